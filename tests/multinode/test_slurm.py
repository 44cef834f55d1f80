"""train.sbatch on a real Slurm 22.05 cluster: a controller and two nodes, each a network
namespace with its own address and host name (scripts/slurm/test_cluster.sh).

What only a real cluster shows: that Slurm's signals (scancel --signal, --signal=B:...@N at a
time limit, scancel, scontrol requeue) reach every process of the job as Slurm delivers them,
that a requeued job finds its run directory and resumes, and what a node failure does. Every
interrupted job must end equal (`torch.equal`) to a job that was never interrupted, with every
sample of every epoch seen once (the epoch digests of metrics.jsonl, recomputed here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_same_training_state, final_state, tiny_job_args
from slurm_cluster import FINAL_STATES, SlurmCluster, leftovers, slurm_cluster

CAN_RUN_SLURM = os.geteuid() == 0 and all(
    shutil.which(tool) for tool in ("ip", "nsenter", "unshare", "slurmctld", "munged")
)
pytestmark = [
    pytest.mark.multinode,
    pytest.mark.slow,
    pytest.mark.slurm,
    # Under CI these must run (scripts/setup.sh installs Slurm): missing tools fail, not skip.
    pytest.mark.skipif(
        not CAN_RUN_SLURM and not os.environ.get("CI"),
        reason="needs root, iproute2, util-linux and Debian's slurmctld, slurmd and munge",
    ),
]

N_TRAIN, BATCH, SEED, EPOCHS, WORLD = 4096, 16, 0, 2, 2
P = 2_147_483_647
STEPS = N_TRAIN // BATCH // WORLD * EPOCHS  # 256
COMMON = tiny_job_args(
    data_synthetic_train_size=N_TRAIN,
    data_batch_size=BATCH,
    data_num_workers=None,  # each job below sets its own
    train_epochs=EPOCHS,
    model_widths="8,16",
    log_every_steps=4,
    ckpt_every_steps=40,
    dist_timeout_s=30,
)
# Loader worker processes, so that Slurm's signals reach those too.
JOB = [*COMMON, "--data.loader=dataloader", "--data.num_workers=1", "--dist.preflight=false"]
# Long enough (over a minute of training on 2 cores) to still run when a time-limit signal
# comes: Slurm checks time limits every 30 s.
LONG_EPOCHS = 36
LONG_JOB = [*COMMON, "--data.num_workers=0", f"--train.epochs={LONG_EPOCHS}"]
ENV = {
    "NPROC_PER_NODE": "1",
    "OMP_NUM_THREADS": "1",
    "RDZV_JOIN_TIMEOUT": "60",
    "RDZV_CHECK": "0",  # a real cluster's nodes all start; spares each job a Python start-up
    "MAX_RESTARTS": "0",
}


# --- references -------------------------------------------------------------------------------


def expected_digest(epoch: int, consumed: int) -> str:
    """Digest of the first `consumed` samples of the epoch's order (DistributedSampler's
    permutation: torch.randperm seeded by seed + epoch), computed with Python integers."""
    order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(SEED + epoch))
    h1s = [(i * 1103515245 + 12345) % P for i in order[:consumed].tolist()]
    h2s = [(h * 48271 + 11) % P for h in h1s]
    return f"{consumed}:{sum(h1s):x}:{sum(h2s):x}"


def epoch_digests(run_dir: Path) -> dict[int, str]:
    """The digest logged at the end of each epoch (the last eval row of the epoch)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["epoch"]: r["epoch_sample_digest"] for r in rows if r["kind"] == "eval"}


def assert_ends_like(run_dir: Path, reference: Path, epochs: int) -> None:
    assert_same_training_state(final_state(run_dir), final_state(reference))
    every_sample_once = {e: expected_digest(e, N_TRAIN) for e in range(epochs)}
    assert epoch_digests(run_dir) == every_sample_once


# --- jobs ---------------------------------------------------------------------------------------


