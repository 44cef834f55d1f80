"""The network: MiniResNet (a small residual network for 28x28 and 32x32 images), any
torchvision classification builder by name, or the user's own factory; and initial weights
from a local file (read by weightfiles.py, fitted here). Nothing here knows of DDP.
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import re
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

import sharding
import weightfiles
from config import MINI_RESNET, ConfigError, ModelConfig, load_factory

log = logging.getLogger(__name__)
UNUSED_SETTING = "--dist.find_unused_parameters=true"

Norm = Literal["batch", "syncbatch", "group", "none"]


def make_norm(kind: Norm, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "syncbatch":
        # Converted to SyncBatchNorm by nn.SyncBatchNorm.convert_sync_batchnorm when wrapped in
        # DDP; plain BatchNorm in a single process (SyncBatchNorm needs a process group).
        return nn.BatchNorm2d(channels)
    if kind == "group":
        # Per-sample statistics: results do not depend on how a batch is split across ranks
        # or micro-steps, which is what the DDP equivalence tests rely on.
        return nn.GroupNorm(num_groups=min(8, channels), num_channels=channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}: choose batch, syncbatch, group or none")


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al., 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: Norm) -> None:
        super().__init__()
        bias = norm == "none"
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=bias)
        self.norm1 = make_norm(norm, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=bias)
        self.norm2 = make_norm(norm, out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=bias),
                make_norm(norm, out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class MiniResNet(nn.Module):
    """Stem, stages of BasicBlocks with increasing widths, global average pooling, linear head.

    Each stage after the first halves the spatial resolution (and a stem stride of 2 halves it
    before the first), so any input of at least 2 ** (len(widths) - 1) pixels a side (twice that
    with stem stride 2) works (1x28x28 Fashion-MNIST, 3x32x32 CIFAR-10, ...).
    """

    def __init__(
        self,
        *,
        in_channels: int,
        num_classes: int,
        widths: Sequence[int] = (16, 32, 64),
        blocks_per_stage: int = 1,
        norm: Norm = "batch",
        dropout: float = 0.0,
        stem_stride: int = 1,
    ) -> None:
        super().__init__()
        if not widths or min(widths) < 1:
            raise ValueError(f"widths must be positive channel counts, got {tuple(widths)}")
        bias = norm == "none"
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, stem_stride, 1, bias=bias),
            make_norm(norm, widths[0]),
            nn.ReLU(inplace=True),
        )
        blocks: list[nn.Module] = []
        channels = widths[0]
        for stage, width in enumerate(widths):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(channels, width, stride, norm))
                channels = width
        self.stages = nn.Sequential(*blocks)
        # Global average pooling is a mean over the spatial dimensions in forward: its backward
        # is a broadcast, deterministic on CUDA, where AdaptiveAvgPool2d's backward kernel is
        # flagged nondeterministic (train.deterministic).
        # Before the classifier; an Identity when off, so no random number is drawn then.
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.head = nn.Linear(channels, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        # Zero the last norm of each residual branch so every block starts as the identity:
        # trains faster and more stably (Goyal et al., 2017).
        for m in self.modules():
            if isinstance(m, BasicBlock) and isinstance(m.norm2, nn.BatchNorm2d | nn.GroupNorm):
                nn.init.zeros_(m.norm2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(self.dropout(x.mean((2, 3))))


# ---------------------------------------------------------------------------------------------
# Any model: by name or by factory


def names() -> list[str]:
    """Every model.name: mini_resnet, then torchvision's classification builders."""
    from torchvision import models  # imported when used: it is slow to import

    return [MINI_RESNET, *models.list_models(module=models)]


