"""Where the samples come from: Fashion-MNIST, CIFAR-10, synthetic images and image folders.

Each source returns `DataSplits`; the built-in ones hold their images in memory as uint8
tensors (`ImageTensors`), an image folder reads its files as it goes (inputs.imagefolder).
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from config import DataConfig
from inputs import imagefolder

log = logging.getLogger(__name__)

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
# Per-channel mean and std of the training sets, in [0, 1] units.
STATS = {
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
SYNTHETIC_SEED = 20240601  # fixed: the synthetic task is the same whatever train.seed is


class DatasetNotFoundError(FileNotFoundError):
    """The dataset is not on disk and may not be downloaded; the message says how to get it."""


class ImageTensors(Dataset):
    """An in-memory dataset: uint8 images (N, C, H, W) and int64 labels (N,)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4 or len(images) != len(labels):
            raise ValueError(
                f"expected uint8 (N, C, H, W) images and N labels, got "
                f"{images.dtype} {tuple(images.shape)} and {tuple(labels.shape)}"
            )
        self.images = images
        self.labels = labels.long()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


@dataclass(frozen=True)
class DataSplits:
    """What a run trains and evaluates on. Images are (C, H, W) tensors: uint8 ones are
    normalised on the device with `mean` and `std` (in [0, 1] units), float ones are used as
    they are."""

    train: Dataset
    eval: Dataset
    input_shape: tuple[int, ...]  # (C, H, W) of every sample
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    classes: tuple[str, ...] | None = None  # class names by label, when the dataset has them
    augmented: bool = False  # training samples come augmented: data.augment leaves them alone

    @property
    def in_channels(self) -> int:
        return self.input_shape[0]


def _prepare_fashion_mnist(root: Path) -> None:
    """Copy Debian's gzipped Fashion-MNIST into torchvision's layout (once; atomic per file)."""
    raw = root / "FashionMNIST" / "raw"
    if not DEBIAN_FASHION_MNIST.is_dir() or all((raw / n).exists() for n in FASHION_MNIST_FILES):
        return
    raw.mkdir(parents=True, exist_ok=True)
    for name in FASHION_MNIST_FILES:
        target = raw / name
        if target.exists():
            continue
        tmp = raw / f".{name}.{os.getpid()}.tmp"
        with gzip.open(DEBIAN_FASHION_MNIST / f"{name}.gz", "rb") as src, tmp.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, target)  # concurrent preparers (several nodes) each write whole files
    log.info("unpacked Fashion-MNIST from %s into %s", DEBIAN_FASHION_MNIST, raw)


def _torchvision_splits(
    cls: type, name: str, cfg: DataConfig, folder: Path, offline_hint: str
) -> tuple[Any, Any]:
    """Train and test sets of a torchvision dataset class, or one error saying how to get it."""
    root = Path(cfg.root)
    try:
        return (
            cls(str(root), train=True, download=cfg.download),
            cls(str(root), train=False, download=cfg.download),
        )
    except (RuntimeError, OSError, AssertionError, ValueError, EOFError) as err:
        # Not found, corrupt (torchvision asserts on a malformed idx header), or a failed
        # download.
        if cfg.download:
            raise DatasetNotFoundError(
                f"{name} could not be downloaded into {root}: {err}. {offline_hint}"
            ) from err
        raise DatasetNotFoundError(
            f"{name} not found or unreadable under {folder} and --data.download=false "
            f"({type(err).__name__}: {err}). {offline_hint}, or pass --data.download=true"
        ) from None


def _fashion_mnist(cfg: DataConfig) -> DataSplits:
    _prepare_fashion_mnist(Path(cfg.root))
    from torchvision import datasets

    train, test = _torchvision_splits(
        datasets.FashionMNIST,
        "Fashion-MNIST",
        cfg,
        Path(cfg.root) / "FashionMNIST" / "raw",
        f"Install Debian's package dataset-fashion-mnist (files in {DEBIAN_FASHION_MNIST})",
    )
    mean, std = STATS["fashion_mnist"]
    return DataSplits(
        ImageTensors(train.data.unsqueeze(1), train.targets),
        ImageTensors(test.data.unsqueeze(1), test.targets),
        (1, 28, 28),
        10,
        mean,
        std,
        tuple(train.classes),
    )


def _cifar10(cfg: DataConfig) -> DataSplits:
    folder = Path(cfg.root) / "cifar-10-batches-py"
    from torchvision import datasets

    train, test = _torchvision_splits(
        datasets.CIFAR10,
        "CIFAR-10",
        cfg,
        folder,
        f"Copy the extracted cifar-10-batches-py folder to {folder}",
    )

    def to_tensors(ds: Any) -> ImageTensors:
        images = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).contiguous()
        return ImageTensors(images, torch.tensor(ds.targets))

    mean, std = STATS["cifar10"]
    classes = tuple(train.classes)
    return DataSplits(to_tensors(train), to_tensors(test), (3, 32, 32), 10, mean, std, classes)


# Names a split folder often has in downloaded datasets, and the name this pipeline reads.
SPLIT_ALIASES = {"val": ("valid", "validation", "test", "eval", "dev"), "train": ("training",)}


def _subfolders(folder: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(folder) if e.is_dir() and e.name[0] != ".")
    except OSError:
        return []


def _holds_images(folder: Path) -> bool:
    """Whether image files lie directly in `folder` (a class folder's look)."""
    try:
        return any(e.name.lower().endswith(imagefolder.EXTENSIONS) for e in os.scandir(folder))
    except OSError:
        return False


