"""Image-folder loading: the pipeline's path against torchvision's reference recipe, side by side.

    python -m benchmarks.imagefolder [--sizes 224,64] [--workers 2] [--batch 64]
        [--images 640] [--repeats 5] [--quick] [--out FILE.json]

Both sides load the same JPEG folder into training batches with the same loader workers, batch
size and output size, and every round of one side is followed by a round of the other (the
order alternating), so drift on the machine hits both alike:

- ours: data.build_train_loader over imagefolder.ImageFolder (torchvision.io decoding,
  RandomResizedCrop + flip on uint8 tensors, uint8 collate);
- reference: torchvision.datasets.ImageFolder (PIL decoding) with transforms.v2
  RandomResizedCrop, RandomHorizontalFlip, ToImage, ToDtype(float32, scale=True), Normalize, in
  a DataLoader (shuffle=True): the recipe of torchvision's classification references.

Our side twice: the uint8 batches, and with data.Preprocess on the CPU too (as CPU-only
training does). The figures and the photo-like folder they are measured on: BENCHMARKS.md
("Image folders").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import data
from benchmarks.common import Spread
from config import DataConfig
from distributed import DistInfo
from inputs import imagefolder

CPU = torch.device("cpu")
ONE = DistInfo(rank=0, local_rank=0, world_size=1, device=CPU)
MEAN, STD = data.STATS["imagefolder"]
PHOTO_SIZE = (500, 375)


def make_photo_folder(root: Path, num_images: int, seed: int = 0) -> float:
    """`num_images` photo-sized JPEGs in 10 class folders under root/train; returns their
    mean size in KiB."""
    from PIL import Image

    splits = data.build_datasets(DataConfig(dataset="fashion_mnist", download=False), 0, ONE)
    assert isinstance(splits.train, data.ImageTensors)
    rng = np.random.default_rng(seed)
    width, height = PHOTO_SIZE
    sizes = []
    for n in range(num_images):
        label = n % 10
        item = splits.train.images[n, 0].numpy()
        base = np.asarray(Image.fromarray(item).resize((width, height), Image.Resampling.BICUBIC))
        texture = rng.normal(0, 18, (height, width, 3))  # fine detail, as photos have
        tint = rng.uniform(0.6, 1.0, 3)
        pixels = np.clip(base[..., None] * tint + 40 + texture, 0, 255).astype(np.uint8)
        path = root / "train" / f"class_{label}" / f"{n:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(path, quality=90)
        sizes.append(path.stat().st_size / 1024)
    return float(np.mean(sizes))


def our_loader(
    root: Path, size: int, workers: int, batch: int, normalise: bool = True
) -> Callable[[], Iterator[Any]]:
    """The pipeline's training batches; `normalise`: also data.Preprocess on the CPU (on a GPU
    it runs there, after the copy, and costs the loader nothing)."""
    cfg = DataConfig(
        dataset="imagefolder",
        root=str(root),
        image_size=size,
        num_workers=workers,
        batch_size=batch,
        prefetch_factor=2,
    )
    folder = imagefolder.ImageFolder(root / "train", size, cfg.crop_ratio, cfg.crop_scale, False)
    splits = data.DataSplits(folder, folder, (3, size, size), 10, MEAN, STD)
    loader = data.build_train_loader(splits, cfg, ONE, seed=0, loader="dataloader")
    preprocess = data.Preprocess(splits, CPU, channels_last=False)
    epoch = iter(range(10**9))

    def batches() -> Iterator[Any]:
        data.set_epoch(loader, next(epoch))
        for images, labels, _ in loader:
            yield preprocess(images, labels) if normalise else (images, labels)

    return batches


def reference_loader(
    root: Path, size: int, workers: int, batch: int
) -> Callable[[], Iterator[Any]]:
    from torchvision import datasets
    from torchvision.transforms import v2

    transform = v2.Compose(
        [
            v2.RandomResizedCrop(size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )
    dataset = datasets.ImageFolder(str(root / "train"), transform=transform)
    options: dict[str, Any] = {"num_workers": workers, "shuffle": True, "drop_last": True}
    if workers:
        options |= {"persistent_workers": True, "prefetch_factor": 2}
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, **options)
    return lambda: iter(loader)


def samples_per_s(make: Callable[[], Iterator[Any]], batches: int, batch: int) -> float:
    """Samples/s over `batches` batches (an epoch is reopened as often as needed)."""
    done, started = 0, time.perf_counter()
    while done < batches:
        for _ in make():
            done += 1
            if done == batches:
                break
    return batches * batch / (time.perf_counter() - started)


def interleaved_rates(
    sides: dict[str, Callable[[], Iterator[Any]]], batches: int, batch: int, repeats: int
) -> dict[str, Spread]:
    for make in sides.values():  # warm-up: workers started, files in the page cache
        samples_per_s(make, max(2, batches // 4), batch)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(repeats):
        for name in list(sides) if round_ % 2 == 0 else list(reversed(sides)):
            rates[name].append(samples_per_s(sides[name], batches, batch))
    return {name: Spread.of(values) for name, values in rates.items()}


def where_time_goes(root: Path, size: int, num: int) -> dict[str, dict[str, float]]:
    """Microseconds per sample of each stage, both sides, one thread, median over `num`."""
    import random

    from PIL import Image
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F

    paths = sorted(str(p) for p in (root / "train").rglob("*.jpg"))[:num]
    mean = torch.tensor(MEAN).view(-1, 1, 1) * 255
    inv_std = 1 / (torch.tensor(STD).view(-1, 1, 1) * 255)
    stages: dict[str, dict[str, list[float]]] = {"ours": {}, "reference": {}}

    def clock(side: str, stage: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        stages[side].setdefault(stage, []).append((time.perf_counter() - started) * 1e6)
        return out

    def pil_decode(path: str) -> Any:
        with Image.open(path) as opened:
            return opened.convert("RGB")

    def to_normalised(image: Any) -> torch.Tensor:
        return F.normalize(F.to_dtype(F.to_image(image), torch.float32, scale=True), MEAN, STD)

    rrc = v2.RandomResizedCrop(size, antialias=True)
    out_size = [size, size]
    for key, path in enumerate(paths):
        raw = clock("ours", "read", lambda p: torch.from_numpy(np.fromfile(p, np.uint8)), path)
        image = clock("ours", "decode", decode_image, raw, ImageReadMode.RGB)
        box = imagefolder.crop_box(image.shape[1], image.shape[2], random.Random(key), (0.08, 1))
        crop = clock("ours", "crop+resize", F.resized_crop, image, *box, out_size, antialias=True)
        clock("ours", "normalise (on the device)", lambda c: (c.float() - mean) * inv_std, crop)
        pil = clock("reference", "read+decode (PIL)", pil_decode, path)
        cropped = clock("reference", "crop+resize (PIL)", rrc, pil)
        clock("reference", "to float+normalise", to_normalised, cropped)
    return {
        side: {stage: float(np.median(values)) for stage, values in by_stage.items()}
        for side, by_stage in stages.items()
    }


def measure(size: int, root: Path, workers: int, batch: int, batches: int, repeats: int) -> dict:
    torch.set_num_threads(1)

    def sides(num_workers: int) -> dict[str, Callable[[], Iterator[Any]]]:
        return {
            "ours": our_loader(root, size, num_workers, batch, normalise=False),
            "ours+normalise": our_loader(root, size, num_workers, batch),
            "reference": reference_loader(root, size, num_workers, batch),
        }

    with_workers = interleaved_rates(sides(workers), batches, batch, repeats)
    one_core = interleaved_rates(sides(0), max(2, batches // max(1, workers)), batch, repeats)
    by_setting = (("per core", one_core), (f"{workers} workers", with_workers))

    def ratio(rates: dict[str, Spread], side: str) -> Spread:
        pairs = zip(rates[side].values, rates["reference"].values, strict=True)
        return Spread.of([a / b for a, b in pairs])

    ratios = {
        f"{side} / reference, {label}": ratio(rates, side)
        for label, rates in by_setting
        for side in ("ours", "ours+normalise")
    }
    shown = "; ".join(f"{name} {spread.show('{:.2f}')}" for name, spread in ratios.items())
    rates_shown = "; ".join(
        f"{label}: " + ", ".join(f"{side} {spread.show()}" for side, spread in rates.items())
        for label, rates in by_setting
    )
    return {
        "image_size": size,
        "workers": workers,
        "samples_per_s": {k: v.__dict__ for k, v in with_workers.items()},
        "samples_per_s_per_core": {k: v.__dict__ for k, v in one_core.items()},
        "ratios": {k: v.__dict__ for k, v in ratios.items()},
        "us_per_sample_by_stage": where_time_goes(root, size, 100),
        "show": f"{size} px, samples/s: {rates_shown}\n  ratios: {shown}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.imagefolder", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", default="224,64")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--images", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke test")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.images, args.repeats, args.batch = 64, 2, 16
    with tempfile.TemporaryDirectory(prefix="imagefolder-bench-") as scratch:
        root = Path(scratch)
        mean_kib = make_photo_folder(root, args.images)
        batches = args.images // args.batch
        report: dict[str, Any] = {
            "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
            "images": args.images,
            "image_file": f"{PHOTO_SIZE[0]}x{PHOTO_SIZE[1]} JPEG, mean {mean_kib:.0f} KiB",
            "batch": args.batch,
            "sizes": [],
        }
        for size in (int(s) for s in args.sizes.split(",")):
            result = measure(size, root, args.workers, args.batch, batches, args.repeats)
            print(result["show"], flush=True)
            for side, stages in result["us_per_sample_by_stage"].items():
                shown = ", ".join(f"{stage} {us:,.0f}" for stage, us in stages.items())
                print(f"  {side}: us per sample: {shown}", flush=True)
            report["sizes"].append(result)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
