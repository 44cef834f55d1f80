"""Training augmentation: a random crop (zero padding) and a horizontal flip, then
aug.auto_augment's policy (torchvision's RandAugment, TrivialAugmentWide, AugMix, AutoAugment).

The augmentation is a pure function of (seed, epoch, sample index, and the copy under
aug.repeated_augment): the same sample gets the same crop whatever the world size, number of
workers, or where a resumed run restarts, so runs are comparable and resumable. `Augmented`
does it per sample, `augment_batch` the crop and flip for a batch on the device,
bit-identically; an image folder draws its own crop from the same hash. A policy draws from
torch's global generator (torchvision's transforms take no other): it runs under a forked
generator seeded from the sample's hash, so it is as pure a function of the key.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from inputs.sampling import mix64, sample_key
from inputs.sources import folder_index, folder_of


def policy(name: str, ra_magnitude: int = 9, augmix_severity: int = 3) -> Callable | None:
    """aug.auto_augment's transform of a uint8 (C, H, W) image, as torchvision's reference
    recipe builds it (bilinear interpolation, AutoAugment's ImageNet policy); None for none."""
    from torchvision import transforms as T

    bilinear = T.InterpolationMode.BILINEAR
    policies = {
        "ra": lambda: T.RandAugment(interpolation=bilinear, magnitude=ra_magnitude),
        "ta_wide": lambda: T.TrivialAugmentWide(interpolation=bilinear),
        "augmix": lambda: T.AugMix(interpolation=bilinear, severity=augmix_severity),
        "autoaugment": lambda: T.AutoAugment(T.AutoAugmentPolicy.IMAGENET, interpolation=bilinear),
    }
    return policies[name]() if name != "none" else None


def seeded(transform: Callable, image: torch.Tensor, seed: int) -> torch.Tensor:
    """`transform(image)` with torch's global CPU generator seeded by `seed` for the call only
    (torch.manual_seed would reseed the CUDA generators too, which fork_rng(devices=[]) does
    not restore: dropout's stream on a GPU)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return transform(image)


class Augmented(Dataset):
    """Training view of a dataset, indexed by (epoch, index) pairs, or (epoch, index, copy)
    under aug.repeated_augment, from `EpochSampler`.

    The crop offsets, the flip and the policy's choices are drawn from a hash of the key
    (`sample_key`), so they do not depend on which rank or worker loads the sample, nor on
    where a resumed run starts.
    """

    def __init__(
        self,
        base: Dataset,
        seed: int,
        padding: int,
        enabled: bool,
        transform: Callable | None = None,
    ) -> None:
        self.base = base
        self.seed = seed
        self.padding = padding
        self.enabled = enabled
        self.transform = transform  # aug.auto_augment's policy

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, ...]) -> tuple[torch.Tensor, int, int]:
        """(image, label, index): the index lets the trainer account for every sample seen."""
        index = key[1]
        h = sample_key(self.seed, *key)
        image, label = self.crop_and_flip(index, h) if self.enabled else self.base[index]
        if self.transform is not None:
            image = seeded(self.transform, image, mix64(h, 3))
        return image, label, index

    def crop_and_flip(self, index: int, h: int) -> tuple[torch.Tensor, int]:
        folder = folder_of(self.base)
        if folder is not None:  # its own training crop and flip
            return folder.augmented_item(folder_index(self.base, index), h)
        image, label = self.base[index]
        if self.padding:
            span = 2 * self.padding + 1
            top, left = h % span, (h >> 16) % span
            height, width = image.shape[-2:]
            padded = torch.nn.functional.pad(image, [self.padding] * 4)
            image = padded[..., top : top + height, left : left + width]
        if (h >> 32) & 1:
            image = image.flip(-1)
        return image, label


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
