"""What a checkpoint holds, and how a run saves it and resumes from it.

Every stateful part of a run (model, optimizer, scheduler, scaler, position, random
generators, sample ledger) follows the `torch.distributed.checkpoint.stateful.Stateful`
protocol (`state_dict()` / `load_state_dict()`;
torch's own optimizers, schedulers and scalers already do), and is registered by name with the
`CheckpointManager`. The manager owns the rest: which checkpoint a run resumes from (rank 0
chooses, every rank loads the same file), whether this run can continue it, when saves
happen, the metadata beside the parts, and the write (rank 0, atomic, verified, optionally in a
background process: ckpt/writer.py; see ckpt/storage.py for the on-disk guarantees). Adding
saved state is one `manager.register(name, part)`.

A part's `state_dict` may be a collective (the random generators and the ledger gather every
rank's): the manager calls it on every rank, and only rank 0 writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful  # a runtime-checkable Protocol

import distributed
from ckpt import atomic, rundir, sharded, single, storage, writer
from ckpt.atomic import CheckpointError
from config import CkptConfig, Config, ConfigError, global_batch_size
from distributed import DistInfo
from runpaths import RunPaths

log = logging.getLogger(__name__)

FORMAT = 2  # 1: before named parts (step, epoch, samples_in_epoch, step_in_epoch at the top)
# Settings whose change alters the math of the resumed run; reported when they differ.
MATH_SECTIONS = ("data", "aug", "model", "optim", "loss", "train")
NON_MATH_KEYS = {
    "data.root",
    "data.download",
    "data.num_workers",
    "data.prefetch_factor",
    "data.eval_batch_size",
    "data.batch_size",  # the global batch is compared instead
    "data.global_batch_size",
    "data.loader",
    "data.prepare_timeout_s",
    "train.epochs",
    "train.max_steps",
    "train.compile",
    "train.max_nonfinite_steps",
    "train.verdict",  # where the skip is decided, not what it decides
    "train.cuda_fast_math",
    "model.channels_last",
    "optim.impl",
}


@dataclass(frozen=True)
class RunRecord:
    """What a checkpoint records about the run that writes it, and what resuming checks
    against this run. Made once per run by the caller (`RunRecord.of`), which holds the whole
    Config and the data; the manager itself reads only ckpt.*."""

    config: dict[str, dict[str, Any]]  # cfg.to_dict(), saved as is: never modified
    config_hash: str  # cfg.fingerprint()
    global_batch_size: int  # samples per optimizer step over all ranks and micro-steps
    optim_name: str  # optim.name: another optimizer's state does not carry over
    num_train: int  # training samples in an epoch: a position beyond it is another dataset's
    data_fingerprint: str  # data.fingerprint of the training and evaluation data
    classes: list[str] | None = None  # label -> class name, where the data names them

    @classmethod
    def of(
        cls,
        cfg: Config,
        world_size: int,
        num_train: int,
        data_fingerprint: str,
        classes: Sequence[str] | None = None,
    ) -> RunRecord:
        return cls(
            config=cfg.to_dict(),
            config_hash=cfg.fingerprint(),
            global_batch_size=global_batch_size(cfg, world_size),
            optim_name=cfg.optim.name,
            num_train=num_train,
            data_fingerprint=data_fingerprint,
            classes=None if classes is None else list(classes),  # as a checkpoint holds them
        )


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from: its path and what it says beside the parts."""

    path: Path
    meta: dict[str, Any]

    @property
    def pending_eval(self) -> bool:
        return bool(self.meta.get("pending_eval"))


