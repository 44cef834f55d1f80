"""The config sections of a training recipe: its length and precision, the optimizer and its
schedule, the loss, the user's metric, and the augmentation of torchvision's reference
classification recipe (docs/recipes.md).

Apart from config.py only to keep each file readable; `config.Config` composes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from schema import Section, finite


@dataclass(frozen=True)
class OptimConfig(Section):
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
    """decoupled (AdamW) or L2 (SGD) weight decay of parameters of 2 or more
    dimensions (conv/linear weights); those of fewer dimensions get
    optim.norm_weight_decay, optim.bias_weight_decay or none"""
    norm_weight_decay: float = 0.0
    """weight decay of the 1-D scales and shifts of normalization layers
    (BatchNorm, LayerNorm, GroupNorm, InstanceNorm; torchvision's
    --norm-weight-decay)"""
    bias_weight_decay: float = 0.0
    """weight decay of the other 1-D parameters named bias (torchvision's
    --bias-weight-decay; left unset there, biases decay at --wd: set this
    to optim.weight_decay)"""
    param_groups: str = ""
    """package.module:function(model, **param_groups_kwargs) returning
    parameter groups, each with its own lr_scale or lr and weight_decay, or
    frozen (docs/your-model-and-data.md); empty = one rate for all"""
    param_groups_kwargs: str = ""
    """JSON object of keyword arguments for optim.param_groups"""
    warmup_steps: int = 100
    """optimizer steps of warm-up (at most a quarter of the run: a shorter
    run warms up over its first quarter)"""
    warmup_epochs: int = 0
    """warm-up in epochs instead of optim.warmup_steps, when > 0
    (torchvision's --lr-warmup-epochs)"""
    warmup: Literal["linear", "constant"] = "linear"
    """warm-up: linear from optim.warmup_factor x optim.lr to optim.lr, or
    constant at optim.warmup_factor x optim.lr (torchvision's
    --lr-warmup-method)"""
    warmup_factor: float = 0.0
    """the warm-up's start, times optim.lr (torchvision's --lr-warmup-decay)"""
    schedule: Literal["cosine", "step", "exponential", "constant"] = "cosine"
    """after the warm-up, per optimizer step: cosine to optim.lr x
    min_lr_ratio on the last step, step (x optim.gamma every
    optim.step_epochs epochs), exponential (x optim.gamma per epoch), or
    constant (torchvision's --lr-scheduler)"""
    min_lr_ratio: float = 0.0
    """cosine decay ends at optim.lr x min_lr_ratio on the last step"""
    step_epochs: int = 30
    """schedule=step: epochs between decays (torchvision's --lr-step-size)"""
    gamma: float = 0.1
    """schedule=step: the factor at each decay; exponential: the factor per
    epoch (torchvision's --lr-gamma)"""
    grad_clip: float = 5.0
    """max global L2 norm of gradients (after unscaling); 0 = no clipping"""
    label_smoothing: float = 0.1
    """label smoothing in [0, 1) of loss.name=cross_entropy and focal"""

    def __post_init__(self) -> None:
        self._require("lr", finite(self.lr) > 0, "must be a finite number > 0")
        self._require("momentum", 0 <= self.momentum < 1, "must be in [0, 1)")
        pair = len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)
        self._require("betas", pair, "give two numbers in [0, 1) such as 0.9,0.999")
        self._require("weight_decay", finite(self.weight_decay) >= 0, "must be >= 0")
        self._require("norm_weight_decay", finite(self.norm_weight_decay) >= 0, "must be >= 0")
        self._require("bias_weight_decay", finite(self.bias_weight_decay) >= 0, "must be >= 0")
        self._require_factory("param_groups", "param_groups_kwargs")
        self._require("warmup_steps", self.warmup_steps >= 0, "must be >= 0")
        self._require("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")
        self._require("warmup_epochs", self.warmup_epochs >= 0, "must be >= 0")
        self._require("warmup_factor", 0 <= self.warmup_factor <= 1, "must be in [0, 1]")
        idle = self.warmup == "constant" and self.warmup_factor == 0
        self._require("warmup_factor", not idle, "a constant warm-up at 0 trains nothing")
        self._require("step_epochs", self.step_epochs >= 1, "must be >= 1")
        self._require("gamma", 0 < finite(self.gamma) <= 1, "must be in (0, 1]")
        self._require("grad_clip", finite(self.grad_clip) >= 0, "must be >= 0 (0 = no clipping)")
        self._require("label_smoothing", 0 <= self.label_smoothing < 1, "must be in [0, 1)")


