"""Train MiniResNet data-parallel: `python train.py` alone, `torchrun ... train.py` on many.

The story of a run: parse and validate the config (before any process group exists), join
the process group, build data, model and optimizer, resume if a checkpoint exists, train with
an evaluation and a checkpoint at the end of every epoch, and always leave the process group.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # a bad command line fails in a second, before torch is imported
    import signal

    from config import ConfigError, parse_args

    try:
        _early_cfg = parse_args()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    # Stop signals that arrive before the training loop's handler is installed (torch's import
    # alone takes seconds, and a scheduler may signal at any time): that handler acts on them.
    _EARLY_SIGNALS: list[int] = []
    for _name in _early_cfg.run.preempt_signals:
        signal.signal(signal.Signals[_name], lambda signum, _: _EARLY_SIGNALS.append(signum))

import contextlib
import functools
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import checkpoint
import data
import distributed
import engine
import faults
import preflight
import resilience
import rundir
from config import Config, ConfigError, for_world_size, global_batch_size, parse_args
from distributed import DistInfo
from metrics import (
    MetricsWriter,
    PhaseClock,
    StepProfiler,
    StragglerReport,
    TrainMeter,
    flops_per_sample,
    peak_flops,
)
from model import MiniResNet

log = logging.getLogger("train")


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO, the others only warnings and errors; every line names its rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Position:
    """Where training stands: optimizer steps done, and how far into which epoch.

    `samples_in_epoch` (summed over ranks) is what a resume continues from; it means the same
    on any world size. `step_in_epoch` is for the logs.
    """

    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0
    step_in_epoch: int = 0


@dataclass
class Job:
    """Everything a run trains with, built once by `build`."""

    model: nn.Module  # wrapped for DDP (and torch.compile) when configured
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None
    loss_fn: nn.Module
    train_loader: torch.utils.data.DataLoader
    eval_loader: torch.utils.data.DataLoader
    preprocess: data.Preprocess
    steps_per_epoch: int  # optimizer steps in a whole epoch
    total_steps: int
    num_train: int  # training samples per epoch, before the split over ranks
    data_fingerprint: str
    saver: checkpoint.AsyncSaver | None
    ledger: resilience.SampleLedger
    # The checkpoint resumed from was written on preemption at the end of an epoch (or of the
    # run), before that segment's evaluation: evaluate (and save) before training on.
    pending_eval: bool = False
    lease: rundir.Lease | None = None  # rank 0's hold on the run dir (checked before saves)


def steps_left_in_epoch(cfg: Config, info: DistInfo, num_train: int, consumed: int) -> int:
    """Whole optimizer steps the rest of an epoch holds after `consumed` samples (all ranks)."""
    per_rank = (num_train - consumed) // info.world_size
    return per_rank // cfg.data.batch_size // cfg.train.grad_accum_steps


def write_config(cfg: Config, run_dir: Path) -> None:
    payload = (cfg.to_json() + "\n").encode()
    checkpoint.atomic_write_bytes(run_dir / "config.json", lambda f: f.write(payload))


def write_settled(cfg: Config, run_dir: Path, step: int) -> None:
    """Once resuming is settled: the config, and where an explicit ckpt.resume started the run
    (restarts repeating the command then continue from the run's own checkpoints)."""
    write_config(cfg, run_dir)
    resume = cfg.ckpt.resume
    if resume not in ("auto", "never") and not rundir.continues_from_own_checkpoints(
        run_dir, resume
    ):
        rundir.record_origin(run_dir, resume, step)


def check_run_dir_shared(info: DistInfo, run_dir: Path, wait_s: float = 10.0) -> None:
    """Refuse to train unless every rank sees the files rank 0 writes in run.dir.

    Rank 0 alone writes checkpoints and every rank reads them back on resume, so a run dir on
    node-local disks would fail only at the first restart, hours in. Network filesystems may
    show a new file late (attribute caching): each rank retries for `wait_s` seconds.
    """
    if info.world_size == 1:
        return
    token = distributed.broadcast_object(uuid.uuid4().hex if info.is_main else None)
    marker = run_dir / f".shared-check-{token}"
    distributed.run_on_main(info, f"writing {marker}", lambda: marker.write_text(token))

    def visible() -> bool:
        try:
            return marker.is_file() and marker.read_text() == token
        except OSError:  # e.g. ESTALE on NFS: treat as not (yet) visible, never skip the vote
            return False

    deadline = time.monotonic() + wait_s
    while not visible() and time.monotonic() < deadline:
        time.sleep(0.2)
    error = None
    if not visible():
        error = ConfigError(
            f"run.dir={run_dir} is not shared: rank {info.rank} on {socket.gethostname()} "
            f"cannot see {marker.name}, written there by rank 0. Checkpoints and resume need a "
            "run.dir on storage every node mounts (NFS, Lustre, a ReadWriteMany volume)"
        )
    try:
        distributed.raise_if_any_failed(info, error, f"checking that run.dir={run_dir} is shared")
    finally:  # every rank has voted, so none reads the marker any more
        if info.is_main:
            marker.unlink(missing_ok=True)


def on_cuda_by_default(setting: str, info: DistInfo) -> bool:
    """An auto/on/off speed setting: auto means on for CUDA devices, off elsewhere."""
    return setting == "on" or (setting == "auto" and info.device.type == "cuda")


def channels_last(cfg: Config, info: DistInfo) -> bool:
    """auto = on: NHWC suits tensor cores on CUDA and oneDNN's convolutions on CPU (measured
    +22% to +54% samples/s for the default job on 2 CPU cores, BENCHMARKS.md)."""
    setting = cfg.model.channels_last
    return setting == "on" or (setting == "auto" and info.device.type in ("cuda", "cpu"))


def configure_cuda(cfg: Config, info: DistInfo) -> None:
    """cudnn autotuning (fixed input shapes) and TF32 for fp32 matmuls and convolutions."""
    if info.device.type != "cuda" or not cfg.train.cuda_fast_math:
        return
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def build_model(cfg: Config, splits: data.DataSplits, info: DistInfo) -> nn.Module:
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    model: nn.Module = MiniResNet(
        in_channels=splits.in_channels,
        num_classes=splits.num_classes,
        widths=cfg.model.widths,
        blocks_per_stage=cfg.model.blocks_per_stage,
        norm=cfg.model.norm,
        dropout=cfg.model.dropout,
    )
    if cfg.model.norm == "syncbatch" and info.world_size > 1:
        if info.device.type != "cuda":
            raise ConfigError(
                "model.norm=syncbatch needs CUDA devices (SyncBatchNorm runs on "
                "GPUs only); use model.norm=batch or group on CPU"
            )
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    memory_format = torch.channels_last if channels_last(cfg, info) else torch.preserve_format
    return model.to(device=info.device, memory_format=memory_format)


def build(cfg: Config, info: DistInfo) -> tuple[Job, Position]:
    configure_cuda(cfg, info)
    splits = data.build_datasets(cfg.data, cfg.train.seed, info)
    data_fingerprint = data.fingerprint(splits)
    if cfg.dist.preflight:
        preflight.check(info, data_fingerprint, cfg.fingerprint())
    if cfg.dist.preflight_bandwidth:
        preflight.bandwidth(info)
    # After preflight, so that a run.dir differing between nodes is reported as a config
    # mismatch rather than as a run dir that is not shared.
    check_run_dir_shared(info, Path(cfg.run.dir))
    train_loader = data.build_train_loader(splits, cfg.data, info, cfg.train.seed)
    num_train = len(splits.train)  # type: ignore[arg-type]
    steps_per_epoch = steps_left_in_epoch(cfg, info, num_train, 0)
    if steps_per_epoch == 0:
        raise ConfigError(
            f"an epoch has {len(train_loader)} micro-batches per rank, fewer than "
            f"train.grad_accum_steps={cfg.train.grad_accum_steps}: lower it or data.batch_size"
        )
    resumed = load_resume_state(cfg, info)
    pos = Position()
    if resumed is not None:
        pos = resume_position(cfg, info, *resumed, num_train, data_fingerprint)
    # Steps left = the rest of this epoch + whole epochs after it; counted from `pos` so that a
    # run resumed with another world size (another steps_per_epoch) still ends after cfg epochs.
    remaining = 0
    if pos.epoch < cfg.train.epochs:
        remaining = steps_left_in_epoch(cfg, info, num_train, pos.samples_in_epoch)
        remaining += (cfg.train.epochs - pos.epoch - 1) * steps_per_epoch
    total_steps = pos.step + remaining
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    if resumed is not None and resumed[1].get("total_steps", total_steps) != total_steps:
        log.warning(
            "the run now ends at step %d instead of %d (train.epochs, train.max_steps or the "
            "world size changed): the cosine learning-rate schedule is stretched to match",
            total_steps,
            resumed[1]["total_steps"],
        )
    model = build_model(cfg, splits, info)
    optimizer = engine.build_optimizer(model, cfg.optim)
    scheduler = engine.build_scheduler(optimizer, cfg.optim, total_steps)
    amp_dtype = engine.resolve_amp(cfg.train.amp, info.device)
    scaler = engine.make_scaler(info.device, amp_dtype)
    ledger = resilience.SampleLedger()
    if resumed is not None:
        # Into the bare model, before wrapping: DDP then starts from the loaded weights.
        load_states(*resumed, model, optimizer, scheduler, scaler)
        restore_progress(info, *resumed, pos, ledger)
    wrapped = distributed.wrap_model(model, info, cfg.dist)
    if on_cuda_by_default(cfg.train.compile, info):
        wrapped = torch.compile(wrapped)
    job = Job(
        model=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        amp_dtype=amp_dtype,
        loss_fn=nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing),
        train_loader=train_loader,
        eval_loader=data.build_eval_loader(splits, cfg.data, info, cfg.train.seed),
        preprocess=data.Preprocess(splits, info.device, channels_last(cfg, info)),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        num_train=num_train,
        data_fingerprint=data_fingerprint,
        saver=checkpoint.AsyncSaver() if cfg.ckpt.async_save else None,
        ledger=ledger,
        pending_eval=bool(resumed[1].get("pending_eval")) if resumed is not None else False,
    )
    return job, pos


