"""Configuration: one frozen, documented dataclass per concern, composed into `Config`.

Every field is set from the command line (`--section.field=value` or `--section.field value`)
or TOML files (`--config FILE.toml`, the same dotted keys as tables; several files are merged).
Precedence: command line > files > defaults. Parsing is tyro's (help from the attribute
docstrings below); lists are comma-separated and booleans are true/false. An unknown key is
named with the nearest known one (`nearest_key`), every value is checked in `__post_init__`,
and a setting that this run would ignore is refused (`check_given`), all before any process
group exists, so a typo costs seconds instead of a queued multi-node job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import importlib
import io
import json
import math
import os
import re
import signal
import sys
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

import exitcodes


class ConfigError(ValueError):
    """A bad key, type or value in the configuration; the message says which and how to fix it."""


def finite(x: float) -> float:
    """`x`, or NaN when it is not finite: then every comparison in a check fails."""
    return x if math.isfinite(x) else math.nan


def image_shape(shape: tuple[int, ...]) -> bool:
    return len(shape) == 3 and min(shape) >= 1 and min(shape[1:]) >= 8


FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
FACTORY_FIX = "write package.module:function"
KWARGS_KEYS = ("model.kwargs", "data.kwargs")  # JSON objects, or TOML tables in a file
RESERVED_KWARGS = {"model.kwargs": ("in_channels", "num_classes"), "data.kwargs": ("root",)}


def json_object(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object, or None when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def load_factory(key: str, spec: str) -> Callable[..., Any]:
    """The function `package.module:function` names (config key `key`), imported from the
    current directory or PYTHONPATH; a ConfigError naming the module, function and error."""
    module_name, _, function_name = spec.partition(":")
    if os.getcwd() not in sys.path:  # `python train.py` puts the script's folder there, not .
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or any error the module raises while importing
        raise ConfigError(
            f"{key}={spec}: cannot import module {module_name!r} "
            f"({type(err).__name__}: {err}); it must be importable from the current "
            "directory or PYTHONPATH"
        ) from None
    target: Any = module
    for part in function_name.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ConfigError(
            f"{key}={spec}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
            f"function {function_name!r}"
        )
    return target


MINI_RESNET = "mini_resnet"
# The label of a sample that is in the batch but not counted (an unreadable image skipped by
# data.bad_images=skip, or a factory's own): cross-entropy's default ignore_index, so its loss
# and gradient are 0.
IGNORED = -100
# dist.strategy values that shard parameters (FSDP2): parallel.py
SHARDED_STRATEGIES = ("fsdp", "hybrid")
NO_SIGNALS = "none"  # run.preempt_signals=none: no preemption checkpoint
SIGNAL_NAMES = (
    "use signal names such as SIGTERM,SIGUSR2 (SIGKILL and SIGSTOP cannot be caught), or none "
    "alone for no preemption checkpoint"
)


class _Section:
    """A config section: `_require` states one check per line."""

    _name: ClassVar[str]

    def _require(self, field_name: str, ok: bool, fix: str) -> None:
        if not ok:
            value = getattr(self, field_name)
            raise ConfigError(f"invalid value for {self._name}.{field_name}: {value!r} ({fix})")

    def _require_factory(self) -> None:
        """factory is empty or package.module:function; kwargs is a JSON object without the
        keywords the pipeline passes itself. kwargs is stored in one canonical spelling."""
        factory: str = self.factory  # type: ignore[attr-defined]
        self._require("factory", not factory or bool(FACTORY.fullmatch(factory)), FACTORY_FIX)
        kwargs = json_object(self.kwargs.strip() or "{}")  # type: ignore[attr-defined]
        self._require("kwargs", kwargs is not None, 'give a JSON object such as {"depth": 4}')
        assert kwargs is not None
        reserved = RESERVED_KWARGS[f"{self._name}.kwargs"]
        taken = sorted(set(kwargs) & set(reserved))
        self._require("kwargs", not taken, f"{', '.join(taken)} is passed by the pipeline")
        object.__setattr__(self, "kwargs", json.dumps(kwargs, sort_keys=True))


@dataclass(frozen=True)
class RunConfig(_Section):
    """Where the run writes, and how it survives preemption and restarts."""

    _name: ClassVar[str] = "run"

    dir: str = "runs/default"
    """output directory of the run: config.json, metrics.jsonl,
    tensorboard/, checkpoints/"""

    preempt_signals: tuple[str, ...] = exitcodes.DEFAULT_PREEMPT_SIGNALS
    """signals that make every rank checkpoint at the next step boundary
    and exit with code 75, however often and to whichever processes they
    are sent (torchrun forwards SIGTERM to its workers; SIGINT is
    Ctrl-C); none = no preemption checkpoint (an empty value is refused:
    it is more often an unset variable than a wish)"""
    lease_timeout_s: float = 120.0
    """one job per run.dir: a lease held by a job whose heartbeat is older
    than this (its holder died) is taken over; a live holder's is
    refused"""
    max_attempts_without_progress: int = 3
    """attempts (torchrun restarts, requeues) that may start from the same
    checkpoint before the run exits 76, 'no progress: do not restart'; 0
    = never"""

    def __post_init__(self) -> None:
        self._require("dir", bool(self.dir.strip()), "give a directory path")
        object.__setattr__(self, "dir", os.path.expanduser(self.dir))  # ~ = home, not ./~
        if self.preempt_signals == (NO_SIGNALS,):  # off, by name (parse_args refuses '')
            object.__setattr__(self, "preempt_signals", ())
        catchable = set(signal.Signals.__members__) - {"SIGKILL", "SIGSTOP"}
        self._require("preempt_signals", set(self.preempt_signals) <= catchable, SIGNAL_NAMES)
        self._require("lease_timeout_s", finite(self.lease_timeout_s) >= 5, "give >= 5 seconds")
        attempts_ok = self.max_attempts_without_progress >= 0
        self._require("max_attempts_without_progress", attempts_ok, "0 = never, or a count")


@dataclass(frozen=True)
class DataConfig(_Section):
    """The dataset, how it is sharded into batches, and how it is loaded."""

    _name: ClassVar[str] = "data"

    dataset: Literal["fashion_mnist", "cifar10", "imagefolder", "synthetic"] = "fashion_mnist"
    """which dataset to train and evaluate on; not with data.factory"""
    factory: str = ""
    """your own data instead: package.module:function, imported from the
    current directory or PYTHONPATH and called as function(root=data.root,
    **data.kwargs); it returns train and eval map-style datasets of
    (image, label) pairs, num_classes and input_shape (see
    data.UserData)"""
    kwargs: str = "{}"
    """keyword arguments of data.factory, as a JSON object ('{"size":
    64}'), or in a TOML file a [data.kwargs] table"""
    root: str = "data"
    """dataset directory: download target for torchvision datasets, or for
    imagefolder the folder holding train/<class>/* and val/<class>/*"""
    download: bool = True
    """let torchvision download fashion_mnist/cifar10 into data.root when
    missing (Debian's /usr/share/datasets/fashion-mnist is used first
    when present)"""
    subset: int = 0
    """train on the first N samples of a seeded shuffle of the training
    set; 0 = all"""
    batch_size: int = 128
    """samples per rank per micro-step; global batch = batch_size x world
    size x train.grad_accum_steps"""
    global_batch_size: int = 0
    """samples per optimizer step over all ranks and micro-steps; when set,
    batch_size is derived from it (it must divide by world size x
    train.grad_accum_steps), so the training math stays the same on any
    number of ranks; 0 = use batch_size"""
    eval_batch_size: int = 512
    """samples per rank per eval forward"""
    num_workers: int = 2
    """DataLoader worker processes per rank; 0 loads in the training
    process"""
    loader: Literal["auto", "device", "dataloader"] = "auto"
    """training data path: device = the whole uint8 training set on the
    device, batches gathered and augmented there (same order, shards and
    augmentation as the DataLoader); dataloader = torch DataLoader with
    data.num_workers; auto = device for in-memory datasets that fit
    (under a quarter of free GPU memory), else dataloader"""
    prefetch_factor: int = 4
    """batches each worker prepares ahead (ignored when num_workers = 0)"""
    augment: bool = True
    """random crop (zero padding data.crop_padding; imagefolder:
    RandomResizedCrop) and horizontal flip on training samples"""
    crop_padding: int = 2
    """pixels of zero padding for random crop"""
    eval_flip: bool = False
    """evaluate each image and its mirror image and average the logits
    (test-time augmentation; twice the evaluation compute)"""
    image_size: int = 224
    """imagefolder: side in pixels of the square training crop
    (RandomResizedCrop) and of the evaluation center crop"""
    crop_ratio: float = 0.875
    """imagefolder evaluation: resize the shorter side to image_size /
    crop_ratio, then center-crop image_size (256 -> 224 as in
    torchvision's references)"""
    crop_scale: tuple[float, ...] = (0.08, 1.0)
    """imagefolder training: RandomResizedCrop's range of the crop's area
    as a fraction of the image's (aspect ratios 3/4 to 4/3)"""
    mean: tuple[float, ...] = ()
    """per-channel mean in [0, 1] units that inputs are normalised with;
    empty = the dataset's own (ImageNet's for imagefolder)"""
    std: tuple[float, ...] = ()
    """per-channel standard deviation in [0, 1] units; empty = the
    dataset's own"""
    bad_images: Literal["fail", "skip"] = "fail"
    """imagefolder: an unreadable image stops the run (exit 2, its path
    named); skip = a blank image in its place whose label counts nowhere
    (not in the loss, accuracy or sample counts), its path logged"""
    decode: Literal["auto", "workers", "device"] = "auto"
    """imagefolder: where images are decoded and cropped. workers = in the
    DataLoader workers (libjpeg-turbo on their CPU cores); device = the
    workers read the files, the training process decodes each batch in
    one call on its device (nvJPEG on a GPU) and crops it there; auto =
    device on a CUDA GPU whose decoder passes a check at start-up,
    workers otherwise"""
    prepare_timeout_s: float = 3600.0
    """seconds the other ranks wait (logging progress) for local rank 0 of
    each node to download or prepare the dataset, instead of
    dist.timeout_s; then the job fails naming the dataset and the
    preparing rank"""
    synthetic_train_size: int = 8192
    """synthetic only: number of training samples"""
    synthetic_eval_size: int = 2048
    """synthetic only: number of evaluation samples"""
    synthetic_shape: tuple[int, ...] = (1, 28, 28)
    """synthetic only: sample shape as channels,height,width"""
    synthetic_num_classes: int = 10
    """synthetic only: number of classes"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", os.path.expanduser(self.root))  # ~ = home, not ./~
        self._require("subset", self.subset >= 0, "use 0 for all or a positive count")
        self._require("global_batch_size", self.global_batch_size >= 0, "0 = use batch_size")
        self._require("batch_size", self.batch_size >= 1, "must be >= 1")
        self._require("eval_batch_size", self.eval_batch_size >= 1, "must be >= 1")
        self._require("num_workers", self.num_workers >= 0, "must be >= 0")
        self._require("prefetch_factor", self.prefetch_factor >= 1, "must be >= 1")
        self._require("crop_padding", self.crop_padding >= 0, "must be >= 0")
        self._require("image_size", self.image_size >= 8, "must be >= 8")
        self._require("crop_ratio", 0 < finite(self.crop_ratio) <= 1, "must be in (0, 1]")
        scale = self.crop_scale
        scale_ok = len(scale) == 2 and 0 < finite(scale[0]) <= finite(scale[1]) <= 1
        self._require("crop_scale", scale_ok, "give MIN,MAX with 0 < MIN <= MAX <= 1")
        self._require("mean", all(0 <= finite(m) <= 1 for m in self.mean), "values in [0, 1]")
        self._require("std", all(finite(s) > 0 for s in self.std), "values > 0")
        same = not self.mean or not self.std or len(self.mean) == len(self.std)
        self._require("std", same, f"give as many values as data.mean has ({len(self.mean)})")
        self._require_factory()
        folder = self.dataset == "imagefolder" and not self.factory
        self._require("decode", self.decode != "device" or folder, "it is for imagefolder only")
        self._require("prepare_timeout_s", finite(self.prepare_timeout_s) > 0, "seconds > 0")
        self._require("synthetic_train_size", self.synthetic_train_size >= 1, "must be >= 1")
        self._require("synthetic_eval_size", self.synthetic_eval_size >= 1, "must be >= 1")
        self._require("synthetic_shape", image_shape(self.synthetic_shape), "give C,H,W; H, W >= 8")
        self._require("synthetic_num_classes", self.synthetic_num_classes >= 2, "must be >= 2")

    @property
    def source(self) -> str:
        """The dataset as the user chose it: data.factory=... or data.dataset=..."""
        return f"data.factory={self.factory}" if self.factory else f"data.dataset={self.dataset}"


@dataclass(frozen=True)
class ModelConfig(_Section):
    """The network, its initial weights and its memory layout."""

    _name: ClassVar[str] = "model"

    name: str = MINI_RESNET
    """the network: mini_resnet (this pipeline's small ResNet, shaped by
    model.widths, blocks_per_stage, norm, dropout), or a torchvision
    classification builder such as resnet18, resnet50, convnext_tiny,
    efficientnet_b0, vit_b_16 (--model.list prints them all), built
    untrained for the dataset's classes and channels; not with
    model.factory"""
    factory: str = ""
    """your own model instead: package.module:function, imported from the
    current directory or PYTHONPATH and called as
    function(in_channels=C, num_classes=N, **model.kwargs); it returns a
    torch.nn.Module"""
    kwargs: str = "{}"
    """keyword arguments of the builder or factory, as a JSON object
    ('{"dropout": 0.2}'), or in a TOML file a [model.kwargs] table"""
    weights: str = ""
    """initialise a fresh run from this local state dict (loaded with
    weights_only): a classifier for another number of classes is
    replaced, a 3-channel stem fitted to the data's channels; any other
    missing, unexpected or misshapen key is an error. Nothing is ever
    downloaded. The file must exist; a run that resumes from a checkpoint
    does not load it (the checkpoint holds the weights) and warns"""
    widths: tuple[int, ...] = (16, 32, 64)
    """mini_resnet: channels of each residual stage; each stage after the
    first halves the resolution"""
    blocks_per_stage: int = 1
    """mini_resnet: BasicBlocks in each stage"""
    stem_stride: int = 1
    """mini_resnet: stride of the stem convolution; 2 halves the
    resolution before the first stage (a quarter of the compute per
    channel: room for wider stages)"""
    norm: Literal["batch", "syncbatch", "group", "none"] = "batch"
    """normalisation: batch (per-rank statistics), syncbatch (statistics
    across ranks: every BatchNorm of any model becomes SyncBatchNorm),
    group (per sample: shard- and micro-batch-invariant), none"""
    channels_last: Literal["auto", "on", "off"] = "auto"
    """store weights and activations in channels_last memory format; auto =
    on for CUDA (tensor cores read NHWC) and CPU (oneDNN's convolutions
    do too)"""
    dropout: float = 0.0
    """mini_resnet: dropout probability before the classifier, in [0, 1);
    0 = no dropout"""

    def __post_init__(self) -> None:
        self._require("widths", bool(self.widths) and min(self.widths) >= 1, "e.g. 16,32,64")
        grouped = self.norm != "group" or all(w % min(8, w) == 0 for w in self.widths)
        self._require("widths", grouped, "with model.norm=group widths must be multiples of 8")
        self._require("blocks_per_stage", self.blocks_per_stage >= 1, "must be >= 1")
        self._require("stem_stride", self.stem_stride in (1, 2), "1 or 2")
        self._require("dropout", 0 <= finite(self.dropout) < 1, "must be in [0, 1)")
        self._require("name", bool(re.fullmatch(r"\w+", self.name)), "e.g. resnet18")
        object.__setattr__(self, "weights", os.path.expanduser(self.weights))
        # Checked even where a checkpoint will be resumed instead: a wrong path is a typo, and
        # the same command line starts the next, fresh run.
        weights_ok = not self.weights or os.path.isfile(self.weights)
        self._require("weights", weights_ok, "no such file: give a local state dict file")
        self._require_factory()
        if self.factory or self.name != MINI_RESNET:  # the MiniResNet fields would do nothing
            for name in ("widths", "blocks_per_stage", "stem_stride", "dropout"):
                unchanged = getattr(self, name) == _DEFAULTS[name]
                self._require(name, unchanged, f"shapes {MINI_RESNET} only: use model.kwargs")
            batch = self.norm in ("batch", "syncbatch")
            self._require("norm", batch, f"{self.norm} is for {MINI_RESNET} only")

    @property
    def source(self) -> str:
        """The model as the user chose it: model.factory=... or model.name=..."""
        return f"model.factory={self.factory}" if self.factory else f"model.name={self.name}"


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


@dataclass(frozen=True)
class OptimConfig(_Section):
    """The optimizer, its learning-rate schedule, clipping and the loss."""

    _name: ClassVar[str] = "optim"

    name: Literal["sgd", "adamw"] = "sgd"
    """optimizer: sgd (momentum, Nesterov) or adamw"""
    lr: float = 0.2
    """peak learning rate, reached after warmup; tuned for the default
    global batch of 256, scale it linearly when you change the global
    batch"""
    momentum: float = 0.9
    """SGD momentum"""
    impl: Literal["auto", "fused", "foreach", "loop"] = "auto"
    """optimizer kernels: fused (one kernel, CUDA), foreach (one kernel per
    op over all tensors), loop (per tensor); auto = fused on CUDA,
    foreach otherwise"""
    nesterov: bool = True
    """SGD Nesterov momentum"""
    betas: tuple[float, ...] = (0.9, 0.999)
    """AdamW betas"""
    weight_decay: float = 5e-4
    """decoupled (AdamW) or L2 (SGD) weight decay of conv/linear weights
    (not norms, biases)"""
    warmup_steps: int = 100
    """optimizer steps of linear warmup from 0 to optim.lr (at most a
    quarter of the run: a shorter run warms up over its first quarter)"""
    min_lr_ratio: float = 0.0
    """cosine decay ends at optim.lr x min_lr_ratio on the last step"""
    grad_clip: float = 5.0
    """max global L2 norm of gradients (after unscaling); 0 = no clipping"""
    label_smoothing: float = 0.1
    """cross-entropy label smoothing in [0, 1)"""

    def __post_init__(self) -> None:
        self._require("lr", finite(self.lr) > 0, "must be a finite number > 0")
        self._require("momentum", 0 <= self.momentum < 1, "must be in [0, 1)")
        pair = len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)
        self._require("betas", pair, "give two numbers in [0, 1) such as 0.9,0.999")
        self._require("weight_decay", finite(self.weight_decay) >= 0, "must be >= 0")
        self._require("warmup_steps", self.warmup_steps >= 0, "must be >= 0")
        self._require("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")
        self._require("grad_clip", finite(self.grad_clip) >= 0, "must be >= 0 (0 = no clipping)")
        self._require("label_smoothing", 0 <= self.label_smoothing < 1, "must be in [0, 1)")


@dataclass(frozen=True)
class TrainConfig(_Section):
    """How long to train, precision, compilation and seeding."""

    _name: ClassVar[str] = "train"

    epochs: int = 10
    """passes over the training set"""
    max_steps: int = 0
    """stop after this many optimizer steps in total; 0 = no limit"""
    grad_accum_steps: int = 1
    """micro-steps per optimizer step; only the last one all-reduces
    gradients"""
    amp: Literal["auto", "none", "bf16", "fp16"] = "auto"
    """autocast precision: auto = bf16 on CUDA devices that support it,
    none on CPU; fp16 adds a GradScaler"""
    seed: int = 0
    """seed of model init, data order and augmentation (same on every rank);
    each rank's own random stream (dropout) is seeded with seed + rank"""
    compile: Literal["auto", "on", "off"] = "auto"
    """wrap the model in torch.compile; auto = on CUDA, off on CPU"""
    cuda_fast_math: bool = True
    """on CUDA: cudnn.benchmark and TF32 matmuls/convolutions for fp32 work"""
    deterministic: bool = False
    """deterministic kernels (torch.use_deterministic_algorithms, cuDNN's
    deterministic algorithms without autotuning, CUBLAS_WORKSPACE_CONFIG):
    a run and its resume repeat bit for bit on a GPU, at some speed; an op
    with no deterministic kernel is named in a warning. CPU kernels are
    deterministic already"""
    ema_decay: float = 0.0
    """evaluate an exponential moving average of the weights with this
    decay per optimizer step (e.g. 0.998; saved in checkpoints as "ema");
    0 = evaluate the weights as they are"""
    max_nonfinite_steps: int = 5
    """consecutive optimizer steps with a non-finite loss or gradient (each
    skipped on every rank) after which the run stops with exit code 3"""

    def __post_init__(self) -> None:
        self._require("epochs", self.epochs >= 1, "must be >= 1")
        self._require("max_nonfinite_steps", self.max_nonfinite_steps >= 1, "must be >= 1")
        self._require("max_steps", self.max_steps >= 0, "use 0 for no limit or a positive count")
        self._require("grad_accum_steps", self.grad_accum_steps >= 1, "must be >= 1")
        self._require("seed", self.seed >= 0, "must be >= 0")
        self._require("ema_decay", 0 <= finite(self.ema_decay) < 1, "in [0, 1); 0 = off")