@dataclass(frozen=True)
class LossConfig(Section):
    """The training loss (docs/your-model-and-data.md, "Loss and metrics")."""

    _name: ClassVar[str] = "loss"

    name: Literal["cross_entropy", "focal", "bce", "model"] = "cross_entropy"
    """cross_entropy (label smoothing optim.label_smoothing); focal
    (cross-entropy scaled by (1 - p)^loss.gamma, smoothed alike); bce (a
    sigmoid per class: multi-label data with multi-hot float targets, or
    class indices made one-hot); model = the model computes its own loss:
    in training it is called as model(images, targets) and returns
    (logits, loss); not with loss.factory"""
    gamma: float = 2.0
    """loss.name=focal: the focusing exponent; 0 = cross-entropy"""
    class_weights: tuple[float, ...] = ()
    """one weight per class (as torch's CrossEntropyLoss and
    BCEWithLogitsLoss weight); checked against the data's classes at
    start-up; empty = all 1"""
    aux_weight: float = 0.4
    """auxiliary classifiers (googlenet, inception_v3 with model.kwargs
    aux_logits true): loss = main + aux_weight x each auxiliary loss"""
    factory: str = ""
    """your own loss instead: package.module:function, called as
    function(num_classes=N, **loss.kwargs); it returns a callable
    (logits, targets) -> the mean loss as a 0-d tensor"""
    kwargs: str = "{}"
    """keyword arguments of loss.factory, as a JSON object, or in a TOML
    file a [loss.kwargs] table"""

    def __post_init__(self) -> None:
        self._require("gamma", 0 <= finite(self.gamma) <= 10, "must be in [0, 10]")
        weights_ok = all(finite(w) >= 0 for w in self.class_weights)
        positive = not self.class_weights or sum(self.class_weights) > 0
        self._require("class_weights", weights_ok and positive, "give finite weights >= 0")
        aux_ok = 0 < finite(self.aux_weight) <= 10
        self._require("aux_weight", aux_ok, "must be in (0, 10]; aux_logits false drops them")
        self._require_factory()


@dataclass(frozen=True)
class MetricsConfig(Section):
    """Your own metric, reduced across ranks like accuracy and logged in train and eval rows."""

    _name: ClassVar[str] = "metrics"

    factory: str = ""
    """package.module:function, called as function(num_classes=N,
    **metrics.kwargs); it returns a callable (logits, targets) ->
    {name: (sum, count)} per batch; name = sum / count is logged"""
    kwargs: str = "{}"
    """keyword arguments of metrics.factory, as a JSON object, or in a
    TOML file a [metrics.kwargs] table"""

    def __post_init__(self) -> None:
        self._require_factory()


