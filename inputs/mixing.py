"""Batch augmentation on the device, after normalisation: random erasing, mixup and cutmix, as
torchvision's reference classification recipe applies them (aug.random_erase,
aug.mixup_alpha, aug.cutmix_alpha).

Every draw comes from a hash of (seed, epoch, step, micro-batch, rank), never from torch's
global generator: a run resumed at a step boundary draws what an uninterrupted one would
(same world size and batch size, as the batches themselves are). Mixing pairs each sample
with the batch rolled by one (torchvision.transforms.v2's MixUp and CutMix do the same) and
returns float targets [N, C]: the one-hot rows (a data.factory's multi-hot rows as they are)
mixed. Label smoothing is the loss's (it is linear: smoothing the one-hot rows before mixing
gives the same targets). A sample labelled
IGNORED (a skipped image) leaves a mixed batch before it is mixed (`counted_only`, on the CPU
where the DataLoader delivers it): every float row counts, as objective/targets.py says.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

import torch

from config import AugConfig
from inputs.sampling import mix64
from objective import targets

# torchvision's RandomErasing defaults (transforms.RandomErasing): area share and aspect ratio
ERASE_SCALE, ERASE_RATIO = (0.02, 0.33), (0.3, 3.3)


class Position(Protocol):
    epoch: int
    step: int


@dataclass(frozen=True)
class Draw:
    """One micro-batch's mixing: which, the weight of each sample's own image (cutmix: the
    share of its area left after the box), and cutmix's box (y1, y2, x1, x2)."""

    kind: str  # "mixup" or "cutmix"
    lam: float
    box: tuple[int, int, int, int] = (0, 0, 0, 0)


class BatchAugment:
    """`(images, labels)` of a preprocessed training micro-batch -> the same, erased and mixed
    as aug says; unchanged (int labels) when none of it is on."""

    def __init__(self, cfg: AugConfig, seed: int, rank: int, num_classes: int) -> None:
        self.cfg, self.seed, self.rank, self.num_classes = cfg, seed, rank, num_classes
        self._last: tuple[int, int] | None = None
        self.micro = 0  # the micro-batch's place in its optimizer step

    def counted_only(
        self, images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A DataLoader's CPU batch without its IGNORED samples in the ledger's `indices`, and,
        when batches are mixed, in the images and labels too (a float target row always
        counts); without mixing they stay, labelled IGNORED, which the loss leaves out."""
        counted = targets.counted(labels)  # a data.factory's multi-hot rows all count
        if self.cfg.mixing and not bool(counted.all()):
            images, labels = images[counted], labels[counted]
        return images, labels, indices[counted]

    def key(self, epoch: int, step: int, micro: int) -> int:
        return mix64(self.seed, epoch, step, micro, self.rank)

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, position: Position
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.cfg.random_erase or self.cfg.mixing):
            return images, labels
        here = (position.epoch, position.step)
        self.micro = self.micro + 1 if here == self._last else 0
        self._last = here
        key = self.key(position.epoch, position.step, self.micro)
        if self.cfg.random_erase:
            images = erase(images, self.cfg.random_erase, key)
        if not self.cfg.mixing:
            return images, labels
        return mix(images, labels, self.num_classes, self.draw(key, images.shape[-2:]))

    def draw(self, key: int, size: torch.Size | tuple[int, int]) -> Draw:
        """The micro-batch's mixing, drawn from `key`: cutmix or mixup at even odds when both
        are on, the weight from Beta(alpha, alpha), cutmix's box centred uniformly with sides
        sqrt(1 - weight) of the image's, clipped, and the weight made the box's true share."""
        rnd = random.Random(mix64(key, 1))
        mixup, cutmix = self.cfg.mixup_alpha, self.cfg.cutmix_alpha
        kind = "cutmix" if cutmix > 0 and (mixup == 0 or rnd.random() < 0.5) else "mixup"
        alpha = cutmix if kind == "cutmix" else mixup
        lam = rnd.betavariate(alpha, alpha)
        if kind == "mixup":
            return Draw(kind, lam)
        height, width = int(size[0]), int(size[1])
        centre = rnd.randrange(height), rnd.randrange(width)
        return cutmix_draw(lam, centre, (height, width))


def cutmix_draw(lam: float, centre: tuple[int, int], size: tuple[int, int]) -> Draw:
    """Cutmix's box about `centre` (y, x) for the weight `lam` drawn: sides sqrt(1 - lam) of
    the image's, clipped to it; the weight then becomes the share of area the box leaves."""
    height, width = size
    half = 0.5 * math.sqrt(1.0 - lam)
    half_h, half_w = int(half * height), int(half * width)
    y1, y2 = max(centre[0] - half_h, 0), min(centre[0] + half_h, height)
    x1, x2 = max(centre[1] - half_w, 0), min(centre[1] + half_w, width)
    return Draw("cutmix", 1.0 - (y2 - y1) * (x2 - x1) / (height * width), (y1, y2, x1, x2))


def erase(images: torch.Tensor, p: float, key: int) -> torch.Tensor:
    """torchvision's RandomErasing(p, value=0) on each image, its own random draws (the coin,
    then `get_params`) made from a seed of (key, row) under a forked global generator, which
    is left as it was."""
    from torchvision import transforms

    images = images.clone()
    with torch.random.fork_rng(devices=[]):
        for row in range(len(images)):
            torch.default_generator.manual_seed(mix64(key, 2, row))  # not CUDA's: dropout's
            if torch.rand(1) < p:
                top, left, h, w, _ = transforms.RandomErasing.get_params(
                    images[row], scale=ERASE_SCALE, ratio=ERASE_RATIO, value=[0.0]
                )
                images[row, :, top : top + h, left : left + w] = 0
    return images


def mix(
    images: torch.Tensor, labels: torch.Tensor, num_classes: int, draw: Draw
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample mixed with the one before it in the batch (the batch rolled by one), as
    `draw` says; targets are the one-hot rows (a data.factory's multi-hot float rows as they
    are) mixed with the same weight. An IGNORED sample (none reaches it from the trainer,
    `counted_only`) gets a zero row and mixes into none; a float row always counts."""
    counted = targets.counted(labels)
    onehot = targets.one_hot(labels, num_classes).to(images.dtype)  # IGNORED rows: zeros
    partner_counted = counted.roll(1, 0)
    lam = torch.where(partner_counted, draw.lam, 1.0).to(images.dtype)  # per sample
    if draw.kind == "mixup":
        mixed = images * draw.lam + images.roll(1, 0) * (1.0 - draw.lam)
    else:
        y1, y2, x1, x2 = draw.box
        mixed = images.clone()
        mixed[:, :, y1:y2, x1:x2] = images.roll(1, 0)[:, :, y1:y2, x1:x2]
    mixed = torch.where(partner_counted[:, None, None, None], mixed, images)
    rows = onehot * lam[:, None] + onehot.roll(1, 0) * (1.0 - lam[:, None])
    return mixed, rows * counted[:, None]  # an IGNORED sample's row stays all zero