@dataclass(frozen=True)
class CkptConfig(_Section):
    """Checkpoints: how often, how many, and where a run resumes from."""

    _name: ClassVar[str] = "ckpt"

    every_steps: int = 0
    """also checkpoint every N optimizer steps; 0 = only at the end of each
    epoch"""
    keep: int = 2
    """newest checkpoints to keep (the best one by eval accuracy is kept as
    well)"""
    async_save: bool = False
    """write checkpoints in a background process (ckpt/writer.py); training
    waits only for the copy into shared memory (the last and the preemption
    checkpoint are always waited for)"""
    format: Literal["auto", "file", "sharded"] = "auto"
    """file = rank 0 writes one file; sharded = every rank writes its own
    piece of each tensor, in parallel, into a folder (any world size and
    dist.strategy loads either); auto = sharded under dist.strategy=fsdp
    and hybrid, a file otherwise"""
    resume: str = "auto"
    """auto = newest valid checkpoint in run.dir/checkpoints if any, never
    = start fresh, a path to a checkpoint file, or a directory (a run
    dir or its checkpoints/ folder) whose newest valid checkpoint is
    taken"""

    def __post_init__(self) -> None:
        self._require("every_steps", self.every_steps >= 0, "0 = only at the end of each epoch")
        self._require("keep", self.keep >= 1, "must be >= 1")
        self._require("resume", bool(self.resume.strip()), "use auto, never or a path")
        object.__setattr__(self, "resume", os.path.expanduser(self.resume))  # ~ = home


