"""Run the same training through Ray Train, on a Ray cluster (KubeRay, Anyscale, `ray start`).

    python ray_train.py --workers 4 --gpus-per-worker 1 -- --config configs/fashion_mnist.toml
    python ray_train.py --address local --workers 2 -- --run.dir=runs/ray --train.epochs=2

Everything after `--` is train.py's command line, unchanged. Needs the `ray` dependency group
(`uv sync --frozen --group ray`).

How it works: `ray.train.torch.TorchTrainer` places the workers (ScalingConfig) and restarts
them after a failure (FailureConfig). Each Ray worker runs train.py as a child process with the
environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT: rank 0's node and a free port there, agreed over Ray's own gloo group). So a Ray
worker runs exactly the pipeline of a torchrun rank: its process group, its signal handling,
its checkpoints in the run dir. What that gives:

- Exact resume. After a worker dies, Ray starts a new worker group and train.py resumes from
  the newest checkpoint in the run dir, as after a torchrun restart. Ray's own state goes to
  `<run.dir>/ray`; Ray's checkpoint mechanism is not used.
- Preemption. A stop signal that reaches train.py (a pod being deleted, `ray stop`) makes every
  rank stop at the same step and checkpoint (exit 75). If its Ray worker dies first, the child
  gets SIGTERM (PR_SET_PDEATHSIG) and does the same. A new attempt waits until the previous
  attempt's processes on its node have exited, so that two attempts never write the run dir at
  once.
- Exit codes. This launcher exits as train.py does: 0 done; 2 bad input, 3 diverged and 76 no
  progress end the job at once (retrying cannot help); a preemption (75) or a crash is retried
  while `--max-failures` allows (each retry spends one), then 75 or 1.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75
EXIT_NO_PROGRESS = 76
# train.py's exits that a retry cannot change: the worker group reports them instead of failing.
FINAL_EXITS = (0, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_NO_PROGRESS)
RUN_ENV = "DDP_RAY_RUN"  # names this launch's train.py processes (in their environment)
PR_SET_PDEATHSIG = 1
WAIT_FOR_PREVIOUS_S = 150.0  # a previous attempt's checkpoint: supervise.py's grace, and more


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
    parser.add_argument("--gpus-per-worker", type=float, default=0, help="0: CPU only")
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument(
        "--max-failures",
        type=int,
        default=3,
        help="worker-group restarts (a preemption spends one too); -1: no limit, "
        "train.py's crash-loop breaker (exit 76) still stops the job",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="the Ray cluster (ray.init's address): 'auto', 'ray://host:10001', or 'local' "
        "to start one on this machine; default: RAY_ADDRESS, else a local one",
    )
    args = parser.parse_args(own)
    for name in ("workers", "cpus_per_worker"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    if args.gpus_per_worker < 0:
        parser.error(f"--gpus-per-worker={args.gpus_per_worker} must not be negative")
    if args.max_failures < -1:
        parser.error(f"--max-failures={args.max_failures}: use -1 (no limit) or a count")
    return args, train_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child: SIGTERM when the Ray worker that started it dies (it then checkpoints)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def previous_attempt_pids(run_id: str) -> list[int]:
    """This node's train.py processes of this launch (earlier attempts: run before ours)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            environ = (entry / "environ").read_bytes().split(b"\0")
            if f"{RUN_ENV}={run_id}".encode() in environ:
                found.append(int(entry.name))
    return found


def wait_for_previous_attempt(run_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while pids := previous_attempt_pids(run_id):
        if time.monotonic() > deadline:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.2)


def worker_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: train.py as a torchrun-style rank, its exit reported."""
    import ray.train
    import torch.distributed as dist

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    # Rank 0's node hosts the rendezvous, on a port free there; Ray's group tells the others.
    address = [None]
    if rank == 0:
        address = [(ray.util.get_node_ip_address(), free_port())]
    dist.broadcast_object_list(address, src=0)
    master_addr, master_port = address[0]

    run_id = config["run_id"]
    wait_for_previous_attempt(run_id, WAIT_FOR_PREVIOUS_S)
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
        RUN_ENV: run_id,
    }
    print(f"ray_train.py: rank {rank} of {world_size}: starting train.py", flush=True)
    child = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *config["train_args"]],
        cwd=REPO,
        env=env,
        preexec_fn=die_with_parent,
    )
    code = child.wait()
    if code not in FINAL_EXITS:
        # Ray restarts the whole worker group (while max_failures allows); train.py resumes.
        raise RuntimeError(f"train.py (rank {rank}) exited with {describe(code)}")
    if rank == 0:  # Ray Train returns metrics only with checkpoints: the exit goes in a file
        Path(config["exit_file"]).write_text(f"{code}\n")


def describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit {code}"


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(REPO))
    from config import ConfigError, parse_args

    try:
        run_dir = Path(parse_args(train_args).run.dir).resolve()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        print(
            "error: Ray is not installed: uv sync --frozen --group ray (the ray dependency group)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT

    # Ray's own warnings only from errors up: without the dashboard (not in the ray group) its
    # state API is missing, and a helper actor of Ray Train warns about that every second.
    # train.py's log is its own (a child process) and unaffected.
    init: dict[str, Any] = {
        "include_dashboard": False,
        "logging_config": ray.LoggingConfig(log_level="ERROR"),
    }
    if args.address == "local" or (args.address is None and not os.environ.get("RAY_ADDRESS")):
        init.update(address="local", num_cpus=int(args.workers * args.cpus_per_worker + 0.999))
        if args.gpus_per_worker:
            init["num_gpus"] = int(args.workers * args.gpus_per_worker + 0.999)
    elif args.address:
        init["address"] = args.address
    # Workers run train.py from this checkout: on a cluster, the same path on every node
    # (a shared filesystem or the image), as for torchrun.
    ray.init(**init)
    run_id = uuid.uuid4().hex[:12]
    exit_file = run_dir / "ray" / f"exit-{run_id}"
    exit_file.parent.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        worker_loop,
        train_loop_config={"run_id": run_id, "train_args": train_args, "exit_file": str(exit_file)},
        # A gloo group only to agree on the rendezvous address; train.py makes its own.
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(
            num_workers=args.workers,
            use_gpu=args.gpus_per_worker > 0,
            resources_per_worker={
                "CPU": args.cpus_per_worker,
                **({"GPU": args.gpus_per_worker} if args.gpus_per_worker else {}),
            },
        ),
        run_config=RunConfig(
            name="ray",
            storage_path=str(run_dir),
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    try:
        result = trainer.fit()
    except Exception as err:  # the worker group failed more often than --max-failures
        print(f"ray_train.py: training failed: {err}", file=sys.stderr)
        preempted = "exit 75" in str(err)
        return EXIT_PREEMPTED if preempted else 1
    finally:
        ray.shutdown()
    try:
        code = int(exit_file.read_text())
    except (OSError, ValueError):
        print(f"ray_train.py: no exit code from rank 0 in {exit_file}: {result}", file=sys.stderr)
        return 1
    print(f"ray_train.py: train.py finished with exit {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
