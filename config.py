"""Configuration: one frozen, documented dataclass per concern, composed into `Config`.

Every field is overridable from the command line (`--section.field=value` or
`--section.field value`) and from a TOML file (`--config FILE.toml`, same dotted keys as
tables). Precedence: command line > file > defaults. Everything is validated here, before any
process group exists, so a typo costs seconds instead of a queued multi-node job.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import signal
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad key, type or value in the configuration; the message says which and how to fix it."""


def doc(text: str) -> dict[str, str]:
    """Field metadata holding the one-line documentation shown by `--help`."""
    return {"doc": text}


def _require(ok: bool, name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"invalid value for {name}: {value!r} ({fix})")


@dataclass(frozen=True)
class RunConfig:
    dir: str = field(
        default="runs/default",
        metadata=doc(
            "output directory of the run: config.json, metrics.jsonl, tensorboard/, checkpoints/"
        ),
    )

    preempt_signals: tuple[str, ...] = field(
        default=("SIGTERM", "SIGUSR2", "SIGINT"),
        metadata=doc(
            "signals that make every rank checkpoint at the next step boundary and exit with "
            "code 75, however often and to whichever processes they are sent (torchrun "
            "forwards SIGTERM to its workers; SIGINT is Ctrl-C)"
        ),
    )
    lease_timeout_s: float = field(
        default=120.0,
        metadata=doc(
            "one job per run.dir: a lease held by a job whose heartbeat is older than this "
            "(its holder died) is taken over; a live holder's is refused"
        ),
    )
    max_attempts_without_progress: int = field(
        default=3,
        metadata=doc(
            "attempts (torchrun restarts, requeues) that may start from the same checkpoint "
            "before the run exits 76, 'no progress: do not restart'; 0 = never"
        ),
    )

    def __post_init__(self) -> None:
        _require(bool(self.dir.strip()), "run.dir", self.dir, "give a directory path")
        object.__setattr__(self, "dir", os.path.expanduser(self.dir))  # ~ = home, not ./~
        for name in self.preempt_signals:
            _require(
                name in signal.Signals.__members__ and name not in ("SIGKILL", "SIGSTOP"),
                "run.preempt_signals",
                name,
                "use signal names such as SIGTERM,SIGUSR2 (SIGKILL and SIGSTOP cannot be caught)",
            )
        _require(
            math.isfinite(self.lease_timeout_s) and self.lease_timeout_s >= 5,
            "run.lease_timeout_s",
            self.lease_timeout_s,
            "give at least 5 seconds (the heartbeat comes every quarter of it)",
        )
        _require(
            self.max_attempts_without_progress >= 0,
            "run.max_attempts_without_progress",
            self.max_attempts_without_progress,
            "give 0 (off) or a positive count",
        )


