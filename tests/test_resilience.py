"""StepGuard's per-step verdicts, as its docstrings state them: a non-finite loss or gradient
skips the step (and names the rank of a loss), the run of skips ends in DivergedError at
train.max_nonfinite_steps, a preemption signal or a busy checkpoint writer on any rank
reaches every rank."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading

import pytest
import torch
from helpers import ThreadRanks

import distributed
from distributed import DistInfo
from resilience import DivergedError, PreemptionHandler, StepGuard, Verdict

ONE = DistInfo(0, 0, 1, torch.device("cpu"))
FINITE = torch.tensor(2.5)


def test_a_finite_step_is_applied() -> None:
    guard = StepGuard(ONE, max_consecutive=3, check_grad=True)
    verdict = guard.agree(FINITE, torch.tensor(0.7), None, step=1)
    assert verdict == Verdict(skip=False, stop=None, nonfinite_ranks=(), writes_done=True)
    assert (guard.consecutive, guard.skipped_total) == (0, 0)


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_skips_the_step_and_names_its_rank(loss: float, caplog) -> None:
    guard = StepGuard(ONE, max_consecutive=3, check_grad=True)
    with caplog.at_level(logging.WARNING, logger="resilience"):
        verdict = guard.agree(torch.tensor(loss), torch.tensor(0.7), None, step=4)
    assert verdict == Verdict(skip=True, stop=None, nonfinite_ranks=(0,))
    assert (guard.consecutive, guard.skipped_total) == (1, 1)
    assert caplog.messages == [
        "step 4: non-finite loss on rank(s) [0]; skipped the optimizer step "
        "(1 in a row, 1 in total)"
    ]


def test_a_non_finite_gradient_skips_the_step_unless_the_grad_scaler_owns_it(caplog) -> None:
    checked = StepGuard(ONE, max_consecutive=3, check_grad=True)
    with caplog.at_level(logging.WARNING, logger="resilience"):
        verdict = checked.agree(FINITE, torch.tensor(math.inf), None, step=2)
    assert verdict == Verdict(skip=True, stop=None, nonfinite_ranks=())
    assert caplog.messages[-1].startswith("step 2: non-finite gradient; skipped")
    fp16 = StepGuard(ONE, max_consecutive=3, check_grad=False)  # the GradScaler skips inf steps
    assert not fp16.agree(FINITE, torch.tensor(math.nan), None, step=2).skip
    assert fp16.agree(torch.tensor(math.nan), torch.tensor(math.nan), None, step=3).skip


def test_the_limit_of_consecutive_skips_raises_diverged_and_an_applied_step_resets() -> None:
    guard = StepGuard(ONE, max_consecutive=3, check_grad=True)
    nan = torch.tensor(math.nan)
    outcomes = [
        guard.agree(loss, FINITE, None, step=s).skip
        for s, loss in enumerate([nan, nan, FINITE, nan, nan], start=1)
    ]
    assert outcomes == [True, True, False, True, True]  # never 3 in a row
    assert (guard.consecutive, guard.skipped_total) == (2, 4)
    with pytest.raises(DivergedError) as raised:
        guard.agree(nan, FINITE, None, step=6)
    message = str(raised.value)
    assert message.startswith("3 consecutive optimizer steps had a non-finite loss or gradient")
    assert "the last at step 6, loss on rank(s) [0]" in message
    assert "train.max_nonfinite_steps=3" in message
    assert (guard.consecutive, guard.skipped_total) == (3, 5)


def test_a_limit_of_one_raises_at_the_first_non_finite_step() -> None:
    guard = StepGuard(ONE, max_consecutive=1, check_grad=True)
    with pytest.raises(DivergedError, match="train.max_nonfinite_steps=1"):
        guard.agree(FINITE, torch.tensor(math.inf), None, step=1)


def test_a_preemption_signal_stops_and_a_busy_writer_holds_back_without_skipping() -> None:
    guard = StepGuard(ONE, max_consecutive=3, check_grad=True)
    stopped = guard.agree(FINITE, FINITE, "SIGTERM", step=5)
    assert stopped == Verdict(skip=False, stop="SIGTERM", nonfinite_ranks=(), writes_done=True)
    writing = guard.agree(FINITE, FINITE, None, step=6, writing=True)
    assert writing == Verdict(skip=False, stop=None, nonfinite_ranks=(), writes_done=False)
    both = guard.agree(torch.tensor(math.nan), FINITE, "SIGUSR2", step=7, writing=True)
    assert both == Verdict(skip=True, stop="SIGUSR2", nonfinite_ranks=(0,), writes_done=False)


def test_one_ranks_nan_signal_or_busy_writer_is_every_ranks_verdict(monkeypatch) -> None:
    """Three ranks: rank 2's loss is NaN, rank 1 received SIGTERM, rank 0 is still writing.
    Every rank skips naming rank 2, stops, and waits for the writer; the rank that got the
    signal names it, the others say another rank received one."""
    ranks = ThreadRanks(3)
    monkeypatch.setattr(distributed, "all_reduce_sum", ranks.all_reduce_sum)
    losses = {0: FINITE, 1: FINITE, 2: torch.tensor(math.nan)}

    def rank_fn(rank: int) -> tuple[Verdict, Verdict]:
        guard = StepGuard(DistInfo(rank, rank, 3, torch.device("cpu")), 3, check_grad=True)
        first = guard.agree(
            losses[rank], FINITE, "SIGTERM" if rank == 1 else None, step=1, writing=rank == 0
        )
        second = guard.agree(FINITE, FINITE, None, step=2)  # the next step: all clear
        return first, second

    verdicts = ranks.run(rank_fn)
    other = "a signal received by another rank"
    assert [first for first, _ in verdicts] == [
        Verdict(skip=True, stop=stop, nonfinite_ranks=(2,), writes_done=False)
        for stop in (other, "SIGTERM", other)
    ]
    assert [second for _, second in verdicts] == [Verdict(False, None, ())] * 3


def test_on_stop_runs_once_on_the_watcher_thread_as_the_signal_arrives() -> None:
    """The crash-loop breaker's uncount must not wait for a step boundary (issue 31 B1): the
    callback runs on the watcher thread, once for two signals, and at once for a late caller."""
    handler = PreemptionHandler(("SIGUSR2",))
    ran: list[str] = []
    done = threading.Event()
    handler.install()
    try:
        handler.on_stop(lambda: (ran.append(threading.current_thread().name), done.set()))
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert done.wait(10)
    finally:
        handler.restore()
    assert ran == ["preemption-watcher"]
    assert handler.received == "SIGUSR2"
    late: list[int] = []
    handler.on_stop(lambda: late.append(1))
    assert late == [1]
    assert signal.set_wakeup_fd(-1) == -1  # restored: no wakeup fd left behind


def test_an_attempt_ended_by_another_ranks_transient_io_is_not_counted(tmp_path) -> None:
    """Rank 0 meets rank 1's ESTALE as a PeerError saying 74: before the review's fix only
    rank 0's own OSError left the attempt uncounted."""
    import json

    import distributed
    import launch

    attempt = launch.Attempt(tmp_path, None)
    attempt.count(0, 3)
    with pytest.raises(distributed.PeerError), launch.uncounted_if_transient_io(attempt):
        raise distributed.PeerError("reading the batch failed on 1 other rank(s)", exit_code=74)
    assert json.loads((tmp_path / "progress.json").read_text())["attempts"] == 0
    crashed = launch.Attempt(tmp_path, None)
    crashed.count(0, 3)
    with pytest.raises(distributed.PeerError), launch.uncounted_if_transient_io(crashed):
        raise distributed.PeerError("step 4 failed on 1 other rank(s)", exit_code=1)
    assert json.loads((tmp_path / "progress.json").read_text())["attempts"] == 1


def test_the_io_marker_counts_attempts_not_reports(tmp_path, monkeypatch) -> None:
    """Every rank that meets transient I/O reports it: before the review's fix each report
    added one, so two ranks of one attempt counted two and the back-off doubled too fast."""
    import errno

    import launch

    marker = tmp_path / "io"
    marker.write_text("")
    monkeypatch.setenv("TRAIN_IO_MARKER", str(marker))
    stale = OSError(errno.ESTALE, "Stale file handle")
    for restart, rank in ((0, 0), (0, 1), (2, 1)):  # two ranks of attempt 0, one of attempt 2
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert launch.exit_code(stale, 32) == 74
    assert launch.io_failed_restarts() == {0, 2}
    assert launch.io_failures_so_far() == 2
