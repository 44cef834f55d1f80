"""run.mode=export: the weights a run evaluated (the weight average under train.ema_decay,
weightfiles.evaluated_weights), in a folder (run.output), as

    model.pt           a state dict that `torch.load(path, weights_only=True)` reads
    model.safetensors  the same tensors in Hugging Face's safetensors format (written here)
    model.json         what rebuilding the model takes: the model section, num_classes, the
                       input shape, the normalisation's mean and std, the class names

Each file is written atomically. docs/modes.md holds the few lines that rebuild the model
from them and predict.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch

import data
import distributed
import weightfiles
from config import Config
from distributed import DistInfo
from modes import common

log = logging.getLogger("train")
DTYPE_NAMES = {dtype: name for name, dtype in weightfiles.SAFETENSORS_DTYPES.items()}
FILES = ("model.pt", "model.safetensors", "model.json")


def run(cfg: Config, info: DistInfo) -> dict[str, Any]:
    splits = data.build_datasets(cfg.data, cfg.train.seed, info)
    weights = common.read_weights(cfg, info)
    common.check_classes(weights, splits, f"model.weights={weights.path}")
    common.build_model(cfg, splits, weights, info)  # the weights fit the model the spec builds
    folder = distributed.broadcast_object(common.output_path(cfg, weights, ""))
    distributed.run_on_main(info, "checking run.output", lambda: check_folder(folder))
    state = {key: value.contiguous() for key, value in weights.state.items()}
    spec = describe(cfg, splits, weights)
    distributed.run_on_main(info, f"writing {folder}", lambda: write_all(folder, state, spec))
    log.info(
        "exported %s (%s weights, %d tensors) to %s",
        weights.path,
        weights.which,
        len(state),
        folder,
    )
    return {"step": weights.step or 0, "output": str(folder), "weights_used": weights.which}


def check_folder(folder: Path) -> None:
    """Bad input unless the files can be written into `folder` (a file there is refused)."""
    common.check_writable(folder / FILES[0], "folder")


def describe(cfg: Config, splits: data.DataSplits, weights: common.Weights) -> dict[str, Any]:
    """model.json: enough to rebuild the model (`model.build(ModelConfig(**spec["model"]),
    spec["input_shape"], spec["num_classes"])`) and to feed it as training did."""
    section = dataclasses.asdict(cfg.model) | {"weights": ""}  # the weights are model.pt
    return {
        "model": section,
        "num_classes": splits.num_classes,
        "input_shape": list(splits.input_shape),
        "mean": list(splits.mean),  # [0, 1] units: (uint8 / 255 - mean) / std
        "std": list(splits.std),
        "classes": weights.classes or (list(splits.classes) if splits.classes else None),
        "weights": str(weights.path),
        "weights_used": weights.which,
        "step": weights.step,
        "eval_accuracy": weights.eval_accuracy,
    }


def write_all(folder: Path, state: dict[str, torch.Tensor], spec: dict[str, Any]) -> None:
    common.write(folder / "model.pt", lambda f: torch.save(state, f))
    common.write(folder / "model.safetensors", lambda f: write_safetensors(f, state))
    text = json.dumps(spec, indent=1).encode()
    common.write(folder / "model.json", lambda f: f.write(text))


def write_safetensors(file: BinaryIO, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format: the header's length (8 bytes, little-endian), the JSON header
    (each tensor's dtype, shape and [begin, end) byte offsets in the data, in name order),
    padded with spaces to a multiple of 8 bytes, then the tensors' bytes, little-endian."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset, payloads = 0, []
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors name here")
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        payloads.append(raw)
        offset += len(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    file.write(struct.pack("<Q", len(encoded)))
    file.write(encoded)
    for raw in payloads:
        file.write(raw)