@dataclass(frozen=True)
class DataConfig:
    dataset: Literal["fashion_mnist", "cifar10", "imagefolder", "synthetic"] = field(
        default="fashion_mnist", metadata=doc("which dataset to train and evaluate on")
    )
    root: str = field(
        default="data",
        metadata=doc(
            "dataset directory: download target for torchvision datasets, or for imagefolder the "
            "folder holding train/<class>/* and val/<class>/*"
        ),
    )
    download: bool = field(
        default=True,
        metadata=doc(
            "let torchvision download fashion_mnist/cifar10 into data.root when missing "
            "(Debian's /usr/share/datasets/fashion-mnist is used first when present)"
        ),
    )
    subset: int = field(
        default=0,
        metadata=doc(
            "train on the first N samples of a seeded shuffle of the training set; 0 = all"
        ),
    )
    batch_size: int = field(
        default=128,
        metadata=doc(
            "samples per rank per micro-step; global batch = batch_size x world size x "
            "train.grad_accum_steps"
        ),
    )
    global_batch_size: int = field(
        default=0,
        metadata=doc(
            "samples per optimizer step over all ranks and micro-steps; when set, batch_size is "
            "derived from it (it must divide by world size x train.grad_accum_steps), so the "
            "training math stays the same on any number of ranks; 0 = use batch_size"
        ),
    )
    eval_batch_size: int = field(default=512, metadata=doc("samples per rank per eval forward"))
    num_workers: int = field(
        default=2,
        metadata=doc("DataLoader worker processes per rank; 0 loads in the training process"),
    )
    loader: Literal["auto", "device", "dataloader"] = field(
        default="auto",
        metadata=doc(
            "training data path: device = the whole uint8 training set on the device, batches "
            "gathered and augmented there (same order, shards and augmentation as the "
            "DataLoader); dataloader = torch DataLoader with data.num_workers; auto = device for "
            "in-memory datasets that fit (under a quarter of free GPU memory), else dataloader"
        ),
    )
    prefetch_factor: int = field(
        default=4, metadata=doc("batches each worker prepares ahead (ignored when num_workers = 0)")
    )
    augment: bool = field(
        default=True,
        metadata=doc(
            "random crop (zero padding data.crop_padding) and horizontal flip on training samples"
        ),
    )
    crop_padding: int = field(default=2, metadata=doc("pixels of zero padding for random crop"))
    image_size: int = field(
        default=32,
        metadata=doc("imagefolder only: images are resized to image_size x image_size pixels"),
    )
    prepare_timeout_s: float = field(
        default=3600.0,
        metadata=doc(
            "seconds the other ranks wait (logging progress) for local rank 0 of each node to "
            "download or prepare the dataset, instead of dist.timeout_s; then the job fails "
            "naming the dataset and the preparing rank"
        ),
    )
    synthetic_train_size: int = field(
        default=8192, metadata=doc("synthetic only: number of training samples")
    )
    synthetic_eval_size: int = field(
        default=2048, metadata=doc("synthetic only: number of evaluation samples")
    )
    synthetic_shape: tuple[int, ...] = field(
        default=(1, 28, 28), metadata=doc("synthetic only: sample shape as channels,height,width")
    )
    synthetic_num_classes: int = field(
        default=10, metadata=doc("synthetic only: number of classes")
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", os.path.expanduser(self.root))  # ~ = home, not ./~
        _require(self.subset >= 0, "data.subset", self.subset, "use 0 for all or a positive count")
        _require(
            self.global_batch_size >= 0,
            "data.global_batch_size",
            self.global_batch_size,
            "use 0 to set data.batch_size per rank, or a positive count",
        )
        _require(self.batch_size >= 1, "data.batch_size", self.batch_size, "must be >= 1")
        _require(
            self.eval_batch_size >= 1, "data.eval_batch_size", self.eval_batch_size, "must be >= 1"
        )
        _require(self.num_workers >= 0, "data.num_workers", self.num_workers, "must be >= 0")
        _require(
            self.prefetch_factor >= 1, "data.prefetch_factor", self.prefetch_factor, "must be >= 1"
        )
        _require(self.crop_padding >= 0, "data.crop_padding", self.crop_padding, "must be >= 0")
        _require(self.image_size >= 8, "data.image_size", self.image_size, "must be >= 8")
        _require(
            math.isfinite(self.prepare_timeout_s) and self.prepare_timeout_s > 0,
            "data.prepare_timeout_s",
            self.prepare_timeout_s,
            "must be a number of seconds > 0",
        )
        _require(
            self.synthetic_train_size >= 1,
            "data.synthetic_train_size",
            self.synthetic_train_size,
            "must be >= 1",
        )
        _require(
            self.synthetic_eval_size >= 1,
            "data.synthetic_eval_size",
            self.synthetic_eval_size,
            "must be >= 1",
        )
        _require(
            len(self.synthetic_shape) == 3
            and min(self.synthetic_shape) >= 1
            and self.synthetic_shape[1] >= 8
            and self.synthetic_shape[2] >= 8,
            "data.synthetic_shape",
            self.synthetic_shape,
            "give channels,height,width with height and width >= 8",
        )
        _require(
            self.synthetic_num_classes >= 2,
            "data.synthetic_num_classes",
            self.synthetic_num_classes,
            "must be >= 2",
        )


@dataclass(frozen=True)
class ModelConfig:
    widths: tuple[int, ...] = field(
        default=(16, 32, 64),
        metadata=doc(
            "channels of each residual stage; each stage after the first halves the resolution"
        ),
    )
    blocks_per_stage: int = field(default=1, metadata=doc("BasicBlocks in each stage"))
    norm: Literal["batch", "syncbatch", "group", "none"] = field(
        default="batch",
        metadata=doc(
            "normalisation: batch (per-rank statistics), syncbatch (statistics across ranks), "
            "group (per sample: shard- and micro-batch-invariant), none"
        ),
    )
    channels_last: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata=doc(
            "store weights and activations in channels_last memory format; auto = on for CUDA "
            "(tensor cores read NHWC) and CPU (oneDNN's convolutions do too)"
        ),
    )
    dropout: float = field(
        default=0.0,
        metadata=doc("dropout probability before the classifier, in [0, 1); 0 = no dropout"),
    )

    def __post_init__(self) -> None:
        _require(
            len(self.widths) >= 1 and min(self.widths) >= 1,
            "model.widths",
            self.widths,
            "give positive channel counts such as 16,32,64",
        )
        _require(
            self.norm != "group" or all(w % min(8, w) == 0 for w in self.widths),
            "model.widths",
            self.widths,
            "with model.norm=group widths must be multiples of 8",
        )
        _require(
            self.blocks_per_stage >= 1,
            "model.blocks_per_stage",
            self.blocks_per_stage,
            "must be >= 1",
        )
        _require(
            math.isfinite(self.dropout) and 0 <= self.dropout < 1,
            "model.dropout",
            self.dropout,
            "must be in [0, 1)",
        )


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["sgd", "adamw"] = field(
        default="sgd", metadata=doc("optimizer: sgd (momentum, Nesterov) or adamw")
    )
    lr: float = field(
        default=0.2,
        metadata=doc(
            "peak learning rate, reached after warmup; tuned for the default global batch of 256, "
            "scale it linearly when you change the global batch"
        ),
    )
    momentum: float = field(default=0.9, metadata=doc("SGD momentum"))
    impl: Literal["auto", "fused", "foreach", "loop"] = field(
        default="auto",
        metadata=doc(
            "optimizer kernels: fused (one kernel, CUDA), foreach (one kernel per op over all "
            "tensors), loop (per tensor); auto = fused on CUDA, foreach otherwise"
        ),
    )
    nesterov: bool = field(default=True, metadata=doc("SGD Nesterov momentum"))
    betas: tuple[float, ...] = field(default=(0.9, 0.999), metadata=doc("AdamW betas"))
    weight_decay: float = field(
        default=5e-4,
        metadata=doc(
            "decoupled (AdamW) or L2 (SGD) weight decay of conv/linear weights (not norms, biases)"
        ),
    )
    warmup_steps: int = field(
        default=100, metadata=doc("optimizer steps of linear warmup from 0 to optim.lr")
    )
    min_lr_ratio: float = field(
        default=0.0, metadata=doc("cosine decay ends at optim.lr x min_lr_ratio on the last step")
    )
    grad_clip: float = field(
        default=5.0,
        metadata=doc("max global L2 norm of gradients (after unscaling); 0 = no clipping"),
    )
    label_smoothing: float = field(
        default=0.1, metadata=doc("cross-entropy label smoothing in [0, 1)")
    )

    def __post_init__(self) -> None:
        _require(
            math.isfinite(self.lr) and self.lr > 0,
            "optim.lr",
            self.lr,
            "must be a finite number > 0",
        )
        _require(0 <= self.momentum < 1, "optim.momentum", self.momentum, "must be in [0, 1)")
        _require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optim.betas",
            self.betas,
            "give two numbers in [0, 1) such as 0.9,0.999",
        )
        _require(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "optim.weight_decay",
            self.weight_decay,
            "must be >= 0",
        )
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(
            0 <= self.min_lr_ratio <= 1,
            "optim.min_lr_ratio",
            self.min_lr_ratio,
            "must be in [0, 1]",
        )
        _require(
            math.isfinite(self.grad_clip) and self.grad_clip >= 0,
            "optim.grad_clip",
            self.grad_clip,
            "must be >= 0 (0 disables clipping)",
        )
        _require(
            0 <= self.label_smoothing < 1,
            "optim.label_smoothing",
            self.label_smoothing,
            "must be in [0, 1)",
        )


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = field(default=10, metadata=doc("passes over the training set"))
    max_steps: int = field(
        default=0, metadata=doc("stop after this many optimizer steps in total; 0 = no limit")
    )
    grad_accum_steps: int = field(
        default=1,
        metadata=doc("micro-steps per optimizer step; only the last one all-reduces gradients"),
    )
    amp: Literal["auto", "none", "bf16", "fp16"] = field(
        default="auto",
        metadata=doc(
            "autocast precision: auto = bf16 on CUDA devices that support it, none on CPU; "
            "fp16 adds a GradScaler"
        ),
    )
    seed: int = field(
        default=0,
        metadata=doc("seed of model init, data order and augmentation (same on every rank)"),
    )
    compile: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata=doc("wrap the model in torch.compile; auto = on CUDA, off on CPU"),
    )
    cuda_fast_math: bool = field(
        default=True,
        metadata=doc("on CUDA: cudnn.benchmark and TF32 matmuls/convolutions for fp32 work"),
    )
    max_nonfinite_steps: int = field(
        default=5,
        metadata=doc(
            "consecutive optimizer steps with a non-finite loss or gradient (each skipped on "
            "every rank) after which the run stops with exit code 3"
        ),
    )

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, "train.epochs", self.epochs, "must be >= 1")
        _require(
            self.max_nonfinite_steps >= 1,
            "train.max_nonfinite_steps",
            self.max_nonfinite_steps,
            "must be >= 1",
        )
        _require(
            self.max_steps >= 0,
            "train.max_steps",
            self.max_steps,
            "use 0 for no limit or a positive count",
        )
        _require(
            self.grad_accum_steps >= 1,
            "train.grad_accum_steps",
            self.grad_accum_steps,
            "must be >= 1",
        )
        _require(self.seed >= 0, "train.seed", self.seed, "must be >= 0")


