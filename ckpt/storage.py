"""A run's checkpoint directory: where it is, and loading from it: any checkpoint by its format
(`single`, `sharded`), the newest usable one to resume from, and refusing later ones.

Layout of `<run.dir>/checkpoints/`:
    step_<N>.pt             a checkpoint in one file, written by rank 0 with `torch.save`
    step_<N>/               a sharded checkpoint: rank_<r>.<token>.pt (rank r's pieces of the
                            tensors) and meta.<token>.pt (the rest of the state, and where each
                            tensor's rows are), every rank writing its own file in parallel
    step_<N>.manifest.json  written last, after the files are durable, so a checkpoint without
                            one is incomplete: {"file", "bytes", "crc32", "step"} for one file;
                            {"format": "sharded", "step", "files": {name: {"bytes", "crc32"}}}
                            for a sharded one
    best.json               {"step", "accuracy"} of the best evaluated checkpoint

Every file is written to a temporary name in the same directory, fsynced, renamed over its
final name and the directory fsynced: a crash at any point leaves the previous checkpoints
as they were and at worst an incomplete new one, which loading recognises and skips. Loading
unpickles nothing but tensors and plain data (`torch.load(weights_only=True)`), for every file
of either kind. The writes: ckpt/atomic.py; what the directory keeps: ckpt/retention.py.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from ckpt import retention, sharded, single
from ckpt.atomic import CheckpointError
from runpaths import RunPaths

log = logging.getLogger(__name__)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return RunPaths(run_dir).checkpoints


def refuse_later_checkpoints(run_dir: str | Path, start_step: int, resume: str) -> None:
    """Refuse to start at `start_step` in a run dir holding checkpoints of later steps.

    They belong to another run (or a later point of this one): continuing would interleave two
    histories and retention would delete one of them. With `resume=auto` the later ones are
    the unloadable checkpoints it skipped, which are kept and overwritten as the run reaches them.
    """
    if resume == "auto":
        return
    directory = checkpoint_dir(run_dir)
    given = Path(resume)
    if given.is_dir() and given.resolve() in (Path(run_dir).resolve(), directory.resolve()):
        return  # this run's own directory, named explicitly: the same as auto
    later = [step for step, _ in retention.list_checkpoints(directory) if step > start_step]
    if later:
        raise CheckpointError(
            f"{directory} already holds checkpoints of steps {later}, later than step "
            f"{start_step} where this run (ckpt.resume={resume}) starts; they belong to another "
            "run: use a new --run.dir or move them away"
        )


def verify(path: Path) -> None:
    """Check the checkpoint `path` (a file or a sharded checkpoint's folder) against its
    manifest: present, complete, same bytes as were written."""
    if path.is_dir():
        sharded.verify_sharded(path)
        return
    single.verify(path)


def load(
    path: str | Path, device: torch.device, verified: bool = False, lazy: Collection[str] = ()
) -> dict[str, Any]:
    """Verify `path` against its manifest, then load it onto `device` with `weights_only=True`.

    `weights_only` unpickles tensors, containers and plain values only: a file carrying any
    other Python object is refused and none of its code runs. There is no unsafe fallback.
    A sharded checkpoint (a folder) is put back into whole tensors, but for the parts named in
    `lazy`, whose tensors it hands out unread for each rank to read its own rows
    (sharded.load_sharded); `verified`: another rank checked its files' checksums already
    (their sizes are still checked).
    """
    path = Path(path)
    if path.is_dir():
        return sharded.load_sharded(path, device, verified=verified, lazy=lazy)
    return single.load(path, device)


def load_for_resume(
    resume: str, run_dir: str | Path, device: torch.device, lazy: Collection[str] = ()
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint `--ckpt.resume` asks for, loaded, or None to start from scratch.

    `auto` takes the newest checkpoint that verifies and loads, skipping (with a warning) any
    that do not; if checkpoints exist but none loads it raises rather than silently starting
    over. A directory (a run dir, or its checkpoints/ folder) is searched the same way, and
    must hold a usable checkpoint.
    """
    if resume == "never":
        return None
    if resume != "auto":
        given = Path(resume)
        if not given.is_dir():
            return given, load(resume, device, lazy=lazy)
        inside = RunPaths(given).checkpoints
        directory = inside if inside.is_dir() else given
        found = _newest_usable(directory, device, lazy)
        if found is None:
            raise CheckpointError(
                f"ckpt.resume={resume}: no checkpoint in {directory} (step_<N>.pt files); "
                "give a run dir, its checkpoints/ folder or a checkpoint file"
            )
        return found
    return _newest_usable(checkpoint_dir(run_dir), device, lazy)


def _newest_usable(
    directory: Path, device: torch.device, lazy: Collection[str] = ()
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in `directory` that loads (None if it holds none at all). Only a
    CheckpointError (the file's content) moves on to an older one: out of memory or a storage
    error would fail there too, or resume it and drop the newer one's steps."""
    errors = []
    for _, path in reversed(retention.list_checkpoints(directory)):
        try:
            return path, load(path, device, lazy=lazy)
        except CheckpointError as err:
            log.warning("skipping unusable checkpoint: %s", err)
            errors.append(str(err))
    if errors:
        raise CheckpointError(
            f"no usable checkpoint in {directory} ({len(errors)} found, none "
            f"loads): {'; '.join(errors)}. Move {directory} away to start from scratch, or "
            "start from an earlier checkpoint in a new run dir: "
            "--ckpt.resume=PATH --run.dir=NEW_DIR"
        )
    return None
