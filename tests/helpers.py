"""Test harness: ranks as spawned processes in a gloo group (through a file store) or as threads,
the training entry points as subprocesses, and readers of what a run leaves in its run dir."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distributed import DistInfo

REPO = Path(__file__).resolve().parents[1]


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, store: str, out: str, args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        info = DistInfo(
            rank=rank,
            local_rank=rank,
            world_size=world_size,
            device=torch.device("cpu"),
            backend="gloo",
        )
        torch.save(fn(info, *args), f"{out}.{rank}")
        # Every rank's result is on disk. Tearing the gloo group down has made a rank abort
        # ("terminate called without an active exception", SIGABRT) under CI load, even after a
        # barrier, which fails a test whose results were all in. So once every rank is here,
        # each leaves at once, without C++ teardown: the kernel closes its sockets.
        dist.barrier()
        os._exit(0)
    finally:  # fn failed: spawn reports this rank's exception
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path, *args: Any) -> list[Any]:
    """Run `fn(info, *args)` on `world_size` ranks; return each rank's result, rank order.

    World size 1 runs in this process without a process group, as `python train.py` does.
    """
    if world_size == 1:
        return [fn(DistInfo(0, 0, 1, torch.device("cpu")), *args)]
    tag = uuid.uuid4().hex
    store, out = str(tmp_path / f"store-{tag}"), str(tmp_path / f"result-{tag}")
    mp.start_processes(
        _entry, args=(fn, world_size, store, out, args), nprocs=world_size, start_method="spawn"
    )
    results = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world_size)]
    for rank in range(world_size):
        os.unlink(f"{out}.{rank}")
    return results


class ThreadRanks:
    """`world_size` ranks as threads of this process, joined by stand-ins for the two
    collectives of `distributed` that the meters, ledgers and guards call: `all_reduce_sum` and
    `all_gather_object`. For unit tests of what those classes compute from every rank's part
    (no process group, no ports, no spawn): install them with monkeypatch, then `run`."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=60)
        self._given: list[Any] = [None] * world_size
        self._local = threading.local()

    def rank(self) -> int:
        return self._local.rank

    def _exchange(self, mine: Any) -> list[Any]:
        self._given[self.rank()] = mine
        self._barrier.wait()  # every rank's part is in
        given = list(self._given)
        self._barrier.wait()  # every rank has read them: the next call may overwrite them
        return given

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        given = self._exchange(tensor.clone())
        return tensor.copy_(torch.stack(given).sum(0))  # every rank adds in rank order

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._exchange(obj)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """`fn(rank)` on every rank at once; the results in rank order, or the first error."""
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def entry(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as error:  # re-raised below, in the test's thread
                errors.append(error)
                self._barrier.abort()  # the other ranks stop waiting for this one

        threads = [threading.Thread(target=entry, args=(r,)) for r in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise next(
                (e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0]
            )
        return results


# The tiny training job of the end-to-end tests: synthetic data, a small MiniResNet, batches
# loaded in the training process, no TensorBoard. Each test states what it changes.
TINY_JOB = {
    "data.dataset": "synthetic",
    "data.synthetic_train_size": "256",
    "data.synthetic_eval_size": "64",
    "data.batch_size": "16",
    "model.widths": "4,8,8",
    "data.num_workers": "0",
    "log.tensorboard": "false",
}


def tiny_job_args(run_dir: Path | str | None = None, *flags: str, **settings: Any) -> list[str]:
    """The tiny job's command-line arguments (TINY_JOB), `--run.dir` first when given.

    `flags` ("--train.max_steps=6") and then `settings` change it: `train_max_steps=6` is
    `--train.max_steps=6` (the section's dot is the first underscore). A key already in the job
    takes the new value in its place, a new one comes after in the order given, and None leaves
    the key out (the config's default). Booleans are written true/false, lists and tuples
    comma-separated. Each key appears once, so that the command line says what the run uses.
    """
    job: dict[str, str | None] = dict(TINY_JOB)
    for flag in flags:
        key, equals, value = flag.removeprefix("--").partition("=")
        if not flag.startswith("--") or not equals:
            raise ValueError(f"{flag!r}: give flags as --section.key=value")
        job[key] = value
    for name, value in settings.items():
        section, _, field = name.partition("_")
        if isinstance(value, bool):
            value = str(value).lower()
        elif isinstance(value, list | tuple):
            value = ",".join(map(str, value))
        job[f"{section}.{field}"] = None if value is None else str(value)
    args = [f"--{key}={value}" for key, value in job.items() if value is not None]
    return args if run_dir is None else [f"--run.dir={run_dir}", *args]


def train_command(
    nproc: int | None, *args: str, script: str = "train.py", restarts: int = 0
) -> list[str]:
    """`python SCRIPT ARGS` (nproc None: no launcher, as a user runs it on a laptop), or torchrun
    with `nproc` workers on this host (--standalone: its own rendezvous on a free port)."""
    if nproc is None:
        return [sys.executable, script, *args]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += [f"--nproc_per_node={nproc}", f"--max-restarts={restarts}"]
    return [*launcher, script, *args]


def launch(
    nproc: int | None,
    *args: str,
    faults: str | None = None,
    restarts: int = 0,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run a training job to its end (see `train_command`), one thread per worker. With
    `faults` (a TRAIN_FAULTS spec), the entry point is tests/faults.py, which injects them.
    The result's `output` is stdout and stderr together."""
    script = "train.py" if faults is None else "tests/faults.py"
    try:
        proc = subprocess.run(
            train_command(nproc, *args, script=script, restarts=restarts),
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_FAULTS": faults or "", **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as err:  # where it stood, not only that it was killed
        said = [_text(err.stdout), _text(err.stderr)]
        raise AssertionError(f"still running after {timeout} s:\n{''.join(said)[-6000:]}") from None
    proc.output = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    return proc


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def rows(run_dir: Path, kind: str) -> list[dict]:
    """The run's metrics.jsonl rows of one kind ("train", "eval", ...), in order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["kind"] == kind]


def free_port() -> int:
    """A port p with p + 1 free too (launch_multinode.sh's rendezvous check uses p + 1)."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port < 65535:
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports found")


def final_state(run_dir: Path) -> dict:
    """The newest checkpoint of a run dir, loaded (weights_only): a file, or a sharded
    checkpoint's folder put back into whole tensors."""
    from ckpt import retention, storage

    _, newest = retention.list_checkpoints(run_dir / "checkpoints")[-1]
    if newest.is_dir():
        return storage.load(newest, torch.device("cpu"))
    return torch.load(newest, weights_only=True)


def assert_same_training_state(a: dict, b: dict) -> None:
    """Two checkpoints hold the same step, weights and optimizer state, bit for bit."""
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert ("ema" in a) == ("ema" in b)
    for key in a.get("ema", {}).get("weights", {}):  # train.ema_decay's average
        assert torch.equal(a["ema"]["weights"][key], b["ema"]["weights"][key]), key
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for name, value in state_a[index].items():
            assert torch.equal(value, state_b[index][name]), (index, name)


def wait_for_train_rows(run_dir: Path, proc: Any, rows: int = 1, timeout: float = 120) -> None:
    """Until the run's metrics.jsonl holds `rows` training rows; fails if `proc` ends first."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= rows):
        assert time.monotonic() < deadline, f"no {rows} training rows in {metrics}"
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {rows} rows"
        time.sleep(0.1)


def unboxed(text: str) -> str:
    """tyro's message boxes as plain text: frames gone, each run of whitespace one space (a
    message wrapped inside a box reads as one line again)."""
    return " ".join(re.sub(r"[│╭╮╰╯]|[─-]{3,}", " ", text).split())
