"""ray_train.py on a local Ray cluster of 2 CPU workers, against torchrun runs of the same job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, assert_same_training_state, final_state, launch, rows

if not os.environ.get("CI"):  # under CI the ray group is part of the set-up (scripts/test.sh)
    pytest.importorskip("ray", reason="the ray dependency group: uv sync --group ray")

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

JOB = [
    "--data.dataset=synthetic",
    "--data.synthetic_train_size=1024",
    "--data.synthetic_eval_size=300",
    "--data.batch_size=32",
    "--model.widths=8,16",
    "--data.num_workers=0",
    "--train.epochs=4",
    "--ckpt.every_steps=8",
    "--log.every_steps=4",
    "--log.tensorboard=false",
    "--dist.timeout_s=60",
]


def ray_command(*args: str, max_failures: int = 2) -> list[str]:
    return [
        sys.executable,
        "ray_train.py",
        "--address=local",
        "--workers=2",
        f"--max-failures={max_failures}",
        "--",
        *args,
    ]


def ray_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def train_processes(rank: int) -> list[int]:
    """This machine's train.py processes of `rank` started by ray_train.py."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ours = b"DDP_RAY_RUN=" in b"\0".join(environ) and b"train.py" in cmdline
        if ours and f"RANK={rank}".encode() in environ:
            found.append(int(entry.name))
    return found


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_killed_ray_worker_is_restarted_and_the_run_ends_equal_to_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    """SIGKILL to rank 1's Ray worker process mid-run: Ray restarts the worker group, train.py
    resumes from the run dir's newest checkpoint, and the final state is torch.equal to a
    torchrun run of the same job that nobody interrupted."""
    run_dir = tmp_path / "ray"
    log = (tmp_path / "ray.log").open("w")
    proc = subprocess.Popen(
        ray_command(f"--run.dir={run_dir}", *JOB),
        cwd=REPO,
        env=ray_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    killed = None
    try:
        deadline = time.monotonic() + 180
        while killed is None:
            assert time.monotonic() < deadline, (tmp_path / "ray.log").read_text()[-4000:]
            assert proc.poll() is None, (tmp_path / "ray.log").read_text()[-4000:]
            checkpoints = list((run_dir / "checkpoints").glob("step_*.pt"))
            ranks = train_processes(1)
            if checkpoints and ranks:
                killed = parent_of(ranks[0])  # the Ray worker (actor) running rank 1
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.1)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    output = (tmp_path / "ray.log").read_text()
    assert code == 0, output[-5000:]
    assert "finished with exit 0" in output
    # The killed worker's train.py checkpointed (SIGTERM at its parent's death), and Ray's
    # second worker group resumed from a checkpoint instead of starting again.
    assert "checkpoint written, exiting with code 75" in output
    assert "resuming from" in output
    reference = tmp_path / "torchrun"
    result = launch(2, f"--run.dir={reference}", *JOB)
    assert result.returncode == 0, result.output[-3000:]
    assert_same_training_state(final_state(run_dir), final_state(reference))
    keys = ("step", "loss", "accuracy", "num_samples")
    evals = [[{k: r[k] for k in keys} for r in rows(d, "eval")] for d in (run_dir, reference)]
    assert evals[0] == evals[1] and len(evals[0]) == 4
    assert not train_processes(0) and not train_processes(1)


def test_a_bad_command_line_exits_2_before_ray_starts(tmp_path: Path) -> None:
    result = subprocess.run(
        ray_command(f"--run.dir={tmp_path / 'run'}", *JOB, "--train.epochs=many"),
        cwd=REPO,
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert "train.epochs" in result.stderr and "many" in result.stderr
    assert not (tmp_path / "run").exists()


def test_bad_input_found_by_the_workers_exits_2_without_retrying(tmp_path: Path) -> None:
    """A checkpoint to resume from that does not exist: train.py's ranks exit 2 naming it, and
    the job ends with 2 on the first attempt, however many retries are allowed."""
    missing = tmp_path / "missing.pt"
    result = subprocess.run(
        ray_command(
            f"--run.dir={tmp_path / 'run'}", *JOB, f"--ckpt.resume={missing}", max_failures=3
        ),
        cwd=REPO,
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert str(missing) in output and "finished with exit 2" in output
    assert "attempt" not in output.lower() or "retry" not in output.lower()
