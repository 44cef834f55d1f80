"""train.verdict=device: the skip decided on the device, the vote read a step late
(verdicts.py), against independent references: the step as torch's optimizers take it
without any skip flag, buffers saved by hand, and whole runs with train.verdict=host."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import helpers
import pytest
import torch
from helpers import assert_same_training_state, final_state, tiny_job_args
from torch import nn

import engine
import exitcodes
import verdicts
from config import Config, ConfigError, TrainConfig
from distributed import DistInfo
from engine import StepStats
from metrics import TrainMeter
from resilience import StepGuard

CPU = torch.device("cpu")


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 3))


def buffers_of(model: nn.Module) -> list[torch.Tensor]:
    return [b.detach().clone() for b in model.buffers()]


@pytest.mark.parametrize("skip", [True, False])
def test_statistics_are_restored_on_a_device_flag_and_only_on_it(skip: bool) -> None:
    model = bn_model()
    snapshot = engine.BufferSnapshot(model)
    model(torch.randn(8, 1, 6, 6))  # the statistics of a first step
    before = buffers_of(model)
    snapshot.take()
    model(torch.randn(8, 1, 6, 6) * 3)  # the step that may be skipped
    after = buffers_of(model)
    assert not torch.equal(before[0], after[0]) and before[2] + 1 == after[2]
    snapshot.restore_where(torch.tensor(skip))
    expected = before if skip else after
    for got, want in zip(buffers_of(model), expected, strict=True):
        assert torch.equal(got, want)


def optimizers(model: nn.Module) -> dict[str, torch.optim.Optimizer]:
    params = list(model.parameters())
    return {
        "sgd": torch.optim.SGD(
            params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3, fused=True
        ),
        "adamw": torch.optim.AdamW(params, lr=0.01, weight_decay=0.05, fused=True),
    }


def gradients(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(torch.randn(8, 1, 6, 6)).square().mean().backward()


def state_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value.clone() for s in optimizer.state.values() for value in s.values()]


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_fused_step_skipped_on_the_device_changes_nothing_and_an_applied_one_is_torchs(
    name: str,
) -> None:
    """found_inf=1: parameters and state bit for bit as they were; found_inf=0: the same step as
    torch's optimizer takes with no flag at all (the reference: a copy stepped plainly)."""
    model = bn_model()
    optimizer = optimizers(model)[name]
    scaler = engine.make_scaler(CPU, None)
    gradients(model, 1)
    optimizer.step()  # the state exists (see test_fused_sgds_first_skip...)
    gradients(model, 2)
    params, state = [p.clone() for p in model.parameters()], state_of(optimizer)
    reference = copy.deepcopy((model, optimizer))
    for ref, param in zip(reference[0].parameters(), model.parameters(), strict=True):
        ref.grad = param.grad.clone()  # deepcopy leaves a parameter's gradient behind
    engine.apply_update(optimizer, scaler, found_inf=torch.tensor(1.0))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    assert all(torch.equal(s, t) for s, t in zip(state_of(optimizer), state, strict=True))
    gradients(model, 2)
    engine.apply_update(optimizer, scaler, found_inf=torch.tensor(0.0))
    ref_model, ref_optimizer = reference
    ref_optimizer.step()
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters(), strict=True)
    )
    assert all(
        torch.equal(s, t) for s, t in zip(state_of(optimizer), state_of(ref_optimizer), strict=True)
    )
    assert not hasattr(optimizer, "found_inf")  # handed over for one step only


def stats(loss: float, correct: int = 3) -> StepStats:
    return StepStats(
        loss_sum=torch.tensor(loss),
        correct=torch.tensor(correct),
        num_samples=8,
        grad_norm=torch.tensor(1.0),
        labelled=torch.tensor(8),
        top5=torch.tensor(7),
    )


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_first_step_is_decided_on_the_host_so_its_skip_leaves_no_state(name: str) -> None:
    """torch's fused SGD, its first step skipped on found_inf, keeps momentum buffers it never
    wrote (torch/optim/sgd.py, _fused_sgd: torch.empty_like), and fused AdamW keeps zeros and
    a step count of 0, where the host verdict (no step at all) keeps no state: the premise.
    So a step with no optimizer state yet is read on the host and skipped by not stepping."""
    model = bn_model()
    optimizer = optimizers(model)[name]
    gradients(model, 1)
    optimizer.found_inf, optimizer.grad_scale = torch.tensor(1.0), None
    optimizer.step()
    del optimizer.found_inf, optimizer.grad_scale
    assert all(optimizer.state[p] for p in model.parameters())

    model = bn_model()
    optimizer = optimizers(model)[name]
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=CPU)
    guard = StepGuard(info, max_consecutive=5, check_grad=True)
    parts = (optimizer, engine.make_scaler(CPU, None), engine.BufferSnapshot(model))
    device = verdicts.DeviceVerdicts(guard, *parts)
    gradients(model, 1)
    params = [p.clone() for p in model.parameters()]
    device.open(lambda: None, lambda: False, False)
    verdict = device.agree(stats(math.nan), step=1)
    assert verdict.skip is True  # a host decision
    device.apply(verdict)
    assert not optimizer.state and guard.skipped_total == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    gradients(model, 2)
    device.open(lambda: None, lambda: False, False)
    verdict = device.agree(stats(1.0), step=2)
    assert verdict.skip is False
    device.apply(verdict)
    gradients(model, 3)
    device.open(lambda: None, lambda: False, False)
    verdict = device.agree(stats(math.inf), step=3)
    assert isinstance(verdict.skip, torch.Tensor)  # momentum made: on the device from now on
    assert guard.skipped_total == 1  # read a step late
    device.settle()
    assert guard.skipped_total == 2 and guard.consecutive == 1


