"""The launch a rank belongs to: the job's checks, the run dir it holds, what it tells the launcher.

`check_job` (collective, before anything is built): every rank runs the same config on the same
data (preflight) and sees the run dir rank 0 writes. `holding_run_dir` holds the run dir's lease
(one job per run dir) on rank 0 for the whole run. Once resuming is settled, `check_progress`
counts the `Attempt` (the crash-loop breaker) and `write_settled` writes config.json.
`launch_was_preempted` reads the marker files that scripts/supervise.py reads (exitcodes.py
names them; `exitcodes.report_to_launcher` writes them), and `exit_code` picks the exit code a
failed run ends with.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import auto
import data
import distributed
import exitcodes
import parallel
import preflight
import resilience
import saturation
from ckpt import atomic, fence, rundir
from ckpt.atomic import CheckpointError
from config import Config, ConfigError
from distributed import DistInfo
from runpaths import RunPaths

log = logging.getLogger("train")  # its lines read as the run's, as they did from train.py


# ---------------------------------------------------------------------------------------------
# The job's checks


def check_job(cfg: Config, info: DistInfo, data_fingerprint: str, run_dir: Path) -> None:
    """Collective checks before anything is built: every rank runs the same config on the same
    data (preflight), the network's bandwidth, and a run dir every rank shares."""
    if cfg.dist.preflight:
        preflight.check(info, data_fingerprint, cfg.fingerprint())
    if cfg.dist.preflight_bandwidth:
        preflight.bandwidth(info)
    # After preflight, so that a run.dir differing between nodes is reported as a config
    # mismatch rather than as a run dir that is not shared.
    check_run_dir_shared(info, run_dir)


def warn_if_oversubscribed(cfg: Config, info: DistInfo, settings: auto.Auto) -> None:
    """Once per node: more trainer processes and loader workers than the node has cores."""
    if cfg.log.resources and info.local_rank == 0:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        workers = cfg.data.num_workers if settings.loader == "dataloader" else 0
        crowded = saturation.oversubscribed(local_ranks, workers, saturation.available_cores())
        if crowded:
            log.warning("%s", crowded)


def check_run_dir_shared(info: DistInfo, run_dir: Path, wait_s: float = 10.0) -> None:
    """Refuse to train unless every rank sees the files rank 0 writes in run.dir.

    Rank 0 alone writes checkpoints and every rank reads them back on resume, so a run dir on
    node-local disks would fail only at the first restart, hours in. Network filesystems may
    show a new file late (attribute caching): each rank retries for `wait_s` seconds.
    """
    if info.world_size == 1:
        return
    token = distributed.broadcast_object(uuid.uuid4().hex if info.is_main else None)
    marker = RunPaths(run_dir).shared_check(token)

    def write_marker() -> None:
        fence.check(marker)  # the run dir's lease is held already: written only while it is
        marker.write_text(token)

    distributed.run_on_main(info, f"writing {marker}", write_marker)

    def visible() -> bool:
        try:
            return marker.is_file() and marker.read_text() == token
        except OSError:  # e.g. ESTALE on NFS: treat as not (yet) visible, never skip the vote
            return False

    deadline = time.monotonic() + wait_s
    while not visible() and time.monotonic() < deadline:
        time.sleep(0.2)
    error = None
    if not visible():
        error = ConfigError(
            f"run.dir={run_dir} is not shared: rank {info.rank} on {socket.gethostname()} "
            f"cannot see {marker.name}, written there by rank 0. Checkpoints and resume need a "
            "run.dir on storage every node mounts (NFS, Lustre, a ReadWriteMany volume)"
        )
    try:
        distributed.raise_if_any_failed(info, error, f"checking that run.dir={run_dir} is shared")
    finally:  # every rank has voted, so none reads the marker any more
        if info.is_main:
            with contextlib.suppress(fence.RunDirBusy):  # taken over: left (the run stops)
                fence.check(marker)
                marker.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# The run dir


