"""Who owns a run directory, and whether its attempts make progress.

- `Lease`: one job per run dir. Rank 0 takes `<run.dir>/lease.json` (host, pid, job id,
  heartbeat) before anything else is written there, and refreshes its heartbeat while the job
  runs. A second job is refused, naming the holder; a restart of the same job (a torchrun
  restart, a Slurm requeue, a pod restart: the same job id) takes it over at once, and so
  does any job once the holder is gone: its process is dead (same host) or its heartbeat is
  older than `run.lease_timeout_s`. Heartbeats are wall-clock times: the nodes' clocks must
  agree to well within that timeout (NTP).
- `count_attempt`: the crash-loop breaker. `<run.dir>/progress.json` counts the attempts that
  started from the same checkpoint step; past `run.max_attempts_without_progress` the run
  exits 76 ("no progress: do not restart") instead of failing the same way again. A
  preemption (exit 75) and a finished run reset the count.
- `origin.json`: the checkpoint an explicit `--ckpt.resume=PATH` initialised this run from, so
  that a restart repeating that command continues from the run's own newer checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import checkpoint
import exitcodes
from config import ConfigError

log = logging.getLogger(__name__)

LEASE_FILE = "lease.json"
PROGRESS_FILE = "progress.json"
ORIGIN_FILE = "origin.json"
# torchrun's --rdzv-id when none is given, and launch_multinode.sh's old default: shared by
# unrelated jobs, so they identify nothing.
_ANONYMOUS_RUN_IDS = ("", "none", "ddp-job")


class RunDirBusy(ConfigError):
    """Another live job holds the run dir's lease."""


class NoProgress(RuntimeError):
    """Too many attempts started from the same checkpoint: restarting again cannot help."""


