"""run.mode=predict: the class of every image in data.predict_root (any depth, no class folders
needed), written as CSV or JSONL (by run.output's extension): the path (relative to the
folder), the predicted class (its name where the checkpoint or data names classes, else its
label), its probability and the top 5.

The files are shared out over the ranks (every world_size-th of the sorted list), gathered to
rank 0 and written in path order, atomically. Each image is decoded and cropped as the
evaluation split's samples are: an image folder's `eval_view` (resize, center crop), else the
dataset's channels and size (resized, center-cropped, only where an image differs), then
normalised by data.Preprocess. An unreadable file is named, and fails the run (exit 2) or,
under data.bad_images=skip, is left out.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import data
import distributed
from config import Config, ConfigError
from distributed import DistInfo
from inputs import imagefolder
from modes import common

log = logging.getLogger("train")
FORMATS = (".csv", ".jsonl")
TOP_K = 5


def run(cfg: Config, info: DistInfo) -> dict[str, Any]:
    root = Path(cfg.data.predict_root)
    files = find_images(root)
    splits = data.build_datasets(cfg.data, cfg.train.seed, info)
    weights = common.read_weights(cfg, info)
    common.check_classes(weights, splits, f"model.weights={weights.path}")
    model = common.build_model(cfg, splits, weights, info)
    output = distributed.broadcast_object(common.output_path(cfg, weights, ".csv"))
    if output.suffix not in FORMATS:
        raise ConfigError(f"run.output={output}: give a file ending in .csv or .jsonl")
    distributed.run_on_main(
        info, "checking run.output", lambda: common.check_writable(output, "file")
    )
    names = weights.classes or (list(splits.classes) if splits.classes else None)
    shard = Shard(root, eval_view(splits), data.Preprocess(splits, info.device, False), names)
    predicted, skipped, error = shard.predict(model, files[info.rank :: info.world_size], cfg)
    distributed.raise_if_any_failed(info, error, "reading data.predict_root's images")
    gathered = distributed.all_gather_object((predicted, len(skipped)))
    everything = sorted((row for part, _ in gathered for row in part), key=lambda r: r["path"])
    num_skipped = sum(n for _, n in gathered)
    text = render(everything, output.suffix)
    distributed.run_on_main(
        info, f"writing {output}", lambda: common.write(output, lambda f: f.write(text))
    )
    log.info(
        "predicted %d images of %s (%d skipped) with %s (%s weights): %s",
        *(len(everything), root, num_skipped, weights.path, weights.which, output),
    )
    return {
        "step": weights.step or 0,
        "predicted": len(everything),
        "skipped": num_skipped,
        "output": str(output),
    }


@dataclass(frozen=True)
class Shard:
    """How this rank turns its share of the files into rows."""

    root: Path
    view: Callable[[str], torch.Tensor]  # a file as an evaluation sample (eval_view)
    preprocess: data.Preprocess
    names: list[str] | None  # class names by label, where known

    def predict(
        self, model: torch.nn.Module, paths: list[str], cfg: Config
    ) -> tuple[list[dict[str, Any]], list[str], ConfigError | None]:
        """(rows, files skipped, the error of the file that failed under bad_images=fail),
        in batches of data.eval_batch_size."""
        predicted, skipped = [], []
        for start in range(0, len(paths), cfg.data.eval_batch_size):
            images, kept = [], []
            for path in paths[start : start + cfg.data.eval_batch_size]:
                try:
                    images.append(self.view(path))
                    kept.append(path)
                except imagefolder.UnreadableImage as err:
                    if cfg.data.bad_images == "fail":
                        failed = ConfigError(f"data.predict_root: {err} (data.bad_images=fail)")
                        return predicted, skipped, failed
                    log.warning("skipping (data.bad_images=skip): %s", err)
                    skipped.append(path)
            if images:
                batch = torch.stack(images)
                probabilities = classify(model, self.preprocess, batch, cfg.data.eval_flip)
                predicted += rows(self.root, kept, probabilities, self.names)
        return predicted, skipped, None


def find_images(root: Path) -> list[str]:
    """The image files under `root` (the extensions inputs.imagefolder reads, any case),
    hidden entries left out, sorted; bad input when there are none."""
    if not root.is_dir():
        raise ConfigError(f"data.predict_root={root}: no such folder")
    found = []
    for folder, subfolders, names in os.walk(root):  # links to folders not followed: no cycles
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        found += [
            os.path.join(folder, name)
            for name in names
            if not name.startswith(".") and name.lower().endswith(imagefolder.EXTENSIONS)
        ]
    if not found:
        raise ConfigError(
            f"data.predict_root={root} holds no images (files ending in "
            f"{', '.join(imagefolder.EXTENSIONS)}, any case, at any depth)"
        )
    return sorted(found)


def eval_view(splits: data.DataSplits) -> Callable[[str], torch.Tensor]:
    """An image file as the evaluation split's samples are: uint8 (C, H, W)."""
    folder = data.folder_of(splits.eval)
    if folder is not None:  # the same decode, resize and center crop as its __getitem__
        return lambda path: folder.eval_view(imagefolder.read(path))
    channels, height, width = splits.input_shape
    if channels not in (1, 3):
        raise ConfigError(
            f"run.mode=predict reads RGB or grayscale image files; the data's samples have "
            f"{channels} channels"
        )

    def view(path: str) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as F

        image = imagefolder.read(path) if channels == 3 else read_gray(path)
        if image.shape[-2:] != (height, width):  # the side the data has, then its crop
            image = F.resize(image, [min(height, width)], antialias=True)
            image = F.center_crop(image, [height, width])
        return image

    return view