def check(cfg: ModelConfig) -> None:
    """Bad input found before any process group or data: an unknown model.name (with the
    nearest names), a model.factory that cannot be imported."""
    if cfg.factory:
        load_factory("model.factory", cfg.factory)
        return
    if cfg.name == MINI_RESNET:
        return
    available = names()
    if cfg.name not in available:
        nearest = difflib.get_close_matches(cfg.name, available, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(nearest)}? " if nearest else ""
        raise ConfigError(
            f"invalid value for model.name: {cfg.name!r} is not a model here ({hint}"
            "--model.list prints every name; your own model goes in model.factory)"
        )


def build(
    cfg: ModelConfig,
    input_shape: Sequence[int],
    num_classes: int,
    unused_ok: bool = False,
    eval_shape: Sequence[int] = (),
) -> nn.Module:
    """The untrained model for inputs of `input_shape` (C, H, W) and `num_classes` classes, on
    the CPU, checked with one forward pass (a model that cannot take such inputs is bad input,
    said before any training), and one of `eval_shape` where evaluation crops to another size.
    `unused_ok`: dist.find_unused_parameters, under which a parameter without a gradient is
    allowed."""
    check(cfg)
    kwargs: dict[str, Any] = json.loads(cfg.kwargs)
    in_channels = input_shape[0]
    if cfg.factory:
        factory = load_factory("model.factory", cfg.factory)
        _check_call(factory, f"model.factory={cfg.factory}", cfg.kwargs, kwargs, in_channels)
        model = factory(in_channels=in_channels, num_classes=num_classes, **kwargs)
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"model.factory={cfg.factory} returned {type(model).__name__}, not a "
                "torch.nn.Module"
            )
        what = f"model.factory={cfg.factory}"
    elif cfg.name == MINI_RESNET:
        options = {"widths": cfg.widths, "blocks_per_stage": cfg.blocks_per_stage}
        options |= {"norm": cfg.norm, "dropout": cfg.dropout, "stem_stride": cfg.stem_stride}
        shadowed = sorted(set(kwargs) & set(options))
        if shadowed:
            raise ConfigError(
                f"model.kwargs={cfg.kwargs} sets {', '.join(shadowed)}: for mini_resnet set "
                + ", ".join(f"model.{key}" for key in shadowed)
                + " instead (they are checked there)"
            )
        options |= kwargs
        _check_call(MiniResNet, "model.name=mini_resnet", cfg.kwargs, options, in_channels)
        model = MiniResNet(in_channels=in_channels, num_classes=num_classes, **options)
        what = f"model.name={cfg.name}"
    else:
        model = _torchvision(cfg.name, in_channels, num_classes, kwargs)
        what = f"model.name={cfg.name}"
    _check_forward(model, what, input_shape, num_classes)
    if eval_shape and tuple(eval_shape) != tuple(input_shape):
        _check_forward(model, what, eval_shape, num_classes, "data.eval_crop_size")
    _check_training(model, what, input_shape, num_classes, unused_ok)
    return model