@dataclass(frozen=True)
class DistConfig(_Section):
    """The process group and how the model is spread over the ranks."""

    _name: ClassVar[str] = "dist"

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """process-group backend: auto = nccl when CUDA is available, gloo
    otherwise"""
    strategy: Literal["ddp", "zero", "fsdp", "hybrid"] = "ddp"
    """ddp: every rank holds the whole model, gradients and optimizer
    state; zero: ddp with the optimizer state sharded over the ranks;
    fsdp: parameters, gradients and optimizer state sharded (FSDP2
    fully_shard); hybrid: fsdp within a node, replicated across nodes
    (README "Models that outgrow one device")"""
    fsdp_units: str = "auto"
    """fsdp/hybrid: the modules sharded as units, each gathering its
    parameters for its own forward and backward: auto = every instance of
    the repeated block class holding the most parameters (MiniResNet's
    BasicBlock, ResNet's Bottleneck, ViT's EncoderBlock); or class names,
    comma-separated"""
    reshard_after_forward: bool = True
    """fsdp/hybrid: free a unit's gathered parameters after its forward
    and gather them again for its backward (less memory, one more
    all-gather per unit)"""
    timeout_s: float = 300.0
    """seconds a collective may wait for the slowest rank before the job
    fails"""
    preflight: bool = True
    """before step 0, check that all ranks run the same versions, device
    type, dataset and config (one all-gather)"""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB: larger = fewer all-reduces, later
    start"""
    gradient_as_bucket_view: bool = True
    """DDP: gradients are views into the all-reduce buckets (no copy, less
    memory)"""
    static_graph: bool = False
    """DDP static_graph: the same parameters are used every step (enables
    overlap optimisations; wrong for models with conditional branches)"""
    grad_compression: Literal["none", "fp16", "bf16"] = "none"
    """DDP communication hook: all-reduce gradients in 16 bits (half the
    bytes on the wire; slightly different numerics)"""
    preflight_bandwidth: bool = False
    """before step 0, time all-reduces of 1, 16 and 64 MB and log bus
    bandwidth"""

    def __post_init__(self) -> None:
        self._require("timeout_s", finite(self.timeout_s) > 0, "must be a number of seconds > 0")
        self._require("bucket_cap_mb", finite(self.bucket_cap_mb) > 0, "must be a size in MiB > 0")


@dataclass(frozen=True)
class LogConfig(_Section):
    """Metrics rows, TensorBoard, the progress bar, stragglers, profiling, MFU."""

    _name: ClassVar[str] = "log"

    every_steps: int = 50
    """optimizer steps between train rows in metrics.jsonl and TensorBoard"""
    tensorboard: bool = True
    """write run.dir/tensorboard events"""
    progress: Literal["auto", "on", "off"] = "auto"
    """progress bar on rank 0: auto = only when stderr is a terminal"""
    straggler_every_steps: int = 500
    """every N optimizer steps log each rank's step time and arrival at the
    gradient all-reduce (min/median/max, the slowest rank named); 0 =
    off"""
    profile_steps: tuple[int, ...] = ()
    """START,END: record optimizer steps START..END-1 with torch.profiler
    into run.dir/tensorboard/profile (TensorBoard's profiler tab); empty
    = off"""
    mfu: bool = True
    """count the model's FLOPs (torch.utils.flop_counter) and time a matmul
    at start-up to log achieved TFLOP/s and model FLOP utilisation"""
    nvtx: bool = False
    """NVTX ranges for Nsight Systems: data wait, forward/backward,
    optimizer, each gradient all-reduce bucket, evaluation and checkpoint
    (README "Profiling with Nsight Systems")"""
    resources: bool = True
    """CPU use of each training process and of its loader workers, GPU
    utilisation (with nvidia-ml-py) and memory in train rows (min, median
    and max over ranks), and warnings that say what to change when the
    loader or the step size holds the hardware back"""

    def __post_init__(self) -> None:
        self._require("every_steps", self.every_steps >= 1, "must be >= 1")
        self._require("straggler_every_steps", self.straggler_every_steps >= 0, "0 = off")
        window = self.profile_steps
        valid = not window or (len(window) == 2 and 0 <= window[0] < window[1])
        self._require("profile_steps", valid, "give START,END with 0 <= START < END; empty = off")


@dataclass(frozen=True)
class Config:
    """Train a model data-parallel. Every key below can also come from TOML files,
    --config FILE.toml (more than one are merged), as [section] tables; the command line
    beats the files, which beat the defaults."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if self.dist.strategy in SHARDED_STRATEGIES:
            where = f"dist.strategy={self.dist.strategy}"
            if self.train.amp == "fp16":
                raise ConfigError(
                    f"train.amp=fp16 cannot be combined with {where}: the fp16 loss scaler "
                    "checks each rank's own gradient shard for infinities, so ranks could "
                    "disagree on skipping a step; use train.amp=bf16 (no scaler needed)"
                )
            if self.model.norm == "syncbatch":
                raise ConfigError(
                    f"model.norm=syncbatch cannot be combined with {where}: under fsdp every "
                    "rank takes rank 0's BatchNorm statistics at each step (as DDP does); use "
                    "model.norm=batch, or dist.strategy=ddp for SyncBatchNorm"
                )
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


def field_types() -> dict[str, Any]:
    """Every dotted key, `section.field`, in declaration order, with its annotated type."""
    types = {}
    for section in dataclasses.fields(Config):
        section_cls = typing.get_type_hints(Config)[section.name]
        hints = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            types[f"{section.name}.{f.name}"] = hints[f.name]
    return types


# ---------------------------------------------------------------------------------------------
# Parsing: tyro over the dataclasses above, with this project's spellings of values.


def _word(kind: type, what: str) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not {what}") from None

    return parse


def _bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{raw!r} is not true or false")


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# The scalar types of the fields: how a value is read, and its help metavar.
_SCALARS: dict[type, tuple[Callable[[str], Any], str]] = {
    int: (_word(int, "an integer"), "INT"),
    float: (_word(float, "a number"), "FLOAT"),
    bool: (_bool, "{true,false}"),
}

_REGISTRY = ConstructorRegistry()


@_REGISTRY.primitive_rule
def _spellings(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    """Booleans as true/false (also yes/no, on/off, 1/0), lists comma-separated (16,32,64), and
    every message naming the field, then the value."""
    if info.type in _SCALARS:
        parse, metavar = _SCALARS[info.type]
        return PrimitiveConstructorSpec(
            nargs=1,
            metavar=metavar,
            instance_from_str=lambda args: parse(args[0]),
            is_instance=lambda value: isinstance(value, info.type),
            str_from_instance=lambda value: [_show(value)],
        )
    if info.type_origin is Literal:  # named in the message as field, then value
        choices = typing.get_args(info.type)

        def choose(args: list[str]) -> str:
            if args[0] not in choices:
                raise ValueError(f"{args[0]!r} is not one of {', '.join(choices)}")
            return args[0]

        return PrimitiveConstructorSpec(
            nargs=1,
            metavar="{" + ",".join(choices) + "}",
            instance_from_str=choose,
            is_instance=lambda value: value in choices,
            str_from_instance=lambda value: [value],
        )
    if info.type_origin is tuple and typing.get_args(info.type)[1:] == (Ellipsis,):
        item = typing.get_args(info.type)[0]
        parse, metavar = _SCALARS.get(item, (str, "STR"))

        def parse_list(args: list[str]) -> tuple[Any, ...]:
            parts = [part.strip() for part in args[0].split(",")]
            if parts == [""]:
                return ()  # empty: each list field's doc says what that means, or refuses it
            if "" in parts:  # 16,,32 is a slip, not 16,32
                raise ValueError(f"{args[0]!r} has an empty element: remove the extra comma")
            try:
                return tuple(parse(part) for part in parts)
            except ValueError:
                expected = f"a comma-separated list ({metavar},...)"
                raise ValueError(f"{args[0]!r} is not {expected}") from None

        return PrimitiveConstructorSpec(
            nargs=1,
            metavar=f"{metavar},...",
            instance_from_str=parse_list,
            is_instance=lambda value: isinstance(value, tuple),
            str_from_instance=lambda value: [",".join(map(_show, value))],
        )
    return None


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as dotted keys (`[train] epochs = 3` and `"train.epochs" = 3` alike). One
    key spelled both ways is refused: tomllib keeps both (the quoted key is one name with a
    dot in it), and which one was meant is not for the parser to guess. A bare dotted key and
    a table (`train.epochs = 3` and `[train]`) tomllib refuses itself."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err}") from None

    def flatten(table: dict[str, Any], prefix: str) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for name, value in table.items():
            if isinstance(value, dict) and f"{prefix}{name}" not in KWARGS_KEYS:
                items = flatten(value, f"{prefix}{name}.")
            else:
                items = {f"{prefix}{name}": value}
            for key, item in items.items():
                if key in flat:
                    raise ConfigError(
                        f"config file {str(path)!r}: {key} is set twice (a quoted dotted key and "
                        "a table): keep one"
                    )
                flat[key] = item
        return flat

    return flatten(table, "")


def _toml_type_ok(annotation: Any, value: Any) -> bool:
    """A TOML value has the field's type (an integral float counts as an integer)."""
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        return isinstance(value, list) and all(_toml_type_ok(item, v) for v in value)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        integral = isinstance(value, float) and value.is_integer()
        return (isinstance(value, int) and not isinstance(value, bool)) or integral
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, str)  # str and Literal fields


