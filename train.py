"""Train a model data-parallel: `python train.py` alone, `torchrun ... train.py` on many.

`main` parses the config (before any process group exists), joins the process group, holds
the run dir and runs a `Trainer`. `Trainer.fit` is the story of a run: resume if a checkpoint
exists, then epochs of training steps, each ended by an evaluation and a checkpoint.
`Trainer.train_step` is one optimizer step, all of its math on one screen.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # a bad command line fails in a second, before torch is imported
    import signal

    from cli import parse_or_exit

    _EARLY_SIGNALS: list[int] = []
    if "--model.list" not in sys.argv:  # that prints the model names (main), nothing to check
        # Stop signals that arrive before the training loop's handler is installed (torch's
        # import alone takes seconds, and a scheduler may signal at any time): that handler
        # acts on them.
        for _name in parse_or_exit().run.preempt_signals:
            signal.signal(signal.Signals[_name], lambda signum, _: _EARLY_SIGNALS.append(signum))

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

import auto
import build
import data
import distributed
import engine
import exitcodes
import launch
import model as models
import parallel
import resilience
import sharding
import verdicts
from ckpt import parts, rundir
from ckpt.manager import CheckpointManager, Resumed, RunRecord
from cli import notices, parse_args
from config import IGNORED, Config, ConfigError, for_world_size, global_batch_size, load_factory
from distributed import DistInfo
from inputs import failures
from instruments import Instruments
from metrics import MetricsWriter
from modes import dispatch
from objective import losses
from optim import ema, groups, schedules, spec
from runpaths import RunPaths

log = logging.getLogger("train")


class Trainer:
    """One rank's training run: built from the config, then `fit()` (or driven step by step
    with `train_steps(n)` and `save()`, as the benchmark does, on its own loader through
    `use_train_loader`)."""

    def __init__(
        self,
        cfg: Config,
        info: DistInfo,
        preemption: resilience.PreemptionHandler,
        lease: rundir.Lease | None = None,
        stall_timeout_s: float | None = None,
    ) -> None:
        self.cfg, self.info, self.preemption = cfg, info, preemption
        self.paths = RunPaths(cfg.run.dir)  # every file of the run dir
        build.configure_cuda(cfg, info)
        parts.seed_everything(cfg.train.seed + info.rank)  # distinct random streams per rank
        splits = data.build_datasets(cfg.data, cfg.train.seed, info)
        data_fingerprint = data.fingerprint(splits)
        launch.check_job(cfg, info, data_fingerprint, self.paths.root)
        self.layout = parallel.Layout.of(cfg.dist, info)  # whether it shards, asked below
        numel, jpeg_share = data.in_memory_numel(splits.train), data.jpeg_share(splits.train)
        self.auto = auto.resolve(cfg, info, numel, jpeg_share, self.layout)
        log.info("settings: %s", self.auto.describe(cfg))
        self.build_data(splits)
        self.build_schedule()
        # The strategy's one place: the model is wrapped before the optimizer, the weight
        # average or the checkpoint sees a parameter.
        model = build.build_model(cfg, splits, info, self.preprocess, self.layout)
        self.param_groups = groups.plan(model, cfg.optim)  # frozen ones frozen before wrapping
        self.parallel = parallel.parallelize(
            model, info, cfg.dist, compile=self.auto.compile, nvtx=cfg.log.nvtx
        )
        self.model = self.parallel.model
        self.build_optimization(splits)
        spans = self.samples_per_step, self.steps_per_epoch, lambda: self.total_steps
        self.ema = ema.build(self.parallel.bare, cfg, *spans)  # None without train.ema_decay
        self.checkpoints = self.build_checkpointing(lease, data_fingerprint, splits.classes)
        self.attempt = launch.Attempt.on_main(info, self.paths.root, lease, preemption)
        self.buffers = engine.BufferSnapshot(self.model)
        guard = resilience.StepGuard(
            info, cfg.train.max_nonfinite_steps, check_grad=not self.scaler.is_enabled()
        )
        self.verdicts = verdicts.build(
            cfg, info, guard, (self.optimizer, self.scaler, self.buffers), self.layout.shards
        )
        self.verdicts.on_diverged = self.checkpoints.settle  # a sharded save gets its manifest
        self.instruments = self.build_instruments(lease, stall_timeout_s or cfg.dist.timeout_s)
        launch.warn_if_oversubscribed(cfg, info, self.auto)
        self.batches: Iterator[Any] | None = None  # the epoch's loader iterator, once opened
        # The checkpoint resumed from was written on preemption at the end of an epoch (or of
        # the run), before that segment's evaluation: evaluate (and save) before training on.
        self.pending_eval = False

    # -- building a run --------------------------------------------------------------------------

    def build_data(self, splits: data.DataSplits) -> None:
        """The train and evaluation loaders, the on-device preprocessing, the split sizes."""
        cfg, info = self.cfg, self.info
        self.train_loader = data.build_train_loader(
            splits, cfg.data, info, cfg.train.seed, self.auto.loader, self.auto.decode, cfg.aug
        )
        self.eval_loader = data.build_eval_loader(
            splits, cfg.data, info, cfg.train.seed, self.auto.decode
        )
        self.preprocess = data.Preprocess(splits, info.device, self.auto.channels_last)
        self.mix = data.BatchAugment(cfg.aug, cfg.train.seed, info.rank, splits.num_classes)
        self.num_train = len(splits.train)  # type: ignore[arg-type]
        self.num_eval = len(splits.eval)  # type: ignore[arg-type]
        # What an evaluation leaves out: an image folder's unreadable images (bad_images=skip),
        # else samples labelled config.IGNORED (-100) by a data.factory.
        self.eval_from_folder = data.folder_of(splits.eval) is not None
        self.input_shape = splits.input_shape
        self.num_classes, self.classes = splits.num_classes, splits.classes

    def build_schedule(self) -> None:
        """Where training stands (the position), and how many steps and samples an epoch has."""
        cfg = self.cfg
        self.position = parts.Position()
        self.saved_step = 0  # the newest checkpoint's step, written or resumed from
        self.steps_per_epoch = self.steps_left_in_epoch(consumed=0)
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"an epoch has {len(self.train_loader)} micro-batches per rank, fewer than train."
                f"grad_accum_steps={cfg.train.grad_accum_steps}: lower it or data.batch_size"
            )
        self.samples_per_step = global_batch_size(cfg, self.info.world_size)

    def build_optimization(self, splits: data.DataSplits) -> None:
        """Optimizer (over the parallelized model's parameters), LR schedule, AMP, objective."""
        cfg = self.cfg
        kind, param_groups, settings = spec.optimizer_spec(
            self.parallel.bare, cfg.optim, self.auto.optimizer_impl, self.param_groups
        )
        self.optimizer = self.parallel.build_optimizer(kind, param_groups, **settings)
        # The schedule's length is read at each step: resuming may change it (total_steps).
        self.scheduler = schedules.build_scheduler(
            self.optimizer, cfg.optim, lambda: self.total_steps, self.steps_per_epoch
        )
        self.amp_dtype = self.auto.amp
        self.scaler = engine.make_scaler(self.info.device, self.amp_dtype)
        self.loss_fn = losses.build(cfg, self.num_classes, splits.eval, self.info.device)
        stand_in = self.loss_fn.zero_targets(cfg.data.batch_size)  # a failed batch's labels
        self.stand_in = failures.StandIn(self.preprocess, splits.input_shape, stand_in)

    def build_checkpointing(
        self, lease: rundir.Lease | None, data_fingerprint: str, classes: list[str] | None
    ) -> CheckpointManager:
        """The sample ledger, and the manager with every part of the run registered."""
        cfg, info, stops = self.cfg, self.info, self.preemption.signals
        self.ledger = parts.SampleLedger()
        record = RunRecord.of(cfg, info.world_size, self.num_train, data_fingerprint, classes)
        manager = CheckpointManager(
            cfg.ckpt, self.paths, record, info, self.auto.ckpt_format, lease, stops
        )
        for name, part in (  # resuming loads them in this order: the position first
            ("position", self.position),
            ("rng", parts.RngState(info, cfg.train.seed, self.position)),
            ("model", parts.ModelState(self.parallel.bare)),
            ("optimizer", parts.OptimizerState(self.optimizer)),
            ("scheduler", parts.SchedulerState(self.scheduler, self.optimizer)),
            ("scaler", parts.ScalerState(self.scaler)),
            ("ledger", self.ledger),
        ):
            manager.register(name, part)
        if self.ema is not None:  # after the model: a checkpoint without it starts it there
            manager.register("ema", self.ema, ("train.ema_decay", self.ema.restart))
        return manager

    def build_instruments(self, lease: rundir.Lease | None, stall_timeout_s: float) -> Instruments:
        """Meters, clocks, watchdog and the metrics writer."""
        # Rank 0 writes metrics only while it holds the run dir (a lost lease stops the run at
        # the next step; until then its rows are dropped, never written over the new holder's).
        holds_run_dir = lease.valid if lease is not None else None
        writer = MetricsWriter(
            self.paths.root, self.info.is_main, self.cfg.log.tensorboard, holds_run_dir
        )
        return Instruments(
            self.cfg.log,
            self.info,
            self.parallel.comm_timer,
            self.layout,
            self.auto,
            writer,
            self.position,
            self.current_lr,
            self.paths,
            self.cfg.data.num_workers,
            stall_timeout_s,
            worker_pids=lambda: data.worker_pids(self.train_loader),
        )

    def use_train_loader(self, loader: Any) -> None:
        """Train on `loader` instead of the loader built from cfg.data; call it before training
        (benchmarks/pipeline.py replays a few batches of the built one, to time steps without
        waiting for data). It yields (images, labels, indices) batches and has a `sampler`."""
        self.train_loader = loader

    # -- the story of a run --------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Resume, then train epoch by epoch, each ended by an evaluation and a checkpoint."""
        self.resume()
        result: engine.EvalResult | None = None
        with self.instruments.running(self.total_steps):
            while self.position.step < self.total_steps or self.pending_eval:
                if not self.pending_eval:
                    self.stop_if(self.train_epoch())
                # A signal during the epoch's last step or an earlier evaluation: checkpoint
                # now (owing this evaluation) rather than after a long evaluation and save.
                self.stop_if(self.stop_requested())
                # A sharded checkpoint still being written gets its manifest before the
                # evaluation, not after it (a failure there would lose it).
                self.checkpoints.settle()
                result = self.evaluate()
                if self.steps_left_in_epoch() == 0:
                    self.start_epoch(self.position.epoch + 1)
                self.save(accuracy=result.accuracy)
            self.checkpoints.wait()
        if self.info.is_main:  # finished: a later attempt (a requeue, say) starts counting anew
            rundir.reset_attempts(self.paths.root, self.position.step)
        return self.summary(result)

    def train_step(self) -> resilience.Verdict:
        """One optimizer step over `grad_accum_steps` micro-batches, agreed on by every rank."""
        with self.instruments.step() as timer:
            accum = self.cfg.train.grad_accum_steps
            loaded = failures.StepLoad.load(self.next_micro_batch, accum, self.stand_in)
            timer.loaded()
            writing, failed = self.checkpoints.writing, loaded.error is not None
            self.verdicts.open(self.stop_reason, writing, failed)
            self.buffers.take()  # a skipped step must leave BatchNorm statistics alone too
            # Forward and backward of every micro-batch; only the last one all-reduces.
            stats = engine.forward_backward(
                self.model,
                loaded.batches,
                self.optimizer,
                self.scaler,
                self.loss_fn,
                self.amp_dtype,
                self.cfg.optim.grad_clip,
            )
            # One small vote: skip the step if any rank's loss or gradient is not finite,
            # stop after it if any rank received a preemption signal (verdicts.py).
            verdict = self.verdicts.agree(stats, self.position.step + 1)
            if verdict.load_failed:
                self.stop_for_a_bad_batch(loaded.error)
            self.ledger.add(torch.cat(loaded.indices))
            timer.agreed(stats, verdict.skip)
            ema = self.ema and functools.partial(self.ema.after_step, self.position)
            self.verdicts.apply(verdict, ema)  # the weight average: the position before it
            self.scheduler.step()
            self.position.step += 1
            self.position.samples_in_epoch += self.samples_per_step
            if self.checkpoints.pending is not None and verdict.writes_done:
                self.checkpoints.settle()  # every writer is done: the manifest, now
        return verdict

    # -- the parts of the story ----------------------------------------------------------------

    def resume(self) -> None:
        """Continue from the newest checkpoint if there is one, then settle the run dir."""
        resumed = self.checkpoints.resume()
        if resumed is not None:
            self.continue_from(resumed)
        elif self.cfg.model.weights:
            self.load_weights(self.cfg.model.weights)
        self.checkpoints.total_steps = self.total_steps
        self.saved_step = self.position.step
        run = self.cfg.optim, self.total_steps, self.steps_per_epoch
        schedules.warn_if_warmup_shortened(*run, self.info.is_main)
        # Once resuming is settled (a refused run changes no file), before anything is trained.
        self.settle_run_dir()
        self.log_run()
        self.instruments.open(self.position.step, self.pending_eval)
        if self.cfg.log.mfu:
            self.count_flops()

    def continue_from(self, resumed: Resumed) -> None:
        """Say where the resumed checkpoint stands, and what of the config it overrides."""
        if self.cfg.model.weights and self.info.is_main:
            log.warning(
                "model.weights=%s is not loaded: the run resumes from %s, which holds the "
                "weights (start a new run.dir to fine-tune from the file)",
                *(self.cfg.model.weights, resumed.path),
            )
        self.pending_eval = resumed.pending_eval
        pos = self.position
        log.info(
            "resuming from %s at step %d (epoch %d, %d samples into it)",
            *(resumed.path, pos.step, pos.epoch, pos.samples_in_epoch),
        )
        ends = resumed.meta.get("total_steps", self.total_steps)
        if resumed.meta.get("step") == ends < self.total_steps and self.info.is_main:
            accuracy, root, steps = resumed.meta.get("eval_accuracy"), self.paths.root, ends
            log.warning(
                f"run.dir={root} holds a run that finished at step {steps} (eval accuracy "
                f"{accuracy}): extending it to step {self.total_steps}. A new experiment "
                "belongs in a new run.dir"
            )
        elif ends != self.total_steps and self.info.is_main:  # the same on every rank
            log.warning(
                "the run now ends at step %d instead of %d (train.epochs, train.max_steps or "
                "the world size changed): the learning-rate schedule is stretched to "
                "match",
                self.total_steps,
                resumed.meta["total_steps"],
            )

    def settle_run_dir(self) -> None:
        """Count this attempt (the crash-loop breaker), then write the config (rank 0)."""
        launch.check_progress(self.cfg, self.info, self.position.step, self.attempt)
        distributed.run_on_main(
            self.info,
            f"writing {self.paths.config}",
            lambda: launch.write_settled(
                self.cfg, self.paths.root, self.position.step, self.checkpoints.lease
            ),
        )

    def log_run(self) -> None:
        log.info(
            "world size %d, device %s, backend %s, amp %s, global batch %d, %d steps/epoch, "
            "%d steps in total, config %s",
            self.info.world_size,
            self.info.device,
            self.info.backend,
            self.amp_dtype,
            self.samples_per_step,
            self.steps_per_epoch,
            self.total_steps,
            self.cfg.fingerprint(),
        )

    def count_flops(self) -> None:
        """log.mfu: the model's FLOPs per sample, counted once on a probe batch."""
        # Zeros of the data's shape (the count depends on shapes only): a rank's share of
        # the evaluation set is empty when it has fewer samples than there are ranks.
        sample = self.stand_in()[0][:2]  # zero images, preprocessed
        dtype = self.amp_dtype or torch.float32
        build.count_flops(
            self.model,
            sample,
            lambda probe, x: self.instruments.count_flops(probe, x, self.loss_fn, dtype),
            lambda: models.build(self.cfg.model, self.input_shape, self.num_classes),
            self.info.is_main,
        )

    def load_weights(self, path: str) -> None:
        """Start from the weights in `path` (model.weights), on every rank (collective: a rank
        that cannot load them fails every rank, and so do ranks that loaded different ones)."""
        error = None
        model = distributed.unwrap_model(self.model)
        try:
            models.load_weights(model, path)
        except ConfigError as err:
            error = err
        distributed.raise_if_any_failed(self.info, error, f"loading model.weights={path}")
        sharding.check_same_weights(model, f"model.weights={path}")
        if self.ema is not None:  # it copied the initial weights: average the loaded ones
            self.ema.restart()

    def train_epoch(self) -> str | None:
        """The rest of the epoch (or of the run); the loader's iterator ends with it."""
        steps = min(self.steps_left_in_epoch(), self.total_steps - self.position.step)
        try:
            return self.train_steps(steps)
        finally:
            self.batches = None  # the next epoch reopens it where the position says

    def train_steps(self, num_steps: int) -> str | None:
        """`num_steps` optimizer steps (with the periodic checkpoints of ckpt.every_steps).

        Returns the name of the preemption signal when the ranks agreed to stop, else None.
        The last of the steps is not checkpointed here: the caller evaluates, then saves.
        """
        for i in range(num_steps):
            verdict = self.train_step()
            last = i == num_steps - 1
            due = self.checkpoints.due(self.position.step) and not last
            if verdict.stop is not None or last or due:
                self.verdicts.settle()  # a vote read a step late is read before what follows
            if verdict.stop is not None:
                return verdict.stop
            if due:
                self.save()
        return None

    def next_micro_batch(self) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The next batch of this rank's shard on the device, and its samples for the ledger."""
        if self.batches is None:  # the sampler continues the epoch where the position says
            data.set_epoch(self.train_loader, self.position.epoch, self.position.samples_in_epoch)
            self.batches = iter(self.train_loader)
            self.model.train()
        images, labels, indices = next(self.batches)
        if labels.device.type == "cpu":  # skipped images (IGNORED) are not trained on
            images, labels, indices = self.mix.counted_only(images, labels, indices)
        return self.mix(*self.preprocess(images, labels), self.position), indices

    def stop_for_a_bad_batch(self, error: Exception | None) -> None:
        """Collective, once the step's vote says a rank's batch failed to load: checkpoint the
        steps trained (the failed step is skipped, its statistics restored), then raise on
        every rank, naming the sample (inputs.failures)."""
        self.buffers.restore()
        failures.log_failure(error, self.position.step + 1)
        if self.position.step > self.saved_step:
            self.save(wait=True)
            log.error("checkpoint of step %d written", self.position.step)
        failures.raise_on_every_rank(self.info, error, self.position.step + 1)

    def start_epoch(self, epoch: int) -> None:
        self.position.epoch, self.position.samples_in_epoch = epoch, 0
        self.ledger.start_epoch(epoch)
        self.batches = None

    def evaluate(self) -> engine.EvalResult:
        """Exact loss and accuracy over the whole evaluation set (a collective).

        BatchNorm statistics are averaged over ranks first, so every rank evaluates the same
        model; a pending evaluation's were averaged before its checkpoint was written. A stop
        signal ends it after the batch at hand (the preemption budget is a step plus a save):
        the checkpoint then owes it, and the resumed run evaluates first.
        """
        if not self.pending_eval:
            distributed.average_buffers(self.model)
        self.pending_eval = False

        failed: list[Exception] = []

        def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            loaded = iter(self.eval_loader)
            while not self.preemption.received:  # local: ranks may hold unequal shares
                try:
                    images, labels = next(loaded)
                except StopIteration:
                    return
                except Exception as err:  # a bad sample: raised once the epoch is saved
                    failed.append(err)
                    return
                self.instruments.phase("evaluation")
                yield self.preprocess(images, labels)

        averaged = self.ema.applied() if self.ema is not None else contextlib.nullcontext()
        with self.instruments.nvtx_range("evaluation"), averaged:
            result = engine.evaluate(
                self.model,
                batches(),
                self.info.device,
                self.amp_dtype,
                self.cfg.data.eval_flip,
                self.input_shape,
                self.num_classes,
                confusion=True,
                objective=self.loss_fn,
            )
        self.save_if_evaluation_failed(failed[0] if failed else None)
        self.stop_if(self.stop_requested(), buffers_averaged=True)  # the result may be partial
        self.instruments.log_eval(result, self.ledger, self.classes)
        if result.num_samples < self.num_eval:
            log.warning(
                "evaluated %d of the %d samples: %d %s",
                result.num_samples,
                self.num_eval,
                self.num_eval - result.num_samples,
                "unreadable images were left out (data.bad_images=skip; each is named above)"
                if self.eval_from_folder
                else f"are labelled {IGNORED}, the ignore label (data.factory)",
            )
        return result

    def save_if_evaluation_failed(self, error: Exception | None) -> None:
        """Collective: when loading an evaluation sample failed on any rank (a label out of
        range, a corrupt image), checkpoint the trained state, owing this evaluation, then raise
        on every rank (exit 2 for bad input, naming the sample): the epoch's training is kept,
        and once the data is fixed the resumed run evaluates first, then trains on."""
        flag = torch.tensor([float(error is not None)], device=self.info.device)
        if distributed.all_reduce_sum(flag).item() == 0:
            return
        self.save(pending_eval=True, wait=True)
        log.error("evaluation failed; checkpoint of step %d written", self.position.step)
        distributed.raise_if_any_failed(self.info, error, "loading the evaluation set")

    def save(
        self, accuracy: float | None = None, pending_eval: bool = False, wait: bool = False
    ) -> None:
        """Checkpoint the current step (a collective: rank 0 writes, every rank learns how it
        went). ckpt.async_save writes in the background unless `wait`."""
        self.instruments.phase("checkpointing")
        with self.instruments.nvtx_range("checkpoint"):
            self.checkpoints.save(
                self.position.step, accuracy, pending_eval=pending_eval, wait=wait
            )
        self.saved_step = self.position.step

    def stop_if(self, signal_name: str | None, buffers_averaged: bool = False) -> None:
        """After a preemption signal: checkpoint where every rank stopped, tell the launcher,
        and end the run (exit 75).

        At the end of an epoch (or of the run) the statistics are averaged as evaluation would
        average them, and the checkpoint is marked as owing that evaluation: the resumed run
        evaluates first, exactly as this one would have.
        """
        if signal_name is None:
            return
        step = self.position.step
        if self.attempt is not None:  # a stop, not a failure (the watcher's, if signalled here)
            self.attempt.uncount()
        at_segment_end = self.steps_left_in_epoch() == 0 or step == self.total_steps
        if at_segment_end and not buffers_averaged:
            distributed.average_buffers(self.model)
        self.save(pending_eval=at_segment_end, wait=True)
        if self.info.is_main:  # progress: restarts after this one start counting anew
            rundir.reset_attempts(self.paths.root, step)
        # The launcher (scripts/supervise.py) exits 75 only after this
        exitcodes.report_to_launcher(
            exitcodes.PREEMPT_MARKER, f"checkpoint of step {step} after {signal_name}"
        )
        raise resilience.Preempted(signal_name, step)

    def stop_reason(self) -> str | None:
        """Why this rank wants to stop after this step: a preemption signal, or (rank 0) a run
        dir lease this job no longer holds. The step's vote carries it to every rank; stop_if's
        checkpoint is then refused by rank 0's lease check, which fails every rank with the
        lease's message (exit 2 when another job took the run dir over), writing nothing."""
        lease = self.checkpoints.lease
        return self.preemption.received or (lease.stop_reason() if lease else "") or None

    def stop_requested(self) -> str | None:
        """Collective: the preemption signal some rank received (outside the step's vote)."""
        received = self.stop_reason()
        flag = torch.tensor([float(received is not None)], device=self.info.device)
        if distributed.all_reduce_sum(flag).item() == 0:
            return None
        return received or "a signal received by another rank"

    # -- where the run stands ------------------------------------------------------------------

    def steps_left_in_epoch(self, consumed: int | None = None) -> int:
        """Whole optimizer steps the rest of the epoch holds after `consumed` samples (all
        ranks; default: the position's)."""
        if consumed is None:
            consumed = self.position.samples_in_epoch
        per_rank = (self.num_train - consumed) // self.info.world_size
        return per_rank // self.cfg.data.batch_size // self.cfg.train.grad_accum_steps

    @property
    def total_steps(self) -> int:
        """The step the run ends at: the rest of this epoch and whole epochs after it, counted
        from the position, so that a run resumed on another world size (another number of
        steps per epoch) still ends after train.epochs. Constant while the run goes on."""
        pos, cfg = self.position, self.cfg
        remaining = 0
        if pos.epoch < cfg.train.epochs:
            remaining = self.steps_left_in_epoch()
            remaining += (cfg.train.epochs - pos.epoch - 1) * self.steps_per_epoch
        total = pos.step + remaining
        return min(total, cfg.train.max_steps) if cfg.train.max_steps else total

    def current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def summary(self, result: engine.EvalResult | None) -> dict[str, Any]:
        if result is None:
            log.info(
                "nothing to do: the checkpoint is at step %d of %d",
                self.position.step,
                self.total_steps,
            )
            return {"step": self.position.step}
        return {
            "step": self.position.step,
            "eval_loss": result.loss,
            "eval_accuracy": result.accuracy,
            "eval_top5": result.top5,
            "eval_num_samples": result.num_samples,
        }

    def close(self) -> None:
        """Let a checkpoint write in flight finish; stop the loader workers; close the sinks."""
        self.checkpoints.close()
        self.batches = None
        for loader in (self.train_loader, self.eval_loader):
            data.close_loader(loader)
        self.instruments.close()
        self.verdicts.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# The entry point


def train(cfg: Config, info: DistInfo) -> dict[str, Any]:
    """One run on this rank: stop signals handled, the run dir held, the Trainer fitted."""
    preemption = resilience.PreemptionHandler(cfg.run.preempt_signals)
    # A signal during start-up (recorded by the first lines of this file) stops at step one.
    preemption.install(globals().get("_EARLY_SIGNALS"))
    try:
        launch.back_off_after_io(info, lambda: preemption.received is not None)
        with (
            launch.holding_run_dir(cfg, info) as lease,
            Trainer(cfg, info, preemption, lease) as trainer,
            launch.uncounted_if_transient_io(trainer.attempt),
        ):
            return trainer.fit()
    finally:
        preemption.restore()


def read_config(argv: list[str]) -> Config:
    """The config, checked as far as it can be before any process group: a typo fails in
    seconds, not after the rendezvous."""
    cfg = parse_args(argv)
    models.check(cfg.model)
    if cfg.data.factory:
        load_factory("data.factory", cfg.data.factory)
    if cfg.optim.param_groups:
        load_factory("optim.param_groups", cfg.optim.param_groups)
    return cfg


@distributed.record
def main(argv: list[str] | None = None) -> int:
    """Run training; the exit codes are listed in exitcodes.py (launch.exit_code picks one)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--model.list" in argv:
        print("\n".join(models.names()))
        return 0
    try:
        cfg = read_config(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        exitcodes.report_to_launcher(exitcodes.BAD_INPUT_MARKER, f"bad input: {err}")
        return exitcodes.EXIT_BAD_INPUT
    launch.setup_logging(int(os.environ.get("RANK", "0")))
    already = launch.launch_was_preempted()
    if already:
        log.warning(
            "not starting: this launch was already preempted (%s); exiting with code %d",
            already,
            exitcodes.EXIT_PREEMPTED,
        )
        return exitcodes.EXIT_PREEMPTED
    try:
        info = distributed.setup(cfg.dist, auto.backend(cfg.dist.backend))
        if info.is_main:
            for line in notices(cfg, argv, info.world_size, info.device.type):
                log.warning(line)
        cfg = for_world_size(cfg, info.world_size)
        result = (train if cfg.run.mode == "train" else dispatch.run)(cfg, info)
        log.info("done: %s", result)
        # A stop signal that came while the run was finishing anyway: done, not preempted.
        exitcodes.report_to_launcher(exitcodes.PREEMPT_MARKER, f"finished at step {result['step']}")
        return 0
    except Exception as err:
        code = launch.exit_code(err, cfg.data.batch_size)
        if code is None:  # a crash: exit 1, with its traceback
            raise
        return code
    finally:
        distributed.teardown()


if __name__ == "__main__":
    sys.exit(main())
