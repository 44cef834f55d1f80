"""Your own loss, metric and a model that computes its own loss, without editing the pipeline:

    torchrun --nproc-per-node=2 train.py --loss.factory=examples.custom_objective:poly1 \
        --metrics.factory=examples.custom_objective:f1_counts
    torchrun --nproc-per-node=2 train.py --loss.name=model \
        --model.factory=examples.custom_objective:self_scoring_cnn

Targets are int64 [N] class indices (-100: a sample no loss counts) or float [N, C] rows
(mixup probabilities, multi-hot labels); each function below takes both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORED = -100


def _rows(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float target rows [N, C], weight per row): weight 0 for a sample no loss counts. Left
    out by arithmetic, not by boolean indexing (logits[kept]), which waits for the device at
    every step."""
    if targets.is_floating_point():
        return targets.float(), torch.ones(len(targets), device=targets.device)
    kept = (targets != IGNORED).float()
    rows = F.one_hot(targets.clamp(min=0), logits.shape[1]).float() * kept[:, None]
    return rows, kept


def poly1(*, num_classes: int, epsilon: float = 1.0) -> nn.Module:
    """loss.factory: Poly-1 cross-entropy (Leng et al., 2022), CE + epsilon x (1 - p_target)."""

    class Poly1(nn.Module):
        def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            q, weight = _rows(logits, targets)
            logp = F.log_softmax(logits.float(), dim=1)
            ce = -(q * logp).sum(dim=1)
            pt = (q * logp.exp()).sum(dim=1)
            return ((ce + epsilon * (1 - pt)) * weight).sum() / weight.sum().clamp(min=1)

    return Poly1()


def f1_counts(*, num_classes: int, threshold: float = 0.0):
    """metrics.factory: micro-F1 = 2 TP / (2 TP + FP + FN) over classes. The prediction is the
    argmax for class-index targets, every logit above `threshold` for multi-hot ones."""

    def metric(logits: torch.Tensor, targets: torch.Tensor) -> dict:
        truth, weight = _rows(logits, targets)
        if targets.is_floating_point():
            predicted = (logits > threshold).float()
        else:
            predicted = F.one_hot(logits.argmax(dim=1), num_classes).float()
        predicted = predicted * weight[:, None]  # an uncounted sample predicts nothing
        tp = (predicted * truth).sum()
        wrong = (predicted != truth).float().sum()  # FP + FN
        return {"f1": (2 * tp, 2 * tp + wrong)}

    return metric


class SelfScoringCNN(nn.Module):
    """loss.name=model: forward(images) gives logits; forward(images, targets) gives (logits,
    loss), here cross-entropy plus a small penalty on the logits' size."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, num_classes),
        )

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.body(images)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits, targets) + 1e-3 * logits.pow(2).mean()


def self_scoring_cnn(*, in_channels: int, num_classes: int, width: int = 16) -> nn.Module:
    return SelfScoringCNN(in_channels, num_classes, width)


def bright_quadrants(*, root: str, size: int = 16, num_train: int = 512, num_eval: int = 128):
    """data.factory for multi-label data (loss.name=bce): gray images whose four quadrants are
    each bright or dark at random; label c is on when quadrant c is bright (a multi-hot row of
    four floats). Drawn from a fixed seed: every rank builds the same samples. `root` unused."""
    generator = torch.Generator().manual_seed(0)

    def split(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        on = torch.rand(n, 4, generator=generator) < 0.4
        noise = torch.randint(0, 90, (n, 1, size, size), generator=generator, dtype=torch.uint8)
        images = noise.clone()
        half = size // 2
        for c, (top, left) in enumerate([(0, 0), (0, half), (half, 0), (half, half)]):
            images[on[:, c], :, top : top + half, left : left + half] += 120
        return list(zip(images, on.float(), strict=True))

    return {
        "train": split(num_train),
        "eval": split(num_eval),
        "num_classes": 4,
        "input_shape": (1, size, size),
    }
