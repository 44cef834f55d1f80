"""Who owns a run directory, and whether its attempts make progress.

- `Lease`: one job per run dir. Rank 0 takes the lease before anything is written there and
  renews it while the job runs; every write and deletion under the run dir first looks the
  next generation up on disk (ckpt/fence.py), in every process that writes there.
- `count_attempt`: the crash-loop breaker. `<run.dir>/progress.json` counts the attempts that
  started from the same checkpoint step; past `run.max_attempts_without_progress` the run
  exits 76 ("no progress: do not restart") instead of failing the same way again. A
  preemption (exit 75) and a finished run reset the count; a preemption is uncounted when its
  signal arrives (`uncount_attempt`, launch.Attempt), so one that dies before its checkpoint
  is written is not counted.
- `origin.json`: the checkpoint an explicit `--ckpt.resume=PATH` initialised this run from, so
  that a restart repeating that command continues from the run's own newer checkpoints.

The lease is a chain of generations, `<run.dir>/lease.<N>.json`, each created with `O_CREAT |
O_EXCL` (of several jobs exactly one creates it); the highest N holds it and writes only its
own file. Who may take it over, when the holder stops itself, and why O_EXCL files and not
locks on NFS and Lustre: docs/fault-tolerance.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import exitcodes
from ckpt import atomic, fence, retention
from ckpt.fence import RunDirBusy
from runpaths import LEASE_GLOB, RunPaths

log = logging.getLogger(__name__)

# torchrun's --rdzv-id when none is given, and launch_multinode.sh's old default: shared by
# unrelated jobs, so they identify nothing.
_ANONYMOUS_RUN_IDS = ("", "none", "ddp-job")
# A lease file that exists but does not parse yet is being created (O_EXCL first, then the
# record) or renamed over: read it again for this long before judging it by its age.
_READ_RETRY_S = 2.0


class LeaseExpired(OSError):
    """This job could not renew its lease for most of run.lease_timeout_s (the filesystem
    failed it, or the process was stopped), and no other job has taken it yet: stop writing.
    Transient (ETIMEDOUT): a restart of the same job takes its lease back at once."""


class NoProgress(RuntimeError):
    """Too many attempts started from the same checkpoint: restarting again cannot help."""


# ---------------------------------------------------------------------------------------------
# Process identity


@dataclass(frozen=True)
class ProcessId:
    """What identifies a process on a network of machines: the kernel boot, the PID namespace,
    the pid there and the pid's start time. Empty or 0 fields: not known (/proc is missing
    or belongs to another PID namespace), and then nothing is inferred from them."""

    boot_id: str
    pid_ns: str
    pid: int
    start_ticks: int

    @classmethod
    def current(cls) -> ProcessId:
        pid = os.getpid()
        try:
            boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            pid_ns = os.readlink("/proc/self/ns/pid")
            stat = _proc_stat(pid)
        except OSError:
            return cls("", "", pid, 0)
        # /proc mounted for another PID namespace (unshare --pid without --mount-proc, a
        # container given the host's /proc) shows other processes under these numbers.
        if stat is None or stat[0] != pid:
            return cls(boot_id, "", pid, 0)
        return cls(boot_id, pid_ns, pid, stat[2])

    def known(self) -> bool:
        return bool(self.boot_id and self.pid_ns and self.start_ticks)

    def exited(self, observer: ProcessId) -> bool:
        """Whether this process is certainly gone, as `observer` (this process) sees it: only
        when both ran under the same boot in the same PID namespace, and the pid is free, a
        zombie or another process (started at another time)."""
        if not (self.known() and observer.known()):
            return False
        if (self.boot_id, self.pid_ns) != (observer.boot_id, observer.pid_ns):
            return False
        try:
            stat = _proc_stat(self.pid)
        except OSError:
            return False
        return stat is None or stat[1] in "ZX" or stat[2] != self.start_ticks


def _proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(pid, state, start time in clock ticks after boot) from /proc/<pid>/stat, None when no
    such process. proc(5): the command name, field 2, is in parentheses and may hold spaces
    and parentheses itself, so the fields after it are counted from the last ')'."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    head, _, rest = text.rpartition(")")
    fields = rest.split()  # fields[0] is field 3 (state); field 22 (starttime) is fields[19]
    return int(head.split(" (", 1)[0]), fields[0], int(fields[19])


def job_id() -> str:
    """What names this job across its restarts: Slurm's job id (kept by a requeue), else the
    torchrun run id (--rdzv-id: kept by torchrun's restarts and by pod restarts that repeat the
    command), else this process (a plain `python train.py`) or its torchrun agent, named by host,
    pid, PID namespace and boot: a host name and pid alone repeat in every container."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id not in _ANONYMOUS_RUN_IDS:
        return f"torchrun-{run_id}"
    # Under torchrun: its agent's pid, the same for every restart of the workers.
    pid = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") is not None else os.getpid()
    me = ProcessId.current()
    namespace = re.sub(r"\D", "", me.pid_ns) or "unknown"
    return f"process-{socket.gethostname()}-{pid}-pidns{namespace}-boot{me.boot_id[:8]}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    payload = (json.dumps(value) + "\n").encode()
    atomic.write_bytes(path, lambda f: f.write(payload))


