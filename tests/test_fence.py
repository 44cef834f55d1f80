"""The run dir's fence (ckpt/fence.py): once the next lease generation exists, the old holder
writes and deletes nothing more under the run dir, whatever its heartbeat last saw.

The takeover runs with two real training processes of the same job id (a Slurm requeue while
the old copy still runs on a node cut off from the controller); the fence's unit tests use
real files and a real lease in this process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REPO, tiny_job_args, train_command

from ckpt import atomic, fence, retention, rundir


def snapshot(run_dir: Path) -> dict[str, tuple[int, int, int]]:
    """{path under run_dir: (inode, mtime in ns, bytes)} of every file and folder but the
    lease files: a write changes the inode (a rename into place) or the mtime (an append), a
    deletion removes the entry."""
    found = {}
    for path in run_dir.rglob("*"):
        if path.parent == run_dir and re.fullmatch(r"lease\.\d+\.json", path.name):
            continue
        try:
            stat = path.stat()
        except FileNotFoundError:  # deleted while listed
            continue
        found[str(path.relative_to(run_dir))] = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    return found


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert proc.poll() is None, f"the process ended ({proc.returncode}) before {what}"
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("nproc", "settings"),
    [
        (None, {"ckpt_async_save": False}),
        (None, {"ckpt_async_save": True}),
        (2, {"ckpt_async_save": True, "dist_strategy": "fsdp", "ckpt_format": "sharded"}),
    ],
    ids=["sync", "async", "fsdp-sharded-async-2-ranks"],
)
def test_the_old_copy_writes_and_deletes_nothing_once_the_same_job_takes_over(
    tmp_path, nproc, settings
) -> None:
    """Slurm job 4242 trains with a checkpoint at every step (ckpt.keep=2) and is held after
    step 5; a second copy of job 4242 takes the run dir's lease over (same job id: at once)
    and holds, before it writes anything, until the old copy has exited. Once lease.2.json
    exists and the old copy goes on, it must change no file of the run dir (checkpoints,
    manifests, best.json, metrics.jsonl, TensorBoard's events, progress.json) and delete
    none, and exit 2 naming the new holder; the new copy then resumes from the checkpoint
    that was newest at the takeover. Under torchrun (2 ranks, fsdp, sharded checkpoints
    written by each rank's writer process) every rank's files are fenced too.

    Before the fix the old copy went on until its next heartbeat (every
    run.lease_timeout_s/4 = 15 s): "7 written, 4 deleted" (sync), the deleted being both
    checkpoints there were at the takeover, the one the new copy was to resume from among
    them. Taken over at a random instant instead (not held): the same in sync and async, and
    17 written, 13 deleted at 2 ranks."""
    run_dir, go, old_go = tmp_path / "run", tmp_path / "go", tmp_path / "old-go"
    args = tiny_job_args(
        run_dir,
        data_synthetic_train_size=40000,  # 2500 steps: the old copy never ends by itself
        train_epochs=1,
        ckpt_every_steps=1,
        ckpt_keep=2,
        log_every_steps=1,
        log_tensorboard=True,
        dist_preflight=False,
        run_lease_timeout_s=60,
        **settings,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "4242"}
    old_log, new_log = (tmp_path / "old.log").open("w+"), (tmp_path / "new.log").open("w+")
    # Held at a step boundary: a write checked an instant before the takeover may still land
    # (the fence is a look-up, not a lock), so the takeover comes while none is under way.
    old = subprocess.Popen(
        train_command(nproc, *args, script="tests/faults.py"),
        cwd=REPO,
        env={**env, "TRAIN_FAULTS": f"gate@step=5,file={old_go}"},
        stdout=old_log,
        stderr=subprocess.STDOUT,
    )
    new = None
    try:
        wait_for(Path(f"{old_go}.waiting").exists, old, "the old copy's step 5", timeout=240)
        new = subprocess.Popen(
            train_command(nproc, *args, script="tests/faults.py"),
            cwd=REPO,
            env={**env, "TRAIN_FAULTS": f"gate@prepare=begin,file={go}"},
            stdout=new_log,
            stderr=subprocess.STDOUT,
        )
        wait_for((run_dir / "lease.2.json").exists, new, "the takeover")
        at_takeover = snapshot(run_dir)
        old_go.touch()
        old_code = old.wait(timeout=180)
        after = snapshot(run_dir)
        assert new.poll() is None  # held at its gate: it wrote nothing either
        # The old copy's temporary files never become a checkpoint: one it was filling at the
        # takeover may have grown, none may have been started.
        temporary = re.compile(r"(^|/)\.[^/]*\.tmp$")
        assert {p for p in after if temporary.search(p)} <= set(at_takeover)
        at_takeover = {p: v for p, v in at_takeover.items() if not temporary.search(p)}
        after = {p: v for p, v in after.items() if not temporary.search(p)}
        written = sorted(after.keys() - at_takeover.keys())
        written += sorted(p for p in after.keys() & at_takeover if after[p] != at_takeover[p])
        deleted = sorted(at_takeover.keys() - after.keys())
        assert (written, deleted) == ([], []), f"{len(written)} written, {len(deleted)} deleted"
        newest = retention.list_checkpoints(run_dir / "checkpoints")
        resumable = [p for _, p in newest if retention.manifest_path(p).exists()][-1]
        go.touch()
        wait_for(lambda: "resuming from" in Path(new_log.name).read_text(), new, "the resume")
        new.send_signal(signal.SIGTERM)  # a preemption: the new copy checkpoints, exits 75
        new_code = new.wait(timeout=180)
    finally:
        for proc in (old, new):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        old_log.close()
        new_log.close()
    old_output, new_output = (Path(f.name).read_text() for f in (old_log, new_log))
    assert "was taken over by job slurm-4242" in old_output, old_output[-3000:]
    if nproc is None:
        assert (old_code, new_code) == (2, 75)
    else:  # torchrun reports a worker's exit code in its summary and exits 1 itself
        assert old_code != 0 and "exitcode: 2" in old_output, old_output[-3000:]
        assert "checkpoint written, exiting with code 75" in new_output, new_output[-3000:]
    assert f"resuming from {resumable} at step" in new_output, new_output[-3000:]


# ---------------------------------------------------------------------------------------------
# The fence itself: real files, a real lease taken over by the same job


@pytest.fixture
def taken_over(tmp_path, monkeypatch):
    """A run dir whose lease job 5 holds (`old`, heartbeat every 15 s: it has not looked
    since) and a restart of job 5 has just taken over (`new`); yields (run_dir, old)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    old = rundir.Lease(run_dir, 60.0)
    old.acquire()
    new = rundir.Lease(run_dir, 60.0)
    new.acquire()  # the same job: at once; this process now holds the new fence
    fence.hold(old.fence)  # the old copy's process, as it was before the takeover
    try:
        yield run_dir, old
    finally:
        fence.hold(None)
        old.release()
        new.release()


def test_the_lease_check_looks_on_disk_not_at_the_heartbeats_flag(taken_over) -> None:
    """Before the fix `check()` passed here: the heartbeat (every 15 s) had not run yet."""
    run_dir, old = taken_over
    assert old.stop_reason() == ""  # the flag still says the lease is held
    with pytest.raises(rundir.RunDirBusy, match="taken over by job slurm-5 .* generation 2"):
        old.check()
    assert not old.valid()
    assert old.stop_reason().startswith("another job took the run dir's lease over")


def test_no_write_and_no_deletion_in_a_run_dir_taken_over(taken_over, tmp_path) -> None:
    run_dir, _ = taken_over
    checkpoints = run_dir / "checkpoints"
    checkpoints.mkdir()
    for step in (1, 2, 3):  # complete checkpoints, as single.save leaves them
        (checkpoints / f"step_{step}.pt").write_bytes(b"x")
        (checkpoints / f"step_{step}.manifest.json").write_text("{}")
    stale = checkpoints / f".step_4.pt.{os.getpid() + 1}.tmp"  # a killed save's leftover
    stale.write_bytes(b"x")
    before = snapshot(run_dir)
    with pytest.raises(rundir.RunDirBusy):
        atomic.write_bytes(run_dir / "progress.json", lambda f: f.write(b"{}"))
    with pytest.raises(rundir.RunDirBusy):
        retention.after_save(checkpoints, 3, 1, 0.5)  # best.json, then pruning steps 1 and 2
    with pytest.raises(rundir.RunDirBusy):
        retention.remove_stale_temporaries(checkpoints)
    with pytest.raises(rundir.RunDirBusy):
        retention.remove(checkpoints / "step_1.pt")
    assert snapshot(run_dir) == before
    # Anywhere else the fence does not apply.
    atomic.write_bytes(tmp_path / "exported.json", lambda f: f.write(b"{}"))
    assert (tmp_path / "exported.json").read_bytes() == b"{}"


def test_a_write_is_not_finished_once_the_run_dir_is_taken_over_meanwhile(tmp_path) -> None:
    """The takeover lands while the bytes are written: the file is never renamed into place
    (its temporary file stays, for the new holder's next save to remove)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "lease.1.json").write_text('{"job": "slurm-5", "generation": 1}')  # this job's
    fence.hold(fence.Fence(run_dir, 1))
    try:

        def write_while_taken_over(f) -> None:
            f.write(b"new bytes")
            (run_dir / "lease.2.json").write_text('{"job": "slurm-6", "generation": 2}')

        with pytest.raises(rundir.RunDirBusy, match="taken over by job slurm-6"):
            atomic.write_bytes(run_dir / "metrics.jsonl", write_while_taken_over)
    finally:
        fence.hold(None)
    assert not (run_dir / "metrics.jsonl").exists()
    assert [p.name for p in run_dir.glob(".*.tmp")] == [f".metrics.jsonl.{os.getpid()}.tmp"]


def test_a_ranks_shard_is_not_written_in_a_run_dir_taken_over(tmp_path) -> None:
    """Every rank writes its own file of a sharded checkpoint (a writer process runs the
    same function): a rank holding generation 1 writes nothing once generation 2 exists."""
    import torch

    from ckpt import sharded

    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints" / "step_3"
    folder.mkdir(parents=True)
    (run_dir / "lease.1.json").write_text('{"job": "slurm-5", "generation": 1}')  # this job's
    (run_dir / "lease.2.json").write_text('{"job": "slurm-6", "generation": 2}')
    payload = {"tensors": {"/model/w": torch.ones(2)}, "rows": {"/model/w": [0, 2]}}
    plan = sharded.ShardedSave(folder, 3, {"mine": (folder / "rank_1.ab12.pt", payload)})
    fence.hold(fence.Fence(run_dir, 1))
    try:
        with pytest.raises(rundir.RunDirBusy):
            sharded.write_sharded(plan)
    finally:
        fence.hold(None)
    assert list(folder.iterdir()) == []
    assert sharded.write_sharded(plan)  # no fence held: written (the fence did refuse it)


def test_a_holder_whose_successor_came_and_went_does_not_write_again(tmp_path, monkeypatch) -> None:
    """A restart of job 8 takes the lease over and releases it at once (say it found the run
    finished), removing generations 1 and 2. The old copy's next heartbeat finds no
    generation 2 to stop it: before the fix it renewed lease.1.json (recreating it) and held
    the run dir again, so the fence would let it write ("the old holder never noticed")."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    old = rundir.Lease(run_dir, 2.0)  # renews every 0.5 s
    old.acquire()
    try:
        new = rundir.Lease(run_dir, 60.0)
        new.acquire()
        new.release()
        assert not list(run_dir.glob("lease.*.json"))
        deadline = time.monotonic() + 30
        while not old.lost_to:  # its next heartbeat
            assert time.monotonic() < deadline, "the old holder never noticed"
            time.sleep(0.05)
        time.sleep(1.0)  # two more heartbeats' time: it renews nothing
        assert not list(run_dir.glob("lease.*.json"))
        with pytest.raises(rundir.RunDirBusy, match="removed lease.1.json"):
            old.check()
    finally:
        old.release()


def test_a_heartbeat_from_the_future_is_named_as_clock_skew() -> None:
    """Before, a holder whose host clock ran ahead showed 'heartbeat -100 s ago'."""
    from ckpt import fence

    holder = {"job": "j", "host": "h", "pid": 1, "generation": 2, "heartbeat": 1100.0}
    assert fence.describe(holder, now=1000.0).endswith("heartbeat 100 s in the future: clock skew)")
    assert fence.describe(holder, now=1130.0).endswith("heartbeat 30 s ago)")


def test_a_successor_that_came_and_released_the_run_dir_still_fences_the_old_copy(
    tmp_path,
) -> None:
    """Generation 2 took over and released the run dir, removing every generation up to its
    own (ckpt/rundir.py, Lease.release): no lease.2.json is left to stop the old copy, and a
    fresh job may hold generation 1 again. Before the review's fix the check passed here, and
    the old copy wrote until its heartbeat saw its own file gone; now its own file's absence
    stops it at once (the writer process and the other ranks have no heartbeat at all)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    mine = run_dir / "lease.1.json"
    mine.write_text('{"job": "slurm-5", "generation": 1}')
    fence.hold(fence.Fence(run_dir, 1))
    try:
        atomic.write_bytes(run_dir / "progress.json", lambda f: f.write(b"{}"))  # still held
        mine.unlink()  # generation 2 came, and released the run dir
        with pytest.raises(rundir.RunDirBusy, match="its lease is released"):
            atomic.write_bytes(run_dir / "progress.json", lambda f: f.write(b"[]"))
    finally:
        fence.hold(None)
    assert (run_dir / "progress.json").read_bytes() == b"{}"
