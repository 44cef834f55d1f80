"""The crash-loop breaker counts crashes, nothing else, and every final exit reaches the scheduler.

Real launchers (scripts/train_single_node.sh, scripts/launch_multinode.sh: supervise.py above
torchrun), real signals (tests/faults.py's `preempt` sends SIGTERM to the launcher, as a
scheduler's stop arrives; the supervisor forwards it to torchrun and each worker, and SIGKILLs
what is left after SUPERVISE_GRACE_S, as Slurm's KillWait would), real divergence (a learning
rate no model survives) and real restarts. The breaker's limit is 2 here: a third attempt from
the same checkpoint exits 76.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, final_state, free_port, rows, tiny_job_args

import exitcodes

pytestmark = pytest.mark.e2e

GRACE_S = 8  # the launchers' preemption budget in these tests (SUPERVISE_GRACE_S)
LIMIT = 2  # run.max_attempts_without_progress
JOB = tiny_job_args(
    data_synthetic_train_size=128,
    data_batch_size=16,  # 4 steps per epoch at 2 ranks, 8 at 1
    train_epochs=2,
    log_every_steps=1,
    dist_preflight=False,
    dist_timeout_s=60,
    run_max_attempts_without_progress=LIMIT,
)
# An evaluation far longer than the grace: 16 batches per rank of one second each.
SLOW_EVAL = ("--data.synthetic_eval_size=256", "--data.eval_batch_size=8")
SLOW_EVAL_FAULT = "sleep@eval=batch,seconds=1"


def run_launcher(
    script: str, run_dir: Path, *args: str, faults: str = "", timeout: float = 300, **env: str
) -> subprocess.CompletedProcess:
    """One launch of `script` (train_single_node.sh or launch_multinode.sh) to its end."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "SUPERVISE_GRACE_S": str(GRACE_S)}
    environment.update(TRAIN_SCRIPT="tests/faults.py", TRAIN_FAULTS=faults, **env)
    if script == "launch_multinode.sh":
        environment.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        environment.update(NNODES="1", NODE_RANK="0")
    proc = subprocess.run(
        ["bash", f"scripts/{script}", f"--run.dir={run_dir}", *JOB, *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    proc.output = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    return proc


# ---------------------------------------------------------------------------------------------
# B1: a preemption is never counted as a crash, whenever it lands


def test_preemptions_during_a_long_evaluation_checkpoint_at_once_and_never_end_the_job(
    tmp_path,
) -> None:
    """Three preemptions in a row, each landing as the first evaluation starts (rank 0 signals
    the launcher), with an evaluation of 16 s per rank and a grace of 8 s.

    Before: the evaluation ran on past the grace, the supervisor SIGKILLed the workers (no
    checkpoint: every attempt started from step 0 again, each counted) and the third launch
    exited 76 ("2 attempts in a row started from step 0"). Now each evaluation stops after the
    batch at hand, the checkpoint of step 4 owes it, every launch exits 75, and the last run
    evaluates each epoch exactly once."""
    run_dir = tmp_path / "run"
    for launch in range(LIMIT + 1):
        proc = run_launcher(
            "train_single_node.sh",
            run_dir,
            *SLOW_EVAL,
            faults=f"preempt@eval=begin,rank=0;{SLOW_EVAL_FAULT}",
            NPROC_PER_NODE="2",
        )
        assert proc.returncode == exitcodes.EXIT_PREEMPTED, (launch, proc.output[-4000:])
        assert final_state(run_dir)["step"] == 4, launch
    finished = run_launcher("train_single_node.sh", run_dir, *SLOW_EVAL, NPROC_PER_NODE="2")
    assert finished.returncode == 0, finished.output[-4000:]
    assert [row["epoch"] for row in rows(run_dir, "eval")] == [0, 1]  # no partial evaluation
    assert all(row["num_samples"] == 256 for row in rows(run_dir, "eval"))


def test_a_crash_of_another_rank_while_rank_0_computes_still_counts(tmp_path) -> None:
    """torchrun SIGTERMs the survivors of a failed worker (its monitor polls every 0.1 s). Rank 1
    dies at step 1 of every attempt while rank 0 is outside any collective (a 3 s computation),
    so rank 0 hears torchrun's SIGTERM before any error. Before the review's fix the watcher
    uncounted every such attempt as a preemption and the crash loop never tripped (the
    launcher ran through MAX_RESTARTS and exited 1); the launcher's own STOP_MARKER now tells a
    stop asked for from torchrun's. Expected: exit 76 after run.max_attempts_without_progress."""
    faults = ";".join(
        f"sleep@step=1,rank=0,seconds=3,restart={k};sigkill@step=1,rank=1,restart={k}"
        for k in range(6)
    )
    proc = run_launcher(
        "launch_multinode.sh", tmp_path / "run", faults=faults, NPROC_PER_NODE="2", MAX_RESTARTS="5"
    )
    assert proc.returncode == exitcodes.EXIT_NO_PROGRESS, proc.output[-4000:]
    assert "attempts in a row started from step 0" in proc.output


def test_preemptions_during_a_save_longer_than_the_grace_are_not_counted(tmp_path) -> None:
    """Three preemptions in a row, each landing as the step-2 checkpoint starts, a save that
    takes 60 s: the supervisor SIGKILLs the worker mid-save each time (nothing is saved).

    Before: the attempt was uncounted only at the next step boundary, never reached, so the
    third launch exited 76 ("2 attempts in a row started from step 0"). Now the preemption
    watcher uncounts it the moment the signal arrives, and the fourth launch trains to the
    end."""
    run_dir = tmp_path / "run"
    for launch in range(LIMIT + 1):
        proc = run_launcher(
            "train_single_node.sh",
            run_dir,
            "--ckpt.every_steps=2",
            faults="preempt@save=begin;sleep@save=begin,seconds=60",
            NPROC_PER_NODE="1",
        )
        assert proc.returncode not in (0, exitcodes.EXIT_NO_PROGRESS), proc.output[-4000:]
        assert "SIGKILL" in proc.output, (launch, proc.output[-4000:])
    finished = run_launcher(
        "train_single_node.sh", run_dir, "--ckpt.every_steps=2", NPROC_PER_NODE="1"
    )
    assert finished.returncode == 0, finished.output[-4000:]
    assert "attempts in a row" not in finished.output
    assert final_state(run_dir)["step"] == 16, finished.output[-3000:]
    record = (run_dir / "progress.json").read_text()
    assert '"attempts": 0' in record, record


# ---------------------------------------------------------------------------------------------
# B3: exit 3 (diverged, final) reaches the scheduler


def test_a_run_that_diverges_under_the_launcher_exits_3_without_restarts(tmp_path) -> None:
    """Two ranks under launch_multinode.sh (MAX_RESTARTS=3) with optim.lr=1e30: the loss is
    not finite from step 2 on, and after train.max_nonfinite_steps=2 such steps every rank
    exits 3.

    Before: torchrun saw exit 1, restarted the group, which diverged again from step 0, and
    the third attempt was stopped by the crash-loop breaker: the launcher exited 76 ("no
    progress", which train.sbatch reports as a crash loop), never 3, so the Kubernetes
    podFailurePolicy's FailJob on 3 and train.sbatch's diverged branch could not fire. Now
    the workers report it (TRAIN_DIVERGED_MARKER), supervise.py stops torchrun's restarts and
    exits 3."""
    proc = run_launcher(
        "launch_multinode.sh",
        tmp_path / "run",
        "--optim.lr=1e30",
        "--optim.warmup_steps=0",
        "--train.max_nonfinite_steps=2",
        MAX_RESTARTS="3",
        NPROC_PER_NODE="2",
    )
    assert proc.returncode == exitcodes.EXIT_DIVERGED, proc.output[-4000:]
    assert proc.output.count("[rank 0] ERROR train: 2 consecutive optimizer steps") == 1
    assert "exit 3, do not restart" in proc.output


# ---------------------------------------------------------------------------------------------
# B2: a transient storage error never ends a job for good


def test_seconds_of_storage_outage_are_retried_with_back_off_and_never_end_the_job(
    tmp_path,
) -> None:
    """ESTALE on every checkpoint write for 45 s from the first, in every attempt (torchrun's
    restarts too), under launch_multinode.sh with MAX_RESTARTS=4 and TRAIN_IO_BACKOFF_S=8.

    Before: torchrun restarted at once, each restart hit the outage again and was counted,
    and the third attempt exited 76 ("2 attempts in a row started from step 0": do not
    restart). Now an attempt that ends in exit 74 is not counted, each restart waits (8 s,
    16 s, 32 s, ...) before touching the storage, and the run trains to its end."""
    run_dir = tmp_path / "run"
    proc = run_launcher(
        "launch_multinode.sh",
        run_dir,
        "--ckpt.every_steps=2",
        faults="oserror@save=written,errno=ESTALE,for=45",
        MAX_RESTARTS="4",
        NPROC_PER_NODE="1",
        TRAIN_IO_BACKOFF_S="8",
        TRAIN_FAULTS_STATE=str(tmp_path / "outage"),
        timeout=400,
    )
    assert proc.returncode == 0, proc.output[-4000:]
    assert "ESTALE" in proc.output and "waiting 8 s" in proc.output
    assert "attempts in a row" not in proc.output
    assert final_state(run_dir)["step"] == 16


def test_a_storage_outage_that_outlasts_the_restarts_exits_74_through_the_launcher(
    tmp_path,
) -> None:
    """ESTALE on every checkpoint write, under train_single_node.sh (torchrun without
    restarts). Before: torchrun's exit 1 reached the scheduler, so train.sbatch's "requeue
    74" branch could never fire. Now the workers report it (TRAIN_IO_MARKER) and the launcher
    exits 74, which schedulers retry after a while."""
    proc = run_launcher(
        "train_single_node.sh",
        tmp_path / "run",
        "--ckpt.every_steps=2",
        faults="oserror@save=written,errno=ESTALE,for=600",
        NPROC_PER_NODE="1",
        TRAIN_FAULTS_STATE=str(tmp_path / "outage"),
    )
    assert proc.returncode == exitcodes.EXIT_IO, proc.output[-4000:]
    assert "ESTALE" in proc.output and "bad input" not in proc.output
