"""Meet every node before torchrun does, and say exactly what is wrong when they do not meet.

Runs first on each node (from launch_multinode.sh): node 0 hosts a small TCP store on
RDZV_CHECK_PORT and every node checks in with its NODE_RANK, NNODES and host name. Node 0
alone decides, by its own deadline (RDZV_JOIN_TIMEOUT seconds), and publishes one verdict that
every node that arrived reads: all go on to torchrun, or all exit with the same message naming
the endpoint, the nodes that arrived and the NODE_RANKs that did not. Node 0 also checks the
address each node will advertise (LOCAL_ADDR, else its fully qualified host name) and that
MASTER_PORT is free.

Exit codes (exitcodes.py): 0 all arrived; 69 (EXIT_RENDEZVOUS, retryable: a node merely late
meets the next attempt) timeout, unreachable node 0, or node 0 gone; 2 (EXIT_BAD_INPUT, final:
the message names the variable) a missing or malformed variable, MASTER_PORT or
RDZV_CHECK_PORT in use on node 0, MASTER_ADDR not an address of node 0, duplicate NODE_RANK,
NNODES differing between nodes, advertised addresses that do not lead back to their node.

`--pick-port START` prints the first of START, START + 2, ... that is free here with its
successor (train.sbatch, on node 0, for a MASTER_PORT it derived).

Why torchrun's own rendezvous is not enough, and what each check prevents: docs/running.md.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's modules
from exitcodes import EXIT_BAD_INPUT, EXIT_RENDEZVOUS  # noqa: E402

POLL_S = 0.2
GRACE_S = 15.0  # beyond node 0's deadline: clock skew, and node 0 writing the verdict


class CheckFailed(Exception):
    """(exit code, message)."""


def fail(code: int, message: str) -> None:
    raise CheckFailed(code, message)


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


def port_holders(port: int) -> list[str]:
    """'pid N (command)' of the processes listening on TCP `port`, as far as /proc shows them
    (sockets in /proc/net/tcp{,6} in state 0A, LISTEN; their owners by /proc/PID/fd links)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    holders = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                holders.append(f"pid {proc.name} ({command[:120]})")
    return holders


def port_taken(port: int) -> str | None:
    """Why `port` cannot be listened on here, or None when it can (SO_REUSEADDR: a closing
    socket of a previous attempt in TIME_WAIT does not count)."""
    try:  # all addresses, IPv4 too, as c10d's TCPStore listens; IPv4 alone without IPv6
        sock = socket.socket(socket.AF_INET6)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        anywhere = "::"
    except OSError:
        sock, anywhere = socket.socket(socket.AF_INET), "0.0.0.0"
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((anywhere, port))
            return None
        except OSError as err:
            return err.strerror or str(err)


def pick_port(start: int, tries: int = 64) -> int:
    """The first of start, start + 2, ... whose port and the next (the rendezvous check's) can
    both be listened on here; `start` when none can (the check then names the holder)."""
    for port in range(start, min(start + 2 * tries, 65534), 2):
        if port_taken(port) is None and port_taken(port + 1) is None:
            return port
    return start


def require_free_port(variable: str, port: int) -> None:
    """On node 0: `port` can be listened on, else bad input naming `variable` and the holder."""
    reason = port_taken(port)
    if reason is None:
        return
    holders = port_holders(port)
    held = f"held by {'; '.join(holders)}" if holders else "held by a process /proc does not show"
    fail(
        EXIT_BAD_INPUT,
        f"{variable}={port} is in use on node 0 ({reason}; {held}): another job, or a "
        f"leftover of an earlier one, listens there. Choose another {variable}, or stop that "
        "process",
    )


def check_local_address(addr: str, ports: dict[str, int]) -> None:
    """On node 0: MASTER_ADDR must be one of this host's addresses, and the ports free."""
    try:
        ip = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as err:
        fail(EXIT_BAD_INPUT, f"MASTER_ADDR={addr} does not resolve on node 0: {err}")
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as sock:
        try:
            sock.bind((ip, 0))
        except OSError:
            fail(
                EXIT_BAD_INPUT,
                f"MASTER_ADDR={addr} ({ip}) is not an address of this host, but this is "
                "node 0 (NODE_RANK=0): give node 0's own address",
            )
    for variable, port in ports.items():
        require_free_port(variable, port)


