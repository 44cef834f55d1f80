r"""Run the same training through Ray Train, on a Ray cluster (KubeRay, Anyscale, `ray start`).

    python scripts/ray_train.py --workers 4 --gpus-per-worker 1 -- \
        --config configs/fashion_mnist.toml
    python scripts/ray_train.py --address local --workers 2 -- --run.dir=runs/ray --train.epochs=2

Everything after `--` is train.py's command line, unchanged. Needs the `ray` dependency group
(`uv sync --frozen --group ray`).

`ray.train.torch.TorchTrainer` places the workers and restarts them after a failure. Each Ray
worker runs train.py (under a small shim process, `_shim` below) with the environment torchrun
would give it, so it runs exactly the pipeline of a torchrun rank: its process group, its signal
handling, its checkpoints in the run dir. Each checkpoint train.py writes is reported to Ray
(`ray.train.report`); a node drain reaches train.py as its stop signal. This launcher exits as
train.py does (exitcodes.py). How it places, resumes, preempts and exits: docs/running.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's flat modules
from exitcodes import (  # noqa: E402
    EXIT_BAD_INPUT,
    EXIT_PREEMPTED,
    EXIT_RENDEZVOUS,
    FINAL_EXITS,
    LAUNCHER_STOP_SIGNALS,
    PREEMPT_MARKER,
)
from runpaths import LEASE_GLOB, RunPaths  # noqa: E402

REPO = Path(__file__).resolve().parents[1]  # train.py and the modules it imports
RUN_ENV = "DDP_RAY_RUN"  # names this launch's processes (in their environment)
ATTEMPT_ENV = "DDP_RAY_ATTEMPT"  # and the attempt (worker group) they belong to
PR_SET_PDEATHSIG = 1
WAIT_FOR_PREVIOUS_S = 150.0  # a previous attempt's checkpoint: supervise.py's grace, and more
FOLLOW_EVERY_S = 1.0  # how often the workers look for new checkpoints and drain notices
# Starting a worker group that does not fit: Ray Train's controller gives up after
# RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s by default, ray/train/v2/_internal/constants.py)
# and, with FailureConfig.controller_failure_limit at its default -1, tries again forever. An
# autoscaler gets this many tries to deliver the nodes.
START_ATTEMPTS = 5


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This launcher's options, and train.py's command line (after `--`)."""
    if "--" in argv:
        split = argv.index("--")
        own, train_args = argv[:split], argv[split + 1 :]
    else:
        own, train_args = argv, []
    parser = argparse.ArgumentParser(
        prog="ray_train.py",
        description="Run train.py on a Ray cluster through ray.train.torch.TorchTrainer. "
        "Arguments after -- go to train.py.",
    )
    parser.add_argument("--workers", type=int, default=2, help="ranks (Ray Train workers)")
    parser.add_argument(
        "--gpus-per-worker", type=int, choices=(0, 1), default=0, help="0: CPU only; 1: a GPU each"
    )
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument(
        "--max-failures",
        type=int,
        default=3,
        help="worker-group restarts after a crash; -1: no limit, train.py's crash-loop "
        "breaker (exit 76) still stops the job",
    )
    parser.add_argument(
        "--max-preemptions",
        type=int,
        default=10,
        help="worker-group restarts after a node drain (Ray's "
        "FailureConfig.max_preemption_failures; they do not spend --max-failures); -1: no limit",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="the Ray cluster (ray.init's address): 'auto', 'ray://host:10001', or 'local' "
        "to start one on this machine; default: RAY_ADDRESS, else a local one",
    )
    parser.add_argument(
        "--force-oversubscribe",
        action="store_true",
        help="with a local cluster: run more CPU workers than this machine has cores",
    )
    args = parser.parse_args(own)
    for name in ("workers", "cpus_per_worker"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    for name in ("max_failures", "max_preemptions"):
        if getattr(args, name) < -1:
            parser.error(
                f"--{name.replace('_', '-')}={getattr(args, name)}: use -1 (no limit) or a count"
            )
    return args, train_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Does the request fit the cluster?


def worker_resources(args: argparse.Namespace) -> dict[str, float]:
    """What one Ray Train worker asks for (ScalingConfig.resources_per_worker)."""
    return {
        "CPU": args.cpus_per_worker,
        **({"GPU": float(args.gpus_per_worker)} if args.gpus_per_worker else {}),
    }


def local_shortfall(args: argparse.Namespace) -> str:
    """Why a cluster on this machine cannot hold the request ('' when it can)."""
    need = worker_resources(args)
    cores = len(os.sched_getaffinity(0))
    cpus = args.workers * need["CPU"]
    if cpus > cores and not args.force_oversubscribe:
        return (
            f"--workers={args.workers} x --cpus-per-worker={args.cpus_per_worker:g} needs "
            f"{cpus:g} CPUs and this machine has {cores} cores; use fewer workers, or "
            "--force-oversubscribe to run them anyway"
        )
    if need.get("GPU"):
        import torch  # only here: a CPU launch does not pay for the import

        gpus = torch.cuda.device_count()
        if args.workers * need["GPU"] > gpus:
            # Not forceable: Ray would hand out GPU ids that do not exist.
            return (
                f"--workers={args.workers} x --gpus-per-worker={args.gpus_per_worker} needs "
                f"{args.workers * need['GPU']:g} GPUs and torch.cuda.device_count() is {gpus} "
                "on this machine"
            )
    return ""


def has_autoscaler() -> bool:
    """Whether the connected cluster can add nodes.

    Autoscaler v2 publishes its cluster config in the GCS
    (`ray._private.state.GlobalState.get_cluster_config`; None without one: checked on a
    `ray.init()` cluster). Autoscaler v1's monitor runs on every head node and, without an
    autoscaling config, reports through a read-only provider whose node types are named
    `node_<node id>` (ray/autoscaler/_private/monitor.py, `format_readonly_node_type`): any
    other node type in its status (the GCS key `__autoscaling_status`) is a configured one.
    """
    import ray._private.state
    from ray._private import ray_constants
    from ray.experimental import internal_kv

    if ray._private.state.state.get_cluster_config() is not None:
        return True
    raw = internal_kv._internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    if not raw:
        return False
    report = json.loads(raw).get("autoscaler_report") or {}
    types = (report.get("node_type_mapping") or {}).items()
    return any(name != f"node_{node}" for node, name in types)


def cluster_shortfall(args: argparse.Namespace) -> str:
    """Why the live nodes of a cluster without an autoscaler cannot place every worker ('' when
    they can). A worker's bundle must fit on one node (Ray Train's placement group, PACK), so
    the count is per node; draining nodes take no new work."""
    import ray._private.state

    need = worker_resources(args)
    draining = ray._private.state.state.get_draining_nodes()
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in draining]
    fits = sum(min(math.floor(n.get(k, 0) / v) for k, v in need.items()) for n in nodes)
    if fits >= args.workers:
        return ""
    have = {k: sum(n.get(k, 0) for n in nodes) for k in need}
    asked = ", ".join(f"{k} {v:g}" for k, v in need.items())
    return (
        f"--workers={args.workers} of {{{asked}}} each: the cluster's {len(nodes)} node(s) "
        f"(CPU {have['CPU']:g}" + (f", GPU {have['GPU']:g}" if "GPU" in have else "") + ") "
        f"hold {fits}, and it has no autoscaler to add more; ask for fewer or smaller workers"
    )


