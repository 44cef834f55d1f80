"""Measure the pipeline against hand-written references in one run, and report the ratios.

    python benchmarks/run.py [--quick] [--out FILE.json] [--device auto|cpu|cuda]
        [--threads N] [--repeats N] [--time-to-accuracy RUN_DIR] [--section.field=VALUE ...]

Config overrides (and `--config FILE.toml`) are train.py's; they configure the measured job.
Each figure is a ratio of two things measured in the same run, interleaved, so that a busy or
slow machine moves both sides alike:

- overhead_ratio: samples/s of train.py's own loop (Trainer.train_steps: step guard, sample
  ledger, watchdog, meter, log rows) / samples/s of a bare hand-written loop doing the same math;
  overhead_ratio_cpu_time is the same per CPU second, which on CPU other processes cannot move.
- weak_scaling_efficiency: samples/s of 2 ranks / (2 x samples/s of 1 rank), 1 thread each,
  and the share of a step spent in the gradient all-reduce that backward does not hide.
- loader_headroom: samples/s the training loader (augmentation, configured workers) and
  data.Preprocess deliver / samples/s a training step consumes.
- mfu: FLOP/s of training (FlopCounterMode count x measured steps/s) / FLOP/s of the fastest
  of a few large matmuls in the training dtype on the same device.
- checkpoint_save_ratio: train.py's synchronous checkpoint save / writing as many bytes raw
  with fsync, in the same directory.
- async_checkpoint_stall_ratio: training time lost to a save through writer.ProcessSaver /
  the synchronous save time.

Both training loops replay the same uint8 batches, taken once from the pipeline's own training
loader, so neither pays for loading and the ratio isolates the step; the loader is measured on
its own (loader_headroom). Each figure is the median of `repeats` timed rounds after warm-up,
shown with min and max; clocks are read after a CUDA synchronize.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's flat modules


import auto  # noqa: E402
import data  # noqa: E402
import distributed  # noqa: E402
import engine  # noqa: E402
import metrics  # noqa: E402
import parallel  # noqa: E402
import resilience  # noqa: E402
import train  # noqa: E402
from ckpt import storage, writer  # noqa: E402
from cli import parse_args  # noqa: E402
from config import (  # noqa: E402
    Config,
    ConfigError,
    for_world_size,
    global_batch_size,
)
from distributed import DistInfo  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]
Stats = tuple[tuple[float, ...], tuple[float, ...]]  # per-channel mean and std, in [0, 1] units
TARGETS = {
    "overhead_ratio": ">= 0.98",
    "weak_scaling_efficiency": ">= 0.90",
    "loader_headroom": ">= 20",
    "mfu": "-",
    "checkpoint_save_ratio": "<= 1.5",
    "checkpoint_save_ratio_64mib": "<= 1.5",
    "async_checkpoint_stall_ratio": "<= 0.1",
}
# Square matmul sizes tried for the peak; the fastest counts. On CPU the best is not always
# the largest: MKL's sgemm on this project's AMD EPYC reaches 93-95 GFLOP/s at 512 but 57-91
# at 2048 (one thread, varying from run to run), below what oneDNN's convolutions reach.
MATMUL_SIZES = {"cpu": (512, 1024, 2048), "cuda": (4096, 8192)}


@dataclass(frozen=True)
class Plan:
    """How long to measure; `--quick` shrinks the counts for the smoke test."""

    repeats: int  # timed rounds per figure, after warm-up
    warmup_steps: int  # untimed optimizer steps before the first round
    replay_batches: int  # distinct batches both training loops cycle through
    loader_batches: int  # batches per timed round of the loader
    scaling_steps: int  # optimizer steps per timed round of the spawned ranks
    min_round_s: float  # a matmul round lasts at least this long
    log_every_steps: int | None  # overrides log.every_steps (a round holds one log row)
    quick: bool = False  # the smoke test's plan (kept by --repeats): the slowest parts left out


FULL = Plan(
    repeats=5,
    warmup_steps=5,
    replay_batches=16,
    loader_batches=40,
    scaling_steps=20,
    min_round_s=0.25,
    log_every_steps=None,
)
QUICK = Plan(
    repeats=3,
    warmup_steps=1,
    replay_batches=4,
    loader_batches=5,
    scaling_steps=3,
    min_round_s=0.05,
    log_every_steps=5,
    quick=True,
)


# ---------------------------------------------------------------------------------------------
# Timing


@dataclass(frozen=True)
class Spread:
    """Median and range of a figure over the timed rounds, and each round's value."""

    median: float
    min: float
    max: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), tuple(values))

    def show(self, fmt: str = "{:,.0f}") -> str:
        return f"{fmt.format(self.median)} [{fmt.format(self.min)}-{fmt.format(self.max)}]"


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds `fn` takes, its device work included (CUDA runs asynchronously to the clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, info: DistInfo
) -> dict[str, list[float]]:
    """Seconds of each function per round, the order reversed every other round.

    Interleaving makes drift (other jobs on the machine, clocks, caches) hit every side of a
    ratio alike; the barrier starts every rank's round together.
    """
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats):
        for name in list(fns) if round_ % 2 == 0 else list(reversed(fns)):
            distributed.barrier(info)
            seconds[name].append(timed(fns[name], info.device))
    return seconds


def rates(seconds: list[float], amount: float) -> Spread:
    """`amount` per second, round by round."""
    return Spread.of([amount / s for s in seconds])


# ---------------------------------------------------------------------------------------------
# The pipeline side: the one place that knows train.py's API (adjust it when train.py changes)


class Replay:
    """Stands in for the training DataLoader: the same batches again and again.

    They are taken once from the pipeline's own loader (augmented, pinned on CUDA); `sampler`
    is that loader's, so `data.set_epoch` works on this as on the real one.
    """

    def __init__(self, loader: torch.utils.data.DataLoader, num_batches: int) -> None:
        self.sampler = loader.sampler
        self.batches: list[tuple[torch.Tensor, ...]] = list(itertools.islice(loader, num_batches))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return itertools.cycle(self.batches)


