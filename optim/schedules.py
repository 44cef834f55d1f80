"""The learning-rate schedule: a multiplier of each parameter group's peak rate at every
optimizer step (the trainer steps the schedule once per optimizer step).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from config import OptimConfig

log = logging.getLogger(__name__)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step`: linear warmup, then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int | Callable[[], int]
) -> LambdaLR:
    """Warmup and cosine decay over `total_steps`: a count, or a function giving it (a run
    knows its length only once it has resumed, which may be after the scheduler is built)."""
    steps = total_steps if callable(total_steps) else lambda: total_steps

    def factor(step: int) -> float:  # a function: LambdaLR saves no state of it
        total = steps()
        return lr_factor(step, warmup_steps(cfg.warmup_steps, total), total, cfg.min_lr_ratio)

    return LambdaLR(optimizer, factor)


def warmup_steps(configured: int, total_steps: int) -> int:
    """optim.warmup_steps, but at most a quarter of the run: a short run (a subset, a smoke
    test) spends three quarters of its steps at useful learning rates instead of warming up
    throughout (the Trainer warns when it shortens the warmup)."""
    return min(configured, total_steps // 4)


def warn_if_warmup_shortened(cfg: OptimConfig, total_steps: int, is_main: bool) -> None:
    """Say so when `warmup_steps` cut optim.warmup_steps to a quarter of the run."""
    warmup = warmup_steps(cfg.warmup_steps, total_steps)
    if warmup < cfg.warmup_steps and is_main:
        log.warning(
            "optim.warmup_steps=%d is more than a quarter of this run's %d steps: warming "
            "up over %d steps instead",
            cfg.warmup_steps,
            total_steps,
            warmup,
        )