def check_progress(cfg: Config, info: DistInfo, step: int) -> None:
    """The crash-loop breaker (rundir.count_attempt): every rank raises NoProgress together."""
    message = None
    if info.is_main:
        try:
            rundir.count_attempt(Path(cfg.run.dir), step, cfg.run.max_attempts_without_progress)
        except rundir.NoProgress as err:
            message = str(err)
        except OSError as err:  # the count is a safeguard: never the reason a run fails
            log.warning("cannot count this attempt in %s: %s", cfg.run.dir, err)
    message = distributed.broadcast_object(message)
    if message is not None:
        report_to_launcher("TRAIN_NO_PROGRESS_MARKER", f"no progress from step {step}")
        raise rundir.NoProgress(message)


def load_resume_state(cfg: Config, info: DistInfo) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from, loaded on every rank onto its own device.

    Rank 0 chooses and broadcasts the path, so all ranks load the same file even when a
    shared filesystem shows them different directory listings.
    """
    chosen: list[tuple[Path, dict[str, Any]] | None] = []

    def choose() -> None:
        resume = cfg.ckpt.resume
        if resume not in ("auto", "never") and rundir.continues_from_own_checkpoints(
            Path(cfg.run.dir), resume
        ):
            # A restart repeating the command: PATH only initialised this run
            log.info("ckpt.resume=%s started this run: continuing from its own checkpoints", resume)
            resume = "auto"
        found = checkpoint.load_for_resume(resume, cfg.run.dir, info.device)
        checkpoint.refuse_later_checkpoints(cfg.run.dir, found[1]["step"] if found else 0, resume)
        chosen.append(found)

    distributed.run_on_main(info, "choosing the checkpoint to resume from", choose)
    path = distributed.broadcast_object(str(chosen[0][0]) if chosen and chosen[0] else None)
    if path is None:
        return None
    state: dict[str, Any] | None = chosen[0][1] if chosen and chosen[0] else None
    error: Exception | None = None
    if state is None:  # every rank but 0
        try:
            state = checkpoint.load(path, info.device)
        except Exception as err:  # e.g. this node cannot see rank 0's file: never skip the vote
            error = err
    distributed.raise_if_any_failed(info, error, f"loading {path}")
    assert state is not None
    return Path(path), state


REQUIRED_KEYS = (
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "step",
    "epoch",
    "samples_in_epoch",
    "step_in_epoch",
    "world_size",
    "global_batch_size",
    "config",
    "rng",
    "ledger",
)
# Settings whose change alters the math of the resumed run; reported when they differ.
MATH_SECTIONS = ("data", "model", "optim", "train")
NON_MATH_KEYS = {
    "data.root",
    "data.download",
    "data.num_workers",
    "data.prefetch_factor",
    "data.eval_batch_size",
    "data.batch_size",  # the global batch is compared instead
    "data.global_batch_size",
    "train.epochs",
    "train.max_steps",
    "train.compile",
    "train.max_nonfinite_steps",
    "train.cuda_fast_math",
    "data.loader",
    "model.channels_last",
    "optim.impl",
}


def resume_position(
    cfg: Config,
    info: DistInfo,
    path: Path,
    state: dict[str, Any],
    num_train: int,
    data_fingerprint: str,
) -> Position:
    """Where the checkpoint left off, after checking that this run can continue from there.

    A different world size is fine, also mid-epoch: the position is a count of samples, and
    the sampler hands the new ranks the rest of the epoch. Changes of the training math
    (global batch, schedule, model, data) are reported, not refused.
    """
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} lacks {', '.join(missing)}: not written by this version of "
            "the pipeline"
        )
    old_name = state["config"].get("optim", {}).get("name", cfg.optim.name)
    if old_name != cfg.optim.name:
        raise ConfigError(
            f"optim.name={cfg.optim.name!r} cannot resume checkpoint {path}, written with "
            f"optim.name={old_name!r}: its optimizer state (momentum buffers or Adam moments) "
            f"does not carry over. Resume with --optim.name={old_name}, or start a new run.dir"
        )
    pos = Position(state["step"], state["epoch"], state["samples_in_epoch"], state["step_in_epoch"])
    if pos.samples_in_epoch > num_train:
        raise ConfigError(
            f"checkpoint {path} is {pos.samples_in_epoch} samples into epoch {pos.epoch}, but an "
            f"epoch of this run has {num_train} samples: the dataset or data.subset changed"
        )
    old, new = _flatten(state["config"]), _flatten(cfg.to_dict())
    changed = [
        f"{key} {old.get(key)!r} -> {new[key]!r}"
        for key in sorted(new)
        if key.split(".")[0] in MATH_SECTIONS
        and key not in NON_MATH_KEYS
        and old.get(key) != new[key]
    ]
    this_batch = global_batch_size(cfg, info.world_size)
    if state["global_batch_size"] != this_batch:
        changed.append(
            f"global batch {state['global_batch_size']} ({state['world_size']} ranks) -> "
            f"{this_batch} ({info.world_size} ranks)"
        )
    if state.get("data_fingerprint", data_fingerprint) != data_fingerprint:
        changed.append("the training or evaluation data")
    if changed:
        log.warning(
            "resuming %s with settings that change the training math: %s", path, "; ".join(changed)
        )
    log.info(
        "resuming from %s at step %d (epoch %d, %d samples into it)",
        path,
        pos.step,
        pos.epoch,
        pos.samples_in_epoch,
    )
    return pos


def restore_progress(
    info: DistInfo, path: Path, state: dict[str, Any], pos: Position, ledger: Any
) -> None:
    """Random generators of this rank and the sample ledger of the epoch in progress."""
    rng_states = state["rng"]
    if state["world_size"] == info.world_size:
        resilience.set_rng_state(rng_states[info.rank])
    else:  # no saved state for this rank: a fresh, deterministic one
        seed_everything(int(state["config"]["train"]["seed"]) + info.rank + 7919 * pos.step)
        log.info("world size changed: random generators reseeded from (seed, rank, step)")
    if state["ledger"]["epoch"] == pos.epoch:
        ledger.start_epoch(list(state["ledger"]["totals"]))


def _flatten(sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        f"{section}.{name}": list(value) if isinstance(value, tuple) else value
        for section, fields in sections.items()
        for name, value in fields.items()
    }


def load_states(
    path: Path,
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    scaler: torch.amp.GradScaler,
) -> None:
    # What this run's config built: loading replaces it with the checkpoint's values.
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} does not fit this run's model or optimizer (did model.* or "
            f"optim.name change?): {err}"
        ) from err
    apply_configured_optimizer(optimizer, scheduler, configured, base_lrs)
    if state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    elif scaler.is_enabled():
        log.warning("checkpoint %s has no fp16 GradScaler state: starting a fresh scaler", path)


def apply_configured_optimizer(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    configured: list[dict[str, Any]],
    base_lrs: list[float],
) -> None:
    """Put this run's optimizer settings back after loading a checkpoint's state.

    `optimizer.load_state_dict` restores each group's lr, momentum, weight decay, betas (and
    the kernel choice), `scheduler.load_state_dict` the peak lrs (`base_lrs`): without this a
    changed --optim.lr or --optim.weight_decay would be ignored while the new checkpoint's
    config records it. The step count (`last_epoch`) and the optimizer's per-parameter state
    (momentum buffers, Adam moments) stay as loaded; the lr becomes this run's schedule at the
    current step. Changes are logged as checkpoint -> now.
    """
    changed: dict[str, tuple[Any, Any]] = {}
    for group, wanted, base_lr in zip(optimizer.param_groups, configured, base_lrs, strict=True):
        if group.get("initial_lr") != base_lr:
            changed.setdefault("peak lr", (group.get("initial_lr"), base_lr))
        group["initial_lr"] = base_lr
        for key, value in wanted.items():
            if key in ("lr", "initial_lr"):
                continue
            if group.get(key) != value:
                changed.setdefault(key, (group.get(key), value))
            group[key] = value
    scheduler.base_lrs = list(base_lrs)
    lrs = [
        base_lr * lr_lambda(scheduler.last_epoch)
        for lr_lambda, base_lr in zip(scheduler.lr_lambdas, base_lrs, strict=True)
    ]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports until the next step
    if changed:
        log.info(
            "resumed optimizer now uses the configured settings (checkpoint -> now): %s; "
            "lr at step %d is %.6g",
            "; ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items()),
            scheduler.last_epoch,
            lrs[0],
        )


def save_checkpoint(
    cfg: Config,
    info: DistInfo,
    job: Job,
    pos: Position,
    accuracy: float | None,
    wait: bool = False,
    pending_eval: bool = False,
) -> None:
    """Rank 0 writes; every rank then learns whether that worked (this is also the barrier).

    Saves rank 0's BatchNorm statistics as they are, without averaging them over ranks: DDP
    broadcasts rank 0's buffers at the start of the next forward anyway, so they are the
    model's true state, and leaving them alone keeps a run with checkpoints bit-identical to
    one without (evaluation, at epoch ends, averages them in every run alike). Gathers every
    rank's random generators and sample ledger (collectives: all ranks call).
    With ckpt.async_save the write finishes in the background unless `wait`; a failure of
    the previous write is raised here.
    """
    rng_states = distributed.all_gather_object(resilience.rng_state())
    ledger_totals, _ = job.ledger.totals()
    config_dict, config_hash = _config_record(cfg)

    def write() -> None:
        if job.lease is not None:
            job.lease.check()  # another job took the run dir over: write nothing
        model = distributed.unwrap_model(job.model)
        state = {
            "model": model.state_dict(),
            "optimizer": job.optimizer.state_dict(),
            "scheduler": job.scheduler.state_dict(),
            "scaler": job.scaler.state_dict(),
            "step": pos.step,
            "epoch": pos.epoch,
            "samples_in_epoch": pos.samples_in_epoch,
            "step_in_epoch": pos.step_in_epoch,
            "eval_accuracy": accuracy,
            "pending_eval": pending_eval,
            "total_steps": job.total_steps,
            "world_size": info.world_size,
            "global_batch_size": global_batch_size(cfg, info.world_size),
            "rng": rng_states,
            "ledger": {"epoch": pos.epoch, "totals": ledger_totals},
            "data_fingerprint": job.data_fingerprint,
            "config": config_dict,
            "config_hash": config_hash,
            "torch_version": str(torch.__version__),  # a plain str: weights_only loads it
        }
        directory = checkpoint.checkpoint_dir(cfg.run.dir)
        if job.saver is None:
            checkpoint.save(state, directory, pos.step, cfg.ckpt.keep, accuracy)
            return
        job.saver.save(state, directory, pos.step, cfg.ckpt.keep, accuracy)
        if wait:
            job.saver.wait()

    distributed.run_on_main(info, f"saving the step {pos.step} checkpoint", write)


def preempt(
    cfg: Config, info: DistInfo, job: Job, pos: Position, loop: Loop, signal_name: str
) -> None:
    """Checkpoint where every rank stopped, tell the launcher, and end the run (exit 75).

    At the end of an epoch (or of the run) the statistics are averaged as evaluation would
    average them, and the checkpoint is marked as owing that evaluation: the resumed run
    evaluates first, exactly as this one would have.
    """
    left = steps_left_in_epoch(cfg, info, job.num_train, pos.samples_in_epoch)
    at_segment_end = left == 0 or pos.step == job.total_steps
    if at_segment_end:
        distributed.average_buffers(job.model)
    loop.watchdog.beat(pos.step, "checkpointing")
    save_checkpoint(cfg, info, job, pos, None, wait=True, pending_eval=at_segment_end)
    if info.is_main:  # progress: restarts after this one start counting anew
        rundir.reset_attempts(Path(cfg.run.dir), pos.step)
    # The launcher (scripts/supervise.py) exits 75 only after this
    report_to_launcher("TRAIN_PREEMPT_MARKER", f"checkpoint of step {pos.step} after {signal_name}")
    raise resilience.Preempted(signal_name, pos.step)


@functools.cache
def _config_record(cfg: Config) -> tuple[dict[str, Any], str]:
    """The config as saved in checkpoints, computed once per run (saves wait for it)."""
    return cfg.to_dict(), cfg.fingerprint()


def finish_saving(info: DistInfo, job: Job) -> None:
    """Collective: wait for a background checkpoint write; raise everywhere if it failed."""
    if job.saver is not None:
        distributed.run_on_main(info, "finishing the last checkpoint", job.saver.wait)


class _PoisonedLoss(nn.Module):
    """Fault injection: the wrapped loss times NaN (see faults.py)."""

    def __init__(self, loss_fn: nn.Module) -> None:
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, labels) * float("nan")


@dataclass
class Loop:
    """The per-run helpers the training loop reports to."""

    meter: TrainMeter
    writer: MetricsWriter
    guard: resilience.StepGuard
    preemption: resilience.PreemptionHandler
    watchdog: resilience.Watchdog
    started: float  # time.perf_counter() when training started (for time_s in the metrics)
    clock: PhaseClock
    stragglers: StragglerReport
    profiler: StepProfiler
    allreduce_timer: Any  # distributed.AllReduceTimer under DDP, else None
    flops_per_sample: float = 0.0  # forward + backward, 0 = not counted
    peak_flops: float = 0.0  # of one device in the training dtype, 0 = not measured
    bar: Any = None


def train_epoch(cfg: Config, info: DistInfo, job: Job, pos: Position, loop: Loop) -> str | None:
    """Optimizer steps from `pos` to the end of the epoch (or of the run).

    Returns the name of the preemption signal when the ranks agreed to stop, else None.
    """
    accum = cfg.train.grad_accum_steps
    steps = min(
        steps_left_in_epoch(cfg, info, job.num_train, pos.samples_in_epoch),
        job.total_steps - pos.step,
    )
    data.set_epoch(job.train_loader, pos.epoch, pos.samples_in_epoch)
    batches = iter(job.train_loader)
    job.model.train()
    samples_per_step = global_batch_size(cfg, info.world_size)
    buffers = engine.BufferSnapshot(job.model)
    for i in range(steps):
        loop.watchdog.beat(pos.step, "data loading")
        loop.profiler.before_step(pos.step)
        faults.fire("step", pos.step, info.rank)
        started = time.perf_counter()
        micro_batches = []
        for _ in range(accum):
            images, labels, indices = next(batches)
            job.ledger.add(indices)
            micro_batches.append(job.preprocess(images, labels))
        data_wait = time.perf_counter() - started
        loop.watchdog.beat(pos.step, "forward/backward")
        buffers.take()
        fwd_bwd_start = loop.clock.mark()
        loss_fn = job.loss_fn
        if faults.poison_loss(pos.step, info.rank):
            loss_fn = _PoisonedLoss(loss_fn)
        stats = engine.forward_backward(
            job.model,
            micro_batches,
            job.optimizer,
            job.scaler,
            loss_fn,
            job.amp_dtype,
            cfg.optim.grad_clip,
        )
        fwd_bwd_end = loop.clock.mark()
        verdict = loop.guard.agree(
            stats.loss_sum, stats.grad_norm, loop.preemption.received, pos.step + 1
        )
        optimizer_start = loop.clock.mark()
        engine.apply_update(job.optimizer, job.scaler, skip=verdict.skip)
        if verdict.skip:
            buffers.restore()
        loop.clock.add("fwd_bwd", fwd_bwd_start, fwd_bwd_end)
        loop.clock.add("optimizer", optimizer_start, loop.clock.mark())
        first_bucket, allreduce_s = (
            loop.allreduce_timer.take() if loop.allreduce_timer else (None, 0.0)
        )
        loop.meter.add_allreduce(allreduce_s)
        loop.stragglers.add(
            time.perf_counter() - started, None if first_bucket is None else first_bucket - started
        )
        job.scheduler.step()
        pos.step += 1
        pos.step_in_epoch += 1
        pos.samples_in_epoch += samples_per_step
        loop.meter.update(stats, data_wait, skipped=verdict.skip)
        if loop.bar is not None:
            loop.bar.update(1)
        loop.profiler.after_step(pos.step)
        if pos.step % cfg.log.every_steps == 0 or pos.step == job.total_steps:
            log_train(loop, pos, job.scheduler.get_last_lr()[0])
        stragglers = loop.stragglers.maybe_report(pos.step)  # a collective every N steps
        if stragglers is not None:
            loop.writer.write({"kind": "stragglers", "step": pos.step, **stragglers})
        if verdict.stop is not None:
            return verdict.stop
        # The end of an epoch (or of the run) is saved by the caller, after evaluation.
        segment_ends = i == steps - 1
        if cfg.ckpt.every_steps and pos.step % cfg.ckpt.every_steps == 0 and not segment_ends:
            loop.watchdog.beat(pos.step, "checkpointing")
            save_checkpoint(cfg, info, job, pos, None)
    return None


def evaluate(
    info: DistInfo, job: Job, watchdog: resilience.Watchdog, step: int, average: bool = True
) -> engine.EvalResult:
    if average:
        distributed.average_buffers(job.model)  # every rank evaluates the same model

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in job.eval_loader:
            watchdog.beat(step, "evaluation")
            yield job.preprocess(images, labels)

    return engine.evaluate(job.model, batches(), info.device, job.amp_dtype)


def log_train(loop: Loop, pos: Position, lr: float) -> None:
    figures = loop.meter.reduce(loop.clock.take())  # a collective: every rank logs together
    if loop.flops_per_sample:
        per_rank = loop.flops_per_sample * figures["samples_per_s"] / loop.meter.world_size
        figures["tflops_per_rank"] = per_rank / 1e12
        if loop.peak_flops:
            figures["mfu"] = per_rank / loop.peak_flops
    log.info(
        "step %d epoch %d loss %.4f acc %.4f lr %.4g %.0f samples/s data-wait %.1f%% "
        "step %.1f ms (fwd+bwd %.1f, optimizer %.1f, all-reduce %.1f)%s",
        pos.step,
        pos.epoch,
        figures["loss"],
        figures["accuracy"],
        lr,
        figures["samples_per_s"],
        100 * figures["data_wait_frac"],
        figures["step_ms"],
        figures["fwd_bwd_ms"],
        figures["optimizer_ms"],
        figures["allreduce_ms"],
        f" skipped {loop.guard.skipped_total}" if loop.guard.skipped_total else "",
    )
    loop.writer.write(
        {
            "kind": "train",
            "step": pos.step,
            "epoch": pos.epoch,
            "time_s": time.perf_counter() - loop.started,
            "lr": lr,
            **figures,
            "skipped_steps_total": loop.guard.skipped_total,
        }
    )


def log_eval(job: Job, loop: Loop, result: engine.EvalResult, pos: Position) -> None:
    """The evaluation row, with the epoch's sample ledger so far (a collective)."""
    totals, per_rank = job.ledger.totals()
    log.info(
        "eval step %d epoch %d loss %.4f accuracy %.4f on %d samples; epoch trained on %d "
        "samples, digest %s",
        pos.step,
        pos.epoch,
        result.loss,
        result.accuracy,
        result.num_samples,
        totals[0],
        resilience.digest(totals),
    )
    loop.writer.write(
        {
            "kind": "eval",
            "step": pos.step,
            "epoch": pos.epoch,
            "time_s": time.perf_counter() - loop.started,
            "loss": result.loss,
            "accuracy": result.accuracy,
            "num_samples": result.num_samples,
            "epoch_samples_seen": totals[0],
            "epoch_sample_digest": resilience.digest(totals),
            "sample_digest_per_rank": [resilience.digest(part) for part in per_rank],
        }
    )


