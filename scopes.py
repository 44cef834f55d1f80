"""Settings that only some runs use: given where the run ignores them, they are refused
before any process group (`check_given`: `--data.image_size` beside a dataset that is no image
folder), said at start when another source's choice replaces them (`replaced`: a recipe file's
`data.batch_size` under the command line's `data.global_batch_size`), or said when this
process's placement makes them a no-op (`ignored_here`: DDP's knobs at world size 1).
"Given" means given explicitly (cli.py collects what the command line and files give), not
merely different from the default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from config import MINI_RESNET, SHARDED_STRATEGIES, Config, ConfigError, DataConfig


@dataclass(frozen=True)
class _Scope:
    """Fields that only some runs use: `keys` do something only where `applies(cfg)` (which
    `users` describes); `chosen(cfg)` names what this run chose instead."""

    keys: tuple[str, ...]
    users: str
    applies: Callable[[Config], bool]
    chosen: Callable[[Config], str]
    # The key whose value made the choice, where a later source may override an earlier one:
    # refused only when both come from one source; otherwise the earlier value is said to be
    # replaced (`notices`), as a command line over a recipe file does (configs/*.toml).
    chooser: str | None = None


def _data(cfg: Config) -> str:
    return cfg.data.source


def _dataset_is(*names: str) -> Callable[[Config], bool]:
    return lambda cfg: cfg.data.source in {f"data.dataset={name}" for name in names}


def _loss(cfg: Config) -> str:
    return f"loss.factory={cfg.loss.factory}" if cfg.loss.factory else f"loss.name={cfg.loss.name}"


_WEIGHTED = ("loss.name=cross_entropy", "loss.name=focal", "loss.name=bce")
_TORCHVISION_DATASETS = ("fashion_mnist", "cifar10")
_SCOPES = (
    _Scope(("data.dataset",), "a run without data.factory", lambda c: not c.data.factory, _data),
    _Scope(
        ("model.name",),
        "a run without model.factory",
        lambda c: not c.model.factory,
        lambda c: c.model.source,
    ),
    _Scope(
        ("data.image_size", "data.crop_ratio", "data.crop_scale", "data.decode")
        + ("data.eval_crop_size", "data.eval_resize_size"),
        "data.dataset=imagefolder",
        _dataset_is("imagefolder"),
        _data,
    ),
    _Scope(  # predict reads image files whatever the data (modes/predict.py)
        ("data.bad_images",),
        "data.dataset=imagefolder and run.mode=predict",
        lambda c: _dataset_is("imagefolder")(c) or c.run.mode == "predict",
        _data,
    ),
    _Scope(
        ("run.output",),
        "run.mode=evaluate, predict and export",
        lambda c: c.run.mode != "train",
        lambda c: f"run.mode={c.run.mode}",
    ),
    _Scope(  # an image folder crops with RandomResizedCrop (data.crop_scale) instead
        ("data.crop_padding",),
        "datasets other than imagefolder",
        lambda c: not _dataset_is("imagefolder")(c),
        _data,
    ),
    _Scope(
        tuple(
            f"data.{f.name}"
            for f in dataclasses.fields(DataConfig)
            if f.name.startswith("synthetic_")
        ),
        "data.dataset=synthetic",
        _dataset_is("synthetic"),
        _data,
    ),
    _Scope(
        ("data.download",),
        " and ".join(f"data.dataset={name}" for name in _TORCHVISION_DATASETS),
        _dataset_is(*_TORCHVISION_DATASETS),
        _data,
    ),
    _Scope(
        (
            "dist.bucket_cap_mb",
            "dist.gradient_as_bucket_view",
            "dist.static_graph",
            "dist.find_unused_parameters",
            "dist.grad_compression",
        ),
        "dist.strategy=ddp and zero (DistributedDataParallel)",
        lambda c: c.dist.strategy in ("ddp", "zero"),
        lambda c: f"dist.strategy={c.dist.strategy}",
    ),
    _Scope(
        ("dist.fsdp_units", "dist.reshard_after_forward"),
        "dist.strategy=fsdp and hybrid",
        lambda c: c.dist.strategy in SHARDED_STRATEGIES,
        lambda c: f"dist.strategy={c.dist.strategy}",
    ),
    _Scope(
        ("data.batch_size",),
        "runs without data.global_batch_size (which derives data.batch_size)",
        lambda c: c.data.global_batch_size == 0,
        lambda c: f"data.global_batch_size={c.data.global_batch_size}",
        "data.global_batch_size",
    ),
    _Scope(
        ("data.prefetch_factor",),
        "DataLoader worker processes (data.num_workers > 0)",
        lambda c: c.data.num_workers > 0,
        lambda c: f"data.num_workers={c.data.num_workers}",
        "data.num_workers",
    ),
    _Scope(
        ("optim.betas",),
        "optim.name=adamw",
        lambda c: c.optim.name == "adamw",
        lambda c: f"optim.name={c.optim.name}",
    ),
    _Scope(
        ("optim.momentum", "optim.nesterov"),
        "optim.name=sgd",
        lambda c: c.optim.name == "sgd",
        lambda c: f"optim.name={c.optim.name}",
    ),
    _Scope(("loss.gamma",), "loss.name=focal", lambda c: _loss(c) == "loss.name=focal", _loss),
    _Scope(
        ("loss.class_weights",),
        "loss.name=cross_entropy, focal and bce",
        lambda c: _loss(c) in _WEIGHTED,
        _loss,
    ),
    _Scope(  # a recipe file's smoothing beside a command line's loss is said, not refused
        ("optim.label_smoothing",),
        "loss.name=cross_entropy and focal",
        lambda c: _loss(c) in _WEIGHTED[:2],
        _loss,
        "loss.name",
    ),
    _Scope(("loss.kwargs",), "loss.factory", lambda c: bool(c.loss.factory), _loss),
    _Scope(
        ("metrics.kwargs",),
        "metrics.factory",
        lambda c: bool(c.metrics.factory),
        lambda c: "no metrics.factory",
    ),
    _Scope(("loss.name",), "a run without loss.factory", lambda c: not c.loss.factory, _loss),
    _Scope(
        ("aug.ra_magnitude",),
        "aug.auto_augment=ra",
        lambda c: c.aug.auto_augment == "ra",
        lambda c: f"aug.auto_augment={c.aug.auto_augment}",
    ),
    _Scope(
        ("aug.augmix_severity",),
        "aug.auto_augment=augmix",
        lambda c: c.aug.auto_augment == "augmix",
        lambda c: f"aug.auto_augment={c.aug.auto_augment}",
    ),
    _Scope(
        ("optim.param_groups_kwargs",),
        "runs with optim.param_groups",
        lambda c: bool(c.optim.param_groups),
        lambda c: "no optim.param_groups",
    ),
    _Scope(
        ("optim.min_lr_ratio",),
        "optim.schedule=cosine",
        lambda c: c.optim.schedule == "cosine",
        lambda c: f"optim.schedule={c.optim.schedule}",
    ),
    _Scope(
        ("optim.step_epochs",),
        "optim.schedule=step",
        lambda c: c.optim.schedule == "step",
        lambda c: f"optim.schedule={c.optim.schedule}",
    ),
    _Scope(
        ("optim.gamma",),
        "optim.schedule=step and exponential",
        lambda c: c.optim.schedule in ("step", "exponential"),
        lambda c: f"optim.schedule={c.optim.schedule}",
    ),
    _Scope(
        ("optim.warmup_steps",),
        "runs without optim.warmup_epochs (which sets the warm-up in epochs)",
        lambda c: c.optim.warmup_epochs == 0,
        lambda c: f"optim.warmup_epochs={c.optim.warmup_epochs}",
        "optim.warmup_epochs",
    ),
    _Scope(
        ("train.ema_every_steps", "train.ema_adjust", "train.ema_warmup_reset"),
        "runs with a weight average (train.ema_decay > 0)",
        lambda c: c.train.ema_decay > 0,
        lambda c: f"train.ema_decay={c.train.ema_decay}",
    ),
    _Scope(
        ("model.widths", "model.blocks_per_stage", "model.stem_stride", "model.dropout"),
        f"model.name={MINI_RESNET}",
        lambda c: c.model.source == f"model.name={MINI_RESNET}",
        lambda c: c.model.source,
    ),
)


def check_given(cfg: Config, given: dict[str, str], origin: dict[str, str]) -> None:
    """Refuse each setting given explicitly (`given`: key -> value as typed) that this run
    would accept and then ignore, naming it, where it came from and what ignores it. Given
    explicitly, not merely different from its default: `--model.name=mini_resnet` beside
    model.factory is ignored just the same."""
    problems = []
    for scope in _SCOPES:
        ignored = [key for key in scope.keys if key in given]
        ignored = [key for key in ignored if not _across_sources(scope, key, origin)]
        if not ignored or scope.applies(cfg):
            continue
        settings = ", ".join(
            f"{origin[key] + ': ' if key in origin else ''}{key}={given[key]}" for key in ignored
        )
        verb, fix = ("is", "remove one of the two") if len(ignored) == 1 else ("are", "remove them")
        problems.append(
            f"{settings} {verb} for {scope.users} only, and this run has {scope.chosen(cfg)}: {fix}"
        )
    if problems:
        raise ConfigError("; ".join(problems))


# Settings that do nothing where a run happens to land (one process; a CPU): the same config
# file may serve runs at every scale, so these are said at start rather than refused.
_DDP_KNOBS = ("dist.bucket_cap_mb", "dist.gradient_as_bucket_view", "dist.static_graph")
_DDP_KNOBS += ("dist.find_unused_parameters",)
_WHERE_IGNORED = (
    (_DDP_KNOBS + ("dist.grad_compression",), "at world size 1 (no DistributedDataParallel)"),
    (("train.cuda_fast_math",), "on a CPU (cuDNN and TF32 are CUDA's)"),
)


def ignored_here(given: dict[str, str], world_size: int, device_type: str) -> list[str]:
    """One line per explicitly given setting that this process's placement makes a no-op."""
    lines = []
    for keys, where in _WHERE_IGNORED:
        applies = world_size == 1 if keys[0].startswith("dist.") else device_type == "cpu"
        named = [f"{key}={given[key]}" for key in keys if key in given]
        if applies and named:
            lines.append(
                f"{', '.join(named)} {'has' if len(named) == 1 else 'have'} no effect "
                f"{where}: ignored"
            )
    return lines


def _across_sources(scope: _Scope, key: str, origin: dict[str, str]) -> bool:
    """Whether `key` and the scope's chooser come from different sources (origin: key -> the
    file it came from; a key the command line gave has none)."""
    return scope.chooser is not None and origin.get(key) != origin.get(scope.chooser)


def replaced(cfg: Config, given: dict[str, str], origin: dict[str, str]) -> list[str]:
    """One line per setting of one source that another source's choice makes a no-op (a
    recipe file's data.batch_size under the command line's data.global_batch_size)."""
    lines = []
    for scope in _SCOPES:
        for key in scope.keys:
            if key in given and _across_sources(scope, key, origin) and not scope.applies(cfg):
                where = f"{origin[key]}: " if key in origin else ""
                lines.append(
                    f"{where}{key}={given[key]} has no effect: this run has {scope.chosen(cfg)}"
                )
    return lines
