"""Meet every node before torchrun does, and say exactly what is wrong when they do not meet.

torchrun's own rendezvous reports a missing node as a bare `RendezvousTimeoutError`, and an
unreachable MASTER_ADDR as a minutes-long connect retry. This check runs first on each node
(from launch_multinode.sh): node 0 hosts a small TCP store on RDZV_CHECK_PORT, every node checks
in with its NODE_RANK and host name, and within RDZV_JOIN_TIMEOUT seconds either all NNODES
arrive or every started node exits with a message naming the endpoint, the nodes that arrived
and the NODE_RANKs that did not. Exit codes: 0 all arrived, 3 timeout or unreachable, 4 bad
setup (port in use, address not on node 0, duplicate NODE_RANK).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

from torch.distributed import TCPStore

POLL_S = 0.2


def fail(code: int, message: str) -> None:
    print(f"rendezvous_check: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Hide c10d's C++ retry logs and stack traces (our message says what went wrong)."""
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class SetupError(Exception):
    """(exit code, message) of a node that cannot join the check."""


def connect(addr: str, port: int, node_rank: int, timeout_s: float) -> TCPStore:
    try:
        with quiet_stderr():
            return _connect(addr, port, node_rank, timeout_s)
    except SetupError as err:
        fail(*err.args)
        raise


def _connect(addr: str, port: int, node_rank: int, timeout_s: float) -> TCPStore:
    endpoint = f"{addr}:{port}"
    if node_rank == 0:
        try:
            return TCPStore(
                addr,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
            )
        except Exception as err:  # bind failed: port taken, or addr is not this host's
            raise SetupError(
                4,
                f"node 0 cannot listen on {endpoint}: {err}. Is port {port} already in use, "
                f"or is MASTER_ADDR={addr} not an address of this host (node 0)?",
            ) from None
    try:
        return TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as err:
        raise SetupError(
            3,
            f"node {node_rank} cannot reach the rendezvous at {endpoint} within "
            f"{timeout_s:.0f} s ({err}). Check MASTER_ADDR (node 0's address as seen from "
            "this node), the firewall, and that node 0 has been started",
        ) from None


def wait_for(store: TCPStore, key: str, count: int, deadline: float) -> int:
    """Poll counter `key` until it reaches `count` or the deadline passes; return its value."""
    while True:
        value = store.add(key, 0)
        if value >= count or time.monotonic() > deadline:
            return value
        time.sleep(POLL_S)


def main() -> None:
    addr = os.environ["MASTER_ADDR"]
    port = int(os.environ["RDZV_CHECK_PORT"])
    num_nodes = int(os.environ["NNODES"])
    node_rank = int(os.environ["NODE_RANK"])
    timeout_s = float(os.environ.get("RDZV_JOIN_TIMEOUT", "600"))
    deadline = time.monotonic() + timeout_s
    store = connect(addr, port, node_rank, timeout_s)
    host = socket.gethostname()
    if store.add(f"rank/{node_rank}", 1) > 1:
        fail(
            4,
            f"NODE_RANK={node_rank} is used by two nodes (this one is {host}); give each "
            f"node its own NODE_RANK in 0..{num_nodes - 1}",
        )
    store.set(f"host/{node_rank}", host)
    store.add("arrived_total", 1)
    arrived = wait_for(store, "arrived_total", num_nodes, deadline)
    if arrived < num_nodes:
        present = [r for r in range(num_nodes) if store.check([f"host/{r}"])]
        names = ", ".join(f"{r}={store.get(f'host/{r}').decode()}" for r in present)
        missing = [r for r in range(num_nodes) if r not in present]
        fail(
            3,
            f"rendezvous at {addr}:{port} timed out after {timeout_s:.0f} s: expected "
            f"{num_nodes} nodes, {arrived} arrived (NODE_RANK {names}); missing NODE_RANK "
            f"{', '.join(map(str, missing))}. Start them, or check their MASTER_ADDR",
        )
    store.add("done", 1)
    if node_rank == 0:  # keep the store up until every node has seen the full count
        wait_for(store, "done", num_nodes, time.monotonic() + 30)
    print(f"rendezvous_check: all {num_nodes} nodes arrived at {addr}:{port}", flush=True)


if __name__ == "__main__":
    main()