class CheckpointManager:
    """Owns what a checkpoint holds, when it is written, and resuming from one."""

    def __init__(
        self,
        cfg: CkptConfig,
        paths: RunPaths,
        record: RunRecord,
        info: DistInfo,
        ckpt_format: str,
        lease: rundir.Lease | None = None,
        stop_signals: Sequence[int] = (),
    ) -> None:
        """`ckpt_format`: ckpt.format as auto.resolve resolved it; `stop_signals`: the run's
        preemption signals (run.preempt_signals), which the writer processes ignore."""
        self.cfg, self.paths, self.record, self.info = cfg, paths, record, info
        self.lease = lease  # rank 0's hold on the run dir: checked before every write
        self.directory = paths.checkpoints
        # Sharded: every rank writes its own piece of each tensor (sharded.save_sharded).
        self.sharded = ckpt_format == "sharded"
        # ckpt.async_save: the writer process of each rank that writes (rank 0; every rank
        # for sharded checkpoints), started now to be ready for the first save.
        writes = info.is_main or self.sharded
        self.saver: writer.ProcessSaver | None = None
        if cfg.async_save:  # the same on every rank: the agreement below is collective
            error: Exception | None = None
            try:
                if writes:
                    self.saver = writer.ProcessSaver(tuple(stop_signals))
            except Exception as err:  # on this rank only: every rank must learn of it
                error = err
            distributed.raise_if_any_failed(info, error, "starting the checkpoint writer")
        # A sharded checkpoint handed to the writers, not yet vouched for by its manifest
        # (written once every rank's writer is done: `settle`), and its accuracy.
        self.pending: tuple[sharded.ShardedSave, float | None] | None = None
        self.parts: dict[str, Stateful] = {}
        # Parts a setting turns on: name -> (setting, how the part starts when a checkpoint
        # written without it is resumed).
        self.optional: dict[str, tuple[str, Callable[[], None]]] = {}
        self.total_steps = 0  # recorded in checkpoints, to report a changed schedule on resume

    def register(
        self, name: str, part: Stateful, optional: tuple[str, Callable[[], None]] | None = None
    ) -> None:
        """Save `part` under `name` from now on; resuming loads it in registration order.

        `optional`: (the setting that turned the part on, how it starts afresh) when a run may
        turn it on at a resume: a checkpoint written without it then starts it afresh, and one
        written with it resumes in a run without it."""
        if optional is not None:
            self.optional[name] = optional
        if not isinstance(part, Stateful):
            raise TypeError(f"{name}: {type(part).__name__} has no state_dict/load_state_dict")
        if name in self.parts or name in _META_KEYS:
            raise ValueError(f"checkpoint part {name!r} is registered already or reserved")
        self.parts[name] = part

    def due(self, step: int) -> bool:
        """Whether `ckpt.every_steps` asks for a checkpoint after `step` steps."""
        every = self.cfg.every_steps
        return bool(every) and step % every == 0

    def use_saver(self, saver: writer.ProcessSaver | None) -> None:
        """Hand the next checkpoints to `saver` (None: write them in `save`), in place of the
        writer ckpt.async_save set up; call it with no save in flight. The benchmark times
        both ways on one run (benchmarks/checkpoints.py). `close()` closes the one it holds."""
        self.saver = saver

    # -- saving --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        accuracy: float | None = None,
        *,
        pending_eval: bool = False,
        wait: bool = False,
    ) -> None:
        """Collective: every rank states its parts, rank 0 writes, every rank learns the outcome.

        With ckpt.async_save the write finishes in the background unless `wait`; a failure of
        the previous write is raised here.
        `pending_eval`: written where an evaluation is owed (a preemption at the end of an
        epoch): the resumed run evaluates first, exactly as this one would have.
        """
        if self.sharded:
            self._save_sharded(step, accuracy, pending_eval, wait)
            return
        states = {name: part.state_dict() for name, part in self.parts.items()}

        def write() -> None:
            if self.lease is not None:
                self.lease.check()  # another job took the run dir over: write nothing
            state = {**states, **self._meta(step, accuracy, pending_eval)}
            if self.saver is None:
                single.save(state, self.directory, step, self.cfg.keep, accuracy)
                return
            self.saver.save(state, self.directory, step, self.cfg.keep, accuracy)
            if wait:
                self.saver.wait()

        distributed.run_on_main(self.info, f"saving the step {step} checkpoint", write)

    def _save_sharded(
        self, step: int, accuracy: float | None, pending_eval: bool, wait: bool
    ) -> None:
        """Collective: every rank writes its pieces of the parts (a part's
        `sharded_state_dict`, where it has one, keeps its DTensor shards as they are). With
        ckpt.async_save each rank's writer process writes them, and the manifest follows at
        the first step every writer has finished (`settle`)."""
        self.settle()  # the previous one first: never two in flight
        states = {
            name: getattr(part, "sharded_state_dict", part.state_dict)()
            for name, part in self.parts.items()
        }
        state = {**states, **self._meta(step, accuracy, pending_eval)}
        rank, gather, agree, check = self._collectives()
        if self.saver is None:
            sharded.save_sharded(
                state,
                self.directory,
                step,
                self.cfg.keep,
                accuracy,
                rank,
                gather,
                agree,
                check,
            )
            return
        plan = sharded.prepare_sharded(state, self.directory, step, rank, gather, agree, check)
        error: BaseException | None = None
        try:
            self.saver.write_sharded(plan)  # returns once the pieces are copied
        except Exception as err:
            error = err
        agree(error, f"handing the step {step} checkpoint to the writers")
        self.pending = (plan, accuracy)
        if wait:
            self.settle()

    def _collectives(
        self,
    ) -> tuple[int, Callable[[Any], list[Any]], Callable[[BaseException | None, str], None], Any]:
        def agree(error: BaseException | None, what: str) -> None:
            distributed.raise_if_any_failed(self.info, error, what)

        check = self.lease.check if self.lease is not None else None
        return self.info.rank, distributed.all_gather_object, agree, check

    def writing(self) -> bool:
        """Whether this rank's writer is still writing a sharded checkpoint (never blocks)."""
        return self.pending is not None and self.saver is not None and self.saver.busy()

    def settle(self) -> None:
        """Collective: finish the sharded checkpoint in flight, if any: wait for this rank's
        writer, then rank 0 writes the manifest once every rank's files are durable (or
        every rank raises the error of one). The training loop calls it at the first step
        where no rank is `writing`, so it does not wait then."""
        if self.pending is None:
            return
        plan, accuracy = self.pending
        self.pending = None
        written: dict[str, Any] = {}
        error: BaseException | None = None
        try:
            assert self.saver is not None
            written = self.saver.wait()
        except Exception as err:
            error = err
        rank, gather, agree, check = self._collectives()
        sharded.finish_sharded(
            plan, written, error, self.cfg.keep, accuracy, rank, gather, agree, check
        )

    def _meta(self, step: int, accuracy: float | None, pending_eval: bool) -> dict[str, Any]:
        record = self.record
        return {
            "format": FORMAT,
            "step": step,
            "eval_accuracy": accuracy,
            "pending_eval": pending_eval,
            "total_steps": self.total_steps,
            "world_size": self.info.world_size,
            "global_batch_size": record.global_batch_size,
            "data_fingerprint": record.data_fingerprint,
            "classes": record.classes,
            "config": record.config,
            "config_hash": record.config_hash,
            "torch_version": str(torch.__version__),  # a plain str: weights_only loads it
        }

    def wait(self) -> None:
        """Collective: wait for a background write; raise everywhere if it failed."""
        if self.sharded:
            self.settle()
        elif self.saver is not None:
            distributed.run_on_main(self.info, "finishing the last checkpoint", self.saver.wait)

    def close(self) -> None:
        """Let a write in flight finish (its error was or is reported elsewhere), then stop
        the writer process."""
        if self.saver is not None:
            try:
                self.saver.close()
            except Exception as err:
                log.warning("the last checkpoint write failed: %s", err)
            self.saver = None

    # -- resuming ------------------------------------------------------------------------------

    def resume(self) -> Resumed | None:
        """Load the checkpoint to continue from into every registered part (None: start fresh).

        Collective. Rank 0 chooses and broadcasts the path, so all ranks load the same file
        even when a shared filesystem shows them different directory listings; a rank that
        cannot load it fails every rank.
        """
        loaded = self._load_chosen()
        return None if loaded is None else self.restore(*loaded)

    def restore(self, path: Path, state: dict[str, Any]) -> Resumed:
        """Check that this run can continue `state` (loaded from `path`), load every part."""
        state = upgrade(state, path)
        self.check_compatible(path, state)
        for name, part in self.parts.items():
            if name not in state:  # optional, turned on in this run
                setting, start = self.optional[name]
                if self.info.is_main:
                    log.warning(
                        "%s was not set when checkpoint %s was written: its %s starts from the "
                        "resumed weights",
                        setting,
                        path,
                        name,
                    )
                start()
                continue
            try:
                part.load_state_dict(state[name])
            except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
                if (instead := atomic.not_about_content(err, f"checkpoint {path}")) is not None:
                    raise instead from err
                raise CheckpointError(
                    f"checkpoint {path} does not fit this run's {name} (did model.*, optim.name, "
                    "optim.param_groups or optim.norm_weight_decay / bias_weight_decay between 0 "
                    "and not change? Resume with the settings it was "
                    "trained with, or use a new run.dir: model.weights can start it from this "
                    f"checkpoint): {err}"
                ) from err
        meta = {key: state[key] for key in _META_KEYS if key in state}
        return Resumed(path, meta)

    def _load_chosen(self) -> tuple[Path, dict[str, Any]] | None:
        cfg, info, run_dir = self.cfg, self.info, self.paths.root
        chosen: list[tuple[Path, dict[str, Any]] | None] = []
        # The parts that save sharded take their tensors unread, each rank reading its rows
        lazy = [name for name, part in self.parts.items() if hasattr(part, "sharded_state_dict")]

        def choose() -> None:
            resume = cfg.resume
            if resume not in ("auto", "never") and rundir.continues_from_own_checkpoints(
                run_dir, resume
            ):
                log.info(
                    "ckpt.resume=%s started this run: continuing from its own checkpoints", resume
                )
                resume = "auto"  # a restart repeating the command: PATH only initialised the run
            found = storage.load_for_resume(resume, run_dir, info.device, lazy)
            storage.refuse_later_checkpoints(run_dir, found[1]["step"] if found else 0, resume)
            chosen.append(found)

        distributed.run_on_main(info, "choosing the checkpoint to resume from", choose)
        path = distributed.broadcast_object(str(chosen[0][0]) if chosen and chosen[0] else None)
        if path is None:
            return None
        state: dict[str, Any] | None = chosen[0][1] if chosen and chosen[0] else None
        error: Exception | None = None
        if state is None:  # every rank but 0
            try:
                # rank 0 checked every file's checksum: a sharded checkpoint's sizes suffice
                state = storage.load(path, info.device, verified=True, lazy=lazy)
            except Exception as err:  # e.g. this node cannot see rank 0's file: never skip the vote
                error = err
        distributed.raise_if_any_failed(info, error, f"loading {path}")
        assert state is not None
        return Path(path), state

    def check_compatible(self, path: Path, state: dict[str, Any]) -> None:
        """Refuse what cannot continue; report what changes the training math.

        A different world size is fine, also mid-epoch: the position is a count of samples.
        Changes of the global batch, the schedule, the model or the data are reported.
        """
        optim_name = self.record.optim_name
        required = [key for key in self.parts if key not in self.optional]
        missing = [key for key in (*required, *_REQUIRED_META) if key not in state]
        if missing:
            raise CheckpointError(
                f"checkpoint {path} lacks {', '.join(missing)}: not written by this version of "
                "the pipeline"
            )
        old_name = state["config"].get("optim", {}).get("name", optim_name)
        if old_name != optim_name:
            raise ConfigError(
                f"optim.name={optim_name!r} cannot resume checkpoint {path}, written with "
                f"optim.name={old_name!r}: its optimizer state (momentum buffers or Adam "
                f"moments) does not carry over. Resume with --optim.name={old_name}, or start a "
                "new run.dir"
            )
        saved_classes = state.get("classes")
        classes = self.record.classes
        if saved_classes is not None and classes is not None and saved_classes != classes:
            gone = sorted(set(saved_classes) - set(classes))
            new = sorted(set(classes) - set(saved_classes))
            raise ConfigError(
                f"checkpoint {path} was trained on the classes {_listed(saved_classes)}; this "
                f"run's data has {_listed(classes)}"
                + (f" (gone: {', '.join(gone)})" if gone else "")
                + (f" (new: {', '.join(new)})" if new else "")
                + ". A label is a class's index in that list: resume with the same class "
                "folders, or start a new run.dir (model.weights can initialise it from this "
                "checkpoint)"
            )
        position, num_train = state.get("position", {}), self.record.num_train
        if position.get("samples_in_epoch", 0) > num_train:
            raise ConfigError(
                f"checkpoint {path} is {position['samples_in_epoch']} samples into epoch "
                f"{position['epoch']}, but an epoch of this run has {num_train} samples: "
                "the dataset or data.subset changed"
            )
        changed = self._math_changes(state)
        if changed:
            log.warning(
                "resuming %s with settings that change the training math: %s. The run "
                "continues with both (its results mix them); a new experiment belongs in a "
                "new run.dir",
                path,
                "; ".join(changed),
            )

    def _math_changes(self, state: dict[str, Any]) -> list[str]:
        """What differs between the checkpoint's run and this one that changes the training
        math: settings, the global batch, the data."""
        info = self.info
        old, new = _flatten(state["config"]), _flatten(self.record.config)
        # A setting newer than the checkpoint ran as its default did (a new option's default
        # keeps the old behaviour): only a value other than that is a change.
        defaults = _flatten(Config().to_dict())
        changed = [
            f"{key} {old.get(key, '(not in that version)')!r} -> {new[key]!r}"
            for key in sorted(new)
            if key.split(".")[0] in MATH_SECTIONS
            and key not in NON_MATH_KEYS
            and old.get(key, defaults.get(key)) != new[key]
        ]
        this_batch = self.record.global_batch_size
        if state["global_batch_size"] != this_batch:
            changed.append(
                f"global batch {state['global_batch_size']} ({state['world_size']} ranks) -> "
                f"{this_batch} ({info.world_size} ranks)"
            )
        fingerprint = self.record.data_fingerprint
        if state.get("data_fingerprint", fingerprint) != fingerprint:
            changed.append("the training or evaluation data")
        return changed


