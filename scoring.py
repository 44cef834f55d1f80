"""What an evaluation counts: the loss, top-1 and top-5 hits, and hits per class, summed on the
device while batches stream past and reduced across ranks once, as integers (no padding, no
sample counted twice), so the result is exact at any world size.

The per-class counts give per-class accuracy; the confusion matrix (true class x predicted
class) is counted too when asked for and the classes are few enough for a C x C matrix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import distributed
from objective import targets
from objective.losses import Objective, cross_entropy_sum

CONFUSION_MAX_CLASSES = 1000  # above it a C x C matrix outgrows one reduction: per-class only


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float  # top-1
    num_samples: int  # evaluated samples summed over all ranks
    top5: float = math.nan  # a hit when the label is among the 5 highest logits (all, if < 5)
    class_correct: tuple[int, ...] = ()  # per class: top-1 hits (empty: not counted)
    class_count: tuple[int, ...] = ()  # per class: evaluated samples of that label
    confusion: tuple[tuple[int, ...], ...] = ()  # [true][predicted] counts (empty: not counted)
    metrics: dict[str, float] = field(default_factory=dict)  # metrics.factory's sum / count

    def per_class_accuracy(self) -> list[float | None]:
        """Top-1 accuracy of each class; None for a class with no evaluated sample."""
        return [
            hits / count if count else None
            for hits, count in zip(self.class_correct, self.class_count, strict=True)
        ]


@dataclass
class EvalCounts:
    """Device-side sums for one evaluation; `add` per batch, `reduce` once (a collective).

    `num_classes` must be the same on every rank (the dataset's), so the reduced tensors have
    one shape even on a rank that evaluated no batch; 0 counts totals only."""

    device: torch.device
    num_classes: int = 0
    confusion: bool = False
    objective: Objective | None = None  # its evaluation loss and metric (else cross-entropy)
    # loss sum, top-1 hits, top-5 hits, count; then the metric's [sum, count] pairs
    totals: torch.Tensor = field(init=False)
    per_class: torch.Tensor = field(init=False)  # [0]: hits by class, [1]: count by class

    def __post_init__(self) -> None:
        self.confusion = self.confusion and 0 < self.num_classes <= CONFUSION_MAX_CLASSES
        self.objective = self.objective or Objective(cross_entropy_sum)
        metric = self.objective.metric
        size = 4 + (2 * len(metric.names) if metric is not None else 0)
        self.totals = torch.zeros(size, device=self.device, dtype=torch.float64)
        cells = self.num_classes * (2 + (self.num_classes if self.confusion else 0))
        self.per_class = torch.zeros(cells, device=self.device, dtype=torch.long)

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """One batch: `logits` [N, C] float, `labels` [N] class indices (IGNORED not counted)
        or float [N, C] rows (objective.targets: hits and per-class counts by their argmax)."""
        assert self.objective is not None
        loss = self.objective.eval_loss(logits, labels)  # IGNORED left out, as in counted
        counted = targets.counted(labels)
        top = targets.top(logits)  # [N, k], the highest first
        hits = targets.hits(top, labels)
        self.totals[0] += loss.double()
        self.totals[1] += hits[:, 0].sum()
        self.totals[2] += hits.any(dim=1).sum()
        self.totals[3] += counted.sum()
        if self.objective.metric is not None:
            self.totals[4:] += self.objective.metric.measure(logits, labels)
        if not self.num_classes:
            return
        c = self.num_classes
        truth, predicted = targets.truth(labels)[counted], top[counted, 0]
        hit = hits[counted, 0]
        self.per_class[:c] += torch.bincount(truth[hit], minlength=c)[:c]
        self.per_class[c : 2 * c] += torch.bincount(truth, minlength=c)[:c]
        if self.confusion:
            pairs = torch.bincount(truth * c + predicted, minlength=c * c)[: c * c]
            self.per_class[2 * c :] += pairs

    def reduce(self) -> EvalResult:
        """The exact result over every rank's batches (a collective: every rank calls it)."""
        reduced = distributed.all_reduce_sum(self.totals).tolist()
        loss_sum, top1, top5, count = reduced[:4]
        metric = self.objective.metric if self.objective is not None else None
        per_class = distributed.all_reduce_sum(self.per_class).tolist() if self.num_classes else []
        c, denominator = self.num_classes, max(count, 1.0)
        confusion = per_class[2 * c :]
        return EvalResult(
            loss=loss_sum / denominator,
            accuracy=top1 / denominator,
            num_samples=int(count),
            top5=top5 / denominator,
            class_correct=tuple(per_class[:c]),
            class_count=tuple(per_class[c : 2 * c]),
            confusion=tuple(tuple(confusion[i * c : (i + 1) * c]) for i in range(c))
            if confusion
            else (),
            metrics=metric.values(reduced[4:]) if metric is not None else {},
        )


def report(result: EvalResult, classes: Sequence[str] | None, step: int) -> dict[str, Any]:
    """The evaluation as a JSON object: totals, each class's accuracy and count (by label, with
    its name where the data names classes), and the confusion matrix [true][predicted]."""
    names = list(classes) if classes is not None else []
    per_class = [
        {
            "label": label,
            "name": names[label] if label < len(names) else str(label),
            "accuracy": accuracy,
            "count": count,
        }
        for label, (accuracy, count) in enumerate(
            zip(result.per_class_accuracy(), result.class_count, strict=True)
        )
    ]
    return {
        "step": step,
        "loss": result.loss,
        "top1": result.accuracy,
        "top5": result.top5,
        "num_samples": result.num_samples,
        "per_class": per_class,
        "confusion": [list(row) for row in result.confusion],
        **result.metrics,
    }
