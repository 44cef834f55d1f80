"""Write Fashion-MNIST as an image folder: OUT/{train,val}/<class>/<n>.jpg, real JPEG files.

    python scripts/export_imagefolder.py OUT [--size 64] [--train-per-class 100]
        [--val-per-class 20] [--quality 90] [--format jpg|png]

A real folder of real image files for trying data.dataset=imagefolder (and for the tests and the
benchmark) where no photo dataset can be downloaded: the offline Fashion-MNIST (Debian's
dataset-fashion-mnist) scaled to SIZE x SIZE pixels, grayscale saved as RGB (as photos are).
Training images come from the training set, val images from the test set, the first N of each
class in file order; OUT must not exist yet (nothing is overwritten).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import data  # noqa: E402
from config import DataConfig  # noqa: E402
from distributed import DistInfo  # noqa: E402


def export(
    out: Path,
    size: int,
    train_per_class: int,
    val_per_class: int,
    quality: int = 90,
    suffix: str = "jpg",
    root: str = "data",
) -> list[str]:
    """Write the folder; returns the class folder names (sorted, as labels index them)."""
    import torch
    from PIL import Image

    splits = data.build_datasets(
        DataConfig(dataset="fashion_mnist", root=root, download=False),
        seed=0,
        info=DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")),
    )
    assert splits.classes is not None
    names = [c.replace("/", "-").replace(" ", "_").lower() for c in splits.classes]
    out.mkdir(parents=True)
    for split, dataset, per_class in (
        ("train", splits.train, train_per_class),
        ("val", splits.eval, val_per_class),
    ):
        assert isinstance(dataset, data.ImageTensors)
        for label, name in enumerate(names):
            folder = out / split / name
            folder.mkdir(parents=True)
            chosen = torch.nonzero(dataset.labels == label).flatten()[:per_class]
            for n, index in enumerate(chosen.tolist()):
                image = Image.fromarray(dataset.images[index, 0].numpy()).convert("RGB")
                image = image.resize((size, size), Image.Resampling.BICUBIC)
                options = {"quality": quality} if suffix == "jpg" else {}
                image.save(folder / f"{n:05d}.{suffix}", **options)
    return sorted(names)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--train-per-class", type=int, default=100)
    parser.add_argument("--val-per-class", type=int, default=20)
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--format", choices=("jpg", "png"), default="jpg")
    parser.add_argument("--data-root", default="data", help="where Fashion-MNIST is unpacked")
    args = parser.parse_args()
    if args.out.exists():
        print(f"error: {args.out} exists already; give a new folder", file=sys.stderr)
        return 2
    if args.size < 8 or args.train_per_class < 1 or args.val_per_class < 1:
        print("error: --size must be >= 8 and the per-class counts >= 1", file=sys.stderr)
        return 2
    classes = export(
        args.out,
        args.size,
        args.train_per_class,
        args.val_per_class,
        args.quality,
        args.format,
        args.data_root,
    )
    print(f"wrote {args.out}/{{train,val}}/<class>/*.{args.format}: {len(classes)} classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
