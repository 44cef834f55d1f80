"""Fault injection for the fault-tolerance tests: real kills, hangs and NaNs at chosen points.

Inactive unless the environment variable TRAIN_FAULTS is set, and then only in the first
attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT 0), so a restarted group runs clean.
TRAIN_FAULTS holds `;`-separated entries `ACTION@POINT[,rank=R][,restart=K]`:

    sigkill@step=7,rank=1      rank 1 SIGKILLs itself before optimizer step 8 (7 done)
    sigterm@step=3             every rank sends itself SIGTERM before step 4
    hang@step=5,rank=1         rank 1 sleeps forever while loading step 6's batches
    nan@step=4,rank=0          rank 0's loss of step 5 becomes NaN
    sigkill@save=renamed       rank 0 SIGKILLs itself at that stage of writing a checkpoint
    sleep@prepare=begin,seconds=30   local rank 0 of each node takes 30 s longer to prepare the
                               dataset (a slow download); `seconds` works at any point

Save stages, in order: begin, partial (half the checkpoint bytes written to the temporary
file), written (temporary file fsynced), renamed (under its final name, no manifest yet),
manifest (manifest written, older checkpoints not yet pruned).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

ACTIONS = ("sigkill", "sigterm", "sigusr2", "hang", "nan", "sleep")
POINTS = ("step", "save", "prepare")


@dataclass(frozen=True)
class Fault:
    action: str
    point: str  # "step" or "save"
    value: str  # step number or save stage
    rank: int | None
    restart: int
    seconds: float = 0.0  # for sleep


def parse(spec: str) -> list[Fault]:
    faults = []
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        try:
            head, *options = entry.split(",")
            action, where = head.split("@")
            point, value = where.split("=")
            extra = dict(option.split("=") for option in options)
            fault = Fault(
                action=action,
                point=point,
                value=value,
                rank=int(extra["rank"]) if "rank" in extra else None,
                restart=int(extra.get("restart", 0)),
                seconds=float(extra.get("seconds", 0)),
            )
        except (ValueError, KeyError):
            raise ValueError(
                f"TRAIN_FAULTS entry {entry!r} is not ACTION@POINT=V[,rank=R]"
            ) from None
        if fault.action not in ACTIONS or fault.point not in POINTS:
            raise ValueError(f"TRAIN_FAULTS entry {entry!r}: unknown action or point")
        faults.append(fault)
    return faults


_FAULTS = parse(os.environ.get("TRAIN_FAULTS", ""))
_RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _matching(point: str, value: object, rank: int) -> list[Fault]:
    return [
        f
        for f in _FAULTS
        if f.point == point
        and f.value == str(value)
        and f.rank in (None, rank)
        and f.restart == _RESTART
    ]


def fire(point: str, value: object, rank: int) -> None:
    """Carry out the kill or hang faults planned at this point (a no-op without TRAIN_FAULTS)."""
    if not _FAULTS:
        return
    for fault in _matching(point, value, rank):
        if fault.action == "hang":
            while True:
                time.sleep(3600)
        if fault.action == "sleep":
            time.sleep(fault.seconds)
        elif fault.action != "nan":
            signum = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}.get(
                fault.action, signal.SIGUSR2
            )
            os.kill(os.getpid(), signum)
            if signum == signal.SIGKILL:
                time.sleep(60)  # never returns: the kill is delivered at once


def poison_loss(step: int, rank: int) -> bool:
    """Whether the loss of the step after `step` steps must be made NaN on this rank."""
    return bool(_FAULTS) and any(f.action == "nan" for f in _matching("step", step, rank))