def as_args(values: dict[str, Any], source: str) -> list[str]:
    """Dotted keys and TOML values as command-line arguments: the file goes through the same
    parser as the command line (the same suggestions for unknown keys, the same checks). A
    value of the wrong TOML type is refused here, naming the file, key and value."""
    annotations = field_types()

    def spell(value: Any) -> str:
        if isinstance(value, list):
            return ",".join(map(spell, value))
        if isinstance(value, float) and value.is_integer():
            return str(int(value))  # 3.0 for an integer field; a float field reads "3" alike
        return _show(value)

    args = []
    for key, value in values.items():
        if key in KWARGS_KEYS and isinstance(value, dict):
            value = json.dumps(value)  # a [model.kwargs] table
        if key in annotations and not _toml_type_ok(annotations[key], value):
            expected = _spelled_type(annotations[key])
            raise ConfigError(f"{source}: {key} = {value!r} is not {expected}")
        args.append(f"--{key}={spell(value)}")
    return args


def _spelled_type(annotation: Any) -> str:
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        return "a list of " + {int: "integers", float: "numbers"}.get(item, "strings")
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(annotation, str(annotation))


def split_config_flag(argv: list[str]) -> tuple[list[str], list[str]]:
    """Every `--config FILE` (or `--config=FILE`) out of argv, in order, and the rest."""
    rest: list[str] = []
    config_files: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg != "--config" and not arg.startswith("--config="):
            rest.append(arg)
            continue
        path = next(args, None) if arg == "--config" else arg.removeprefix("--config=")
        if path is None:
            raise ConfigError("missing value for '--config': write --config=FILE.toml")
        if not path.strip():  # an unset variable; Path("") would be "." ("is a directory")
            raise ConfigError(f"--config: {path!r} (empty) names no file: write --config=FILE.toml")
        config_files.append(path)
    return config_files, rest