@dataclass(frozen=True)
class CkptConfig:
    every_steps: int = field(
        default=0,
        metadata=doc("also checkpoint every N optimizer steps; 0 = only at the end of each epoch"),
    )
    keep: int = field(
        default=2,
        metadata=doc("newest checkpoints to keep (the best one by eval accuracy is kept as well)"),
    )
    async_save: bool = field(
        default=False,
        metadata=doc(
            "write checkpoints in a background thread; training waits only for the copy to "
            "host memory (the last and the preemption checkpoint are always waited for)"
        ),
    )
    resume: str = field(
        default="auto",
        metadata=doc(
            "auto = newest valid checkpoint in run.dir/checkpoints if any, never = start fresh, "
            "a path to a checkpoint file, or a directory (a run dir or its checkpoints/ folder) "
            "whose newest valid checkpoint is taken"
        ),
    )

    def __post_init__(self) -> None:
        _require(
            self.every_steps >= 0,
            "ckpt.every_steps",
            self.every_steps,
            "use 0 to checkpoint only at epoch ends",
        )
        _require(self.keep >= 1, "ckpt.keep", self.keep, "must be >= 1")
        _require(
            bool(self.resume.strip()),
            "ckpt.resume",
            self.resume,
            "use auto, never or a checkpoint path",
        )
        object.__setattr__(self, "resume", os.path.expanduser(self.resume))  # ~ = home


