"""How a launch ends: exit codes by cause, the files the ranks report through, the stop signals.

One home for what train.py, scripts/supervise.py, scripts/ray_train.py, scripts/rendezvous_check.py,
the shell launchers, the Kubernetes manifests and the tests must agree on. It imports nothing
but the standard library (no torch: the launchers import it in milliseconds); the shell
scripts and manifests spell the numbers out and tests/test_exitcodes.py checks them against
this file.

Every code is final (retrying the same command cannot help: 0 done, 2 bad input, 3 diverged,
76 no progress; schedulers end the job on these) or retryable (anything else; 75, preempted,
without spending a retry budget). An `OSError` is classed by its errno (`exit_for_os_error`),
not by when it happens: a network filesystem's hiccup is 74; a wrong path, a permission, a
full disk or quota is 2 (a retry would fail the same way). Under torchrun a worker's code
becomes torchrun's 1; scripts/supervise.py turns it back into 2, 3, 74, 75 or 76 through the
marker files below.

Why each code is what it is, and what each launcher does with it: docs/fault-tolerance.md.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from pathlib import Path

EXIT_OK = 0
EXIT_FAILED = 1  # a crash: torchrun turns every worker failure into its own 1
EXIT_BAD_INPUT = 2  # a config, file, dataset or run dir this run cannot use: fix the input
EXIT_DIVERGED = 3  # train.max_nonfinite_steps consecutive non-finite steps
EXIT_STALLED = 4  # dist.timeout_s without a step: the watchdog aborted (retryable)
EXIT_RENDEZVOUS = 69  # EX_UNAVAILABLE: the nodes did not meet (a node late, a port taken)
EXIT_IO = 74  # EX_IOERR: transient I/O mid-run (EIO, ESTALE, ETIMEDOUT on NFS/Lustre)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a stop signal; the preemption checkpoint is written
EXIT_NO_PROGRESS = 76  # run.max_attempts_without_progress attempts from one checkpoint

FINAL_EXITS = frozenset({EXIT_OK, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_NO_PROGRESS})
# What the Kubernetes podFailurePolicy and train.sbatch fail the whole job on (0 is success).
FAIL_JOB_EXITS = tuple(sorted(FINAL_EXITS - {EXIT_OK}))

# Environment variables naming the files through which local rank 0 of each node tells the
# launcher (scripts/supervise.py) how this launch ends: torchrun reports any worker failure as
# its own exit 1, so the cause travels beside it.
PREEMPT_MARKER = "TRAIN_PREEMPT_MARKER"  # "checkpoint at step N" or "finished at step N"
NO_PROGRESS_MARKER = "TRAIN_NO_PROGRESS_MARKER"
BAD_INPUT_MARKER = "TRAIN_BAD_INPUT_MARKER"
DIVERGED_MARKER = "TRAIN_DIVERGED_MARKER"
# scripts/supervise.py writes the name of a stop signal it received here, before it passes the
# stop on: a worker's stop that the launcher did not see is torchrun's own SIGTERM to the
# survivors of a failed worker, which no scheduler asked for (launch.Attempt)
STOP_MARKER = "TRAIN_STOP_MARKER"
IO_MARKER = "TRAIN_IO_MARKER"  # "I/O error at restarts 0,2: ...": attempts that ended in 74
# Written by every rank that meets them: the first rank to exit makes torchrun stop the others.
EVERY_RANK_MARKERS = (BAD_INPUT_MARKER, DIVERGED_MARKER, IO_MARKER)

# Signals a scheduler or terminal sends to stop a job: Slurm's step signal (--signal, USR2 in
# train.sbatch) and time limit, scancel, the kubelet, systemd, Ctrl-C, a closed terminal. The
# launchers turn the first of them into one checkpoint request; loader workers ignore them all
# (SIGUSR1 too, which some sites use as the step signal).
LAUNCHER_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)
LOADER_IGNORED_SIGNALS = (*LAUNCHER_STOP_SIGNALS, signal.SIGUSR1)
# run.preempt_signals' default: what the training processes checkpoint on.
DEFAULT_PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR2", "SIGINT")


def is_final(code: int) -> bool:
    """Whether a retry of the same command cannot change this exit."""
    return code in FINAL_EXITS


# errnos of storage that comes back by itself (NFS, Lustre, a SAN path failing over): retryable.
TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO", "ESTALE", "ETIMEDOUT", "EAGAIN", "EINTR", "EBUSY", "ENOLCK", "ECOMM",
        "EREMOTEIO", "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "EHOSTDOWN",
        "EHOSTUNREACH", "ENETDOWN", "ENETUNREACH", "ENETRESET", "ENOLINK",
    )
    if hasattr(errno, name)
)  # fmt: skip
# A full disk or quota: named in the message; final (see the module's text).
DISK_FULL_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT") if hasattr(errno, name)
)


def exit_for_os_error(err: OSError) -> int:
    """EXIT_IO for transient storage errors, else EXIT_BAD_INPUT (see the module's text)."""
    return EXIT_IO if err.errno in TRANSIENT_ERRNOS else EXIT_BAD_INPUT


def describe_os_error(err: OSError) -> str:
    """The error with its errno's name, and what to do about a full disk or quota."""
    name = errno.errorcode.get(err.errno or 0, "")
    text = f"{err} ({name})" if name and name not in str(err) else str(err)
    if err.errno in DISK_FULL_ERRNOS:
        what = "no space left on the device" if err.errno == errno.ENOSPC else "disk quota exceeded"
        text += (
            f": {what}. Retrying cannot help until space is freed (older runs, checkpoints, "
            "ckpt.keep) or the quota raised; then run the same command again: it resumes from "
            "the newest checkpoint"
        )
    elif err.errno in TRANSIENT_ERRNOS:
        text += ": a transient storage error; a restart resumes from the newest checkpoint"
    return text


def report_to_launcher(variable: str, text: str) -> None:
    """Tell scripts/supervise.py how this launch ends (one file per node, see there). Bad input
    and divergence are reported by every rank that meets them (atomically: the last writer's
    text): a rank that exits first makes torchrun stop the others, local rank 0 perhaps before
    it wrote."""
    marker = os.environ.get(variable)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not marker or (local_rank != 0 and variable not in EVERY_RANK_MARKERS):
        return
    with contextlib.suppress(OSError):
        staged = Path(f"{marker}.{os.getpid()}")
        staged.write_text(text + "\n")
        os.replace(staged, marker)