class Pipeline:
    """train.py's Trainer, driven through its public API: `train_steps(n)` and `save()`.

    The Trainer trains on a `Replay` of its own loader's batches (`use_train_loader`), so each `run`
    is `num_steps` steps of the real step (instruments, step guard, sample ledger, periodic
    log rows: an all-reduce, a metrics.jsonl line, TensorBoard scalars every
    `log.every_steps`) without waiting for data.
    """

    def __init__(self, cfg: Config, info: DistInfo, num_batches: int) -> None:
        self.cfg, self.info = cfg, info
        # The watchdog wakes as in training, but with a timeout that the untimed phases
        # between runs (matmuls, saves) cannot trip.
        preemption = resilience.PreemptionHandler(cfg.run.preempt_signals)
        self.trainer = train.Trainer(cfg, info, preemption, stall_timeout_s=3600.0)
        self.replay = Replay(self.trainer.train_loader, num_batches * cfg.train.grad_accum_steps)
        self.trainer.use_train_loader(self.replay)
        self.schedule_steps = self.trainer.total_steps  # what the LR schedule is built for
        self.trainer.resume()  # a fresh run (ckpt.resume=never): settles the run dir
        self._running = self.trainer.instruments.running(self.schedule_steps)
        self._running.__enter__()

    @property
    def model(self) -> nn.Module:
        return self.trainer.model

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return self.trainer.amp_dtype

    @property
    def batches(self) -> list[Batch]:
        """The replayed (images, labels) pairs, for the bare loop."""
        return [(images, labels) for images, labels, *_ in self.replay.batches]

    def run(self, num_steps: int) -> None:
        self.trainer.train_steps(num_steps)

    def save(self, step: int, accuracy: float | None, saver: writer.ProcessSaver | None) -> None:
        """The Trainer's checkpoint save as of `step`: synchronous, or handed to `saver`."""
        self.trainer.checkpoints.saver = saver
        self.trainer.checkpoints.save(step, accuracy)

    def close(self) -> None:
        self._running.__exit__(None, None, None)
        self.trainer.close()


# ---------------------------------------------------------------------------------------------
# The bare loop


@dataclass
class Bare:
    """What a minimal hand-written training script holds."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    scaler: torch.amp.GradScaler
    batches: list[Batch]  # the pipeline's replayed batches, uint8 on the host
    mean: torch.Tensor  # per channel, in uint8 units, on the device
    inv_std: torch.Tensor
    memory_format: torch.memory_format
    amp_dtype: torch.dtype | None
    label_smoothing: float
    max_norm: float
    accum: int

    def __post_init__(self) -> None:
        self.stream = itertools.cycle(self.batches)


def build_bare(cfg: Config, info: DistInfo, pipeline: Pipeline, stats: Stats) -> Bare:
    """The reference loop, on a copy of the job's model taken before its first step.

    The optimizer is written out here rather than taken from engine.build_optimizer, so that
    the test's parameter comparison checks the pipeline against an independent statement of
    the math: SGD (momentum, Nesterov) or AdamW, weight decay on conv/linear weights only.
    """
    model = distributed.wrap_model(copy.deepcopy(distributed.unwrap_model(pipeline.model)), info)
    if auto.compile_model(cfg.train.compile, info.device):
        model = torch.compile(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    o = cfg.optim
    optimizer: torch.optim.Optimizer
    kernels = engine.optimizer_kernels(auto.optimizer_impl(o.impl, info.device))  # same speed
    if o.name == "sgd":
        nesterov = o.nesterov and o.momentum > 0
        optimizer = torch.optim.SGD(
            groups, lr=o.lr, momentum=o.momentum, nesterov=nesterov, **kernels
        )
    else:
        optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.betas[0], o.betas[1]), **kernels)
    mean, std = (torch.tensor(s, device=info.device).view(1, -1, 1, 1) * 255.0 for s in stats)
    return Bare(
        model=model,
        optimizer=optimizer,
        # The learning rates are not what the comparison is about: use the pipeline's schedule.
        scheduler=engine.build_scheduler(optimizer, o, pipeline.schedule_steps),
        scaler=torch.amp.GradScaler(info.device.type, enabled=pipeline.amp_dtype == torch.float16),
        batches=pipeline.batches,
        mean=mean,
        inv_std=1.0 / std,
        memory_format=torch.channels_last
        if auto.channels_last(cfg.model.channels_last, info.device)
        else torch.contiguous_format,
        amp_dtype=pipeline.amp_dtype,
        label_smoothing=o.label_smoothing,
        max_norm=o.grad_clip if o.grad_clip > 0 else math.inf,
        accum=cfg.train.grad_accum_steps,
    )


def bare_forward_backward(
    bare: Bare, model: nn.Module, images: torch.Tensor, labels: torch.Tensor
) -> None:
    device = bare.mean.device
    images = images.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    x = ((images.float() - bare.mean) * bare.inv_std).contiguous(memory_format=bare.memory_format)
    with engine.autocast(device, bare.amp_dtype):
        loss = nn.functional.cross_entropy(model(x), labels, label_smoothing=bare.label_smoothing)
    bare.scaler.scale(loss / bare.accum).backward()


def bare_steps(bare: Bare, num_steps: int, sync: bool = True) -> None:
    """`num_steps` optimizer steps; `sync=False` skips DDP's gradient all-reduce (no_sync).
    The replayed batches go on where the previous call left them, as in the pipeline."""
    batches = bare.stream
    bare.model.train()
    for _ in range(num_steps):
        for i in range(bare.accum):
            with parallel.gradient_sync(bare.model, enabled=sync and i == bare.accum - 1):
                bare_forward_backward(bare, bare.model, *next(batches))
        bare.scaler.unscale_(bare.optimizer)
        nn.utils.clip_grad_norm_(bare.model.parameters(), bare.max_norm)
        bare.scaler.step(bare.optimizer)
        bare.scaler.update()
        bare.optimizer.zero_grad(set_to_none=True)
        bare.scheduler.step()


# ---------------------------------------------------------------------------------------------
# One rank's measured job


@dataclass
class Rig:
    """One rank's measured job: the pipeline and the bare loop, side by side."""

    cfg: Config
    info: DistInfo
    pipeline: Pipeline
    bare: Bare

    @property
    def samples_per_step(self) -> int:
        """Samples one rank consumes per optimizer step."""
        return self.cfg.data.batch_size * self.cfg.train.grad_accum_steps

    def close(self) -> None:
        self.pipeline.close()


