"""Fault injection for the fault-tolerance tests: real kills, hangs and NaNs at chosen points.

A test entry point, not part of the pipeline: `python tests/faults.py ARGS` and
`torchrun ... tests/faults.py ARGS` run `train.main()` after wrapping the production functions
named below according to the environment variable TRAIN_FAULTS. Faults fire only in the
first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT 0, or `restart=K`), so a
restarted group runs clean. TRAIN_FAULTS holds `;`-separated entries
`ACTION@POINT[,rank=R][,restart=K]`:

    sigkill@step=7,rank=1      rank 1 SIGKILLs itself before optimizer step 8 (7 done)
    sigterm@step=3             every rank sends itself SIGTERM before step 4
    hang@step=5,rank=1         rank 1 sleeps forever while loading step 6's batches
    nan@step=4,rank=0          rank 0's loss of step 5 becomes NaN
    sigkill@save=renamed       rank 0 SIGKILLs itself at that stage of writing a checkpoint
    sleep@prepare=begin,seconds=30   rank 0 takes 30 s longer to prepare the dataset (a slow
                               download); `seconds` works at any point
    sleep@save=begin,seconds=40      rank 0 takes 40 s longer to write each checkpoint (a
                               large model on a slow filesystem)
    oserror@save=written,errno=ESTALE   rank 0's checkpoint write fails with that errno (an NFS
                               server that restarted, a full disk: ENOSPC)
    gate@step=5,file=PATH      touches PATH.waiting, then waits until PATH exists (at any
                               point: a job held where the test wants it, e.g. a newcomer
                               holding the run dir's lease before it writes anything)
    oserror@save=written,errno=ESTALE,for=S   ... in every attempt (restarts too) for S
                               seconds from its first failure (a storage outage; the time of
                               that failure is kept in the file TRAIN_FAULTS_STATE names)
    preempt@eval=begin,rank=0  rank 0 sends SIGTERM to the launcher (scripts/supervise.py, the
                               parent of torchrun; without torchrun, this process's parent) as
                               its first evaluation batch is loaded: a scheduler's stop
    sleep@eval=batch,seconds=1 every evaluation batch takes a second longer (a large eval set)

Save stages, in order: begin, partial (some of the checkpoint's bytes written to the
temporary file, far from all), written (temporary file complete, not yet fsynced), renamed
(under its final name, no manifest yet), manifest (manifest written, older checkpoints not
yet pruned).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ACTIONS = ("sigkill", "sigterm", "sigusr2", "hang", "nan", "sleep", "oserror", "gate", "preempt")
POINTS = ("step", "save", "prepare", "eval")


@dataclass(frozen=True)
class Fault:
    action: str
    point: str  # step, save or prepare
    value: str  # step number or stage
    rank: int | None
    restart: int
    seconds: float = 0.0  # for sleep
    errno_name: str = "EIO"  # for oserror
    file: str = ""  # for gate
    outage_s: float = 0.0  # for oserror: fire in every attempt this long after the first


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
                errno_name=extra.get("errno", "EIO"),
                file=extra.get("file", ""),
                outage_s=float(extra.get("for", 0)),
            )
        except (ValueError, KeyError):
            raise ValueError(
                f"TRAIN_FAULTS entry {entry!r} is not ACTION@POINT=V[,rank=R]"
            ) from None
        if not hasattr(errno, fault.errno_name):
            raise ValueError(f"TRAIN_FAULTS entry {entry!r}: unknown errno {fault.errno_name}")
        if fault.action not in ACTIONS or fault.point not in POINTS:
            raise ValueError(f"TRAIN_FAULTS entry {entry!r}: unknown action or point")
        faults.append(fault)
    return faults


class Plan:
    """The faults of this process's attempt, and carrying them out."""

    def __init__(self, faults: list[Fault], restart: int) -> None:
        self.faults = [fault for fault in faults if fault.restart == restart or fault.outage_s]

    def matching(self, point: str, value: object, rank: int) -> list[Fault]:
        return [
            f
            for f in self.faults
            if f.point == point and f.value == str(value) and f.rank in (None, rank)
        ]

    def fire(self, point: str, value: object, rank: int = 0) -> None:
        """Carry out the kill, signal, hang or sleep faults planned at this point."""
        for fault in self.matching(point, value, rank):
            if fault.outage_s and time.time() > outage_start() + fault.outage_s:
                continue  # the outage is over
            if fault.action == "preempt":
                os.kill(launcher_pid(), signal.SIGTERM)
                continue
            if fault.action == "hang":
                while True:
                    time.sleep(3600)
            if fault.action == "oserror":
                code = getattr(errno, fault.errno_name)
                raise OSError(code, f"{os.strerror(code)} (injected: {fault.errno_name})")
            if fault.action == "gate":
                Path(f"{fault.file}.waiting").touch()
                while not Path(fault.file).exists():
                    time.sleep(0.05)
            elif fault.action == "sleep":
                time.sleep(fault.seconds)
            elif fault.action != "nan":
                signum = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}.get(
                    fault.action, signal.SIGUSR2
                )
                os.kill(os.getpid(), signum)
                if signum == signal.SIGKILL:
                    time.sleep(60)  # never returns: the kill is delivered at once

    def poisons(self, step: int, rank: int) -> bool:
        """Whether the loss of the step after `step` steps must be made NaN on this rank."""
        return any(f.action == "nan" for f in self.matching("step", step, rank))


