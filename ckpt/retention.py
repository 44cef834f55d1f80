"""What a checkpoint directory holds and keeps: the names of checkpoints and their manifests,
listing them, best.json, pruning, and the temporary files a killed save left.

Both formats (`single`, `sharded`) call `require_finite` and `remove_stale_temporaries` before
they write, and `after_save` (best.json, then pruning) once their manifest exists. Every
deletion here (`delete`, `remove`) checks the run dir's fence first (ckpt/fence.py): a job that
lost the run dir never removes the checkpoint its successor resumed from.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ckpt import atomic, fence
from ckpt.atomic import CheckpointError
from runpaths import BEST_FILE

_NAME = re.compile(r"^step_(\d+)(\.pt)?$")  # a file, or a sharded checkpoint's folder


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".pt") + ".manifest.json")


def next_manifest_path(path: Path) -> Path:
    """The manifest of a replacement of `path` while it is being renamed into place."""
    return path.with_name(path.name.removesuffix(".pt") + ".manifest.next.json")


def read_manifest(manifest_file: Path) -> tuple[int, str]:
    """(bytes, crc32) a manifest vouches for; FileNotFoundError when there is none."""
    try:
        manifest = json.loads(manifest_file.read_text())
        return int(manifest["bytes"]), str(manifest["crc32"])
    except FileNotFoundError:
        raise
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise CheckpointError(f"checkpoint manifest {manifest_file} is unreadable: {err}") from None


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in `directory` (`step_<N>.pt` files and `step_<N>`
    folders), oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def read_best(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / BEST_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def remove_stale_temporaries(directory: Path) -> None:
    """Delete temporary files left by a save that was killed (only rank 0 of one job writes
    here, and never two saves at once, so no temporary file belongs to a live save)."""
    for path in [*directory.glob(".*.tmp"), *directory.glob("step_*/.*.tmp")]:
        delete(path)
    # A re-save killed between its rename and its manifest: the second manifest becomes the
    # manifest if it vouches for the bytes in place, else it vouches for nothing.
    for pending in directory.glob("step_*.manifest.next.json"):
        path = pending.with_name(pending.name.removesuffix(".manifest.next.json") + ".pt")
        try:
            vouched = read_manifest(pending)
            settled = path.is_file() and (path.stat().st_size, atomic.file_crc32(path)) == vouched
        except (OSError, CheckpointError):
            settled = False
        if settled:
            fence.check(pending)
            os.replace(pending, manifest_path(path))
        else:
            delete(pending)


def after_save(directory: Path, step: int, keep: int, accuracy: float | None) -> None:
    """After a checkpoint's manifest: best.json, then pruning the older ones."""
    best = read_best(directory)
    if best is not None and best["step"] > step:  # left by an abandoned later run: stale
        best = None
    if accuracy is not None and (best is None or accuracy > best["accuracy"]):
        best = {"step": step, "accuracy": accuracy}
        best_payload = json.dumps(best).encode()
        atomic.write_bytes(directory / BEST_FILE, lambda f: f.write(best_payload))
    _prune(directory, keep, step, best["step"] if best else None)


def require_finite(model_state: dict[str, Any], step: int) -> None:
    """Refuse to save a model holding NaN or Inf (one fused norm over all float tensors; the
    offending entry is looked up only when that norm is not finite)."""
    floats = {k: v for k, v in model_state.items() if torch.is_tensor(v) and v.is_floating_point()}
    if not floats:
        return
    norms = torch._foreach_norm([v.float() for v in floats.values()])
    if bool(torch.stack(norms).isfinite().all()):
        return
    bad = next((k for k, v in floats.items() if not bool(torch.isfinite(v).all())), None)
    if bad is None:  # finite values whose norm overflows: nothing to refuse
        return
    raise FloatingPointError(f"refusing to checkpoint step {step}: {bad} holds NaN or Inf values")


def _prune(directory: Path, keep: int, saved_step: int, best_step: int | None) -> None:
    """Delete all but the newest `keep` checkpoints up to `saved_step`, and the best one.

    Checkpoints of later steps (unloadable ones that a resume skipped) are left alone; the one
    just written is always kept; older ones without a manifest (their save was killed) go. A
    checkpoint's .pt goes before its manifest, so a kill in between leaves an incomplete
    checkpoint (skipped), never a manifest that vouches for nothing.
    """
    older = [(step, path) for step, path in list_checkpoints(directory) if step <= saved_step]
    complete = []
    for step, path in older:
        if manifest_path(path).exists() or step == saved_step:
            complete.append((step, path))
        else:  # its save was killed before the manifest: it can never load, and must not
            remove(path)  # take the place of a good checkpoint among the `keep` newest
    for step, path in complete[:-keep]:
        if step not in (best_step, saved_step):
            remove(path)
            delete(manifest_path(path))
    for orphan in directory.glob("step_*.manifest*.json"):
        stem = orphan.name.removesuffix(".json").removesuffix(".next").removesuffix(".manifest")
        if not orphan.with_name(stem + ".pt").exists() and not orphan.with_name(stem).is_dir():
            delete(orphan)


def delete(path: Path) -> None:
    """Unlink a file of the run dir, if this process still holds it (the fence)."""
    fence.check(path)
    path.unlink(missing_ok=True)


def remove(path: Path) -> None:
    """Delete a checkpoint's file or folder (not its manifest), fence checked first."""
    fence.check(path)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
