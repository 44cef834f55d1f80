"""Configuration: one frozen, documented dataclass per concern, composed into `Config`.

Every field is documented by the attribute docstring below it (read for --help, and by
scripts/config_docs.py for docs/configuration.md), and every value is checked in
`__post_init__` with a message naming the field, the value and the fix. `cli.py` reads the
command line and TOML files into these dataclasses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import exitcodes
from recipe import AugConfig, LossConfig, MetricsConfig, OptimConfig, TrainConfig
from schema import (  # re-exported: the rest of the pipeline imports them from here
    FACTORY,
    FACTORY_FIX,
    IGNORED,
    MINI_RESNET,
    NO_SIGNALS,
    RESERVED_KWARGS,
    SHARDED_STRATEGIES,
    SIGNAL_NAMES,
    ConfigError,
    Section,
    finite,
    image_shape,
    json_object,
    load_factory,
)

__all__ = [
    "FACTORY",
    "FACTORY_FIX",
    "IGNORED",
    "MINI_RESNET",
    "NO_SIGNALS",
    "RESERVED_KWARGS",
    "SHARDED_STRATEGIES",
    "SIGNAL_NAMES",
    "AugConfig",
    "CkptConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "LogConfig",
    "LossConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
    "finite",
    "for_world_size",
    "global_batch_size",
    "image_shape",
    "json_object",
    "load_factory",
]


@dataclass(frozen=True)
class RunConfig(Section):
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
    mode: Literal["train", "evaluate", "predict", "export"] = "train"
    """train; or, beside training (docs/modes.md), without taking the run
    dir's lease: evaluate model.weights (empty: the newest verified
    checkpoint of run.dir) on the evaluation split, predict the classes
    of data.predict_root's images, export the evaluated weights"""
    output: str = ""
    """evaluate: the JSON report; predict: the .csv or .jsonl file;
    export: the folder; replaced atomically if it exists; inside run.dir
    only under its evaluations/, predictions/ or exports/. Empty = a new
    path there, named after the weights and the time"""

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
        object.__setattr__(self, "output", os.path.expanduser(self.output))
        self._require("output", self.output == self.output.strip(), "no surrounding spaces")


@dataclass(frozen=True)
class DataConfig(Section):
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
    predict_root: str = ""
    """run.mode=predict: the folder whose images (in any subfolder) get a
    predicted class, preprocessed as the evaluation split is"""
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
    (RandomResizedCrop) and, unless data.eval_crop_size, of the
    evaluation center crop"""
    crop_ratio: float = 0.875
    """imagefolder evaluation: unless data.eval_resize_size, resize the
    shorter side to the eval crop size / crop_ratio, then center-crop
    (256 -> 224 as in torchvision's references)"""
    eval_crop_size: int = 0
    """imagefolder evaluation: side of the center crop (torchvision's
    --val-crop-size); 0 = data.image_size"""
    eval_resize_size: int = 0
    """imagefolder evaluation: the shorter side is resized to this before
    the center crop (torchvision's --val-resize-size); 0 = the eval crop
    size / data.crop_ratio"""
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
        object.__setattr__(self, "predict_root", os.path.expanduser(self.predict_root))
        self._require("subset", self.subset >= 0, "use 0 for all or a positive count")
        self._require("global_batch_size", self.global_batch_size >= 0, "0 = use batch_size")
        self._require("batch_size", self.batch_size >= 1, "must be >= 1")
        self._require("eval_batch_size", self.eval_batch_size >= 1, "must be >= 1")
        self._require("num_workers", self.num_workers >= 0, "must be >= 0")
        self._require("prefetch_factor", self.prefetch_factor >= 1, "must be >= 1")
        self._require("crop_padding", self.crop_padding >= 0, "must be >= 0")
        self._require("image_size", self.image_size >= 8, "must be >= 8")
        self._require("crop_ratio", 0 < finite(self.crop_ratio) <= 1, "must be in (0, 1]")
        self._require("eval_crop_size", self.eval_crop_size in (0, *range(8, 1 << 16)), ">= 8")
        resize_ok = self.eval_resize_size == 0 or self.eval_resize_size >= self.eval_size[0]
        self._require("eval_resize_size", resize_ok, "0, or >= the eval crop size")
        ratio_used = not self.eval_resize_size or self.crop_ratio == DataConfig.crop_ratio
        self._require("crop_ratio", ratio_used, "data.eval_resize_size sets the resize alone")
        same_view = self.augment or self.eval_crop_size in (0, self.image_size)
        fix = "with data.augment=false an image folder trains on the evaluation view: leave it 0"
        self._require("eval_crop_size", same_view, fix)
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
    def eval_size(self) -> tuple[int, int]:
        """imagefolder evaluation: (center crop side, shorter side resized to), derived."""
        crop = self.eval_crop_size or self.image_size
        return crop, self.eval_resize_size or int(crop / self.crop_ratio)

    @property
    def source(self) -> str:
        """The dataset as the user chose it: data.factory=... or data.dataset=..."""
        return f"data.factory={self.factory}" if self.factory else f"data.dataset={self.dataset}"


@dataclass(frozen=True)
class ModelConfig(Section):
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
    weights_only), or this pipeline's checkpoint: a file, a sharded
    checkpoint's folder or its manifest (read whole): a classifier for another number of classes is
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
        weights_ok = not self.weights or os.path.exists(self.weights)
        self._require(
            "weights", weights_ok, "no such file: give a state dict file or a checkpoint's folder"
        )
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
class CkptConfig(Section):
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
class DistConfig(Section):
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
    (docs/strategies.md)"""
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
    type, dataset, config and code (one all-gather)"""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB: larger = fewer all-reduces, later
    start"""
    gradient_as_bucket_view: bool = True
    """DDP: gradients are views into the all-reduce buckets (no copy, less
    memory)"""
    static_graph: bool = False
    """DDP static_graph: the same parameters are used every step (enables
    overlap optimisations; wrong for models with conditional branches)"""
    find_unused_parameters: bool = False
    """DDP: parameters may go without a gradient on some steps (LayerDrop,
    a branch taken by chance); DDP then walks the autograd graph every step
    to find them. Off: a model with such parameters is refused at start, or
    at the step that skips one, naming this setting"""
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
class LogConfig(Section):
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
    (docs/observability.md, "NVTX and Nsight Systems")"""
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
    loss: LossConfig = field(default_factory=LossConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    aug: AugConfig = field(default_factory=AugConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if (self.run.mode == "predict") != bool(self.data.predict_root):
            raise ConfigError(
                f"run.mode={self.run.mode} with data.predict_root={self.data.predict_root!r}: "
                "predict reads the folder data.predict_root names, and only predict reads it"
            )
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
        for path in ("loader", "decode"):
            if getattr(self.data, path) == "device" and self.aug.worker_only(path):
                other = "dataloader" if path == "loader" else "workers"
                raise ConfigError(
                    f"{', '.join(self.aug.worker_only(path))} cannot be combined with data."
                    f"{path}=device, which cannot make it (a policy runs per sample in the "
                    "DataLoader's workers; the device decoder knows no repeated sample's copy): "
                    f"leave data.{path} at auto (or {other})"
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