def make_loop(
    cfg: Config,
    info: DistInfo,
    job: Job,
    writer: MetricsWriter,
    preemption: resilience.PreemptionHandler,
    stall_timeout_s: float | None = None,
) -> Loop:
    """The loop's helpers: meter, step guard, watchdog, clocks, reports (and FLOP counts)."""
    model = job.model
    loop = Loop(
        meter=TrainMeter(info.device, info.world_size),
        writer=writer,
        guard=resilience.StepGuard(
            info, cfg.train.max_nonfinite_steps, check_grad=not job.scaler.is_enabled()
        ),
        preemption=preemption,
        watchdog=resilience.Watchdog(info, stall_timeout_s or cfg.dist.timeout_s),
        started=time.perf_counter() - writer.time_offset_s,  # time_s goes on after a resume
        clock=PhaseClock(info.device),
        stragglers=StragglerReport(
            info, cfg.log.straggler_every_steps if info.world_size > 1 else 0
        ),
        profiler=StepProfiler(cfg.log.profile_steps, Path(cfg.run.dir), info.rank, info.device),
        allreduce_timer=getattr(getattr(model, "_orig_mod", model), "allreduce_timer", None),
    )
    if cfg.log.mfu:
        count_flops(job, loop, info)
    return loop


def count_flops(job: Job, loop: Loop, info: DistInfo) -> None:
    """FLOPs per training sample, and (rank 0) the device's peak FLOP/s, for MFU in the logs.

    The probe draws random numbers (the matmul operands, the probe model's dropout masks): it
    runs between the generators' restore from a checkpoint and the first resumed step, so the
    generators are put back as they were, or resuming would not continue the same run.
    """
    saved_rng = resilience.rng_state()
    try:
        images, labels = next(iter(job.eval_loader))
        sample, _ = job.preprocess(images[:2], labels[:2])
        loop.flops_per_sample = flops_per_sample(job.model, sample, job.loss_fn)
        if info.is_main:
            loop.peak_flops = peak_flops(info.device, job.amp_dtype or torch.float32)
    finally:
        resilience.set_rng_state(saved_rng)
    if info.is_main:
        log.info(
            "model: %.3g GFLOP per training sample (forward + backward); peak %.3g TFLOP/s "
            "(%s matmul)",
            loop.flops_per_sample / 1e9,
            loop.peak_flops / 1e12,
            job.amp_dtype or torch.float32,
        )


