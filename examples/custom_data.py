"""Your own data, trained by the pipeline without editing it:

    torchrun --nproc-per-node=2 train.py --data.factory=examples.custom_data:idx_images \
        --data.root=/usr/share/datasets/fashion-mnist --data.kwargs='{"limit": 20000}'

The factory is called with `root` (data.root) plus data.kwargs and returns the training and
evaluation datasets with their class count and sample shape (a mapping, or data.UserData).
Each dataset is map-style: `len(ds)` and `ds[i] -> (image, label)`, the image a (C, H, W)
tensor, uint8 (normalised on the device with `mean` and `std`) or float (used as is). The
pipeline shards, shuffles, augments (random crop and flip, data.augment) and resumes it; keep
random draws out of `__getitem__`, or a resumed run would differ from an uninterrupted one.

Labels are ints in [0, num_classes) (or -100, for a sample no loss counts); `mean` and `std`
are in [0, 1] units, one per channel. Both are checked before training: the labels when the
dataset lists them (a `labels` or `targets` attribute, as here, or a plain list of samples),
else each as its sample loads, naming the sample's index and value.

This one reads IDX files (the MNIST family's format, gzipped or not) with NumPy.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip


def read_idx(path: Path) -> np.ndarray:
    """An IDX file as an array: a 4-byte magic (0, 0, type 8 = uint8, number of dimensions),
    one big-endian uint32 per dimension, then the data."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if raw[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


class IdxImages(Dataset):
    """Images (N, H, W) and labels (N,) from a pair of IDX files, served as uint8 (1, H, W).
    `labels` holds every label: the pipeline checks them all before training from it."""

    def __init__(self, images: Path, labels: Path, limit: int = 0) -> None:
        self.images = torch.from_numpy(read_idx(images).copy())
        self.labels = torch.from_numpy(read_idx(labels).astype(np.int64))
        if limit:
            self.images, self.labels = self.images[:limit], self.labels[:limit]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index].unsqueeze(0), int(self.labels[index])


def idx_images(*, root: str, limit: int = 0, eval_limit: int = 0) -> dict[str, Any]:
    """Train and test sets from `root`/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]."""
    folder = Path(root)

    def find(stem: str) -> Path:
        for name in (f"{stem}.gz", stem):
            if (folder / name).is_file():
                return folder / name
        raise FileNotFoundError(f"{folder / stem}[.gz] does not exist")

    train = IdxImages(find("train-images-idx3-ubyte"), find("train-labels-idx1-ubyte"), limit)
    test = IdxImages(find("t10k-images-idx3-ubyte"), find("t10k-labels-idx1-ubyte"), eval_limit)
    return {
        "train": train,
        "eval": test,
        "num_classes": 10,
        "input_shape": (1, *train.images.shape[1:]),
        "mean": (0.2860,),
        "std": (0.3530,),
        "classes": CLASSES,
    }