def nearest_key(key: str) -> str | None:
    """The known `section.field` key closest to `key`, or None when none is close.

    Section and field are scored apart (difflib's ratio, the lower of the two), so a
    misspelt section or field still finds its key while a shared section alone
    (optim.learning_rate, optim.min_lr_ratio) does not. tyro 1.0's own suggestion scores the
    whole `--key=value` token (`_backends/_tyro_help_formatting.py`, cutoff 0.8), so whether a
    typo got one depended on the length of its value."""
    wanted = key.lower()
    wanted_section, _, wanted_field = wanted.rpartition(".")

    def score(known: str) -> float:
        section, field_name = known.split(".")
        if not wanted_section:  # --epochs: a field without its section
            return difflib.SequenceMatcher(a=wanted_field, b=field_name).ratio()
        return min(
            difflib.SequenceMatcher(a=wanted_section, b=section).ratio(),
            difflib.SequenceMatcher(a=wanted_field, b=field_name).ratio(),
        )

    best = max(field_types(), key=score)
    return best if score(best) >= 0.6 else None  # difflib.get_close_matches' default cutoff


def _options(args: list[str]) -> list[tuple[str, str]]:
    """(key, value as typed) of each `--key=value` or `--key value` in `args`: every field
    takes exactly one value, so the word after a bare `--key` is its value.
    Keys as the dataclasses spell them (tyro also takes --data.batch-size). Unknown keys and
    stray words are refused, each with the nearest known key."""
    known = field_types()
    found = []
    words = iter(args)
    for word in words:
        if word in ("-h", "--help"):
            continue
        if not word.startswith("--"):
            name, _, value = word.partition("=")
            near = nearest_key(name)
            hint = f"; did you mean --{near}{'=' * bool(value)}{value}?" if near else ""
            raise ConfigError(f"unexpected argument {word!r}: options start with --{hint}")
        typed, has_value, value = word[2:].partition("=")
        key = typed.replace("-", "_")
        if key not in known:
            near = nearest_key(key)
            hint = f"; did you mean --{near}?" if near else ""
            raise ConfigError(f"unknown option {word}{hint} (--help lists every key)")
        if not has_value:
            following = next(words, None)
            if following is None or following.startswith("--"):  # the next option, no value
                raise ConfigError(f"missing value for {word}: write {word}=VALUE")
            value = following
        found.append((key, value))
    return found


