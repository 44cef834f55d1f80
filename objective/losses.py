"""The training loss, chosen by `[loss]`: cross_entropy (the default, label smoothing from
optim.label_smoothing), focal, bce (multi-label), the user's `loss.factory`, or the model's
own (`loss.name=model`); class weights; and auxiliary classifiers (googlenet, inception_v3).

`Objective` turns what the model returned into (logits, loss): the logits give top-1, top-5
and the user's metric; the loss is the mean over the counted samples (targets.py) that
backward takes. Its `eval_loss` is the loss an evaluation reports, summed per sample so that
it reduces exactly across ranks: the configured loss without label smoothing or class
weights where it is defined on the logits alone (cross_entropy, focal, bce), plain
cross-entropy for a factory's or the model's loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from config import Config, ConfigError
from objective import metrics, targets
from objective.metrics import UserMetric

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def focal_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    gamma: float,
    weight: torch.Tensor | None = None,
    smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Focal loss (Lin et al., 2017) for index or float targets: per sample
    -sum_c w_c q_c (1 - p_c)^gamma log p_c, q the target distribution (one-hot, smoothed as
    cross_entropy smooths it, or the float row). At gamma 0 it is F.cross_entropy with the same
    weight and label_smoothing, mean included: over the weights of the counted targets for
    indices, over the rows for float targets (torch's rule for probability targets)."""
    num_classes = logits.shape[1]
    keep = targets.counted(target).float()  # as a factor: masking would sync with the device
    logp = F.log_softmax(logits.float(), dim=1)
    q = targets.one_hot(target, num_classes)
    if smoothing:
        q = (q * (1 - smoothing) + smoothing / num_classes) * keep[:, None]
    w = torch.ones(num_classes, device=logits.device) if weight is None else weight
    # (1 - p)^gamma; clamped above 0 so that a gamma below 1 has a finite gradient at p = 1
    modulation = (-torch.expm1(logp)).clamp_min(1e-12) ** gamma
    per_sample = -(w * q * modulation * logp).sum(dim=1)
    if reduction == "sum":
        return per_sample.sum()
    if targets.soft(target):
        return per_sample.sum() / len(per_sample)
    if weight is None:
        return per_sample.sum() / keep.sum()
    return per_sample.sum() / (weight[target.clamp_min(0)] * keep).sum()


def bce_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """One sigmoid per class against multi-hot (or one-hot, from indices) rows: torch's
    BCEWithLogitsLoss(weight=class_weights), its mean over counted rows x classes."""
    keep = targets.counted(target).float()[:, None]  # IGNORED rows: a factor 0, not masked
    q = targets.one_hot(target, logits.shape[1])
    terms = F.binary_cross_entropy_with_logits(logits.float(), q, weight=weight, reduction="none")
    total = (terms * keep).sum()
    return total if reduction == "sum" else total / (keep.sum() * logits.shape[1])


