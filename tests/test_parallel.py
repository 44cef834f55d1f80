"""parallel.Layout: the one answer to "does this run shard?" and where its tensors live."""

from __future__ import annotations

import pytest
import torch
from helpers import REPO, final_state, launch
from torch import nn

import distributed
import parallel
from config import DistConfig
from distributed import DistInfo

CPU = torch.device("cpu")


def info(rank: int, world_size: int) -> DistInfo:
    return DistInfo(rank, rank, world_size, CPU, "gloo")


# (strategy, under a process group) -> shards: fsdp and hybrid shard under a process group
# (at world size 1 too, under torchrun); nothing shards without one (python train.py).
CASES = [
    ("ddp", False, False),
    ("zero", False, False),
    ("fsdp", False, False),
    ("hybrid", False, False),
    ("ddp", True, False),
    ("zero", True, False),
    ("fsdp", True, True),
    ("hybrid", True, True),
]


@pytest.mark.parametrize("strategy, in_group, expected", CASES)
def test_a_run_shards_under_fsdp_and_hybrid_in_a_process_group(
    monkeypatch, strategy: str, in_group: bool, expected: bool
) -> None:
    monkeypatch.setattr(distributed, "in_group", lambda: in_group)
    layout = parallel.Layout.of(DistConfig(strategy=strategy), info(0, 1))
    assert layout == parallel.Layout(strategy, expected, 1)
    assert layout.shards is expected


def test_only_ranks_but_rank_0_of_a_sharded_run_build_on_the_meta_device() -> None:
    sharded = parallel.Layout("fsdp", True, 3)
    assert not sharded.builds_on_meta(is_main=True)
    assert sharded.builds_on_meta(is_main=False)
    whole = parallel.Layout("ddp", False, 3)
    assert not whole.builds_on_meta(is_main=True)
    assert not whole.builds_on_meta(is_main=False)


def test_collectives_run_inside_the_step_only_when_sharded_over_several_ranks() -> None:
    assert parallel.Layout("fsdp", True, 2).collectives_inside_step
    assert parallel.Layout("hybrid", True, 4).collectives_inside_step
    assert not parallel.Layout("fsdp", True, 1).collectives_inside_step  # torchrun, one rank
    assert not parallel.Layout("ddp", False, 2).collectives_inside_step


# ---------------------------------------------------------------------------------------------
# Models fsdp cannot shard as they are (issue 31 A5), as users bring them (--model.factory)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


class _Shared(nn.Module):
    """Two blocks (fsdp's auto units) sharing one weight ("blocks"), or a block sharing its
    weight with the head, which stays in the root ("head"); or a learned temperature, a 0-dim
    parameter ("temperature")."""

    def __init__(self, in_features: int, num_classes: int, kind: str) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, num_classes)
        self.blocks = nn.Sequential(_Block(num_classes), _Block(num_classes))
        self.head = nn.Linear(num_classes, num_classes)
        if kind == "blocks":
            self.blocks[1].fc.weight = self.blocks[0].fc.weight
        if kind == "head":
            self.head.weight = self.blocks[1].fc.weight
        self.temperature = nn.Parameter(torch.tensor(2.0)) if kind == "temperature" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(self.stem(x.flatten(1))))
        return logits if self.temperature is None else logits / self.temperature


def shared_model(*, in_channels: int, num_classes: int, kind: str) -> nn.Module:
    return _Shared(in_channels * 28 * 28, num_classes, kind)


def _run(tmp_path, strategy: str, kind: str):  # noqa: ANN202
    return launch(
        2,
        f"--run.dir={tmp_path / f'{strategy}-{kind}'}",
        f"--dist.strategy={strategy}",
        "--model.factory=test_parallel:shared_model",
        f'--model.kwargs={{"kind": "{kind}"}}',
        "--data.dataset=synthetic",
        "--data.synthetic_train_size=64",
        "--data.synthetic_eval_size=16",
        "--data.batch_size=4",
        "--data.num_workers=0",
        "--train.max_steps=4",
        "--log.tensorboard=false",
        env={"PYTHONPATH": str(REPO / "tests")},
    )


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["blocks", "head"])
def test_tied_weights_train_under_fsdp_as_under_ddp(tmp_path, kind) -> None:
    """Before: fully_shard raised "Parameter 'blocks.1.fc.weight' is shared with a parameter
    already managed by another FSDP group" (exit 1, a traceback). Now the blocks that share
    it are one FSDP unit (a block sharing it with the root is left to the root), and the run
    ends with ddp's weights, the tie kept."""
    states = {}
    for strategy in ("ddp", "fsdp"):
        done = _run(tmp_path, strategy, kind)
        assert done.returncode == 0, done.output[-4000:]
        states[strategy] = final_state(tmp_path / f"{strategy}-{kind}")["model"]
    assert states["fsdp"].keys() == states["ddp"].keys()
    for name, value in states["ddp"].items():
        assert torch.allclose(states["fsdp"][name], value, atol=1e-6), name
    tied = "head.weight" if kind == "head" else "blocks.1.fc.weight"
    assert torch.equal(states["fsdp"][tied], states["fsdp"]["blocks.0.fc.weight" if kind ==
                       "blocks" else "blocks.1.fc.weight"])  # fmt: skip


@pytest.mark.e2e
def test_a_0_dim_parameter_under_fsdp_is_refused_by_name(tmp_path) -> None:
    """Before: "ValueError: fully_shard doesn't support scalar parameters" with a traceback,
    exit 1 (launchers retry it). Now exit 2 naming the parameter and the alternatives."""
    refused = _run(tmp_path, "fsdp", "temperature")
    assert "exitcode: 2" in refused.output, refused.output[-4000:]
    assert "dist.strategy=fsdp cannot shard 0-dim parameters (temperature)" in refused.output
    assert "[rank0]: Traceback" not in refused.output
    trained = _run(tmp_path, "ddp", "temperature")
    assert trained.returncode == 0, trained.output[-4000:]


def test_a_unit_tied_to_a_unit_tied_to_the_root_goes_to_the_root_too() -> None:
    """Blocks 0 and 1 share a weight, and block 1 shares another with the head (the root's).
    Before the review's fix block 1 went to the root while block 0 was still wrapped alone,
    holding block 1's tied weight: fully_shard's overlapping groups again."""
    from torch import nn

    import parallel

    blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(3))
    blocks[1][0].weight = blocks[0][0].weight
    head = nn.Linear(4, 4)
    head.weight = blocks[1][1].weight
    model = nn.ModuleDict({"blocks": blocks, "head": head})
    groups = parallel.tied_groups(model, list(blocks))
    assert groups == [[blocks[2]]]  # blocks 0 and 1 are the root's