def _file_args(config_files: list[str]) -> tuple[list[str], dict[str, str]]:
    """The config files' keys as command-line arguments, and the file that set each key.
    Several files are merged; a key set in two of them is refused, naming both (which one
    should win is not obvious from the command line). Unknown keys are named with the nearest
    known one."""
    known = field_types()
    args: list[str] = []
    origin: dict[str, str] = {}
    for path in config_files:
        source = f"config file {path!r}"
        values = load_toml(path)
        for key, value in values.items():
            if key not in known:
                near = nearest_key(key)
                hint = f"; did you mean {near}?" if near else " (--help lists every key)"
                raise ConfigError(f"{source}: unknown key {key} = {value!r}{hint}")
            if key in origin:
                raise ConfigError(
                    f"{key} is set in {origin[key]} and in {source}: set it in one file (or on "
                    "the command line, which beats both)"
                )
            origin[key] = source
        args += as_args(values, source)
    return args, origin


# Keys whose empty value the type allows but which is refused: `--run.preempt_signals=$SIGS`
# with the variable unset would turn the preemption checkpoint off without a word.
_NOT_EMPTY = {"run.preempt_signals": f"write {NO_SIGNALS} for no preemption checkpoint"}


@dataclass(frozen=True)
class _Scope:
    """Fields that only some runs use: `keys` do something only where `applies(cfg)` (which
    `users` describes); `chosen(cfg)` names what this run chose instead."""

    keys: tuple[str, ...]
    users: str
    applies: Callable[[Config], bool]
    chosen: Callable[[Config], str]