# ---------------------------------------------------------------------------------------------
# The processes on each node: Ray worker -> shim -> train.py


def arm_parent_death_signal(sig: int, parent: int) -> None:
    """`sig` to this process when the thread that started it dies (PR_SET_PDEATHSIG, prctl(2));
    at once when `parent` is already gone."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # it died before prctl took effect
        os.kill(os.getpid(), sig)


def shim(argv: list[str]) -> int:
    """`ray_train.py _shim PARENT SIGNAL COMMAND...`: run COMMAND (train.py) one process away
    from the Ray worker PARENT. Ray SIGKILLs a worker's own children when it stops one (a
    failed peer, an abort, `ray stop`); this process takes that SIGKILL, and train.py, which
    gets SIGNAL when this process dies, stops at the next step with a checkpoint instead of
    dying mid-step. A stop signal sent to this process reaches train.py as SIGNAL too.

    The Ray worker is threaded, so its child may not run Python between fork and exec
    (`preexec_fn`, "not safe in the presence of threads": subprocess's documentation): this
    process arms its own parent-death signal instead, first thing. It has no threads, so its
    own `preexec_fn` for train.py is safe."""
    parent, sig, command = int(argv[0]), signal.Signals[argv[1]], argv[2:]
    arm_parent_death_signal(signal.SIGKILL, parent)
    child: subprocess.Popen | None = None

    def forward(signum: int, _: Any) -> None:  # a stop signal sent to this process only
        if child is not None:
            with contextlib.suppress(OSError):
                child.send_signal(sig)

    for stop in LAUNCHER_STOP_SIGNALS:
        signal.signal(stop, forward)
    me = os.getpid()
    # A process group of its own: Ray (2.60: RAY_process_group_cleanup_enabled, on; raylet.out
    # says "Per-worker process group cleanup is ENABLED") SIGKILLs a stopped worker's whole
    # process group, which took train.py with the shim before it could checkpoint (SIGTERM to
    # ray_train.py exited 143 with the lease stale). train.py gets `sig` from the shim's death.
    child = subprocess.Popen(
        command, preexec_fn=lambda: arm_parent_death_signal(sig, me), process_group=0
    )
    code = child.wait()
    return 128 - code if code < 0 else code


def stop_signal(names: tuple[str, ...]) -> str:
    """The signal that makes train.py checkpoint and stop: SIGTERM, or another of
    run.preempt_signals when that leaves SIGTERM out."""
    return "SIGTERM" if "SIGTERM" in names or not names else names[0]


def launch_pids(run_id: str, except_attempt: str = "") -> list[int]:
    """This node's processes (shims, train.py) of this launch, except those of one attempt."""
    found = []
    mine, skip = f"{RUN_ENV}={run_id}".encode(), f"{ATTEMPT_ENV}={except_attempt}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            environ = (entry / "environ").read_bytes().split(b"\0")
            if mine in environ and not (except_attempt and skip in environ):
                found.append(int(entry.name))
    return found


def wait_for_exit(run_id: str, timeout_s: float, except_attempt: str = "") -> None:
    """Until this node's processes of earlier attempts have exited (a checkpoint they write
    must land before a new attempt looks for one); SIGKILL after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while pids := launch_pids(run_id, except_attempt):
        if time.monotonic() > deadline:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.2)


class TrainExit(RuntimeError):
    """train.py ended with an exit that a new attempt may change (Ray retries the group)."""


def complete_checkpoints(directory: Path) -> dict[int, Path]:
    """step -> file (or sharded checkpoint's folder) of each complete checkpoint: its manifest
    is written last (ckpt/storage.py)."""
    found = {}
    for manifest in directory.glob("step_*.manifest.json"):
        step = manifest.name.split("_", 1)[1].split(".", 1)[0]
        for path in (directory / f"step_{step}.pt", directory / f"step_{step}"):
            if step.isdigit() and path.exists():
                found[int(step)] = path
    return found


def metrics_at(run_dir: Path, step: int) -> dict[str, Any]:
    """The newest metrics.jsonl row of each kind up to `step`, flattened ("eval/accuracy")."""
    newest: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(OSError):
        for line in RunPaths(run_dir).metrics.read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                row = json.loads(line)
                if row.get("step", step + 1) <= step:
                    newest[row["kind"]] = row
    flat: dict[str, Any] = {"step": step}
    for kind, row in newest.items():
        for key, value in row.items():
            if isinstance(value, (int, float)) and key != "step":
                flat[f"{kind}/{key}"] = value
    return flat


def _link_or_copy(source: Path, target: Path) -> None:
    """Hard-link `source` to `target` (a copy across filesystems); FileNotFoundError if gone."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except FileNotFoundError:
        raise
    except OSError:  # another filesystem
        shutil.copy2(source, target)


def report_checkpoint(run_dir: Path, step: int, path: Path | None) -> None:
    """Collective (every worker, the same number of times: ray.train.report's contract,
    ray/train/v2/api/train_fn_utils.py): rank 0 hands Ray the checkpoint of `step` (the file
    and its manifest, hard-linked into a directory Ray copies into its storage)."""
    import ray.train

    metrics = metrics_at(run_dir, step)
    if path is None:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="ray-ckpt-") as staging:
        manifest = path.with_name(f"step_{step}.manifest.json")
        try:
            # A sharded checkpoint is a folder: its files go into a folder of the same name.
            inside = [Path(path.name) / f.name for f in path.iterdir()] if path.is_dir() else []
            for name in [*inside] or [Path(path.name)]:
                _link_or_copy(path.parent / name, Path(staging) / name)
            _link_or_copy(manifest, Path(staging) / manifest.name)
        except FileNotFoundError:  # pruned meanwhile by train.py: report the metrics only
            ray.train.report(metrics, checkpoint=None)
            return
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(staging))
    print(f"ray_train.py: reported the checkpoint of step {step} to Ray", flush=True)


