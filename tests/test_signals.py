"""Stop signals delivered the way clusters deliver them: to every process of the job tree
(launcher, torchrun, each worker, each loader worker), repeated and mixed, or to a subset.

slurmstepd and the kubelet signal each process, not a process group, and torchrun starts its
workers in sessions of their own, so these tests walk /proc for the launcher's descendants and
signal each one. Every pattern must end in exactly one checkpoint (the preemption's) and
exit 75, and a resumed run must end `torch.equal` to a run that was never stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    assert_same_training_state,
    final_state,
    free_port,
    launch,
    tiny_job_args,
    train_command,
    wait_for_train_rows,
)

import exitcodes

pytestmark = pytest.mark.e2e

STEPS = 400  # about 8 s of training at 2 ranks: long enough to be hit mid-run
JOB = tiny_job_args(
    data_synthetic_train_size=20000,  # one epoch is longer than the run: no epoch-end save
    data_loader="dataloader",
    data_num_workers=1,  # loader workers, which must survive the signals
    log_every_steps=1,
    dist_preflight=False,
    dist_timeout_s=30,
    train_max_steps=STEPS,
    train_epochs=1,
)


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


def start_job(
    launcher: str, run_dir: Path, log: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """The job under `launcher`, in a session of its own, its output in `log`; `args` are
    config overrides beyond JOB, `env` more environment (TRAIN_FAULTS, ...)."""
    cmd, base_env = launcher_command(launcher)
    env = {**base_env, **(env or {})}
    with log.open("w") as out:
        return subprocess.Popen(
            [*cmd, f"--run.dir={run_dir}", *JOB, *args],
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


# CI runs each pattern once, and the launcher-only one under both launchers (their shells differ;
# below them the same supervise.py and torchrun); the other pairs are the extended tier.
IN_CI = {
    "train_single_node.sh": (
        "usr2_then_term_to_all",
        "usr2_to_workers_and_loaders_only",
        "term_to_launcher_only",
    ),
    "launch_multinode.sh": (
        "term_to_all_twice",
        "term_to_loaders_then_usr2_and_int",
        "term_to_launcher_only",
    ),
}
STOP_CASES = [
    pytest.param(
        launcher, pattern, marks=[] if pattern in IN_CI[launcher] else [pytest.mark.extended]
    )
    for launcher in ("train_single_node.sh", "launch_multinode.sh")
    for pattern in PATTERNS
]


@pytest.mark.parametrize(("launcher", "pattern"), STOP_CASES)
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
    assert returncode == exitcodes.EXIT_PREEMPTED, output[-4000:]
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
    assert returncode == exitcodes.EXIT_PREEMPTED, output[-3000:]
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
    assert proc.returncode == exitcodes.EXIT_PREEMPTED, output[-3000:]
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
    assert proc.returncode == exitcodes.EXIT_BAD_INPUT, output[-3000:]
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
    assert proc.returncode == exitcodes.EXIT_BAD_INPUT, output[-3000:]
    assert "train.epochs" in output and "many" in output and "retrying cannot help" in output
    assert not (tmp_path / "run").exists()


# The patterns that differ in what torchrun sees: one SIGTERM (from the launcher), its own
# SIGTERM twice besides the launcher's (it dies of a repeat inside its shutdown and leaves the
# workers to the launcher, a child subreaper), nothing at all (the workers exit 75 by themselves).
SLOW_SAVE_CASES = [  # CI: the first; the launcher's own signal under the other launcher and
    # the patterns that reach the workers directly are the extended tier
    ("train_single_node.sh", "term_to_launcher_only"),
    pytest.param("launch_multinode.sh", "term_to_launcher_only", marks=pytest.mark.extended),
    pytest.param("train_single_node.sh", "term_to_all_twice", marks=pytest.mark.extended),
    pytest.param(
        "train_single_node.sh", "usr2_to_workers_and_loaders_only", marks=pytest.mark.extended
    ),
]
SLOW_SAVE_S = 40  # beyond torchrun's default shutdown timeout of 30 s


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "pattern"), SLOW_SAVE_CASES)
def test_a_preemption_save_slower_than_torchruns_default_30_s_is_written(
    tmp_path, launcher, pattern
) -> None:
    """torchrun SIGKILLs its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30) after
    its stop signal (torch/distributed/launcher/api.py, LaunchConfig.__post_init__;
    elastic/agent/server/api.py, SimpleElasticAgent.run -> _shutdown(timeout=...)). Before
    scripts/supervise.py set it to SUPERVISE_GRACE_S, a 40 s save ended with exit 1, no
    checkpoint and a stale lease.json. Now: the checkpoint, exit 75, the lease released."""
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    faults = {
        "TRAIN_SCRIPT": "tests/faults.py",
        "TRAIN_FAULTS": f"sleep@save=begin,seconds={SLOW_SAVE_S}",
    }
    # The other ranks wait in the save's collective meanwhile: give them more than the save.
    slow = ("--dist.timeout_s=180",)
    proc = start_job(launcher, run_dir, log, *slow, env=faults)
    try:
        wait_for_train_rows(run_dir, proc, rows=3)
        started = time.monotonic()
        deliver(proc.pid, PATTERNS[pattern])
        returncode = proc.wait(timeout=240)
        took = time.monotonic() - started
        print(f"{launcher} {pattern}: exit {returncode}, {took:.1f} s after the signal")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert "preemption budget 120 s" in output, output[-4000:]
    assert returncode == exitcodes.EXIT_PREEMPTED, output[-4000:]
    assert "forcefully exiting" not in output, output[-4000:]  # torchrun's SIGKILL
    [stopped] = checkpoints(run_dir)
    assert f"checkpoint of step {stopped}" in output
    assert not list(run_dir.glob("lease.*.json"))  # runpaths.LEASE_GLOB: released
    assert not job_tree(proc.pid)["all"][1:], "processes left behind"


@pytest.mark.slow
def test_a_sigkill_of_the_launcher_stops_torchrun_and_its_workers(tmp_path) -> None:
    """SIGKILL to scripts/supervise.py (the OOM killer, `kill -9`, a crashed node agent) on a
    bare machine, where no cgroup kill follows. Before, torchrun and its workers trained on,
    holding the run dir's lease, with nobody to stop them. Now torchrun gets SIGTERM at its
    parent's death (PR_SET_PDEATHSIG, prctl(2)) and stops its workers as for any stop
    signal: they checkpoint and leave, the lease is released, and the same command resumes."""
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    endless = [arg for arg in JOB if not arg.startswith(("--train.max_steps", "--train.epochs"))]
    job = ("--train.epochs=1000",)  # never done by itself
    cmd, env = launcher_command("train_single_node.sh")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*cmd, f"--run.dir={run_dir}", *endless, *job],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    tree: dict[str, list[int]] = {"all": []}
    try:
        wait_for_train_rows(run_dir, proc, rows=3)
        tree = job_tree(proc.pid)
        assert len(tree["torchrun"]) == 1 and len(tree["workers"]) == 2, tree
        os.kill(proc.pid, signal.SIGKILL)  # bash exec'd supervise.py: this is the launcher
        proc.wait(timeout=10)
        deadline = time.monotonic() + 150  # the shutdown timeout is 120 s; the save takes 1 s
        while (alive := [p for p in tree["all"][1:] if p in process_table()]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.5)
        assert not alive, f"still running after the launcher's SIGKILL: {alive}"
    finally:
        for pid in tree["all"][1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    output = log.read_text()
    assert not list(run_dir.glob("lease.*.json")), output[-3000:]  # released
    [stopped] = checkpoints(run_dir)
    assert f"preempted by SIGTERM at step {stopped}:" in output, output[-3000:]
    # The same command again resumes from that checkpoint (then stops for this test).
    resumed = subprocess.Popen(
        [*cmd, f"--run.dir={run_dir}", *endless, *job],
        cwd=REPO,
        env=env,
        stdout=(tmp_path / "resumed.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_train_rows(run_dir, resumed, rows=stopped + 2)
        os.kill(resumed.pid, signal.SIGTERM)
        assert resumed.wait(timeout=120) == exitcodes.EXIT_PREEMPTED
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)
    assert f"at step {stopped} " in (tmp_path / "resumed.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "-1", "010", "two", "gpu"])
@pytest.mark.parametrize("launcher", ["train_single_node.sh", "launch_multinode.sh"])
def test_a_bad_nproc_per_node_exits_2_naming_it(tmp_path, launcher, value) -> None:
    """torchrun's determine_local_world_size (torch/distributed/run.py) takes any int (0 and
    -1 too) and checks `gpu` only with torch.cuda.is_available(); before, these reached torch
    tracebacks and exit 1 from train_single_node.sh, which schedulers retry."""
    if value == "gpu" and torch.cuda.is_available():
        pytest.skip("this host has a GPU: NPROC_PER_NODE=gpu is valid here")
    cmd, env = launcher_command(launcher)
    proc = subprocess.run(
        [*cmd, f"--run.dir={tmp_path / 'run'}", *JOB],
        cwd=REPO,
        env={**env, "NPROC_PER_NODE": value},
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == exitcodes.EXIT_BAD_INPUT, output[-3000:]
    assert f"NPROC_PER_NODE={value}" in output and "Traceback" not in output
    assert not (tmp_path / "run").exists()


def _fake_torch(root: Path, launcher_api: str) -> dict[str, str]:
    """A torch package that only has what supervise.py reads (version, launcher/api.py)."""
    (root / "torch" / "distributed" / "launcher").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("")
    (root / "torch" / "version.py").write_text("__version__ = '2.4.1'\n")
    (root / "torch" / "distributed" / "launcher" / "api.py").write_text(launcher_api)
    return {**os.environ, "PYTHONPATH": str(root)}


def _supervise_with(env: dict[str, str], command: list[str]) -> subprocess.CompletedProcess:
    """supervise.py over `command` (torchrun's --help: its start-up message is the subject)."""
    return subprocess.run(
        [sys.executable, "scripts/supervise.py", "--", *command],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_a_torch_without_the_shutdown_timeout_is_named_at_start(tmp_path) -> None:
    """torch releases before pytorch PR #172596 hard-code torchrun's 30 s: the launcher says
    that the budget is 30 s, not SUPERVISE_GRACE_S, instead of pretending."""
    env = _fake_torch(tmp_path, "class LaunchConfig:\n    pass\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--help"]
    proc = _supervise_with(env, command)
    assert "warning: torch 2.4.1 has no TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in proc.stderr
    assert "within 30 s, not SUPERVISE_GRACE_S=120 s" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["--shutdown-timeout=45"], "preemption budget 45 s"),
        (["--shutdown_timeout", "600"], "preemption budget 120 s"),
        (["--shutdown-timeout=soon"], "--shutdown-timeout=soon is not a whole number"),
    ],
)
def test_a_shutdown_timeout_given_to_torchrun_is_kept_and_the_budget_named(
    tmp_path, given, expected
) -> None:
    """An explicit torchrun timeout wins over the one supervise.py would set (run.py's flag,
    then PET_SHUTDOWN_TIMEOUT, then TORCH_ELASTIC_SHUTDOWN_TIMEOUT); the budget is the smaller
    of it and SUPERVISE_GRACE_S, and one torchrun would crash on (int()) is refused: exit 2."""
    env = _fake_torch(tmp_path, "os.environ.get('TORCH_ELASTIC_SHUTDOWN_TIMEOUT', '30')\n")
    command = [sys.executable, "-m", "torch.distributed.run", *given, "--help"]
    proc = _supervise_with(env, command)
    assert expected in proc.stderr, proc.stderr
    if "soon" in expected:
        assert proc.returncode == exitcodes.EXIT_BAD_INPUT


