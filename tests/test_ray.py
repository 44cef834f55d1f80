"""ray_train.py on a local Ray cluster of 2 CPU workers, against torchrun runs of the same job."""

from __future__ import annotations

import os
import re
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job under torchrun, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    result = launch(2, f"--run.dir={run_dir}", *JOB)
    assert result.returncode == 0, result.output[-3000:]
    return run_dir


def assert_same_as(run_dir: Path, reference: Path) -> None:
    assert_same_training_state(final_state(run_dir), final_state(reference))
    keys = ("step", "loss", "accuracy", "num_samples")
    evals = [[{k: r[k] for k in keys} for r in rows(d, "eval")] for d in (run_dir, reference)]
    assert evals[0] == evals[1] and len(evals[0]) == 4


def start(run_dir: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            ray_command(f"--run.dir={run_dir}", *JOB),
            cwd=REPO,
            env=ray_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def launch_processes() -> list[int]:
    """Every process of any ray_train.py launch on this machine (shims and train.py)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if b"DDP_RAY_RUN=" in environ:
                found.append(int(entry.name))
    return found


def preempted_and_resumed_steps(output: str) -> tuple[list[int], list[int]]:
    preempted = [int(s) for s in re.findall(r"preempted by .* at step (\d+)", output)]
    resumed = [int(s) for s in re.findall(r"resuming from \S+ at step (\d+)", output)]
    return preempted, resumed


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
        ours = ours and b"_shim" not in cmdline  # train.py itself, not its shim
        if ours and f"RANK={rank}".encode() in environ:
            found.append(int(entry.name))
    return found


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_killed_ray_worker_is_restarted_and_the_run_ends_equal_to_an_uninterrupted_one(
    tmp_path: Path, reference: Path
) -> None:
    """SIGKILL to rank 1's Ray worker process mid-run: Ray restarts the worker group, the ranks
    checkpoint at one step (SIGTERM from their shims' deaths), the new group resumes from that
    very step, and the final state is torch.equal to a torchrun run that nobody interrupted."""
    run_dir, log = tmp_path / "ray", tmp_path / "ray.log"
    proc = start(run_dir, log)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            assert proc.poll() is None, log.read_text()[-4000:]
            ranks = train_processes(1)
            if list((run_dir / "checkpoints").glob("step_*.pt")) and ranks:
                # train.py's parent is the shim, whose parent is the Ray worker (an actor).
                os.kill(parent_of(parent_of(ranks[0])), signal.SIGKILL)
                break
            time.sleep(0.1)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    assert code == 0, output[-5000:]
    assert "finished with exit 0" in output
    preempted, resumed = preempted_and_resumed_steps(output)
    assert len(set(preempted)) == 1 and resumed == preempted[:1], output[-5000:]
    assert_same_as(run_dir, reference)
    assert not launch_processes()


def test_sigterm_to_the_launcher_checkpoints_exits_75_and_the_same_command_resumes(
    tmp_path: Path, reference: Path
) -> None:
    """SIGTERM to ray_train.py alone (the driver): Ray stops the workers, the ranks checkpoint,
    the launcher waits for them and exits 75 with nothing left running; the same command then
    resumes from that checkpoint and ends torch.equal to the uninterrupted run."""
    run_dir, log = tmp_path / "ray", tmp_path / "ray.log"
    proc = start(run_dir, log)
    try:
        deadline = time.monotonic() + 180
        while not list((run_dir / "checkpoints").glob("step_*.pt")):
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            assert proc.poll() is None, log.read_text()[-4000:]
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    assert code == 75, output[-5000:]
    assert not launch_processes()
    # The ranks' last lines stay in Ray's worker logs (forwarding stops with Ray): what they
    # left is the checkpoint of the step they stopped at, newer than the periodic ones.
    saved = [int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*.pt")]
    assert any(step % 8 for step in saved) or max(saved) > 8, saved

    proc = start(run_dir, tmp_path / "again.log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "again.log").read_text()[-4000:]
    _, resumed = preempted_and_resumed_steps((tmp_path / "again.log").read_text())
    assert resumed == [max(saved)]
    assert_same_as(run_dir, reference)


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
    # One attempt: each rank started once, and Ray's failure policy never ran.
    assert len(set(re.findall(r"ray_train.py: attempt \S+ rank \d/2: train.py", output))) == 2
    assert "[FailurePolicy]" not in output
