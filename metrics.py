"""Training metrics reduced across ranks, and their sinks: metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json
import logging
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import distributed
from ckpt import atomic
from distributed import DistInfo
from engine import StepStats
from runpaths import RunPaths

log = logging.getLogger(__name__)

PHASES = ("data", "fwd_bwd", "optimizer")


class PhaseClock:
    """Per-step durations of the data, forward+backward and optimizer phases.

    Host clock on CPU. On CUDA, events recorded on the stream (the host runs ahead of the
    GPU) and read when the figures are reduced, which synchronises anyway.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, Any, Any]] = []
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, phase: str, start: Any, end: Any) -> None:
        if self.cuda and phase != "data":  # data wait is host time: the host waits for it
            self.pending.append((phase, start, end))
        elif self.cuda:
            self.seconds[phase] += 0.0 if start is None else end - start
        else:
            self.seconds[phase] += end - start

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last call."""
        for phase, start, end in self.pending:
            end.synchronize()
            self.seconds[phase] += start.elapsed_time(end) / 1000
        out, self.pending, self.seconds = self.seconds, [], dict.fromkeys(PHASES, 0.0)
        return out


class StragglerReport:
    """Every N steps: each rank's mean step time and arrival at the gradient all-reduce
    (seconds from the start of its step to its first gradient bucket), all-gathered; rank 0
    logs min, median and max and names the slowest rank."""

    def __init__(self, info: DistInfo, every: int) -> None:
        self.info = info
        self.every = every
        self.step_s: list[float] = []
        self.arrival_s: list[float] = []

    def add(self, step_s: float, arrival_s: float | None) -> None:
        self.step_s.append(step_s)
        if arrival_s is not None:
            self.arrival_s.append(arrival_s)

    def maybe_report(self, step: int) -> dict[str, Any] | None:
        """Collective every `every` steps (all ranks call it every step)."""
        if not self.every or step % self.every or not self.step_s:
            return None
        mine = (
            statistics.fmean(self.step_s),
            statistics.fmean(self.arrival_s) if self.arrival_s else float("nan"),
            socket.gethostname(),
        )
        self.step_s, self.arrival_s = [], []
        gathered = distributed.all_gather_object(mine)
        steps = [g[0] for g in gathered]
        arrivals = [g[1] for g in gathered]
        slowest = max(
            range(len(gathered)),
            key=lambda r: arrivals[r] if arrivals[r] == arrivals[r] else steps[r],
        )
        report = {
            "step_ms_min": 1000 * min(steps),
            "step_ms_median": 1000 * statistics.median(steps),
            "step_ms_max": 1000 * max(steps),
            "arrival_ms_min": 1000 * min(arrivals),
            "arrival_ms_median": 1000 * statistics.median(arrivals),
            "arrival_ms_max": 1000 * max(arrivals),
            "slowest_rank": slowest,
            "slowest_host": gathered[slowest][2],
        }
        log.info(
            "stragglers at step %d: step %.1f/%.1f/%.1f ms, arrival at the gradient all-reduce "
            "%.1f/%.1f/%.1f ms (min/median/max over %d ranks); slowest: rank %d on %s",
            step,
            report["step_ms_min"],
            report["step_ms_median"],
            report["step_ms_max"],
            report["arrival_ms_min"],
            report["arrival_ms_median"],
            report["arrival_ms_max"],
            len(gathered),
            slowest,
            report["slowest_host"],
        )
        return report


def flops_per_sample(model: nn.Module, sample: torch.Tensor, loss_fn: nn.Module) -> float:
    """Forward + backward FLOPs of one training sample (torch.utils.flop_counter), counted on a
    copy of the bare model so that no statistic of the real one moves."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    probe = copy.deepcopy(distributed.unwrap_model(model)).train()
    batch = sample[:2]
    counter = FlopCounterMode(display=False)
    if hasattr(loss_fn, "zero_targets"):  # the kind training passes (objective.losses)
        labels = loss_fn.zero_targets(len(batch), batch.device)
    else:
        labels = torch.zeros(len(batch), dtype=torch.long, device=batch.device)
    inputs = loss_fn.inputs(batch, labels) if hasattr(loss_fn, "inputs") else (batch,)
    with counter:  # the model's arguments as the objective gives them (objective.losses)
        loss_fn(probe(*inputs), labels).backward()
    return counter.get_total_flops() / len(batch)


# Dense datasheet peaks in FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name
# and dtype. float32 means TF32 tensor cores, which train.cuda_fast_math turns on.
DATASHEET_PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494e12},
    "H100 PCIe": {torch.bfloat16: 756e12, torch.float16: 756e12, torch.float32: 378e12},
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494e12},  # SXM
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 156e12},
    "L40S": {torch.bfloat16: 362e12, torch.float16: 362e12, torch.float32: 183e12},
    "L4": {torch.bfloat16: 121e12, torch.float16: 121e12, torch.float32: 60e12},
}


