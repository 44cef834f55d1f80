"""parallel.Layout: the one answer to "does this run shard?" and where its tensors live."""

from __future__ import annotations

import pytest
import torch

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
