"""Run torchrun under a supervisor that turns stop signals, however they arrive, into one
checkpoint and a launcher exit code a scheduler can act on.

    python scripts/supervise.py -- python -m torch.distributed.run ... train.py ...

scripts/launch_multinode.sh and scripts/train_single_node.sh exec this; use it directly only
to wrap a torchrun command of your own. Exit codes:

    0   finished (also when a stop signal came while the run was finishing anyway)
    2, 3  bad input, diverged (reported by the workers): retrying cannot help
    74  torchrun failed, and transient storage errors ended an attempt: retry later
    75  preempted: the workers wrote their preemption checkpoint (or were stopped before any
        of them started); requeue / resubmit
    76  no progress: attempts keep starting from the same checkpoint; do not restart
    *   otherwise torchrun's own code (128 + N when a signal N killed it)

SUPERVISE_GRACE_S (default 120 s) bounds the wait for the workers' preemption checkpoint,
torchrun's shutdown timeout included. What it does with each signal, orphaned workers and
the marker files, and why: docs/fault-tolerance.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's modules
from exitcodes import (  # noqa: E402
    BAD_INPUT_MARKER,
    DIVERGED_MARKER,
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_IO,
    EXIT_NO_PROGRESS,
    EXIT_PREEMPTED,
    IO_MARKER,
    LAUNCHER_STOP_SIGNALS,
    NO_PROGRESS_MARKER,
    PREEMPT_MARKER,
    STOP_MARKER,
)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.2
SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
TORCHRUN_DEFAULT_SHUTDOWN_S = 30  # torch/distributed/launcher/api.py, when nothing is set


def say(message: str) -> None:
    print(f"supervise.py: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


LIBC = _libc()  # loaded before any fork: the child calls prctl through it


def prctl(option: int, value: int) -> bool:
    try:
        return LIBC is not None and LIBC.prctl(option, value, 0, 0, 0) == 0
    except AttributeError:  # not Linux
        return False


def become_subreaper() -> bool:
    """Orphaned descendants (workers whose torchrun died) are reparented to this process."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


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
    def __init__(self, command: list[str], grace_s: float, markers: dict[str, Path]) -> None:
        self.command = command
        self.grace_s = grace_s
        self.markers = markers  # the workers' reports: preempted, no_progress, bad_input, ...
        self.signals: list[int] = []  # received, not yet acted on (handlers only append)
        self.stop_reason = ""  # why the workers were asked to stop ('' = not asked)
        self.stop_deadline = 0.0
        self.repeats = 0
        self.child: subprocess.Popen | None = None
        self.status: int | None = None  # torchrun's exit status once reaped
        self.workers_seen = False  # torchrun started workers (training may have begun)

    def on_signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)  # nothing else here: the loop acts within POLL_S

    def request_stop(self, reason: str) -> None:
        """SIGTERM to torchrun (it forwards it to its workers) and to each worker directly:
        torchrun handles signals only once its workers run, and may have died already."""
        self.stop_reason = reason
        self.stop_deadline = time.monotonic() + self.grace_s
        say(f"{reason}: asking the workers to checkpoint and stop")
        targets = children_of(os.getpid())
        if self.child is not None and self.status is None:
            targets += children_of(self.child.pid)
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

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
                f"{len(pids)} process(es) still running {self.grace_s:g} s after the workers "
                f"were asked to stop (SUPERVISE_GRACE_S): SIGKILL to {pids}"
            )
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def step(self) -> None:
        """One round of the loop: act on signals and on what the workers reported."""
        while self.signals:
            signum = self.signals.pop(0)
            if self.stop_reason:
                self.repeats += 1
            else:
                with contextlib.suppress(OSError, KeyError):  # before the workers hear of it
                    Path(os.environ[STOP_MARKER]).write_text(signal.Signals(signum).name)
                self.request_stop(f"{describe(-signum).removeprefix('signal ')} received")
        if self.child is not None and self.status is None and not self.workers_seen:
            self.workers_seen = bool(children_of(self.child.pid))
        reported = {name: read(path) for name, path in self.markers.items()}
        if not self.stop_reason:
            if reported["preempted"].startswith("checkpoint"):
                # The workers were signalled without this process: stop torchrun restarting them.
                self.request_stop(f"the workers were preempted ({reported['preempted']})")
            elif reported["no_progress"] or reported["bad_input"] or reported["diverged"]:
                # Final for this launch: restarts would fail the same way again.
                self.request_stop(
                    reported["no_progress"] or reported["bad_input"] or reported["diverged"]
                )
            elif self.status is not None and children_of(os.getpid()):
                # torchrun died on its own (OOM killer, a kill -9) and left training workers.
                self.request_stop(f"torchrun ended with {describe(self.status)}")
        if self.status is not None and not self.stop_deadline:
            # torchrun is gone: what it left (loader workers, say) gets the same grace
            self.stop_deadline = time.monotonic() + self.grace_s

    def run(self) -> int:
        if not become_subreaper():
            say("cannot become a child subreaper: workers orphaned by torchrun are not waited for")
        for sig in LAUNCHER_STOP_SIGNALS:
            signal.signal(sig, self.on_signal)

        me = os.getpid()

        def in_child() -> None:
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            # This process's death, even by SIGKILL, is a stop request to torchrun, which
            # then stops its workers as for any SIGTERM: nothing trains on without a launcher.
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != me:  # died before the prctl: the signal would never come
                os._exit(128 + signal.SIGTERM)

        # A process group of its own: a terminal's Ctrl-C reaches torchrun only through here
        # (once), never twice.
        self.child = subprocess.Popen(self.command, preexec_fn=in_child, process_group=0)
        killed = False
        while self.reap():
            self.step()
            if self.stop_deadline and time.monotonic() > self.stop_deadline:
                self.kill_leftovers(quiet=killed)  # again each round: their children come next
                killed = True
            time.sleep(POLL_S)
        self.step()  # signals that came at the very end
        if self.repeats:
            say(f"{self.repeats} more stop signal(s) arrived meanwhile: the same request")
        return self.exit_code({name: read(path) for name, path in self.markers.items()})

    def exit_code(self, reported: dict[str, str]) -> int:
        status = self.status if self.status is not None else 1
        if reported["no_progress"]:
            say(f"{reported['no_progress']}: exit {EXIT_NO_PROGRESS}, do not restart")
            return EXIT_NO_PROGRESS
        if reported["bad_input"]:
            say(f"{reported['bad_input']}: exit {EXIT_BAD_INPUT}, retrying cannot help")
            return EXIT_BAD_INPUT
        if reported["diverged"]:
            say(f"the workers {reported['diverged']}: exit {EXIT_DIVERGED}, do not restart")
            return EXIT_DIVERGED
        if reported["preempted"].startswith("finished"):
            say(f"the workers {reported['preempted']}: exit 0")
            return 0
        if reported["preempted"]:
            say(f"the workers checkpointed ({reported['preempted']}); torchrun {describe(status)}")
            return EXIT_PREEMPTED
        if self.stop_reason and not self.workers_seen:
            say(f"{self.stop_reason} before any worker started: nothing to checkpoint, exit 75")
            return EXIT_PREEMPTED
        code = 128 - status if status < 0 else status
        if code and reported["io_error"] and not self.stop_reason:
            # torchrun's restarts are spent, and storage errors ended one: retryable, as 74
            say(f"the workers reported {reported['io_error']}: exit {EXIT_IO}, retry later")
            return EXIT_IO
        if self.stop_reason:
            say(f"{self.stop_reason}, but no preemption checkpoint was reported")
            return code or 1
        return code


