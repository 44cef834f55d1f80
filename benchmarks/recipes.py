"""Recipes side by side: the plain recipe against the reference recipe's features, trained on a
real image folder, accuracy and samples/s from the runs' own metrics.jsonl.

    python -m benchmarks.recipes [--images 12000] [--eval-images 2000] [--epochs 6]
        [--rounds 2] [--nproc 2] [--variants plain,reference] [--out FILE.json]

The folder is the offline Fashion-MNIST written as JPEG files in class folders (train/ and
val/, the first `--images` and `--eval-images` of each split). Each round runs every variant
once through torchrun (the order reversed every other round, so drift on the machine hits both
alike), each in a run dir of its own; a variant is a list of config overrides (VARIANTS). The
figures and the machine: BENCHMARKS.md ("Recipes").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Spread
from runpaths import RunPaths

REPO = Path(__file__).resolve().parent.parent
FASHION = "/usr/share/datasets/fashion-mnist"

# Shared by every variant: MiniResNet on the 28 px folder, one loader worker per rank.
COMMON = (
    "--data.dataset=imagefolder",
    "--data.image_size=28",
    "--data.crop_ratio=1.0",
    "--data.batch_size=64",
    "--data.num_workers=1",
    "--model.widths=32,64,128",
    "--model.stem_stride=2",
    "--train.amp=none",
    "--log.every_steps=20",
    "--log.tensorboard=false",
)
VARIANTS: dict[str, tuple[str, ...]] = {
    "plain": (),  # RandomResizedCrop and flip, cross-entropy with label smoothing 0.1, cosine
    "reference": (  # torchvision's reference recipe features (configs/imagenet_resnet50.toml)
        "--aug.auto_augment=ta_wide",
        "--aug.random_erase=0.1",
        "--aug.mixup_alpha=0.2",
        "--aug.cutmix_alpha=1.0",
        "--optim.warmup_factor=0.01",
        "--train.ema_decay=0.998",
    ),
    "reference_ra": (  # the same with the repeated-augmentation sampler, 2 copies
        "--aug.auto_augment=ta_wide",
        "--aug.random_erase=0.1",
        "--aug.mixup_alpha=0.2",
        "--aug.cutmix_alpha=1.0",
        "--optim.warmup_factor=0.01",
        "--train.ema_decay=0.998",
        "--aug.repeated_augment=2",
    ),
}


def export_folder(root: Path, images: int, eval_images: int) -> None:
    """Fashion-MNIST's first images of each split as JPEGs: root/{train,val}/<class>/N.jpg."""
    import gzip

    import numpy as np
    from PIL import Image

    def read(name: str, offset: int, shape: tuple[int, ...]) -> Any:
        with gzip.open(f"{FASHION}/{name}.gz") as f:
            return np.frombuffer(f.read()[offset:], dtype=np.uint8).reshape(shape)

    for split, prefix, count in (("train", "train", images), ("val", "t10k", eval_images)):
        pixels = read(f"{prefix}-images-idx3-ubyte", 16, (-1, 28, 28))[:count]
        labels = read(f"{prefix}-labels-idx1-ubyte", 8, (-1,))[:count]
        for n, (image, label) in enumerate(zip(pixels, labels, strict=True)):
            path = root / split / f"class_{label}" / f"{n:05d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(path, quality=95)


def run_variant(
    name: str, folder: Path, run_dir: Path, epochs: int, nproc: int
) -> dict[str, float]:
    """One training run of a variant; its final accuracy, throughput and wall time."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(REPO / "train.py"),
        *COMMON,
        f"--data.root={folder}",
        f"--train.epochs={epochs}",
        f"--run.dir={run_dir}",
        *VARIANTS[name],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    lines = RunPaths(run_dir).metrics.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    evals = [row for row in rows if row["kind"] == "eval"]
    rates = sorted(row["samples_per_s"] for row in rows if row["kind"] == "train")
    return {
        "accuracy": evals[-1]["accuracy"],
        "top5": evals[-1].get("top5", float("nan")),
        "samples_per_s": rates[len(rates) // 2],
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=12000)
    parser.add_argument("--eval-images", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="recipes-") as tmp:
        folder = Path(tmp) / "folder"
        export_folder(folder, args.images, args.eval_images)
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                run_dir = Path(tmp) / f"{name}-{round_}"
                results[name].append(run_variant(name, folder, run_dir, args.epochs, args.nproc))
                print(f"round {round_} {name}: {results[name][-1]}", flush=True)
    summary = {
        name: {key: Spread.of([run[key] for run in runs]).__dict__ for key in runs[0]}
        for name, runs in results.items()
    }
    report = {"machine": platform.node(), "args": vars(args) | {"out": str(args.out)}, **summary}
    for name, figures in summary.items():
        shown = ", ".join(
            f"{key} {Spread(**value).show('{:.4g}')}" for key, value in figures.items()
        )
        print(f"{name}: {shown}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
