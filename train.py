"""Train MiniResNet data-parallel: `python train.py` alone, `torchrun ... train.py` on many.

The story of a run: parse and validate the config (before any process group exists), join
the process group, build data, model and optimizer, resume if a checkpoint exists, train with
an evaluation and a checkpoint at the end of every epoch, and always leave the process group.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
import time
import uuid
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
import preflight
from config import Config, ConfigError, global_batch_size, parse_args
from distributed import DistInfo
from metrics import MetricsWriter, TrainMeter
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
    """Where training stands: optimizer steps done, and how far into which epoch."""

    step: int = 0
    epoch: int = 0
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
    steps_per_epoch: int
    total_steps: int


def write_config(cfg: Config, run_dir: Path) -> None:
    payload = (cfg.to_json() + "\n").encode()
    checkpoint.atomic_write_bytes(run_dir / "config.json", lambda f: f.write(payload))


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


def build_model(cfg: Config, splits: data.DataSplits, info: DistInfo) -> nn.Module:
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    model: nn.Module = MiniResNet(
        in_channels=splits.in_channels,
        num_classes=splits.num_classes,
        widths=cfg.model.widths,
        blocks_per_stage=cfg.model.blocks_per_stage,
        norm=cfg.model.norm,
    )
    if cfg.model.norm == "syncbatch" and info.world_size > 1:
        if info.device.type != "cuda":
            raise ConfigError(
                "model.norm=syncbatch needs CUDA devices (SyncBatchNorm runs on "
                "GPUs only); use model.norm=batch or group on CPU"
            )
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    memory_format = torch.channels_last if cfg.model.channels_last else torch.preserve_format
    return model.to(device=info.device, memory_format=memory_format)


def build(cfg: Config, info: DistInfo) -> tuple[Job, Position]:
    splits = data.build_datasets(cfg.data, cfg.train.seed, info)
    if cfg.dist.preflight:
        preflight.check(info, data.fingerprint(splits), cfg.fingerprint())
    if cfg.dist.preflight_bandwidth:
        preflight.bandwidth(info)
    # After preflight, so that a run.dir differing between nodes is reported as a config
    # mismatch rather than as a run dir that is not shared.
    check_run_dir_shared(info, Path(cfg.run.dir))
    train_loader = data.build_train_loader(splits, cfg.data, info, cfg.train.seed)
    accum = cfg.train.grad_accum_steps
    steps_per_epoch = len(train_loader) // accum
    if steps_per_epoch == 0:
        raise ConfigError(
            f"an epoch has {len(train_loader)} micro-batches per rank, fewer than "
            f"train.grad_accum_steps={accum}: lower it or data.batch_size"
        )
    resumed = load_resume_state(cfg, info)
    pos = Position() if resumed is None else resume_position(cfg, info, *resumed, steps_per_epoch)
    # Steps left = the rest of this epoch + whole epochs after it; counted from `pos` so that a
    # run resumed with another world size (another steps_per_epoch) still ends after cfg epochs.
    remaining = (cfg.train.epochs - pos.epoch) * steps_per_epoch - pos.step_in_epoch
    total_steps = pos.step + max(0, remaining)
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    model = build_model(cfg, splits, info)
    optimizer = engine.build_optimizer(model, cfg.optim)
    scheduler = engine.build_scheduler(optimizer, cfg.optim, total_steps)
    amp_dtype = engine.resolve_amp(cfg.train.amp, info.device)
    scaler = engine.make_scaler(info.device, amp_dtype)
    if resumed is not None:
        # Into the bare model, before wrapping: DDP then starts from the loaded weights.
        load_states(*resumed, model, optimizer, scheduler, scaler)
    wrapped = distributed.wrap_model(model, info)
    if cfg.train.compile:
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
        preprocess=data.Preprocess(splits, info.device, cfg.model.channels_last),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
    )
    return job, pos


def load_resume_state(cfg: Config, info: DistInfo) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from, loaded on every rank onto its own device.

    Rank 0 chooses and broadcasts the path, so all ranks load the same file even when a
    shared filesystem shows them different directory listings.
    """
    chosen: list[tuple[Path, dict[str, Any]] | None] = []

    def choose() -> None:
        found = checkpoint.load_for_resume(cfg.ckpt.resume, cfg.run.dir, info.device)
        checkpoint.refuse_later_checkpoints(
            cfg.run.dir, found[1]["step"] if found else 0, cfg.ckpt.resume
        )
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
    "step_in_epoch",
    "world_size",
    "global_batch_size",
    "config",
)
# Settings whose change alters the math of the resumed run; reported when they differ.
MATH_SECTIONS = ("data", "model", "optim", "train")
NON_MATH_KEYS = {
    "data.root",
    "data.download",
    "data.num_workers",
    "data.prefetch_factor",
    "data.eval_batch_size",
    "train.epochs",
    "train.max_steps",
    "train.compile",
}


