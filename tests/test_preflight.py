from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys

import pytest
import torch
from helpers import REPO, free_port, run_ranks

import exitcodes
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
        "code": "5eed",
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


def _check_code(info: DistInfo, folders: list[str]) -> str:
    """Each rank imports the user's factory module from a working directory of its own, as
    two nodes with their own checkouts do; rank 1's copy has one line changed."""
    os.chdir(folders[info.rank])
    sys.path.insert(0, folders[info.rank])
    __import__("my_factory")
    try:
        preflight.check(info, dataset_fingerprint="data", config_hash="same")
    except preflight.PreflightError as err:
        return str(err)
    return "passed"


@pytest.mark.spawn
def test_ranks_running_different_code_with_one_config_are_caught(tmp_path) -> None:
    """Before, nodes with the same config and dataset but different code (an edited factory, a
    stale checkout) passed preflight and trained different models."""
    folders = []
    for rank, width in enumerate((32, 33)):
        folder = tmp_path / f"node{rank}"
        folder.mkdir()
        (folder / "my_factory.py").write_text(f"WIDTH = {width}\n")
        folders.append(str(folder))
    messages = run_ranks(_check_code, 2, tmp_path, folders)
    assert len(set(messages)) == 1, messages
    assert "code differs" in messages[0], messages[0]
    assert "rank 1 runs other versions of: my_factory.py" in messages[0], messages[0]
    (tmp_path / "node1" / "my_factory.py").write_text("WIDTH = 32\n")  # the same code again
    assert run_ranks(_check_code, 2, tmp_path, folders) == ["passed", "passed"]


def test_the_code_digest_covers_the_project_and_not_installed_packages() -> None:
    files = preflight.source_files()
    assert {"preflight.py", "distributed.py", "config.py"} <= files.keys()
    assert not [name for name in files if "site-packages" in name or name.startswith(".venv")]
    digest = hashlib.sha256((REPO / "preflight.py").read_bytes()).hexdigest()
    assert files["preflight.py"] == digest[: preflight.DIGEST_CHARS]


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


MUST_MATCH = ("python", "torch", "cuda", "nccl", "device", "dataset", "config", "code")


@pytest.mark.parametrize("key", MUST_MATCH)
def test_every_must_match_key_is_checked(key) -> None:
    assert preflight.mismatches([record(0, "a"), record(1, "b", **{key: "x"})])


# --- scripts/rendezvous_check.py on this host (tests/multinode runs it across namespaces) ------


