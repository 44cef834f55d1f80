"""Cluster-scheduler files: the Slurm batch script and the Kubeflow PyTorchJob manifest.

No cluster is needed: the batch script runs under bash with fake `scontrol` and `srun` first on
PATH, and the manifest is checked as parsed YAML. Only what a real cluster cannot show cheaply
is tested here (argument quoting, the port formula, exit codes the training side does not yet
produce, the requeue limit); tests/multinode/test_slurm.py submits train.sbatch to a real Slurm.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

import exitcodes

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
MANIFEST = REPO / "scripts" / "k8s" / "pytorchjob.yaml"

HOSTS = ("gpu-node-17", "gpu-node-18")
# Arguments that a wrong quoting level would split, glob or expand.
PASSTHROUGH = ["--train.epochs=3", "--log.note=two  words", "--x=$HOME '*' \"q\"", "--y=a;b"]

# `scontrol show hostnames` prints the job's hosts; `scontrol requeue` is logged and, as Slurm
# would, ends the running job step (the fake srun).
FAKE_SCONTROL = f"""#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$FAKE_LOG/scontrol.log"
if [[ "$1 $2" == "show hostnames" ]]; then
  touch "$FAKE_LOG/scontrol.started"
  sleep "${{FAKE_SCONTROL_SLEEP:-0}}"  # a slow controller: the batch shell waits here
  printf '%s\\n' {" ".join(HOSTS)}; exit 0
fi
if [[ "$1 $2" == "show job" && -n "${{FAKE_TIME_LIMIT:-}}" ]]; then
  printf '   RunTime=00:00:01 TimeLimit=%s TimeMin=N/A\n' "$FAKE_TIME_LIMIT"; exit 0
fi
if [[ "$1" == requeue && -f "$FAKE_LOG/srun.pid" ]]; then
  kill -TERM "$(cat "$FAKE_LOG/srun.pid")" 2>/dev/null || true
fi
"""

# Records its arguments (NUL-separated) and the rendezvous environment, and creates the file
# FAKE_SRUN_CREATES names (a checkpoint's manifest: progress). FAKE_SRUN_MODE=exec runs
# the task command once per node with that node's SLURM_NODEID, as srun would; =sleep waits to be
# killed, or on SIGUSR2 exits with FAKE_SRUN_STATUS (75: the workers checkpointed). Otherwise it
# runs nothing and exits FAKE_SRUN_STATUS (0).
FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$FAKE_LOG/srun.args"
for v in NNODES MASTER_ADDR MASTER_PORT JOB_ID RUN_DIR; do
  printf '%s=%s\\n' "$v" "${!v-<unset>}"
done > "$FAKE_LOG/srun.env"
if [[ -n "${FAKE_SRUN_CREATES:-}" ]]; then
  mkdir -p "$(dirname "$FAKE_SRUN_CREATES")" && touch "$FAKE_SRUN_CREATES"
fi
case "${FAKE_SRUN_MODE:-record}" in
  exec)
    while [[ "$1" == --* ]]; do shift; done  # srun's own options
    for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" || exit; done ;;
  sleep)  # a job step whose tasks stop when srun forwards SIGUSR2
    trap 'echo USR2 > "$FAKE_LOG/srun.usr2"; exit "${FAKE_SRUN_STATUS:-75}"' USR2
    echo $$ > "$FAKE_LOG/srun.pid"
    for ((i = 0; i < 600; i++)); do sleep 0.1; done ;;
esac
exit "${FAKE_SRUN_STATUS:-0}"
"""