def _data(cfg: Config) -> str:
    return cfg.data.source


def _dataset_is(*names: str) -> Callable[[Config], bool]:
    return lambda cfg: cfg.data.source in {f"data.dataset={name}" for name in names}


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
        ("data.image_size", "data.crop_ratio", "data.crop_scale", "data.bad_images", "data.decode"),
        "data.dataset=imagefolder",
        _dataset_is("imagefolder"),
        _data,
    ),
    _Scope(  # an image folder crops with RandomResizedCrop (data.crop_scale) instead
        ("data.crop_padding",),
        "datasets other than imagefolder",
        lambda c: not _dataset_is("imagefolder")(c),
        _data,
    ),
    _Scope(
        tuple(key for key in field_types() if key.startswith("data.synthetic_")),
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


def _check_not_empty(given: dict[str, str], origin: dict[str, str]) -> None:
    for key, fix in _NOT_EMPTY.items():
        value = given.get(key)
        if value is not None and not value.strip():
            where = f"{origin[key]}: " if key in origin else ""
            raise ConfigError(f"{where}{key}: '' (empty) is refused: {fix}")


def _plain(box: str) -> str:
    """tyro's error box as one line: its first section (the reason)."""
    sections: list[list[str]] = [[]]
    for line in box.splitlines()[1:]:  # the first line is the box's title
        text = line.strip().strip("│").strip()
        if text and set(text) <= set("─-"):
            sections.append([])
        elif text and not set(text) <= set("╰╯─"):
            sections[-1].append(text)
    parts = [" ".join(lines) for lines in sections if lines]
    if not parts:
        return box.strip()
    reason = re.sub(r"^Error parsing (--[\w.]+): ", r"\1: ", parts[0])  # the key, then the value
    return re.sub(r"^Error parsing [\w.]+: ", "", reason)  # a section's or Config's check


def _tyro(args: list[str], prog: str) -> Config:
    """tyro over Config with this project's spellings; its explanation of a refused value
    goes to stderr, and a ConfigError carries the reason on one line."""
    explained = io.StringIO()
    try:
        with contextlib.redirect_stderr(explained):
            return tyro.cli(
                Config,
                args=args,
                prog=prog,
                registry=_REGISTRY,
                use_underscores=True,  # --data.batch_size, as the fields are spelled
                config=(tyro.conf.FlagConversionOff,),  # --data.augment=false
            )
    except SystemExit as exit:
        if exit.code in (0, None):  # --help
            raise
        sys.stderr.write(explained.getvalue())
        raise ConfigError(_plain(explained.getvalue())) from None


def parse_args(argv: list[str] | None = None, prog: str = "train.py") -> Config:
    """The command line (default sys.argv[1:]) over the --config files over the defaults, in
    one tyro pass (the files' keys first: a later key wins), then checked. Unknown keys are
    refused first, each with the nearest known key; then the values (tyro's explanation of a
    refused value goes to stderr); then settings this run would ignore. Every refusal is a
    ConfigError with the reason on one line, naming the config file when the key came from
    one. --help prints the help and exits 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    config_files, cli_args = split_config_flag(argv)
    if {"-h", "--help"} & set(cli_args):
        return _tyro(cli_args, prog)
    file_args, origin = _file_args(config_files)
    cli = dict(_options(cli_args))
    given = dict(_options(file_args)) | cli
    origin = {key: source for key, source in origin.items() if key not in cli}
    _check_not_empty(given, origin)
    try:
        cfg = _tyro([*file_args, *cli_args], prog)
    except ConfigError as err:
        named = set(re.findall(r"--([\w.]+)", str(err)))
        named |= set(re.findall(r"for ([a-z]+\.\w+):", str(err)))
        from_files = sorted({origin[key] for key in named & origin.keys()})
        if from_files:
            raise ConfigError(f"{', '.join(from_files)}: {err}") from None
        raise
    check_given(cfg, given, origin)
    return cfg
