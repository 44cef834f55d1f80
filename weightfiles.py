"""What a weights file holds, read without running code: the state dict `--model.weights`
fits to the model (model.load_weights), from any of the files users bring.

- a bare state dict, or one under "state_dict" (timm, Lightning), saved by `torch.save`;
- a training checkpoint with the weights under "model": this pipeline's (a one-file checkpoint,
  a sharded one's folder or manifest: `evaluated_weights` picks the weights the run evaluated),
  or torchvision's reference scripts' (`{"model", "optimizer", "args": argparse.Namespace}`);
- a `.safetensors` file (Hugging Face's format: a JSON header and raw tensors), read here.

Every `torch.load` is weights_only; the one class allowed beyond torch's own is
argparse.Namespace, a bag of attributes, for the reference scripts' `args`.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any

import torch

from ckpt import retention, storage
from ckpt.atomic import CheckpointError
from config import ConfigError

# safetensors' dtype names (its format's spec), as torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def evaluated_weights(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict a checkpoint's run evaluated, and so the one its logged and best accuracy
    belong to: the weight average (its "ema" part) when train.ema_decay was on, else the model's
    ("model"). Resuming uses both; inference and fine-tuning want this one."""
    average = checkpoint.get("ema")
    if isinstance(average, dict) and isinstance(average.get("weights"), dict):
        return average["weights"]
    return checkpoint["model"]


def bare(state: Any) -> dict[str, torch.Tensor] | None:
    """A state dict of tensors out of what a file holds (see the module's list), with DDP's
    `module.` and torch.compile's `_orig_mod.` prefixes removed; None when there is none."""
    if isinstance(state, dict):
        if isinstance(state.get("model"), dict):
            state = evaluated_weights(state)
        elif isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        return None
    found = {}
    for key, value in state.items():
        for prefix in ("module.", "_orig_mod."):
            key = key.removeprefix(prefix)
        found[key] = value
    return found


def read_state(path: str, where: str) -> dict[str, torch.Tensor]:
    """The bare state dict in `path`, or bad input (naming `where`, the setting) saying why
    there is none. A checkpoint of this pipeline given by its folder (sharded) or its
    manifest is read as a resume reads it (verified, weights_only), whole."""
    given = Path(path)
    if given.name.endswith(".manifest.json"):  # the checkpoint it vouches for
        stem = given.with_name(given.name.removesuffix(".manifest.json"))
        given = stem if stem.is_dir() else stem.with_name(stem.name + ".pt")
    if given.is_dir():
        if not retention.manifest_path(given).is_file():
            raise ConfigError(
                f"{where} is a folder without a checkpoint manifest beside it: give a state "
                "dict file, or a sharded checkpoint's folder (checkpoints/step_<N>)"
            )
        try:
            return bare(storage.load(given, torch.device("cpu"))) or {}
        except CheckpointError as err:
            raise ConfigError(f"{where} cannot be loaded: {err}") from None
    if not given.is_file():
        raise ConfigError(f"{where}: the file does not exist")
    try:
        if given.suffix == ".safetensors":
            state = bare(read_safetensors(given))
        else:
            with torch.serialization.safe_globals([argparse.Namespace]):
                state = bare(torch.load(given, map_location="cpu", weights_only=True))
    except Exception as err:  # not a torch file, truncated, or objects weights_only refuses
        raise ConfigError(f"{where} cannot be loaded (weights_only): {err}") from None
    if state is None:
        raise ConfigError(f"{where} holds no state dict (a dict of tensors by parameter name)")
    return state


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A .safetensors file's tensors: 8 bytes (little-endian) giving the JSON header's length,
    the header (name -> dtype, shape, [begin, end) in the data that follows), the data."""
    raw = path.read_bytes()
    if len(raw) < 8:
        raise ValueError(f"{path} is too short for a safetensors file")
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    data = memoryview(raw)[8 + length :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, not read here")
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= len(data):
            raise ValueError(f"{path}: tensor {name}'s bytes lie outside the file")
        if begin == end:  # torch.frombuffer refuses an empty buffer
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype)
        tensors[name] = flat.reshape(entry["shape"])
    return tensors
