"""Stop signals delivered the way clusters deliver them: to every process of the job tree
(launcher, torchrun, each worker, each loader worker), repeated and mixed, or to a subset.

slurmstepd and the kubelet signal each process, not a process group, and torchrun starts its
workers in sessions of their own, so these tests walk /proc for the launcher's descendants and
signal each one. Every pattern must end in exactly one checkpoint (the preemption's) and
exit 75, and a resumed run must end `torch.equal` to a run that was never stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    REPO,
    assert_same_training_state,
    final_state,
    free_port,
    launch,
    train_command,
    wait_for_train_rows,
)

pytestmark = pytest.mark.e2e

STEPS = 400  # about 8 s of training at 2 ranks: long enough to be hit mid-run
JOB = [
    "--data.dataset=synthetic",
    "--data.synthetic_train_size=20000",  # one epoch is longer than the run: no epoch-end save
    "--data.synthetic_eval_size=64",
    "--data.batch_size=16",
    "--model.widths=4,8,8",
    "--log.tensorboard=false",
    "--data.loader=dataloader",
    "--data.num_workers=1",  # loader workers, which must survive the signals
    "--log.every_steps=1",
    "--dist.preflight=false",
    "--dist.timeout_s=30",
    f"--train.max_steps={STEPS}",
    "--train.epochs=1",
]


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            table[int(entry.name)] = (int(fields[1]), cmdline)
    return table


def job_tree(root: int) -> dict[str, list[int]]:
    """The processes under `root`, by role."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    everyone, todo = [], [root]
    while todo:
        pid = todo.pop()
        everyone.append(pid)
        todo.extend(children.get(pid, []))
    torchrun = [
        p
        for p in everyone
        if "-m torch.distributed.run" in table.get(p, (0, ""))[1]
        and "supervise.py" not in table[p][1]
    ]
    workers = [p for p in everyone if table.get(p, (0, ""))[0] in torchrun]
    loaders = [p for p in everyone if table.get(p, (0, ""))[0] in workers]
    return {
        "all": everyone,
        "launcher": [root],
        "torchrun": torchrun,
        "workers": workers,
        "loaders": loaders,
    }


# (who, signal) deliveries, 20 ms apart.
PATTERNS = {
    # Slurm --signal=USR2 / scancel --signal=USR2: every process; then the launcher's forwarded
    # SIGTERM and scancel's SIGTERM to every process.
    "usr2_then_term_to_all": [("all", "SIGUSR2"), ("all", "SIGTERM")],
    # A time limit without --signal, scancel, a Kubernetes or systemd stop, twice.
    "term_to_all_twice": [("all", "SIGTERM"), ("all", "SIGTERM")],
    # A scheduler that signals only the training processes (and their loader workers).
    "usr2_to_workers_and_loaders_only": [("workers", "SIGUSR2"), ("loaders", "SIGUSR2")],
    # Kubernetes with the launcher as PID 1: only it.
    "term_to_launcher_only": [("launcher", "SIGTERM")],
    # Loader workers first (they must not die), then mixed signals to the rest.
    "term_to_loaders_then_usr2_and_int": [
        ("loaders", "SIGTERM"),
        ("torchrun", "SIGUSR2"),
        ("workers", "SIGINT"),
        ("launcher", "SIGUSR2"),
    ],
}
RESUMED = ("usr2_then_term_to_all", "usr2_to_workers_and_loaders_only")


def launcher_command(launcher: str) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MAX_RESTARTS": "1", "NPROC_PER_NODE": "2"}
    if launcher == "train_single_node.sh":
        return ["bash", "scripts/train_single_node.sh"], env
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NNODES="1", NODE_RANK="0")
    return ["bash", "scripts/launch_multinode.sh"], env


def start_job(launcher: str, run_dir: Path, log: Path) -> subprocess.Popen:
    """The job under `launcher`, in a session of its own, its output in `log`."""
    cmd, env = launcher_command(launcher)
    with log.open("w") as out:
        return subprocess.Popen(
            [*cmd, f"--run.dir={run_dir}", *JOB],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def deliver(root: int, pattern: list[tuple[str, str]]) -> None:
    for who, name in pattern:
        for pid in job_tree(root)[who]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.Signals[name])
        time.sleep(0.02)


def checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*.pt"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """A 2-rank run of the same job, never signalled (plain torchrun)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = launch(2, f"--run.dir={run_dir}", *JOB, timeout=180)
    assert proc.returncode == 0, proc.output[-3000:]
    return final_state(run_dir)


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("launcher", ["train_single_node.sh", "launch_multinode.sh"])
def test_stop_signals_however_delivered_end_in_one_checkpoint_and_exit_75(
    tmp_path, launcher, pattern, reference
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    proc = start_job(launcher, run_dir, log)
    try:
        wait_for_train_rows(run_dir, proc, rows=3)
        tree = job_tree(proc.pid)
        assert len(tree["workers"]) == 2 and len(tree["loaders"]) >= 2, tree
        deliver(proc.pid, PATTERNS[pattern])
        returncode = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert returncode == 75, output[-4000:]
    assert "killed by signal" not in output, output[-4000:]  # no loader worker died
    assert output.count("saved checkpoint") == 1, output[-4000:]  # the preemption's alone
    [stopped] = checkpoints(run_dir)
    assert 3 <= stopped < STEPS
    assert f"checkpoint of step {stopped}" in output
    assert not job_tree(proc.pid)["all"][1:], "processes left behind"
    if pattern in RESUMED:  # nothing lost: the same command again ends as if never stopped
        resumed = start_job(launcher, run_dir, tmp_path / "resumed.log")
        assert resumed.wait(timeout=180) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
        assert f"at step {stopped} " in (tmp_path / "resumed.log").read_text()
        assert reference["step"] == STEPS
        assert_same_training_state(final_state(run_dir), reference)


def test_ctrl_c_in_an_interactive_run_checkpoints(tmp_path) -> None:
    """`python train.py` in a terminal: Ctrl-C (SIGINT to the foreground group) checkpoints,
    and a second Ctrl-C while it does is the same request."""
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            train_command(None, f"--run.dir={run_dir}", *JOB),
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_train_rows(run_dir, proc)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        returncode = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert returncode == 75, output[-3000:]
    assert "preempted by SIGINT" in output and "Traceback" not in output
    assert len(checkpoints(run_dir)) == 1


@pytest.mark.parametrize("launcher", ["train_single_node.sh", "launch_multinode.sh"])
def test_a_stop_before_training_starts_exits_75_and_leaves_nothing(tmp_path, launcher) -> None:
    """SIGTERM to every process while torchrun is still starting (it handles signals only
    once its workers run, and dies of one before): nothing trained, so 'resubmit' (75)."""
    run_dir = tmp_path / "run"
    cmd, env = launcher_command(launcher)
    proc = subprocess.Popen(
        [*cmd, f"--run.dir={run_dir}", *JOB],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        time.sleep(1.0)
        deliver(proc.pid, [("all", "SIGTERM")])
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, output[-3000:]
    assert not (run_dir / "checkpoints").exists()
    assert not job_tree(proc.pid)["all"][1:]


def test_bad_input_under_the_launcher_exits_2_without_burning_restarts(tmp_path) -> None:
    """torchrun turns a worker's exit 2 into its own 1 and restarts it; the launcher reports
    the workers' 2 (train.sbatch does not requeue it) and stops the restarts."""
    cmd, env = launcher_command("launch_multinode.sh")
    env["MAX_RESTARTS"] = "3"
    missing = tmp_path / "missing.pt"
    proc = subprocess.run(
        [*cmd, f"--run.dir={tmp_path / 'run'}", *JOB, f"--ckpt.resume={missing}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert str(missing) in output and "retrying cannot help" in output
    assert output.count("not starting") == 0 and output.count("world size") == 0


@pytest.mark.parametrize("launcher", ["train_single_node.sh", "launch_multinode.sh"])
def test_a_bad_command_line_under_the_launcher_exits_2(tmp_path, launcher) -> None:
    """A value the config rejects fails in train.py's first lines, before torch is imported:
    that path reports bad input to the launcher as well, so the job exits 2 (not torchrun's 1,
    which a scheduler would retry), naming the field and the value, and writes nothing."""
    cmd, env = launcher_command(launcher)
    env["MAX_RESTARTS"] = "3"
    proc = subprocess.run(
        [*cmd, f"--run.dir={tmp_path / 'run'}", *JOB, "--train.epochs=many"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "train.epochs" in output and "many" in output and "retrying cannot help" in output
    assert not (tmp_path / "run").exists()
