"""Image files: the user's `root/<class>/<image>` folders, decoded with torchvision.io
(libjpeg-turbo, libpng, libwebp) and transformed as torchvision's classification references
transform them: RandomResizedCrop and a horizontal flip for training, resize then center crop
for evaluation.

Every random choice of a training sample (the crop's area, aspect and place, the flip) comes
from a hash of (seed, epoch, index), so a sample gets the same crop whichever rank or loader
worker reads it, and a resumed run (on any world size) sees exactly the crops an uninterrupted
one would have. Images stay uint8 until they reach the device (`data.Preprocess` normalises
there): four times less to decode into, copy and collate than float.
"""

from __future__ import annotations

import logging
import math
import os
import random
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from config import ConfigError

log = logging.getLogger(__name__)
# torchvision 0.29 deprecates its image decoders in favour of TorchCodec 0.16 (which needs torch
# >= 2.11); they are the same libjpeg-turbo and libpng, and the GPU image's torchvision has them.
warnings.filterwarnings("ignore", "The image decoding and encoding", DeprecationWarning)

EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's aspect-ratio range (torchvision's default)
SKIPPED = -100  # the label of a skipped image: cross-entropy's ignore_index, counted nowhere


class UnreadableImage(OSError):
    """An image file that cannot be read or decoded; the message names it."""


def scan(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """The class folders of `root` (sorted: a label is a class's index in that order) and
    every image file under them, sorted by path (symbolic links followed, hidden files not)."""
    classes = sorted(
        entry.name
        for entry in os.scandir(root)
        if entry.is_dir() and not entry.name.startswith(".")
    )
    if not classes:
        raise ConfigError(f"{root} has no class folders: put images in {root}/<class>/")
    samples: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        found = sorted(
            os.path.join(folder, file)
            for folder, _, files in os.walk(root / name, followlinks=True)
            for file in files
            if file.lower().endswith(EXTENSIONS) and not file.startswith(".")
        )
        if not found:
            raise ConfigError(
                f"class folder {root / name} holds no images (files ending in "
                f"{', '.join(EXTENSIONS)}, any case)"
            )
        samples += [(path, label) for path in found]
    return classes, samples


def read(path: str) -> torch.Tensor:
    """The image at `path` as a uint8 RGB tensor (3, H, W), or UnreadableImage naming it."""
    from torchvision import io  # imported when used: it is slow to import

    try:
        return io.decode_image(io.read_file(path), mode=io.ImageReadMode.RGB)
    except Exception as err:  # a missing, truncated or non-image file; decode errors vary
        raise UnreadableImage(f"cannot read image {path}: {type(err).__name__}: {err}") from None


def crop_box(
    height: int, width: int, rnd: random.Random, scale: Sequence[float]
) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (top, left, height, width): an area of `scale` of the image's
    and an aspect ratio in 3/4..4/3 (uniform in log), ten tries to fit, then the center crop
    of the image clamped to that ratio range."""
    area = height * width
    log_low, log_high = math.log(RATIO[0]), math.log(RATIO[1])
    for _ in range(10):
        target = area * rnd.uniform(scale[0], scale[1])
        aspect = math.exp(rnd.uniform(log_low, log_high))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rnd.randint(0, height - h), rnd.randint(0, width - w), h, w
    if width / height < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif width / height > RATIO[1]:
        w, h = round(height * RATIO[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class ImageFolder(Dataset):
    """`root/<class>/<image>` files as (uint8 image, label) pairs: eval view by index, the
    training view through `augmented_item` (see data.Augmented)."""

    def __init__(
        self,
        root: Path,
        image_size: int,
        crop_ratio: float,
        crop_scale: Sequence[float],
        skip_bad: bool,
    ) -> None:
        self.root = root
        self.classes, self.samples = scan(root)
        self.image_size = image_size
        self.resize_size = int(image_size / crop_ratio)
        self.crop_scale = tuple(crop_scale)
        self.skip_bad = skip_bad

    def __len__(self) -> int:
        return len(self.samples)

    def _read(self, index: int) -> tuple[torch.Tensor | None, int]:
        path, label = self.samples[index]
        try:
            return read(path), label
        except UnreadableImage as err:
            if not self.skip_bad:
                raise
            log.warning("skipping (data.bad_images=skip): %s", err)
            return None, SKIPPED

    def _blank(self) -> torch.Tensor:
        return torch.zeros(3, self.image_size, self.image_size, dtype=torch.uint8)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Evaluation view: the shorter side resized to image_size / crop_ratio, then the
        center image_size x image_size crop."""
        from torchvision.transforms.v2 import functional as F

        image, label = self._read(index)
        if image is None:
            return self._blank(), label
        image = F.resize(image, [self.resize_size], antialias=True)
        return F.center_crop(image, [self.image_size, self.image_size]), label

    def augmented_item(self, index: int, key: int) -> tuple[torch.Tensor, int]:
        """Training view: a random crop (`crop_box`) resized to image_size x image_size, then
        flipped left-right with probability 1/2; every choice drawn from `key`, the sample's
        hash of (seed, epoch, index)."""
        from torchvision.transforms.v2 import functional as F

        image, label = self._read(index)
        if image is None:
            return self._blank(), label
        rnd = random.Random(key)
        top, left, h, w = crop_box(image.shape[-2], image.shape[-1], rnd, self.crop_scale)
        size = [self.image_size, self.image_size]
        image = F.resized_crop(image, top, left, h, w, size, antialias=True)
        return (image.flip(-1) if rnd.random() < 0.5 else image), label