@contextlib.contextmanager
def holding_run_dir(cfg: Config, info: DistInfo) -> Iterator[rundir.Lease | None]:
    """Rank 0 takes the run dir's lease (one job per run dir) before anything is written
    there, and lets go of it at the end; a run refused before writing anything leaves no
    empty run dir behind. Yields the lease on rank 0, None elsewhere; every other rank holds
    the lease's generation as its fence (ckpt/fence.py: its shards are written there too)."""
    run_dir = Path(cfg.run.dir)
    lease = rundir.Lease(run_dir, cfg.run.lease_timeout_s)
    created = not run_dir.exists()

    def take_lease() -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        lease.acquire()

    try:
        distributed.run_on_main(info, f"taking the lease of run.dir={run_dir}", take_lease)
        generation = distributed.broadcast_object(lease.generation if info.is_main else None)
        if not info.is_main:
            fence.hold(fence.Fence(run_dir, generation))
        yield lease if info.is_main else None
    finally:
        fence.hold(None)
        if info.is_main:
            lease.release()
            if created:
                with contextlib.suppress(OSError):
                    run_dir.rmdir()


class Attempt:
    """This attempt's entry in the crash-loop breaker (rundir.count_attempt), on rank 0.

    Counted once resuming is settled; uncounted at most once when the attempt ends in a way
    that is not the run's fault: a preemption (by the preemption watcher the moment the signal
    arrives, so that an evaluation or a save outlasting the grace cannot leave it counted; at
    the step boundary for a signal only another rank received) or a transient storage error
    (exit 74). Both threads call it, hence the lock; a stop before the count uncounts at once.
    """

    def __init__(self, run_dir: Path, lease: rundir.Lease | None) -> None:
        self.run_dir, self.lease = run_dir, lease
        self._lock = threading.Lock()
        self._counted = self._not_counting = self._uncounted = False

    @classmethod
    def on_main(
        cls,
        info: DistInfo,
        run_dir: Path,
        lease: rundir.Lease | None,
        preemption: resilience.PreemptionHandler,
    ) -> Attempt | None:
        """Rank 0's attempt, uncounted the moment a stop signal arrives; None elsewhere."""
        if not info.is_main:
            return None
        attempt = cls(run_dir, lease)
        preemption.on_stop(attempt.uncount_if_asked)
        return attempt

    def uncount_if_asked(self, wait_s: float = 2.0) -> None:
        """The preemption watcher's: uncount a stop that was asked for. torchrun also SIGTERMs
        the survivors of a failed worker (and every worker of a node when another node's
        restart opens a new round), which no scheduler asked for: a crash there must still
        count. Under the launcher a stop asked for reached it too (its STOP_MARKER, written
        within its poll); under torchrun without it the two look alike, and the step
        boundary's agreement uncounts (a failed rank cannot agree)."""
        marker = os.environ.get(exitcodes.STOP_MARKER)
        if marker:
            deadline = time.monotonic() + wait_s
            while not _has_text(Path(marker)):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
        elif os.environ.get("TORCHELASTIC_RUN_ID") is not None:
            return
        self.uncount()

    def count(self, step: int, limit: int) -> None:
        with self._lock:
            if self.lease is not None:
                self.lease.check()  # progress.json is written only while this job holds the dir
            rundir.count_attempt(self.run_dir, step, limit)
            self._counted = True
        if self._not_counting:
            self.uncount()

    def uncount(self) -> None:
        with self._lock:
            self._not_counting = True
            if not self._counted or self._uncounted:
                return
            self._uncounted = True
            if self.lease is None or self.lease.valid():  # a lost lease: write nothing
                rundir.uncount_attempt(self.run_dir)


def _has_text(path: Path) -> bool:
    try:
        return bool(path.read_text().strip())
    except OSError:
        return False


def ends_in_transient_io(err: BaseException) -> bool:
    """Whether `err` ends the run with exit 74 (a network filesystem's hiccup)."""
    return isinstance(err, OSError) and exitcodes.exit_for_os_error(err) == exitcodes.EXIT_IO


