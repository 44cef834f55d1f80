"""DDP math against independent single-process references (gloo, spawned ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import data
import distributed
import engine
import sharding
from config import DataConfig, DistConfig, OptimConfig
from distributed import DistInfo
from model import MiniResNet
from optim import spec

pytestmark = pytest.mark.spawn

WIDTHS = (8, 16)
LR = 0.05


def problem(num_samples: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    return torch.randn(num_samples, 1, 28, 28, generator=gen), torch.randint(
        0, 10, (num_samples,), generator=gen
    )


def fresh_model(norm: str = "group") -> nn.Module:
    torch.manual_seed(0)
    return MiniResNet(in_channels=1, num_classes=10, widths=WIDTHS, norm=norm)


def reference_training(global_batch: int, steps: int) -> dict[str, torch.Tensor]:
    """Hand-written single-process SGD on whole global batches: the independent reference."""
    x, y = problem()
    model = fresh_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        batch = slice(step * global_batch, (step + 1) * global_batch)
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


def pipeline_training(
    info: DistInfo,
    per_rank_batch: int,
    accum: int,
    steps: int,
    dist_cfg: DistConfig | None = None,
) -> dict[str, torch.Tensor]:
    """The pipeline's DDP step: this rank's micro-batches of each global batch."""
    x, y = problem()
    model = distributed.wrap_model(fresh_model(), info, dist_cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scaler = engine.make_scaler(info.device, None)
    global_batch = per_rank_batch * accum * info.world_size
    for step in range(steps):
        micro = []
        for i in range(accum):
            start = step * global_batch + (info.rank * accum + i) * per_rank_batch
            micro.append((x[start : start + per_rank_batch], y[start : start + per_rank_batch]))
        engine.train_step(model, micro, optimizer, scaler, nn.CrossEntropyLoss(), None, 0.0)
    return distributed.unwrap_model(model).state_dict()


def assert_states_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)


def test_two_ranks_of_b_equal_one_rank_of_2b(tmp_path) -> None:
    expected = reference_training(global_batch=16, steps=4)
    results = run_ranks(pipeline_training, 2, tmp_path, 8, 1, 4)
    for state in results:
        assert_states_close(state, expected)


def test_three_ranks_with_accumulation_equal_one_big_batch(tmp_path) -> None:
    expected = reference_training(global_batch=24, steps=3)
    results = run_ranks(pipeline_training, 3, tmp_path, 4, 2, 3)
    for state in results:
        assert_states_close(state, expected)


def test_accumulation_of_2_by_b_equals_one_step_of_2b() -> None:
    expected = reference_training(global_batch=16, steps=4)
    state = pipeline_training(DistInfo(0, 0, 1, torch.device("cpu")), 8, 2, 4)
    assert_states_close(state, expected)


def _identical_after_steps(info: DistInfo) -> list[bool]:
    x, y = problem()
    model = distributed.wrap_model(fresh_model(norm="batch"), info)
    optimizer = spec.build_optimizer(model, OptimConfig(), "foreach")
    scaler = engine.make_scaler(info.device, None)
    for step in range(5):
        rows = slice((step * 2 + info.rank) * 8, (step * 2 + info.rank + 1) * 8)
        engine.train_step(
            model, [(x[rows], y[rows])], optimizer, scaler, nn.CrossEntropyLoss(), None, 1.0
        )
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(info.world_size)]
    dist.all_gather(gathered, flat)
    return [torch.equal(g, gathered[0]) for g in gathered]


def test_parameters_bit_identical_on_every_rank(tmp_path) -> None:
    for flags in run_ranks(_identical_after_steps, 3, tmp_path):
        assert all(flags)


def _count_allreduces(info: DistInfo, accum: int, steps: int) -> int:
    x, y = problem()
    model = distributed.wrap_model(fresh_model(), info)
    calls = {"n": 0}

    def counting_hook(state, bucket):  # noqa: ANN001
        calls["n"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    # wrap_model's hook (the all-reduce timer) calls this one for every bucket it all-reduces.
    model.allreduce_timer.inner = counting_hook
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = engine.make_scaler(info.device, None)
    for step in range(steps):
        rows = [slice((step * accum + i) * 4, (step * accum + i + 1) * 4) for i in range(accum)]
        micro = [(x[r], y[r]) for r in rows]
        engine.train_step(model, micro, optimizer, scaler, nn.CrossEntropyLoss(), None, 0.0)
    return calls["n"]


def test_one_gradient_allreduce_per_optimizer_step_with_accumulation(tmp_path) -> None:
    # The model fits in one 25 MB DDP bucket, so one all-reduce = one hook call.
    assert sum(p.numel() for p in fresh_model().parameters()) * 4 < 25 * 2**20
    without, with_accum = (run_ranks(_count_allreduces, 2, tmp_path, accum, 3) for accum in (1, 4))
    assert without == [3, 3]
    assert with_accum == [3, 3]


def _evaluate(info: DistInfo, state: dict) -> engine.EvalResult:
    dataset = data.make_synthetic(1001, (1, 28, 28), 10, seed=7)
    splits = data.DataSplits(dataset, dataset, (1, 28, 28), 10, (0.5,), (0.25,))
    loader = data.build_eval_loader(splits, DataConfig(eval_batch_size=64, num_workers=0), info, 0)
    preprocess = data.Preprocess(splits, info.device, channels_last=False)
    model = fresh_model(norm="batch")
    model.load_state_dict(state)
    return engine.evaluate(
        distributed.wrap_model(model, info),
        (preprocess(x, y) for x, y in loader),
        info.device,
        None,
        num_classes=10,
        confusion=True,
    )


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_exact_evaluation_for_any_world_size(tmp_path, world_size) -> None:
    model = fresh_model(norm="batch")
    for p in model.parameters():  # a non-trivial model: random norms and biases too
        p.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    state = model.state_dict()
    # Independent reference: the whole set in one forward pass, no loaders, no sharding.
    dataset = data.make_synthetic(1001, (1, 28, 28), 10, seed=7)
    x = (dataset.images.float() / 255 - 0.5) / 0.25
    with torch.no_grad():
        logits = model.eval()(x)
    ref_loss = nn.functional.cross_entropy(logits, dataset.labels).item()
    ref_acc = (logits.argmax(1) == dataset.labels).sum().item() / 1001
    assert 0.0 < ref_acc < 1.0
    # Top-5, per class and the confusion matrix, by hand: one sample at a time.
    confusion = [[0] * 10 for _ in range(10)]
    top5_hits = 0
    for row, label in zip(logits.tolist(), dataset.labels.tolist(), strict=True):
        ranked = sorted(range(10), key=lambda c: -row[c])
        top5_hits += label in ranked[:5]
        confusion[label][ranked[0]] += 1
    assert 0 < top5_hits < 1001 and top5_hits / 1001 > ref_acc
    for result in run_ranks(_evaluate, world_size, tmp_path, state):
        assert result.num_samples == 1001
        assert result.accuracy == pytest.approx(ref_acc, abs=1e-12)
        assert result.loss == pytest.approx(ref_loss, rel=1e-5)
        assert result.top5 == pytest.approx(top5_hits / 1001, abs=1e-12)
        assert [list(r) for r in result.confusion] == confusion
        assert list(result.class_count) == [sum(r) for r in confusion]
        assert list(result.class_correct) == [confusion[c][c] for c in range(10)]


def _buffers_after_average(info: DistInfo) -> list[torch.Tensor]:
    model = fresh_model(norm="batch")
    model.train()
    model(torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(info.rank)))
    distributed.average_buffers(model)
    return [b.clone() for b in model.buffers()]


def test_batchnorm_statistics_are_averaged_across_ranks(tmp_path) -> None:
    results = run_ranks(_buffers_after_average, 2, tmp_path)
    expected = []
    for rank in range(2):
        model = fresh_model(norm="batch").train()
        model(torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(rank)))
        expected.append([b.clone() for b in model.buffers()])
    for got0, got1, a, b in zip(results[0], results[1], expected[0], expected[1], strict=True):
        assert torch.equal(got0, got1)
        if got0.is_floating_point():
            torch.testing.assert_close(got0, (a + b) / 2)


@pytest.mark.parametrize(
    ("knobs", "accum", "tolerance"),
    [
        # Small buckets and the fp16-compressing hook (under the all-reduce timer), with
        # accumulation: equal to the reference up to fp16 rounding of the gradients.
        (DistConfig(bucket_cap_mb=0.01, grad_compression="fp16"), 2, 2e-3),
        (DistConfig(static_graph=True, gradient_as_bucket_view=False), 1, 1e-5),
    ],
)
def test_ddp_knobs_keep_the_math(tmp_path, knobs, accum, tolerance) -> None:
    results = run_ranks(pipeline_training, 2, tmp_path, 16 // accum, accum, 3, knobs)
    reference = reference_training(global_batch=32, steps=3)
    assert results[0].keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(
            results[0][key], reference[key], rtol=10 * tolerance, atol=tolerance, msg=key
        )
        assert torch.equal(results[0][key], results[1][key])  # ranks stay identical


def test_static_graph_with_accumulation_is_refused(capsys) -> None:
    from cli import parse_args
    from config import ConfigError

    with pytest.raises(ConfigError) as refused:
        parse_args(["--dist.static_graph=true", "--train.grad_accum_steps=2"])
    assert "dist.static_graph=true cannot be combined" in str(refused.value)
    assert capsys.readouterr().err == ""  # said once, by the error train.py prints


def _load_node_weights(info: DistInfo, tmp_path, odd_one: int | None) -> str | None:
    """model.weights as each node sees it: the same path, and on rank `odd_one`'s node a file
    of other weights."""
    import model as models
    from config import ConfigError

    torch.manual_seed(0)
    saved = nn.Linear(3, 2)
    if info.rank == odd_one:
        with torch.no_grad():
            saved.weight.add_(1e-3)
    path = tmp_path / f"node{info.rank}.pt"
    torch.save(saved.state_dict(), path)
    loaded = nn.Linear(3, 2)
    models.load_weights(loaded, str(path))
    try:
        sharding.check_same_weights(loaded, "model.weights=w.pt")
    except ConfigError as err:
        return str(err)
    return None


def test_ranks_that_load_different_weights_all_stop_naming_them(tmp_path) -> None:
    assert run_ranks(_load_node_weights, 3, tmp_path, tmp_path, None) == [None] * 3
    messages = run_ranks(_load_node_weights, 3, tmp_path, tmp_path, 1)
    assert len(set(messages)) == 1 and messages[0] is not None
    assert "model.weights=w.pt gave the ranks different weights (ranks 0,2: sha256" in messages[0]
    assert "; ranks 1: sha256" in messages[0]


def _fail_on_rank_1(info: DistInfo, errno_name: str) -> tuple[str, int | None]:
    import errno

    error = OSError(getattr(errno, errno_name), "the sample file") if info.rank == 1 else None
    try:
        distributed.raise_if_any_failed(info, error, "reading the batch")
    except distributed.PeerError as err:
        return "peer", err.exit_code
    except OSError:
        return "own", None
    return "none", None


@pytest.mark.spawn
def test_another_ranks_transient_io_reaches_rank_0_as_74(tmp_path) -> None:
    """Before the review's fix every other rank's failure reached rank 0 as exit 1 (2 for bad
    input), so rank 1's ESTALE counted toward the crash-loop breaker; now as 74 when every
    failing rank met transient I/O (and launch.uncounted_if_transient_io leaves it uncounted)."""
    assert run_ranks(_fail_on_rank_1, 2, tmp_path, "ESTALE") == [("peer", 74), ("own", None)]
    assert run_ranks(_fail_on_rank_1, 2, tmp_path, "ENOENT") == [("peer", 2), ("own", None)]
