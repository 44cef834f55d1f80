"""The run dir's fencing token, looked up on disk before each write and each deletion there.

A job holds the run dir as lease generation N (ckpt/rundir.py); a job that takes it over,
the same job id included (a Slurm requeue while this copy still runs on a node cut off from
the controller), creates generation N + 1. The heartbeat sees that only every
run.lease_timeout_s/4: a write or a deletion trusting its flag lands among the new holder's
files, or removes the checkpoint it resumed from. So `check(path)` stats N + 1's file first
(one stat: cheap beside any write) and raises `RunDirBusy` once it exists, or once N's own
file is gone (a successor that came and went), for good.

The fence is held per process (`hold`): rank 0 holds its lease's, every other rank the same
generation (their files of a sharded checkpoint), a checkpoint writer process the one of the
write it was handed. `check` covers only paths under the held run dir; anywhere else (no
fence held, an exported file) it does nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from config import ConfigError
from runpaths import RunPaths


class RunDirBusy(ConfigError):
    """Another live job holds the run dir's lease (or took it over from this one)."""


def describe(holder: dict[str, Any], now: float | None = None) -> str:
    """A lease record as the messages name its holder."""
    age = (time.time() if now is None else now) - float(holder.get("heartbeat", 0))
    # A heartbeat from the future: this host's clock is behind the holder's, and every age
    # (the lease's expiry) read here is off by as much.
    beat = f"{age:.0f} s ago" if age > -1 else f"{-age:.0f} s in the future: clock skew"
    return (
        f"job {holder.get('job')} (host {holder.get('host')}, pid {holder.get('pid')}, "
        f"lease generation {holder.get('generation')}, heartbeat {beat})"
    )


class Fence:
    """Generation `generation` of run dir `root`'s lease: this process writes there until
    generation + 1 exists. `lost_to` names the new holder once seen (it stays seen)."""

    def __init__(self, root: Path | str, generation: int) -> None:
        self.root = Path(root)
        self.generation = generation
        self.lost_to = ""
        self._prefix = os.path.join(os.path.abspath(self.root), "")

    @property
    def successor(self) -> Path:
        return RunPaths(self.root).lease(self.generation + 1)

    def covers(self, path: Path | str) -> bool:
        """Whether `path` lies under the run dir (by name: no I/O)."""
        return os.path.join(os.path.abspath(path), "").startswith(self._prefix)

    def check(self) -> None:
        """Raise RunDirBusy once generation + 1 exists, or this generation's own file is gone
        (a successor that came and released the run dir removed it, and a later job may hold
        generation 1 again); an OSError when that cannot be told (ESTALE, EIO: a failed
        look-up must never write). One stat, two when the successor's is absent."""
        if not self.lost_to:
            try:
                os.stat(self.successor)
            except FileNotFoundError:
                try:
                    os.stat(RunPaths(self.root).lease(self.generation))
                    return
                except FileNotFoundError:
                    self.lost_to = "a later job (its lease is released, and this job's is gone)"
            else:
                self.lost_to = describe(_record(self.successor))
        raise RunDirBusy(
            f"run.dir={self.root} was taken over by {self.lost_to}, which owns it now: "
            "stopping without writing anything more, so that the two jobs do not overwrite "
            "each other. Do not restart this job in this run dir"
        )


def _record(path: Path) -> dict[str, Any]:
    """The successor's record, or what can be said of a file still being written."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        value = None
    if isinstance(value, dict):
        return value
    return {"job": "unknown (its lease file is being written)", "generation": "?"}


_held: Fence | None = None  # this process's, by `hold`: one run dir per process


def hold(fence: Fence | None) -> None:
    """Check every later write under `fence.root` against it (None: no fence any more)."""
    global _held
    _held = fence


def held() -> Fence | None:
    return _held


def check(path: Path | str) -> None:
    """Before a write or a deletion of `path`: raise RunDirBusy if it lies in the run dir
    this process holds and another job has taken that over (one stat)."""
    fence = _held
    if fence is not None and fence.covers(path):
        fence.check()