def _rendezvous_check(**env: str) -> subprocess.CompletedProcess:
    base = {"MASTER_ADDR": "127.0.0.1", "NNODES": "1", "NODE_RANK": "0", "RDZV_JOIN_TIMEOUT": "2"}
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "rendezvous_check.py")],
        env={**os.environ, **base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_a_late_node_is_retryable_not_diverged() -> None:
    """Before, a missing node exited 3, which is train.py's 'diverged' (final on Slurm, Ray and
    the Kubernetes podFailurePolicy): a node merely late failed the job for good."""
    port = free_port()
    result = _rendezvous_check(NNODES="2", RDZV_CHECK_PORT=str(port + 1), MASTER_PORT=str(port))
    assert result.returncode == exitcodes.EXIT_RENDEZVOUS, result.stderr
    assert not exitcodes.is_final(result.returncode)
    assert "expected 2 nodes, 1 arrived" in result.stderr and "missing NODE_RANK 1" in result.stderr


@pytest.mark.slow
def test_master_port_held_by_another_job_is_caught_on_node_zero() -> None:
    """torchrun's c10d store listens on MASTER_PORT after this check passed: a port held by
    another job failed torchrun later, with a traceback and exit 1. Now node 0 tries to bind it
    (as c10d's TCPStore would, on every address) and names the variable and the holder."""
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", port))
        holder.listen()
        result = _rendezvous_check(RDZV_CHECK_PORT=str(port + 1), MASTER_PORT=str(port))
    assert result.returncode == exitcodes.EXIT_BAD_INPUT, result.stderr
    assert f"MASTER_PORT={port} is in use on node 0" in result.stderr
    assert f"pid {os.getpid()} " in result.stderr  # this test process holds it


@pytest.mark.slow
@pytest.mark.parametrize(("unset", "value"), [("NNODES", None), ("NODE_RANK", "first")])
def test_a_missing_or_malformed_variable_is_named(unset: str, value: str | None) -> None:
    env = {"RDZV_CHECK_PORT": str(free_port()), unset: value or ""}
    result = _rendezvous_check(**env)
    assert result.returncode == exitcodes.EXIT_BAD_INPUT, result.stderr
    assert unset in result.stderr and "Traceback" not in result.stderr


def _connection_broken_by_rank_1(rank: int, store: str, out: str) -> None:
    """Rank 1 leaves (its sockets closed by the kernel) after one all-reduce; rank 0's next
    all-reduce breaks, and rank 0 writes what `broken_peer` makes of gloo's real error."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    import distributed

    dist.init_process_group("gloo", f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))  # fmt: skip
    distributed.know_peers(
        [
            {"rank": 0, "host": "node-a", "addresses": ["127.0.0.1"]},
            {"rank": 1, "host": "node-b", "addresses": ["127.0.0.1", "10.9.9.9"]},
        ]
    )
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        os._exit(0)
    said = None
    try:
        for _ in range(200):
            dist.all_reduce(torch.ones(1))
    except RuntimeError as err:
        said = [distributed.broken_peer(err), str(err)]
    with open(out, "w") as file:
        json.dump(said, file)
    os._exit(0)


@pytest.mark.spawn
def test_a_broken_connection_names_the_node_at_its_other_end(tmp_path) -> None:
    """Before, when a rank on another node died, node 0's log named only its own rank 0's
    error ("Connection closed by peer [ADDR]:PORT"). Now the address is matched to the host
    and ranks preflight met there (rank 0 itself left out)."""
    import json

    import torch.multiprocessing as mp

    out = tmp_path / "said.json"
    mp.start_processes(
        _connection_broken_by_rank_1,
        args=(str(tmp_path / "store"), str(out)),
        nprocs=2,
        start_method="spawn",
    )
    named, error = json.loads(out.read_text())
    # gloo's own words (pair.cc), either "Connection closed by peer [ADDR]:PORT" or "Read
    # error [ADDR]:PORT: Connection reset by peer", as the race between the two ranks falls
    assert "[127.0.0.1]:" in error and "by peer" in error, error
    assert named.startswith("the connection to 127.0.0.1 (node-b: rank 1) broke"), named


def test_both_forms_of_a_gloo_broken_connection_names_its_address(monkeypatch) -> None:
    """gloo's pair.cc words it two ways; the bracketed source path before it is not an
    address. Without preflight's records only the address is named."""
    import distributed

    monkeypatch.setattr(
        distributed, "_peers", [{"rank": 3, "host": "n1", "addresses": ["10.0.0.2"]}]
    )
    reset = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
        "[10.0.0.2]:45734: Connection reset by peer. This is typically caused by ..."
    )
    assert distributed.broken_peer(reset).startswith("the connection to 10.0.0.2 (n1: rank 3)")
    monkeypatch.setattr(distributed, "_peers", [])
    assert distributed.broken_peer(reset) == "the connection to 10.0.0.2 broke"
    assert distributed.broken_peer(RuntimeError("Connection closed by peer")) is None


def test_a_derived_port_held_on_node_zero_is_exchanged_for_a_free_pair() -> None:
    """train.sbatch derives MASTER_PORT from the job id; before, a port another process held
    on node 0 ended the job with exit 2 ("bad input, not requeued") though the user chose no
    port. `--pick-port` steps by 2 to a port free with its successor (the rendezvous check's)."""
    port = free_port()
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        held.bind(("", port))
        held.listen()
        picked = subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "rendezvous_check.py"),
                "--pick-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    chosen = int(picked.stdout)
    assert chosen > port and (chosen - port) % 2 == 0
    for candidate in (chosen, chosen + 1):
        with socket.socket() as probe:
            probe.bind(("", candidate))
