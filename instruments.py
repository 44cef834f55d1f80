"""What a run reports about itself, behind one object: the training loop sees `step()`.

`Instruments` holds the meter (loss, accuracy, samples/s, phase times, reduced across ranks
at log intervals), the metrics sinks, the stall watchdog's heartbeats, the straggler report,
the gradient all-reduce timer, the profiler, the progress bar and the FLOP count for MFU.
Nothing here changes what is trained; every collective it makes (the meter's reduction, the
straggler gather, the ledger's totals) happens at the same step on every rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import auto
import distributed
import resilience
import saturation
import scoring
from ckpt import fence, parts
from config import LogConfig
from distributed import AllReduceTimer, DistInfo
from engine import EvalResult, StepStats
from metrics import (
    MetricsWriter,
    PhaseClock,
    StragglerReport,
    TrainMeter,
    flops_per_sample,
    peak_flops,
)
from parallel import Layout
from runpaths import RunPaths

log = logging.getLogger("train")


class NvtxRange:
    """One NVTX range at a time, moved from phase to phase (log.nvtx; else nothing). Process-
    wide ranges (range_start/range_end), so that a range may end on another thread."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.current: int | None = None

    def begin(self, name: str) -> None:
        if self.enabled:
            self.end()
            self.current = torch.cuda.nvtx.range_start(name)

    def end(self) -> None:
        if self.current is not None:
            torch.cuda.nvtx.range_end(self.current)
            self.current = None


class StepTimer:
    """The marks inside one optimizer step (see `Instruments.step`)."""

    def __init__(self, instruments: Instruments, step: int) -> None:
        self.instruments, self.step = instruments, step
        self.started = time.perf_counter()
        instruments.nvtx.begin("data wait")
        self.data_wait_s = 0.0
        self.compute_mark: Any = None
        self.update_mark: Any = None
        self.stats: StepStats | None = None
        self.skipped: bool | torch.Tensor = False

    def loaded(self) -> None:
        """The step's micro-batches are on the device: forward and backward begin."""
        self.data_wait_s = time.perf_counter() - self.started
        self.instruments.watchdog.beat(self.step, "forward/backward")
        self.instruments.nvtx.begin("forward/backward")
        self.compute_mark = self.instruments.clock.mark()

    def agreed(self, stats: StepStats, skipped: bool | torch.Tensor) -> None:
        """Forward, backward and the ranks' verdict are done: the update begins."""
        clock = self.instruments.clock
        clock.add("fwd_bwd", self.compute_mark, clock.mark())
        self.stats, self.skipped = stats, skipped
        self.instruments.nvtx.begin("optimizer")
        self.update_mark = clock.mark()


