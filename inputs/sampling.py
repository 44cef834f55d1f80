"""Which samples each rank sees, in which order: the resumable training sampler
(`EpochSampler`), the evaluation shards (`ShardSampler`), and the (seed, epoch, index) hash
that augmentation draws from.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from distributed import DistInfo

_MASK64 = (1 << 64) - 1


def mix64(*values: int) -> int:
    """A well-mixed 64-bit hash of integers (splitmix64 finaliser), cheap in pure Python."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def sample_key(seed: int, epoch: int, index: int, repeat: int = 0) -> int:
    """The hash a training sample's augmentation draws from; a repeated copy's (aug.
    repeated_augment: copy 1, 2, ...) includes its number, so each copy is augmented anew."""
    return mix64(seed, epoch, index, repeat) if repeat else mix64(seed, epoch, index)


def _round(h: np.ndarray, value: np.ndarray | np.uint64) -> np.ndarray:
    """One of mix64's rounds, for arrays (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        h = (h ^ value) * _M1
        h = (h ^ (h >> np.uint64(27))) * _M2
        return h ^ (h >> np.uint64(31))


def mix64_many(
    seed: int, epoch: int, indices: np.ndarray, copies: np.ndarray | None = None
) -> np.ndarray:
    """`sample_key(seed, epoch, index, copy)` for arrays of indices (and copies): mix64
    hashes its values in turn, so a copy is one more round, and copy 0 the plain hash."""
    h = np.full(indices.shape, 0x9E3779B97F4A7C15, dtype=np.uint64)
    for value in (np.uint64(seed & _MASK64), np.uint64(epoch & _MASK64)):
        h = _round(h, value)
    h = _round(h, indices.astype(np.uint64))
    if copies is None:
        return h
    return np.where(copies > 0, _round(h, copies.astype(np.uint64)), h)


class EpochSampler(DistributedSampler):
    """DistributedSampler's seeded order and sharding, yielding (epoch, index) pairs, resumable
    at any global position of the epoch and with any world size.

    The epoch's order is DistributedSampler's permutation, seeded by (seed, epoch), the same on
    every rank. Ranks take interleaved strides of it, so after every rank has consumed c
    samples the epoch has consumed exactly the first `world_size * c` entries of the order,
    whatever the world size. `set_epoch(epoch, consumed)` hands each rank its stride of the
    rest: a resumed run (with the same or another world size) sees every remaining sample of
    the epoch once and none it already trained on. Every rank gets the same number of samples
    (the tail that does not divide evenly is dropped, as with drop_last): unequal counts would
    leave one rank waiting in a gradient all-reduce the others never join.

    With `repeats` > 1 (aug.repeated_augment, torchvision's RASampler) each sample of the
    permutation stands `repeats` times in a row, as (epoch, index, copy) keys whose copies the
    strides hand to different ranks; the epoch is the first len(dataset) of that order.
    """

    def __init__(self, dataset: Dataset, info: DistInfo, seed: int, repeats: int = 1) -> None:
        super().__init__(
            dataset,
            num_replicas=info.world_size,
            rank=info.rank,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        self.consumed = 0
        self.repeats = repeats

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Start `epoch` after the first `consumed` samples of its order (summed over ranks)."""
        if not 0 <= consumed <= len(self.dataset):  # type: ignore[arg-type]
            raise ValueError(f"consumed={consumed} is outside an epoch of {len(self.dataset)}")  # type: ignore[arg-type]
        super().set_epoch(epoch)
        self.consumed = consumed

    def order(self) -> list[int]:
        """This epoch's permutation of the dataset (DistributedSampler's, shuffle=True)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[int, ...]]:  # type: ignore[override]
        start = self.consumed + self.rank
        stop = self.consumed + len(self) * self.num_replicas
        order, repeats = self.order(), self.repeats
        positions = range(start, stop, self.num_replicas)  # in the epoch's order of keys
        if repeats == 1:
            return iter([(self.epoch, order[p]) for p in positions])
        return iter([(self.epoch, order[p // repeats], p % repeats) for p in positions])

    def __len__(self) -> int:
        return (len(self.dataset) - self.consumed) // self.num_replicas  # type: ignore[arg-type]


class ShardSampler(Sampler[int]):
    """Every `world_size`-th index starting at `rank`: disjoint, covering, no padding.

    For evaluation: shards differ in length by at most one, which is fine because evaluation
    runs no collective per batch, only one all-reduce of (loss sum, correct, count) at the end.
    """

    def __init__(self, num_samples: int, info: DistInfo) -> None:
        self.indices = range(info.rank, num_samples, info.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