def test_the_meters_drop_a_skipped_step_alike_whether_the_flag_is_on_host_or_device() -> None:
    host, device = TrainMeter(CPU, 1), TrainMeter(CPU, 1)
    for loss, skipped in ((2.0, False), (math.nan, True), (1.0, False), (math.inf, True)):
        host.update(stats(loss), 0.0, skipped=skipped)
        device.update(stats(loss), 0.0, skipped=torch.tensor(skipped))
    a, b = host.reduce(), device.reduce()
    assert a["skipped_steps"] == b["skipped_steps"] == 2
    for key in ("loss", "accuracy", "top5"):
        assert a[key] == b[key], key
    assert a["loss"] == 3.0 / 16  # by hand: the two applied steps' loss sums over 16 samples


def test_a_device_verdict_where_none_can_be_is_refused_naming_the_settings() -> None:
    cfg = Config(train=TrainConfig(verdict="device", ema_decay=0.99))
    model = bn_model()
    foreach = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    reasons = verdicts.why_not_on_device(cfg, foreach, engine.make_scaler(CPU, None), False)
    assert any("optim.impl=auto" in r for r in reasons)
    assert any("train.ema_decay" in r for r in reasons)
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=CPU)
    guard = StepGuard(info, 5, True)
    parts = (foreach, engine.make_scaler(CPU, None), engine.BufferSnapshot(model))
    with pytest.raises(ConfigError, match="train.verdict=device is not possible"):
        verdicts.build(cfg, info, guard, parts, sharded=False)
    fused = optimizers(model)["sgd"]
    plain = Config(train=TrainConfig(verdict="auto"))
    parts = (fused, engine.make_scaler(CPU, None), engine.BufferSnapshot(model))
    assert not verdicts.build(plain, info, guard, parts, sharded=False).on_device  # CPU: host


# ---------------------------------------------------------------------------------------------
# Whole runs: train.verdict=device against train.verdict=host


def job(run_dir: Path, verdict: str, *args: str, **settings: Any) -> list[str]:
    return tiny_job_args(
        run_dir,
        f"--train.verdict={verdict}",
        "--optim.impl=fused",
        *args,
        data_synthetic_train_size=250,
        train_grad_accum_steps=2,
        data_num_workers=1,
        log_every_steps=1,
        dist_preflight=False,
        **settings,
    )


ON_DEVICE = "step verdicts: the skip decided on the device"


@pytest.mark.e2e
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_nonfinite_step_is_skipped_on_the_device_exactly_as_on_the_host(
    tmp_path, optimizer: str
) -> None:
    """Rank 0's loss of step 1 (no optimizer state yet) and rank 1's of step 4 are NaN: under
    both verdicts every checkpoint is the same bit for bit, step 4 changed nothing, and the
    warnings and the rows say so."""
    runs = {}
    for verdict in ("host", "device"):
        run_dir = tmp_path / verdict
        proc = helpers.launch(
            2,
            *job(run_dir, verdict, "--ckpt.every_steps=1", "--ckpt.keep=20"),
            f"--optim.name={optimizer}",
            "--train.max_steps=6",
            faults="nan@step=0,rank=0;nan@step=3,rank=1",
        )
        assert proc.returncode == 0, proc.output[-3000:]
        assert (ON_DEVICE in proc.output) == (verdict == "device")
        assert "step 1: non-finite loss on rank(s) [0]; skipped the optimizer step" in proc.output
        assert "step 4: non-finite loss on rank(s) [1]; skipped the optimizer step" in proc.output
        rows = helpers.rows(run_dir, "train")
        assert [r["skipped_steps"] for r in rows] == [1, 0, 0, 1, 0, 0]
        assert rows[-1]["skipped_steps_total"] == 2
        runs[verdict] = {
            step: torch.load(run_dir / "checkpoints" / f"step_{step}.pt", weights_only=True)
            for step in range(1, 7)
        }
    for step in range(1, 7):
        assert_same_training_state(runs["device"][step], runs["host"][step])
    assert_same_training_state({**runs["device"][4], "step": 3}, runs["device"][3])


