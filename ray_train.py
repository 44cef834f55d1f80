"""Run the same training through Ray Train, on a Ray cluster (KubeRay, Anyscale, `ray start`).

    python ray_train.py --workers 4 --gpus-per-worker 1 -- --config configs/fashion_mnist.toml
    python ray_train.py --address local --workers 2 -- --run.dir=runs/ray --train.epochs=2

Everything after `--` is train.py's command line, unchanged. Needs the `ray` dependency group
(`uv sync --frozen --group ray`).

How it works: `ray.train.torch.TorchTrainer` places the workers (ScalingConfig) and restarts
them after a failure (FailureConfig). Each Ray worker runs train.py as a grandchild process with
the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT: rank 0's node and a port free there, agreed over Ray's own gloo
group). So a Ray worker runs exactly the pipeline of a torchrun rank: its process group, its
signal handling, its checkpoints in the run dir. What that gives:

- Exact resume. After a worker fails, Ray starts a new worker group and train.py resumes from
  the newest checkpoint in the run dir, as after a torchrun restart. Ray's own state goes to
  `<run.dir>/ray`; Ray's checkpoint mechanism is not used.
- Preemption. A stop signal that reaches train.py (a pod being deleted) makes every rank stop
  at the same step and checkpoint (exit 75). When Ray stops a worker instead (a failed peer,
  Ctrl-C or SIGTERM to this launcher, `ray stop`), it SIGKILLs the worker's children: train.py
  runs under a small shim process (`_shim` below) that takes that SIGKILL, and train.py gets
  the stop signal when the shim dies (PR_SET_PDEATHSIG). A new attempt starts once the previous
  attempt's processes on its node have exited, so that their checkpoint is there to resume
  from.
- Exit codes. This launcher exits as train.py does: 0 done; 2 bad input, 3 diverged and 76 no
  progress end the job at once (retrying cannot help); a preemption (75) or a crash is retried
  while `--max-failures` allows (each retry spends one), then 75 (every failed rank had
  checkpointed) or 1. Ctrl-C or SIGTERM to the launcher: 75, once the ranks have checkpointed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exitcodes import EXIT_BAD_INPUT, EXIT_PREEMPTED, FINAL_EXITS, LAUNCHER_STOP_SIGNALS

REPO = Path(__file__).resolve().parent
RUN_ENV = "DDP_RAY_RUN"  # names this launch's processes (in their environment)
ATTEMPT_ENV = "DDP_RAY_ATTEMPT"  # and the attempt (worker group) they belong to
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
    parser.add_argument(
        "--gpus-per-worker", type=int, choices=(0, 1), default=0, help="0: CPU only; 1: a GPU each"
    )
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
    if args.max_failures < -1:
        parser.error(f"--max-failures={args.max_failures}: use -1 (no limit) or a count")
    return args, train_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def signal_at_parent_death(sig: int, parent: int) -> Callable[[], None]:
    """A preexec_fn: `sig` to the child when `parent` (the process starting it) dies."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, before the fork

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # it died before prctl took effect
            os.kill(os.getpid(), sig)

    return arm


def shim(argv: list[str]) -> int:
    """`ray_train.py _shim SIGNAL COMMAND...`: run COMMAND (train.py) one process away from the
    Ray worker. Ray SIGKILLs a worker's own children when it stops one (a failed peer, an
    abort, `ray stop`); this process takes that SIGKILL, and train.py, which gets SIGNAL when
    this process dies, stops at the next step with a checkpoint instead of dying mid-step."""
    sig, command = signal.Signals[argv[0]], argv[1:]
    child: subprocess.Popen | None = None

    def forward(signum: int, _: Any) -> None:  # a stop signal sent to this process only
        if child is not None:
            with contextlib.suppress(OSError):
                child.send_signal(signum)

    for stop in LAUNCHER_STOP_SIGNALS:
        signal.signal(stop, forward)
    child = subprocess.Popen(command, preexec_fn=signal_at_parent_death(sig, os.getpid()))
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