_REQUIRED_META = ("step", "world_size", "global_batch_size", "config")
_META_KEYS = (
    "format",
    "step",
    "eval_accuracy",
    "pending_eval",
    "total_steps",
    "world_size",
    "global_batch_size",
    "data_fingerprint",
    "classes",
    "config",
    "config_hash",
    "torch_version",
)


def upgrade(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """A checkpoint of an older format in today's layout (format 1: before named parts)."""
    version = state.get("format", 1)
    if version == FORMAT:
        return state
    if version != 1:
        raise CheckpointError(
            f"checkpoint {path} has format {version!r}, newer than this pipeline's {FORMAT}: "
            "resume it with the version of the pipeline that wrote it"
        )
    state = dict(state)
    if {"epoch", "samples_in_epoch"} <= state.keys():
        state["position"] = {
            "step": state["step"],
            "epoch": state.pop("epoch"),
            "samples_in_epoch": state.pop("samples_in_epoch"),
        }
    state.pop("step_in_epoch", None)  # never used
    if isinstance(state.get("rng"), list):
        state["rng"] = {"per_rank": state["rng"]}
    return state


def _listed(names: list[str], most: int = 12) -> str:
    shown = ", ".join(names[:most])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > most else ''}]"


def _flatten(sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        f"{section}.{name}": list(value) if isinstance(value, tuple) else value
        for section, fields in sections.items()
        for name, value in fields.items()
    }