def _check_call(
    function: Any, what: str, spelled: str, kwargs: dict[str, Any], in_channels: int
) -> None:
    """ConfigError when `function` cannot be called with in_channels, num_classes and
    `kwargs` (an unknown or missing keyword): said as a setting, not as a TypeError raised
    from inside the model's code, which stays the user's own error."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to check (a builtin): the call will say
        return
    try:
        signature.bind(in_channels=in_channels, num_classes=2, **kwargs)
    except TypeError as err:
        raise ConfigError(f"{what} cannot be called with model.kwargs={spelled}: {err}") from None


def _torchvision(
    name: str, in_channels: int, num_classes: int, kwargs: dict[str, Any]
) -> nn.Module:
    from torchvision import models

    if name in ("googlenet", "inception_v3"):
        # Built without their auxiliary classifiers unless model.kwargs turns them on, as
        # torchvision builds them for its pretrained weights (googlenet() and inception_v3()
        # set aux_logits False and the heads to None after loading). On, their training-mode
        # outputs are namedtuples, which objective.losses weighs with loss.aux_weight.
        kwargs = {"aux_logits": False, **kwargs}
    _check_patch_size(name, kwargs)
    try:  # weights=None: built untrained, nothing is downloaded
        model = models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    except (TypeError, ValueError, AssertionError) as err:
        raise ConfigError(f"model.name={name} with model.kwargs={kwargs}: {err}") from None
    adapt_stem(model, in_channels)
    return model


def _check_patch_size(name: str, kwargs: dict[str, Any]) -> None:
    """A ViT's image_size must be a multiple of its patch size (torchvision's
    VisionTransformer asserts "Input shape indivisible by patch size!", naming neither)."""
    vit = re.fullmatch(r"vit_[a-z]_(\d+)", name)  # vit_b_16: patches of 16x16 pixels
    if vit is None:
        return
    patch, size = int(vit.group(1)), kwargs.get("image_size", 224)  # 224: torchvision's default
    if not isinstance(size, int) or size % patch:
        raise ConfigError(
            f"model.name={name}: model.kwargs image_size={size!r} is not a multiple of its "
            f"patch size {patch}; use a multiple of {patch} equal to the images' height and "
            "width"
        )


def _first_conv(model: nn.Module) -> tuple[str, nn.Conv2d] | None:
    return next(((name, m) for name, m in model.named_modules() if isinstance(m, nn.Conv2d)), None)


def adapt_stem(model: nn.Module, in_channels: int) -> None:
    """Make the first convolution (built for RGB) take `in_channels` channels, its weights
    summed or repeated over the new channels (`fit_stem_weight`) so that the layer's output
    statistics, and any pretrained filters loaded later, keep their meaning."""
    found = _first_conv(model)
    if found is None or found[1].in_channels == in_channels:
        return
    name, old = found
    new = nn.Conv2d(
        in_channels,
        old.out_channels,
        old.kernel_size,  # type: ignore[arg-type]
        old.stride,  # type: ignore[arg-type]
        old.padding,  # type: ignore[arg-type]
        old.dilation,  # type: ignore[arg-type]
        bias=old.bias is not None,
        padding_mode=old.padding_mode,
    )
    with torch.no_grad():
        new.weight.copy_(fit_stem_weight(old.weight, in_channels))
        if old.bias is not None:
            new.bias.copy_(old.bias)  # type: ignore[union-attr]
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attribute, new)


def fit_stem_weight(weight: torch.Tensor, in_channels: int) -> torch.Tensor:
    """A convolution weight (out, c, kh, kw) for `in_channels` inputs: summed over c for one
    channel (a gray image seen as equal R, G and B gives the same output), else its channels
    repeated cyclically and scaled by c / in_channels (the same output for a repeated image)."""
    if in_channels == 1:
        return weight.sum(dim=1, keepdim=True)
    channels = weight.shape[1]
    index = torch.arange(in_channels) % channels
    return weight[:, index] * (channels / in_channels)


def _check_forward(
    model: nn.Module,
    what: str,
    input_shape: Sequence[int],
    num_classes: int,
    size_key: str = "data.image_size",
) -> None:
    """One sample through the model in eval mode (no statistic updated, no random number
    drawn): logits of shape (1, num_classes), or bad input naming the model and the shape."""
    shape = "x".join(map(str, input_shape))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, *input_shape))
    except Exception as err:  # a model's own check (an assert) or a shape mismatch inside it
        raise ConfigError(
            f"{what} cannot take {shape} inputs ({type(err).__name__}: {err}); too small an "
            f"image for it? Choose another model, or larger images ({size_key} for "
            "imagefolder)"
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"{what} returns {got} for a batch of one {shape} input, not logits of shape "
            f"(1, {num_classes})"
        )


def _check_training(
    model: nn.Module, what: str, input_shape: Sequence[int], num_classes: int, unused_ok: bool
) -> None:
    """One training-mode forward and backward of two samples, leaving no trace (buffers, random
    generators and gradients restored): logits of shape (2, num_classes), and a gradient for
    every trainable parameter, or bad input naming the output or the parameters.

    A model may return something else in training mode only (torchvision's googlenet and
    inception_v3 with aux_logits: namedtuples), which the eval-mode check cannot see. And a
    parameter without a gradient makes DistributedDataParallel fail at the first step ("Expected
    to have finished reduction in the prior iteration ..."; torch/nn/parallel/distributed.py)
    unless find_unused_parameters is set (dist.find_unused_parameters, a graph traversal every
    step): refused otherwise at any world size, so that a run does not work on one rank and
    fail on two.
    """
    shape = "x".join(map(str, input_shape))
    was_training = model.training
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.get_rng_state()
    model.train()
    try:
        try:
            out = model(torch.zeros(2, *input_shape))
        except Exception as err:
            raise ConfigError(
                f"{what} fails in training mode on a batch of two {shape} inputs "
                f"({type(err).__name__}: {err})"
            ) from None
        logits = _training_logits(out, num_classes)
        if not logits:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ConfigError(
                f"{what} returns {got} in training mode for a batch of two {shape} inputs, not "
                f"logits of shape (2, {num_classes}), nor a namedtuple of such logits, the "
                "main ones first (auxiliary classifiers): return the logits in training mode "
                "as in evaluation"
            )
        sum(x.float().sum() for x in logits).backward()
        _check_gradients(model, what, unused_ok)
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for p in model.parameters():
            p.grad = None
        torch.set_rng_state(rng)
        model.train(was_training)


def _training_logits(out: Any, num_classes: int) -> list[torch.Tensor]:
    """The logits a training-mode output holds: the tensor, or every tensor of a namedtuple
    with auxiliary logits (googlenet's GoogLeNetOutputs, inception_v3's InceptionOutputs);
    empty when any is not of shape (2, num_classes)."""
    aux = isinstance(out, tuple) and hasattr(out, "_fields")
    found = [x for x in out if x is not None] if aux else [out]
    shaped = all(isinstance(x, torch.Tensor) and x.shape == (2, num_classes) for x in found)
    return found if found and shaped else []


def _check_gradients(model: nn.Module, what: str, unused_ok: bool) -> None:
    """After one backward: every trainable parameter has a gradient, or bad input naming
    those without (said only, under dist.find_unused_parameters)."""
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    listed = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if unused[8:] else "")
    if unused and unused_ok:
        log.info("%s: parameters without a gradient in one step: %s", what, listed)
    elif unused:
        raise ConfigError(
            f"{what} has parameters that get no gradient in training: {listed}. "
            "DistributedDataParallel fails on them at the first step: remove them from the "
            "model, freeze them (requires_grad_(False)), or, if they are used on some steps "
            f"only (LayerDrop), set {UNUSED_SETTING} (ddp and zero)"
        )


# ---------------------------------------------------------------------------------------------
# Initial weights from a file


def _classifier_keys(model: nn.Module) -> set[str]:
    """The state-dict keys of the model's classifier heads: the last Linear or 1x1 convolution
    registered (squeezenet's classifier is `classifier.1`, a 1x1 convolution whose output
    channels are the classes), else the last Linear layer; and every other Linear of that
    head's shape (a distilled DeiT's `head` and `head_dist`, averaged into the logits)."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    linears = [(name, m) for name, m in layers if isinstance(m, nn.Linear)]
    head = layers[-1] if layers else None
    if head and isinstance(head[1], nn.Conv2d) and head[1].kernel_size != (1, 1):
        head = linears[-1] if linears else None  # a body convolution, not a classifier
    if head is None:
        return set()
    heads = [head[0]]
    if isinstance(head[1], nn.Linear):
        shape = head[1].weight.shape
        heads += [name for name, m in linears if name != head[0] and m.weight.shape == shape]
    prefixes = [f"{name}." if name else "" for name in heads]
    return {f"{prefix}{key}" for prefix in prefixes for key in ("weight", "bias")}