def job_id() -> str:
    """What names this job across its restarts: Slurm's job id (kept by a requeue), else the
    torchrun run id (--rdzv-id: kept by torchrun's restarts and by pod restarts that repeat the
    command), else this process (a plain `python train.py`)."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id not in _ANONYMOUS_RUN_IDS:
        return f"torchrun-{run_id}"
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:  # under torchrun: its agent's pid
        return f"process-{socket.gethostname()}-{os.getppid()}"
    return f"process-{socket.gethostname()}-{os.getpid()}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    payload = (json.dumps(value) + "\n").encode()
    checkpoint.atomic_write_bytes(path, lambda f: f.write(payload))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """The run dir's lease, held by rank 0 for the whole run (see the module's text)."""

    def __init__(self, run_dir: Path, timeout_s: float) -> None:
        self.path = run_dir / LEASE_FILE
        self.timeout_s = timeout_s
        self.mine = {
            "job": job_id(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "heartbeat": time.time(),
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost_to = ""  # the job that took the lease over while this one still ran

    def held_by_me(self, holder: dict[str, Any] | None) -> bool:
        return bool(holder) and (holder.get("job"), holder.get("pid")) == (  # type: ignore[union-attr]
            self.mine["job"],
            self.mine["pid"],
        )

    def acquire(self) -> None:
        """Take the lease or raise RunDirBusy naming the holder. Call with the dir existing."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            self._take_over(_read_json(self.path))
        else:
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(self.mine) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as err:  # a full disk, say: leave nothing behind, name the file
                self.path.unlink(missing_ok=True)
                raise OSError(err.errno, f"cannot write {self.path}: {err.strerror}") from err
        self._thread = threading.Thread(target=self._beat, name="run-dir-lease", daemon=True)
        self._thread.start()

    def _take_over(self, holder: dict[str, Any] | None) -> None:
        for _ in range(5):  # a read can race the holder's rename (ESTALE on NFS): read again
            if holder is not None:
                break
            time.sleep(0.2)
            holder = _read_json(self.path)
        if holder is None:
            log.warning("%s is unreadable: taking the lease", self.path)
        else:
            age = time.time() - float(holder.get("heartbeat", 0))
            who = (
                f"job {holder.get('job')} (host {holder.get('host')}, pid {holder.get('pid')}, "
                f"heartbeat {age:.0f} s ago)"
            )
            same_host = holder.get("host") == self.mine["host"]
            if holder.get("job") == self.mine["job"]:
                log.info("run dir lease: continuing job %s (a restart)", self.mine["job"])
            elif same_host and not _pid_alive(int(holder.get("pid", 0))):
                log.warning("run dir lease: %s has exited: taking the lease", who)
            elif age > self.timeout_s:
                log.warning(
                    "run dir lease: %s is silent for more than run.lease_timeout_s=%g s: taking "
                    "the lease",
                    who,
                    self.timeout_s,
                )
            else:
                raise RunDirBusy(
                    f"run.dir={self.path.parent} is in use by {who}: two jobs in one run dir "
                    "would overwrite each other's checkpoints and metrics. Use another --run.dir; "
                    f"if that job is dead on another host, its lease expires "
                    f"{max(0.0, self.timeout_s - age):.0f} s from now "
                    f"(run.lease_timeout_s={self.timeout_s:g})"
                )
        _write_json(self.path, self.mine)

    def _beat(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            holder = _read_json(self.path)
            if holder is not None and not self.held_by_me(holder):
                # Taken over while this job was silent (suspended, a stalled filesystem):
                # never write over the new holder; checkpoints refuse to write (check()).
                self.lost_to = f"job {holder.get('job')} (host {holder.get('host')})"
                log.error("run dir lease taken over by %s: this job must stop", self.lost_to)
                return
            self.mine["heartbeat"] = time.time()
            with contextlib.suppress(OSError):  # a flaky filesystem: the next beat retries
                _write_json(self.path, self.mine)

    def check(self) -> None:
        """Raise RunDirBusy when another job took the lease over (before writing anything)."""
        if self.lost_to:
            raise RunDirBusy(
                f"run.dir={self.path.parent} was taken over by {self.lost_to} while this job "
                f"was silent for more than run.lease_timeout_s={self.timeout_s:g} s: stopping "
                "without writing, so that the two jobs do not overwrite each other"
            )

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self.held_by_me(_read_json(self.path)):
                self.path.unlink(missing_ok=True)


def count_attempt(run_dir: Path, step: int, limit: int) -> int:
    """Record an attempt starting at checkpoint `step`; raise NoProgress past `limit`.

    Returns the number of attempts (this one included) that started at `step`."""
    path = run_dir / PROGRESS_FILE
    record = _read_json(path) or {}
    attempts = int(record.get("attempts", 0)) + 1 if record.get("step") == step else 1
    if limit and attempts > limit:
        raise NoProgress(
            f"{attempts - 1} attempts in a row started from step {step} and none saved a "
            f"later checkpoint (run.max_attempts_without_progress={limit}): restarting again "
            f"cannot help. Exiting with code {exitcodes.EXIT_NO_PROGRESS} ('do not restart'). "
            f"Read the earlier attempts' errors; once fixed, delete {path} or raise the limit"
        )
    _write_json(path, {"step": step, "attempts": attempts, "job": job_id()})
    return attempts


def reset_attempts(run_dir: Path, step: int) -> None:
    """The run made progress (a preemption checkpoint, the end): restarts start counting anew."""
    with contextlib.suppress(OSError):
        _write_json(run_dir / PROGRESS_FILE, {"step": step, "attempts": 0, "job": job_id()})


def origin_of(resume: str) -> str:
    return str(Path(resume).expanduser().resolve())


def continues_from_own_checkpoints(run_dir: Path, resume: str) -> bool:
    """Whether an explicit `--ckpt.resume=PATH` already initialised this run dir, which holds
    complete checkpoints since (a manifest, a step not before PATH's): a restart repeating the
    command then continues from those."""
    record = _read_json(Path(run_dir) / ORIGIN_FILE)
    if not record or record.get("resume") != origin_of(resume):
        return False
    directory = checkpoint.checkpoint_dir(run_dir)
    return any(
        step >= int(record.get("step", 0)) and checkpoint.manifest_path(path).is_file()
        for step, path in checkpoint.list_checkpoints(directory)
    )


def record_origin(run_dir: Path, resume: str, step: int) -> None:
    _write_json(Path(run_dir) / ORIGIN_FILE, {"resume": origin_of(resume), "step": step})