def follow(child: subprocess.Popen, run_dir: Path, rank: int) -> Any:
    """Collective, until every rank's train.py has exited: report each new checkpoint to Ray,
    and pass a drain notice on to train.py as the stop signal. Returns the notice (Ray's
    PreemptionInfo), or None.

    Drains reach the workers through Ray Train's PreemptionWatcher (it polls the GCS's draining
    nodes every RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S, 5 s by default, and marks every worker:
    ray/train/v2/_internal/execution/preemption.py); `ray.train.get_preemption_info` returns
    it, and is a collective too: every worker calls both in step, once a round."""
    import ray.train
    import torch
    import torch.distributed as dist

    checkpoints = RunPaths(run_dir).checkpoints
    reported = set(complete_checkpoints(checkpoints)) if rank == 0 else set()
    notice = None

    def pass_on_a_drain() -> None:
        """Collective. Looked at before each report too: Ray copies each checkpoint into its
        storage, a second or more on a busy node, and a notice must not wait for that."""
        nonlocal notice
        info = ray.train.get_preemption_info()
        if info is not None and notice is None:
            notice = info
            print(f"ray_train.py: rank {rank}: node drain {info}: stopping train.py", flush=True)
            with contextlib.suppress(OSError):
                child.send_signal(signal.SIGTERM)  # the shim passes it on as the stop signal

    while True:
        running = torch.tensor([float(child.poll() is None)])
        dist.all_reduce(running)  # read before the scan below: it then sees the last save
        new = [None]
        if rank == 0:
            found = complete_checkpoints(checkpoints)
            new = [sorted(set(found) - reported)]
            reported |= set(found)
        dist.broadcast_object_list(new, src=0)
        for step in new[0]:
            pass_on_a_drain()
            path = found[step] if rank == 0 else None
            report_checkpoint(run_dir, step, path)
        pass_on_a_drain()
        if running.item() == 0:
            return notice
        time.sleep(FOLLOW_EVERY_S)