def progress_bar(cfg: Config, info: DistInfo, total: int, initial: int) -> Any:
    show = cfg.log.progress == "on" or (cfg.log.progress == "auto" and sys.stderr.isatty())
    if not (info.is_main and show):
        return nullcontext()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)


def train(cfg: Config, info: DistInfo) -> dict[str, Any]:
    run_dir = Path(cfg.run.dir)
    preemption = resilience.PreemptionHandler(cfg.run.preempt_signals)
    # A signal during start-up (recorded by the first lines of this file) stops at step one.
    preemption.install(globals().get("_EARLY_SIGNALS"))
    lease = rundir.Lease(run_dir, cfg.run.lease_timeout_s)
    created = not run_dir.exists()

    def take_lease() -> None:  # before anything else is written into the run dir
        run_dir.mkdir(parents=True, exist_ok=True)
        lease.acquire()

    try:
        distributed.run_on_main(info, f"taking the lease of run.dir={run_dir}", take_lease)
        return _train(cfg, info, run_dir, preemption, lease if info.is_main else None)
    finally:
        preemption.restore()
        if info.is_main:
            lease.release()
            if created:  # a run refused before writing anything leaves no empty run dir
                with contextlib.suppress(OSError):
                    run_dir.rmdir()


def _train(
    cfg: Config,
    info: DistInfo,
    run_dir: Path,
    preemption: resilience.PreemptionHandler,
    lease: rundir.Lease | None,
) -> dict[str, Any]:
    seed_everything(cfg.train.seed + info.rank)  # distinct random streams per rank
    job, pos = build(cfg, info)
    job.lease = lease
    # Once resuming is settled (a refused run changes no file), before anything is trained.
    check_progress(cfg, info, pos.step)
    # Only now, once resuming (or refusing to) is settled: a refused run changes no file.
    distributed.run_on_main(
        info, f"writing {run_dir / 'config.json'}", lambda: write_settled(cfg, run_dir, pos.step)
    )
    log.info(
        "world size %d, device %s, backend %s, amp %s, global batch %d, %d steps/epoch, "
        "%d steps in total, config %s",
        info.world_size,
        info.device,
        info.backend,
        job.amp_dtype,
        global_batch_size(cfg, info.world_size),
        job.steps_per_epoch,
        job.total_steps,
        cfg.fingerprint(),
    )
    writer = MetricsWriter(run_dir, info.is_main, cfg.log.tensorboard)
    distributed.run_on_main(
        info,
        "opening metrics.jsonl and tensorboard",
        lambda: writer.open(pos.step, job.pending_eval),
    )
    loop = make_loop(cfg, info, job, writer, preemption)
    result: engine.EvalResult | None = None
    loop.watchdog.start()
    try:
        with progress_bar(cfg, info, job.total_steps, pos.step) as loop.bar:
            pending_eval = job.pending_eval
            while pos.step < job.total_steps or pending_eval:
                average = not pending_eval  # a pending evaluation's statistics are averaged
                if not pending_eval:
                    stop = train_epoch(cfg, info, job, pos, loop)
                    if stop is not None:
                        preempt(cfg, info, job, pos, loop, stop)
                pending_eval = False
                # A signal during the epoch's last step or an earlier evaluation: checkpoint
                # now (owing this evaluation) rather than after a long evaluation and save.
                stop = stop_requested(info, loop.preemption)
                if stop is not None:
                    preempt(cfg, info, job, pos, loop, stop)
                result = evaluate(info, job, loop.watchdog, pos.step, average)
                log_eval(job, loop, result, pos)
                left = steps_left_in_epoch(cfg, info, job.num_train, pos.samples_in_epoch)
                if left == 0:
                    pos.epoch, pos.samples_in_epoch, pos.step_in_epoch = pos.epoch + 1, 0, 0
                    job.ledger.start_epoch()
                loop.watchdog.beat(pos.step, "checkpointing")
                save_checkpoint(cfg, info, job, pos, result.accuracy)
            finish_saving(info, job)
    except RuntimeError as err:
        peers = loop.watchdog.describe_peers()
        if peers:
            log.error(
                "step %d failed (%s). Last heartbeat of each rank: %s", pos.step + 1, err, peers
            )
        raise
    finally:
        if job.saver is not None:  # a write in flight finishes (its error was or is reported)
            with contextlib.suppress(Exception):
                job.saver.wait()
        loop.profiler.stop()
        loop.watchdog.stop()
        writer.close()
    if info.is_main:  # finished: a later attempt (a requeue, say) starts counting anew
        rundir.reset_attempts(run_dir, pos.step)
    if result is None:
        log.info("nothing to do: the checkpoint is at step %d of %d", pos.step, job.total_steps)
        return {"step": pos.step}
    return {
        "step": pos.step,
        "eval_loss": result.loss,
        "eval_accuracy": result.accuracy,
        "eval_num_samples": result.num_samples,
    }


