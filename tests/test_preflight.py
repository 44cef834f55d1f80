from __future__ import annotations

import pytest
import torch
from helpers import run_ranks

import preflight
from distributed import DistInfo


def record(rank: int, host: str, **values: str) -> dict:
    base = {
        "rank": rank,
        "local_rank": 0,
        "host": host,
        "python": "3.11.7",
        "torch": "2.14.1",
        "cuda": "12.8",
        "nccl": "2.27.3",
        "device": "NVIDIA H100",
        "dataset": "abc",
        "config": "c0ffee",
    }
    return {**base, **values}


def test_consistent_ranks_have_no_mismatch() -> None:
    assert preflight.mismatches([record(r, f"n{r // 2}") for r in range(4)]) == []


def test_odd_hosts_and_values_are_named() -> None:
    records = [
        record(0, "n0"),
        record(1, "n1"),
        record(2, "n2", device="NVIDIA A100", torch="2.11.0"),
    ]
    problems = preflight.mismatches(records)
    assert problems == [
        "torch differs: 2 ranks have 2.14.1; n2 rank 2: 2.11.0",
        "device differs: 2 ranks have NVIDIA H100; n2 rank 2: NVIDIA A100",
    ]


def _check(info: DistInfo) -> str:
    config_hash = "odd" if info.rank == 2 else "same"
    try:
        preflight.check(info, dataset_fingerprint="data", config_hash=config_hash)
    except preflight.PreflightError as err:
        return str(err)
    return "passed"


@pytest.mark.spawn
def test_every_rank_fails_on_a_mismatch_on_one_rank(tmp_path) -> None:
    messages = run_ranks(_check, 3, tmp_path)
    assert len(set(messages)) == 1  # the same message everywhere
    assert "config differs: 2 ranks have same" in messages[0] and "rank 2: odd" in messages[0]


def _bandwidth(info: DistInfo) -> list[dict]:
    return preflight.bandwidth(info, sizes_mb=(1, 4), repeats=3)


@pytest.mark.spawn
def test_bandwidth_reports_every_size(tmp_path) -> None:
    for results in run_ranks(_bandwidth, 2, tmp_path):
        assert [r["size_mb"] for r in results] == [1, 4]
        assert all(r["seconds"] > 0 and r["busbw_gb_s"] > 0 for r in results)


def test_describe_on_cpu() -> None:
    info = DistInfo(0, 0, 1, torch.device("cpu"))
    described = preflight.describe(info, "d", "c")
    assert described["device"] == "cpu" and described["nccl"] == "none"
    assert set(MUST_MATCH) <= set(described)


MUST_MATCH = ("python", "torch", "cuda", "nccl", "device", "dataset", "config")


@pytest.mark.parametrize("key", MUST_MATCH)
def test_every_must_match_key_is_checked(key) -> None:
    assert preflight.mismatches([record(0, "a"), record(1, "b", **{key: "x"})])