def worker_loop(config: dict[str, Any]) -> int:
    """One Ray Train worker: train.py as a torchrun-style rank; returns its final exit."""
    import ray.train
    import torch.distributed as dist

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    run_id, run_dir = config["run_id"], Path(config["run_dir"])
    # An id for this attempt (Ray's group carries rank 0's to the others), so that the wait
    # below skips this attempt's own processes on this node.
    attempt = [uuid.uuid4().hex[:8] if rank == 0 else None]
    dist.broadcast_object_list(attempt, src=0)
    wait_for_exit(run_id, WAIT_FOR_PREVIOUS_S, except_attempt=attempt[0])
    dist.barrier()
    # Rank 0's node hosts the rendezvous, on a port free there now.
    address = [(ray.util.get_node_ip_address(), free_port()) if rank == 0 else None]
    dist.broadcast_object_list(address, src=0)
    master_addr, master_port = address[0]
    marker = RunPaths(run_dir).ray_markers / f"{run_id}-{attempt[0]}-node{context.get_node_rank()}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()  # empty: not preempted (yet); its time orders the attempts
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(context.get_local_rank()),
        "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
        "GROUP_RANK": str(context.get_node_rank()),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        # The run dir's lease names the job: a new attempt of this launch takes it over.
        "TORCHELASTIC_RUN_ID": f"ray-{run_id}",
        # Local rank 0 writes "checkpoint of step N ..." there after a preemption checkpoint.
        PREEMPT_MARKER: str(marker),
        RUN_ENV: run_id,
        ATTEMPT_ENV: attempt[0],
    }
    print(f"ray_train.py: attempt {attempt[0]} rank {rank}/{world_size}: train.py", flush=True)
    train = [sys.executable, str(REPO / "train.py"), *config["train_args"]]
    child = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "ray_train.py"), "_shim", str(os.getpid())]
        + [config["stop_signal"], *train],
        cwd=config["cwd"],
        env=env,
    )
    drain = follow(child, run_dir, rank)
    code = child.wait()
    if code in FINAL_EXITS:
        return code
    if drain is not None and code == EXIT_PREEMPTED:
        wait_for_teardown(drain, rank)
    # Ray restarts the whole worker group (while max_failures allows); train.py resumes.
    raise TrainExit(f"train.py (rank {rank}) exited with {describe(code)}")


