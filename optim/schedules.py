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


def warmup_factor(step: int, warmup: int, cfg: OptimConfig) -> float:
    """The multiplier at warm-up step `step` < `warmup`: linear from optim.warmup_factor,
    reaching 1 on the step after the last warm-up step (the first step learns already: from
    0 it is (step + 1) / warmup); constant at optim.warmup_factor."""
    start = cfg.warmup_factor
    if cfg.warmup == "constant":
        return start
    return start + (1 - start) * (step + 1) / warmup


def main_factor(step: int, cfg: OptimConfig, length: int, steps_per_epoch: int) -> float:
    """The multiplier `step` steps after the warm-up, of a schedule `length` steps long."""
    if cfg.schedule == "cosine":  # to optim.min_lr_ratio on the last step
        progress = min(1.0, step / max(1, length - 1))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "step":
        return cfg.gamma ** (step // (cfg.step_epochs * steps_per_epoch))
    if cfg.schedule == "exponential":  # gamma per epoch, spread over its steps
        return cfg.gamma ** (step / steps_per_epoch)
    return 1.0


def lr_factor(
    step: int, cfg: OptimConfig, total_steps: int, steps_per_epoch: int | None = None
) -> float:
    """Multiplier of each group's peak LR at optimizer step `step` of `total_steps`: the
    warm-up, then optim.schedule counted from the warm-up's end. `steps_per_epoch` converts
    the epochs of step and exponential schedules and of optim.warmup_epochs."""
    warmup = warmup_length(cfg, total_steps, steps_per_epoch)
    if step < warmup:
        return warmup_factor(step, warmup, cfg)
    if steps_per_epoch is None and cfg.schedule in ("step", "exponential"):
        raise ValueError(f"optim.schedule={cfg.schedule} needs the steps per epoch")
    return main_factor(step - warmup, cfg, total_steps - warmup, steps_per_epoch or 1)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: OptimConfig,
    total_steps: int | Callable[[], int],
    steps_per_epoch: int | None = None,
) -> LambdaLR:
    """`lr_factor` over `total_steps`: a count, or a function giving it (a run knows its
    length only once it has resumed, which may be after the scheduler is built). LambdaLR
    multiplies each group's own initial lr: groups at other rates follow the same curve."""
    steps = total_steps if callable(total_steps) else lambda: total_steps

    def factor(step: int) -> float:  # a function: LambdaLR saves no state of it
        return lr_factor(step, cfg, steps(), steps_per_epoch)

    return LambdaLR(optimizer, factor)


def configured_warmup(cfg: OptimConfig, steps_per_epoch: int | None) -> int:
    """optim.warmup_epochs in steps when set, else optim.warmup_steps."""
    if cfg.warmup_epochs:
        if steps_per_epoch is None:
            raise ValueError("optim.warmup_epochs needs the steps per epoch")
        return cfg.warmup_epochs * steps_per_epoch
    return cfg.warmup_steps


def warmup_length(cfg: OptimConfig, total_steps: int, steps_per_epoch: int | None = None) -> int:
    """The warm-up as configured, but at most a quarter of the run: a short run (a subset, a
    smoke test) spends three quarters of its steps at useful learning rates instead of
    warming up throughout (the Trainer warns when it shortens the warm-up)."""
    return min(configured_warmup(cfg, steps_per_epoch), total_steps // 4)


def warn_if_warmup_shortened(
    cfg: OptimConfig, total_steps: int, steps_per_epoch: int, is_main: bool
) -> None:
    """Say so when `warmup_length` cut the configured warm-up to a quarter of the run."""
    configured = configured_warmup(cfg, steps_per_epoch)
    warmup = warmup_length(cfg, total_steps, steps_per_epoch)
    if warmup < configured and is_main:
        key = "warmup_epochs" if cfg.warmup_epochs else "warmup_steps"
        log.warning(
            "optim.%s=%d is more than a quarter of this run's %d steps: warming up over %d "
            "steps instead",
            *(key, getattr(cfg, key), total_steps, warmup),
        )