def read_gray(path: str) -> torch.Tensor:
    """A grayscale image file as uint8 (1, H, W): the decoder's own gray output, so a gray
    file's pixels stay exactly as they are (torchvision's rgb_to_grayscale of the RGB decode
    would round some of them down); a colour image is converted by the decoder."""
    from torchvision import io as tvio

    encoded = imagefolder.read_bytes(path)
    try:
        image = tvio.decode_image(encoded, mode=tvio.ImageReadMode.GRAY)
    except Exception as err:  # a truncated or non-image file; decode errors vary
        raise imagefolder.UnreadableImage(
            f"cannot read image {imagefolder.shown(path)}: {type(err).__name__}: {err}"
        ) from None
    image = image[0] if image.dim() == 4 else image  # an animated GIF: its first frame
    if image.dtype != torch.uint8:  # a 16-bit PNG: its high byte, as imagefolder.decode does
        from torchvision.transforms.v2 import functional as F

        image = F.to_dtype(image, torch.uint8, scale=True)
    return image


@torch.no_grad()
def classify(
    model: torch.nn.Module, preprocess: data.Preprocess, images: torch.Tensor, flip: bool
) -> torch.Tensor:
    """Class probabilities [N, C] (float32), with data.eval_flip's mean of mirrored logits."""
    batch, _ = preprocess(images, torch.zeros(len(images), dtype=torch.long))
    logits = model(batch).float()
    if flip:
        logits = (logits + model(batch.flip(-1)).float()) / 2
    return logits.softmax(dim=1).cpu()


def rows(
    root: Path, paths: list[str], probabilities: torch.Tensor, names: list[str] | None
) -> list[dict[str, Any]]:
    """One row per image: path relative to `root`, class, label, probability, top 5."""
    values, labels = probabilities.topk(min(TOP_K, probabilities.shape[1]), dim=1)

    def name(label: int) -> str:
        return names[label] if names is not None and label < len(names) else str(label)

    return [
        {
            "path": Path(path).relative_to(root).as_posix(),
            "class": name(int(top[0])),
            "label": int(top[0]),
            "probability": float(p[0]),
            "top5": [
                {"class": name(int(label)), "label": int(label), "probability": float(q)}
                for label, q in zip(top.tolist(), p.tolist(), strict=True)
            ],
        }
        for path, top, p in zip(paths, labels, values, strict=True)
    ]


def render(predicted: list[dict[str, Any]], suffix: str) -> bytes:
    """JSON lines, or CSV whose top5 column reads class:probability;... (best first)."""
    if suffix == ".jsonl":
        return "".join(json.dumps(row) + "\n" for row in predicted).encode()
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["path", "class", "label", "probability", "top5"])
    for row in predicted:
        top = ";".join(f"{t['class']}:{t['probability']!r}" for t in row["top5"])
        writer.writerow([row["path"], row["class"], row["label"], repr(row["probability"]), top])
    return text.getvalue().encode()