def submit(cluster: SlurmCluster, tmp: Path, args: list[str], *options: str, **env: str) -> int:
    return cluster.submit(
        tmp / "job.out", {**ENV, "RUN_DIR": str(tmp / "run"), **env}, args, *options
    )


def wait_for_training(run_dir: Path, min_step: int, timeout: float = 180) -> None:
    """Until rank 0 has logged step `min_step` (training runs on both nodes by then)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists():
            steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()]
            if steps and max(steps) >= min_step:
                return
        time.sleep(0.2)
    raise TimeoutError(f"no step {min_step} in {metrics} after {timeout} s")


def run_to_end(cluster: SlurmCluster, job_id: int, tmp: Path, timeout: float = 300) -> dict:
    job = cluster.wait_until_over(job_id, timeout)
    log = (tmp / "job.out").read_text()
    print(f"--- job {job_id}: {job['JobState']} {job['ExitCode']}\n{log[-5000:]}")
    return job


@pytest.fixture(scope="module")
def cluster() -> SlurmCluster:
    with slurm_cluster(2) as made:
        yield made


@pytest.fixture(scope="module")
def reference(cluster: SlurmCluster, tmp_path_factory) -> Path:
    """JOB, never interrupted."""
    tmp = tmp_path_factory.mktemp("reference")
    job = run_to_end(cluster, submit(cluster, tmp, JOB), tmp)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0")
    assert epoch_digests(tmp / "run") == {e: expected_digest(e, N_TRAIN) for e in range(EPOCHS)}
    return tmp / "run"


@pytest.fixture(scope="module")
def long_reference(cluster: SlurmCluster, tmp_path_factory) -> tuple[Path, str]:
    """LONG_JOB, never interrupted: (run dir, job log)."""
    tmp = tmp_path_factory.mktemp("long")
    job = run_to_end(cluster, submit(cluster, tmp, LONG_JOB), tmp)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0")
    return tmp / "run", (tmp / "job.out").read_text()


# --- tests --------------------------------------------------------------------------------------


def test_a_job_runs_to_completion_with_ranks_on_both_nodes(cluster, tmp_path) -> None:
    """The job with the preflight check, whose table names each rank's host."""
    job = run_to_end(
        cluster, submit(cluster, tmp_path, [*COMMON, "--data.num_workers=0"]), tmp_path
    )
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0")
    log = (tmp_path / "job.out").read_text()
    assert "rendezvous node1:" in log  # the first node of `scontrol show hostnames`
    ranks = dict(re.findall(r"rank (\d+) = (\S+) local rank \d+", log))
    assert ranks == {"0": "node1", "1": "node2"}, log[-3000:]
    assert "train.sbatch: " in log and "finished" in log
    digests = epoch_digests(tmp_path / "run")
    assert digests == {e: expected_digest(e, N_TRAIN) for e in range(EPOCHS)}