@dataclass(frozen=True)
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = field(
        default="auto",
        metadata=doc("process-group backend: auto = nccl when CUDA is available, gloo otherwise"),
    )
    timeout_s: float = field(
        default=300.0,
        metadata=doc("seconds a collective may wait for the slowest rank before the job fails"),
    )
    preflight: bool = field(
        default=True,
        metadata=doc(
            "before step 0, check that all ranks run the same versions, device type, dataset "
            "and config (one all-gather)"
        ),
    )
    bucket_cap_mb: float = field(
        default=25.0,
        metadata=doc("DDP gradient bucket size in MiB: larger = fewer all-reduces, later start"),
    )
    gradient_as_bucket_view: bool = field(
        default=True,
        metadata=doc("DDP: gradients are views into the all-reduce buckets (no copy, less memory)"),
    )
    static_graph: bool = field(
        default=False,
        metadata=doc(
            "DDP static_graph: the same parameters are used every step (enables overlap "
            "optimisations; wrong for models with conditional branches)"
        ),
    )
    grad_compression: Literal["none", "fp16", "bf16"] = field(
        default="none",
        metadata=doc(
            "DDP communication hook: all-reduce gradients in 16 bits (half the bytes on the "
            "wire; slightly different numerics)"
        ),
    )
    preflight_bandwidth: bool = field(
        default=False,
        metadata=doc("before step 0, time all-reduces of 1, 16 and 64 MB and log bus bandwidth"),
    )

    def __post_init__(self) -> None:
        _require(
            math.isfinite(self.timeout_s) and self.timeout_s > 0,
            "dist.timeout_s",
            self.timeout_s,
            "must be a number of seconds > 0",
        )
        _require(
            math.isfinite(self.bucket_cap_mb) and self.bucket_cap_mb > 0,
            "dist.bucket_cap_mb",
            self.bucket_cap_mb,
            "must be a size in MiB > 0",
        )


