"""Jobs across real network hosts: network namespaces joined by a bridge, one machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from cluster import JOB, netns_cluster

import exitcodes

CAN_MAKE_HOSTS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("unshare")
pytestmark = [
    pytest.mark.multinode,
    pytest.mark.slow,
    # Under CI these must run (root, iproute2): missing tools fail instead of skipping.
    pytest.mark.skipif(
        not CAN_MAKE_HOSTS and not os.environ.get("CI"),
        reason="needs root, iproute2 and unshare to create test hosts",
    ),
]


def layout(output: str) -> dict[int, tuple[str, int]]:
    """rank -> (host, local rank), from the preflight table rank 0 logs."""
    found = re.findall(r"rank (\d+) = (\S+) local rank (\d+)", output)
    return {int(rank): (host, int(local)) for rank, host, local in found}


def final_state(run_dir) -> dict:
    return torch.load(run_dir / "checkpoints" / "step_6.pt", weights_only=True)


def test_two_nodes_by_two_processes_is_one_job_equal_to_one_node_by_four(tmp_path) -> None:
    with netns_cluster(2) as cluster:
        two_nodes = cluster.launch([0, 1], nproc=2, args=[f"--run.dir={tmp_path / 'a'}", *JOB])
        one_node = cluster.launch(
            [0], nproc=2 * 2, args=[f"--run.dir={tmp_path / 'b'}", *JOB], port=29401
        )
    assert [r.returncode for r in two_nodes] == [0, 0] and one_node[0].returncode == 0
    node0, node1 = (r.stdout for r in two_nodes)
    assert "world size 4" in node0
    ranks = layout(node0)
    assert sorted(ranks) == [0, 1, 2, 3]
    assert ranks[0] == ("node0", 0) and ranks[1] == ("node0", 1)
    assert {ranks[2], ranks[3]} == {("node1", 0), ("node1", 1)}
    # Only global rank 0, on node 0, writes checkpoints and metrics.
    assert "saved checkpoint" in node0 and "saved checkpoint" not in node1
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    for key, value in b["model"].items():
        assert torch.equal(a["model"][key], value), key
    for index, state in b["optimizer"]["state"].items():
        assert torch.equal(
            a["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"]
        )


def test_hybrid_shards_within_each_node_and_replicates_across_them(tmp_path) -> None:
    """dist.strategy=hybrid on 2 nodes x 2 processes: a (2, 2) mesh, parameters sharded over
    each node's 2 ranks and replicated across the nodes; the first node's ranks write the
    sharded checkpoint's rows; the result is ddp's on the same 2 x 2 job, within float
    rounding (the gradient reductions run in another order)."""
    with netns_cluster(2) as cluster:
        hybrid = cluster.launch(
            [0, 1], nproc=2, args=[f"--run.dir={tmp_path / 'h'}", *JOB, "--dist.strategy=hybrid"]
        )
        ddp = cluster.launch(
            [0, 1], nproc=2, args=[f"--run.dir={tmp_path / 'd'}", *JOB], port=29402
        )
    assert [r.returncode for r in hybrid + ddp] == [0, 0, 0, 0], hybrid[0].stderr[-3000:]
    assert "dist.strategy=hybrid: mesh (2, 2)" in hybrid[0].stdout
    folder = tmp_path / "h" / "checkpoints" / "step_6"
    rows = {}
    for shard in folder.glob("rank_*.pt"):
        rows[shard.name.split(".")[0]] = torch.load(shard, weights_only=True)["rows"]
    weight = next(key for key in rows["rank_0"] if key.endswith(".weight") and "conv" in key)
    assert weight in rows["rank_1"]  # node 0's two ranks each wrote half of it
    assert weight not in rows["rank_2"] and weight not in rows["rank_3"]  # node 1: replicas
    from ckpt import storage

    a = storage.load(folder, torch.device("cpu"))
    b = final_state(tmp_path / "d")
    for key, value in b["model"].items():
        assert torch.allclose(a["model"][key], value, atol=2e-5), key


@pytest.mark.extended  # CI: 2 nodes x 2, hybrid, a killed node, a node-local run dir
def test_three_nodes(tmp_path) -> None:
    with netns_cluster(3) as cluster:
        results = cluster.launch([0, 1, 2], nproc=1, args=[f"--run.dir={tmp_path}", *JOB])
    assert [r.returncode for r in results] == [0, 0, 0]
    assert sorted(layout(results[0].stdout)) == [0, 1, 2]
    assert "on 300 samples" in results[0].stdout  # exact evaluation across 3 hosts


def test_hosts_are_removed_after_the_test() -> None:
    with netns_cluster(2) as cluster:
        prefix = cluster.prefix
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert prefix not in names and prefix not in links


def test_a_node_that_never_arrives_fails_every_started_node_in_bounded_time(tmp_path) -> None:
    run_dir = tmp_path / "run"
    with netns_cluster(2) as cluster:
        started = time.monotonic()
        # NNODES=2 but only node 0 is started.
        (result,) = cluster.launch(
            [0], nproc=1, args=[f"--run.dir={run_dir}", *JOB], NNODES="2", RDZV_JOIN_TIMEOUT="15"
        )
        elapsed = time.monotonic() - started
        leftovers = subprocess.run(
            ["ip", "netns", "pids", f"{cluster.prefix}-node0"], capture_output=True, text=True
        ).stdout
    # retryable: a node merely late meets the next attempt (it was 3, "diverged", final)
    assert result.returncode == exitcodes.EXIT_RENDEZVOUS and elapsed < 15 + 20
    assert "expected 2 nodes, 1 arrived" in result.stdout and "missing NODE_RANK 1" in result.stdout
    assert "10.77.0.1:29401" in result.stdout  # the endpoint
    assert leftovers.strip() == ""  # no process left behind
    assert not run_dir.exists()  # nothing written


def test_wrong_master_addr_is_explained_not_a_hang(tmp_path) -> None:
    with netns_cluster(2) as cluster:
        started = time.monotonic()
        (result,) = cluster.launch(
            [1],
            nproc=1,
            args=[f"--run.dir={tmp_path}", *JOB],
            MASTER_ADDR="10.77.0.9",
            NNODES="2",
            NODE_RANK="1",
            RDZV_JOIN_TIMEOUT="10",
        )
    assert result.returncode == exitcodes.EXIT_RENDEZVOUS and time.monotonic() - started < 10 + 20
    assert "cannot reach the rendezvous at 10.77.0.9:29401" in result.stdout
    assert "MASTER_ADDR" in result.stdout


def test_port_in_use_on_node_zero_is_explained(tmp_path) -> None:
    with netns_cluster(1) as cluster:
        holder = subprocess.Popen(
            cluster.command(
                0,
                {},
                [
                    sys.executable,
                    "-c",
                    "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 29401)); "
                    "s.listen(); print('bound', flush=True); time.sleep(60)",
                ],
            ),
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "NETNS_PREFIX": cluster.prefix},
        )
        try:
            assert holder.stdout.readline().strip() == "bound"
            (result,) = cluster.launch(
                [0], nproc=1, args=[f"--run.dir={tmp_path}", *JOB], RDZV_JOIN_TIMEOUT="10"
            )
        finally:
            holder.kill()
            holder.wait()
    assert result.returncode == exitcodes.EXIT_BAD_INPUT
    assert "RDZV_CHECK_PORT=29401 is in use on node 0" in result.stdout
    assert "import socket, time" in result.stdout  # the holder, named


def test_node_local_run_dir_is_refused_before_training(tmp_path) -> None:
    """Node 1 gets its own disk at the run dir's parent: resume could never work, so refuse."""
    local = tmp_path / "local"
    local.mkdir()
    with netns_cluster(2) as cluster:
        results = cluster.launch(
            [0, 1], nproc=1, args=[f"--run.dir={local / 'run'}", *JOB], private_dirs={1: str(local)}
        )
    assert [r.returncode != 0 for r in results] == [True, True]
    node1 = results[1].stdout
    assert "is not shared: rank 1 on node1 cannot see" in node1 and "ReadWriteMany" in node1
    assert not (local / "run" / "checkpoints").exists()
    assert not list((local / "run").glob(".shared-check-*"))  # the marker is removed again


