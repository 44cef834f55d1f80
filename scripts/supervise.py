"""Run torchrun under a supervisor that turns stop signals, however they arrive, into one
checkpoint and a launcher exit code a scheduler can act on.

    python scripts/supervise.py -- python -m torch.distributed.run ... train.py ...

scripts/launch_multinode.sh and scripts/train_single_node.sh exec this; use it directly only
to wrap a torchrun command of your own. Exit codes:

    75  preempted: the workers wrote their preemption checkpoint; requeue / resubmit
    76  no progress: attempts keep starting from the same checkpoint; do not restart
    *   otherwise torchrun's own code (128 + N when a signal N killed it)

What it does, and why:
- Schedulers signal every process of a job, more than once, with mixed signals (Slurm: the
  step signal, then KillWait's SIGKILL; scancel; the kubelet). The first stop signal
  (SIGTERM, SIGINT, SIGHUP, SIGUSR2) that reaches this process becomes one SIGTERM to torchrun,
  which forwards it to its workers; repeats are logged and dropped. torchrun runs in a process
  group of its own (a terminal's Ctrl-C reaches it only through here) with SIGUSR2 ignored (it
  would die of it and orphan its workers).
- torchrun starts its workers in sessions of their own and may itself die of a second signal
  before they have checkpointed. This process is a child subreaper (Linux), so such workers
  become its children and it waits for every one of them (at most SUPERVISE_GRACE_S, default
  120 s, after the first stop signal, then SIGKILL) before it decides the exit code: it never
  exits while a worker is still writing the checkpoint.
- Workers can be signalled without this process (a scheduler that signals only them): they
  checkpoint and exit 75, and torchrun, for which that is a failure, would restart them. Rank
  0 of each node writes TRAIN_PREEMPT_MARKER after the checkpoint; once it is written this
  process stops torchrun, and a worker started meanwhile exits 75 at once (train.py).
- TRAIN_NO_PROGRESS_MARKER is written by train.py when it refuses to start for lack of
  progress (run.max_attempts_without_progress): the exit is 76 whatever torchrun reports.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXIT_PREEMPTED = 75
EXIT_NO_PROGRESS = 76
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)
PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.2


def say(message: str) -> None:
    print(f"supervise.py: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def become_subreaper() -> bool:
    """Orphaned descendants (workers whose torchrun died) are reparented to this process."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children_of(pid: int) -> list[int]:
    """Live child processes of `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


class Supervisor:
    def __init__(self, command: list[str], grace_s: float) -> None:
        self.command = command
        self.grace_s = grace_s
        self.stop_reason = ""  # why torchrun was asked to stop ('' = not asked)
        self.stop_deadline = 0.0
        self.repeats = 0
        self.child: subprocess.Popen | None = None
        self.status: int | None = None  # torchrun's exit status once reaped

    def on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.stop_reason:
            self.repeats += 1
            return
        self.request_stop(f"{name} received")

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason
        self.stop_deadline = time.monotonic() + self.grace_s
        say(f"{reason}: asking the workers to checkpoint and stop (SIGTERM to torchrun)")
        if self.child is not None and self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child.pid, signal.SIGTERM)

    def reap(self) -> bool:
        """Reap exited children (torchrun, adopted workers); False once none is left."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if self.child is not None and pid == self.child.pid:
                self.status = os.waitstatus_to_exitcode(status)
                self.child.returncode = self.status
                if self.status != 0 or self.stop_reason:
                    say(f"torchrun exited with {describe(self.status)}")

    def kill_leftovers(self, quiet: bool) -> None:
        pids = children_of(os.getpid())
        if not pids:
            return
        if not quiet:
            say(
                f"{len(pids)} process(es) still running {self.grace_s:g} s after torchrun was "
                "asked to stop or ended "
                f"(SUPERVISE_GRACE_S): SIGKILL to {pids}"
            )
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def run(self, preempt_marker: Path, no_progress_marker: Path) -> int:
        if not become_subreaper():
            say("cannot become a child subreaper: workers orphaned by torchrun are not waited for")
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.on_signal)

        def in_child() -> None:
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)

        # A process group of its own: a terminal's Ctrl-C reaches torchrun only through here
        # (once), never twice.
        self.child = subprocess.Popen(self.command, preexec_fn=in_child, process_group=0)
        if self.stop_reason:  # a signal came before torchrun existed
            os.kill(self.child.pid, signal.SIGTERM)
        killed = False
        while self.reap():
            if not self.stop_reason and read(preempt_marker):
                self.request_stop(f"the workers were preempted ({read(preempt_marker)})")
            if self.status is not None and not self.stop_deadline:
                # torchrun is gone: what it left (loader workers, say) gets the same grace
                self.stop_deadline = time.monotonic() + self.grace_s
            if self.stop_deadline and time.monotonic() > self.stop_deadline:
                self.kill_leftovers(quiet=killed)  # again each round: their children come next
                killed = True
            time.sleep(POLL_S)
        if self.repeats:
            say(f"{self.repeats} more stop signal(s) arrived meanwhile: the same request")
        return self.exit_code(read(preempt_marker), read(no_progress_marker))

    def exit_code(self, preempted: str, no_progress: str) -> int:
        status = self.status if self.status is not None else 1
        if no_progress:
            say(f"no progress ({no_progress}): exit {EXIT_NO_PROGRESS}, do not restart")
            return EXIT_NO_PROGRESS
        if preempted:
            say(f"the workers checkpointed ({preempted}); torchrun {describe(status)}: exit 75")
            return EXIT_PREEMPTED
        if self.stop_reason:
            say(f"{self.stop_reason}, but no preemption checkpoint was reported")
            return status if status != 0 else 1
        return 128 - status if status < 0 else status


def describe(status: int) -> str:
    if status < 0:
        return f"signal {signal.Signals(-status).name}"
    return f"exit {status}"


def main(argv: list[str]) -> int:
    if "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    if not argv:
        print("usage: supervise.py -- COMMAND...", file=sys.stderr)
        return 2
    try:
        grace_s = float(os.environ.get("SUPERVISE_GRACE_S", "120"))
    except ValueError:
        grace_s = -1
    if not grace_s > 0:
        print(
            f"supervise.py: SUPERVISE_GRACE_S={os.environ['SUPERVISE_GRACE_S']} is not a "
            "positive number of seconds",
            file=sys.stderr,
        )
        return 2
    markers = []
    for name, prefix in (
        ("TRAIN_PREEMPT_MARKER", "train-preempted."),
        ("TRAIN_NO_PROGRESS_MARKER", "train-no-progress."),
    ):
        fd, path = tempfile.mkstemp(prefix=prefix)
        os.close(fd)
        os.environ[name] = path
        markers.append(Path(path))
    try:
        return Supervisor(argv, grace_s).run(*markers)
    finally:
        for marker in markers:
            marker.unlink(missing_ok=True)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Exit at once, handlers still in place: a stop signal during the interpreter's shutdown
    # (srun's --kill-on-bad-exit SIGTERM when another node exited 75 first) would find the
    # default action restored and turn this 75 into 'killed by SIGTERM'.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