def measured_config(cfg: Config, plan: Plan, run_dir: Path) -> Config:
    """`cfg` as measured: a fresh run dir, no resume, loading in the training process.

    The per-rank batch is the one a single rank trains with, on any number of ranks (weak
    scaling). No loader workers: the replay never asks them for a batch, and they would
    compete for the cores the timed loops run on.
    """
    cfg = for_world_size(cfg, 1)
    log_every = plan.log_every_steps or cfg.log.every_steps
    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, dir=str(run_dir)),
        data=dataclasses.replace(cfg.data, global_batch_size=0, num_workers=0),
        ckpt=dataclasses.replace(cfg.ckpt, resume="never", async_save=False),
        log=dataclasses.replace(cfg.log, every_steps=log_every),
    )


def build_rig(cfg: Config, info: DistInfo, plan: Plan, stats: Stats, run_dir: Path) -> Rig:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = measured_config(cfg, plan, run_dir)
    pipeline = Pipeline(cfg, info, plan.replay_batches)
    return Rig(cfg, info, pipeline, build_bare(cfg, info, pipeline, stats))


# ---------------------------------------------------------------------------------------------
# Measurements in this process


def measure_overhead(rig: Rig, plan: Plan) -> dict[str, Any]:
    """Pipeline vs bare loop; a round is one log interval, so each holds one log row.

    Besides wall time, the CPU time of the process (all threads: TensorBoard's writer and the
    watchdog too) is recorded. On CPU it is a cross-check that other processes taking the
    cores cannot move: samples per CPU second, pipeline over bare.
    """
    steps = rig.cfg.log.every_steps
    rig.pipeline.run(plan.warmup_steps)
    bare_steps(rig.bare, plan.warmup_steps)
    cpu_seconds: dict[str, list[float]] = {"pipeline": [], "bare": []}

    def on_cpu_clock(name: str, fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            started = time.process_time()
            fn()
            cpu_seconds[name].append(time.process_time() - started)

        return run

    seconds = interleaved(
        {
            "pipeline": on_cpu_clock("pipeline", partial(rig.pipeline.run, steps)),
            "bare": on_cpu_clock("bare", partial(bare_steps, rig.bare, steps)),
        },
        plan.repeats,
        rig.info,
    )
    samples = steps * rig.samples_per_step
    pipeline, bare = rates(seconds["pipeline"], samples), rates(seconds["bare"], samples)
    cpu_pipeline, cpu_bare = (statistics.median(cpu_seconds[name]) for name in ("pipeline", "bare"))
    return {
        "steps_per_round": steps,
        "pipeline_samples_per_s": pipeline,
        "bare_samples_per_s": bare,
        "ratio": pipeline.median / bare.median,
        "ratio_per_round": Spread.of(
            [b / p for p, b in zip(seconds["pipeline"], seconds["bare"], strict=True)]
        ),
        "ratio_cpu_time": cpu_bare / cpu_pipeline,
    }


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
    image_folder = cfg.data.source == "data.dataset=imagefolder"
    decode = auto.decode(cfg.data.decode, image_folder, info.device, data.jpeg_share(splits.train))
    loader = data.build_train_loader(splits, cfg.data, info, cfg.train.seed, decode=decode)
    preprocess = data.Preprocess(
        splits, info.device, auto.channels_last(cfg.model.channels_last, info.device)
    )
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


def step_flops(bare: Bare) -> int:
    """FLOPs of one optimizer step's forwards and backwards, counted by PyTorch's dispatcher.

    Counted on the bare module (no DDP or compile wrapper). The optimizer update and the
    clip are elementwise and left out, as MFU conventionally does.
    """
    model = distributed.unwrap_model(bare.model)
    with FlopCounterMode(display=False) as counter:
        for images, labels in itertools.islice(itertools.cycle(bare.batches), bare.accum):
            bare_forward_backward(bare, model, images, labels)
    bare.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int, plan: Plan) -> Spread:
    """FLOP/s of a square matmul of `size` in `dtype`."""
    a, b, out = (torch.randn(size, size, device=device).to(dtype) for _ in range(3))
    torch.mm(a, b, out=out)  # warm-up: kernel selection, allocation
    once = timed(lambda: torch.mm(a, b, out=out), device)
    iterations = max(1, math.ceil(plan.min_round_s / once))

    def matmuls() -> None:
        for _ in range(iterations):
            torch.mm(a, b, out=out)

    seconds = [timed(matmuls, device) for _ in range(plan.repeats)]
    return rates(seconds, 2 * size**3 * iterations)


def measure_mfu(rig: Rig, plan: Plan, step_rate: float) -> dict[str, Any]:
    """Training FLOP/s over the peak that training's MFU divides by (metrics.peak_flops: the
    datasheet for known GPUs, else the fastest large matmul), with the matmul rates of a few
    sizes in the training dtype, measured here with the same threads, for context."""
    flops = step_flops(rig.bare)
    dtype = rig.bare.amp_dtype or torch.float32
    device = rig.info.device
    by_size = {size: matmul_flops(device, dtype, size, plan) for size in MATMUL_SIZES[device.type]}
    peak, source = metrics.peak_flops(device, dtype)
    achieved = flops * step_rate / rig.samples_per_step
    return {
        "flops_per_step": flops,
        "model_flops_per_s": achieved,
        "peak_flops_per_s": peak,
        "peak_source": source,
        "matmul_flops_per_s_by_size": {size: rate for size, rate in by_size.items()},
        "mfu": achieved / peak,
    }


