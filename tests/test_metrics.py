"""TrainMeter against hand computations: global loss and accuracy as sums over labelled
samples, skipped steps kept out of them, throughput and per-step times from a clock the test
sets (no figure here depends on how fast or busy the machine is)."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch
from helpers import ThreadRanks

import distributed
import metrics
from engine import StepStats
from metrics import TrainMeter

CPU = torch.device("cpu")


def step(loss_sum: float, correct: int, num_samples: int, labelled: int | None = None) -> StepStats:
    """One optimizer step's statistics, as engine.forward_backward leaves them on the device."""
    return StepStats(
        loss_sum=torch.tensor(loss_sum),
        correct=torch.tensor(correct),
        num_samples=num_samples,
        grad_norm=torch.tensor(1.0),
        labelled=torch.tensor(num_samples if labelled is None else labelled),
    )


@pytest.fixture
def clock(monkeypatch) -> threading.local:
    """metrics' clock, set by the test: `clock.now` (seconds), one per thread."""
    now = threading.local()
    now.now = 0.0
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: now.now))
    return now


def test_loss_and_accuracy_are_sums_over_labelled_samples_not_means_of_steps(clock) -> None:
    meter = TrainMeter(CPU, world_size=1)
    meter.update(step(loss_sum=6.0, correct=3, num_samples=8), data_wait_s=0.0)
    # 8 samples of which 6 carry a label (the others IGNORED): only those 6 count.
    meter.update(step(loss_sum=1.5, correct=2, num_samples=8, labelled=6), data_wait_s=0.0)
    meter.update(step(loss_sum=0.5, correct=1, num_samples=2), data_wait_s=0.0)
    clock.now = 1.0
    figures = meter.reduce()
    # (6 + 1.5 + 0.5) / (8 + 6 + 2) = 0.5, where the mean of the steps' means is 0.4167
    assert figures["loss"] == pytest.approx(8.0 / 16)
    assert figures["accuracy"] == pytest.approx(6 / 16)
    assert figures["samples_per_s"] == pytest.approx(18 / 1.0)  # ignored labels still ran
    assert figures["skipped_steps"] == 0


def test_a_skipped_steps_loss_stays_out_of_the_averages_but_its_samples_count(clock) -> None:
    meter = TrainMeter(CPU, world_size=1)
    meter.update(step(loss_sum=2.0, correct=4, num_samples=8), data_wait_s=0.0)
    meter.update(step(loss_sum=math.nan, correct=8, num_samples=8), data_wait_s=0.0, skipped=True)
    meter.update(step(loss_sum=1.0, correct=2, num_samples=8), data_wait_s=0.0)
    clock.now = 2.0
    figures = meter.reduce()
    assert figures["loss"] == pytest.approx(3.0 / 16) and figures["skipped_steps"] == 1
    assert figures["accuracy"] == pytest.approx(6 / 16)
    assert figures["samples_per_s"] == pytest.approx(24 / 2.0)  # the skipped step's too
    assert figures["step_ms"] == pytest.approx(2000 / 3)


def test_throughput_data_wait_and_per_step_times_from_a_set_clock(clock) -> None:
    clock.now = 10.0
    meter = TrainMeter(CPU, world_size=1)
    meter.update(step(loss_sum=1.0, correct=1, num_samples=16), data_wait_s=0.5)
    meter.add_allreduce(0.125)
    meter.update(step(loss_sum=1.0, correct=1, num_samples=16), data_wait_s=0.25)
    meter.add_allreduce(0.375)
    clock.now = 12.0  # 2 s and 2 steps since the meter started
    figures = meter.reduce({"data": 0.75, "fwd_bwd": 1.25, "optimizer": 0.5})
    assert figures["samples_per_s"] == pytest.approx(32 / 2.0)
    assert figures["data_wait_frac"] == pytest.approx(0.75 / 2.0)
    assert figures["step_ms"] == pytest.approx(1000.0)  # 2 s / 2 steps
    assert figures["data_ms"] == pytest.approx(375.0)
    assert figures["fwd_bwd_ms"] == pytest.approx(625.0)
    assert figures["optimizer_ms"] == pytest.approx(250.0)
    assert figures["allreduce_ms"] == pytest.approx(250.0)


def test_reduce_starts_a_new_window(clock) -> None:
    meter = TrainMeter(CPU, world_size=1)
    meter.update(step(loss_sum=4.0, correct=4, num_samples=4), data_wait_s=1.0, skipped=True)
    meter.add_allreduce(1.0)
    clock.now = 5.0
    meter.reduce({"fwd_bwd": 1.0, "optimizer": 1.0})
    empty = meter.reduce()  # nothing since: no figure carries over
    assert math.isnan(empty["loss"]) and math.isnan(empty["accuracy"])
    assert empty["samples_per_s"] == 0.0 and empty["data_wait_frac"] == 0.0
    assert empty["skipped_steps"] == 0 and empty["step_ms"] == 0.0
    assert empty["allreduce_ms"] == 0.0
    meter.update(step(loss_sum=3.0, correct=1, num_samples=4), data_wait_s=0.25)
    clock.now = 5.5  # the window began at the last reduce, at 5.0
    figures = meter.reduce()
    assert figures["loss"] == pytest.approx(0.75) and figures["accuracy"] == pytest.approx(0.25)
    assert figures["samples_per_s"] == pytest.approx(4 / 0.5)
    assert figures["step_ms"] == pytest.approx(500.0) and figures["data_ms"] == pytest.approx(250.0)


def test_two_ranks_report_global_sums_and_per_step_times_averaged_over_ranks(
    clock, monkeypatch
) -> None:
    """Rank 0: 2 steps of 8 samples in 2 s; rank 1: the same steps in 4 s (a straggler). The
    loss is the global sum over the global labelled count, samples/s the global samples over
    the ranks' mean time, a per-step time the mean over ranks and steps."""
    ranks = ThreadRanks(2)
    monkeypatch.setattr(distributed, "all_reduce_sum", ranks.all_reduce_sum)
    work = {  # rank: (loss sums, correct counts, labelled counts, data wait s, elapsed s)
        0: ((2.0, 2.0), (8, 4), (8, 8), (0.25, 0.25), 2.0),
        1: ((1.0, 3.0), (0, 0), (8, 4), (1.0, 1.0), 4.0),
    }

    def rank_fn(rank: int) -> dict[str, float]:
        losses, correct, labelled, waits, elapsed = work[rank]
        clock.now = 0.0
        meter = TrainMeter(CPU, world_size=2)
        for loss, right, counted, wait in zip(losses, correct, labelled, waits, strict=True):
            meter.update(step(loss, right, num_samples=8, labelled=counted), data_wait_s=wait)
        clock.now = elapsed
        return meter.reduce({"fwd_bwd": elapsed / 2})

    zero, one = ranks.run(rank_fn)
    assert zero == one  # every rank reports the same figures
    assert zero["loss"] == pytest.approx(8.0 / 28)  # (2 + 2 + 1 + 3) / (8 + 8 + 8 + 4)
    assert zero["accuracy"] == pytest.approx(12 / 28)
    assert zero["samples_per_s"] == pytest.approx(32 / 3.0)  # mean elapsed (2 + 4) / 2
    assert zero["data_wait_frac"] == pytest.approx(2.5 / 6.0)
    assert zero["step_ms"] == pytest.approx(1500.0)  # (1 + 2) s per step / 2 ranks
    assert zero["data_ms"] == pytest.approx(625.0)  # (0.25 + 1.0) / 2
    assert zero["fwd_bwd_ms"] == pytest.approx(750.0)  # (0.5 + 1.0) / 2
