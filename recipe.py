"""The config sections of a training recipe: the optimizer and its schedule, the loss and the
user's metric.

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
    """label smoothing in [0, 1) of loss.name=cross_entropy and focal"""

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
