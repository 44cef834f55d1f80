"""The config sections of a training recipe: the optimizer and its schedule, and the
augmentation of torchvision's reference classification recipe (docs/recipes.md).

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
