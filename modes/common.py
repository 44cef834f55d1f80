"""What the modes beside training share: the weights they read, the model those fit, and where
their output goes.

`read_weights` takes what `model.weights` names (a checkpoint file or folder, its manifest, a
consolidated file, a state dict, a safetensors file) or, when it is empty, the newest checkpoint
of run.dir that verifies against its manifest: a training job writing there meanwhile is never
read half-written. A checkpoint gives the weights its run evaluated (the weight average under
train.ema_decay, weightfiles.evaluated_weights), its step and its classes. `build_model` fits
them to the configured model strictly: a missing, unexpected or misshapen key (a classifier
for another number of classes) is bad input. Nothing here takes the run dir's lease or writes
into the run dir but under its evaluations/, predictions/ and exports/ folders.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

import data
import distributed
import model as models
import weightfiles
from ckpt import atomic, retention, storage
from ckpt.atomic import CheckpointError
from config import Config, ConfigError
from distributed import DistInfo
from runpaths import MODE_FOLDERS, RunPaths

log = logging.getLogger("train")
PICKS = 3  # newest checkpoints tried while a training job prunes them


@dataclass(frozen=True)
class Weights:
    """A state dict and where it came from."""

    path: Path
    state: dict[str, torch.Tensor]
    which: str  # "ema" (the run's weight average), "trained" (the model's), "file" (weights alone)
    step: int | None = None  # a checkpoint's step
    classes: list[str] | None = None  # a checkpoint's class names, by label
    eval_accuracy: float | None = None  # what the run logged for this checkpoint

    @property
    def label(self) -> str:
        """A short name for output files: step_<N>, else the file's stem."""
        return f"step_{self.step}" if self.step is not None else self.path.name.split(".")[0]


def read_weights(cfg: Config, info: DistInfo) -> Weights:
    """The weights `model.weights` names, else the newest verified checkpoint of run.dir, the
    same on every rank (a collective then): rank 0 picks it, every rank loads it, and should
    the job training there prune it meanwhile on any rank, rank 0 picks again."""
    if cfg.model.weights:
        return _read(Path(cfg.model.weights), f"model.weights={cfg.model.weights}")
    directory = RunPaths(cfg.run.dir).checkpoints
    for _ in range(PICKS):
        path = distributed.broadcast_object(_newest_verified(directory) if info.is_main else None)
        if path is None:
            break
        weights, error = None, None
        try:
            weights = _from_checkpoint(path, storage.load(path, torch.device("cpu")))
        except (CheckpointError, FileNotFoundError) as err:
            error = err
        if not distributed.any_rank(error is not None, info.device):
            return weights  # type: ignore[return-value]
        log.warning("%s changed while it was read (%s): picking again", path, error)
    raise ConfigError(
        f"model.weights is empty and run.dir={cfg.run.dir} holds no verified checkpoint in "
        f"{directory}: give --model.weights=FILE or the run.dir of a run that saved one"
    )


def _newest_verified(directory: Path) -> Path | None:
    """The newest checkpoint in `directory` that verifies against its manifest, or None."""
    for _, path in reversed(retention.list_checkpoints(directory)):
        try:
            storage.verify(path)
            return path
        except (CheckpointError, FileNotFoundError) as err:  # incomplete, or pruned meanwhile
            log.warning("skipping %s: %s", path, err)
    return None


def _read(path: Path, where: str) -> Weights:
    """A checkpoint (verified where a manifest vouches for it) or a weights file."""
    if path.name.endswith(".manifest.json"):  # the checkpoint it vouches for
        stem = path.with_name(path.name.removesuffix(".manifest.json"))
        path = stem if stem.is_dir() else stem.with_name(stem.name + ".pt")
    if path.is_dir() or retention.manifest_path(path).is_file():
        try:
            return _from_checkpoint(path, storage.load(path, torch.device("cpu")))
        except (CheckpointError, OSError) as err:
            raise ConfigError(f"{where} cannot be loaded: {err}") from None
    if not path.is_file():
        raise ConfigError(f"{where}: no such file")
    try:
        if path.suffix == ".safetensors":
            held: Any = weightfiles.read_safetensors(path)
        else:
            with torch.serialization.safe_globals([argparse.Namespace]):
                held = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # not a torch file, truncated, or objects weights_only refuses
        raise ConfigError(f"{where} cannot be loaded (weights_only): {err}") from None
    if isinstance(held, dict) and isinstance(held.get("model"), dict) and "step" in held:
        return _from_checkpoint(path, held)  # a checkpoint file copied without its manifest
    state = weightfiles.bare(held)
    if state is None:
        raise ConfigError(f"{where} holds no state dict (a dict of tensors by parameter name)")
    return Weights(path, state, "file")


