"""Targets as a batch carries them, and the hits of the logits against them.

A batch's targets are int64 `[N]` class indices (`IGNORED` marks a sample no loss or count
takes in) or float `[N, C]`: class probabilities (mixup, cutmix) or multi-hot labels. A float
row's top-k hit is one of the k highest logits on a class with the row's highest target: its
argmax (torchvision's reference scores mixed targets against their argmax), and for a
multi-hot row any of its labels. An all-zero row is never a hit.
"""

from __future__ import annotations

import torch

from schema import IGNORED

TOP_K = 5  # torchvision's reference prints Acc@1 and Acc@5


def soft(targets: torch.Tensor) -> bool:
    """Whether `targets` are float rows [N, C] rather than class indices [N]."""
    return targets.is_floating_point()


def counted(targets: torch.Tensor) -> torch.Tensor:
    """Bool [N]: the rows a loss and every count take in (all float rows; index rows that are
    not IGNORED)."""
    if soft(targets):
        return torch.ones(len(targets), dtype=torch.bool, device=targets.device)
    return targets != IGNORED


def truth(targets: torch.Tensor) -> torch.Tensor:
    """Int64 [N]: the class a row stands for (per-class counts): the index, or the argmax."""
    return targets.argmax(dim=1) if soft(targets) else targets


def top(logits: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """Int64 [N, min(k, C)]: each row's classes with the highest logits, the highest first."""
    return logits.topk(min(k, logits.shape[1]), dim=1).indices


def hits(predicted: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Bool [N, k]: whether each predicted class (`predicted` [N, k], as `top` or an argmax
    gives them) is a hit; `.any(1)` is the row's top-k hit. Uncounted rows are never hits."""
    if not soft(targets):
        return predicted == targets[:, None]  # IGNORED (-100) is no class index
    best = targets.max(dim=1, keepdim=True).values
    return (targets.gather(1, predicted) == best) & (best > 0)


def one_hot(targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Float [N, C]: index targets one-hot (IGNORED rows all zero), float rows as they are.
    No boolean indexing: its nonzero() would wait for the device at every step."""
    if soft(targets):
        return targets.float()
    rows = torch.nn.functional.one_hot(targets.clamp_min(0), num_classes).float()
    return rows * counted(targets)[:, None]
