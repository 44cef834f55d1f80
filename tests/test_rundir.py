"""The run dir's lease (rundir.Lease): one job per run dir, taken over by exactly one job.

Every race runs with real processes: two contenders started on the same instant, a holder in
another PID namespace (`unshare --pid --fork --mount-proc`, root), a holder stopped with
SIGSTOP past the timeout. A failed read (ESTALE from NFS) is simulated in-process: this
machine's kernel has no NFS client or server (/proc/filesystems lists neither nfs nor nfsd, and
there are no modules to load), so a real export on loopback cannot run here.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, launch, rows, tiny_job_args, train_command, wait_for_train_rows

from ckpt import rundir

# A lease holder or contender in its own process: `python -c PROGRAM MODE ARGS`.
#   hold DIR TIMEOUT      take the lease, print "held", then check it every 50 ms; once it is
#                         lost print "stopped: <why>" and exit 3
#   take DIR TIMEOUT      take the lease or be refused: print "won" (and hold it until killed)
#                         or "refused: <why>" and exit 2
#   contend BASE N WHO    touch BASE/ready-WHO, then for trials 0..N-1: wait for
#                         BASE/trial-K/go, take the lease of
#                         BASE/trial-K once, write "won" or "refused" to BASE/trial-K/WHO
PROGRAM = f"""
import sys, time
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from ckpt import rundir

mode = sys.argv[1]
if mode == "contend":
    base, trials, who = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    held = []
    (base / f"ready-{{who}}").touch()
    for trial in range(trials):
        run_dir = base / f"trial-{{trial}}"
        while not (run_dir / "go").exists():
            time.sleep(0.0002)
        lease = rundir.Lease(run_dir, 60.0)
        try:
            lease.acquire()
            outcome = "won"
            held.append(lease)
        except rundir.RunDirBusy as err:
            outcome = f"refused: {{err}}"
        (run_dir / who).write_text(outcome)
    time.sleep(2)
    sys.exit(0)
run_dir, timeout = Path(sys.argv[2]), float(sys.argv[3])
lease = rundir.Lease(run_dir, timeout)
try:
    lease.acquire()
except rundir.RunDirBusy as err:
    print("refused:", err, flush=True)
    sys.exit(2)
print("won" if mode == "take" else "held", flush=True)
while True:
    time.sleep(0.05)
    if mode == "hold":
        try:
            lease.check()
        except Exception as err:
            print("stopped:", type(err).__name__, err, flush=True)
            sys.exit(3)
"""


def lease_process(mode: str, *args: str, env: dict[str, str] | None = None, prefix=()):
    """Start PROGRAM in MODE; stdout is a pipe (text), stderr goes with it."""
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", PROGRAM, mode, *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def first_line(proc: subprocess.Popen, timeout: float = 120) -> str:
    """The process's first line of output that is not logging (it starts with won/held/...)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(("won", "held", "refused", "stopped")):
            return line.strip()
    raise AssertionError(f"no outcome from {proc.args[3]} (exit {proc.poll()})")


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


# ---------------------------------------------------------------------------------------------
# Takeover is a one-winner step


@pytest.mark.slow
def test_two_contenders_for_a_dead_holders_lease_never_both_win(tmp_path) -> None:
    """20 trials: a holder that died (SIGKILL) leaves its lease; two jobs started on the same
    instant both try to take it over. Exactly one may win in every trial (issue 21: both won
    17 of 20 times when the takeover was read-then-write)."""
    trials = 20
    dirs = [tmp_path / f"trial-{k}" for k in range(trials)]
    for run_dir in dirs:
        run_dir.mkdir()
    # One holder per trial would cost a torch import each: hold them all from one process.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from ckpt import rundir\n"
            "leases = [rundir.Lease(__import__('pathlib').Path(d), 60.0) for d in sys.argv[1:]]\n"
            "[lease.acquire() for lease in leases]\nprint('held', flush=True)\ntime.sleep(600)",
            *map(str, dirs),
        ],
        env={**os.environ, "SLURM_JOB_ID": "2"},
        stdout=subprocess.PIPE,
        text=True,
    )
    contenders = []
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.kill()  # dies holding all of them
        holder.wait()
        contenders = [
            lease_process("contend", str(tmp_path), str(trials), who, env={"SLURM_JOB_ID": job})
            for who, job in (("a", "10"), ("b", "11"))
        ]
        deadline = time.monotonic() + 240  # both import torch (via checkpoint): slow on CI
        while not all((tmp_path / f"ready-{who}").exists() for who in "ab"):
            assert time.monotonic() < deadline and all(p.poll() is None for p in contenders)
            time.sleep(0.1)
        for run_dir in dirs:
            (run_dir / "go").touch()
            deadline = time.monotonic() + 60
            while not ((run_dir / "a").exists() and (run_dir / "b").exists()):
                assert time.monotonic() < deadline, [p.poll() for p in contenders]
                time.sleep(0.01)
        outcomes = [((d / "a").read_text(), (d / "b").read_text()) for d in dirs]
        winners = [[o.split(":")[0] for o in outcome].count("won") for outcome in outcomes]
        assert winners == [1] * trials, outcomes
    finally:
        stop(holder, *contenders)