def test_a_launch_with_the_same_job_id_takes_its_run_dir_back_after_a_hard_kill(tmp_path):
    """A container killed outright (SIGKILL to every process: the OOM killer, `docker kill`)
    and restarted at once by its runtime. Before, the default launcher's torchrun --standalone
    drew a new job id per launch, so the restart found the old lease alive and exited 2 ("bad
    input") until it expired (run.lease_timeout_s, 120 s by default). With TRAIN_JOB_ID (the
    container's entry point sets it from scripts/container/job_id.sh) it takes the run dir
    back and continues; without one, a second launch on a run dir in use is still refused.
    (TRAIN_JOB_ID, not JOB_ID, which Grid Engine sets for every job: the review's finding.)"""
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "NPROC_PER_NODE": "1",
        "TRAIN_JOB_ID": "container-1",
    }
    job = tiny_job_args(run_dir, train_max_steps=STEPS, log_every_steps=1, ckpt_every_steps=5)
    # Each launch in a PID namespace of its own, as each container start is: a holder there
    # cannot be seen to be dead from here, so its lease stands until it expires (on one
    # host and namespace the dead holder's pid and start time tell at once).
    container = ["unshare", "--pid", "--fork", "--mount-proc"]
    command = [*container, "bash", "scripts/train_single_node.sh", *job]
    with (tmp_path / "first.log").open("w") as log:
        first = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    wait_for_train_rows(run_dir, first, rows=10)
    for pid in job_tree(first.pid)["all"]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    first.wait(timeout=30)
    time.sleep(1)  # the kill lands on every process; the lease stays, its heartbeat fresh
    anonymous = {key: value for key, value in env.items() if key != "TRAIN_JOB_ID"}
    refused = subprocess.run(
        command, cwd=REPO, env=anonymous, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == exitcodes.EXIT_BAD_INPUT, refused.stderr[-3000:]
    assert "in use by job torchrun-container-1" in refused.stderr, refused.stderr[-3000:]
    again = subprocess.run(
        [*command, f"--train.max_steps={STEPS // 20}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr, again.stderr[-3000:]


@pytest.mark.parametrize(
    ("line", "named"),
    [  # /proc/self/mountinfo lines as Docker, Podman (rootful, rootless) and the kubelet write
        (
            "601 583 253:1 /var/lib/docker/containers/4f2c/hosts /etc/hosts rw - ext4 /dev/vda1 r",
            True,
        ),
        (
            "712 690 0:44 /containers/storage/overlay-containers/9be1/userdata/hosts /etc/hosts "
            "rw,nosuid - tmpfs tmpfs rw",
            True,
        ),
        (
            "33 30 0:27 /user/1000/containers/overlay-containers/77aa/userdata/hosts /etc/hosts "
            "rw - tmpfs tmpfs rw",
            True,
        ),
        (
            "1422 1410 253:1 /var/lib/kubelet/pods/5e0d/etc-hosts /etc/hosts rw - ext4 /dev/sda1 r",
            True,
        ),
        ("25 1 253:1 / / rw,relatime - ext4 /dev/vda1 rw", False),  # no container: no id
    ],
)
def test_a_containers_job_id_is_its_own_and_kept_by_its_restarts(tmp_path, line, named) -> None:
    """scripts/container/job_id.sh reads the host directory /etc/hosts is bind-mounted from:
    per container (per pod on Kubernetes), so a restart keeps it and another container, even
    with the host's network and host name, does not share it."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"24 1 0:22 / /proc rw - proc proc rw\n{line}\n")
    script = REPO / "scripts" / "container" / "job_id.sh"
    printed = subprocess.run(
        ["bash", str(script), str(mountinfo)], capture_output=True, text=True, check=True
    ).stdout
    source = line.split()[3]
    expected = f"container-{hashlib.sha256(source.encode()).hexdigest()[:12]}\n"
    assert printed == (expected if named else "")
