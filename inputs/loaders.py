"""How batches reach the device: the DataLoader's workers, `DeviceLoader` (a dataset held on
the device), `DecodingLoader` (image files decoded on the device), and `Preprocess`.

Samples travel as uint8 tensors (4x less to copy than float) and are normalised on the device
in `Preprocess`.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import exitcodes
from config import DataConfig
from distributed import DistInfo
from inputs import imagefolder
from inputs.augment import augment_batch
from inputs.sampling import EpochSampler, mix64, mix64_many
from inputs.sources import DataSplits, ImageTensors, folder_index, folder_of


def _init_worker(worker_id: int) -> None:
    # A loader worker that dies of a stop signal makes the DataLoader raise in the training
    # process at once ("worker ... killed by signal"), before that process can checkpoint at
    # the next step boundary. So loader workers ignore every stop signal, however they come:
    # to their process group (torchrun, a terminal's Ctrl-C: hence a group of their own) or
    # to each process (slurmstepd, the kubelet). They end when the DataLoader shuts them down,
    # or within seconds of the training process's death (the DataLoader's watchdog).
    # The window before this function runs is closed by `StopSafeLoader`: the worker starts
    # with these signals blocked, and setting SIG_IGN discards any that arrived meanwhile.
    os.setpgid(0, 0)
    for sig in exitcodes.LOADER_IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, exitcodes.LOADER_IGNORED_SIGNALS)
    # torch seeds each worker with base_seed + worker_id; give Python and NumPy (used by
    # user-added transforms) seeds derived from it as well.
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    np.random.seed(worker_seed)


class StopSafeLoader(DataLoader):
    """A DataLoader whose workers never die of a stop signal, even while starting.

    torch's worker loop installs its own SIGTERM handler (die unless the parent sent it) before
    `worker_init_fn` runs, so a SIGTERM to every process of the job landing in that window
    killed a starting worker, and the training process raised "DataLoader worker ... exited
    unexpectedly" instead of checkpointing (seen under CI load as the first evaluation's
    workers started). Workers are forked while the stop signals are blocked in the forking
    thread; the child inherits the mask and `_init_worker` unblocks them once they are ignored.
    Signals to the training process meanwhile stay pending until the fork is done.
    """

    def __iter__(self):  # type: ignore[no-untyped-def]
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, exitcodes.LOADER_IGNORED_SIGNALS)
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def loader_options(cfg: DataConfig, info: DistInfo, seed: int) -> dict[str, Any]:
    options: dict[str, Any] = {
        "num_workers": cfg.num_workers,
        "pin_memory": info.device.type == "cuda",
        "worker_init_fn": _init_worker,
        "generator": torch.Generator().manual_seed(seed + info.rank),
    }
    if cfg.num_workers > 0:
        options["persistent_workers"] = True
        options["prefetch_factor"] = cfg.prefetch_factor
    return options


class DeviceLoader:
    """Training batches from a dataset held on the device as one uint8 tensor.

    The same sampler as the DataLoader path (order, shards, resume position) and the same
    augmentation, batched: per step one index gather, one pad, one crop gather and one flip on
    the device instead of a Python call per sample, and no worker processes. Yields
    `(images, labels, indices)` like the DataLoader (indices on the CPU, for the ledger).
    """

    def __init__(
        self,
        base: ImageTensors,
        sampler: EpochSampler,
        cfg: DataConfig,
        seed: int,
        device: torch.device,
    ) -> None:
        self.images = base.images.to(device)
        self.labels = base.labels.to(device)
        self.sampler = sampler
        self.batch_size = cfg.batch_size
        self.seed = seed
        self.padding = cfg.crop_padding
        self.augment = cfg.augment
        self.device = device

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        epoch = self.sampler.epoch
        keys = list(self.sampler)  # (epoch, index), or (epoch, index, copy): aug.repeated_augment
        indices = np.fromiter((key[1] for key in keys), dtype=np.int64, count=len(keys))
        copies = None
        if self.sampler.repeats > 1:
            copies = np.fromiter((key[2] for key in keys), dtype=np.int64, count=len(keys))
        hashes = mix64_many(self.seed, epoch, indices, copies) if self.augment else None
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = torch.from_numpy(indices[start : start + self.batch_size])
            on_device = batch.to(self.device, non_blocking=True)
            images = self.images.index_select(0, on_device)
            if hashes is not None:
                images = augment_batch(
                    images, hashes[start : start + self.batch_size], self.padding
                )
            yield images, self.labels.index_select(0, on_device), batch


class Encoded(Dataset):
    """An image folder (or a Subset of one) read but not decoded, for data.decode=device:
    item `key` (an (epoch, index) pair from EpochSampler, or an index) is (file bytes, path,
    label, index). `DecodingLoader` decodes and transforms the batches."""

    def __init__(self, base: Dataset) -> None:
        folder = folder_of(base)
        assert folder is not None, "data.decode=device for a dataset that is no image folder"
        self.base, self.folder = base, folder

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, str, int, int]:
        index = key[1] if isinstance(key, tuple) else key
        return (*self.folder.encoded_item(folder_index(self.base, index)), index)


def collate_encoded(
    batch: list[tuple[torch.Tensor, str, int, int]],
) -> tuple[torch.Tensor, torch.Tensor, list[str], torch.Tensor, torch.Tensor]:
    """The files' bytes end to end in one tensor, with each file's size: one shared-memory
    block per batch to send from the worker (one per file would use a descriptor each)."""
    encoded, paths, labels, indices = zip(*batch, strict=True)
    sizes = torch.tensor([len(data) for data in encoded])
    return torch.cat(encoded), sizes, list(paths), torch.tensor(labels), torch.tensor(indices)


class DecodingLoader:
    """A DataLoader of `Encoded` items whose batches are decoded and transformed on the device
    (ImageFolder.decode_batch). Yields `(images, labels, indices)` for training, the crops and
    flips drawn from the same (seed, epoch, index) hashes as `Augmented`'s, or
    `(images, labels)` for evaluation, like the DataLoaders they stand in for."""

    def __init__(
        self, loader: DataLoader, seed: int, augment: bool, device: torch.device, train: bool
    ) -> None:
        self.loader = loader
        self.folder: imagefolder.ImageFolder = loader.dataset.folder  # type: ignore[attr-defined]
        self.seed, self.augment, self.device, self.train = seed, augment, device, train
        self.sampler = loader.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        epoch = getattr(self.sampler, "epoch", 0)  # fixed while an iterator runs (set_epoch)
        for flat, sizes, paths, labels, indices in self.loader:
            encoded = torch.split(flat, sizes.tolist())
            keys = None
            if self.train and self.augment:
                keys = [mix64(self.seed, epoch, index) for index in indices.tolist()]
            images, labels = self.folder.decode_batch(encoded, paths, labels, keys, self.device)
            yield (images, labels, indices) if self.train else (images, labels)


def _torch_loader(loader: DataLoader | DeviceLoader | DecodingLoader) -> Any:
    """The torch DataLoader that holds a loader's workers (a DeviceLoader has none)."""
    return loader.loader if isinstance(loader, DecodingLoader) else loader


