"""Training metrics reduced across ranks, and their sinks: metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

import distributed
from engine import StepStats


class TrainMeter:
    """Accumulates step statistics on the device; `reduce` turns them into global figures.

    Accumulating into device tensors keeps the hot loop free of device syncs; the one sync
    (and the one all-reduce) happens in `reduce`, which every rank calls at the same step.
    """

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.device = device
        self.world_size = world_size
        self._reset()

    def _reset(self) -> None:
        # loss sum, correct and samples of applied steps; data-wait seconds, step seconds,
        # samples of all steps (skipped ones too) -- summed over ranks in `reduce`
        self.totals = torch.zeros(6, device=self.device, dtype=torch.float64)
        self.data_wait_s = 0.0
        self.samples = 0
        self.skipped = 0
        self.started = time.perf_counter()

    def update(self, stats: StepStats, data_wait_s: float, skipped: bool = False) -> None:
        """Add one step. A skipped step's (non-finite) loss stays out of the averages."""
        if skipped:
            self.skipped += 1  # the same on every rank: the skip decision is global
        else:
            self.totals[0] += stats.loss_sum
            self.totals[1] += stats.correct
            self.totals[2] += stats.num_samples
        self.samples += stats.num_samples
        self.data_wait_s += data_wait_s

    def reduce(self) -> dict[str, float]:
        """Global loss, accuracy, samples/s and data-wait fraction since the last call."""
        elapsed = time.perf_counter() - self.started
        self.totals[3] = self.data_wait_s
        self.totals[4] = elapsed
        self.totals[5] = self.samples
        skipped = self.skipped
        loss_sum, correct, samples, wait, busy, all_samples = distributed.all_reduce_sum(
            self.totals
        ).tolist()
        self._reset()
        mean_elapsed = busy / self.world_size
        return {
            "loss": loss_sum / samples if samples else float("nan"),
            "accuracy": correct / samples if samples else float("nan"),
            "samples_per_s": all_samples / mean_elapsed if mean_elapsed > 0 else 0.0,
            "data_wait_frac": wait / busy if busy > 0 else 0.0,
            "skipped_steps": skipped,
        }


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl and mirrors scalars to TensorBoard.

    Only the main rank writes (`enabled`); the figures it writes are already global.
    """

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.tensorboard = tensorboard
        self._file = None
        self._tb = None

    def open(self) -> None:
        """Open the sinks (main rank only; a no-op elsewhere)."""
        if not self.enabled:
            return
        self._file = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only on rank 0

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()  # a crash must not lose the rows already reported
        if self._tb is not None:
            kind, step = row["kind"], row["step"]
            for key, value in row.items():
                if key not in ("kind", "step", "epoch") and isinstance(value, int | float):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