def outage_start() -> float:
    """When the outage began: its first failure, in any attempt (TRAIN_FAULTS_STATE's file)."""
    state = Path(os.environ["TRAIN_FAULTS_STATE"])
    if not state.exists():
        state.write_text(str(time.time()))
    return float(state.read_text())


def launcher_pid() -> int:
    """The launcher above this worker: torchrun's parent under torchrun, else the parent."""
    parent = os.getppid()
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return parent
    stat = Path(f"/proc/{parent}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


class _CountingFile:
    """A file that fires the `partial` save stage at its second write: torch.save writes in
    several calls, so some bytes are on their way then, far from all of them."""

    def __init__(self, file: Any, plan: Plan) -> None:
        self.file, self.plan, self.writes = file, plan, 0

    def write(self, chunk: bytes) -> int:
        written = self.file.write(chunk)
        self.writes += 1
        if self.writes == 2:
            self.file.flush()
            self.plan.fire("save", "partial")
        return written

    def flush(self) -> None:
        self.file.flush()


def _wrap(owner: Any, name: str, around: Callable[..., Any]) -> None:
    """Replace `owner.name` by `around(original, *args, **kwargs)`."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return around(original, *args, **kwargs)

    setattr(owner, name, wrapper)


def install(plan: Plan) -> None:
    """Wrap the production functions at the points the plan names."""
    from torch import nn

    import engine
    import train
    from ckpt import atomic, retention, sharded, single
    from inputs import sources

    def is_checkpoint(path: Path) -> bool:  # a checkpoint file, or a file of a sharded one
        named = path.name.startswith("step_") or path.parent.name.startswith("step_")
        return path.name.endswith(".pt") and named

    # -- save stages (rank 0 writes a file; every rank its file of a sharded checkpoint) --
    _wrap(single, "save", lambda save, *a, **k: (plan.fire("save", "begin"), save(*a, **k))[1])
    _wrap(
        sharded,
        "save_sharded",
        lambda save, *a, **k: (plan.fire("save", "begin"), save(*a, **k))[1],
    )

    def write_temporary(original: Callable, path: Path, write: Callable) -> Path:
        if not is_checkpoint(path):
            return original(path, write)

        def write_then_fire(f: Any) -> None:
            write(_CountingFile(f, plan))
            plan.fire("save", "written")

        return original(path, write_then_fire)

    _wrap(atomic, "write_temporary", write_temporary)

    def write_bytes(original: Callable, path: Path, *args: Any, **kwargs: Any) -> None:
        if path.name.endswith(".manifest.json"):  # the renamed .pt's own manifest comes next
            plan.fire("save", "renamed")
        return original(path, *args, **kwargs)

    _wrap(atomic, "write_bytes", write_bytes)
    # save reads best.json right after the manifest is written, before pruning anything
    _wrap(retention, "read_best", lambda read, *a: (plan.fire("save", "manifest"), read(*a))[1])

    # -- steps --
    def next_micro_batch(original: Callable, trainer: Any) -> Any:
        step = trainer.position.step
        if getattr(trainer, "_faults_fired_at", None) != step:  # once per step, in its loading
            trainer._faults_fired_at = step
            plan.fire("step", step, trainer.info.rank)
        return original(trainer)

    _wrap(train.Trainer, "next_micro_batch", next_micro_batch)

    def train_step(original: Callable, trainer: Any) -> Any:
        if not plan.poisons(trainer.position.step, trainer.info.rank):
            return original(trainer)
        loss_fn = trainer.loss_fn
        trainer.loss_fn = _PoisonedLoss(loss_fn)
        try:
            return original(trainer)
        finally:
            trainer.loss_fn = loss_fn

    _wrap(train.Trainer, "train_step", train_step)

    class _PoisonedLoss(nn.Module):
        """The wrapped loss times NaN."""

        def __init__(self, loss_fn: nn.Module) -> None:
            super().__init__()
            self.loss_fn = loss_fn

        def forward(self, logits: Any, labels: Any) -> Any:
            return self.loss_fn(logits, labels) * float("nan")

    # -- evaluation batches --
    def evaluate(original: Callable, model: Any, batches: Any, *args: Any, **kwargs: Any) -> Any:
        rank = int(os.environ.get("RANK", "0"))

        def slowed() -> Any:
            for i, batch in enumerate(batches):
                if i == 0:
                    plan.fire("eval", "begin", rank)
                plan.fire("eval", "batch", rank)
                yield batch

        return original(model, slowed(), *args, **kwargs)

    _wrap(engine, "evaluate", evaluate)

    # -- dataset preparation (local rank 0 of each node prepares) --
    rank = int(os.environ.get("RANK", "0"))
    for name, builder in list(sources.BUILDERS.items()):

        def prepare(cfg: Any, builder: Callable = builder) -> Any:
            plan.fire("prepare", "begin", rank)
            return builder(cfg)

        sources.BUILDERS[name] = prepare


def install_from_environment() -> None:
    """Install the faults TRAIN_FAULTS plans for this attempt (TORCHELASTIC_RESTART_COUNT)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    install(Plan(parse(os.environ.get("TRAIN_FAULTS", "")), restart))


def main() -> int:
    sys.path.insert(0, str(REPO))
    import train
    from ckpt import writer

    install_from_environment()
    writer.child_setup = "faults:install_from_environment"  # ckpt.async_save's writer too
    return train.main()


if __name__ == "__main__":
    sys.exit(main())
