"""Train MiniResNet data-parallel: `python train.py` on one process, `torchrun ... train.py` on many.

The story of a run: parse and validate the config (before any process group exists), join
the process group, build data, model and optimizer, resume if a checkpoint exists, train
with periodic evaluation and checkpoints, and always leave the process group on the way out.
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
import time
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
from config import Config, ConfigError, global_batch_size, parse_args
from distributed import DistInfo
from metrics import MetricsWriter, TrainMeter
from model import MiniResNet

log = logging.getLogger("train")


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO, the others only warnings and errors, each line tagged with its rank."""
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


def write_run_files(cfg: Config, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = (cfg.to_json() + "\n").encode()
    checkpoint.atomic_write_bytes(run_dir / "config.json", lambda f: f.write(payload))


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
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    memory_format = torch.channels_last if cfg.model.channels_last else torch.preserve_format
    return model.to(device=info.device, memory_format=memory_format)


def checkpoint_state(
    cfg: Config,
    info: DistInfo,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    pos: Position,
    accuracy: float | None,
) -> dict[str, Any]:
    return {
        "model": distributed.unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "step": pos.step,
        "epoch": pos.epoch,
        "step_in_epoch": pos.step_in_epoch,
        "eval_accuracy": accuracy,
        "world_size": info.world_size,
        "global_batch_size": global_batch_size(cfg, info.world_size),
        "config": cfg.to_dict(),
        "config_hash": cfg.fingerprint(),
        "torch_version": torch.__version__,
    }


def save_checkpoint(
    cfg: Config, info: DistInfo, state_fn: Any, step: int, accuracy: float | None
) -> None:
    """Rank 0 writes; every rank then learns whether it worked (this is also the barrier)."""
    error: Exception | None = None
    if info.is_main:
        try:
            checkpoint.save(
                state_fn(), checkpoint.checkpoint_dir(cfg.run.dir), step, cfg.ckpt.keep, accuracy
            )
        except Exception as err:  # re-raised on rank 0 by raise_if_any_failed
            error = err
    distributed.raise_if_any_failed(info, error, f"saving the step {step} checkpoint")


def restore(
    cfg: Config,
    info: DistInfo,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    steps_per_epoch: int,
) -> Position:
    found = checkpoint.load_for_resume(cfg.ckpt.resume, cfg.run.dir, info.device)
    if found is None:
        return Position()
    path, state = found
    mid_epoch = 0 < state["step_in_epoch"] < steps_per_epoch
    if mid_epoch and state["global_batch_size"] != global_batch_size(cfg, info.world_size):
        raise ConfigError(
            f"checkpoint {path} stopped mid-epoch with a global batch of "
            f"{state['global_batch_size']} ({state['world_size']} ranks); this run has "
            f"{global_batch_size(cfg, info.world_size)} ({info.world_size} ranks). Resume with "
            "the same world size and batch settings to continue the epoch exactly"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    pos = Position(state["step"], state["epoch"], state["step_in_epoch"])
    if pos.step_in_epoch >= steps_per_epoch:
        pos = Position(pos.step, pos.epoch + 1, 0)
    log.info(
        "resumed from %s at step %d (epoch %d, step %d of it)",
        path,
        pos.step,
        pos.epoch,
        pos.step_in_epoch,
    )
    return pos


def progress_bar(cfg: Config, info: DistInfo, total: int, initial: int) -> Any:
    show = cfg.log.progress == "on" or (cfg.log.progress == "auto" and sys.stderr.isatty())
    if not (info.is_main and show):
        return nullcontext()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)


def train(cfg: Config, info: DistInfo) -> dict[str, Any]:
    run_dir = Path(cfg.run.dir)
    if info.is_main:
        write_run_files(cfg, run_dir)
    seed_everything(cfg.train.seed + info.rank)  # distinct random streams per rank
    splits = data.build_datasets(cfg.data, cfg.train.seed, info)
    train_loader = data.build_train_loader(splits, cfg.data, info, cfg.train.seed)
    eval_loader = data.build_eval_loader(splits, cfg.data, info, cfg.train.seed)
    preprocess = data.Preprocess(splits, info.device, cfg.model.channels_last)
    accum = cfg.train.grad_accum_steps
    steps_per_epoch = len(train_loader) // accum
    if steps_per_epoch == 0:
        raise ConfigError(
            f"an epoch has {len(train_loader)} micro-batches per rank, fewer than "
            f"--train.grad_accum_steps={accum}: lower it or data.batch_size"
        )
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)

    model = build_model(cfg, splits, info)
    optimizer = engine.build_optimizer(model, cfg.optim)
    scheduler = engine.build_scheduler(optimizer, cfg.optim, total_steps)
    amp_dtype = engine.resolve_amp(cfg.train.amp, info.device)
    scaler = engine.make_scaler(info.device, amp_dtype)
    pos = restore(cfg, info, model, optimizer, scheduler, scaler, steps_per_epoch)
    ddp_model = distributed.wrap_model(model, info)
    if cfg.train.compile:
        ddp_model = torch.compile(ddp_model)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)

    log.info(
        "world size %d, device %s, backend %s, amp %s, global batch %d, %d steps/epoch, "
        "%d steps in total, config %s",
        info.world_size,
        info.device,
        info.backend,
        amp_dtype,
        global_batch_size(cfg, info.world_size),
        steps_per_epoch,
        total_steps,
        cfg.fingerprint(),
    )
    writer = MetricsWriter(run_dir, info.is_main, cfg.log.tensorboard)
    meter = TrainMeter(info.device, info.world_size)
    last_eval: engine.EvalResult | None = None

    def state_fn(accuracy: float | None = None) -> dict[str, Any]:
        return checkpoint_state(cfg, info, ddp_model, optimizer, scheduler, scaler, pos, accuracy)

    try:
        with progress_bar(cfg, info, total_steps, pos.step) as bar:
            while pos.step < total_steps:
                data.set_epoch(
                    train_loader, pos.epoch, pos.step_in_epoch * accum * cfg.data.batch_size
                )
                batches = iter(train_loader)
                while pos.step_in_epoch < steps_per_epoch and pos.step < total_steps:
                    started = time.perf_counter()
                    micro = [preprocess(*next(batches)) for _ in range(accum)]
                    data_wait = time.perf_counter() - started
                    ddp_model.train()
                    stats = engine.train_step(
                        ddp_model, micro, optimizer, scaler, loss_fn, amp_dtype, cfg.optim.grad_clip
                    )
                    scheduler.step()
                    pos.step += 1
                    pos.step_in_epoch += 1
                    meter.update(stats, data_wait)
                    if bar is not None:
                        bar.update(1)
                    if pos.step % cfg.log.every_steps == 0 or pos.step == total_steps:
                        log_train(writer, meter, pos, scheduler.get_last_lr()[0])
                    ends_here = pos.step_in_epoch == steps_per_epoch or pos.step == total_steps
                    if (
                        cfg.ckpt.every_steps
                        and pos.step % cfg.ckpt.every_steps == 0
                        and not ends_here
                    ):
                        distributed.average_buffers(ddp_model)
                        save_checkpoint(cfg, info, state_fn, pos.step, None)
                distributed.average_buffers(ddp_model)
                eval_batches = (preprocess(x, y) for x, y in eval_loader)
                last_eval = engine.evaluate(ddp_model, eval_batches, info.device, amp_dtype)
                log_eval(writer, last_eval, pos)
                save_checkpoint(
                    cfg, info, lambda: state_fn(last_eval.accuracy), pos.step, last_eval.accuracy
                )
                if pos.step_in_epoch == steps_per_epoch:
                    pos.epoch += 1
                    pos.step_in_epoch = 0
    finally:
        writer.close()
    if last_eval is None:
        log.info("nothing to do: the checkpoint is already at step %d of %d", pos.step, total_steps)
        return {"step": pos.step}
    return {
        "step": pos.step,
        "eval_loss": last_eval.loss,
        "eval_accuracy": last_eval.accuracy,
        "eval_num_samples": last_eval.num_samples,
    }


def log_train(writer: MetricsWriter, meter: TrainMeter, pos: Position, lr: float) -> None:
    figures = meter.reduce()  # collective: every rank logs at the same steps
    if not math.isfinite(figures["loss"]):
        log.warning("non-finite training loss at step %d", pos.step)
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
    finally:
        distributed.teardown()


if __name__ == "__main__":
    sys.exit(main())