def resume_position(
    cfg: Config, info: DistInfo, path: Path, state: dict[str, Any], steps_per_epoch: int
) -> Position:
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} lacks {', '.join(missing)}: not written by this pipeline"
        )
    pos = Position(state["step"], state["epoch"], state["step_in_epoch"])
    this_batch = global_batch_size(cfg, info.world_size)
    if pos.step_in_epoch and state["global_batch_size"] != this_batch:
        raise ConfigError(
            f"checkpoint {path} stopped mid-epoch with a global batch of "
            f"{state['global_batch_size']} ({state['world_size']} ranks); this run has "
            f"{this_batch} ({info.world_size} ranks). Resume with the same batch settings to "
            "finish the epoch exactly, or from an end-of-epoch checkpoint"
        )
    if pos.step_in_epoch >= steps_per_epoch:
        raise ConfigError(
            f"checkpoint {path} is {pos.step_in_epoch} steps into epoch {pos.epoch}, but an "
            f"epoch of this run has {steps_per_epoch} steps: the dataset or subset changed"
        )
    old, new = _flatten(state["config"]), _flatten(cfg.to_dict())
    changed = [
        f"{key} {old.get(key)!r} -> {new[key]!r}"
        for key in sorted(new)
        if key.split(".")[0] in MATH_SECTIONS
        and key not in NON_MATH_KEYS
        and old.get(key) != new[key]
    ]
    if changed:
        log.warning(
            "resuming %s with settings that change the training math: %s", path, "; ".join(changed)
        )
    log.info(
        "resuming from %s at step %d (epoch %d, step %d of it)",
        path,
        pos.step,
        pos.epoch,
        pos.step_in_epoch,
    )
    return pos


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
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} does not fit this run's model or optimizer (did model.* or "
            f"optim.name change?): {err}"
        ) from err
    if state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    elif scaler.is_enabled():
        log.warning("checkpoint %s has no fp16 GradScaler state: starting a fresh scaler", path)


def save_checkpoint(
    cfg: Config, info: DistInfo, job: Job, pos: Position, accuracy: float | None
) -> None:
    """Rank 0 writes; every rank then learns whether that worked (this is also the barrier).

    Call after `distributed.average_buffers`, so the saved model is the one every rank holds.
    """

    def write() -> None:
        state = {
            "model": distributed.unwrap_model(job.model).state_dict(),
            "optimizer": job.optimizer.state_dict(),
            "scheduler": job.scheduler.state_dict(),
            "scaler": job.scaler.state_dict(),
            "step": pos.step,
            "epoch": pos.epoch,
            "step_in_epoch": pos.step_in_epoch,
            "eval_accuracy": accuracy,
            "world_size": info.world_size,
            "global_batch_size": global_batch_size(cfg, info.world_size),
            "config": cfg.to_dict(),
            "config_hash": cfg.fingerprint(),
            "torch_version": str(torch.__version__),  # a plain str: weights_only loads it
        }
        directory = checkpoint.checkpoint_dir(cfg.run.dir)
        checkpoint.save(state, directory, pos.step, cfg.ckpt.keep, accuracy)

    distributed.run_on_main(info, f"saving the step {pos.step} checkpoint", write)


def train_epoch(
    cfg: Config,
    info: DistInfo,
    job: Job,
    pos: Position,
    meter: TrainMeter,
    writer: MetricsWriter,
    bar: Any,
) -> None:
    """Optimizer steps from `pos` to the end of the epoch (or of the run)."""
    accum = cfg.train.grad_accum_steps
    data.set_epoch(job.train_loader, pos.epoch, pos.step_in_epoch * accum * cfg.data.batch_size)
    batches = iter(job.train_loader)
    job.model.train()
    while pos.step_in_epoch < job.steps_per_epoch and pos.step < job.total_steps:
        started = time.perf_counter()
        micro_batches = [job.preprocess(*next(batches)) for _ in range(accum)]
        data_wait = time.perf_counter() - started
        stats = engine.train_step(
            job.model,
            micro_batches,
            job.optimizer,
            job.scaler,
            job.loss_fn,
            job.amp_dtype,
            cfg.optim.grad_clip,
        )
        job.scheduler.step()
        pos.step += 1
        pos.step_in_epoch += 1
        meter.update(stats, data_wait)
        if bar is not None:
            bar.update(1)
        if pos.step % cfg.log.every_steps == 0 or pos.step == job.total_steps:
            log_train(writer, meter, pos, job.scheduler.get_last_lr()[0])
        # The end of an epoch (or of the run) is saved by the caller, after evaluation.
        segment_ends = pos.step_in_epoch == job.steps_per_epoch or pos.step == job.total_steps
        if cfg.ckpt.every_steps and pos.step % cfg.ckpt.every_steps == 0 and not segment_ends:
            distributed.average_buffers(job.model)
            save_checkpoint(cfg, info, job, pos, None)