def worker_loop(config: dict[str, Any]) -> int:
    """One Ray Train worker: train.py as a torchrun-style rank; returns its final exit."""
    import ray.train
    import torch.distributed as dist

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    run_id = config["run_id"]
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
        ATTEMPT_ENV: attempt[0],
    }
    print(f"ray_train.py: attempt {attempt[0]} rank {rank}/{world_size}: train.py", flush=True)
    train = [sys.executable, str(REPO / "train.py"), *config["train_args"]]
    child = subprocess.Popen(
        [sys.executable, str(REPO / "ray_train.py"), "_shim", config["stop_signal"], *train],
        cwd=config["cwd"],
        env=env,
        preexec_fn=signal_at_parent_death(signal.SIGKILL, os.getpid()),
    )
    code = child.wait()
    if code not in FINAL_EXITS:
        # Ray restarts the whole worker group (while max_failures allows); train.py resumes.
        raise TrainExit(f"train.py (rank {rank}) exited with {describe(code)}")
    return code


def describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit {code}"


def failed_exit(error: BaseException) -> int:
    """The launcher's exit once the retries are spent: 75 when every failed rank had
    checkpointed for a stop (preempted), else 1."""
    codes = re.findall(r"train\.py \(rank \d+\) exited with exit (\d+)", str(error))
    return EXIT_PREEMPTED if codes and set(codes) == {str(EXIT_PREEMPTED)} else 1


def wait_for_run_dir(run_dir: Path, run_id: str, timeout_s: float) -> None:
    """After a stop: until this node's ranks have exited and rank 0 released the run dir."""
    deadline = time.monotonic() + timeout_s
    wait_for_exit(run_id, timeout_s)
    while (run_dir / "lease.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(REPO))
    from config import ConfigError, parse_args

    try:
        cfg = parse_args(train_args)
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
    run_dir = Path(cfg.run.dir).resolve()
    init: dict[str, Any] = {
        "include_dashboard": False,
        "logging_config": ray.LoggingConfig(log_level="ERROR"),
    }
    if args.address == "local" or (args.address is None and not os.environ.get("RAY_ADDRESS")):
        init.update(address="local", num_cpus=math.ceil(args.workers * args.cpus_per_worker))
    elif args.address:
        init["address"] = args.address
    # Workers run train.py from this checkout: on a cluster, the same path on every node
    # (a shared filesystem or the image), as for torchrun.
    ray.init(**init)
    run_id = uuid.uuid4().hex[:12]
    trainer = TorchTrainer(
        worker_loop,
        train_loop_config={
            "run_id": run_id,
            "train_args": train_args,
            "cwd": os.getcwd(),  # relative paths in train_args mean what they mean here
            "stop_signal": stop_signal(cfg.run.preempt_signals),
        },
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

    # SIGTERM as Ctrl-C: Ray's fit() then aborts the run (its workers stop, and so, through
    # their shims, do the ranks) and exits. Without this, Ray's own handler aborts the process.
    def interrupt(signum: int, _: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    stopped = ""
    try:
        result = trainer.fit()
    except (KeyboardInterrupt, SystemExit) as stop:
        stopped = f"stopped ({type(stop).__name__} {stop})"
        for sig in (signal.SIGTERM, signal.SIGINT):  # repeats: the same request
            signal.signal(sig, signal.SIG_IGN)
    except Exception as err:  # the worker group failed more often than --max-failures
        print(f"ray_train.py: training failed: {err}", file=sys.stderr)
        ray.shutdown()
        return failed_exit(err)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    if stopped:
        # The ranks were told to stop by their shims' deaths: wait for their checkpoint.
        wait_for_run_dir(run_dir, run_id, WAIT_FOR_PREVIOUS_S)
        print(f"ray_train.py: {stopped}: exit {EXIT_PREEMPTED}", file=sys.stderr)
        return EXIT_PREEMPTED
    code = result.return_value
    if not isinstance(code, int):
        print(f"ray_train.py: no exit code from rank 0: {result}", file=sys.stderr)
        return 1
    print(f"ray_train.py: train.py finished with exit {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == ["_shim"]:
        sys.exit(shim(sys.argv[2:]))
    sys.exit(main())