@dataclass(frozen=True)
class LogConfig:
    every_steps: int = field(
        default=50,
        metadata=doc("optimizer steps between train rows in metrics.jsonl and TensorBoard"),
    )
    tensorboard: bool = field(default=True, metadata=doc("write run.dir/tensorboard events"))
    progress: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata=doc("progress bar on rank 0: auto = only when stderr is a terminal"),
    )
    straggler_every_steps: int = field(
        default=500,
        metadata=doc(
            "every N optimizer steps log each rank's step time and arrival at the gradient "
            "all-reduce (min/median/max, the slowest rank named); 0 = off"
        ),
    )
    profile_steps: tuple[int, ...] = field(
        default=(),
        metadata=doc(
            "START,END: record optimizer steps START..END-1 with torch.profiler into "
            "run.dir/tensorboard/profile (TensorBoard's profiler tab); empty = off"
        ),
    )
    mfu: bool = field(
        default=True,
        metadata=doc(
            "count the model's FLOPs (torch.utils.flop_counter) and time a matmul at start-up to "
            "log achieved TFLOP/s and model FLOP utilisation"
        ),
    )

    def __post_init__(self) -> None:
        _require(self.every_steps >= 1, "log.every_steps", self.every_steps, "must be >= 1")
        _require(
            self.straggler_every_steps >= 0,
            "log.straggler_every_steps",
            self.straggler_every_steps,
            "use 0 for off or a positive count",
        )
        _require(
            not self.profile_steps
            or (
                len(self.profile_steps) == 2 and 0 <= self.profile_steps[0] < self.profile_steps[1]
            ),
            "log.profile_steps",
            ",".join(map(str, self.profile_steps)),
            "give START,END with 0 <= START < END",
        )


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if self.dist.static_graph and self.train.grad_accum_steps > 1:
            raise ConfigError(
                f"dist.static_graph=true cannot be combined with train.grad_accum_steps="
                f"{self.train.grad_accum_steps}: DDP's static graph does not support the no_sync "
                "micro-steps of gradient accumulation (it fails inside backward)"
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def fingerprint(self) -> str:
        """Short hash of the resolved configuration, for logs and checkpoint compatibility."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:12]


def for_world_size(cfg: Config, world_size: int) -> Config:
    """`cfg` with data.batch_size derived from data.global_batch_size, when that is set."""
    total = cfg.data.global_batch_size
    if total == 0:
        return cfg
    per_step = world_size * cfg.train.grad_accum_steps
    if total % per_step:
        raise ConfigError(
            f"data.global_batch_size={total} does not divide by world size {world_size} x "
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} = {per_step}: choose a "
            "multiple of it, or set data.batch_size per rank instead"
        )
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, batch_size=total // per_step)
    )


def global_batch_size(cfg: Config, world_size: int) -> int:
    """Samples that contribute to one optimizer step, over all ranks and micro-steps."""
    return cfg.data.batch_size * world_size * cfg.train.grad_accum_steps


# ---------------------------------------------------------------------------------------------
# Parsing: dotted keys -> typed values -> validated frozen dataclasses.


def field_types() -> dict[str, Any]:
    """Every dotted key (`section.field`) mapped to its annotated type."""
    out: dict[str, Any] = {}
    for section, section_cls in typing.get_type_hints(Config).items():
        for name, annotation in typing.get_type_hints(section_cls).items():
            out[f"{section}.{name}"] = annotation
    return out


def _coerce(key: str, annotation: Any, raw: Any) -> Any:
    """Convert a CLI string or TOML value to the annotated type, or raise naming the key."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if raw in choices:
            return raw
        raise ConfigError(f"invalid value for {key}: {raw!r} (choose one of {', '.join(choices)})")
    if origin is tuple:
        (item_type, _) = typing.get_args(annotation)
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list | tuple):
            raise ConfigError(f"invalid value for {key}: {raw!r} (expected a comma-separated list)")
        try:
            return tuple(
                _coerce(key, item_type, item.strip() if isinstance(item, str) else item)
                for item in items
                if not (isinstance(item, str) and not item.strip())
            )
        except ConfigError:
            raise ConfigError(
                f"invalid value for {key}: {raw!r} (expected a comma-separated list "
                f"of {item_type.__name__})"
            ) from None
    if annotation is bool:
        if isinstance(raw, bool):
            return raw
        lowered = str(raw).strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"invalid value for {key}: {raw!r} (expected true or false)")
    if annotation is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ConfigError(f"invalid value for {key}: {raw!r} (expected an integer)")
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"invalid value for {key}: {raw!r} (expected an integer)") from None
    if annotation is float:
        if isinstance(raw, bool):
            raise ConfigError(f"invalid value for {key}: {raw!r} (expected a number)")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"invalid value for {key}: {raw!r} (expected a number)") from None
    if annotation is str:
        if isinstance(raw, str):
            return raw
        raise ConfigError(f"invalid value for {key}: {raw!r} (expected a string)")
    raise TypeError(f"config field {key} has an unsupported annotation {annotation!r}")


