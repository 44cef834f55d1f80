"""Test hosts as network namespaces (scripts/netns_cluster.sh) and launching a job across them."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from helpers import tiny_job_args

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "netns_cluster.sh"


# A small synthetic job, 6 steps, that the multi-node and container tests run on their hosts.
JOB = tiny_job_args(
    data_synthetic_train_size=1024,
    data_synthetic_eval_size=300,
    data_batch_size=32,
    train_max_steps=6,
    model_widths="8,16",
    log_every_steps=2,
    dist_timeout_s=60,
)


def address(node: int) -> str:
    return f"10.77.0.{node + 1}"


@dataclass(frozen=True)
class Cluster:
    prefix: str
    num_hosts: int

    def command(
        self, node: int, env: dict[str, str], argv: list[str], image: list[str] | None = None
    ) -> list[str]:
        pairs = [f"{key}={value}" for key, value in env.items()]
        if image is None:
            return ["bash", str(SCRIPT), "exec", str(node), "env", *pairs, *argv]
        # A container on this host: `image` is the engine's run command up to and including
        # the image name, with the host's network and host name. nsenter, not `ip netns exec`:
        # that one remounts /sys, hiding the cgroup file systems the container runtime needs.
        run, name = image[:-1], image[-1]
        return [
            "nsenter",
            f"--net=/run/netns/{self.prefix}-node{node}",
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            f"node{node}",
            *run,
            "--network=host",
            "--uts=host",
            *[f"--env={pair}" for pair in pairs],
            name,
            *argv,
        ]

    def launch(
        self,
        nodes: list[int],
        nproc: int,
        args: list[str],
        port: int = 29400,
        timeout: float = 240,
        private_dirs: dict[int, str] | None = None,
        hostnames: dict[int, str] | None = None,
        image: list[str] | None = None,
        **overrides: str,
    ) -> list[subprocess.CompletedProcess]:
        """Run scripts/launch_multinode.sh on `nodes` as a user would on each machine.

        `private_dirs` maps a node to a directory that gets a tmpfs of its own on that node:
        a node-local disk where the others have shared storage. `hostnames` renames nodes.
        `image` runs the script in a container instead (see `command`).
        """
        # Those wrappers rename the host and mount as root, which a container user cannot.
        assert image is None or not (private_dirs or hostnames), "not with image"
        procs, logs = [], []
        for node_rank, node in enumerate(nodes):
            env = {
                "MASTER_ADDR": address(nodes[0]),
                "MASTER_PORT": str(port),
                "NNODES": str(len(nodes)),
                "NODE_RANK": str(node_rank),
                "NPROC_PER_NODE": str(nproc),
                "SOCKET_IFNAME": "eth0",
                "LOCAL_ADDR": address(node),
                "MAX_RESTARTS": "0",
                "RDZV_JOIN_TIMEOUT": "60",
                "JOB_ID": f"test-{self.prefix}",
                "OMP_NUM_THREADS": "1",
                **overrides,
            }
            argv = ["bash", "scripts/launch_multinode.sh", *args]
            if hostnames and node in hostnames:  # this host's own UTS namespace only
                argv = ["sh", "-c", 'hostname "$0" && exec "$@"', hostnames[node], *argv]
            if private_dirs and node in private_dirs:
                mount = 'mkdir -p "$0" && mount -t tmpfs tmpfs "$0" && exec "$@"'
                argv = ["sh", "-c", mount, private_dirs[node], *argv]
            # Output to files, not pipes: a full pipe would block that node's ranks mid-job.
            logs.append(tempfile.TemporaryFile(mode="w+"))  # noqa: SIM115 (closed below)
            procs.append(
                subprocess.Popen(
                    self.command(node, env, argv, image),
                    cwd=REPO,
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**os.environ, "NETNS_PREFIX": self.prefix},
                )
            )
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        results = []
        for proc, log in zip(procs, logs, strict=True):
            log.seek(0)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, log.read()))
            log.close()
        for node, result in zip(nodes, results, strict=True):
            if result.returncode != 0:
                print(f"--- node {node} exited {result.returncode}:\n{result.stdout[-6000:]}")
        return results


@contextmanager
def netns_cluster(num_hosts: int) -> Iterator[Cluster]:
    """`num_hosts` hosts, removed again however the test ends."""
    prefix = "t" + uuid.uuid4().hex[:6]
    env = {**os.environ, "NETNS_PREFIX": prefix}
    try:
        subprocess.run(
            ["bash", str(SCRIPT), "up", str(num_hosts)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        yield Cluster(prefix, num_hosts)
    finally:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True, timeout=60)