def connect(addr: str, port: int, node_rank: int, timeout_s: float) -> TCPStore:
    endpoint = f"{addr}:{port}"
    with quiet_stderr():
        try:
            return TCPStore(
                addr,
                port,
                is_master=node_rank == 0,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
            )
        except Exception as err:
            if node_rank == 0:  # the port was free a moment ago: a race, retry
                fail(
                    EXIT_RENDEZVOUS,
                    f"node 0 cannot serve the rendezvous check on {endpoint}: {err}",
                )
            fail(
                EXIT_RENDEZVOUS,
                f"node {node_rank} cannot reach the rendezvous at {endpoint} within "
                f"{timeout_s:.0f} s ({err}). Check MASTER_ADDR (node 0's address as seen "
                "from this node), that TCP port "
                f"{port} on node 0 is open to this node, and that node 0 has been started",
            )
    raise AssertionError("unreachable")


def advertised_address() -> dict:
    """The name torchrun will advertise for this node to the others (LOCAL_ADDR, else the
    fully qualified host name) and what it resolves to here."""
    local = os.environ.get("LOCAL_ADDR", "")
    name = local or socket.getfqdn()
    try:
        ips = sorted(
            {info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
        )
    except OSError:
        ips = []
    return {"name": name, "explicit": bool(local), "ips": ips}


def address_problems(present: dict[int, dict]) -> list[str]:
    """Advertised names that cannot lead the other nodes back to their node: torchrun's
    rendezvous would hand them out and the workers would wait on them until a timeout."""
    problems = []
    by_name: dict[str, list[int]] = {}
    for rank, node in present.items():
        by_name.setdefault(node["addr"]["name"], []).append(rank)
    for name, ranks in by_name.items():
        if len(ranks) > 1:
            problems.append(f"NODE_RANKs {ranks} all advertise the same host name {name!r}")
    for rank, node in present.items():
        addr = node["addr"]
        if not addr["ips"]:
            problems.append(
                f"NODE_RANK {rank} ({node['host']}) advertises {addr['name']!r}, which does "
                "not resolve on that node"
            )
        elif all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in addr["ips"]):
            problems.append(
                f"NODE_RANK {rank} ({node['host']}) advertises {addr['name']!r}, which "
                f"resolves to loopback ({', '.join(addr['ips'])}) on that node"
            )
    return problems


def check_in(store: TCPStore, node_rank: int, num_nodes: int) -> None:
    me = {"host": socket.gethostname(), "nnodes": num_nodes, "addr": advertised_address()}
    if store.add(f"rank/{node_rank}", 1) > 1:
        reason = (
            f"NODE_RANK={node_rank} is used by two nodes (one is {me['host']}); give "
            f"each node its own NODE_RANK in 0..{num_nodes - 1}"
        )
        store.compare_set("verdict", "", json.dumps({"code": EXIT_BAD_INPUT, "message": reason}))
        fail(EXIT_BAD_INPUT, reason)
    store.set(f"node/{node_rank}", json.dumps(me))