class Instruments:
    """Meters, clocks, heartbeats, reports and profiler of one rank's training loop."""

    def __init__(
        self,
        cfg: LogConfig,
        info: DistInfo,
        comm_timer: AllReduceTimer | None,
        layout: Layout,
        settings: auto.Auto,
        writer: MetricsWriter,
        position: Any,  # parts.Position: its step and epoch label every row
        lr: Callable[[], float],
        paths: RunPaths,
        num_workers: int,
        stall_timeout_s: float,
        worker_pids: Callable[[], list[int]] = list,
    ) -> None:
        """`num_workers`: data.num_workers, for the saturation advice; `stall_timeout_s`: how
        long a rank may go without a heartbeat (dist.timeout_s in training)."""
        self.cfg, self.info, self.writer, self.position, self.lr = cfg, info, writer, position, lr
        self.paths, self.num_workers = paths, num_workers
        self.usage = saturation.Usage(info.device, worker_pids) if cfg.resources else None
        self.advisor = saturation.Advisor()
        self.nvtx = NvtxRange(cfg.nvtx)
        self.meter = TrainMeter(info.device, info.world_size)
        self.clock = PhaseClock(info.device)
        every = cfg.straggler_every_steps if info.world_size > 1 else 0
        self.stragglers = StragglerReport(info, every)
        self.watchdog = resilience.Watchdog(info, stall_timeout_s)
        self.allreduce_timer = comm_timer  # the strategy's (parallel.Parallel.comm_timer)
        self.layout, self.settings = layout, settings  # the resolved autos: compile, progress
        self.started = time.perf_counter()  # for time_s; `open` moves it back after a resume
        self.total_steps = 0
        self.skipped_total = 0
        self.flops_per_sample = 0.0  # forward + backward, 0 = not counted
        self.peak_flops = 0.0  # of one device in the training dtype, 0 = not known
        self.profiler: Any = None
        self.bar: Any = None

    # -- the run ---------------------------------------------------------------------------

    def open(self, resume_step: int, pending_eval: bool) -> None:
        """Collective: open metrics.jsonl and TensorBoard (rank 0), continuing at
        `resume_step` (see MetricsWriter.open); time_s goes on from the rows kept."""
        distributed.run_on_main(
            self.info,
            "opening metrics.jsonl and tensorboard",
            lambda: self.writer.open(resume_step, pending_eval),
        )
        self.started = time.perf_counter() - self.writer.time_offset_s

    def close(self) -> None:
        self.writer.close()

    @contextlib.contextmanager
    def running(self, total_steps: int) -> Iterator[None]:
        """Heartbeats, profiler and progress bar for the training loop; on a failure, each
        rank's last heartbeat in the log (which peer was behind)."""
        self.total_steps = total_steps
        self.watchdog.start()
        self.profiler = _profiler(
            self.cfg, self.paths.profile, self.info, self.position.step, total_steps
        )
        try:
            bar = _progress_bar(self.settings.progress, self.info, total_steps, self.position.step)
            with bar as self.bar:
                yield
        except RuntimeError as err:
            peers = self.watchdog.describe_peers()
            if peers:
                log.error(
                    "step %d failed (%s). Last heartbeat of each rank: %s",
                    self.position.step + 1,
                    err,
                    peers,
                )
            raise
        finally:
            if self.profiler is not None:
                self.profiler.stop()
                self.profiler = None
            self.watchdog.stop()

    def phase(self, name: str) -> None:
        """A heartbeat: this rank is now in `name` (evaluation, checkpointing, ...)."""
        self.watchdog.beat(self.position.step, name)

    @contextlib.contextmanager
    def nvtx_range(self, name: str) -> Iterator[None]:
        """An NVTX range around the block (log.nvtx)."""
        outer = NvtxRange(self.cfg.nvtx)
        outer.begin(name)
        try:
            yield
        finally:
            outer.end()

    @contextlib.contextmanager
    def step(self) -> Iterator[StepTimer]:
        """One optimizer step: call `loaded()` once the batches are in, `agreed(stats, skip)`
        after the verdict; at the end come the meter, the log row and the reports."""
        timer = StepTimer(self, self.position.step)
        self.watchdog.beat(timer.step, "data loading")
        yield timer
        self.nvtx.end()
        self.clock.add("optimizer", timer.update_mark, self.clock.mark())
        first_bucket, allreduce_s = (
            self.allreduce_timer.take() if self.allreduce_timer else (None, 0.0)
        )
        self.meter.add_allreduce(allreduce_s)
        arrival = None if first_bucket is None else first_bucket - timer.started
        self.stragglers.add(time.perf_counter() - timer.started, arrival)
        assert timer.stats is not None, "StepTimer.agreed was not called"
        self.meter.update(timer.stats, timer.data_wait_s, skipped=timer.skipped)
        if self.bar is not None:
            self.bar.update(1)
        if self.profiler is not None:
            self.profiler.step()
        done = self.position.step
        if done % self.cfg.every_steps == 0 or done == self.total_steps:
            self.log_train()
        report = self.stragglers.maybe_report(done)  # a collective every N steps
        if report is not None:
            self.writer.write({"kind": "stragglers", "step": done, **report})

    # -- rows ------------------------------------------------------------------------------

    def log_train(self) -> None:
        figures = self.meter.reduce(self.clock.take())  # a collective: every rank logs together
        self.skipped_total += figures["skipped_steps"]
        if self.usage is not None:  # one more, at the same step on every rank
            samples = distributed.all_gather_floats(self.usage.sample(), self.info.device)
            figures |= saturation.reduce(samples)
            if self.info.is_main:
                on_gpu = self.info.device.type == "cuda"
                advice = saturation.advice(
                    figures,
                    self.num_workers,
                    on_gpu,
                    self.settings.compile,
                    self.settings.loader,
                    self.settings.decode,
                )
                self.advisor.consider(advice)
        if self.flops_per_sample:
            per_rank = self.flops_per_sample * figures["samples_per_s"] / self.info.world_size
            figures["tflops_per_rank"] = per_rank / 1e12
            if self.peak_flops:
                figures["mfu"] = per_rank / self.peak_flops
        pos, lr = self.position, self.lr()
        comm = f"all-reduce {figures['allreduce_ms']:.1f}"
        if self.layout.collectives_inside_step:
            # all-gathers and reduce-scatters run inside forward and backward, not timed apart
            figures["allreduce_ms"] = None
            comm = "collectives inside fwd+bwd"
        log.info(
            "step %d epoch %d loss %.4f acc %.4f top5 %.4f%s lr %.4g %.0f samples/s data-wait "
            "%.1f%% step %.1f ms (fwd+bwd %.1f, optimizer %.1f, %s)%s",
            pos.step,
            pos.epoch,
            figures["loss"],
            figures["accuracy"],
            figures["top5"],
            _named(figures, self.meter.metric_names),
            lr,
            figures["samples_per_s"],
            100 * figures["data_wait_frac"],
            figures["step_ms"],
            figures["fwd_bwd_ms"],
            figures["optimizer_ms"],
            comm,
            f" skipped {self.skipped_total}" if self.skipped_total else "",
        )
        self.writer.write(
            {
                "kind": "train",
                "step": pos.step,
                "epoch": pos.epoch,
                "time_s": time.perf_counter() - self.started,
                "lr": lr,
                **figures,
                "skipped_steps_total": self.skipped_total,
            }
        )

    def log_eval(
        self, result: EvalResult, ledger: parts.SampleLedger, classes: Sequence[str] | None
    ) -> None:
        """The evaluation row, with the epoch's sample ledger so far (a collective), and the
        report with per-class accuracy and confusion matrix (rank 0, eval_report.json)."""
        totals, per_rank = ledger.totals()
        pos = self.position
        log.info(
            "eval step %d epoch %d loss %.4f accuracy %.4f top-5 %.4f%s on %d samples; epoch "
            "trained on %d samples, digest %s",
            pos.step,
            pos.epoch,
            result.loss,
            result.accuracy,
            result.top5,
            _named(result.metrics, tuple(result.metrics)),
            result.num_samples,
            totals[0],
            parts.digest(totals),
        )
        self.writer.write(
            {
                "kind": "eval",
                "step": pos.step,
                "epoch": pos.epoch,
                "time_s": time.perf_counter() - self.started,
                "loss": result.loss,
                "accuracy": result.accuracy,
                "top5": result.top5,
                **result.metrics,
                "num_samples": result.num_samples,
                "epoch_samples_seen": totals[0],
                "epoch_sample_digest": parts.digest(totals),
                "sample_digest_per_rank": [parts.digest(part) for part in per_rank],
            }
        )
        if result.class_count and self.info.is_main:
            payload = json.dumps(scoring.report(result, classes, pos.step))
            self.writer.write_file(self.paths.eval_report, payload.encode())

    def count_flops(
        self, model: nn.Module, sample: torch.Tensor, loss_fn: nn.Module, dtype: torch.dtype
    ) -> None:
        """FLOPs per training sample, and (rank 0) the device's peak FLOP/s, for MFU.

        The probe draws random numbers (the matmul operands, the probe model's dropout
        masks): it runs between the generators' restore from a checkpoint and the first
        resumed step, so the generators are put back as they were, or resuming would not
        continue the same run.
        """
        saved_rng = parts.rng_state()
        source = ""
        try:
            self.flops_per_sample = flops_per_sample(model, sample, loss_fn)
            if self.info.is_main:
                self.peak_flops, source = peak_flops(self.info.device, dtype)
        finally:
            parts.set_rng_state(saved_rng)
        if self.info.is_main:
            log.info(
                "model: %.3g GFLOP per training sample (forward + backward); MFU divides by a "
                "peak of %.3g TFLOP/s (%s)",
                self.flops_per_sample / 1e9,
                self.peak_flops / 1e12,
                source,
            )