def wait_for_teardown(drain: Any, rank: int) -> None:
    """After the drain's checkpoint: until Ray takes the worker group down.

    Ray Train charges a drain to max_preemption_failures only while its workers are still
    running when the drain's deadline passes (or when the node dies under them): a worker that
    failed or returned meanwhile is a failure, or the end of the run
    (ray/train/v2/_internal/execution/controller/controller.py,
    TrainController._handle_preempting_state). A drain without a deadline ends after
    DEFAULT_PREEMPTION_DEADLINE_S (120 s) there; after a bound beyond that this worker fails.
    """
    print(f"ray_train.py: rank {rank}: checkpointed for the node drain, waiting for Ray")
    deadline_s = drain.deadline_ms / 1000 if drain.deadline_ms else time.time() + 120
    while time.time() < deadline_s + WAIT_FOR_PREVIOUS_S:
        time.sleep(1)


def describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit {code}"


# ---------------------------------------------------------------------------------------------
# The driver


def checkpointed(run_dir: Path, run_id: str) -> bool:
    """Whether every node of this launch's newest attempt reported its preemption checkpoint
    (train.py's marker, written by local rank 0 after the checkpoint)."""
    found = RunPaths(run_dir).ray_markers.glob(f"{run_id}-*")
    markers = sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)
    if not markers:
        return False
    newest = markers[0].name.rsplit("-node", 1)[0]
    texts = [p.read_text() for p in markers if p.name.rsplit("-node", 1)[0] == newest]
    return all(text.startswith("checkpoint") for text in texts)