def cross_entropy_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the counted samples: what evaluation has always reported."""
    return F.cross_entropy(logits, target, reduction="sum")


@dataclass
class Objective:
    """The loss of one batch from whatever the model returned, and the logits it scored."""

    loss: LossFn  # (logits, targets) -> the mean loss
    eval_loss: LossFn = cross_entropy_sum  # (logits, targets) -> summed over counted samples
    model_loss: bool = False  # loss.name=model: model(images, targets) -> (logits, loss)
    aux_weight: float = 0.4
    metric: UserMetric | None = None
    float_targets: int = 0  # C when training passes float rows [N, C] (multi-hot, mixed)

    def zero_targets(self, n: int, device: torch.device | None = None) -> torch.Tensor:
        """Zero targets of the kind training passes the loss, for the FLOP probe and a failed
        batch's stand-in: float rows [n, C] for multi-hot data or mixed batches, else indices."""
        if self.float_targets:
            return torch.zeros(n, self.float_targets, device=device)
        return torch.zeros(n, dtype=torch.long, device=device)

    def inputs(self, images: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The model's arguments in training: the targets too when it computes its loss."""
        return (images, target) if self.model_loss else (images,)

    def split(self, outputs: Any, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, loss). Auxiliary logits (a namedtuple whose first field is the logits, as
        torchvision's GoogLeNetOutputs and InceptionOutputs are) add aux_weight x their loss."""
        if self.model_loss:
            ok = isinstance(outputs, tuple | list) and len(outputs) == 2
            if not ok or not all(isinstance(o, torch.Tensor) for o in outputs) or outputs[1].ndim:
                got = type(outputs).__name__
                raise ConfigError(
                    f"loss.name=model: the model returned {got} when called as model(images, "
                    "targets) in training; return (logits [N, C], loss as a 0-d tensor)"
                )
            return outputs[0], outputs[1]
        if isinstance(outputs, tuple) and hasattr(outputs, "_fields"):
            logits = outputs[0]
            loss = self.loss(logits, target)
            for aux in outputs[1:]:
                if aux is not None:
                    loss = loss + self.aux_weight * self.loss(aux, target)
            return logits, loss
        return outputs, self.loss(outputs, target)

    def __call__(self, outputs: Any, target: torch.Tensor) -> torch.Tensor:
        return self.split(outputs, target)[1]


def as_objective(loss_fn: LossFn | Objective) -> Objective:
    """`loss_fn` as an Objective: a plain (logits, targets) -> loss callable is its loss."""
    return loss_fn if isinstance(loss_fn, Objective) else Objective(loss_fn)


def build(
    cfg: Config, num_classes: int, eval_set: Sequence[Any] | torch.Tensor, device: torch.device
) -> Objective:
    """The run's objective, checked before training: class weights against the dataset's
    classes; loss.factory and metrics.factory by a call on a batch of real targets (those of
    the first samples of `eval_set`, read only then, or the targets given as a tensor) as
    training passes them: one-hot float rows when batches are mixed (inputs/mixing.py)."""
    section, smoothing = cfg.loss, cfg.optim.label_smoothing
    sample = torch.zeros(0, dtype=torch.long)
    if section.factory or cfg.metrics.factory or cfg.data.factory:  # only a factory's multi-hot
        sample = eval_set if isinstance(eval_set, torch.Tensor) else sample_targets(eval_set)
    trained = sample
    if cfg.aug.mixing:  # step 1's targets: the rows mixed, every IGNORED sample left out
        trained = targets.one_hot(sample[targets.counted(sample)], num_classes)
    rows = num_classes if targets.soft(trained) else 0  # float rows in training, and C
    weights = section.class_weights
    if weights and len(weights) != num_classes:
        raise ConfigError(
            f"invalid value for loss.class_weights: {','.join(map(str, weights))} gives "
            f"{len(weights)} weights, and the data has {num_classes} classes: give one per class"
        )
    w = torch.tensor(weights, dtype=torch.float32, device=device) if weights else None
    metric = metrics.load(cfg.metrics, num_classes, sample.to(device), trained.to(device))
    if section.factory:
        loss = _factory(section.factory, section.kwargs, num_classes, trained.to(device))
        return Objective(loss, aux_weight=section.aux_weight, metric=metric, float_targets=rows)
    chosen: dict[str, tuple[LossFn, LossFn]] = {
        "cross_entropy": (
            functools.partial(F.cross_entropy, weight=w, label_smoothing=smoothing),
            cross_entropy_sum,
        ),
        "focal": (
            functools.partial(focal_loss, gamma=section.gamma, weight=w, smoothing=smoothing),
            functools.partial(focal_loss, gamma=section.gamma, reduction="sum"),
        ),
        "bce": (
            functools.partial(bce_loss, weight=w),
            lambda x, t: bce_loss(x, t, reduction="sum") / x.shape[1],
        ),
        "model": (_no_loss, cross_entropy_sum),
    }
    loss, eval_loss = chosen[section.name]
    model_loss = section.name == "model"
    return Objective(loss, eval_loss, model_loss, section.aux_weight, metric, rows)


def _no_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise AssertionError("loss.name=model: the model returns the loss")


def _factory(spec: str, kwargs: str, num_classes: int, sample: torch.Tensor) -> LossFn:
    """loss.factory's loss, called once on zero logits and `sample`: a differentiable 0-d
    tensor, or bad input naming the key and what came back."""
    where = f"loss.factory={spec}"
    made = metrics.make("loss.factory", spec, kwargs, num_classes)
    if not callable(made):
        raise ConfigError(f"{where} returned {type(made).__name__}, not a callable loss")
    logits = torch.zeros(len(sample), num_classes, device=sample.device, requires_grad=True)
    try:
        value = made(logits, sample)
    except Exception as err:
        raise ConfigError(
            f"{where}: its loss fails on logits {tuple(logits.shape)} and targets "
            f"{_describe(sample)} ({type(err).__name__}: {err})"
        ) from None
    if not isinstance(value, torch.Tensor) or value.ndim or not value.requires_grad:
        got = _describe(value) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(
            f"{where}: its loss returned {got}; return the mean loss as a 0-d tensor computed "
            "from the logits (backward runs through it)"
        )
    return made


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)}"


def sample_targets(dataset: Sequence[Any], n: int = 8) -> torch.Tensor:
    """The targets of the first `n` samples of `dataset`, batched as a loader batches them."""
    labels = [dataset[i][1] for i in range(min(n, len(dataset)))]
    if labels and isinstance(labels[0], torch.Tensor) and labels[0].numel() > 1:
        return torch.stack(labels).float()
    return torch.tensor([int(label) for label in labels], dtype=torch.long)