def stop_requested(info: DistInfo, preemption: resilience.PreemptionHandler) -> str | None:
    """Collective: the preemption signal some rank received (outside the step's own vote)."""
    flag = torch.tensor([float(preemption.received is not None)], device=info.device)
    if distributed.all_reduce_sum(flag).item() == 0:
        return None
    return preemption.received or "a signal received by another rank"


def report_to_launcher(variable: str, text: str) -> None:
    """Tell scripts/supervise.py how this launch ends (one file per node, see there)."""
    marker = os.environ.get(variable)
    if marker and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        with contextlib.suppress(OSError):
            Path(marker).write_text(text + "\n")


def launch_was_preempted() -> str:
    """What the launcher's preemption marker says ('' when unset or empty).

    Workers that checkpointed for a signal only they received exit 75, and torchrun, for which
    any non-zero exit is a failure, restarts them; the launcher (scripts/supervise.py) stops
    torchrun once it sees the marker, and until then a restarted worker must not train on.
    """
    marker = os.environ.get("TRAIN_PREEMPT_MARKER")
    if not marker:
        return ""
    try:
        text = Path(marker).read_text().strip()
    except OSError:
        return ""
    return text if text.startswith("checkpoint") else ""


@distributed.record
def main(argv: list[str] | None = None) -> int:
    """Run training; the exit codes are listed in resilience.py and the README."""
    try:
        cfg = parse_args(argv)  # before any process group: a typo fails in seconds
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        report_to_launcher("TRAIN_BAD_INPUT_MARKER", f"bad input: {err}")
        return resilience.EXIT_BAD_INPUT
    setup_logging(int(os.environ.get("RANK", "0")))
    already = launch_was_preempted()
    if already:
        log.warning(
            "not starting: this launch was already preempted (%s); exiting with code %d",
            already,
            resilience.EXIT_PREEMPTED,
        )
        return resilience.EXIT_PREEMPTED
    try:
        info = distributed.setup(cfg.dist)
        cfg = for_world_size(cfg, info.world_size)
        result = train(cfg, info)
        log.info("done: %s", result)
        # A stop signal that came while the run was finishing anyway: done, not preempted.
        report_to_launcher("TRAIN_PREEMPT_MARKER", f"finished at step {result['step']}")
        return 0
    except rundir.NoProgress as err:
        log.error("%s", err)
        return rundir.EXIT_NO_PROGRESS
    except resilience.Preempted as stop:
        log.warning(
            "%s: checkpoint written, exiting with code %d; resume with the same command",
            stop,
            resilience.EXIT_PREEMPTED,
        )
        return resilience.EXIT_PREEMPTED
    except (resilience.DivergedError, FloatingPointError) as err:
        log.error("%s", err)
        return resilience.EXIT_DIVERGED
    except (ConfigError, checkpoint.CheckpointError, data.DatasetNotFoundError, OSError) as err:
        log.error("%s", err)  # a clear message instead of a traceback; every rank exits
        report_to_launcher("TRAIN_BAD_INPUT_MARKER", f"bad input: {err}")
        return resilience.EXIT_BAD_INPUT
    except distributed.PeerError as err:
        log.error("%s", err)
        if err.exit_code == resilience.EXIT_BAD_INPUT:
            report_to_launcher("TRAIN_BAD_INPUT_MARKER", f"bad input: {err}")
        return err.exit_code
    finally:
        distributed.teardown()


if __name__ == "__main__":
    sys.exit(main())
