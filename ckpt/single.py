"""The one-file checkpoint format: `step_<N>.pt`, written by rank 0 with `torch.save`, and its
manifest {"file", "bytes", "crc32", "step"}, written last."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from ckpt import atomic, fence, retention
from ckpt.atomic import CheckpointError

log = logging.getLogger(__name__)


def save(
    state: dict[str, Any], directory: Path, step: int, keep: int, accuracy: float | None
) -> Path:
    """Write `state` as `step_<step>.pt` with its manifest, update best.json, prune old ones.

    Call on rank 0 only. The new file is fsynced and its size checked before its manifest
    (with the CRC-32 of the bytes written) exists, and pruning happens only after that: the
    newest good checkpoint is never removed before its successor is verified.
    """
    retention.require_finite(state.get("model", {}), step)
    fence.check(directory)  # a writer process too: never a write for a holder that lost
    directory.mkdir(parents=True, exist_ok=True)
    retention.remove_stale_temporaries(directory)
    path = directory / f"step_{step}.pt"
    # Re-saving a step (a resumed run saves again the step it was preempted at) must not
    # invalidate the good checkpoint of that step before its replacement is durable: the new
    # bytes go to a temporary file first, a second manifest vouches for them before they are
    # renamed over the old ones, and only then does the manifest proper change. At every
    # point the file under the final name matches one of the two manifests.
    replacing = path.exists() or retention.manifest_path(path).exists()
    tmp, size, expected = atomic.write_checked(path, on_host(state))
    manifest = {"file": path.name, "bytes": size, "crc32": expected, "step": step}
    payload = (json.dumps(manifest) + "\n").encode()
    if replacing:
        atomic.write_bytes(retention.next_manifest_path(path), lambda f: f.write(payload))
    # The manifest's write below fsyncs the directory for this rename too. Until then a crash
    # may lose the new name: loading skips a manifest without its file, and the older ones
    # remain.
    fence.check(path)
    os.replace(tmp, path)
    atomic.write_bytes(retention.manifest_path(path), lambda f: f.write(payload))
    retention.delete(retention.next_manifest_path(path))
    retention.after_save(directory, step, keep, accuracy)
    log.info("saved checkpoint %s (%d bytes, crc32 %s)", path, size, expected)
    return path


def on_host(state: Any, _copies: dict[int, torch.Tensor] | None = None) -> Any:
    """`state` with every tensor in host memory (a tensor that appears twice, copied once).
    torch.save records each tensor's device, and `torch.load` without map_location puts it
    back there: a file saved from a GPU would not load on a machine without one (seen on an
    H200: the writer process's copies were on the host, the synchronous save's on cuda:0).
    Host tensors are not copied."""
    copies = {} if _copies is None else _copies
    if torch.is_tensor(state):
        if state.device.type == "cpu":  # a view is copied: torch.save writes whole storages
            return atomic.own_storage(state)
        if id(state) not in copies:
            copies[id(state)] = state.detach().cpu()
        return copies[id(state)]
    if isinstance(state, dict):
        return {key: on_host(value, copies) for key, value in state.items()}
    if isinstance(state, list | tuple) and not hasattr(state, "_fields"):
        return type(state)(on_host(value, copies) for value in state)
    return state


def verify(path: Path) -> None:
    """Check the file `path` against its manifest: present, complete, same bytes as were written.

    While a re-save of the same step is renamed into place, a second manifest
    (`step_<N>.manifest.next.json`) vouches for the new bytes: either version is accepted.
    """
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
    manifest_file = retention.manifest_path(path)
    vouched = []
    for candidate in (manifest_file, retention.next_manifest_path(path)):
        with contextlib.suppress(FileNotFoundError):
            vouched.append(retention.read_manifest(candidate))
    if not vouched:
        raise CheckpointError(
            f"checkpoint {path} has no manifest {manifest_file.name}: its save did not finish"
        )
    if all(size != expected_bytes for expected_bytes, _ in vouched):
        raise CheckpointError(
            f"checkpoint {path} is {size} bytes but its manifest says {vouched[0][0]}: "
            "truncated or overwritten"
        )
    actual = atomic.file_crc32(path)
    if all((size, actual) != manifest for manifest in vouched):
        raise CheckpointError(
            f"checkpoint {path} fails its checksum (crc32 {actual}, manifest says "
            f"{vouched[0][1]}): the file is corrupted"
        )


def load(path: Path, device: torch.device) -> dict[str, Any]:
    """Verify the file `path` against its manifest, then load it onto `device` with
    `weights_only=True` (see storage.load)."""
    verify(path)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint {path} is refused: it holds Python objects that safe loading "
            f"(torch.load weights_only=True) does not allow, so it was not written by this "
            f"pipeline or was tampered with; nothing in it was run ({first_line})"
        ) from err
    except Exception as err:  # torch reports truncation as a bare zip-reader error
        if (instead := atomic.not_about_content(err, f"checkpoint {path}")) is not None:
            raise instead from err
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {err}") from err
    if not isinstance(state, dict) or not {"model", "step"} <= state.keys():
        raise CheckpointError(
            f"checkpoint {path} has no 'model' and 'step' entries: not a "
            "checkpoint of this pipeline"
        )
    return state