def worker_pids(loader: DataLoader | DeviceLoader | DecodingLoader) -> list[int]:
    """The process ids of a loader's running workers (none before its first iterator, none
    for the device loader)."""
    iterator = getattr(_torch_loader(loader), "_iterator", None)
    workers = getattr(iterator, "_workers", None) or []
    return [w.pid for w in workers if w.pid is not None and w.is_alive()]


def close_loader(loader: DataLoader | DeviceLoader | DecodingLoader) -> None:
    """Stop a loader's persistent workers now. Otherwise they stop when the loader is garbage
    collected, and an interpreter that exits first waits for them forever (multiprocessing
    joins its children at exit, while the workers wait for their parent to tell them)."""
    torch_loader = _torch_loader(loader)
    iterator = getattr(torch_loader, "_iterator", None)
    if iterator is not None:
        iterator._shutdown_workers()
        torch_loader._iterator = None


class Preprocess:
    """Move a batch to the device; normalise it there when it is uint8 (float batches of a
    data.factory are used as they are)."""

    def __init__(self, splits: DataSplits, device: torch.device, channels_last: bool) -> None:
        scale = 255.0
        self.mean = torch.tensor(splits.mean, device=device).view(1, -1, 1, 1) * scale
        self.inv_std = 1.0 / (torch.tensor(splits.std, device=device).view(1, -1, 1, 1) * scale)
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # non_blocking: with pinned memory the copy overlaps with compute already queued.
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        # Change the layout while the batch is uint8 (a quarter of the bytes to move), then
        # normalise in place: one float batch allocated instead of three. On a CPU each fresh
        # allocation of a float batch is new pages to fault in, which cost more than the
        # arithmetic (BENCHMARKS.md, "Image folders").
        images = images.contiguous(memory_format=self.memory_format)
        if images.dtype != torch.uint8:  # a data.factory's float images: used as they are
            return images.float(), labels
        return images.float().sub_(self.mean).mul_(self.inv_std), labels
