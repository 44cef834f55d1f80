"""Where the ranks' verdict on a step is read (train.verdict): on the host every step, or
with the skip decided on the device and the vote read a step late.

A step's verdict (resilience.StepGuard) makes every rank's facts global: a non-finite loss or
gradient (skip the step), a preemption signal (stop after it), a checkpoint writer still
writing, a batch that failed to load. `HostVerdicts` all-reduces them and reads the result
every step: free on CPU, one device sync per step on CUDA, where the host then waits for the
whole step before it can queue the next one.

`DeviceVerdicts` splits them. The facts the host knows (signal, writer, load failure) are
all-reduced on the CPU (gloo; the default group on CPU runs, a gloo group beside NCCL), started
before the forward and waited for after it: every rank stops at the same step (a signal landing
during a forward and backward counts at the next one). The non-finite flags are all-reduced on
the device into a 0-dim flag: the fused optimizer skips on it (engine.apply_update's
`found_inf`), the BatchNorm statistics are restored on it, the meters drop the step on it. The
host reads the flags a step late, after the next step's forward and backward are queued, from
page-locked memory behind an event (`Ballot`; `settle`: the warning, the counts, DivergedError),
and at once where the run stops, saves or ends a segment.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

import distributed
import engine
from config import Config, ConfigError
from distributed import DistInfo
from engine import BufferSnapshot, StepStats
from resilience import DivergedError, StepGuard, Verdict

log = logging.getLogger(__name__)

Facts = Callable[[], Any]  # a host fact, asked when the vote is taken


class HostVerdicts:
    """The vote read on the host every step (resilience.StepGuard.agree)."""

    on_device = False

    def __init__(self, guard: StepGuard, optimizer: Any, scaler: Any, buffers: BufferSnapshot):
        self.guard, self.optimizer, self.scaler, self.buffers = guard, optimizer, scaler, buffers
        # Called before DivergedError leaves a vote (raised on every rank alike: a collective
        # is safe there), e.g. to give a sharded checkpoint in flight its manifest.
        self.on_diverged: Callable[[], None] = lambda: None

    @contextlib.contextmanager
    def diverging(self) -> Iterator[None]:
        try:
            yield
        except DivergedError:
            self.on_diverged()
            raise

    def open(self, stop: Facts, writing: Facts, load_failed: bool) -> None:
        """Once the step's batches are loaded: the facts this rank's host knows, `stop` (the
        preemption signal received, if any) and `writing` (a checkpoint writer busy) asked
        when the vote is taken (here: after the backward)."""
        self.asked, self.load_failed = (stop, writing), load_failed

    def agree(self, stats: StepStats, step: int) -> Verdict:
        """Every rank's verdict on the step, after its forward and backward."""
        stop, writing = self.asked
        with self.diverging():
            return self.guard.agree(
                stats.loss_sum, stats.grad_norm, stop(), step, bool(writing()), self.load_failed
            )

    def apply(self, verdict: Verdict, after_applied: Callable[[], None] | None = None) -> None:
        """The optimizer step (or its skip), the statistics restored where it is skipped;
        `after_applied` (the weight average's update) only after an applied step."""
        engine.apply_update(self.optimizer, self.scaler, skip=bool(verdict.skip))
        if verdict.skip:
            self.buffers.restore()
        elif after_applied is not None:
            after_applied()

    def settle(self) -> tuple[bool, tuple[int, ...]]:
        """Nothing is left to read: every verdict was read at its step."""
        return False, ()

    def close(self) -> None:
        """Nothing to release."""