@pytest.mark.e2e
def test_consecutive_nonfinite_steps_read_a_step_late_still_stop_with_exit_3(tmp_path) -> None:
    """Rank 1's steps 3, 4 and 5 are NaN with train.max_nonfinite_steps=3: step 5's vote is read
    in step 6 (no checkpoint is due at 5), which raises on both ranks before step 6 is applied
    or saved."""
    run_dir = tmp_path / "run"
    plan = ";".join(f"nan@step={step},rank=1" for step in (2, 3, 4))
    proc = helpers.launch(
        2,
        *job(run_dir, "device", "--train.max_nonfinite_steps=3", "--ckpt.every_steps=2"),
        faults=plan,
    )
    assert proc.returncode != 0 and ON_DEVICE in proc.output
    assert f"exitcode: {exitcodes.EXIT_DIVERGED}" in proc.output, proc.output[-3000:]
    for rank in (0, 1):  # raised on each rank, rank 0 whose own losses were all finite too
        said = f"[rank {rank}] ERROR train: 3 consecutive optimizer steps had a non-finite loss"
        assert said in proc.output, proc.output[-3000:]
    assert "(the last at step 5, loss on rank(s) [1])" in proc.output
    assert final_state(run_dir)["step"] == 4


@pytest.mark.e2e
def test_a_preempted_device_verdict_run_resumes_equal_to_an_uninterrupted_host_one(
    tmp_path,
) -> None:
    """SIGTERM to rank 1 only before step 5: the host facts' vote stops both ranks after step 5
    (as the host verdict does), one checkpoint, and the resumed run ends bit for bit where an
    uninterrupted train.verdict=host run ends."""
    reference = tmp_path / "reference"
    proc = helpers.launch(2, *job(reference, "host"))
    assert proc.returncode == 0, proc.output[-3000:]
    run_dir = tmp_path / "run"
    first = helpers.launch(2, *job(run_dir, "device"), faults="sigterm@step=4,rank=1")
    assert ON_DEVICE in first.output
    assert "exitcode: 75" in first.output and "exitcode: 1" not in first.output  # both ranks
    assert "preempted by a signal received by another rank at step 5" in first.output
    assert final_state(run_dir)["step"] == 5
    second = helpers.launch(2, *job(run_dir, "device"))
    assert second.returncode == 0, second.output[-3000:]
    assert_same_training_state(final_state(run_dir), final_state(reference))


@pytest.mark.e2e
def test_train_verdict_device_with_a_foreach_optimizer_exits_2(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = helpers.launch(None, *tiny_job_args(run_dir, "--train.verdict=device"))
    assert proc.returncode == 2, proc.output[-3000:]
    assert "train.verdict=device is not possible with optim.impl=auto" in proc.output
    assert not (run_dir / "checkpoints").exists()


def test_a_parameter_first_updated_late_gets_its_first_step_read_on_the_host() -> None:
    """Two parameter groups, the second's parameter used from step 3 on only, whose loss is
    NaN: the device verdict leaves it (and its momentum) exactly as the host verdict does,
    through the finite step 4 after it."""
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=CPU)
    finals = []
    for kind in (verdicts.HostVerdicts, verdicts.DeviceVerdicts):
        torch.manual_seed(0)
        a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
        sgd = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1, momentum=0.9, fused=True)
        guard = StepGuard(info, max_consecutive=5, check_grad=True)
        judge = kind(
            guard, sgd, engine.make_scaler(CPU, None), engine.BufferSnapshot(nn.Linear(1, 1))
        )
        for step, loss, used in (
            (1, 1.0, [a]),
            (2, 1.0, [a]),
            (3, math.nan, [a, b]),
            (4, 1.0, [a, b]),
        ):
            for p in used:
                p.grad = torch.full_like(p, 0.5 * step)
            judge.open(lambda: None, lambda: False, False)
            judge.apply(judge.agree(stats(loss), step))
        judge.settle()
        assert guard.skipped_total == 1
        finals.append((b.detach().clone(), sgd.state[b]["momentum_buffer"].clone()))
    (b_host, m_host), (b_device, m_device) = finals
    assert torch.equal(b_host, b_device) and torch.equal(m_host, m_device)