# ---------------------------------------------------------------------------------------------
# The lease


def _clock() -> float:
    """Seconds on a clock that runs on through a suspend (a laptop, a paused VM) and that no
    clock adjustment moves: a holder that was asleep must count that time as silence."""
    return time.clock_gettime(getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC))


def lease_path(run_dir: Path, generation: int) -> Path:
    return RunPaths(run_dir).lease(generation)


def _generations(run_dir: Path) -> list[int]:
    """The generations the listing shows, then those above its highest that a lookup by name
    finds (a cached NFS listing may miss the newest), in ascending order."""
    found = []
    for path in run_dir.glob(LEASE_GLOB):
        number = path.name.split(".")[1]
        if number.isdigit():
            found.append(int(number))
    found.sort()
    top = found[-1] if found else 0
    while lease_path(run_dir, top + 1).exists():
        top += 1
        found.append(top)
    return found


def _missing(path: Path) -> bool:
    """Whether `path` does not exist; raises other OSErrors (ESTALE: cannot tell)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    return False


def _read_lease(path: Path) -> dict[str, Any] | None:
    """A lease file's record: None when there is no such file; raises OSError when it cannot
    be read, ValueError when it does not parse (being created, or torn)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds no JSON object")
    return value


class Lease:
    """The run dir's lease, held by rank 0 for the whole run (see the module's text)."""

    def __init__(self, run_dir: Path, timeout_s: float) -> None:
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.me = ProcessId.current()
        self.job = job_id()
        self.generation = 0  # the generation held; 0 before acquire
        self.fence: fence.Fence | None = None  # the generation's token, once held
        self._renewed = 0.0  # _clock() before the last renewal that reached the file
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        return lease_path(self.run_dir, self.generation)

    @property
    def lost_to(self) -> str:
        """Who took the lease over while this job ran ('' while no one is known to)."""
        return self.fence.lost_to if self.fence is not None else ""

    def record(self) -> dict[str, Any]:
        now = time.time()
        return {
            "generation": self.generation,
            "job": self.job,
            "host": socket.gethostname(),
            "pid": self.me.pid,
            "boot_id": self.me.boot_id,
            "pid_ns": self.me.pid_ns,
            "start_ticks": self.me.start_ticks,
            "timeout_s": self.timeout_s,
            "heartbeat": now,
        }

    # -- taking it -----------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lease or raise RunDirBusy naming the holder. Call with the dir existing."""
        self._judge_legacy()
        for _ in range(100):  # each pass contests one generation; losing one means a new holder
            generations = _generations(self.run_dir)
            top = generations[-1] if generations else 0
            if top:
                self._judge(top)  # raises RunDirBusy unless the holder may be taken over
            if self._create(top + 1):
                break
        else:
            raise RunDirBusy(f"run.dir={self.run_dir}: lost 100 races for its lease in a row")
        self._collect(generations)
        self.fence = fence.Fence(self.run_dir, self.generation)
        fence.hold(self.fence)  # this process's writes under the run dir check it from now on
        self._thread = threading.Thread(target=self._beat, name="run-dir-lease", daemon=True)
        self._thread.start()

    def _judge(self, top: int) -> None:
        """Return if generation `top`'s holder may be taken over (log why), else raise."""
        path = lease_path(self.run_dir, top)
        holder, problem = self._read_patiently(path)
        if holder is None:  # unreadable for seconds: judge the file by its age
            try:
                age = time.time() - path.stat().st_mtime
            except FileNotFoundError:
                return  # released meanwhile: contest the next generation
            if age > self.timeout_s:
                log.warning("run dir lease: %s is unreadable (%s): taking the lease", path, problem)
                return
            raise RunDirBusy(
                f"run.dir={self.run_dir}: its lease {path.name} cannot be read ({problem}) and "
                f"was written {age:.0f} s ago: another job may hold it. Try again later, or use "
                "another --run.dir"
            )
        who = fence.describe(holder)
        holder_id = ProcessId(
            str(holder.get("boot_id", "")),
            str(holder.get("pid_ns", "")),
            int(holder.get("pid", 0)),
            int(holder.get("start_ticks", 0)),
        )
        timeout = float(holder.get("timeout_s", self.timeout_s))
        age = time.time() - float(holder.get("heartbeat", 0))
        if holder.get("job") == self.job:
            log.info("run dir lease: continuing job %s (a restart)", self.job)
        elif holder_id.exited(self.me):
            log.warning("run dir lease: %s has exited: taking the lease", who)
        elif age > timeout:
            log.warning(
                "run dir lease: %s is silent for more than run.lease_timeout_s=%g s (the "
                "holder's setting): taking the lease",
                who,
                timeout,
            )
        else:
            raise RunDirBusy(
                f"run.dir={self.run_dir} is in use by {who}: two jobs in one run dir would "
                "overwrite each other's checkpoints and metrics. Use another --run.dir; if that "
                f"job is gone without a trace here (another host, another container), its "
                f"lease expires {max(0.0, timeout - age):.0f} s from now "
                f"(its run.lease_timeout_s={timeout:g})"
            )

    def _judge_legacy(self) -> None:
        """Refuse a run dir whose earlier-version lease.json has a fresh heartbeat from another
        job: that version knows nothing of generation files, so until its heartbeat is older
        than this run's lease timeout it is taken to be running."""
        legacy = RunPaths(self.run_dir).legacy_lease
        holder = _read_json(legacy)
        if holder is None or holder.get("job") == self.job:
            return
        age = time.time() - float(holder.get("heartbeat", 0))
        if age <= self.timeout_s:
            raise RunDirBusy(
                f"run.dir={self.run_dir} is in use by {fence.describe(holder)}, a job of an "
                f"earlier version ({legacy.name}): two jobs in one run dir would overwrite each "
                f"other's checkpoints and metrics. Use another --run.dir, or wait: its lease "
                f"expires {max(0.0, self.timeout_s - age):.0f} s from now"
            )

    def _read_patiently(self, path: Path) -> tuple[dict[str, Any] | None, str]:
        """(the record, '') or, after retrying for _READ_RETRY_S, (None, why not)."""
        deadline = time.monotonic() + _READ_RETRY_S
        while True:
            try:
                holder = _read_lease(path)
                if holder is not None:
                    return holder, ""
                return None, "gone"
            except (OSError, ValueError) as err:  # ESTALE mid-rename, a file being created
                problem = str(err)
            if time.monotonic() > deadline:
                return None, problem
            time.sleep(0.1)

    def _create(self, generation: int) -> bool:
        """Create generation `generation`'s file with O_EXCL: True if this job created it."""
        path = lease_path(self.run_dir, generation)
        renewed = _clock()
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        self.generation = generation
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.record()) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:  # a full disk, say: leave nothing behind, name the file
            path.unlink(missing_ok=True)
            self.generation = 0
            raise OSError(err.errno, f"cannot write {path}: {err.strerror}") from err
        self._renewed = renewed
        return True

    def _collect(self, generations: list[int]) -> None:
        """Remove generations below the previous one: only the one just below can still have
        a holder that runs (it stops itself at its next renewal, seeing this generation)."""
        for generation in generations:
            if generation < self.generation - 1:
                with contextlib.suppress(OSError):
                    lease_path(self.run_dir, generation).unlink()

    # -- holding it ----------------------------------------------------------------------------

    def _successor(self) -> dict[str, Any] | None:
        """The record of generation N + 1 if it exists (a file still being written counts,
        as an unknown job); raises OSError when it cannot be told."""
        path = lease_path(self.run_dir, self.generation + 1)
        try:
            return _read_lease(path)
        except ValueError:
            return {"job": "unknown (its lease file is being written)", "generation": "?"}

    def _beat(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            if self.stop_reason():
                break  # silent for too long: a newcomer may already have judged it stale
            try:
                successor = self._successor()
                removed = successor is None and _missing(self.path)
            except OSError as err:  # ESTALE, EIO: cannot tell, so do not write
                log.warning("run dir lease: cannot read %s (%s): not renewing", self.run_dir, err)
                continue
            if successor is not None or removed:
                self._lose(successor)
                break
            renewed = _clock()
            try:
                _write_json(self.path, self.record())
            except RunDirBusy:  # taken over since the look-up above (the write's own fence)
                log.error("run dir lease taken over by %s: this job must stop", self.lost_to)
                break
            except OSError as err:
                log.warning("run dir lease: cannot renew %s (%s)", self.path, err)
                continue
            self._renewed = renewed

    def _lose(self, successor: dict[str, Any] | None) -> None:
        """Record the takeover; `successor` None: this generation's file is gone, removed by a
        newer holder that has released the run dir since (renewing would recreate it, and the
        fence, which looks for generation N + 1 only, would let this job write again)."""
        assert self.fence is not None
        self.fence.lost_to = (
            fence.describe(successor)
            if successor is not None
            else f"a newer holder, which removed {self.path.name} and has released the run dir"
        )
        log.error("run dir lease taken over by %s: this job must stop", self.lost_to)

    def stop_reason(self) -> str:
        """'' while this job holds the lease, else why it must stop (no I/O: cheap each step,
        and up to timeout/4 late: `check` before a write looks on disk)."""
        if self.lost_to:
            return f"another job took the run dir's lease over: {self.lost_to}"
        silent = _clock() - self._renewed
        if self.generation and silent > 0.75 * self.timeout_s:
            return (
                f"the run dir's lease was last renewed {silent:.0f} s ago, more than 3/4 of "
                f"run.lease_timeout_s={self.timeout_s:g}"
            )
        return ""

    def valid(self) -> bool:
        """Whether this job may write to the run dir now (`check`, as a bool: one stat)."""
        try:
            self.check()
        except (OSError, RunDirBusy):
            return False
        return True

    def check(self) -> None:
        """Raise unless this job may write to the run dir (call it right before each write):
        RunDirBusy naming the new holder once the next generation exists on disk (one stat,
        not the heartbeat's flag), LeaseExpired when this job could not renew the lease in
        time, an OSError when the look-up itself fails (then nothing may be written)."""
        if self.fence is not None:
            self.fence.check()
        reason = self.stop_reason()
        if not reason:
            return
        raise LeaseExpired(
            errno.ETIMEDOUT,
            f"run.dir={self.run_dir}: {reason} (the filesystem failed the renewals, or this "
            "process was stopped): stopping without writing; a restart of this job takes the "
            "lease back at once",
        )

    def release(self) -> None:
        """Stop renewing; remove the lease (and the generations below it) if it is still this
        job's: no newer generation exists."""
        self._stop.set()
        if fence.held() is self.fence:
            fence.hold(None)
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        with contextlib.suppress(OSError):
            if self._successor() is None and not self.lost_to:
                for generation in reversed(_generations(self.run_dir)):
                    if generation <= self.generation:
                        lease_path(self.run_dir, generation).unlink(missing_ok=True)


def count_attempt(run_dir: Path, step: int, limit: int) -> int:
    """Record an attempt starting at checkpoint `step`; raise NoProgress past `limit`.

    Returns the number of attempts (this one included) that started at `step`."""
    path = RunPaths(run_dir).progress
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


def uncount_attempt(run_dir: Path) -> None:
    """This attempt was asked to stop (a preemption): it does not count against the limit,
    even if it dies before its checkpoint is written (torchrun's shutdown timeout, a
    scheduler's KillWait, a second node's failure). Call once (launch.Attempt), when the signal
    arrives: the attempts that end otherwise (crashes, hangs) still count, so a crash loop
    still trips."""
    path = RunPaths(run_dir).progress
    record = _read_json(path)
    if not record or int(record.get("attempts", 0)) < 1:
        return
    record["attempts"] = int(record["attempts"]) - 1
    record["preempted"] = int(record.get("preempted", 0)) + 1  # for the reader: why not counted
    with contextlib.suppress(OSError):  # the count is a safeguard: never the reason a stop fails
        _write_json(path, record)


def reset_attempts(run_dir: Path, step: int) -> None:
    """The run made progress (a preemption checkpoint, the end): restarts start counting anew."""
    with contextlib.suppress(OSError):
        _write_json(RunPaths(run_dir).progress, {"step": step, "attempts": 0, "job": job_id()})


def origin_of(resume: str) -> str:
    return str(Path(resume).expanduser().resolve())


def continues_from_own_checkpoints(run_dir: Path, resume: str) -> bool:
    """Whether an explicit `--ckpt.resume=PATH` already initialised this run dir, which holds
    complete checkpoints since (a manifest, a step not before PATH's): a restart repeating the
    command then continues from those."""
    record = _read_json(RunPaths(run_dir).origin)
    if not record or record.get("resume") != origin_of(resume):
        return False
    directory = RunPaths(run_dir).checkpoints
    return any(
        step >= int(record.get("step", 0)) and retention.manifest_path(path).is_file()
        for step, path in retention.list_checkpoints(directory)
    )


def record_origin(run_dir: Path, resume: str, step: int) -> None:
    _write_json(RunPaths(run_dir).origin, {"resume": origin_of(resume), "step": step})
