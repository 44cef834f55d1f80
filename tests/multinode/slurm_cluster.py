"""A real Slurm cluster for tests (scripts/slurm/test_cluster.sh) and jobs of train.sbatch on it."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "test_cluster.sh"
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"

# A job is over in these states; PENDING after a requeue is not over.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@dataclass(frozen=True)
class SlurmCluster:
    name: str
    num_nodes: int

    def _env(self) -> dict[str, str]:
        return {**os.environ, "TEST_CLUSTER": self.name}

    def script(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), *argv],
            env=self._env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ctl(self, *argv: str, check: bool = True) -> str:
        """A Slurm command on the controller host (the cluster's only "login node")."""
        result = self.script("ctl", *argv)
        if check and result.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} failed: {result.stderr}")
        return result.stdout

    @property
    def state_dir(self) -> Path:
        return Path(self.script("dir").stdout.strip())

    def submit(self, log: Path, env: dict[str, str], args: list[str], *options: str) -> int:
        """sbatch train.sbatch from the repository root, as a user on the login node would."""
        pairs = [f"{key}={value}" for key, value in env.items()]
        out = self.ctl(
            "env", *pairs, "sbatch", "--parsable", f"--output={log}", *options, str(SBATCH), *args
        )
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (one line: -o)."""
        fields = {}
        for item in self.ctl("scontrol", "show", "job", "-o", str(job_id)).split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_for(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["JobState"] in states:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {states} after {timeout} s: {job}")
            time.sleep(0.5)

    def wait_for_node(self, node: str, state: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (found := self.ctl("sinfo", "-h", "-n", node, "-o", "%T").strip()) != state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{node} is {found}, not {state}, after {timeout} s")
            time.sleep(0.5)

    def wait_until_over(self, job_id: int, timeout: float) -> dict[str, str]:
        """Wait until the job is over for good, ending Slurm's requeue hold at once.

        Slurm 22.05 makes a requeued job wait about two minutes (Reason=BeginTime); the tests
        have no reason to wait that long, so a requeued job is made eligible early, but not in
        the second its last run was killed: slurmd refuses a job credential created in the
        same second as the revocation of the previous one (whole seconds are compared), and the
        job then fails at launch ("Job credential revoked", exit 1). Seen under CI load.
        """
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["JobState"] in FINAL_STATES:
                return job
            if job["JobState"] == "PENDING" and job["Reason"] == "BeginTime":
                time.sleep(2.0)  # a later second than the revocation
                self.ctl("scontrol", "update", f"JobId={job_id}", "StartTime=now")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not over after {timeout} s: {job}")
            time.sleep(0.5)


def leftovers(name: str) -> list[str]:
    """What a cluster called `name` left behind: namespaces, links, processes, mounts, files."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    found += [line for line in netns.splitlines() if line.startswith(f"{name}-")]
    found += [line for line in links.splitlines() if line.startswith(name)]
    state_dir = f"{os.environ.get('TMPDIR', '/tmp')}/slurm-test-{name}"
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                mounts = Path(f"/proc/{pid}/mountinfo").read_text()
            except OSError:
                continue
            if state_dir in cmdline or state_dir in mounts:
                found.append(f"process {pid}: {cmdline}")
    if Path(state_dir).exists():
        found.append(state_dir)
    return found


@contextmanager
def slurm_cluster(num_nodes: int) -> Iterator[SlurmCluster]:
    """A controller and `num_nodes` compute nodes, removed again however the caller ends."""
    cluster = SlurmCluster("s" + uuid.uuid4().hex[:6], num_nodes)
    try:
        result = cluster.script("up", str(num_nodes))
        assert result.returncode == 0, result.stdout + result.stderr
        yield cluster
    finally:
        cluster.script("down")