def failed_exit(error: BaseException, run_dir: Path, run_id: str) -> int:
    """The launcher's exit once Ray gave up: 75 when the newest attempt's ranks had
    checkpointed for a stop (a drain, a signal), 69 when the worker group never started, else
    1."""
    from ray.train import ControllerError
    from ray.train.v2._internal.exceptions import (
        WorkerGroupStartupFailedError,
        WorkerGroupStartupTimeoutError,
    )

    start_errors = (WorkerGroupStartupFailedError, WorkerGroupStartupTimeoutError)
    if isinstance(error, ControllerError) and isinstance(error.controller_failure, start_errors):
        print(
            f"ray_train.py: the worker group did not start in {START_ATTEMPTS} tries: the "
            "cluster (its autoscaler) did not deliver the resources",
            file=sys.stderr,
        )
        return EXIT_RENDEZVOUS
    codes = re.findall(r"train\.py \(rank \d+\) exited with exit (\d+)", str(error))
    if codes and set(codes) != {str(EXIT_PREEMPTED)}:
        return 1
    return EXIT_PREEMPTED if checkpointed(run_dir, run_id) else 1


def rank0_here(run_id: str) -> bool:
    """Whether this launch's rank 0 (train.py or its shim) runs on this node."""
    for pid in launch_pids(run_id):
        with contextlib.suppress(OSError):
            if b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return True
    return False


def wait_for_ranks(run_dir: Path, run_id: str, timeout_s: float, rank0_local: bool) -> None:
    """After a stop: until this node's ranks have exited and, when rank 0 runs on another node,
    until it released the run dir (rank 0's lease goes after its checkpoint). A rank 0 of this
    node that is gone has checkpointed or never will: its stale lease is not waited for."""
    deadline = time.monotonic() + timeout_s
    wait_for_exit(run_id, timeout_s)
    while not rank0_local and any(run_dir.glob(LEASE_GLOB)) and time.monotonic() < deadline:
        time.sleep(0.2)


def connect(args: argparse.Namespace, ray: Any) -> str:
    """ray.init for this launch; '' or why the request cannot fit the cluster."""
    # Ray's own warnings only from errors up: without the dashboard (not in the ray group) its
    # state API is missing, and a helper actor of Ray Train warns about that every second.
    # train.py's log is its own (a child process) and unaffected.
    init: dict[str, Any] = {
        "include_dashboard": False,
        "logging_config": ray.LoggingConfig(log_level="ERROR"),
    }
    local = args.address == "local" or (args.address is None and not os.environ.get("RAY_ADDRESS"))
    if local:
        if shortfall := local_shortfall(args):
            return shortfall
        init.update(address="local", num_cpus=math.ceil(args.workers * args.cpus_per_worker))
    elif args.address:
        init["address"] = args.address
    # Workers run train.py from this checkout: on a cluster, the same path on every node
    # (a shared filesystem or the image), as for torchrun.
    for attempt in range(3 if local else 1):
        try:
            ray.init(**init)
            break
        except Exception as err:
            # A local node's raylet gets 30 s to register with its GCS (ray/_private/node.py,
            # Node.__init__): a busy machine misses that now and then.
            if attempt == 2 or "timed out during startup" not in str(err):
                raise
            print(f"ray_train.py: {err} Starting it again.", file=sys.stderr)
            ray.shutdown()
    return "" if has_autoscaler() else cluster_shortfall(args)


def make_trainer(args: argparse.Namespace, cfg: Any, train_args: list[str], run_id: str) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    run_dir = Path(cfg.run.dir).resolve()
    return TorchTrainer(
        worker_loop,
        train_loop_config={
            "run_id": run_id,
            "run_dir": str(run_dir),
            "train_args": train_args,
            "cwd": os.getcwd(),  # relative paths in train_args mean what they mean here
            "stop_signal": stop_signal(cfg.run.preempt_signals),
        },
        # A gloo group to agree on the rendezvous address and to follow the run; train.py
        # makes its own.
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(
            num_workers=args.workers,
            use_gpu=args.gpus_per_worker > 0,
            resources_per_worker=worker_resources(args),
        ),
        run_config=RunConfig(
            name="ray",
            storage_path=str(run_dir),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.ckpt.keep),
            failure_config=FailureConfig(
                max_failures=args.max_failures,
                max_preemption_failures=args.max_preemptions,
                controller_failure_limit=START_ATTEMPTS - 1,
            ),
        ),
    )