def write_raw(path: Path, payload: bytes) -> None:
    with path.open("wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def measure_checkpoint(rig: Rig, plan: Plan) -> dict[str, Any]:
    """train.py's synchronous save vs writing as many bytes with one fsync, same directory.

    Each save reports a better accuracy than the last, as early in a run, so best.json is
    rewritten every time (the costlier path); retention deletes old files as in training.
    A small atomic write (temporary file, fsync, rename, directory fsync) is timed too: a save
    makes several (checkpoint, manifest, best.json), so on storage where fsync dominates the
    ratio is about their count.
    """
    directory = storage.checkpoint_dir(rig.cfg.run.dir)
    raw_path, small_path = directory / "raw.bin", directory / "small.json"
    saves: list[float] = []
    raws: list[float] = []
    smalls: list[float] = []
    for step in range(plan.repeats + 1):  # step 0 is warm-up
        saves.append(
            timed(partial(rig.pipeline.save, step, 0.5 + 0.01 * step, None), rig.info.device)
        )
        payload = os.urandom((directory / f"step_{step}.pt").stat().st_size)
        raws.append(timed(partial(write_raw, raw_path, payload), rig.info.device))
        raw_path.unlink()
        small = partial(storage.atomic_write_bytes, small_path, lambda f: f.write(b"{}"))
        smalls.append(timed(small, rig.info.device))
    save_s, raw_s = Spread.of(saves[1:]), Spread.of(raws[1:])
    large = measure_large_checkpoint(directory, plan, rig.info.device)
    return {
        "bytes": len(payload),
        "save_s": save_s,
        "raw_write_s": raw_s,
        "small_atomic_write_s": Spread.of(smalls[1:]),
        "ratio": save_s.median / raw_s.median,
        "large": large,
    }


def measure_large_checkpoint(directory: Path, plan: Plan, device: torch.device) -> dict[str, Any]:
    """storage.save of a 64 MiB state (16 tensors of 4 MiB, the size of a mid-sized
    model's weights and momentum) vs a raw write of its bytes: where the fixed costs of a
    save (torch.save's per-tensor records, the manifest's fsyncs) no longer dominate."""
    state = {"model": {f"w{i}": torch.randn(1 << 20) for i in range(16)}, "step": 0}
    large_dir = directory / "large"
    saves: list[float] = []
    raws: list[float] = []
    for step in range(plan.repeats + 1):
        saves.append(timed(partial(storage.save, state, large_dir, step, 1, None), device))
        payload = os.urandom((large_dir / f"step_{step}.pt").stat().st_size)
        raw_path = large_dir / "raw.bin"
        raws.append(timed(partial(write_raw, raw_path, payload), device))
        raw_path.unlink()
    save_s, raw_s = Spread.of(saves[1:]), Spread.of(raws[1:])
    # The same state handed to a writer process (ckpt.async_save): what training waits for
    # is the copy into the writer's shared buffers, which grows with the bytes as the write
    # does, while the fixed costs of a small state's hand-over (state dicts, the message) fade.
    handovers: list[float] = []
    saver = writer.ProcessSaver()
    try:
        for step in range(plan.repeats + 1):  # the first one makes the buffers
            started = time.perf_counter()
            saver.save(state, large_dir / "async", step, 1, None)
            handovers.append(time.perf_counter() - started)
            saver.wait()
    finally:
        saver.close()
    handover_s = Spread.of(handovers[1:])
    return {
        "bytes": len(payload),
        "save_s": save_s,
        "raw_write_s": raw_s,
        "ratio": save_s.median / raw_s.median,
        "handover_s": handover_s,
        "handover_ratio": handover_s.median / save_s.median,
    }


def measure_async(rig: Rig, plan: Plan, sync_save_s: float) -> dict[str, Any]:
    """Bare steps after a ProcessSaver save vs the same steps without one.

    A round spans enough steps to cover a whole synchronous save and ends in `wait()`, so a
    write that outlasts it is counted in full. The stall is what `save()` blocks for (building
    the state, the copy into shared memory) plus any slowdown the writer process
    causes the steps (cores, memory bandwidth, the page cache).
    """
    saver = writer.ProcessSaver()
    try:
        return _measure_async(rig, plan, sync_save_s, saver)
    finally:
        saver.close()


def _measure_async(
    rig: Rig, plan: Plan, sync_save_s: float, saver: writer.ProcessSaver
) -> dict[str, Any]:
    step_s = timed(partial(bare_steps, rig.bare, 1), rig.info.device)
    steps = max(2, math.ceil(sync_save_s / step_s) + 1)
    next_step = itertools.count(10**6)  # after the synchronous saves: retention prunes those
    blocking: list[float] = []

    def steps_with_save() -> None:
        started = time.perf_counter()
        rig.pipeline.save(next(next_step), None, saver)
        blocking.append(time.perf_counter() - started)
        bare_steps(rig.bare, steps)
        saver.wait()

    steps_with_save()  # warm-up: the writer has started, the shared buffers exist
    blocking.clear()
    # A stall of a few milliseconds in rounds of hundreds: three times the usual rounds.
    rounds = 3 * plan.repeats
    seconds = interleaved(
        {"plain": partial(bare_steps, rig.bare, steps), "async": steps_with_save},
        rounds,
        rig.info,
    )
    stall = Spread.of([a - p for a, p in zip(seconds["async"], seconds["plain"], strict=True)])
    save_call = Spread.of(blocking)
    return {
        "steps_per_round": steps,
        "rounds": rounds,
        "plain_round_s": Spread.of(seconds["plain"]),
        "stall_s": stall,
        "save_call_s": save_call,
        # What training waits for in save() alone, without the noise of the rounds
        "handover_ratio": save_call.median / sync_save_s,
        # Below the noise the difference can come out negative: no measurable stall.
        "ratio": max(0.0, stall.median) / sync_save_s,
    }


# ---------------------------------------------------------------------------------------------
# Weak scaling: spawned ranks, 1 thread each


def measure_rank(
    cfg: Config, info: DistInfo, plan: Plan, stats: Stats, run_dir: Path
) -> dict[str, Any]:
    """Seconds per round of the pipeline; with several ranks also of the bare loop with and
    without the gradient all-reduce, whose difference is the all-reduce time backward does
    not hide. `cpu_share` per rank (CPU seconds / wall seconds of the rounds) tells whether
    each rank had a core to itself: below 1 other processes took part of it."""
    rig = build_rig(cfg, info, plan, stats, run_dir)
    try:
        steps = plan.scaling_steps
        rig.pipeline.run(plan.warmup_steps)
        bare_steps(rig.bare, plan.warmup_steps)
        fns: dict[str, Callable[[], Any]] = {"pipeline": partial(rig.pipeline.run, steps)}
        if info.world_size > 1:
            fns["bare_sync"] = partial(bare_steps, rig.bare, steps)
            fns["bare_no_sync"] = partial(bare_steps, rig.bare, steps, sync=False)
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        seconds: dict[str, Any] = interleaved(fns, plan.repeats, info)
        cpu_share = (time.process_time() - cpu_started) / (time.perf_counter() - wall_started)
        seconds["cpu_share"] = distributed.all_gather_object(cpu_share)
        return seconds
    finally:
        rig.close()


def rank_entry(
    rank: int,
    world_size: int,
    device_type: str,
    cfg: Config,
    plan: Plan,
    stats: Stats,
    scratch: str,
) -> None:
    """One spawned rank: join a group through a file store (no port to race for), measure."""
    torch.set_num_threads(1)
    run_dir = Path(scratch) / f"ranks{world_size}"
    log_to(Path(scratch) / f"ranks{world_size}-rank{rank}.log")
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    backend = None
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL binds its communicator to a device
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"file://{scratch}/store{world_size}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=300),
        )
    try:
        info = DistInfo(rank, rank, world_size, device, backend)
        seconds = measure_rank(cfg, info, plan, stats, run_dir)
        if info.is_main:
            (run_dir / "seconds.json").write_text(json.dumps(seconds))
    finally:
        distributed.teardown()