def decide(store: TCPStore, addr: str, port: int, num_nodes: int, timeout_s: float) -> dict:
    """Node 0: wait for all nodes (or a verdict from a duplicate) until the deadline."""
    deadline = time.monotonic() + timeout_s
    keys = [f"node/{rank}" for rank in range(num_nodes)]
    while time.monotonic() < deadline and not store.check(keys) and not store.check(["verdict"]):
        time.sleep(POLL_S)
    if store.check(["verdict"]):
        return json.loads(store.get("verdict"))
    present = {
        rank: json.loads(store.get(f"node/{rank}"))
        for rank in range(num_nodes)
        if store.check([f"node/{rank}"])
    }
    names = ", ".join(f"{rank}={node['host']}" for rank, node in present.items())
    if len(present) < num_nodes:
        missing = ", ".join(str(r) for r in range(num_nodes) if r not in present)
        verdict = {
            "code": EXIT_RENDEZVOUS,
            "message": (
                f"rendezvous at {addr}:{port} timed out after {timeout_s:.0f} s: expected "
                f"{num_nodes} nodes, {len(present)} arrived (NODE_RANK {names}); missing NODE_RANK "
                f"{missing}. Start them, or check their MASTER_ADDR"
            ),
        }
    elif any(node["nnodes"] != num_nodes for node in present.values()):
        odd = ", ".join(
            f"{node['host']} has NNODES={node['nnodes']}"
            for node in present.values()
            if node["nnodes"] != num_nodes
        )
        verdict = {
            "code": EXIT_BAD_INPUT,
            "message": f"NNODES differs between nodes: node 0 has {num_nodes}; {odd}",
        }
    elif num_nodes > 1 and (problems := address_problems(present)):
        verdict = {
            "code": EXIT_BAD_INPUT,
            "message": (
                "the nodes' addresses do not lead back to them: "
                + "; ".join(problems)
                + ". torchrun would advertise these names and its workers would wait for "
                "unreachable peers until a timeout. Set LOCAL_ADDR on each node to its own "
                "address as the other nodes reach it (for example LOCAL_ADDR=$(hostname -I | "
                "cut -d' ' -f1)), or fix the host names in DNS or /etc/hosts"
            ),
        }
    else:
        verdict = {
            "code": 0,
            "message": f"all {num_nodes} nodes arrived at {addr}:{port} (NODE_RANK {names})",
        }
    store.compare_set("verdict", "", json.dumps(verdict))
    return json.loads(store.get("verdict"))


def run(
    addr: str, port: int, num_nodes: int, node_rank: int, timeout_s: float, master_port: int
) -> str:
    if node_rank == 0:
        ports = {"RDZV_CHECK_PORT": port}
        if master_port:
            ports["MASTER_PORT"] = master_port
        check_local_address(addr, ports)
    store = connect(addr, port, node_rank, timeout_s)
    try:
        if node_rank == 0:
            store.set("deadline", str(time.time() + timeout_s))
            check_in(store, node_rank, num_nodes)
            verdict = decide(store, addr, port, num_nodes, timeout_s)
            arrived = sum(store.check([f"node/{r}"]) for r in range(num_nodes))
            # Keep the store up until every node that arrived has read the verdict.
            until = time.monotonic() + GRACE_S
            while store.add("read", 0) < arrived - 1 and time.monotonic() < until:
                time.sleep(POLL_S)
        else:
            check_in(store, node_rank, num_nodes)
            store.wait(["deadline"], timedelta(seconds=timeout_s))
            remaining = float(store.get("deadline")) - time.time() + GRACE_S
            store.wait(["verdict"], timedelta(seconds=max(remaining, GRACE_S)))
            verdict = json.loads(store.get("verdict"))
            store.add("read", 1)
    except CheckFailed:
        raise
    except Exception as err:  # node 0 closed the store (it gave up, or was killed)
        fail(
            EXIT_RENDEZVOUS,
            f"the rendezvous check at {addr}:{port} ended before all nodes met ({err}); "
            "see node 0's message",
        )
    if verdict["code"]:
        fail(verdict["code"], verdict["message"])
    return verdict["message"]


def setting(name: str, kind: type, default: str | None = None) -> int | float | str:
    """Environment variable `name` as `kind`, or bad input naming it and its value."""
    value = os.environ.get(name, default)
    if not value:
        fail(EXIT_BAD_INPUT, f"{name} is not set")
    try:
        return kind(value)
    except ValueError:
        fail(EXIT_BAD_INPUT, f"{name}={value} is not {'an integer' if kind is int else 'a number'}")
    raise AssertionError("unreachable")


def main() -> int:
    if sys.argv[1:2] == ["--pick-port"]:  # train.sbatch, for a port it derived: print one free
        print(pick_port(int(sys.argv[2])))
        return 0
    try:
        message = run(
            str(setting("MASTER_ADDR", str)),
            int(setting("RDZV_CHECK_PORT", int)),
            int(setting("NNODES", int)),
            int(setting("NODE_RANK", int)),
            float(setting("RDZV_JOIN_TIMEOUT", float, "600")),
            int(setting("MASTER_PORT", int, "0")),
        )
    except CheckFailed as failure:
        code, message = failure.args
        print(f"rendezvous_check: {message}", file=sys.stderr, flush=True)
        return code
    print(f"rendezvous_check: {message}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
