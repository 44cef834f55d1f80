"""Checkpoints: atomic writes by rank 0, retention, and safe loading on every rank.

Layout: `<run.dir>/checkpoints/step_<N>.pt` plus `best.json` ({"step", "accuracy"}).
A checkpoint is written to a temporary file in the same directory, fsynced, renamed over its
final name and the directory fsynced: a crash at any point leaves either no `step_<N>.pt` or
a complete one, never a truncated file under the final name.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d+)\.pt$")
BEST_FILE = "best.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, write: Any) -> None:
    """Call `write(file)` on a temporary file next to `path`, then fsync and rename it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_<N>.pt` in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def read_best(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / BEST_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def save(
    state: dict[str, Any], directory: Path, step: int, keep: int, accuracy: float | None
) -> Path:
    """Write `state` as `step_<step>.pt`, update best.json, then prune old checkpoints.

    Call on rank 0 only. Pruning happens after the new file is durable, so the newest good
    checkpoint is never removed before its successor exists.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step}.pt"
    atomic_write_bytes(path, lambda f: torch.save(state, f))
    best = read_best(directory)
    if best is not None and best["step"] > step:  # left by an abandoned later run: stale
        best = None
    if accuracy is not None and (best is None or accuracy > best["accuracy"]):
        best = {"step": step, "accuracy": accuracy}
        payload = json.dumps(best).encode()
        atomic_write_bytes(directory / BEST_FILE, lambda f: f.write(payload))
    _prune(directory, keep, step, best["step"] if best else None)
    log.info("saved checkpoint %s", path)
    return path


def _prune(directory: Path, keep: int, saved_step: int, best_step: int | None) -> None:
    """Delete all but the newest `keep` checkpoints up to `saved_step`, and the best one.

    Checkpoints of later steps (unloadable ones that a resume skipped) are left alone; the one
    just written is always kept.
    """
    older = [(step, path) for step, path in list_checkpoints(directory) if step <= saved_step]
    for step, path in older[:-keep]:
        if step not in (best_step, saved_step):
            path.unlink(missing_ok=True)


def refuse_later_checkpoints(run_dir: str | Path, start_step: int, resume: str) -> None:
    """Refuse to start at `start_step` in a run dir holding checkpoints of later steps.

    They belong to another run (or a later point of this one): continuing would interleave two
    histories and retention would delete one of them. With `resume=auto` the later ones are
    the unloadable checkpoints it skipped, which are kept and overwritten as the run reaches them.
    """
    if resume == "auto":
        return
    directory = checkpoint_dir(run_dir)
    later = [step for step, _ in list_checkpoints(directory) if step > start_step]
    if later:
        raise CheckpointError(
            f"{directory} already holds checkpoints of steps {later}, later than step "
            f"{start_step} where this run (ckpt.resume={resume}) starts; they belong to another "
            "run: use a new --run.dir or move them away"
        )


def load(path: str | Path, device: torch.device) -> dict[str, Any]:
    """Load a checkpoint onto `device` with `weights_only=True` (no code from the file runs)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # torch reports truncation as a bare zip-reader error
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {err}") from err
    if not isinstance(state, dict) or not {"model", "step"} <= state.keys():
        raise CheckpointError(
            f"checkpoint {path} has no 'model' and 'step' entries: not a "
            "checkpoint of this pipeline"
        )
    return state


def load_for_resume(
    resume: str, run_dir: str | Path, device: torch.device
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint `--ckpt.resume` asks for, loaded, or None to start from scratch.

    `auto` takes the newest checkpoint that loads, skipping (with a warning) any that do not;
    if checkpoints exist but none loads it raises rather than silently starting over.
    """
    if resume == "never":
        return None
    if resume != "auto":
        return Path(resume), load(resume, device)
    directory = checkpoint_dir(run_dir)
    errors = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            return path, load(path, device)
        except CheckpointError as err:
            log.warning("skipping unusable checkpoint: %s", err)
            errors.append(str(err))
    if errors:
        raise CheckpointError(
            f"no usable checkpoint in {directory} ({len(errors)} found, none "
            f"loads): {'; '.join(errors)}. Move them away or pass "
            "--ckpt.resume=never to start from scratch"
        )
    return None
