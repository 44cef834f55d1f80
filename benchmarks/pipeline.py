"""The pipeline and the bare loop it is compared with: overhead_ratio.

- overhead_ratio: samples/s of train.py's own loop (Trainer.train_steps: step guard, sample
  ledger, watchdog, meter, log rows) / samples/s of a bare hand-written loop doing the same math;
  overhead_ratio_cpu_time is the same per CPU second, which on CPU other processes cannot move.

Both training loops replay the same uint8 batches, taken once from the pipeline's own training
loader, so neither pays for loading and the ratio isolates the step; the loader is measured on
its own (benchmarks/loaders.py). The other measurements take the same rig (`build_rig`).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import distributed
import engine
import parallel
import resilience
import train
import verdicts
from benchmarks.common import Batch, Plan, Spread, Stats, interleaved, rates
from ckpt import writer
from config import Config, for_world_size
from distributed import DistInfo
from optim import schedules, spec

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
    """train.py's Trainer, driven through its public API: `train_steps(n)`, and its
    checkpoint manager's `use_saver` and `save`.

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

    def run_on_host_verdicts(self, num_steps: int) -> None:
        """`run`, the vote read on the host every step (train.verdict=host) over the same
        optimizer and statistics: the rounds the device verdicts are measured against."""
        trainer, own = self.trainer, self.trainer.verdicts
        trainer.verdicts = verdicts.HostVerdicts(own.guard, own.optimizer, own.scaler, own.buffers)
        trainer.verdicts.on_diverged = own.on_diverged
        try:
            trainer.train_steps(num_steps)
        finally:
            trainer.verdicts = own

    def save(self, step: int, accuracy: float | None, saver: writer.ProcessSaver | None) -> None:
        """The Trainer's checkpoint save as of `step`: synchronous, or handed to `saver`."""
        self.trainer.checkpoints.use_saver(saver)
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

    The optimizer is written out here rather than taken from optim.spec.build_optimizer, so that
    the test's parameter comparison checks the pipeline against an independent statement of
    the math: SGD (momentum, Nesterov) or AdamW, weight decay on conv/linear weights only.
    """
    model = distributed.wrap_model(copy.deepcopy(distributed.unwrap_model(pipeline.model)), info)
    settings = pipeline.trainer.auto  # the run's autos, resolved once (auto.resolve)
    if settings.compile:
        model = torch.compile(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    o = cfg.optim
    optimizer: torch.optim.Optimizer
    kernels = spec.optimizer_kernels(settings.optimizer_impl)  # same speed
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
        scheduler=schedules.build_scheduler(
            optimizer, o, pipeline.schedule_steps, pipeline.trainer.steps_per_epoch
        ),
        scaler=torch.amp.GradScaler(info.device.type, enabled=pipeline.amp_dtype == torch.float16),
        batches=pipeline.batches,
        mean=mean,
        inv_std=1.0 / std,
        memory_format=torch.channels_last if settings.channels_last else torch.contiguous_format,
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
# The overhead: the two loops, round for round


def measure_overhead(rig: Rig, plan: Plan) -> dict[str, Any]:
    """Pipeline vs bare loop; a round is one log interval, so each holds one log row.

    Besides wall time, the CPU time of the process (all threads: TensorBoard's writer and the
    watchdog too) is recorded. On CPU it is a cross-check that other processes taking the
    cores cannot move: samples per CPU second, pipeline over bare.
    """
    steps = rig.cfg.log.every_steps
    rig.pipeline.run(plan.warmup_steps)
    bare_steps(rig.bare, plan.warmup_steps)
    cpu_seconds: dict[str, list[float]] = {"pipeline": [], "bare": [], "host_verdicts": []}

    def on_cpu_clock(name: str, fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            started = time.process_time()
            fn()
            cpu_seconds[name].append(time.process_time() - started)

        return run

    loops = {
        "pipeline": on_cpu_clock("pipeline", partial(rig.pipeline.run, steps)),
        "bare": on_cpu_clock("bare", partial(bare_steps, rig.bare, steps)),
    }
    if rig.pipeline.trainer.verdicts.on_device:  # the same loop, its vote read every step
        loops["host_verdicts"] = on_cpu_clock(
            "host_verdicts", partial(rig.pipeline.run_on_host_verdicts, steps)
        )
    seconds = interleaved(loops, plan.repeats, rig.info)
    samples = steps * rig.samples_per_step
    pipeline, bare = rates(seconds["pipeline"], samples), rates(seconds["bare"], samples)
    cpu_pipeline, cpu_bare = (statistics.median(cpu_seconds[name]) for name in ("pipeline", "bare"))
    host = rates(seconds["host_verdicts"], samples) if "host_verdicts" in seconds else None
    return {
        "verdicts": "device" if host is not None else "host",
        # train.verdict=host's rounds, where the run's own are on the device (else None)
        "host_verdicts_samples_per_s": host,
        "ratio_host_verdicts": None if host is None else host.median / bare.median,
        "steps_per_round": steps,
        "pipeline_samples_per_s": pipeline,
        "bare_samples_per_s": bare,
        "ratio": pipeline.median / bare.median,
        "ratio_per_round": Spread.of(
            [b / p for p, b in zip(seconds["pipeline"], seconds["bare"], strict=True)]
        ),
        "ratio_cpu_time": cpu_bare / cpu_pipeline,
    }