def describe(status: int) -> str:
    if status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:  # a real-time signal
            return f"signal {-status}"
    return f"exit {status}"


def torchrun_python(command: list[str]) -> str | None:
    """The interpreter that runs torchrun in `command` (None when it is not torchrun)."""
    for i, arg in enumerate(command[:-1]):
        if arg == "-m" and command[i + 1] in ("torch.distributed.run", "torchrun"):
            return command[0]
    if command and Path(command[0]).name == "torchrun":
        found = shutil.which(command[0])
        with contextlib.suppress(OSError, UnicodeDecodeError):
            first = Path(found).read_text().splitlines()[0] if found else ""
            if first.startswith("#!"):
                return first[2:].split()[0]
    return None


def torch_source(python: str) -> Path | None:
    """Where that interpreter's torch package lies, found without importing torch (fast)."""
    probe = "import importlib.util as u; s = u.find_spec('torch'); print(s.origin if s else '')"
    try:
        done = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    origin = done.stdout.strip()
    return Path(origin).parent if origin else None


def torch_version(package: Path) -> str:
    for line in read(package / "version.py").splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("'\"")
    return "?"


def requested_shutdown_timeout(command: list[str]) -> tuple[str, str] | None:
    """(setting, value) of a shutdown timeout the command or environment gives torchrun, in
    torchrun's order: the flag, then PET_SHUTDOWN_TIMEOUT (argparse_util.env), then
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT (LaunchConfig.__post_init__)."""
    for i, arg in enumerate(command):
        for flag in ("--shutdown-timeout", "--shutdown_timeout"):
            if arg.startswith(f"{flag}="):
                return flag, arg.split("=", 1)[1]
            if arg == flag and i + 1 < len(command):
                return flag, command[i + 1]
    for variable in ("PET_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT):
        if os.environ.get(variable):
            return variable, os.environ[variable]
    return None


def size_shutdown_timeout(command: list[str], grace_s: float) -> str:
    """Give torchrun a shutdown timeout of SUPERVISE_GRACE_S (docs/fault-tolerance.md); say what
    the budget really is. Returns an error message for a setting torchrun would crash on."""
    python = torchrun_python(command)
    package = torch_source(python) if python else None
    if package is None:
        return ""  # not torchrun, or a torch this process cannot find: nothing to size
    launcher_api = read(package / "distributed" / "launcher" / "api.py")
    if SHUTDOWN_TIMEOUT not in launcher_api:
        say(
            f"warning: torch {torch_version(package)} has no {SHUTDOWN_TIMEOUT}: its torchrun "
            f"SIGKILLs the workers {TORCHRUN_DEFAULT_SHUTDOWN_S} s after a stop signal, so the "
            f"preemption checkpoint must be written within {TORCHRUN_DEFAULT_SHUTDOWN_S} s, "
            f"not SUPERVISE_GRACE_S={grace_s:g} s. A torch with torchrun's --shutdown-timeout "
            "gives the whole grace"
        )
        return ""
    requested = requested_shutdown_timeout(command)
    if requested is None:
        os.environ[SHUTDOWN_TIMEOUT] = str(math.ceil(grace_s))
        say(f"preemption budget {grace_s:g} s (SUPERVISE_GRACE_S = torchrun's {SHUTDOWN_TIMEOUT})")
        return ""
    setting, value = requested
    if not value.isdigit():  # torchrun parses it with int(): anything else is a traceback
        return f"{setting}={value} is not a whole number of seconds"
    budget = min(grace_s, int(value))
    say(
        f"preemption budget {budget:g} s: the smaller of SUPERVISE_GRACE_S={grace_s:g} and "
        f"torchrun's {setting}={value}"
    )
    return ""


def main(argv: list[str]) -> int:
    if "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    if not argv:
        print("usage: supervise.py -- COMMAND...", file=sys.stderr)
        return EXIT_BAD_INPUT
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
        return EXIT_BAD_INPUT
    problem = size_shutdown_timeout(argv, grace_s)
    if problem:
        print(f"supervise.py: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # What the workers report (train.py; local rank 0 of each node writes its node's file).
    markers = {}
    for name, variable in (
        ("preempted", PREEMPT_MARKER),
        ("no_progress", NO_PROGRESS_MARKER),
        ("bad_input", BAD_INPUT_MARKER),
        ("diverged", DIVERGED_MARKER),
        ("io_error", IO_MARKER),
        ("stop", STOP_MARKER),  # written by this process (step), not by the workers
    ):
        fd, path = tempfile.mkstemp(prefix=f"train-{name}.")
        os.close(fd)
        os.environ[variable] = path
        markers[name] = Path(path)
    try:
        return Supervisor(argv, grace_s, markers).run()
    finally:
        for marker in markers.values():
            marker.unlink(missing_ok=True)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Exit at once, handlers still in place: a stop signal during the interpreter's shutdown
    # (srun's --kill-on-bad-exit SIGTERM when another node exited 75 first) would find the
    # default action restored and turn this 75 into 'killed by SIGTERM'.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
