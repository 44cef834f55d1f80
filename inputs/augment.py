"""Training augmentation: a random crop (zero padding) and a horizontal flip.

The augmentation is a pure function of (seed, epoch, sample index): the same sample gets the
same crop whatever the world size, number of workers, or where a resumed run restarts, so runs
are comparable and resumable. `Augmented` does it per sample, `augment_batch` for a batch on
the device, bit-identically; an image folder draws its own crop from the same hash.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from inputs.sampling import mix64
from inputs.sources import folder_index, folder_of


class Augmented(Dataset):
    """Training view of a dataset, indexed by (epoch, index) pairs from `EpochSampler`.

    The crop offsets and the flip are drawn from a hash of (seed, epoch, index), so they do not
    depend on which rank or worker loads the sample, nor on where a resumed run starts.
    """

    def __init__(self, base: Dataset, seed: int, padding: int, enabled: bool) -> None:
        self.base = base
        self.seed = seed
        self.padding = padding
        self.enabled = enabled

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
        """(image, label, index): the index lets the trainer account for every sample seen."""
        epoch, index = key
        if not self.enabled:
            image, label = self.base[index]
            return image, label, index
        h = mix64(self.seed, epoch, index)
        folder = folder_of(self.base)
        if folder is not None:  # its own training crop and flip
            return (*folder.augmented_item(folder_index(self.base, index), h), index)
        image, label = self.base[index]
        if self.padding:
            span = 2 * self.padding + 1
            top, left = h % span, (h >> 16) % span
            height, width = image.shape[-2:]
            padded = torch.nn.functional.pad(image, [self.padding] * 4)
            image = padded[..., top : top + height, left : left + width]
        if (h >> 32) & 1:
            image = image.flip(-1)
        return image, label, index


def augment_batch(images: torch.Tensor, hashes: np.ndarray, padding: int) -> torch.Tensor:
    """`Augmented`'s crop and flip for a whole batch at once, on the images' device.

    One gather does both: output pixel (y, x) of a sample reads padded pixel
    (top + y, left + x), or (top + y, left + W - 1 - x) when the sample is flipped. The same
    hash bits pick the same offsets and flips as the per-sample path: bit-identical results.
    """
    device = images.device
    n, channels, height, width = images.shape
    span = np.uint64(2 * padding + 1)
    top = torch.from_numpy((hashes % span).astype(np.int64)).to(device, non_blocking=True)
    left = torch.from_numpy(((hashes >> np.uint64(16)) % span).astype(np.int64))
    flip = torch.from_numpy(((hashes >> np.uint64(32)) & np.uint64(1)).astype(bool))
    left, flip = left.to(device, non_blocking=True), flip.to(device, non_blocking=True)
    padded = torch.nn.functional.pad(images, [padding] * 4) if padding else images
    padded_width = width + 2 * padding
    ys = torch.arange(height, device=device)
    xs = torch.arange(width, device=device)
    xs = torch.where(flip[:, None], width - 1 - xs, xs)  # (n, W)
    flat = (
        (top[:, None, None] + ys[None, :, None]) * padded_width
        + left[:, None, None]
        + xs[:, None, :]
    )
    index = flat.view(n, 1, height * width).expand(n, channels, height * width)
    out = padded.reshape(n, channels, -1).gather(2, index)
    return out.view(n, channels, height, width)