def measure_scaling(
    cfg: Config, device: torch.device, plan: Plan, stats: Stats, scratch: Path
) -> dict[str, Any]:
    """1 rank, then 2 ranks, both spawned the same way: only the world size differs."""
    seconds = {}
    for world_size in (1, 2):
        mp.start_processes(
            rank_entry,
            args=(world_size, device.type, cfg, plan, stats, str(scratch)),
            nprocs=world_size,
            start_method="spawn",
        )
        seconds[world_size] = json.loads(
            (scratch / f"ranks{world_size}" / "seconds.json").read_text()
        )
    samples = plan.scaling_steps * global_batch_size(measured_config(cfg, plan, scratch), 1)
    one = rates(seconds[1]["pipeline"], samples)
    two = rates(seconds[2]["pipeline"], 2 * samples)
    synced, unsynced = Spread.of(seconds[2]["bare_sync"]), Spread.of(seconds[2]["bare_no_sync"])
    return {
        "one_rank_samples_per_s": one,
        "two_ranks_samples_per_s": two,
        "efficiency": two.median / (2 * one.median),
        "bare_step_s_with_allreduce": synced.median / plan.scaling_steps,
        "bare_step_s_without_allreduce": unsynced.median / plan.scaling_steps,
        # Below the noise the difference can come out negative: read it as fully hidden.
        "allreduce_exposed_fraction": (synced.median - unsynced.median) / synced.median,
        "cpu_share_one_rank": seconds[1]["cpu_share"],
        "cpu_share_two_ranks": seconds[2]["cpu_share"],
    }


# ---------------------------------------------------------------------------------------------
# Strategies: what each rank holds, and how fast, under ddp, zero and fsdp at 2 ranks

STRATEGIES = ("ddp", "zero", "fsdp")