def evaluate(info: DistInfo, job: Job) -> engine.EvalResult:
    distributed.average_buffers(job.model)  # every rank evaluates the same model
    batches = (job.preprocess(images, labels) for images, labels in job.eval_loader)
    return engine.evaluate(job.model, batches, info.device, job.amp_dtype)


def log_train(writer: MetricsWriter, meter: TrainMeter, pos: Position, lr: float) -> None:
    figures = meter.reduce()  # a collective: every rank logs at the same steps
    log.info(
        "step %d epoch %d loss %.4f acc %.4f lr %.4g %.0f samples/s data-wait %.1f%%",
        pos.step,
        pos.epoch,
        figures["loss"],
        figures["accuracy"],
        lr,
        figures["samples_per_s"],
        100 * figures["data_wait_frac"],
    )
    writer.write({"kind": "train", "step": pos.step, "epoch": pos.epoch, "lr": lr, **figures})


def log_eval(writer: MetricsWriter, result: engine.EvalResult, pos: Position) -> None:
    log.info(
        "eval step %d epoch %d loss %.4f accuracy %.4f on %d samples",
        pos.step,
        pos.epoch,
        result.loss,
        result.accuracy,
        result.num_samples,
    )
    writer.write(
        {
            "kind": "eval",
            "step": pos.step,
            "epoch": pos.epoch,
            "loss": result.loss,
            "accuracy": result.accuracy,
            "num_samples": result.num_samples,
        }
    )


def progress_bar(cfg: Config, info: DistInfo, total: int, initial: int) -> Any:
    show = cfg.log.progress == "on" or (cfg.log.progress == "auto" and sys.stderr.isatty())
    if not (info.is_main and show):
        return nullcontext()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)


def train(cfg: Config, info: DistInfo) -> dict[str, Any]:
    run_dir = Path(cfg.run.dir)
    distributed.run_on_main(
        info, f"creating run.dir={run_dir}", lambda: run_dir.mkdir(parents=True, exist_ok=True)
    )
    seed_everything(cfg.train.seed + info.rank)  # distinct random streams per rank
    job, pos = build(cfg, info)
    # Only now, once resuming (or refusing to) is settled: a refused run changes no file.
    distributed.run_on_main(
        info, f"writing {run_dir / 'config.json'}", lambda: write_config(cfg, run_dir)
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
    distributed.run_on_main(info, "opening metrics.jsonl and tensorboard", writer.open)
    meter = TrainMeter(info.device, info.world_size)
    result: engine.EvalResult | None = None
    try:
        with progress_bar(cfg, info, job.total_steps, pos.step) as bar:
            while pos.step < job.total_steps:
                train_epoch(cfg, info, job, pos, meter, writer, bar)
                result = evaluate(info, job)
                log_eval(writer, result, pos)
                if pos.step_in_epoch == job.steps_per_epoch:
                    pos.epoch, pos.step_in_epoch = pos.epoch + 1, 0
                save_checkpoint(cfg, info, job, pos, result.accuracy)
    finally:
        writer.close()
    if result is None:
        log.info("nothing to do: the checkpoint is at step %d of %d", pos.step, job.total_steps)
        return {"step": pos.step}
    return {
        "step": pos.step,
        "eval_loss": result.loss,
        "eval_accuracy": result.accuracy,
        "eval_num_samples": result.num_samples,
    }


@distributed.record
def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)  # before any process group: a typo fails in seconds
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    setup_logging(int(os.environ.get("RANK", "0")))
    try:
        info = distributed.setup(cfg.dist)
        result = train(cfg, info)
        log.info("done: %s", result)
        return 0
    except (ConfigError, checkpoint.CheckpointError, data.DatasetNotFoundError) as err:
        log.error("%s", err)  # a clear message instead of a traceback; every rank exits
        return 2
    finally:
        distributed.teardown()


if __name__ == "__main__":
    sys.exit(main())