def _from_checkpoint(path: Path, checkpoint: dict[str, Any]) -> Weights:
    evaluated = weightfiles.evaluated_weights(checkpoint)
    state = weightfiles.bare(evaluated)  # DDP's and compile's prefixes removed
    if state is None:
        raise CheckpointError(f"checkpoint {path} holds no state dict of tensors")
    accuracy = checkpoint.get("eval_accuracy")
    return Weights(
        path,
        state,
        "trained" if evaluated is checkpoint["model"] else "ema",
        int(checkpoint["step"]),
        checkpoint.get("classes"),
        None if accuracy is None else float(accuracy),
    )


def check_classes(weights: Weights, splits: data.DataSplits, where: str) -> None:
    """A checkpoint trained on other class names than the data's is bad input."""
    known = weights.classes is not None and splits.classes is not None
    if known and list(weights.classes) != list(splits.classes):  # type: ignore[arg-type]
        raise ConfigError(
            f"{where} was trained on the classes {weights.classes}; the data has "
            f"{list(splits.classes)}: a label would mean another class"  # type: ignore[arg-type]
        )


def build_model(
    cfg: Config, splits: data.DataSplits, weights: Weights, info: DistInfo
) -> nn.Module:
    """The configured model (model.name or model.factory) with `weights` loaded strictly, in
    eval mode on this rank's device."""
    where = f"model.weights={weights.path}"
    with torch.random.fork_rng(devices=[]):  # the build's initialisation is overwritten
        model = models.build(cfg.model, splits.input_shape, splits.num_classes)
    own = model.state_dict()
    state = weights.state
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own]
    misshapen = [
        f"{k} {tuple(v.shape)} (the model's: {tuple(own[k].shape)})"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape
    ]
    problems = models.fit_problems(missing, unexpected, misshapen)
    if problems:
        raise ConfigError(
            f"{where} does not fit {cfg.model.source} for {splits.num_classes} classes and "
            f"inputs {splits.input_shape} ({cfg.data.source}): {'; '.join(problems)}. Give the "
            "model settings and data the weights were trained with"
        )
    model.load_state_dict(state, strict=False)
    return model.to(info.device).eval()


def output_path(cfg: Config, weights: Weights, suffix: str) -> Path:
    """run.output, checked; else a new path in the mode's folder of run.dir (RunPaths), named
    after the weights and the time."""
    if cfg.run.output:
        path = Path(cfg.run.output)
        _refuse_run_files(cfg, path)
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = RunPaths(cfg.run.dir).mode_outputs(cfg.run.mode) / f"{weights.label}-{stamp}"
    path, n = base.with_name(base.name + suffix), 1
    while path.exists():  # two in one second
        path, n = base.with_name(f"{base.name}.{n}{suffix}"), n + 1
    return path


def _refuse_run_files(cfg: Config, path: Path) -> None:
    """Inside run.dir, an output goes under evaluations/, predictions/ or exports/ only: never
    over a training run's own files."""
    root = RunPaths(cfg.run.dir).root.resolve()
    resolved = path.resolve()
    if resolved == root or root in resolved.parents:
        inside = resolved.relative_to(root).parts
        if not inside or inside[0] not in MODE_FOLDERS.values():
            raise ConfigError(
                f"run.output={cfg.run.output} lies in run.dir={cfg.run.dir} outside its "
                "evaluations/, predictions/ and exports/ folders: a training run's files are "
                "never written over; give a path outside run.dir or under one of those"
            )


def check_writable(path: Path, what: str) -> None:
    """Bad input, before any work, when `path`'s folder cannot be made or written."""
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if path.is_dir() and what != "folder":
        raise ConfigError(f"run.output={path} is a folder: give a file path")
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(
            f"run.output={path}: {ancestor} is not a folder this process can write in"
        )


def write(path: Path, write_to: Callable[[BinaryIO], Any]) -> None:
    """Write `path` atomically (a temporary file beside it, fsync, rename): a reader never sees
    half of it, and an earlier file there stays whole until the new one is complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(path, write_to)