def _rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm, pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _local_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(
        distributed.local_tensor(t).numel() * t.element_size()
        for t in tensors
        if isinstance(t, torch.Tensor)
    )


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """This rank's optimizer state tensors (ZeRO: its local optimizer's, its shard)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer.optim
    for entry in local.state.values():
        yield from (value for value in entry.values() if isinstance(value, torch.Tensor))


def strategy_entry(
    rank: int,
    strategy: str,
    model_name: str,
    image: int,
    batch: int,
    steps: int,
    rounds: int,
    device_type: str,
    scratch: str,
    store: int,
    async_stall: bool,
) -> None:
    """One of 2 spawned ranks under `strategy` (`store`: a file store of its own): bytes of
    parameters, gradients and optimizer state this rank holds after a step, its peak memory,
    and seconds per `steps` steps; under fsdp the checkpoint timings too (the async stall
    unless `async_stall` is false)."""
    import resource

    from config import DistConfig, ModelConfig, OptimConfig
    from model import build

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"file://{scratch}/store-{strategy}-{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=300),
    )
    try:
        info = DistInfo(rank, rank, 2, device, backend)
        rss_start = _rss_bytes()
        torch.manual_seed(0)
        model = build(ModelConfig(name=model_name), (3, image, image), 100)
        if not parallel.shards(strategy):  # fsdp shards it onto the device (build.build_model)
            model = model.to(device)
        par = parallel.parallelize(model, info, DistConfig(strategy=strategy))
        kind, groups, settings = engine.optimizer_spec(par.bare, OptimConfig(name="adamw"))
        optimizer = par.build_optimizer(kind, groups, **settings)
        scaler = engine.make_scaler(device, None)
        loss_fn = nn.CrossEntropyLoss()
        generator = torch.Generator().manual_seed(rank)
        images = torch.randn(batch, 3, image, image, generator=generator).to(device)
        labels = torch.randint(0, 100, (batch,), generator=generator).to(device)
        held: dict[str, int] = {}

        def step(count: bool = False) -> None:
            engine.forward_backward(
                par.model, [(images, labels)], optimizer, scaler, loss_fn, None, 0.0
            )
            if count:  # gradients exist between backward and the update
                held["grads"] = _local_bytes(p.grad for p in par.bare.parameters())
            engine.apply_update(optimizer, scaler)

        step(count=True)
        held["params"] = _local_bytes(par.bare.parameters())
        held["optimizer_state"] = _local_bytes(optimizer_state_tensors(optimizer))
        seconds = [
            timed(partial(lambda: [step() for _ in range(steps)]), device) for _ in range(rounds)
        ]
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            peak_kind = "max_memory_allocated"
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_start
            peak_kind = "peak RSS above the RSS before the model was built"
        report = {**held, "peak_bytes": peak, "peak_kind": peak_kind, "seconds": seconds}
        if strategy == "fsdp":  # after the peak: the saves' buffers are not training's
            report["checkpoint"] = time_checkpoints(info, par, optimizer, Path(scratch), rounds)
            if async_stall:
                sync_s = statistics.median(report["checkpoint"]["save_sharded_s"])
                report["checkpoint"] |= time_async_stall(
                    info, par, optimizer, Path(scratch), 3, step, sync_s
                )
        gathered = distributed.all_gather_object(report)
        if rank == 0:
            (Path(scratch) / f"strategy-{strategy}.json").write_text(json.dumps(gathered))
        # Every rank's figures are on disk: leave without gloo's C++ teardown, which has
        # aborted a rank here ("terminate called without an active exception") as it does in
        # the tests' spawned ranks under load (tests/helpers.py); the kernel closes the sockets.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    finally:  # a failure: spawn reports this rank's exception
        distributed.teardown()


def time_checkpoints(
    info: DistInfo, par: Any, optimizer: torch.optim.Optimizer, scratch: Path, rounds: int
) -> dict[str, list[float]]:
    """Collective, under fsdp: seconds to save the model and optimizer state as a sharded
    checkpoint (every rank its rows, in parallel) and as one file (gathered whole, rank 0
    writes), alternately on the same state, and to load each back whole on every rank."""
    from ckpt import parts

    model_part, optim_part = parts.ModelState(par.bare), parts.OptimizerState(optimizer)
    gather = distributed.all_gather_object

    def agree(error: BaseException | None, what: str) -> None:
        distributed.raise_if_any_failed(info, error, what)

    sharded_dir, file_dir = scratch / "ckpt-sharded", scratch / "ckpt-file"
    times: dict[str, list[float]] = {"save_sharded_s": [], "save_file_s": []}
    times |= {"load_sharded_s": [], "load_file_s": []}
    for step in range(1, rounds + 1):
        started = time.perf_counter()
        state = {
            "model": model_part.sharded_state_dict(),
            "optimizer": optim_part.sharded_state_dict(),
            "step": step,
        }
        storage.save_sharded(state, sharded_dir, step, 1, None, info.rank, gather, agree)
        times["save_sharded_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        whole = {"model": model_part.state_dict(), "optimizer": optim_part.state_dict()}
        write = partial(storage.save, {**whole, "step": step}, file_dir, step, 1, None)
        distributed.run_on_main(info, "saving the file checkpoint", write)
        times["save_file_s"].append(time.perf_counter() - started)
        for kind, path in (("sharded", sharded_dir / f"step_{step}"), ("file", None)):
            dist.barrier()
            started = time.perf_counter()
            target = path if path is not None else file_dir / f"step_{step}.pt"
            storage.load(target, torch.device("cpu"), verified=info.rank != 0)
            dist.barrier()
            times[f"load_{kind}_s"].append(time.perf_counter() - started)
    return times


def time_async_stall(
    info: DistInfo,
    par: Any,
    optimizer: torch.optim.Optimizer,
    scratch: Path,
    rounds: int,
    step: Callable[[], None],
    sync_s: float,
) -> dict[str, list[float]]:
    """Collective, under fsdp: training steps with an asynchronous sharded save handed over
    at their start (ckpt.async_save: each rank's writer process) vs the same steps without,
    interleaved. A round spans enough steps to cover a synchronous save and ends once the
    manifest is written, so a write that outlasts the steps counts in full; the stall is the
    difference (prepare, the copy into shared memory, and the writers' competition for the
    cores)."""
    from ckpt import parts, writer

    model_part, optim_part = parts.ModelState(par.bare), parts.OptimizerState(optimizer)
    gather = distributed.all_gather_object

    def agree(error: BaseException | None, what: str) -> None:
        distributed.raise_if_any_failed(info, error, what)

    def clock() -> float:  # after the device's queued work (CUDA runs ahead of the host)
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        return time.perf_counter()

    started = clock()
    step()
    steps = max(2, math.ceil(sync_s / (clock() - started)) + 1)
    saver = writer.ProcessSaver()
    directory = scratch / "ckpt-async"
    times: dict[str, list[float]] = {"steps_s": [], "steps_with_async_save_s": []}
    times["async_handover_s"] = []
    try:
        for number in range(rounds + 1):  # round 0: warm-up (the writer's buffers)
            dist.barrier()
            started = clock()
            for _ in range(steps):
                step()
            plain = clock() - started
            dist.barrier()
            started = clock()
            state = {
                "model": model_part.sharded_state_dict(),
                "optimizer": optim_part.sharded_state_dict(),
                "step": number + 1,
            }
            plan = storage.prepare_sharded(state, directory, number + 1, info.rank, gather, agree)
            saver.write_sharded(plan)
            handover = clock() - started
            for _ in range(steps):
                step()
            written = saver.wait()
            storage.finish_sharded(plan, written, None, 1, None, info.rank, gather, agree)
            with_save = clock() - started
            if number:
                times["steps_s"].append(plain)
                times["steps_with_async_save_s"].append(with_save)
                times["async_handover_s"].append(handover)
    finally:
        saver.close()
    return times


def measure_strategies(
    model_name: str,
    device: torch.device,
    plan: Plan,
    scratch: Path,
    image: int = 64,
    batch: int = 8,
) -> dict[str, Any]:
    """ddp, zero and fsdp at 2 ranks on `model_name`, each in fresh processes (a peak of
    memory is a process's), the strategies' turns interleaved over rounds (one with --quick)."""
    per_strategy: dict[str, list[dict[str, Any]]] = {s: [] for s in STRATEGIES}
    steps = max(2, plan.scaling_steps // 4)
    for repeat in range(1 if plan.quick else max(2, plan.repeats // 2)):
        order = STRATEGIES if repeat % 2 == 0 else tuple(reversed(STRATEGIES))
        for strategy in order:
            mp.start_processes(
                strategy_entry,
                args=(
                    strategy,
                    model_name,
                    image,
                    batch,
                    steps,
                    2,
                    device.type,
                    str(scratch),
                    repeat,
                    not plan.quick,  # the async stall: minutes more on 2 cores
                ),
                nprocs=2,
                start_method="spawn",
            )
            ranks = json.loads((scratch / f"strategy-{strategy}.json").read_text())
            per_strategy[strategy].append(ranks)
    result: dict[str, Any] = {
        "model": model_name,
        "input": [3, image, image],
        "batch_per_rank": batch,
        "steps_per_round": steps,
    }
    ddp_state = None
    for strategy, runs in per_strategy.items():
        first = runs[0]  # bytes do not vary between runs; the peak barely does
        state = max(r["params"] + r["grads"] + r["optimizer_state"] for r in first)
        rounds = [s for run in runs for r in run[:1] for s in r["seconds"]]
        result[strategy] = {
            "params_bytes_per_rank": [r["params"] for r in first],
            "grads_bytes_per_rank": [r["grads"] for r in first],
            "optimizer_state_bytes_per_rank": [r["optimizer_state"] for r in first],
            "state_bytes_max_rank": state,
            "peak_bytes_per_rank": Spread.of([max(r["peak_bytes"] for r in run) for run in runs]),
            "peak_kind": first[0]["peak_kind"],
            "samples_per_s": rates(rounds, 2 * batch * steps),
        }
        ddp_state = ddp_state or state
        result[strategy]["state_vs_ddp"] = state / ddp_state
    fsdp_runs = per_strategy["fsdp"]
    if "checkpoint" in fsdp_runs[0][0]:
        result["checkpoint"] = {
            key: Spread.of([s for run in fsdp_runs for s in run[0]["checkpoint"][key]])
            for key in fsdp_runs[0][0]["checkpoint"]
        }
        if "steps_s" in fsdp_runs[0][0]["checkpoint"]:
            stalls = [
                a - p
                for run in fsdp_runs
                for a, p in zip(
                    run[0]["checkpoint"]["steps_with_async_save_s"],
                    run[0]["checkpoint"]["steps_s"],
                    strict=True,
                )
            ]
            result["stall_s"] = Spread.of(stalls)
            # Below the noise the difference can come out negative: no measurable stall.
            sync = result["checkpoint"]["save_sharded_s"].median
            result["stall_ratio"] = max(0.0, result["stall_s"].median) / sync
            result["handover_ratio"] = result["checkpoint"]["async_handover_s"].median / sync
    return result


def strategies_table(result: dict[str, Any]) -> str:
    """MB per rank (the larger of the two ranks), peak memory and samples/s of each strategy."""
    lines = [
        f"strategies at 2 ranks: {result['model']} on {result['input']} inputs, batch "
        f"{result['batch_per_rank']} per rank, AdamW; MB per rank (the larger rank)",
        f"{'strategy':<9} {'params':>8} {'grads':>8} {'optim':>8} {'state':>8} {'vs ddp':>7}  "
        f"{'peak MB':<18} samples/s",
    ]
    for strategy in STRATEGIES:
        r = result[strategy]
        peak = r["peak_bytes_per_rank"]
        lines.append(
            f"{strategy:<9} {max(r['params_bytes_per_rank']) / 1e6:>8.1f} "
            f"{max(r['grads_bytes_per_rank']) / 1e6:>8.1f} "
            f"{max(r['optimizer_state_bytes_per_rank']) / 1e6:>8.1f} "
            f"{r['state_bytes_max_rank'] / 1e6:>8.1f} {r['state_vs_ddp']:>7.2f}  "
            f"{f'{peak.median / 1e6:.0f} [{peak.min / 1e6:.0f}-{peak.max / 1e6:.0f}]':<18} "
            f"{r['samples_per_s'].show('{:.1f}')}"
        )
    lines.append(f"peak: {result[STRATEGIES[0]]['peak_kind']}")
    if "checkpoint" in result:
        c = result["checkpoint"]
        lines.append(
            "fsdp checkpoint of model + optimizer state, seconds: save sharded "
            f"{c['save_sharded_s'].show('{:.3f}')} vs one file by rank 0 "
            f"{c['save_file_s'].show('{:.3f}')}; load sharded {c['load_sharded_s'].show('{:.3f}')}"
            f" vs one file {c['load_file_s'].show('{:.3f}')}"
        )
        if "stall_ratio" in result:
            lines.append(
                f"async sharded save: stall {result['stall_s'].show('{:.3f}')} s over "
                f"{c['steps_s'].median:.1f} s of steps, hand-over "
                f"{c['async_handover_s'].show('{:.3f}')} s ({result['handover_ratio']:.2f} of a "
                f"synchronous sharded save); stall / synchronous sharded save "
                f"{result['stall_ratio']:.2f}"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Time to accuracy, read from a finished run


def time_to_accuracy(run_dir: Path, targets: tuple[float, ...] = (0.90, 0.92)) -> dict[str, Any]:
    """The first evaluation at or above each target in RUN_DIR/metrics.jsonl.

    `time_s` is train.py's: seconds from the start of training (after the job is built) to
    the end of that evaluation; a resumed run restarts the clock.
    """
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    evals = [row for row in map(json.loads, filter(str.strip, lines)) if row["kind"] == "eval"]
    found = {}
    for target in targets:
        row = next((r for r in evals if r["accuracy"] >= target), None)
        keys = ("step", "epoch", "accuracy", "time_s")
        found[f"{target:.0%}"] = None if row is None else {key: row.get(key) for key in keys}
    return found


# ---------------------------------------------------------------------------------------------
# Report


def log_to(path: Path) -> None:
    """The pipeline's log lines go to a file: produced (their cost is real), not shown."""
    logging.basicConfig(
        filename=path,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def environment(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    return {
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_start": os.getloadavg()[0],
    }


def to_json(value: Any) -> Any:
    if isinstance(value, Spread):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    return value


def notes(details: dict[str, Any]) -> dict[str, str]:
    """One line per figure: what it was computed from (median [min-max])."""
    o, ld, m, c = details["overhead"], details["loader"], details["mfu"], details["checkpoint"]
    lines = {
        "overhead_ratio": f"pipeline {o['pipeline_samples_per_s'].show()} / "
        f"bare {o['bare_samples_per_s'].show()} samples/s; by CPU time {o['ratio_cpu_time']:.3f}",
        "loader_headroom": f"loader {ld['loader_samples_per_s'].show()} samples/s "
        f"({ld['num_workers']} workers) / step {ld['step_samples_per_s']:,.0f}",
        "mfu": f"{m['flops_per_step'] / 1e9:.2f} GFLOP/step, {m['model_flops_per_s'] / 1e9:.2f} "
        f"GFLOP/s / peak {m['peak_flops_per_s']:,.3g} FLOP/s ({m['peak_source']})",
        "checkpoint_save_ratio": f"save {c['save_s'].show('{:.4f}')} s / raw "
        f"{c['raw_write_s'].show('{:.4f}')} s, {c['bytes'] / 1e6:.2f} MB; one small atomic "
        f"write {c['small_atomic_write_s'].show('{:.4f}')} s",
        "checkpoint_save_ratio_64mib": f"save {c['large']['save_s'].show('{:.4f}')} s / raw "
        f"{c['large']['raw_write_s'].show('{:.4f}')} s, {c['large']['bytes'] / 1e6:.1f} MB; "
        f"handed to a writer process, save() blocks {c['large']['handover_s'].show('{:.4f}')} "
        f"s, {c['large']['handover_ratio']:.3f} of the synchronous save",
    }
    if (s := details["scaling"]) is not None:
        lines["weak_scaling_efficiency"] = (
            f"2 ranks {s['two_ranks_samples_per_s'].show()} / 2 x 1 rank "
            f"{s['one_rank_samples_per_s'].show()} samples/s; all-reduce not hidden: "
            f"{s['allreduce_exposed_fraction']:.1%} of a step; CPU share per rank "
            f"{'/'.join(f'{share:.2f}' for share in s['cpu_share_two_ranks'])}"
        )
    if (a := details["async"]) is not None:
        lines["async_checkpoint_stall_ratio"] = (
            f"stall {a['stall_s'].show('{:.4f}')} s in {a['rounds']} rounds of "
            f"{a['steps_per_round']} steps ({a['plain_round_s'].show('{:.3f}')} s without a save); "
            f"save() blocks {a['save_call_s'].show('{:.4f}')} s, {a['handover_ratio']:.3f} of a "
            "synchronous save"
        )
    return lines


def table(report: dict[str, Any]) -> str:
    explained = {**notes(report["details"]), **report["unavailable"]}
    lines = [f"{'figure':<29} {'value':>6}  {'target':<7}  detail: median [min-max]"]
    for key, target in TARGETS.items():
        value = "null" if report[key] is None else f"{report[key]:.3g}"
        lines.append(f"{key:<29} {value:>6}  {target:<7}  {explained[key]}")
    for name, row in report.get("time_to_accuracy", {}).items():
        reached = "not reached"
        if row is not None:
            seconds = "no time_s" if row["time_s"] is None else f"{row['time_s']:.0f} s"
            reached = f"{seconds}, step {row['step']} (epoch {row['epoch']})"
        lines.append(f"{'time to ' + name + ' accuracy':<29} {reached}")
    env = report["environment"]
    lines.append(
        f"torch {env['torch']} on {env['device']}, {env['cpu']} ({env['cpus_usable']} CPUs), "
        f"{env['torch_threads']} thread(s), load average {env['load_average_at_start']:.2f} "
        f"at start, {report['load_average_at_end']:.2f} at end; {report['wall_s']:.0f} s"
    )
    return "\n".join(lines)


def measure(cfg: Config, device: torch.device, plan: Plan, scratch: Path) -> dict[str, Any]:
    """Every figure: first those of this process, then the spawned ranks (cores to themselves)."""
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=device)
    splits = data.build_datasets(cfg.data, cfg.train.seed, info)
    stats = (splits.mean, splits.std)
    rig = build_rig(cfg, info, plan, stats, scratch / "single")
    try:
        overhead = measure_overhead(rig, plan)
        step_rate = overhead["pipeline_samples_per_s"].median
        # The measured batch size, with the configured workers.
        workers = dataclasses.replace(rig.cfg.data, num_workers=cfg.data.num_workers)
        loader = measure_loader(
            dataclasses.replace(rig.cfg, data=workers), splits, info, plan, step_rate
        )
        mfu = measure_mfu(rig, plan, step_rate)
        ckpt = measure_checkpoint(rig, plan)
        async_save = measure_async(rig, plan, ckpt["save_s"].median)
    finally:
        rig.close()
    unavailable = {}
    scaling = None
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        unavailable["weak_scaling_efficiency"] = "needs 2 GPUs on this machine"
    else:
        scaling = measure_scaling(cfg, device, plan, stats, scratch)
    return {
        "overhead_ratio": overhead["ratio"],
        "overhead_ratio_cpu_time": overhead["ratio_cpu_time"],
        "weak_scaling_efficiency": None if scaling is None else scaling["efficiency"],
        "loader_headroom": loader["headroom"],
        "mfu": mfu["mfu"],
        "checkpoint_save_ratio": ckpt["ratio"],
        "checkpoint_save_ratio_64mib": ckpt["large"]["ratio"],
        "async_checkpoint_stall_ratio": async_save["ratio"],
        "unavailable": unavailable,
        "details": {
            "overhead": overhead,
            "scaling": scaling,
            "loader": loader,
            "mfu": mfu,
            "checkpoint": ckpt,
            "async": async_save,
        },
    }


def parse(argv: list[str]) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        description="Benchmark the training pipeline. Other arguments (--section.field=VALUE, "
        "--config FILE.toml) configure the measured job as for train.py."
    )
    parser.add_argument(
        "--quick", action="store_true", help="a short smoke run (about a minute on 2 cores)"
    )
    parser.add_argument("--out", type=Path, help="also write the report here as JSON")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: what torchrun gives each rank)"
    )
    parser.add_argument("--repeats", type=int, help="timed rounds per figure (default 5)")
    parser.add_argument(
        "--time-to-accuracy",
        type=Path,
        metavar="RUN_DIR",
        help="also report when RUN_DIR/metrics.jsonl first reached 90%% and 92%% accuracy",
    )
    parser.add_argument(
        "--strategies",
        metavar="MODEL",
        help="also measure ddp, zero and fsdp at 2 ranks on model.name MODEL (resnet50): bytes "
        "of parameters, gradients and optimizer state per rank, peak memory, samples/s",
    )
    parser.add_argument(
        "--only-strategies",
        action="store_true",
        help="with --strategies: measure the strategies alone (not the pipeline's figures)",
    )
    args, rest = parser.parse_known_args(argv)
    return args, parse_args(rest, prog="benchmarks/run.py")


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    try:
        args, cfg = parse(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if cfg.dist.strategy != "ddp":
        # The figures compare train.py's loop with a hand-written DDP loop on the same model;
        # the strategies are measured side by side with --strategies MODEL instead.
        print(
            f"error: dist.strategy={cfg.dist.strategy}: the benchmark measures the ddp pipeline "
            "against a bare DDP loop; use --strategies MODEL to compare ddp, zero and fsdp",
            file=sys.stderr,
        )
        return 2
    plan = QUICK if args.quick else FULL
    if args.repeats:
        plan = dataclasses.replace(plan, repeats=args.repeats)
    torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    env = environment(device)
    # Beside the run dir: on the filesystem the run's checkpoints would go to.
    parent = Path(cfg.run.dir).resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".benchmark-", dir=parent))
    try:
        log_to(scratch / "pipeline.log")
        report = {} if args.only_strategies else measure(cfg, device, plan, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.time_to_accuracy:
        report["time_to_accuracy"] = time_to_accuracy(args.time_to_accuracy)
    if args.strategies:
        scratch = Path(tempfile.mkdtemp(prefix=".benchmark-", dir=parent))
        try:
            report["strategies"] = measure_strategies(args.strategies, device, plan, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    report.update(
        environment=env,
        plan=dataclasses.asdict(plan),
        config=cfg.to_dict(),
        command=sys.argv,
        load_average_at_end=os.getloadavg()[0],
        wall_s=time.perf_counter() - started,
    )
    if not args.only_strategies:
        print(table(report))
    if "strategies" in report:
        print(strategies_table(report["strategies"]))
    if args.out:
        args.out.write_text(json.dumps(to_json(report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