class DeviceVerdicts(HostVerdicts):
    """The skip decided on the device, the host facts voted on the CPU (see the module)."""

    on_device = True

    def __init__(
        self,
        guard: StepGuard,
        optimizer: Any,
        scaler: Any,
        buffers: BufferSnapshot,
        host_group: Any = None,
    ) -> None:
        super().__init__(guard, optimizer, scaler, buffers)
        self.info = guard.info
        self.host_group = host_group  # None: the default group (gloo already)
        self.pending: Ballot | None = None  # the flags of a step not read yet
        self.spare: Ballot | None = None  # a read ballot's buffers, for the next step
        self.state_made = False

    def open(self, stop: Facts, writing: Facts, load_failed: bool) -> None:
        """Start the vote on the host's facts, asked now, before the forward (a signal that
        arrives during the forward and backward is voted on at the next step, one step later
        than train.verdict=host); gloo's thread works while the device is fed."""
        self.stop = stop()
        facts = [self.stop is not None, bool(writing()), load_failed]
        self.host = torch.tensor(facts, dtype=torch.float32)
        self.work = None
        if distributed.active():
            self.work = dist.all_reduce(self.host, group=self.host_group, async_op=True)

    def agree(self, stats: StepStats, step: int) -> Verdict:
        info, world = self.info, self.info.world_size
        ballot, self.spare = self.spare or Ballot.new(world + 1, info.device), None
        flags = ballot.flags
        self.guard.mark_nonfinite(flags, stats.loss_sum, stats.grad_norm)
        distributed.all_reduce_sum(flags)
        ballot.post(step)
        if self.work is not None:
            self.work.wait()
        stopped, writing, load_failed = (value > 0 for value in self.host.tolist())
        self.settle()  # the previous step's flags: waits for that step's copy, not this one's
        stop_name = (self.stop or "a signal received by another rank") if stopped else None
        if load_failed:  # not a non-finite step: neither logged nor counted as one
            self.spare = ballot
            return Verdict(True, stop_name, (), not writing, load_failed=True)
        self.pending = ballot
        if not self.state_made and not self.optimizer_state_made():
            skip, ranks = self.settle()  # read at once: see `optimizer_state_made`
            return Verdict(skip, stop_name, ranks, writes_done=not writing)
        return Verdict(flags.sum() > 0, stop_name, (), writes_done=not writing)

    def optimizer_state_made(self) -> bool:
        """Whether the optimizer holds state for every parameter this step updates. Until it
        does, the step is decided on the host, so that a skipped step leaves the state as the
        host verdict does: torch's fused SGD makes a first step's momentum buffers with
        `torch.empty_like` (torch/optim/sgd.py, `_fused_sgd`) and its kernel skips on
        `found_inf` before writing them (uninitialised memory kept as the momentum); fused
        Adam and AdamW make zeros and a step count that a skipped step leaves at 0. Once every
        trainable parameter has state the answer is kept; a parameter that has not yet had a
        gradient (used on some steps only) keeps it asked at each step."""
        opt = self.optimizer
        stateful = [
            p
            for group in opt.param_groups
            if not (isinstance(opt, torch.optim.SGD) and group["momentum"] == 0)
            for p in group["params"]
            if p.requires_grad
        ]
        self.state_made = all(opt.state.get(p) for p in stateful)
        return self.state_made or all(opt.state.get(p) for p in stateful if p.grad is not None)

    def apply(self, verdict: Verdict, after_applied: Callable[[], None] | None = None) -> None:
        if not isinstance(verdict.skip, torch.Tensor):
            super().apply(verdict, after_applied)
            return
        assert after_applied is None, "the weight average is updated on host verdicts"
        self.buffers.restore_where(verdict.skip)
        engine.apply_update(self.optimizer, self.scaler, found_inf=verdict.skip.float())

    def settle(self) -> tuple[bool, tuple[int, ...]]:
        """Read the step still pending: log it, count it, and raise DivergedError on every
        rank alike after too many non-finite steps in a row. On CUDA this waits for that
        step's copy of its flags only, not for the work queued after it. Returns whether it
        was skipped and the ranks whose loss was not finite (no step pending: not skipped)."""
        ballot, self.pending = self.pending, None
        if ballot is None:
            return False, ()
        try:
            with self.diverging():
                return self.guard.judge(ballot.read(), ballot.step)
        finally:
            self.spare = ballot

    def close(self) -> None:
        if self.host_group is not None and dist.is_initialized():  # not after the default one
            dist.destroy_process_group(self.host_group)
        self.host_group = None


class Ballot:
    """One step's non-finite flags on the device and, on CUDA, their copy in page-locked host
    memory made on the stream after the all-reduce, with an event to wait for that copy alone
    (a `.tolist()` of the device tensor would wait for everything queued since)."""

    def __init__(self, flags: torch.Tensor, host: torch.Tensor | None) -> None:
        self.flags, self.host = flags, host
        self.event = torch.cuda.Event() if host is not None else None
        self.step = 0

    @classmethod
    def new(cls, size: int, device: torch.device) -> Ballot:
        flags = torch.zeros(size, device=device)
        host = torch.zeros(size, pin_memory=True) if device.type == "cuda" else None
        return cls(flags, host)

    def post(self, step: int) -> None:
        """After the all-reduce: start the copy to the host (CUDA)."""
        self.step = step
        if self.host is not None and self.event is not None:
            self.host.copy_(self.flags, non_blocking=True)
            self.event.record()

    def read(self) -> list[float]:
        if self.host is not None and self.event is not None:
            self.event.synchronize()
            return self.host.tolist()
        return self.flags.tolist()


def why_not_on_device(cfg: Config, optimizer: Any, scaler: Any, sharded: bool) -> list[str]:
    """What keeps this run's skip from being decided on the device, each naming its setting."""
    reasons = []
    if isinstance(optimizer, ZeroRedundancyOptimizer) or sharded:
        reasons.append(f"dist.strategy={cfg.dist.strategy} (the skip flag is not measured there)")
    elif not getattr(optimizer, "_step_supports_amp_scaling", False):
        reasons.append(
            f"optim.impl={cfg.optim.impl} builds no fused optimizer (only fused kernels take a "
            "skip flag on the device)"
        )
    if scaler.is_enabled():
        reasons.append("train.amp=fp16 (its GradScaler decides its own skips)")
    if cfg.train.ema_decay > 0:
        reasons.append("train.ema_decay (the weight average is updated on a host decision)")
    return reasons


def build(
    cfg: Config,
    info: DistInfo,
    guard: StepGuard,
    update: tuple[Any, Any, BufferSnapshot],
    sharded: bool,
) -> HostVerdicts:
    """The run's verdicts over `update` (its optimizer, scaler and buffer snapshot).
    train.verdict=device where it cannot be is bad input (exit 2); auto takes the device on
    CUDA where it can, and says why where it cannot."""
    optimizer, scaler, buffers = update
    setting = cfg.train.verdict
    reasons = why_not_on_device(cfg, optimizer, scaler, sharded)
    if setting == "device" and reasons:
        raise ConfigError(f"train.verdict=device is not possible with {'; '.join(reasons)}")
    if setting == "host" or reasons or (setting == "auto" and info.device.type != "cuda"):
        if setting == "auto" and reasons and info.device.type == "cuda" and info.is_main:
            log.info("step verdicts read on the host every step: %s", "; ".join(reasons))
        return HostVerdicts(guard, optimizer, scaler, buffers)
    host_group = None
    if distributed.active() and dist.get_backend() != "gloo":
        # the default group's timeout (distributed.setup): a stuck rank's watchdog fires first
        timeout_s = cfg.dist.timeout_s + distributed.collective_grace_s(cfg.dist.timeout_s)
        host_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    if info.is_main:
        log.info("step verdicts: the skip decided on the device, the vote read a step late")
    return DeviceVerdicts(guard, optimizer, scaler, buffers, host_group)