# Stands in for scripts/launch_multinode.sh in the submit directory for FAKE_SRUN_MODE=exec.
FAKE_LAUNCH = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$FAKE_LOG/launch.$NODE_RANK.args"
"""


def _write_exe(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, str]:
    """Environment of a 2-node batch job with fake Slurm commands; submit dir = tmp_path/submit."""
    bin_dir, log, submit = tmp_path / "bin", tmp_path / "log", tmp_path / "submit"
    log.mkdir()
    _write_exe(bin_dir / "scontrol", FAKE_SCONTROL)
    _write_exe(bin_dir / "srun", FAKE_SRUN)
    _write_exe(submit / "scripts" / "launch_multinode.sh", FAKE_LAUNCH)
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "FAKE_LOG": str(log),
        "SLURM_JOB_ID": "123457",
        "SLURM_CLUSTER_NAME": "gpu",
        "SLURM_JOB_NODELIST": "gpu-node-[17-18]",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "0",
        "SLURM_SUBMIT_DIR": str(submit),
    }


def _run_sbatch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=30
    )


def _read_nul(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def _read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def _directives() -> dict[str, str]:
    found = {}
    for line in SBATCH.read_text().splitlines():
        if m := re.match(r"#SBATCH\s+(--[\w-]+)(?:=(\S+))?", line):
            found[m.group(1)] = m.group(2) or ""
    return found


def test_sbatch_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_sbatch_directives() -> None:
    directives = _directives()
    assert int(directives["--nodes"]) >= 2
    assert directives["--ntasks-per-node"] == "1"
    # sbatch refuses a GPU request on a partition without GPUs, and a CPU request larger than
    # the nodes' leaves the job pending forever: both are asked for at submission, not here.
    assert not {"--gpus-per-node", "--gpus", "--gres", "--cpus-per-task"} & directives.keys()
    signal_spec = re.fullmatch(r"B:USR2@(\d+)", directives["--signal"])
    assert signal_spec and int(signal_spec.group(1)) >= 60, directives["--signal"]
    assert "--requeue" in directives
    assert directives["--open-mode"] == "append"
    assert "%j" in directives["--output"]
    # sbatch stops reading directives at the first command: all of them must come before it.
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, s in enumerate(lines) if s.strip() and not s.startswith("#"))
    assert all(i < first_command for i, s in enumerate(lines) if s.startswith("#SBATCH"))


def test_sbatch_sets_rendezvous_and_passes_args(slurm: dict[str, str]) -> None:
    result = _run_sbatch(slurm, *PASSTHROUGH)
    assert result.returncode == 0, result.stderr
    log = Path(slurm["FAKE_LOG"])
    env = _read_env(log / "srun.env")
    run_dir = f"{slurm['SLURM_SUBMIT_DIR']}/runs/slurm-gpu-123457"
    assert env == {
        "NNODES": "2",
        "MASTER_ADDR": HOSTS[0],
        "MASTER_PORT": "26914",  # 20000 + 2 * (123457 % 5000)
        "JOB_ID": "123457",
        "RUN_DIR": run_dir,
    }
    args = _read_nul(log / "srun.args")
    assert "--kill-on-bad-exit=1" in args and "--ntasks-per-node=1" in args
    # The run dir, then every passthrough argument exactly as given, at the end of the line.
    assert args[-len(PASSTHROUGH) - 1 :] == [f"--run.dir={run_dir}", *PASSTHROUGH]
    assert (log / "scontrol.log").read_text().splitlines() == [
        f"show hostnames {slurm['SLURM_JOB_NODELIST']}",
        "show job 123457",  # its time limit
    ]


@pytest.mark.parametrize("job_id", ["1", "29999", "987654321"])
def test_sbatch_port_in_range(slurm: dict[str, str], job_id: str) -> None:
    result = _run_sbatch({**slurm, "SLURM_JOB_ID": job_id})
    assert result.returncode == 0, result.stderr
    port = int(_read_env(Path(slurm["FAKE_LOG"]) / "srun.env")["MASTER_PORT"])
    assert 20000 <= port <= 29998 and port % 2 == 0
    # Even ports only: this job's check port (MASTER_PORT + 1) is never the next job's port.
    assert port == 20000 + 2 * (int(job_id) % 5000)


def test_sbatch_run_dir_override(slurm: dict[str, str]) -> None:
    result = _run_sbatch({**slurm, "RUN_DIR": "/shared/runs/exp1"}, "--train.epochs=3")
    assert result.returncode == 0, result.stderr
    args = _read_nul(Path(slurm["FAKE_LOG"]) / "srun.args")
    assert args[-2:] == ["--run.dir=/shared/runs/exp1", "--train.epochs=3"]


def test_sbatch_each_node_gets_its_rank_and_the_args(slurm: dict[str, str]) -> None:
    """Run srun's task command per node: NODE_RANK must come from each task's SLURM_NODEID."""
    result = _run_sbatch({**slurm, "FAKE_SRUN_MODE": "exec"}, *PASSTHROUGH)
    assert result.returncode == 0, result.stderr
    run_dir = f"{slurm['SLURM_SUBMIT_DIR']}/runs/slurm-gpu-123457"
    for node in (0, 1):
        launched = _read_nul(Path(slurm["FAKE_LOG"]) / f"launch.{node}.args")
        assert launched == [f"--run.dir={run_dir}", *PASSTHROUGH]


def test_sbatch_without_slurm_job_fails(slurm: dict[str, str]) -> None:
    env = {k: v for k, v in slurm.items() if k != "SLURM_JOB_ID"}
    result = _run_sbatch(env)
    assert result.returncode != 0
    assert "sbatch" in result.stderr
    assert not (Path(slurm["FAKE_LOG"]) / "srun.args").exists()


def _usr2_during_step(slurm: dict[str, str], step_status: int) -> tuple[int, str, list[str]]:
    """SIGUSR2 to the batch shell while its (fake) job step runs; the step then exits
    `step_status`. Returns the batch shell's exit status, its output and scontrol's calls."""
    log = Path(slurm["FAKE_LOG"])
    # Output to a file, not a pipe: the fake srun must not keep the test waiting on its end.
    with open(log / "batch.out", "w") as out:
        proc = subprocess.Popen(
            ["bash", str(SBATCH), "--train.epochs=3"],
            env={**slurm, "FAKE_SRUN_MODE": "sleep", "FAKE_SRUN_STATUS": str(step_status)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    finished = False
    try:
        deadline = time.monotonic() + 20
        while not (log / "srun.pid").exists():  # srun started, so the trap is installed
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGUSR2)
        proc.wait(timeout=20)
        finished = True
    finally:
        if not finished:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError, ValueError):  # leave no fake srun (sleep) behind
            pid = int((log / "srun.pid").read_text())
            if b"srun" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
    output = (log / "batch.out").read_text()
    assert (log / "srun.usr2").read_text().strip() == "USR2", output  # forwarded to the step
    return proc.returncode, output, (log / "scontrol.log").read_text().splitlines()


@pytest.mark.parametrize(
    "step_status", [exitcodes.EXIT_PREEMPTED, exitcodes.EXIT_FAILED, 128 + signal.SIGKILL]
)
def test_sbatch_requeues_after_usr2_unless_final(slurm: dict[str, str], step_status: int) -> None:
    """Near the time limit the job is requeued whether or not the workers managed to checkpoint
    (75): otherwise the limit kills it and the newest periodic checkpoint is lost to it."""
    returncode, output, calls = _usr2_during_step(slurm, step_status)
    assert calls[-1] == "requeue 123457", output
    assert "requeueing job 123457" in output
    assert returncode == step_status, output


@pytest.mark.parametrize("step_status", sorted(exitcodes.FINAL_EXITS))
def test_sbatch_does_not_requeue_a_final_status_after_usr2(
    slurm: dict[str, str], step_status: int
) -> None:
    """2 (bad input), 3 (diverged) and 76 (crash loop) would fail the same way again; 0 is
    done. Every final code of exitcodes.py (before, a divergence after SIGUSR2 was requeued)."""
    returncode, output, calls = _usr2_during_step(slurm, step_status)
    assert not any(call.startswith("requeue") for call in calls), output
    assert returncode == step_status, output


@pytest.mark.parametrize(
    ("step_status", "requeued", "message"),
    [
        (exitcodes.EXIT_PREEMPTED, True, "requeueing job 123457"),
        (
            exitcodes.EXIT_NO_PROGRESS,
            False,
            "crash loop, restarts made no progress: not requeueing",
        ),
        (exitcodes.EXIT_BAD_INPUT, False, "bad input, retrying cannot help: not requeueing"),
        (exitcodes.EXIT_DIVERGED, False, "diverged, retrying cannot help: not requeueing"),
        (exitcodes.EXIT_FAILED, False, "exit 1: failed"),
        (exitcodes.EXIT_RENDEZVOUS, True, "retryable (a node late"),
        (exitcodes.EXIT_IO, True, "retryable (a node late, transient I/O)"),
    ],
)
def test_sbatch_step_status_decides_requeue(
    slurm: dict[str, str], step_status: int, requeued: bool, message: str
) -> None:
    """Without SIGUSR2 to the batch shell: only a preempted step (75) is requeued. 76 is the
    training side's "crash loop, no progress" code, which no real run produces yet."""
    result = _run_sbatch({**slurm, "FAKE_SRUN_STATUS": str(step_status)})
    calls = (Path(slurm["FAKE_LOG"]) / "scontrol.log").read_text().splitlines()
    assert ("requeue 123457" in calls) == requeued, result.stderr
    assert message in result.stderr
    assert result.returncode == step_status


