"""Every path under a run's `run.dir`, named in one place.

The run dir is a contract with the launchers, the supervisor, Ray's driver and the user (who
reads metrics.jsonl and points TensorBoard at it), so each name is spelled here once and every
layer takes it from here. Standard library only: the torch-free drivers use it too. What each
file holds: docs/design.md ("Who owns each run fact").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BEST_FILE = "best.json"  # in the checkpoints folder: {"step", "accuracy"} of the best checkpoint
LEASE_GLOB = "lease.*.json"  # lease.<generation>.json
# Where run.mode's outputs go when run.output is empty (modes/): never a training run's files.
MODE_FOLDERS = {"evaluate": "evaluations", "predict": "predictions", "export": "exports"}


@dataclass(frozen=True)
class RunPaths:
    """The files and folders of one run dir; `RunPaths(cfg.run.dir)`."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def best(self) -> Path:
        return self.checkpoints / BEST_FILE

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def eval_report(self) -> Path:
        """The latest evaluation: top-1, top-5, per-class accuracy, confusion matrix."""
        return self.root / "eval_report.json"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def profile(self) -> Path:
        """The profiler's traces, inside the TensorBoard folder (its profile plugin reads them)."""
        return self.tensorboard / "profile"

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def progress(self) -> Path:
        """The crash-loop breaker's count of attempts without progress."""
        return self.root / "progress.json"

    @property
    def origin(self) -> Path:
        """Where an explicit ckpt.resume started the run."""
        return self.root / "origin.json"

    def mode_outputs(self, mode: str) -> Path:
        """The folder of run.mode=`mode`'s outputs (evaluate, predict, export)."""
        return self.root / MODE_FOLDERS[mode]

    def lease(self, generation: int) -> Path:
        return self.root / f"lease.{generation}.json"

    @property
    def legacy_lease(self) -> Path:
        """The single lease file of earlier versions: such a job may still run in the dir."""
        return self.root / "lease.json"

    def shared_check(self, token: str) -> Path:
        """The marker rank 0 writes for every rank to read: is the run dir shared?"""
        return self.root / f".shared-check-{token}"

    @property
    def ray_markers(self) -> Path:
        """What each node's local rank 0 reported to Ray's driver, per attempt."""
        return self.root / "ray" / "markers"