def test_one_missing_node_of_three_fails_every_started_node_with_one_verdict(tmp_path) -> None:
    """Node 1 arrives, node 2 never does: nodes 0 and 1 both stop with node 0's verdict."""
    with netns_cluster(3) as cluster:
        results = cluster.launch(
            [0, 1],
            nproc=1,
            args=[f"--run.dir={tmp_path / 'run'}", *JOB],
            NNODES="3",
            RDZV_JOIN_TIMEOUT="10",
        )
    for result in results:
        assert result.returncode != 0
        assert "expected 3 nodes, 2 arrived" in result.stdout
        assert "missing NODE_RANK 2" in result.stdout
    assert not (tmp_path / "run").exists()


def test_master_addr_that_is_not_node_zero_is_explained(tmp_path) -> None:
    with netns_cluster(2) as cluster:
        (result,) = cluster.launch(
            [0],
            nproc=1,
            args=[f"--run.dir={tmp_path}", *JOB],
            MASTER_ADDR="10.77.0.2",
            RDZV_JOIN_TIMEOUT="10",
        )
    assert result.returncode != 0
    assert (
        "MASTER_ADDR=10.77.0.2" in result.stdout and "not an address of this host" in result.stdout
    )


def test_sigkill_on_one_node_restarts_both_and_matches_a_clean_run(tmp_path) -> None:
    """A worker on node 1 is SIGKILLed at step 4; both nodes' torchrun restart the group (a
    fresh rendezvous store per round, set by launch_multinode.sh), it resumes from step 2's
    checkpoint and ends torch.equal to a run that was never interrupted."""
    job = [*JOB, "--ckpt.every_steps=2"]
    with netns_cluster(2) as cluster:
        clean = cluster.launch([0, 1], nproc=1, args=[f"--run.dir={tmp_path / 'a'}", *job])
        killed = cluster.launch(
            [0, 1],
            nproc=1,
            args=[f"--run.dir={tmp_path / 'b'}", *job],
            port=29401,
            MAX_RESTARTS="1",
            TRAIN_FAULTS="sigkill@step=3,rank=1",
            TRAIN_SCRIPT="tests/faults.py",
        )
    assert [r.returncode for r in clean] == [0, 0]
    assert [r.returncode for r in killed] == [0, 0], killed[0].stdout[-3000:]
    assert "exitcode: -9" in killed[1].stdout  # node 1's worker really died
    assert "resuming from" in killed[0].stdout
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    for key, value in a["model"].items():
        assert torch.equal(b["model"][key], value), key


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        ({0: "gpu-node", 1: "gpu-node"}, "NODE_RANKs [0, 1] all advertise the same host name"),
        ({0: "node-a", 1: "localhost"}, "NODE_RANK 1 (localhost) advertises 'localhost', which "),
    ],
)
def test_host_names_that_do_not_lead_back_are_explained_naming_local_addr(
    tmp_path, names, expected
) -> None:
    """Without LOCAL_ADDR torchrun advertises each node's host name; the same name on every
    node, or one resolving to loopback, would leave the workers waiting past every timeout."""
    start = time.monotonic()
    with netns_cluster(2) as cluster:
        results = cluster.launch(
            [0, 1],
            nproc=1,
            args=[f"--run.dir={tmp_path / 'run'}", *JOB],
            hostnames=names,
            LOCAL_ADDR="",
            RDZV_JOIN_TIMEOUT="30",
            timeout=120,
        )
    assert time.monotonic() - start < 90
    for result in results:
        assert result.returncode == exitcodes.EXIT_BAD_INPUT, result.stdout[-3000:]
        assert expected in result.stdout and "Set LOCAL_ADDR" in result.stdout
    assert not (tmp_path / "run").exists()  # nothing started