def _dropped_heads(model: nn.Module, keys: list[str]) -> list[str]:
    """Keys of submodules the model was built without: attributes it set to None, such as
    googlenet's aux1/aux2 and inception_v3's AuxLogits with aux_logits=False. torchvision's own
    builders drop them the same way after loading their weights (googlenet(), inception_v3())."""
    return [key for key in keys if "." in key and getattr(model, key.split(".")[0], 0) is None]


def _but_channels(shape: torch.Size) -> tuple[int, ...]:
    return (shape[0], *shape[2:])


def load_weights(model: nn.Module, path: str) -> None:
    """Initialise `model` from the state dict in `path` (torch.load with weights_only: a file
    cannot run code). A classifier shaped for another number of classes stays as built; a
    first convolution for another number of input channels is fitted (`fit_stem_weight`).
    Anything else that does not fit is bad input naming the keys."""
    where = f"model.weights={path}"
    state = weightfiles.read_state(path, where)
    own = model.state_dict()
    kept, replaced, misshapen = _fit_to_model(model, own, state)
    missing = [
        key
        for key in own
        if key not in state and not key.endswith("num_batches_tracked")  # older files lack it
    ]
    unexpected = [key for key in state if key not in own]
    dropped = _dropped_heads(model, unexpected)
    unexpected = [key for key in unexpected if key not in dropped]
    for key in dropped:
        del kept[key]
    _raise_unless_fits(where, missing, unexpected, misshapen)
    sharding.load_full_state_dict(model, kept, strict=False)  # each rank its fsdp shard
    _log_loaded(path, kept, replaced, dropped)