def print_result(result: Any) -> None:
    """What Ray recorded: its newest checkpoint and the metrics reported with it."""
    checkpoint = result.checkpoint.path if result.checkpoint else None
    print(
        f"ray_train.py: Ray's result: checkpoint {checkpoint}, metrics "
        f"{json.dumps(result.metrics, sort_keys=True)}",
        flush=True,
    )


def stopped_exit(run_dir: Path, run_id: str, stopped: str, rank0_local: bool) -> int:
    """The launcher's exit after Ctrl-C or SIGTERM (`stopped` names it)."""
    # The ranks were told to stop by their shims' deaths: wait for their checkpoint, and
    # say 75 only when they reported it (a rank killed meanwhile left none).
    wait_for_ranks(run_dir, run_id, WAIT_FOR_PREVIOUS_S, rank0_local)
    code = EXIT_PREEMPTED
    if not checkpointed(run_dir, run_id):
        code = 128 + (signal.SIGTERM if stopped == "SIGTERM" else signal.SIGINT)
    print(f"ray_train.py: stopped ({stopped}): exit {code}", file=sys.stderr)
    return code


def finished_exit(result: Any) -> int:
    """The launcher's exit once Ray's run ended: rank 0's train.py exit."""
    print_result(result)
    code = result.return_value
    if not isinstance(code, int):
        print(f"ray_train.py: no exit code from rank 0: {result}", file=sys.stderr)
        return 1
    print(f"ray_train.py: train.py finished with exit {code}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run train.py's command line on Ray; returns the launcher's exit code."""
    args, train_args = parse(sys.argv[1:] if argv is None else argv)
    # cli and config (and tyro) only here: the shim that each rank runs through this file
    # needs neither
    from cli import parse_args
    from config import ConfigError

    try:
        cfg = parse_args(train_args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        import ray
    except ImportError:
        print(
            "error: Ray is not installed: uv sync --frozen --group ray (the ray dependency group)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT

    run_dir, run_id = Path(cfg.run.dir).resolve(), uuid.uuid4().hex[:12]
    rank0_local, received = [False], [""]

    # SIGTERM as Ctrl-C: Ray's fit() then aborts the run (its workers stop, and so, through
    # their shims, do the ranks) and exits. Without this, Ray's own handler aborts the process.
    # Where rank 0 runs is noted now, while it runs: after the stop it may be gone.
    def interrupt(signum: int, _: Any) -> None:
        rank0_local[0] = rank0_here(run_id)
        received[0] = received[0] or signal.Signals(signum).name
        raise KeyboardInterrupt(received[0])

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, interrupt)
    stopped = ""
    try:
        if shortfall := connect(args, ray):
            print(f"error: {shortfall}", file=sys.stderr)
            return EXIT_BAD_INPUT
        for sig in (signal.SIGTERM, signal.SIGINT):  # again: ray.init may install its own
            signal.signal(sig, interrupt)
        result = make_trainer(args, cfg, train_args, run_id).fit()
    except (KeyboardInterrupt, SystemExit) as stop:
        # Ray's fit() raises a KeyboardInterrupt of its own after its abort.
        stopped = received[0] or f"{type(stop).__name__} {stop}"
        for sig in (signal.SIGTERM, signal.SIGINT):  # repeats: the same request
            signal.signal(sig, signal.SIG_IGN)
    except Exception as err:  # Ray gave up: more failures or preemptions than allowed
        print(f"ray_train.py: training failed: {err}", file=sys.stderr)
        return failed_exit(err, run_dir, run_id)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    if stopped:
        return stopped_exit(run_dir, run_id, stopped, rank0_local[0])
    return finished_exit(result)


if __name__ == "__main__":
    if sys.argv[1:2] == ["_shim"]:
        sys.exit(shim(sys.argv[2:]))
    sys.exit(main())
