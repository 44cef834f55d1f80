"""What keeps a long run alive or stops it cleanly: per-step agreement across ranks (skip a
non-finite step, stop for preemption) and the stall watchdog. (The sample ledger and the
random generators' states are checkpoint parts: ckpt/parts.py.)

Exit codes of train.py (also in docs/fault-tolerance.md, "Exit codes"):
    0   finished
    1   unexpected error (a traceback says where)
    2   bad input: config, data path or checkpoint (retrying cannot help)
    3   diverged: train.max_nonfinite_steps consecutive non-finite steps
    4   stalled: a rank made no progress for dist.timeout_s (the watchdog aborted it)
    75  preempted: a checkpoint was written at the step boundary after the signal; resubmit
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import distributed
import exitcodes
from distributed import DistInfo

log = logging.getLogger(__name__)


class DivergedError(RuntimeError):
    """Too many consecutive optimizer steps with a non-finite loss or gradient."""


class Preempted(Exception):
    """A preemption signal arrived; the checkpoint at `step` is written. Not an error."""

    def __init__(self, signal_name: str, step: int) -> None:
        super().__init__(f"preempted by {signal_name} at step {step}")
        self.signal_name = signal_name
        self.step = step


# ---------------------------------------------------------------------------------------------
# Preemption signals


class PreemptionHandler:
    """Records that a preemption signal arrived; the training loop acts at a step boundary.

    The handler only sets a flag (a signal can land in the middle of a collective, where
    nothing else is safe to do). The flag travels in the per-step all-reduce of `StepGuard`,
    so every rank stops after the same step even when only one received the signal. What
    must happen when the signal arrives, not at that step (`on_stop`: the crash-loop breaker
    uncounts the attempt), runs on a watcher thread woken through `signal.set_wakeup_fd`.

    Schedulers signal every process of a job, often more than once and with mixed signals:
    Slurm's SIGUSR2 reaches a worker directly and, milliseconds later, the SIGTERM torchrun
    forwards; a Kubernetes or systemd stop repeats SIGTERM. Every one of them after the first
    is the same request and is only logged; what ends a run that will not stop is the
    scheduler's SIGKILL (Slurm's KillWait, the pod's grace period, torchrun's shutdown
    timeout), or SIGQUIT by hand.
    """

    def __init__(self, signal_names: tuple[str, ...]) -> None:
        self.signals = [signal.Signals[name] for name in signal_names]
        self.received: str | None = None
        self.repeats = 0
        self._previous: dict[signal.Signals, Any] = {}
        self._on_stop: list[Callable[[], None]] = []
        self._stopped = False  # a stop signal arrived and the on_stop callbacks ran
        self._lock = threading.Lock()  # taken by threads only, never by the handler
        self._pipe: tuple[int, int] | None = None  # (read, write) of the wakeup pipe
        self._previous_wakeup = -1
        self._watcher: threading.Thread | None = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            self.repeats += 1  # no logging here: a handler may interrupt the logging module
            return
        self.received = signal.Signals(signum).name

    def install(self, early: list[int] | None = None) -> None:
        """Handle the signals from now on; `early` lists signals recorded before this (by the
        entry point's first lines, while torch was being imported)."""
        for signum in early or ():
            self._handle(signum, None)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._start_watcher()
        if self.received is not None:
            self._stop_now()

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Run `callback` once, on the watcher thread, as soon as a stop signal arrives (here
        and now if one already has): what must not wait for the next step boundary, which an
        evaluation or a long save may put past the scheduler's grace. It must be thread-safe."""
        with self._lock:
            if not self._stopped:
                self._on_stop.append(callback)
                return
        callback()

    def _start_watcher(self) -> None:
        """The C-level part of Python's signal handling writes each signal's number to the
        wakeup fd at once (signal.set_wakeup_fd), even while the main thread is inside a long
        C call where the Python handler cannot run yet; a thread reads it."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd refuses a blocking fd
        self._pipe = read_fd, write_fd
        self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="preemption-watcher", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        assert self._pipe is not None
        stops = {int(sig) for sig in self.signals}
        while True:
            try:
                numbers = os.read(self._pipe[0], 64)
            except OSError:
                return
            if not numbers:  # restore() closed the write end
                return
            if stops.intersection(numbers):  # other handled signals (SIGCHLD) wake it too
                self._stop_now()

    def _stop_now(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            callbacks, self._on_stop = self._on_stop, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a safeguard's failure must not stop the stop
                log.exception("acting on the stop signal at once failed")

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            os.close(self._pipe[1])  # the watcher reads the end of the pipe and returns
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            if self._watcher is None or not self._watcher.is_alive():
                os.close(self._pipe[0])  # still in a callback (a hung NFS): left open, or its
            self._pipe = self._watcher = None  # next read could take a reused fd's bytes


# ---------------------------------------------------------------------------------------------
# Per-step agreement


@dataclass(frozen=True)
class Verdict:
    # A non-finite loss or gradient somewhere: leave params and optimizer alone. A 0-dim bool
    # tensor on the device where verdicts.DeviceVerdicts decides it there (never read on the host).
    skip: bool | torch.Tensor
    stop: str | None  # name of the preemption signal some rank received, or None
    nonfinite_ranks: tuple[int, ...]  # ranks whose loss was not finite
    writes_done: bool = True  # no rank's checkpoint writer is still writing
    load_failed: bool = False  # a rank could not load its batch: skip, checkpoint, stop


class StepGuard:
    """One small all-reduce per optimizer step that makes every per-rank decision global.

    Slots: one per rank for "my loss is not finite", one for "my gradient norm is not finite"
    (the norm is taken after DDP's all-reduce, so it is the same on every rank, but a rank
    without DDP, world size 1, still needs it), one for "a preemption signal arrived here",
    one for "my checkpoint writer is still writing" (a sharded checkpoint's manifest is
    written at the first step where no rank is), one for "my batch failed to load" (it ran on
    stand-in batches: the step is skipped, uncounted, and the run stops after a checkpoint).
    The result is read on the host once per step: free on CPU, one device sync on CUDA
    (verdicts.DeviceVerdicts reads the non-finite flags a step late instead).
    """

    def __init__(self, info: DistInfo, max_consecutive: int, check_grad: bool) -> None:
        self.info = info
        self.max_consecutive = max_consecutive
        self.check_grad = check_grad  # False under fp16, where the GradScaler owns inf steps
        self.consecutive = 0
        self.skipped_total = 0
        self._signal_code: dict[str, int] = {}
        self._flags = torch.zeros(info.world_size + 4, device=info.device)

    def agree(
        self,
        loss_sum: torch.Tensor,
        grad_norm: torch.Tensor,
        stop_signal: str | None,
        step: int,
        writing: bool = False,
        load_failed: bool = False,
    ) -> Verdict:
        world = self.info.world_size
        flags = self._flags
        self.mark_nonfinite(flags, loss_sum, grad_norm)
        if stop_signal is not None:
            flags[world + 1] = 1.0
        if writing:
            flags[world + 2] = 1.0
        if load_failed:
            flags[world + 3] = 1.0
        values = distributed.all_reduce_sum(flags).tolist()
        writes_done = values[world + 2] == 0
        if values[world + 3] > 0:  # not a non-finite step: neither logged nor counted as one
            return Verdict(True, stop_signal, (), writes_done, load_failed=True)
        stop = None
        if values[world + 1] > 0:
            stop = stop_signal or "a signal received by another rank"
        skip, nonfinite_ranks = self.judge(values[: world + 1], step)
        return Verdict(skip, stop, nonfinite_ranks, writes_done=writes_done)

    def mark_nonfinite(
        self, flags: torch.Tensor, loss_sum: torch.Tensor, grad_norm: torch.Tensor
    ) -> None:
        """Zero `flags` and set this rank's non-finite slots: its loss at [rank], the gradient
        norm at [world size] (the layout `judge` reads), on the device, with no host read."""
        flags.zero_()
        flags[self.info.rank] = (~torch.isfinite(loss_sum)).float()
        if self.check_grad:
            flags[self.info.world_size] = (~torch.isfinite(grad_norm)).float()

    def judge(self, values: list[float], step: int) -> tuple[bool, tuple[int, ...]]:
        """Whether the step is skipped, from its all-reduced flags ([non-finite loss of each
        rank..., non-finite gradient]), and the ranks whose loss was not finite: counted,
        logged, and raised as DivergedError (on every rank alike) after too many in a row."""
        world = self.info.world_size
        nonfinite_ranks = tuple(rank for rank in range(world) if values[rank] > 0)
        skip = bool(nonfinite_ranks) or values[world] > 0
        if not skip:
            self.consecutive = 0
            return False, ()
        self.consecutive += 1
        self.skipped_total += 1
        where = f"loss on rank(s) {list(nonfinite_ranks)}" if nonfinite_ranks else "gradient"
        log.warning(
            "step %d: non-finite %s; skipped the optimizer step (%d in a row, %d in total)",
            step,
            where,
            self.consecutive,
            self.skipped_total,
        )
        if self.consecutive >= self.max_consecutive:
            raise DivergedError(
                f"{self.consecutive} consecutive optimizer steps had a non-finite loss or "
                f"gradient (the last at step {step}, {where}), "
                f"train.max_nonfinite_steps={self.max_consecutive}: training diverged. Lower "
                "optim.lr, raise optim.warmup_steps or set optim.grad_clip, and resume from a "
                "checkpoint before the divergence"
            )
        return True, nonfinite_ranks


# ---------------------------------------------------------------------------------------------
# Stall watchdog


# Phases that wait in collectives for other ranks: the watchdog allows them the collective
# timeout and one more grace, so that the collective's own error (naming the peers) comes first.
COLLECTIVE_PHASES = ("forward/backward", "evaluation", "checkpointing")


class Watchdog:
    """Aborts this rank when it makes no progress for `timeout_s`, naming where it stood.

    The training loop calls `beat(step, phase)` (two attribute writes, no I/O). A background
    thread checks the time since the last beat; past the limit it logs the phase, dumps every
    thread's stack and exits with exit code 4 (stalled), so torchrun restarts the group instead of
    it hanging until an NCCL watchdog (if any) notices. It also publishes each rank's last beat to
    the process group's store, so a rank whose collective times out can say which peer is
    behind (`describe_peers`).
    """

    def __init__(self, info: DistInfo, timeout_s: float) -> None:
        self.info = info
        self.timeout_s = timeout_s
        self.step = 0
        self.phase = "starting"
        self.last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = _default_store()
        self._restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def beat(self, step: int, phase: str) -> None:
        self.step, self.phase, self.last_beat = step, phase, time.monotonic()

    def start(self) -> None:
        self.beat(self.step, self.phase)
        self._thread = threading.Thread(target=self._run, name="stall-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def limit_s(self, phase: str) -> float:
        if phase in COLLECTIVE_PHASES:
            return self.timeout_s + 2 * distributed.collective_grace_s(self.timeout_s)
        return self.timeout_s

    def _run(self) -> None:
        interval = min(2.0, self.timeout_s / 10)
        publish_every, published = max(1.0, interval), 0.0
        host = socket.gethostname()
        while not self._stop.wait(interval):
            now = time.monotonic()
            step, phase, last_beat = self.step, self.phase, self.last_beat
            idle = now - last_beat
            if idle > self.limit_s(phase):
                self._abort(idle)
            if self._store is not None and now - published >= publish_every:
                published = now
                beat = {
                    "step": step,
                    "phase": phase,
                    "since": time.time() - idle,  # wall time of the last beat
                    "host": host,
                    "attempt": self._restart,
                }
                # A store that went away means the job is ending anyway.
                with contextlib.suppress(Exception):
                    self._store.set(f"heartbeat/{self.info.rank}", json.dumps(beat))

    def _abort(self, idle: float) -> None:
        message = (
            f"rank {self.info.rank} on {socket.gethostname()} made no progress for {idle:.1f} s "
            f"(dist.timeout_s={self.timeout_s:g}) in {self.phase} of step {self.step + 1}: "
            f"aborting with exit code {exitcodes.EXIT_STALLED} so that the job restarts. Stacks:"
        )
        log.error(message)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(exitcodes.EXIT_STALLED)

    def describe_peers(self) -> str:
        """Each rank's last published step and phase, the laggards first ('' without a store)."""
        if self._store is None:
            return ""
        rows = []
        now = time.time()
        for rank in range(self.info.world_size):
            try:
                # check, not wait: a rank that never published must not cost a timeout each
                if not self._store.check([f"heartbeat/{rank}"]):
                    raise KeyError(rank)
                beat = json.loads(self._store.get(f"heartbeat/{rank}"))
            except Exception:
                rows.append((-1, f"rank {rank}: no heartbeat"))
                continue
            rows.append(
                (
                    int(beat["step"]),
                    f"rank {rank} on {beat['host']}: in {beat['phase']} of step "
                    f"{int(beat['step']) + 1} for {now - float(beat['since']):.1f} s",
                )
            )
        rows.sort(key=lambda row: row[0])
        return "; ".join(text for _, text in rows)


def _default_store() -> Any:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private helper: without it the watchdog still works, only quieter
        return None