@dataclass(frozen=True)
class AugConfig(Section):
    """Augmentation beyond data.augment's crop and flip: torchvision's reference recipe
    (docs/recipes.md). Every draw comes from the seed, epoch and sample or step: exact on
    resume."""

    _name: ClassVar[str] = "aug"

    auto_augment: Literal["none", "ra", "ta_wide", "augmix", "autoaugment"] = "none"
    """automatic augmentation policy of each training image, after the crop
    and flip (torchvision's RandAugment, TrivialAugmentWide, AugMix,
    AutoAugment with the ImageNet policy); none = off. Runs per sample in
    the DataLoader workers (data.loader=auto picks them)"""
    ra_magnitude: int = 9
    """aug.auto_augment=ra: RandAugment's magnitude, 0..30"""
    augmix_severity: int = 3
    """aug.auto_augment=augmix: AugMix's severity, 1..10"""
    random_erase: float = 0.0
    """probability of erasing a random rectangle of each training image to 0
    after normalisation (torchvision's RandomErasing, on the device); 0 =
    off"""
    mixup_alpha: float = 0.0
    """mixup of each training batch with itself rolled by one, the weight
    drawn from Beta(alpha, alpha); 0 = off. With aug.cutmix_alpha too,
    each batch takes one of the two at even odds"""
    cutmix_alpha: float = 0.0
    """cutmix of each training batch with itself rolled by one, the box's
    area drawn from Beta(alpha, alpha); 0 = off"""
    repeated_augment: int = 1
    """repeated-augmentation sampler (torchvision's --ra-sampler --ra-reps):
    each epoch's order holds every sample this many times in a row,
    differently augmented, spread over the ranks, and an epoch stays
    len(dataset) samples long; 1 = off. Not with data.decode=device"""

    def __post_init__(self) -> None:
        self._require("ra_magnitude", 0 <= self.ra_magnitude <= 30, "must be in 0..30")
        self._require("augmix_severity", 1 <= self.augmix_severity <= 10, "must be in 1..10")
        self._require("random_erase", 0 <= finite(self.random_erase) <= 1, "must be in [0, 1]")
        self._require("mixup_alpha", finite(self.mixup_alpha) >= 0, "must be >= 0 (0 = off)")
        self._require("cutmix_alpha", finite(self.cutmix_alpha) >= 0, "must be >= 0 (0 = off)")
        self._require("repeated_augment", self.repeated_augment >= 1, "must be >= 1 (1 = off)")

    @property
    def mixing(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def worker_only(self, path: str) -> list[str]:
        """The settings that data.<path>=device cannot run (path: loader or decode): a policy
        runs per sample in the DataLoader's workers; repeated copies reach the device loader's
        batched crops, not the device decoder's."""
        keys = [] if self.auto_augment == "none" else [f"aug.auto_augment={self.auto_augment}"]
        if path == "decode" and self.repeated_augment > 1:
            keys.append(f"aug.repeated_augment={self.repeated_augment}")
        return keys


@dataclass(frozen=True)
class TrainConfig(Section):
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
    ema_every_steps: int = 1
    """update the average on every N-th optimizer step of an epoch
    (torchvision's --model-ema-steps)"""
    ema_adjust: bool = False
    """scale 1 - ema_decay by the global batch x ema_every_steps /
    train.epochs, as torchvision's reference adjusts --model-ema-decay"""
    ema_warmup_reset: bool = False
    """restart the average from the weights at each update of the warm-up
    (torchvision's reference resets it in its warm-up epochs)"""
    max_nonfinite_steps: int = 5
    """consecutive optimizer steps with a non-finite loss or gradient (each
    skipped on every rank) after which the run stops with exit code 3"""
    verdict: Literal["auto", "host", "device"] = "auto"
    """where a step's non-finite skip is decided: host = the ranks' vote read
    every step (one device sync per step on CUDA); device = the fused
    optimizer skips on a flag on the device and the host reads the vote a
    step late (needs optim.impl=fused, no fp16, no ema_decay, ddp or one
    rank); auto = device on CUDA where it can, host elsewhere"""

    def __post_init__(self) -> None:
        self._require("epochs", self.epochs >= 1, "must be >= 1")
        self._require("max_nonfinite_steps", self.max_nonfinite_steps >= 1, "must be >= 1")
        self._require("max_steps", self.max_steps >= 0, "use 0 for no limit or a positive count")
        self._require("grad_accum_steps", self.grad_accum_steps >= 1, "must be >= 1")
        self._require("seed", self.seed >= 0, "must be >= 0")
        self._require("ema_decay", 0 <= finite(self.ema_decay) < 1, "in [0, 1); 0 = off")
        self._require("ema_every_steps", self.ema_every_steps >= 1, "must be >= 1")