def test_sbatch_usr2_before_the_job_step_starts_requeues_without_training(
    slurm: dict[str, str],
) -> None:
    """Slurm may send the step signal at any time (sbatch(1): up to 60 s early; a preemption
    with preempt_send_user_signal), also while the batch shell is still asking scontrol for
    the nodes. Before, the trap then read the unset srun_pid and `set -u` killed the shell
    (exit 1: no requeue, the job lost). Now: requeued, exit 75, no job step started."""
    log = Path(slurm["FAKE_LOG"])
    with open(log / "batch.out", "w") as out:
        proc = subprocess.Popen(
            ["bash", str(SBATCH)],
            env={**slurm, "FAKE_SCONTROL_SLEEP": "2"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 20
        while not (log / "scontrol.started").exists():  # the trap is installed before this
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGUSR2)
        returncode = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = (log / "batch.out").read_text()
    assert returncode == exitcodes.EXIT_PREEMPTED, output
    assert "unbound variable" not in output
    assert (log / "scontrol.log").read_text().splitlines()[-1] == "requeue 123457", output
    assert not (log / "srun.args").exists()  # nothing started, nothing to checkpoint


def test_sbatch_refuses_a_default_run_dir_of_an_earlier_job(slurm: dict[str, str]) -> None:
    """Job ids restart with a new cluster: a first start must not resume another job's run."""
    stale = Path(slurm["SLURM_SUBMIT_DIR"]) / "runs" / "slurm-gpu-123457"
    stale.mkdir(parents=True)
    result = _run_sbatch(slurm)
    assert result.returncode == exitcodes.EXIT_BAD_INPUT
    assert "already exists" in result.stderr and "RUN_DIR=" in result.stderr
    assert not (Path(slurm["FAKE_LOG"]) / "srun.args").exists()
    # A requeued run of this job (SLURM_RESTART_COUNT >= 1) is what the directory is for.
    result = _run_sbatch({**slurm, "SLURM_RESTART_COUNT": "1"})
    assert result.returncode == 0, result.stderr
    args = _read_nul(Path(slurm["FAKE_LOG"]) / "srun.args")
    assert f"--run.dir={stale}" in args


@pytest.mark.parametrize(
    ("limit", "refused", "warned"),
    [
        ("00:01:00", True, False),
        ("00:03:00", True, False),  # the 120 s lead + the 60 s Slurm may send it early
        ("00:05:00", False, True),
        ("1-00:00:00", False, False),
        ("UNLIMITED", False, False),
    ],
)
def test_sbatch_refuses_a_time_limit_that_leaves_no_time_before_the_step_signal(
    slurm: dict[str, str], limit: str, refused: bool, warned: bool
) -> None:
    """Issue 31 B5: on the real Slurm test cluster `--time=1` with `--signal=B:USR2@120` was
    requeued forever, one step each time (the signal came at once). Before, this test's
    one-minute job started a job step (exit 0 here, no word); now it is refused, exit 2,
    naming --time and the signal's lead, and a short limit is warned about."""
    result = _run_sbatch({**slurm, "FAKE_TIME_LIMIT": limit})
    started = (Path(slurm["FAKE_LOG"]) / "srun.args").exists()
    assert started != refused, result.stderr
    assert result.returncode == (exitcodes.EXIT_BAD_INPUT if refused else 0), result.stderr
    assert ("--time is" in result.stderr and "USR2@120" in result.stderr) == (refused or warned)
    assert ("warning" in result.stderr) == warned


def test_sbatch_preemptions_that_save_no_checkpoint_end_after_max_idle_requeues(
    slurm: dict[str, str],
) -> None:
    """Issue 31 B5: a preempted step (75) is requeued without counting against MAX_REQUEUES,
    so one that never saves a new checkpoint was requeued forever. Now MAX_IDLE_REQUEUES (3)
    such requeues in a row end the job with 76; one that saved a checkpoint resets the count."""
    log = Path(slurm["FAKE_LOG"])
    run_dir = Path(slurm["SLURM_SUBMIT_DIR"]) / "runs" / "slurm-gpu-123457"
    env = {**slurm, "FAKE_SRUN_STATUS": "75", "SLURM_RESTART_COUNT": "1"}

    def requeued(**more: str) -> tuple[bool, subprocess.CompletedProcess[str]]:
        (log / "scontrol.log").unlink(missing_ok=True)
        result = _run_sbatch({**env, **more})
        calls = (log / "scontrol.log").read_text().splitlines()
        return "requeue 123457" in calls, result

    progress = str(run_dir / "checkpoints" / "step_5.manifest.json")
    assert requeued(FAKE_SRUN_CREATES=progress)[0]  # a new checkpoint: progress
    for _ in range(3):
        again, result = requeued()
        assert again and result.returncode == exitcodes.EXIT_PREEMPTED, result.stderr
    again, result = requeued()
    assert not again and result.returncode == exitcodes.EXIT_NO_PROGRESS, result.stderr
    assert "4 preemptions in a row saved no new checkpoint" in result.stderr
    # A step that saved one starts the count anew.
    assert requeued(FAKE_SRUN_CREATES=str(run_dir / "checkpoints" / "step_9.manifest.json"))[0]
    assert (run_dir / "requeues_without_progress").read_text().strip() == "0"


@pytest.mark.parametrize(("how", "requeued"), [("capped", False), ("", True)])
def test_sbatch_requeue_limit(slurm: dict[str, str], how: str, requeued: bool) -> None:
    """After MAX_REQUEUES requeues a failure is not requeued again; a preemption (75, progress
    saved) always is."""
    # Define just the handler (sed cuts it out of the script), then call it.
    handler = f"source <(sed -n '/^requeue_now()/,/^}}/p' {shlex.quote(str(SBATCH))})"
    env = {**slurm, "MAX_REQUEUES": "5"}
    script = f"restarts=5; {handler}; requeue_now {how}"
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert ("not requeueing" in result.stderr) != requeued
    assert (Path(slurm["FAKE_LOG"]) / "scontrol.log").exists() == requeued


# --- Kubernetes ---------------------------------------------------------------------------------


def _manifest() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_pytorchjob_manifest() -> None:
    docs = _manifest()
    job = docs["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["rdzvBackend"] == "c10d"
    assert elastic["maxRestarts"] >= 1
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "OnFailure"
    # A fixed size: resuming on another world size works (even mid-epoch), but a job whose size
    # changes under it would change the global batch, and so the training math, mid-run.
    assert elastic["minReplicas"] == elastic["maxReplicas"] == worker["replicas"] >= 2

    pod = worker["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 30
    (container,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
    assert "CHANGE-ME" in container["image"]  # the placeholder is unmistakable
    command = container["command"]
    # torchrun (not plain python) reads the operator's PET_* rendezvous settings.
    launcher = command.index("torch.distributed.run")
    assert command[1:3] == ["scripts/supervise.py", "--"]  # exit 75 / 76 for the pod
    assert command[launcher - 1] == "-m" and command[0].endswith("python")
    assert launcher < command.index("train.py")

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (shared,) = [n for n, v in volumes.items() if "persistentVolumeClaim" in v]
    run_dirs = [a.split("=", 1)[1] for a in command if a.startswith("--run.dir=")]
    assert len(run_dirs) == 1
    assert run_dirs[0].startswith(mounts[shared].rstrip("/") + "/")
    assert run_dirs[0] != mounts[shared]
    claim = volumes[shared]["persistentVolumeClaim"]["claimName"]
    pvc = docs["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == claim
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]

    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert mounts["dshm"] == "/dev/shm"

    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= 1
    # One rank per GPU: the policy, the explicit torchrun flag and the GPU limit agree.
    assert int(job["spec"]["nprocPerNode"]) == gpus
    assert f"--nproc-per-node={gpus}" in command
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert "pytorchjob-port" in ports  # the operator builds the rendezvous endpoint from it