# ---------------------------------------------------------------------------------------------
# Who holds it: a host name does not identify a PID namespace


needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a new PID namespace needs root and unshare (util-linux)",
)


@pytest.mark.slow
@needs_unshare
def test_a_live_holder_in_another_pid_namespace_keeps_the_lease(tmp_path) -> None:
    """A job in its own PID namespace on the same host (a --network=host container, a
    hostNetwork pod: same host name) cannot see the holder's pid; it must not take the live
    holder's lease as if the holder had exited (issue 21: it did, heartbeat 0 s old). The
    holder here is in the root namespace and the newcomer in a new one, and the other way."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    isolated = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")
    holder = lease_process("hold", str(run_dir), "60", env={"SLURM_JOB_ID": "100"})
    newcomers: list[subprocess.Popen] = []
    try:
        assert first_line(holder) == "held"
        newcomer = lease_process(
            "take", str(run_dir), "60", env={"SLURM_JOB_ID": "200"}, prefix=isolated
        )
        newcomers.append(newcomer)
        outcome = first_line(newcomer)
        assert outcome.startswith("refused:") and "in use by job slurm-100" in outcome, outcome
        time.sleep(1)
        assert holder.poll() is None  # it still holds the lease and trains on
    finally:
        stop(holder, *newcomers)
    # The other way round: the holder in a new namespace (its pid there is small, and a pid
    # with that number is alive in the root namespace: pid 1, say), the holder SIGKILLed. The
    # newcomer cannot tell from pids alone, so it waits for the heartbeat to go stale.
    shutil.rmtree(run_dir)
    run_dir.mkdir()
    holder = lease_process("hold", str(run_dir), "60", env={"SLURM_JOB_ID": "300"}, prefix=isolated)
    try:
        assert first_line(holder) == "held"
        newcomer = lease_process("take", str(run_dir), "60", env={"SLURM_JOB_ID": "400"})
        newcomers.append(newcomer)
        outcome = first_line(newcomer)
        assert outcome.startswith("refused:") and "in use by job slurm-300" in outcome, outcome
    finally:
        stop(holder, *newcomers)


# ---------------------------------------------------------------------------------------------
# A failed read never writes; a silent holder stops itself


@pytest.mark.slow
def test_a_failed_heartbeat_read_never_writes_over_the_new_holder(tmp_path, monkeypatch) -> None:
    """The holder's reads of the lease fail (ESTALE: NFS replaced the file under it) while a
    restart of the same job (a Slurm requeue while this incarnation still runs on a node cut
    off from the controller) takes the lease over. The old holder must neither write over the
    new holder's lease nor go on as the holder (issue 21: a failed read made the heartbeat
    write its own record back over the new holder)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    old = rundir.Lease(run_dir, 2.0)  # renews every 0.5 s
    old.acquire()
    new = lease_process("take", str(run_dir), "60", env={"SLURM_JOB_ID": "7"})
    third = None
    try:
        assert first_line(new) == "won"  # the same job: it takes the lease over at once
        real_read_text = Path.read_text

        def stale(path: Path, *args, **kwargs) -> str:
            if path.parent == run_dir and path.name.startswith("lease"):
                raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(path))
            return real_read_text(path, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", stale)  # this process only: the old holder
        time.sleep(2.5)  # five of its heartbeats, every read failing
        # It cannot read who took over, but it knows it may no longer write.
        with pytest.raises((rundir.RunDirBusy, rundir.LeaseExpired)):
            old.check()
        monkeypatch.setattr(Path, "read_text", real_read_text)
        third = lease_process("take", str(run_dir), "60", env={"SLURM_JOB_ID": "9"})
        outcome = first_line(third)
        assert f"in use by job slurm-7 (host {os.uname().nodename}, pid {new.pid}" in outcome
    finally:
        monkeypatch.undo()
        old.release()
        stop(new, *([third] if third else []))


@pytest.mark.slow
def test_a_stopped_holder_is_taken_over_and_stops_itself_without_writing(tmp_path) -> None:
    """A holder SIGSTOPped past its timeout (a suspended job, a frozen VM) is taken over by
    another job; once continued it stops itself, names the new holder and writes nothing."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = lease_process("hold", str(run_dir), "5", env={"SLURM_JOB_ID": "1"})
    newcomer = None
    try:
        assert first_line(holder) == "held"
        holder.send_signal(signal.SIGSTOP)
        time.sleep(6)  # past its run.lease_timeout_s
        newcomer = lease_process("take", str(run_dir), "60", env={"SLURM_JOB_ID": "2"})
        assert first_line(newcomer) == "won"  # it renews every 15 s: nothing moves meanwhile
        before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()}
        holder.send_signal(signal.SIGCONT)
        outcome = first_line(holder, timeout=30)
        assert holder.wait(timeout=30) == 3
        assert outcome.startswith("stopped:") and "slurm-2" in outcome, outcome
        after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()}
        assert after == before
    finally:
        stop(holder, *([newcomer] if newcomer else []))


# ---------------------------------------------------------------------------------------------
# Identity: the liveness shortcut only when boot, PID namespace, pid and start time match


def test_a_reused_pid_is_not_the_holder(tmp_path) -> None:
    """The holder's pid now belongs to another process (started at another time): the holder
    has exited, so its lease is taken at once; with the right start time it is refused."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    me = rundir.ProcessId.current()
    assert me.known(), "this test needs /proc of this PID namespace"
    stat = Path("/proc/self/stat").read_text()
    start_ticks = int(stat.rpartition(")")[2].split()[19])  # proc(5): starttime, field 22
    holder = {
        "generation": 1,
        "job": "slurm-5",
        "host": "here",
        "pid": os.getpid(),  # alive: this process
        "boot_id": me.boot_id,
        "pid_ns": me.pid_ns,
        "start_ticks": start_ticks,
        "timeout_s": 60.0,
        "heartbeat": time.time(),
    }
    lease_file = run_dir / "lease.1.json"
    lease_file.write_text(json.dumps(holder))
    with pytest.raises(rundir.RunDirBusy, match="in use by job slurm-5"):
        rundir.Lease(run_dir, 60.0).acquire()
    lease_file.write_text(json.dumps({**holder, "start_ticks": start_ticks - 1}))
    taker = rundir.Lease(run_dir, 60.0)
    taker.acquire()
    try:
        assert taker.generation == 2 and taker.valid()
    finally:
        taker.release()
    assert not list(run_dir.glob("lease.*.json"))  # released: every generation gone


def test_another_boot_or_namespace_is_never_judged_dead(tmp_path) -> None:
    """A record from another boot or PID namespace with a pid that is free here: alive as
    far as this process can tell (only the heartbeat can expire it)."""
    me = rundir.ProcessId.current()
    free_pid = 4_000_000  # above pid_max's ceiling (2^22): never a process
    for other in (
        rundir.ProcessId("another-boot", me.pid_ns, free_pid, 1),
        rundir.ProcessId(me.boot_id, "pid:[1]", free_pid, 1),
        rundir.ProcessId("", "", free_pid, 0),  # an old record, or /proc not ours
    ):
        assert not other.exited(me), other
    assert rundir.ProcessId(me.boot_id, me.pid_ns, free_pid, 1).exited(me)


@pytest.mark.slow
def test_proc_stat_parses_a_command_name_with_spaces_and_parentheses(tmp_path) -> None:
    """proc(5): comm (field 2) may hold ') (' itself; start time is field 22 after it."""
    program = tmp_path / "a) (b c"
    program.symlink_to(shutil.which("sleep"))
    proc = subprocess.Popen([str(program), "30"])
    try:
        time.sleep(0.2)
        pid, state, start = rundir._proc_stat(proc.pid)
        ticks = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        assert (pid, start) == (proc.pid, ticks) and state in "RS"
    finally:
        proc.kill()
        proc.wait()


def test_a_holder_is_judged_by_its_own_timeout_not_the_newcomers(tmp_path) -> None:
    """The holder stops itself at 3/4 of its own run.lease_timeout_s: a newcomer with a shorter
    timeout must still wait for the holder's, or both would write."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {"generation": 1, "job": "slurm-5", "host": "elsewhere", "pid": 1}
    written = time.time()
    record.update(timeout_s=600.0, heartbeat=written - 100)
    (run_dir / "lease.1.json").write_text(json.dumps(record))
    with pytest.raises(rundir.RunDirBusy) as refused:
        rundir.Lease(run_dir, 60.0).acquire()
    took = time.time() - written
    # 600 - 100 s when the refusal comes at once; on a busy machine, less by the time it took.
    expires = re.search(r"expires (\d+) s from now", str(refused.value))
    assert expires and math.floor(500 - took) <= int(expires.group(1)) <= 500, refused.value


def test_a_running_job_of_the_earlier_version_keeps_the_run_dir(tmp_path) -> None:
    """Earlier versions held the run dir with one lease.json, which this version's generation
    files do not see: while its heartbeat is fresh, a newcomer is refused naming it; once it
    is stale, the newcomer takes the dir."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    legacy = run_dir / "lease.json"
    record = {"job": "slurm-9", "host": "node7", "pid": 1234, "started": time.time()}
    legacy.write_text(json.dumps({**record, "heartbeat": time.time() - 5}))
    with pytest.raises(rundir.RunDirBusy, match="slurm-9.*earlier version.*lease.json"):
        rundir.Lease(run_dir, 60.0).acquire()
    assert not list(run_dir.glob("lease.*.json"))  # refused before writing anything
    legacy.write_text(json.dumps({**record, "heartbeat": time.time() - 61}))
    lease = rundir.Lease(run_dir, 60.0)
    lease.acquire()
    try:
        assert lease.generation == 1
    finally:
        lease.release()


# ---------------------------------------------------------------------------------------------
# A training run that loses its lease stops at the next step, on every rank


@pytest.mark.slow
@pytest.mark.e2e
def test_a_run_that_loses_its_lease_stops_at_the_next_step(tmp_path) -> None:
    """torchrun, 2 ranks, Slurm job 77; mid-epoch a restart of job 77 elsewhere (a requeue
    while this incarnation still runs on a node cut off from the controller) takes the lease
    over. Rank 0 sees it at its next renewal (every lease_timeout_s/4 = 1.5 s) and every rank
    stops at the step after that (the per-step vote), not at the epoch's checkpoint 625 steps
    later; nothing more is written to the run dir, and the message names the new holder."""
    run_dir = tmp_path / "run"
    args = tiny_job_args(
        run_dir,
        data_synthetic_train_size=40000,  # 625 steps per epoch at 2 x 16 x 2
        train_grad_accum_steps=2,
        train_epochs=1,
        log_every_steps=1,
        dist_timeout_s=60,
        dist_preflight=False,
        run_lease_timeout_s=6,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "77"}
    log_file = (tmp_path / "job.log").open("w+")
    job = subprocess.Popen(
        train_command(2, *args), cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT
    )
    taker = None
    try:
        wait_for_train_rows(run_dir, job, rows=3, timeout=240)
        taker = lease_process("take", str(run_dir), "60", env={"SLURM_JOB_ID": "77"})
        assert first_line(taker) == "won"
        rows_at_takeover = len(rows(run_dir, "train"))
        kept = {name: (run_dir / name).read_bytes() for name in ("config.json", "progress.json")}
        assert job.wait(timeout=120) != 0
    finally:
        stop(*([taker] if taker else []))
        if job.poll() is None:
            job.kill()
            job.wait()
    log_file.seek(0)
    output = log_file.read()
    log_file.close()
    assert f"was taken over by job slurm-77 (host {os.uname().nodename}, pid {taker.pid}" in output
    assert "exitcode: 2" in output, output[-3000:]
    assert not list((run_dir / "checkpoints").glob("step_*.pt"))  # none: nothing written
    assert {name: (run_dir / name).read_bytes() for name in kept} == kept
    assert "eval" not in {
        row["kind"] for row in map(json.loads, (run_dir / "metrics.jsonl").open())
    }
    # The last step trained: from the refused checkpoint ("saving the step N checkpoint").
    stopped = int(re.search(r"saving the step (\d+) checkpoint", output).group(1))
    last_row = rows(run_dir, "train")[-1]["step"]
    # Rows stop where rank 0 saw the loss (at most one renewal, 1.5 s, after the takeover);
    # the ranks stop at the step after that one (the one in flight, then the vote).
    assert last_row <= stopped <= last_row + 2, (rows_at_takeover, last_row, stopped)
    assert stopped < 625


# ---------------------------------------------------------------------------------------------
# Whole jobs: refused naming the holder, restarts, stale holders (moved from test_faults.py)

JOB = tiny_job_args(
    data_synthetic_train_size=250,
    train_grad_accum_steps=2,
    data_num_workers=1,
    log_every_steps=1,
    dist_timeout_s=20,
    dist_preflight=False,
)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_second_job_in_a_run_dir_is_refused_naming_the_holder(tmp_path) -> None:
    run_dir = tmp_path / "run"
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(
        train_command(None, f"--run.dir={run_dir}", *JOB, "--train.epochs=400"),
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_train_rows(run_dir, first)
        config_before = (run_dir / "config.json").read_bytes()
        second = launch(2, f"--run.dir={run_dir}", *JOB, "--train.epochs=400")
        assert second.returncode != 0
        assert "exitcode: 2" in second.output
        host = socket.gethostname()
        holder = f"job process-{host}-{first.pid}-pidns"
        assert f"is in use by {holder}" in second.output, second.output[-3000:]
        assert f"(host {host}, pid {first.pid}, lease generation 1" in second.output
        assert (run_dir / "config.json").read_bytes() == config_before  # nothing written
        assert first.poll() is None  # the holder trains on
    finally:
        first.kill()
        first.wait()
        log.close()
    # The holder died (same boot and PID namespace, its pid is gone): the next job takes the
    # lease at once.
    third = launch(None, f"--run.dir={run_dir}", *JOB, "--train.epochs=400", "--train.max_steps=2")
    assert third.returncode == 0, third.output[-3000:]
    assert holder in third.output and "has exited" in third.output
    assert not list(run_dir.glob("lease.*.json"))  # released at the end


@pytest.mark.slow
@pytest.mark.e2e
def test_a_lease_from_another_host_is_refused_while_fresh_and_taken_when_stale(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lease = run_dir / "lease.1.json"
    holder = {"generation": 1, "job": "slurm-999", "host": "elsewhere", "pid": 1}
    holder.update(boot_id="another-machine", pid_ns="pid:[4026531836]", start_ticks=10)
    lease.write_text(json.dumps({**holder, "timeout_s": 60, "heartbeat": time.time()}))
    args = (f"--run.dir={run_dir}", *JOB, "--train.max_steps=2", "--run.lease_timeout_s=60")
    refused = launch(None, *args)
    assert refused.returncode == 2, refused.output[-3000:]
    assert "in use by job slurm-999 (host elsewhere, pid 1" in refused.output
    assert "expires" in refused.output
    assert sorted(p.name for p in run_dir.iterdir()) == ["lease.1.json"]  # nothing written
    # The same job restarted (a Slurm requeue keeps the job id) continues at once.
    same_job = launch(None, *args, env={"SLURM_JOB_ID": "999"})
    assert same_job.returncode == 0, same_job.output[-3000:]
    assert "continuing job slurm-999" in same_job.output
    # A holder silent for longer than its timeout is taken over.
    lease.write_text(json.dumps({**holder, "timeout_s": 60, "heartbeat": time.time() - 61}))
    stale = launch(None, *args[:-2], "--train.max_steps=3")
    assert stale.returncode == 0, stale.output[-3000:]
    assert "silent for more than run.lease_timeout_s=60" in stale.output


def test_metrics_are_not_written_once_the_lease_is_taken_over(tmp_path, monkeypatch) -> None:
    """metrics.jsonl is the run dir's too: rows written after another job took the lease over
    (here a restart of the same job, which takes it at once) are dropped, not appended."""
    from metrics import MetricsWriter

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "3")
    old = rundir.Lease(run_dir, 0.4)  # renews (and looks for a successor) every 0.1 s
    old.acquire()
    writer = MetricsWriter(run_dir, True, False, old.valid)
    writer.open()
    writer.write({"kind": "train", "step": 1})
    new = rundir.Lease(run_dir, 60.0)
    new.acquire()
    try:
        deadline = time.monotonic() + 30
        while old.valid():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        writer.write({"kind": "train", "step": 2})
        writer.close()
        assert [row["step"] for row in rows(run_dir, "train")] == [1]
        with pytest.raises(rundir.RunDirBusy, match="taken over by job slurm-3"):
            old.check()
    finally:
        old.release()
        new.release()
    assert not list(run_dir.glob("lease.*.json"))