@contextlib.contextmanager
def uncounted_if_transient_io(attempt: Attempt | None) -> Iterator[None]:
    """An attempt that ends in transient storage errors (exit 74) is not counted by the
    crash-loop breaker: each of torchrun's immediate restarts would hit the same outage, and a
    few seconds of it would end the job as a crash loop. The launchers' retry budgets
    (--max-restarts, MAX_REQUEUES) still bound them, with a back-off (`back_off_after_io`)."""
    try:
        yield
    except Exception as err:  # an OSError here, or another rank's (a PeerError that says 74)
        if attempt is not None and (
            ends_in_transient_io(err) or getattr(err, "exit_code", None) == exitcodes.EXIT_IO
        ):
            attempt.uncount()
        raise


def io_failed_restarts() -> set[int]:
    """The attempts of this launch (torchrun's restart numbers) that ended in transient I/O,
    from the launcher's marker: "I/O error at restarts 0,2: ...". By attempt, not by report:
    every rank that meets the error reports it."""
    marker = os.environ.get(exitcodes.IO_MARKER)
    try:
        head = Path(marker).read_text().split(":")[0] if marker else ""
    except OSError:
        return set()
    listed = head.removeprefix("I/O error at restarts ").split(",")
    return {int(word) for word in listed if word.strip().isdigit()}


def io_failures_so_far() -> int:
    """How many attempts of this launch ended in transient I/O."""
    return len(io_failed_restarts())


def back_off_after_io(info: DistInfo, stopped: Callable[[], bool]) -> None:
    """Collective: after attempts of this launch ended in transient storage errors, wait before
    touching storage again (torchrun restarts at once; an NFS server's restart takes seconds
    to minutes): TRAIN_IO_BACKOFF_S (default 10) seconds, doubled after each such attempt, at
    most 16 times that. A stop signal ends the wait."""
    failures = io_failures_so_far()
    try:
        base = float(os.environ.get("TRAIN_IO_BACKOFF_S", "10"))
    except ValueError:
        base = 10.0
    delay = base * 2 ** min(failures - 1, 4) if failures else 0.0
    delay = max(row[0] for row in distributed.all_gather_floats([delay], info.device))
    if delay <= 0:
        return
    log.warning(
        "an earlier attempt of this launch ended in transient storage errors: waiting %.0f s "
        "(TRAIN_IO_BACKOFF_S, doubled per attempt) before touching the storage again",
        delay,
    )
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline and not stopped():
        time.sleep(0.2)


def check_progress(cfg: Config, info: DistInfo, step: int, attempt: Attempt | None) -> None:
    """The crash-loop breaker (rundir.count_attempt): every rank raises NoProgress together.
    `attempt`: rank 0's, None elsewhere."""
    message = None
    if attempt is not None:
        try:
            attempt.count(step, cfg.run.max_attempts_without_progress)
        except rundir.NoProgress as err:
            message = str(err)
        # The count is a safeguard: never the reason a run fails. A lost lease stops the run
        # at its first step (stop_reason), on every rank.
        except (OSError, rundir.RunDirBusy) as err:
            log.warning("cannot count this attempt in %s: %s", cfg.run.dir, err)
    message = distributed.broadcast_object(message)
    if message is not None:
        exitcodes.report_to_launcher(exitcodes.NO_PROGRESS_MARKER, f"no progress from step {step}")
        raise rundir.NoProgress(message)


def write_settled(cfg: Config, run_dir: Path, step: int, lease: rundir.Lease | None = None) -> None:
    """Once resuming is settled: the config, and where an explicit ckpt.resume started the run
    (restarts repeating the command then continue from the run's own checkpoints)."""
    if lease is not None:
        lease.check()  # another job took the run dir over: write nothing
    payload = (cfg.to_json() + "\n").encode()
    atomic.write_bytes(RunPaths(run_dir).config, lambda f: f.write(payload))
    resume = cfg.ckpt.resume
    if resume not in ("auto", "never") and not rundir.continues_from_own_checkpoints(
        run_dir, resume
    ):
        rundir.record_origin(run_dir, resume, step)


