"""What every benchmark shares: how long to measure, and how rounds are timed and summarised.

Each figure is the median of `repeats` timed rounds after warm-up, shown with min and max;
clocks are read after a CUDA synchronize; the sides of a ratio take turns round by round.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import distributed
from distributed import DistInfo

Batch = tuple[torch.Tensor, torch.Tensor]
Stats = tuple[tuple[float, ...], tuple[float, ...]]  # per-channel mean and std, in [0, 1] units


@dataclass(frozen=True)
class Plan:
    """How long to measure; `--quick` shrinks the counts for the smoke test."""

    repeats: int  # timed rounds per figure, after warm-up
    warmup_steps: int  # untimed optimizer steps before the first round
    replay_batches: int  # distinct batches both training loops cycle through
    loader_batches: int  # batches per timed round of the loader
    scaling_steps: int  # optimizer steps per timed round of the spawned ranks
    min_round_s: float  # a matmul round lasts at least this long
    log_every_steps: int | None  # overrides log.every_steps (a round holds one log row)
    quick: bool = False  # the smoke test's plan (kept by --repeats): the slowest parts left out


FULL = Plan(
    repeats=5,
    warmup_steps=5,
    replay_batches=16,
    loader_batches=40,
    scaling_steps=20,
    min_round_s=0.25,
    log_every_steps=None,
)
QUICK = Plan(
    repeats=3,
    warmup_steps=1,
    replay_batches=4,
    loader_batches=5,
    scaling_steps=3,
    min_round_s=0.05,
    log_every_steps=5,
    quick=True,
)


# ---------------------------------------------------------------------------------------------
# Timing


@dataclass(frozen=True)
class Spread:
    """Median and range of a figure over the timed rounds, and each round's value."""

    median: float
    min: float
    max: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), tuple(values))

    def show(self, fmt: str = "{:,.0f}") -> str:
        return f"{fmt.format(self.median)} [{fmt.format(self.min)}-{fmt.format(self.max)}]"


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds `fn` takes, its device work included (CUDA runs asynchronously to the clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, info: DistInfo
) -> dict[str, list[float]]:
    """Seconds of each function per round, the order reversed every other round.

    Interleaving makes drift (other jobs on the machine, clocks, caches) hit every side of a
    ratio alike; the barrier starts every rank's round together.
    """
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats):
        for name in list(fns) if round_ % 2 == 0 else list(reversed(fns)):
            distributed.barrier(info)
            seconds[name].append(timed(fns[name], info.device))
    return seconds


def rates(seconds: list[float], amount: float) -> Spread:
    """`amount` per second, round by round."""
    return Spread.of([amount / s for s in seconds])


def log_to(path: Path) -> None:
    """The pipeline's log lines go to a file: produced (their cost is real), not shown."""
    logging.basicConfig(
        filename=path,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
