"""What the training data path delivers, training nothing: loader_headroom.

- loader_headroom: samples/s the training loader (augmentation, configured workers) and
  data.Preprocess deliver / samples/s a training step consumes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

import auto
import data
from benchmarks.common import Plan, rates, timed
from config import Config
from distributed import DistInfo


def endless(loader: torch.utils.data.DataLoader) -> Iterator[tuple[torch.Tensor, ...]]:
    for epoch in itertools.count():
        data.set_epoch(loader, epoch)
        yield from loader


def measure_loader(
    cfg: Config, splits: data.DataSplits, info: DistInfo, plan: Plan, step_rate: float
) -> dict[str, Any]:
    """What the training data path delivers with the configured workers, training nothing.

    Here the workers have the cores to themselves; during training they share them with the
    ranks, so the headroom a run sees on a small machine is lower.
    """
    settings = auto.resolve(
        cfg, info, data.in_memory_numel(splits.train), data.jpeg_share(splits.train)
    )
    loader = data.build_train_loader(
        splits, cfg.data, info, cfg.train.seed, settings.loader, settings.decode
    )
    preprocess = data.Preprocess(splits, info.device, settings.channels_last)
    batches = endless(loader)

    def take(num_batches: int) -> None:
        for images, labels, *_ in itertools.islice(batches, num_batches):
            preprocess(images, labels)

    # Warm-up: start the workers and drain what they prefetched while starting.
    take(max(plan.warmup_steps, cfg.data.num_workers * cfg.data.prefetch_factor))
    seconds = [timed(partial(take, plan.loader_batches), info.device) for _ in range(plan.repeats)]
    batches.close()
    delivered = rates(seconds, plan.loader_batches * cfg.data.batch_size)
    return {
        "num_workers": cfg.data.num_workers,
        "loader_samples_per_s": delivered,
        "step_samples_per_s": step_rate,
        "headroom": delivered.median / step_rate,
    }