# ---------------------------------------------------------------------------------------------
# What the launcher is told


def launch_was_preempted() -> str:
    """What the launcher's preemption marker says ('' when unset or empty).

    Workers that checkpointed for a signal only they received exit 75, and torchrun, for which
    any non-zero exit is a failure, restarts them; the launcher (scripts/supervise.py) stops
    torchrun once it sees the marker, and until then a restarted worker must not train on.
    """
    marker = os.environ.get(exitcodes.PREEMPT_MARKER)
    if not marker:
        return ""
    try:
        text = Path(marker).read_text().strip()
    except OSError:
        return ""
    return text if text.startswith("checkpoint") else ""


def exit_code(err: Exception, batch_size: int) -> int | None:
    """The exit code of a run that raised `err` (exitcodes.py), logged, and told to the
    launcher when it is bad input; None for a crash, which the caller raises again (exit 1,
    with its traceback). `batch_size` (data.batch_size) goes into the out-of-memory advice."""
    if isinstance(err, rundir.NoProgress):
        log.error("%s", err)
        return exitcodes.EXIT_NO_PROGRESS
    if isinstance(err, resilience.Preempted):
        log.warning(
            "%s: checkpoint written, exiting with code %d; resume with the same command",
            err,
            exitcodes.EXIT_PREEMPTED,
        )
        return exitcodes.EXIT_PREEMPTED
    if isinstance(err, (resilience.DivergedError, FloatingPointError)):
        log.error("%s", err)  # final: a restart would diverge again (torchrun's would, unasked)
        first_sentence = str(err).split(". ")[0]
        exitcodes.report_to_launcher(exitcodes.DIVERGED_MARKER, f"diverged: {first_sentence}")
        return exitcodes.EXIT_DIVERGED
    if isinstance(err, OSError):  # by errno: NFS's ESTALE mid-run is retryable, a wrong path is not
        log.error("%s", exitcodes.describe_os_error(err))
        code = exitcodes.exit_for_os_error(err)
        if code == exitcodes.EXIT_BAD_INPUT:
            exitcodes.report_to_launcher(exitcodes.BAD_INPUT_MARKER, f"bad input: {err}")
        else:  # the launcher exits 74 if torchrun's restarts end this way (and backs off)
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            restarts = ",".join(map(str, sorted(io_failed_restarts() | {restart})))
            exitcodes.report_to_launcher(
                exitcodes.IO_MARKER, f"I/O error at restarts {restarts}: {err}"
            )
        return code
    if isinstance(err, (ConfigError, CheckpointError, data.DatasetNotFoundError)):
        log.error("%s", err)  # a clear message instead of a traceback; every rank exits
        exitcodes.report_to_launcher(exitcodes.BAD_INPUT_MARKER, f"bad input: {err}")
        return exitcodes.EXIT_BAD_INPUT
    if isinstance(err, distributed.PeerError):
        log.error("%s", err)
        if err.exit_code == exitcodes.EXIT_BAD_INPUT:
            exitcodes.report_to_launcher(exitcodes.BAD_INPUT_MARKER, f"bad input: {err}")
        distributed.outlive_the_root_cause(err)
        return err.exit_code
    if not parallel.is_out_of_memory(err):
        distributed.outlive_the_root_cause(err)
        return None
    # The same command on the same machines runs out again: final, with what to change.
    rank = int(os.environ.get("RANK", "0"))
    advice = parallel.out_of_memory_advice(err, rank, batch_size)
    log.error("%s", advice)
    exitcodes.report_to_launcher(exitcodes.BAD_INPUT_MARKER, f"out of memory: {advice}")
    return exitcodes.EXIT_BAD_INPUT


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO, the others only warnings and errors; every line names its rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
