"""scripts/ray_train.py on a local Ray cluster of 2 CPU workers, against torchrun runs of the
same job."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO, assert_same_training_state, final_state, launch, rows, tiny_job_args

if not os.environ.get("CI"):  # under CI the ray group is part of the set-up (scripts/test.sh)
    pytest.importorskip("ray", reason="the ray dependency group: uv sync --group ray")

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

JOB = tiny_job_args(
    data_synthetic_train_size=4096,  # 256 steps: the stop tests stop it after the first
    # checkpoint, a few seconds in, while it still has seconds to run on a fast machine
    data_synthetic_eval_size=300,
    data_batch_size=32,
    model_widths="8,16",
    train_epochs=4,
    ckpt_every_steps=32,
    log_every_steps=4,
    dist_timeout_s=60,
)


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


def ray_command(*args: str, max_failures: int = 2, own: tuple[str, ...] = ()) -> list[str]:
    """ray_train.py's command line: a local cluster and 2 workers unless `own` says otherwise
    (the last of a repeated option wins, argparse's rule)."""
    return [
        sys.executable,
        "scripts/ray_train.py",
        "--address=local",
        "--workers=2",
        f"--max-failures={max_failures}",
        *own,
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
        deadline = time.monotonic() + 420  # starting Ray takes minutes on a busy machine
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


@pytest.mark.extended  # CI: a node drain stops the ranks through the same checkpoint path
def test_sigterm_to_the_launcher_checkpoints_exits_75_and_the_same_command_resumes(
    tmp_path: Path, reference: Path
) -> None:
    """SIGTERM to ray_train.py alone (the driver): Ray stops the workers, the ranks checkpoint,
    the launcher waits for them and exits 75 with nothing left running; the same command then
    resumes from that checkpoint and ends torch.equal to the uninterrupted run."""
    run_dir, log = tmp_path / "ray", tmp_path / "ray.log"
    proc = start(run_dir, log)
    try:
        deadline = time.monotonic() + 420  # starting Ray takes minutes on a busy machine
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
    assert max(saved) < 256, saved  # stopped mid-run, not at its end

    proc = start(run_dir, tmp_path / "again.log")
    assert proc.wait(timeout=480) == 0, (tmp_path / "again.log").read_text()[-4000:]
    _, resumed = preempted_and_resumed_steps((tmp_path / "again.log").read_text())
    assert resumed == [max(saved)]
    assert_same_as(run_dir, reference)


@pytest.mark.slow
@pytest.mark.extended  # CI runs fsdp under torchrun, launch_multinode.sh (hybrid) and Slurm
def test_fsdp_under_ray_trains_as_under_torchrun(tmp_path: Path) -> None:
    """dist.strategy=fsdp through ray_train.py, sharded checkpoints written asynchronously by
    each rank's writer process: the run ends torch.equal to the same job under torchrun, with
    complete sharded checkpoints."""
    job = [a for a in JOB if not a.startswith("--train.epochs")]
    job += ["--train.epochs=1", "--dist.strategy=fsdp", "--ckpt.async_save=true"]
    torchrun = tmp_path / "torchrun"
    result = launch(2, f"--run.dir={torchrun}", *job)
    assert result.returncode == 0, result.output[-3000:]
    run_dir = tmp_path / "ray"
    proc = subprocess.run(
        ray_command(f"--run.dir={run_dir}", *job),
        cwd=REPO,
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert_same_training_state(final_state(run_dir), final_state(torchrun))
    folders = sorted((run_dir / "checkpoints").glob("step_*.manifest.json"))
    assert folders and all(p.with_name(p.name.split(".")[0]).is_dir() for p in folders)


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
        timeout=480,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert str(missing) in output and "finished with exit 2" in output
    # One attempt: each rank started once, and Ray's failure policy never ran.
    assert len(set(re.findall(r"ray_train.py: attempt \S+ rank \d/2: train.py", output))) == 2
    assert "[FailurePolicy]" not in output


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in children(todo.pop()):
            found.add(child)
            todo.append(child)
    return found


def wait_for_first_checkpoint(run_dir: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 420  # starting Ray's actors takes minutes on a busy machine
    while not (
        list((run_dir / "checkpoints").glob("step_*.manifest.json"))
        and train_processes(0)
        and train_processes(1)
    ):
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-4000:]
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# Requests the cluster cannot hold


@pytest.mark.slow
@pytest.mark.parametrize("request_", ["cpus", pytest.param("gpus", marks=pytest.mark.extended)])
def test_a_local_request_beyond_this_machine_exits_2_naming_the_shortfall(
    tmp_path: Path, request_: str
) -> None:
    """More ranks than cores, or a GPU each where torch.cuda.device_count() has none: exit 2
    naming the option and what the machine has, before any cluster starts. Before, the local
    cluster was sized to the request (CPUs: ranks time-sliced on too few cores) or the worker
    group waited for a GPU that never comes, retried every 60 s forever."""
    cores = len(os.sched_getaffinity(0))
    if request_ == "cpus":
        own, named = (f"--workers={cores + 1}",), [f"--workers={cores + 1}", f"{cores} cores"]
    else:
        if torch.cuda.device_count() >= 2:
            pytest.skip("this machine has the GPUs")
        own, named = ("--gpus-per-worker=1",), ["--gpus-per-worker=1", "device_count() is"]
    result = subprocess.run(
        ray_command(f"--run.dir={tmp_path / 'run'}", *JOB, own=own),
        cwd=REPO,
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert all(text in result.stderr for text in named), result.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A Ray cluster without an autoscaler (ray.cluster_utils.Cluster: `ray start` processes on
    this machine): a head with no CPUs (the driver's node) and one node of 2 CPUs for the
    workers. Its processes read RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S from this environment (the
    drain watcher's poll, 5 s by default in ray/train/v2/_internal/constants.py): 1 s here."""
    from ray.cluster_utils import Cluster

    saved = os.environ.get("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S")
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "1"
    small = {"object_store_memory": 100 * 2**20}
    for attempt in range(3):
        ray_cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "include_dashboard": False, **small},
        )
        try:
            ray_cluster.add_node(num_cpus=2, **small)
            ray_cluster.wait_for_nodes()
            break
        except Exception:  # Ray gives a raylet 30 s to register (ray/_private/node.py): busy CI
            ray_cluster.shutdown()
            if attempt == 2:
                raise
    try:
        yield ray_cluster
    finally:
        ray_cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", None)
        else:
            os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = saved


@pytest.mark.slow
def test_more_workers_than_a_cluster_without_autoscaler_holds_exits_2(
    tmp_path: Path, cluster: Any
) -> None:
    """3 workers of 1 CPU on a node of 2 CPUs and a head of none: the nodes hold 2. Without
    an autoscaler nothing will come: exit 2 naming the request and what the nodes hold. Before,
    Ray Train's controller waited 60 s for the placement group, then tried again, forever
    (FailureConfig.controller_failure_limit -1:
    ray/train/v2/_internal/execution/failure_handling/default.py)."""
    result = subprocess.run(
        ray_command(
            f"--run.dir={tmp_path / 'run'}",
            *JOB,
            own=(f"--address={cluster.address}", "--workers=3"),
        ),
        cwd=REPO,
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert "--workers=3" in result.stderr and "hold 2" in result.stderr, result.stderr[-3000:]
    assert "no autoscaler" in result.stderr


# ---------------------------------------------------------------------------------------------
# Ray's own view of the run: checkpoints and metrics


@pytest.mark.slow
@pytest.mark.extended  # CI: the drain test checks a report (its preemption checkpoint's)
def test_every_checkpoint_is_reported_to_ray_with_its_metrics(
    tmp_path: Path, reference: Path
) -> None:
    """Each checkpoint train.py writes reaches Ray through ray.train.report (every worker calls
    it, rank 0 with the checkpoint: ray/train/v2/api/train_fn_utils.py, report): the Result's
    checkpoint holds the final step's file, bytes equal to the torchrun run's final state, and
    its metrics are that run's last evaluation."""
    run_dir = tmp_path / "ray"
    result = subprocess.run(
        ray_command(f"--run.dir={run_dir}", *JOB),
        cwd=REPO,
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    found = re.search(r"Ray's result: checkpoint (\S+), metrics (\{.*\})", output)
    assert found, output[-5000:]
    checkpoint, metrics = Path(found[1]), json.loads(found[2])
    last_eval = rows(reference, "eval")[-1]
    final = final_state(reference)["step"]
    assert metrics["step"] == final == last_eval["step"]
    assert metrics["eval/accuracy"] == last_eval["accuracy"]
    assert metrics["eval/loss"] == last_eval["loss"]
    assert checkpoint.is_relative_to(run_dir / "ray")
    state = torch.load(checkpoint / f"step_{final}.pt", weights_only=True)
    assert_same_training_state(state, final_state(reference))
    # Every checkpoint still on disk when the workers look (once a second) is reported; one
    # that train.py wrote and pruned (ckpt.keep=2) in between is not: under load a run of
    # {8, 16, ..., 64} (every 8 steps) reported {8, 16, 24, 32, 56, 64}. The newest two always
    # are.
    reported = {int(s) for s in re.findall(r"reported the checkpoint of step (\d+)", output)}
    assert {final - 32, final} <= reported, reported


# ---------------------------------------------------------------------------------------------
# Stops: node drains, the launcher's own signals, a killed driver


def raylet_of(pid: int, cluster: Any) -> Any:
    """The cluster node whose raylet is an ancestor of `pid`."""
    raylets = {
        node.all_processes["raylet"][0].process.pid: node for node in cluster.list_all_nodes()
    }
    while pid > 1:
        if pid in raylets:
            return raylets[pid]
        pid = parent_of(pid)
    raise AssertionError("not a process of this cluster")


@pytest.mark.slow
def test_a_node_drain_stops_the_ranks_at_once_and_spends_the_preemption_budget(
    tmp_path: Path, cluster: Any
) -> None:
    """A real drain (GcsClient.drain_node with DRAIN_NODE_REASON_PREEMPTION and a deadline, as
    the autoscaler does for a spot reclaim: ray/autoscaler/v2/instance_manager/subscribers/
    ray_stopper.py) of the node holding the ranks: Ray Train's PreemptionWatcher marks the
    workers, they stop train.py at once (a checkpoint at the step of the notice, long before
    the deadline, reported to Ray), and Ray charges the attempt to its preemption budget
    (PreemptionError), not to --max-failures: with --max-preemptions=0 the launcher ends with
    75 though 3 failures were still allowed. Before, the notice was not passed on: the ranks
    trained on until Ray tore them down at the deadline (here they finish first)."""
    import ray._raylet
    from ray.core.generated import autoscaler_pb2

    run_dir, log = tmp_path / "ray", tmp_path / "ray.log"
    deadline_s = 45
    command = ray_command(
        f"--run.dir={run_dir}",
        *JOB,
        "--train.epochs=12",  # 768 steps, half a minute or more: the notice comes mid-run
        max_failures=3,
        own=(f"--address={cluster.address}", "--max-preemptions=0"),
    )
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, env=ray_env(), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_for_first_checkpoint(run_dir, proc, log)
        node = raylet_of(train_processes(0)[0], cluster)
        steps_at_drain = [r["step"] for r in rows(run_dir, "train")]
        accepted, why = ray._raylet.GcsClient(address=cluster.address).drain_node(
            node.node_id,
            autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "test: spot reclaim",
            int((time.time() + deadline_s) * 1000),
        )
        assert accepted, why
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text()
    assert code == 75, output[-5000:]
    assert "interrupted by node preemption" in output, output[-5000:]
    preempted, _ = preempted_and_resumed_steps(output)
    assert len(set(preempted)) == 1, output[-5000:]
    # The stop came with the notice, not with Ray's teardown at the deadline: within a third of
    # the deadline of training time (train rows' time_s) after the newest train row at the
    # drain. The notice takes up to Ray Train's poll interval to arrive (PreemptionWatcher,
    # RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S: 5 s), then up to FOLLOW_EVERY_S to pass on.
    elapsed = {r["step"]: r["time_s"] for r in rows(run_dir, "train")}
    at_drain = max(steps_at_drain, default=min(elapsed))
    assert preempted[0] < 768, output[-5000:]
    stopped = max(step for step in elapsed if step <= preempted[0])  # rows every 4 steps
    assert elapsed[stopped] - elapsed[at_drain] < deadline_s / 3, (at_drain, preempted, elapsed)
    assert (run_dir / "checkpoints" / f"step_{preempted[0]}.pt").exists()
    assert f"reported the checkpoint of step {preempted[0]} to Ray" in output
    assert not launch_processes()


@pytest.mark.slow
def test_the_shim_arms_its_own_parent_death_signal(tmp_path: Path) -> None:
    """The Ray worker is threaded, so it starts the shim without `preexec_fn` (subprocess's
    documentation: not safe in the presence of threads); the shim sets PR_SET_PDEATHSIG on
    itself. A plain parent that starts the shim and is SIGKILLed: the shim dies with it and
    the command under the shim gets the stop signal (it writes it down). Before, only the
    parent's preexec_fn armed the shim: without it, the shim outlived its parent."""
    spec = importlib.util.spec_from_file_location("ray_train", REPO / "scripts" / "ray_train.py")
    assert spec is not None and spec.loader is not None
    ray_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ray_train)
    assert "preexec_fn" not in inspect.getsource(ray_train.worker_loop)
    got = tmp_path / "got"
    child = (
        "import signal, sys, time, pathlib\n"
        f"out = pathlib.Path({str(got)!r})\n"
        "signal.signal(signal.SIGTERM, lambda s, f: (out.write_text('SIGTERM'), sys.exit(0)))\n"
        "out.with_name('ready').write_text('')\n"
        "time.sleep(120)\n"
    )
    parent = (
        "import os, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, 'scripts/ray_train.py', '_shim', str(os.getpid()),"
        f" 'SIGTERM', sys.executable, '-c', {child!r}])\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=REPO)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        started = descendants(proc.pid)
        assert len(started) == 2  # the shim and its command
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while any(map(alive, started)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(alive, started))
        assert got.read_text() == "SIGTERM"
    finally:
        for pid in {proc.pid, *started}:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.extended
def test_after_a_sigkill_of_the_driver_nothing_it_started_keeps_running(tmp_path: Path) -> None:
    """SIGKILL to ray_train.py alone mid-run (a local cluster): the Ray processes it started
    share its fate (ray._private.services: fate_share, PR_SET_PDEATHSIG), the Ray workers go
    with their raylet, the shims with their workers, and train.py, told by its shim's death,
    checkpoints and exits: within a bound nothing of the launch is left."""
    run_dir, log = tmp_path / "ray", tmp_path / "ray.log"
    proc = start(run_dir, log)
    started: set[int] = set()
    try:
        wait_for_first_checkpoint(run_dir, proc, log)
        started = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 420  # train.py checkpoints first: slow when busy
        while (any(map(alive, started)) or launch_processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {
            pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in started if alive(pid)
        }
        assert not left and not launch_processes(), (left, log.read_text()[-3000:])
    finally:
        for pid in {*started, *launch_processes()}:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.extended
def test_a_stop_whose_ranks_left_no_checkpoint_does_not_exit_75(tmp_path: Path) -> None:
    """The ranks SIGKILLed (the OOM killer, a failed save) as SIGTERM reaches ray_train.py: no
    rank reported a checkpoint (train.py's TRAIN_PREEMPT_MARKER), so the launcher does not say
    75 "preempted, resume": it exits 128 + SIGTERM, with nothing left running. Before, it
    waited out rank 0's stale lease and exited 75. The kill comes first: once the stop reaches
    them, the ranks checkpoint within half a second (their own process group keeps them out of
    Ray's kill of the worker's group)."""
    run_dir, log = tmp_path / "ray", tmp_path / "ray.log"
    proc = start(run_dir, log)
    try:
        wait_for_first_checkpoint(run_dir, proc, log)
        for pid in train_processes(0) + train_processes(1):
            os.kill(pid, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    assert code == 128 + signal.SIGTERM, output[-5000:]
    assert "stopped (SIGTERM): exit 143" in output
    assert not launch_processes()