def _named(figures: dict[str, Any], names: Sequence[str]) -> str:
    """metrics.factory's figures for a log line: ' name value' each."""
    return "".join(f" {name} {figures[name]:.4f}" for name in names)


def _profiler(
    cfg: LogConfig, trace_dir: Path, info: DistInfo, first_step: int, total_steps: int
) -> Any:
    """torch.profiler recording optimizer steps [START, END) of log.profile_steps (those
    still ahead of `first_step`, and before the run's last), written under `trace_dir` for
    TensorBoard's profiler tab; None when off. A window outside the run is said, not ignored:
    a trace is written only once its window is complete."""
    if not cfg.profile_steps:
        return None
    given = f"log.profile_steps={','.join(map(str, cfg.profile_steps))}"
    start, end = cfg.profile_steps
    start, end = max(start, first_step), min(end, total_steps)
    if start >= end:
        if info.is_main:
            where = f"steps {first_step}-{total_steps - 1}" if first_step < total_steps else "none"
            log.warning("%s: no profiler trace; the steps left to this run: %s", given, where)
        return None
    if end < cfg.profile_steps[1] and info.is_main:
        log.warning("%s: the run ends at step %d, so the trace ends there", given, total_steps)
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    ahead = start - first_step  # steps before the window; one of them warms the profiler up
    warmup = 1 if ahead else 0
    activities = [ProfilerActivity.CPU]
    if info.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)

    def on_trace_ready(prof: Any) -> None:
        fence.check(trace_dir)  # the run dir may have been taken over since the window began
        tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{info.rank}")(prof)
        log.info("profiler trace of steps %d-%d written under %s", start, end - 1, trace_dir)

    prof = profile(
        activities=activities,
        schedule=schedule(
            skip_first=ahead - warmup, wait=0, warmup=warmup, active=end - start, repeat=1
        ),
        on_trace_ready=on_trace_ready,
        record_shapes=True,
    )
    prof.start()
    return prof


@contextlib.contextmanager
def _progress_bar(progress: bool, info: DistInfo, total: int, initial: int) -> Iterator[Any]:
    """The bar (None when off). While it is shown, log lines go through tqdm.write, which
    clears the bar, writes the line and draws the bar again below it: written straight to
    the terminal they landed on the bar's line."""
    if not (info.is_main and progress):
        yield None
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with (
        logging_redirect_tqdm(),
        tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False) as bar,
    ):
        yield bar
