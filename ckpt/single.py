"""The one-file checkpoint format: `step_<N>.pt`, written by rank 0 with `torch.save`, and its
manifest {"file", "bytes", "crc32", "step"}, written last."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ckpt import atomic, retention

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
    directory.mkdir(parents=True, exist_ok=True)
    retention._remove_stale_temporaries(directory)
    path = directory / f"step_{step}.pt"
    # Re-saving a step (a resumed run saves again the step it was preempted at) must not
    # invalidate the good checkpoint of that step before its replacement is durable: the new
    # bytes go to a temporary file first, a second manifest vouches for them before they are
    # renamed over the old ones, and only then does the manifest proper change. At every
    # point the file under the final name matches one of the two manifests.
    replacing = path.exists() or retention.manifest_path(path).exists()
    tmp, size, expected = atomic._write_checked(path, on_host(state))
    manifest = {"file": path.name, "bytes": size, "crc32": expected, "step": step}
    payload = (json.dumps(manifest) + "\n").encode()
    if replacing:
        atomic.atomic_write_bytes(retention.next_manifest_path(path), lambda f: f.write(payload))
    # The manifest's write below fsyncs the directory for this rename too. Until then a crash
    # may lose the new name: loading skips a manifest without its file, and the older ones
    # remain.
    os.replace(tmp, path)
    atomic.atomic_write_bytes(retention.manifest_path(path), lambda f: f.write(payload))
    retention.next_manifest_path(path).unlink(missing_ok=True)
    retention._finish(directory, step, keep, accuracy)
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
        if state.device.type == "cpu":
            return state.detach()
        if id(state) not in copies:
            copies[id(state)] = state.detach().cpu()
        return copies[id(state)]
    if isinstance(state, dict):
        return {key: on_host(value, copies) for key, value in state.items()}
    if isinstance(state, list | tuple) and not hasattr(state, "_fields"):
        return type(state)(on_host(value, copies) for value in state)
    return state