def _check_key(key: str, types_by_key: dict[str, Any], source: str) -> None:
    if key in types_by_key:
        return
    guess = difflib.get_close_matches(key, list(types_by_key), n=1, cutoff=0.5)
    hint = f"; did you mean {guess[0]}?" if guess else "; see python train.py --help"
    raise ConfigError(f"unknown config key {key!r} in {source}{hint}")


def _flatten_toml(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in table.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            flat.update(_flatten_toml(value, key + "."))
        else:
            flat[key] = value
    return flat


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file into dotted keys (`[train] epochs = 3` and `"train.epochs" = 3` alike)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return _flatten_toml(tomllib.load(f))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err}") from None


def split_argv(argv: list[str]) -> tuple[str | None, dict[str, str]]:
    """Split `--config FILE` and `--key=value` / `--key value` pairs out of argv."""
    config_file: str | None = None
    overrides: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides look like --section.field=value"
            )
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, value = body, argv[i + 1]
            i += 1
        else:
            raise ConfigError(f"missing value for {arg!r}: write {arg}=VALUE")
        if key == "config":
            config_file = value
        else:
            overrides[key] = value
        i += 1
    return config_file, overrides


def build_config(file_values: dict[str, Any], cli_values: dict[str, str]) -> Config:
    """Merge defaults < file < CLI into a validated `Config`."""
    types_by_key = field_types()
    for key in file_values:
        _check_key(key, types_by_key, "the config file")
    for key in cli_values:
        _check_key(key, types_by_key, "the command line")
    merged = {**file_values, **cli_values}
    sections: dict[str, dict[str, Any]] = {}
    for key, raw in merged.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = _coerce(key, types_by_key[key], raw)
    hints = typing.get_type_hints(Config)
    return Config(**{name: hints[name](**sections.get(name, {})) for name in hints})


def format_help() -> str:
    lines = [
        "usage: python train.py [--config FILE.toml] [--section.field=VALUE ...]",
        "       torchrun --nproc_per_node=N train.py [overrides]",
        "",
        "Precedence: command line > --config file > defaults. Keys:",
    ]
    defaults = Config()
    for section, section_cls in typing.get_type_hints(Config).items():
        lines.append(f"\n[{section}]")
        for f in dataclasses.fields(section_cls):
            default = getattr(getattr(defaults, section), f.name)
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            choices = typing.get_args(typing.get_type_hints(section_cls)[f.name])
            kind = "|".join(choices) if choices and all(isinstance(c, str) for c in choices) else ""
            lines.append(
                f"  --{section}.{f.name} (default: {shown}){'  {' + kind + '}' if kind else ''}"
            )
            lines.append(f"      {f.metadata['doc']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse argv into a validated Config; prints help and exits on --help / -h."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(format_help())
        raise SystemExit(0)
    config_file, cli_values = split_argv(argv)
    file_values = load_toml(config_file) if config_file else {}
    return build_config(file_values, cli_values)