def datasheet_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The datasheet's dense peak for a known GPU, or None (the first matching name wins)."""
    for name, peaks in DATASHEET_PEAK_FLOPS.items():
        if name in device_name:
            return peaks.get(dtype)
    return None


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 4) -> float:
    """FLOP/s of the fastest of `repeats` square matmuls of `size` in `dtype` on `device`."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.mm(a, b)  # warm-up: kernel selection, allocation
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The peak FLOP/s that MFU divides by, and where it comes from: the datasheet for known
    GPUs, else the fastest large matmul this process runs (on CPU: with its torch threads)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = datasheet_peak_flops(name, dtype)
        if peak is not None:
            return peak, f"datasheet, {name}, {dtype}"
    size = 4096 if device.type == "cuda" else 1024
    return matmul_flops(device, dtype, size), f"measured {size}x{size} {dtype} matmul"


class TrainMeter:
    """Accumulates step statistics on the device; `reduce` turns them into global figures.

    Accumulating into device tensors keeps the hot loop free of device syncs; the one sync
    (and the one all-reduce) happens in `reduce`, which every rank calls at the same step.
    """

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.device = device
        self.world_size = world_size
        self.metric_names: tuple[str, ...] = ()  # metrics.factory's, from the first step
        self.metric_size = 0
        self._reset()

    def _reset(self) -> None:
        # loss sum, correct and samples of applied steps; data-wait seconds, step seconds,
        # samples of all steps (skipped ones too), seconds of forward+backward, of the
        # optimizer and of gradient all-reduce, steps; top-5 hits; steps skipped on a flag
        # decided on the device; then metrics.factory's [sum, count] pairs -- summed over ranks
        # in `reduce`
        self.totals = torch.zeros(12 + self.metric_size, device=self.device, dtype=torch.float64)
        self.allreduce_s = 0.0
        self.steps = 0
        self.data_wait_s = 0.0
        self.samples = 0
        self.skipped = 0
        self.started = time.perf_counter()

    def update(
        self, stats: StepStats, data_wait_s: float, skipped: bool | torch.Tensor = False
    ) -> None:
        """Add one step. A skipped step's (non-finite) loss stays out of the averages.
        `skipped`: a 0-dim bool tensor where the skip was decided on the device (counted there)."""
        if stats.metric is not None and not self.metric_size:  # the same shape on every rank
            self.metric_size, self.metric_names = len(stats.metric), stats.metric_names
            self.totals = torch.cat([self.totals, torch.zeros_like(stats.metric)])
        if isinstance(skipped, torch.Tensor):
            self._add(stats, skipped)
        elif skipped:
            self.skipped += 1  # the same on every rank: the skip decision is global
        else:
            self._add(stats, None)
        self.samples += stats.num_samples
        self.data_wait_s += data_wait_s
        self.steps += 1

    def _add(self, stats: StepStats, skipped: torch.Tensor | None) -> None:
        """The step's sums into the totals, no host read; zeros in their place where the
        device flag `skipped` is set (it is counted on the device too)."""
        top5 = stats.top5 if stats.top5 is not None else torch.zeros_like(stats.correct)
        kept = (stats.loss_sum, stats.correct, stats.labelled, top5)
        figures = torch.stack([k.to(torch.float64) for k in kept])
        metric = stats.metric
        if skipped is not None:
            figures = torch.where(skipped, 0.0, figures)
            metric = None if metric is None else torch.where(skipped, 0.0, metric)
            self.totals[11] += skipped
        self.totals[:3] += figures[:3]  # loss, correct, labelled
        self.totals[10] += figures[3]  # top-5
        if metric is not None:
            self.totals[12:] += metric

    def add_allreduce(self, seconds: float) -> None:
        self.allreduce_s += seconds

    def reduce(self, phases: dict[str, float] | None = None) -> dict[str, float]:
        """Global loss, accuracy, samples/s, data-wait fraction and per-step times (ms, mean
        over ranks) since the last call. `phases`: this rank's seconds per phase."""
        elapsed = time.perf_counter() - self.started
        phases = phases or {}
        self.totals[3] = self.data_wait_s
        self.totals[4] = elapsed
        self.totals[5] = self.samples
        self.totals[6] = phases.get("fwd_bwd", 0.0)
        self.totals[7] = phases.get("optimizer", 0.0)
        self.totals[8] = self.allreduce_s
        self.totals[9] = self.steps
        skipped = self.skipped
        reduced = distributed.all_reduce_sum(self.totals).tolist()
        loss_sum, correct, samples, wait, busy, all_samples, fwd_bwd, opt, allreduce, steps = (
            reduced[:10]
        )
        top5, metric = reduced[10], reduced[12:]
        skipped += round(reduced[11] / self.world_size)  # the same on every rank
        self._reset()
        mean_elapsed = busy / self.world_size
        per_step_ms = 1000 / steps if steps else 0.0  # sums over ranks / (steps x ranks) x ranks
        return {
            "loss": loss_sum / samples if samples else float("nan"),
            "accuracy": correct / samples if samples else float("nan"),
            "top5": top5 / samples if samples else float("nan"),
            "samples_per_s": all_samples / mean_elapsed if mean_elapsed > 0 else 0.0,
            "data_wait_frac": wait / busy if busy > 0 else 0.0,
            "skipped_steps": skipped,
            "step_ms": busy * per_step_ms,
            "data_ms": wait * per_step_ms,
            "fwd_bwd_ms": fwd_bwd * per_step_ms,
            "optimizer_ms": opt * per_step_ms,
            "allreduce_ms": allreduce * per_step_ms,
            **{  # metrics.factory's: name = sum / count
                name: metric[2 * i] / metric[2 * i + 1] if metric[2 * i + 1] else float("nan")
                for i, name in enumerate(self.metric_names)
            },
        }


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl and mirrors scalars to TensorBoard.

    Only the main rank writes (`enabled`); the figures it writes are already global.
    `holds_run_dir` (rank 0's run dir lease, rundir.Lease.valid: a look-up of the next
    generation on disk) is asked before each write: once another job has taken the run dir
    over, rows are dropped, not written over its own. TensorBoard's events are flushed with
    each row, so that its writer thread has nothing left to write after a takeover.
    Dropping, not raising: a write is made on rank 0 alone, outside any collective, and the
    training loop stops every rank together at the next step.
    """

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        tensorboard: bool,
        holds_run_dir: Callable[[], bool] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.tensorboard = tensorboard
        self.holds_run_dir = holds_run_dir or (lambda: True)
        self._dropping = False
        self._file = None
        self._tb = None
        # time_s of the last row kept from earlier attempts: a resumed run's time_s goes on
        # from there instead of restarting at 0 (main rank only; 0 elsewhere).
        self.time_offset_s = 0.0

    def open(self, resume_step: int = 0, pending_eval: bool = False) -> None:
        """Open the sinks (main rank only; a no-op elsewhere), continuing at `resume_step`.

        Rows of earlier attempts past the checkpoint resumed from (step > resume_step) are
        dropped, so every step is reported once: the resumed run writes them again. With
        `pending_eval` the checkpoint still owes the evaluation of its own step, so an eval
        row at that step (from an attempt that evaluated, then died before saving) goes too.
        TensorBoard drops its events past `resume_step` (purge_step).
        """
        if not self.enabled or not self._may_write():
            return
        path = RunPaths(self.run_dir).metrics
        self._truncate(path, resume_step, pending_eval)
        self._file = path.open("a", encoding="utf-8")
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only on rank 0

            self._tb = SummaryWriter(
                log_dir=str(RunPaths(self.run_dir).tensorboard), purge_step=resume_step + 1
            )

    def _truncate(self, path: Path, resume_step: int, pending_eval: bool) -> None:
        """Keep the rows up to the resumed step; rewrite the file atomically if any go."""
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except FileNotFoundError:
            return
        kept: list[str] = []
        for line in lines:
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):  # e.g. the last line, torn by a kill
                continue
            if step > resume_step or (
                pending_eval and step == resume_step and row.get("kind") == "eval"
            ):
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
            if isinstance(row.get("time_s"), int | float):
                self.time_offset_s = float(row["time_s"])
        if len(kept) == len(lines) and all(line.endswith("\n") for line in lines):
            return
        payload = "".join(kept).encode("utf-8")
        atomic.write_bytes(path, lambda f: f.write(payload))
        log.info(
            "metrics.jsonl: kept %d rows up to step %d, dropped %d from after it",
            len(kept),
            resume_step,
            len(lines) - len(kept),
        )

    def _may_write(self) -> bool:
        if self.holds_run_dir():
            return True
        if not self._dropping:
            log.error("this job no longer holds the run dir's lease: metrics are not written")
            self._dropping = True
        return False

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None or not self._may_write():
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()  # a crash must not lose the rows already reported
        if self._tb is not None:
            kind, step = row["kind"], row["step"]
            for key, value in row.items():
                if key not in ("kind", "step", "epoch") and isinstance(value, int | float):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
            self._tb.flush()  # now, while the run dir is this job's (checked above)

    def write_file(self, path: Path, payload: bytes) -> None:
        """A whole file beside metrics.jsonl (eval_report.json), replaced atomically, written
        as the rows are: by rank 0, while its job holds the run dir."""
        if self._file is None or not self._may_write():
            return
        atomic.write_bytes(path, lambda f: f.write(payload))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        # TensorBoard's writer flushes its queued events on close: after the lease is lost
        # they would land beside the new holder's, past the step it resumed from. Left
        # unflushed, they end with this process (the writer's thread is a daemon: tensorboard's
        # summary/writer/event_file_writer.py, _AsyncWriterThread).
        if self._tb is not None and self._may_write():
            self._tb.close()