def _missing_split(root: Path, split: str) -> DatasetNotFoundError:
    """`root/split` is missing: what the folder holds, and the likely fix."""
    expected = f"imagefolder reads {root}/train/<class>/<image> and {root}/val/<class>/<image>"
    if not root.is_dir():
        return DatasetNotFoundError(f"data.root={root} does not exist ({expected})")
    found = _subfolders(root)
    aliases = [name for name in found if name.lower() in SPLIT_ALIASES[split]]
    nested = [name for name in found if {"train", "val"} <= set(_subfolders(root / name))]
    classes = [name for name in found if _holds_images(root / name)]
    if aliases:
        link = f"ln -s {aliases[0]} {root / split}"
        fix = f"{root} has {aliases[0]}/: rename it {split}/ (or link it: {link})"
    elif nested:
        fix = f"{root / nested[0]} holds train/ and val/: set --data.root={root / nested[0]}"
    elif classes and root.name in ("train", "val", *SPLIT_ALIASES["val"]):
        fix = f"{root} is a split's folder of class folders: set --data.root={root.parent}"
    elif classes:
        fix = (
            f"{root} holds class folders directly ({', '.join(classes[:3])}, ...): make "
            f"{root}/train/<class>/ and {root}/val/<class>/ from them (a share of each class "
            "in val/), or point --data.root at the folder holding train/ and val/"
        )
    else:
        held = ", ".join(f"{name}/" for name in found[:5]) or "no folders"
        fix = f"{root} holds {held}; set --data.root to the folder holding train/ and val/"
    return DatasetNotFoundError(f"{root / split} does not exist: {fix} ({expected})")


def _imagefolder(cfg: DataConfig) -> DataSplits:
    root = Path(cfg.root)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise _missing_split(root, split)
    options = (cfg.image_size, cfg.crop_ratio, cfg.crop_scale, cfg.bad_images == "skip")
    train = imagefolder.ImageFolder(root / "train", *options, eval_size=cfg.eval_size)
    imagefolder.require_two_classes(train)  # before val: a val of one class is a mismatch
    # The training split's classes label the validation split: a class without validation
    # images still trains (named in a warning), one without training images is refused.
    known = train.classes
    test = imagefolder.ImageFolder(root / "val", *options, known=known, eval_size=cfg.eval_size)
    mean, std = STATS["imagefolder"]
    shape = (3, cfg.image_size, cfg.image_size)
    return DataSplits(train, test, shape, len(train.classes), mean, std, tuple(train.classes))


def make_synthetic(
    num_samples: int, shape: Sequence[int], num_classes: int, seed: int
) -> ImageTensors:
    """Deterministic, learnable images: a smooth per-class template plus per-sample noise."""
    channels, height, width = shape
    templates_gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    coarse = torch.randn(
        num_classes, channels, max(2, height // 4), max(2, width // 4), generator=templates_gen
    )
    templates = torch.nn.functional.interpolate(
        coarse, size=(height, width), mode="bilinear", align_corners=False
    )
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (num_samples,), generator=gen)
    noise = torch.randn(num_samples, channels, height, width, generator=gen)
    images = 128 + 60 * templates[labels] + 30 * noise
    return ImageTensors(images.round().clamp(0, 255).to(torch.uint8), labels)


def _synthetic(cfg: DataConfig) -> DataSplits:
    shape = cfg.synthetic_shape
    train = make_synthetic(
        cfg.synthetic_train_size, shape, cfg.synthetic_num_classes, SYNTHETIC_SEED + 1
    )
    test = make_synthetic(
        cfg.synthetic_eval_size, shape, cfg.synthetic_num_classes, SYNTHETIC_SEED + 2
    )
    channels = shape[0]
    return DataSplits(
        train, test, shape, cfg.synthetic_num_classes, (0.5,) * channels, (0.25,) * channels
    )


BUILDERS = {
    "fashion_mnist": _fashion_mnist,
    "cifar10": _cifar10,
    "imagefolder": _imagefolder,
    "synthetic": _synthetic,
}


def jpeg_share(dataset: Dataset) -> float:
    """The share of an image folder's files named .jpg or .jpeg (1.0 for other datasets)."""
    folder = folder_of(dataset)
    if folder is None or not folder.samples:
        return 1.0
    jpegs = sum(path.lower().endswith((".jpg", ".jpeg")) for path, _ in folder.samples)
    return jpegs / len(folder.samples)


def folder_of(dataset: Dataset) -> imagefolder.ImageFolder | None:
    """The ImageFolder a dataset is, or is a Subset of; else None."""
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    return base if isinstance(base, imagefolder.ImageFolder) else None


def folder_index(dataset: Dataset, index: int) -> int:
    """Sample `index` of `dataset` (a folder or a Subset of one) as an index into the folder."""
    return dataset.indices[index] if isinstance(dataset, Subset) else index


def in_memory(dataset: Dataset) -> ImageTensors | None:
    """The dataset as one ImageTensors (a Subset materialised), or None if it is not in memory."""
    if isinstance(dataset, ImageTensors):
        return dataset
    if isinstance(dataset, Subset) and isinstance(dataset.dataset, ImageTensors):
        indices = torch.as_tensor(dataset.indices, dtype=torch.long)
        return ImageTensors(dataset.dataset.images[indices], dataset.dataset.labels[indices])
    return None


def in_memory_numel(dataset: Dataset) -> int | None:
    """Elements of the dataset's images when it is held in memory (ImageTensors, or a Subset of
    one), without copying it; None for a dataset read from files."""
    if isinstance(dataset, ImageTensors):
        return dataset.images.numel()
    if isinstance(dataset, Subset) and isinstance(dataset.dataset, ImageTensors):
        images = dataset.dataset.images
        return len(dataset.indices) * images[0].numel() if len(images) else 0
    return None