@pytest.mark.parametrize(
    "how",
    [
        # The batch shell only: train.sbatch traps it, forwards it through srun, requeues.
        ["scancel", "--signal=USR2", "--batch"],
        # Every process of the job step (not the batch shell): launcher, torchrun, workers and
        # their loader workers each get SIGUSR2; the step ends with 75 and the job requeues.
        # Extended tier: test_signals.py delivers to every process under each launcher in CI.
        pytest.param(["scancel", "--signal=USR2"], marks=pytest.mark.extended),
        # Slurm ends the job (SIGTERM to every process, SIGKILL after KillWait) and queues it.
        # Extended tier: CI's time-limit and node-failure tests requeue through Slurm too.
        pytest.param(["scontrol", "requeue"], marks=pytest.mark.extended),
    ],
    ids=["scancel-usr2-batch", "scancel-usr2-steps", "scontrol-requeue"],
)
def test_signal_checkpoints_requeues_and_ends_exact(cluster, reference, tmp_path, how) -> None:
    job_id = submit(cluster, tmp_path, JOB)
    wait_for_training(tmp_path / "run", min_step=8)
    cluster.ctl(*how, str(job_id))
    job = run_to_end(cluster, job_id, tmp_path)
    log = (tmp_path / "job.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert int(job["Restarts"]) == 1
    if how[0] == "scancel":  # the workers checkpointed where the signal stopped them
        assert "preempted by SIG" in log and "the workers checkpointed" in log
        assert "requeueing job" in log
    assert "resuming from" in log
    assert_ends_like(tmp_path / "run", reference, EPOCHS)


def test_an_fsdp_job_preempted_by_slurm_resumes_exactly(cluster, tmp_path) -> None:
    """dist.strategy=fsdp across the two nodes, one epoch: Slurm's USR2 to the batch shell,
    forwarded to every process; each rank writes its shard of the preemption checkpoint, the
    job requeues, resumes from the sharded checkpoint and ends torch.equal to the same fsdp
    job never interrupted, every sample seen once."""
    job = [*[a for a in JOB if not a.startswith("--train.epochs")], "--train.epochs=1"]
    job += ["--dist.strategy=fsdp"]
    reference = tmp_path / "reference"
    reference.mkdir()
    ended = run_to_end(cluster, submit(cluster, reference, job), reference)
    assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0")
    job_id = submit(cluster, tmp_path, job)
    wait_for_training(tmp_path / "run", min_step=8)
    cluster.ctl("scancel", "--signal=USR2", "--batch", str(job_id))
    ended = run_to_end(cluster, job_id, tmp_path)
    log = (tmp_path / "job.out").read_text()
    assert (ended["JobState"], ended["ExitCode"], ended["Restarts"]) == ("COMPLETED", "0:0", "1")
    assert "preempted by SIG" in log and "resuming from" in log, log[-4000:]
    assert "saved sharded checkpoint" in log and "dist.strategy=fsdp: mesh (2,)" in log
    assert_ends_like(tmp_path / "run", reference / "run", 1)


@pytest.mark.extended  # CI: scancel --signal=USR2 --batch requeues and resumes the same way
def test_scancel_then_resubmit_ends_exact(cluster, reference, tmp_path) -> None:
    """A plain scancel ends the job for good (CANCELLED: SIGTERM to every process, the workers
    checkpoint); the user submits again with the same RUN_DIR, which resumes."""
    first = submit(cluster, tmp_path, JOB)
    wait_for_training(tmp_path / "run", min_step=8)
    cluster.ctl("scancel", str(first))
    job = run_to_end(cluster, first, tmp_path)
    assert job["JobState"] == "CANCELLED" and job["Restarts"] == "0"
    log = (tmp_path / "job.out").read_text()
    assert "preempted by SIGTERM" in log, log[-4000:]
    stopped = final_state(tmp_path / "run")["step"]
    assert 8 <= stopped < STEPS
    second = submit(cluster, tmp_path, JOB)
    job = run_to_end(cluster, second, tmp_path)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0")
    assert f"resuming from {tmp_path / 'run'}" in (tmp_path / "job.out").read_text()
    assert_ends_like(tmp_path / "run", reference, EPOCHS)


@pytest.mark.extended  # CI: the same trap in train.sbatch, by scancel --signal=USR2 --batch
def test_time_limit_signal_checkpoints_requeues_and_ends_exact(
    cluster, long_reference, tmp_path
) -> None:
    """--signal=B:USR2@110 and a real time limit. Slurm checks limits every 30 s, so the limit
    is set to 2 minutes once training runs (at submission the signal could come before the
    workers started): the signal then comes at the next check, within about 30 s, while the
    job (over a minute of training) still runs, and well before the limit itself."""
    job_id = submit(cluster, tmp_path, LONG_JOB, "--time=30", "--signal=B:USR2@110")
    wait_for_training(tmp_path / "run", min_step=4)
    cluster.ctl("scontrol", "update", f"JobId={job_id}", "TimeLimit=2")
    cluster.wait_for(job_id, {"PENDING", *FINAL_STATES}, timeout=120)
    # The next run gets the time limit it was submitted with, so it finishes.
    cluster.ctl("scontrol", "update", f"JobId={job_id}", "TimeLimit=30")
    job = run_to_end(cluster, job_id, tmp_path, timeout=400)
    log = (tmp_path / "job.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert int(job["Restarts"]) >= 1
    assert "SIGUSR2: asking the workers to checkpoint" in log
    assert "preempted by SIG" in log and "requeueing job" in log
    assert "TIME LIMIT" not in log  # requeued before the limit, not killed at it
    assert_ends_like(tmp_path / "run", long_reference[0], LONG_EPOCHS)


def test_a_time_limit_within_the_signal_lead_is_refused_not_requeued_forever(
    cluster, tmp_path
) -> None:
    """Issue 31 B5: with `--time=1` and the script's `--signal=B:USR2@120` the signal came at
    once, so each run trained a step, checkpointed, exited 75 and was requeued: forever, a step
    every 2.5 minutes, never counted. Now the batch shell reads the job's time limit
    (scontrol), refuses it before any job step with exit 2 naming --time and the signal's
    lead, and the job is not requeued."""
    job_id = submit(cluster, tmp_path, LONG_JOB, "--time=1")
    job = run_to_end(cluster, job_id, tmp_path, timeout=180)
    log = (tmp_path / "job.out").read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "2:0", "0"), log
    assert "--time is 60 s" in log and "USR2@120" in log
    assert not (tmp_path / "run").exists()  # no job step started


def test_node_failure_requeues_and_ends_exact(cluster, reference, tmp_path) -> None:
    """node2 dies (its slurmd, slurmstepd and job processes: SIGKILL) after a checkpoint.
    Slurm marks it DOWN within SlurmdTimeout, requeues the job (--requeue) and, once node2 is
    back (ReturnToService=2), runs it again from the newest periodic checkpoint."""
    job_id = submit(cluster, tmp_path, JOB)
    run_dir = tmp_path / "run"
    wait_for_training(run_dir, min_step=44)  # past the step 40 checkpoint
    crash = cluster.script("crash", "2")
    assert crash.returncode == 0, crash.stderr
    started = time.monotonic()
    node = ""
    while time.monotonic() - started < 60:  # SlurmdTimeout=10: DOWN well within a minute
        node = cluster.ctl("sinfo", "-h", "-n", "node2", "-o", "%T").strip()
        if node.startswith("down"):
            break
        time.sleep(1)
    assert node.startswith("down"), node
    job = cluster.wait_for(job_id, {"PENDING", *FINAL_STATES}, timeout=90)
    assert job["JobState"] == "PENDING" and job["Restarts"] == "1", job
    # The node stays down a little, as a rebooting machine would: a node back within a second
    # of being marked DOWN, with the job relaunched on it at once, was seen to leave the new
    # run's srun waiting forever ("step creation temporarily disabled").
    time.sleep(10)
    revive = cluster.script("revive", "2")
    assert revive.returncode == 0, revive.stderr
    cluster.wait_for_node("node2", "idle", timeout=30)
    job = run_to_end(cluster, job_id, tmp_path)
    log = (tmp_path / "job.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert "resuming from" in log
    assert_ends_like(run_dir, reference, EPOCHS)


def test_cluster_is_removed_without_a_trace() -> None:
    """A cluster of its own: up, one job step, down; then no namespace, link, process (daemon,
    job or mount namespace) or file of it is left."""
    with slurm_cluster(2) as made:
        hosts = made.ctl("srun", "--nodes=2", "--ntasks-per-node=1", "hostname")
        state_dir = made.state_dir
        assert state_dir.is_dir()
    assert sorted(hosts.split()) == ["node1", "node2"]
    assert leftovers(made.name) == []