def _fit_to_model(
    model: nn.Module, own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(the tensors to load, the classifier keys left as built, the misshapen keys described):
    a tensor of the model's shape is kept, a stem fitted to the model's input channels."""
    classifier = _classifier_keys(model)
    stem = _first_conv(model)
    stem_key = f"{stem[0]}.weight" if stem else None
    kept, replaced, misshapen = {}, [], []
    for key, value in state.items():
        if key not in own or value.shape == own[key].shape:
            kept[key] = value
        elif key in classifier:
            replaced.append(key)
        elif key == stem_key and _but_channels(value.shape) == _but_channels(own[key].shape):
            kept[key] = fit_stem_weight(value, own[key].shape[1])
        else:
            misshapen.append(f"{key} {tuple(value.shape)} (the model's: {tuple(own[key].shape)})")
    return kept, replaced, misshapen


def fit_problems(missing: list[str], unexpected: list[str], misshapen: list[str]) -> list[str]:
    """Each kind of misfit between a state dict and a model, naming its first keys."""
    return [
        f"{label}: {', '.join(keys[:8])}{f' and {len(keys) - 8} more' if len(keys) > 8 else ''}"
        for label, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("misshapen", misshapen),
        )
        if keys
    ]


def _raise_unless_fits(
    where: str, missing: list[str], unexpected: list[str], misshapen: list[str]
) -> None:
    """Bad input naming the first keys of each kind of misfit, if there is any."""
    problems = fit_problems(missing, unexpected, misshapen)
    if problems:
        raise ConfigError(f"{where} does not fit the model: {'; '.join(problems)}")


def _log_loaded(
    path: str, kept: dict[str, torch.Tensor], replaced: list[str], dropped: list[str]
) -> None:
    log.info(
        "initialised the model from %s (%d tensors)%s",
        path,
        len(kept),
        f"; the classifier ({', '.join(sorted(replaced))}) was sized for another number of "
        "classes and starts untrained"
        if replaced
        else "",
    )
    if dropped:
        heads = sorted({key.split(".")[0] for key in dropped})
        log.info(
            "left out %d tensors of %s: the model is built without %s (aux_logits=False)",
            len(dropped),
            path,
            ", ".join(heads),
        )
