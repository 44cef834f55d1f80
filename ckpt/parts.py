"""The parts of a checkpoint: every piece of a run's state that a resume restores, each a
`torch.distributed.checkpoint.stateful.Stateful` (`state_dict()` / `load_state_dict()`) that
`ckpt.manager.CheckpointManager` registers by name: the position in the data, the model, the
scheduler, the scaler, every random generator, and the sample ledger that proves each sample
of an epoch was trained on once.

A part's `state_dict` may be a collective (the generators and the ledger gather every rank's);
the manager calls it on every rank.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import distributed
import sharding
from distributed import DistInfo

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# The parts


@dataclass
class Position:
    """Where training stands: optimizer steps done, and the loader's place in which epoch.

    `samples_in_epoch` (summed over ranks) is what a resume continues from: it means the same
    on any world size, and the sampler hands the new ranks the rest of the epoch.
    """

    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.samples_in_epoch = int(state["samples_in_epoch"])


class ModelState:
    """The bare model's weights and buffers (no `module.` or `_orig_mod.` prefixes), as whole
    tensors under every strategy: a parameter FSDP shards is gathered to save (a collective)
    and each rank keeps its shard on load, so a checkpoint loads into any strategy and world
    size.

    Saves rank 0's BatchNorm statistics as they are, without averaging them over ranks: DDP
    (and parallel.sync_buffers under fsdp) give every rank rank 0's buffers at the start of
    the next step anyway, so they are the model's true state, and leaving them alone keeps a
    run with checkpoints bit-identical to one without (evaluation, at epoch ends, averages
    them in every run alike).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return sharding.full_state_dict(distributed.unwrap_model(self.model))

    def sharded_state_dict(self) -> dict[str, Any]:
        """As `state_dict`, a sharded parameter left as this rank's DTensor shard."""
        return distributed.unwrap_model(self.model).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sharding.load_full_state_dict(distributed.unwrap_model(self.model), state)


class OptimizerState:
    """The optimizer in torch's own format (state by parameter index, in the order of its
    param groups) with whole tensors, under every strategy: ZeroRedundancyOptimizer
    consolidates its shards on rank 0, the rank that writes (the other ranks return nothing);
    under fsdp each state tensor of a sharded parameter is gathered to save, and each rank
    keeps its shard on load."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        optimizer = self.optimizer
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.consolidate_state_dict(to=0)  # a collective
            return optimizer.state_dict() if distributed.rank() == 0 else {}
        state = optimizer.state_dict()
        state["state"] = {
            index: {name: sharding.host_full_tensor(value) for name, value in entry.items()}
            for index, entry in state["state"].items()
        }
        return state

    def sharded_state_dict(self) -> dict[str, Any]:
        """As `state_dict`, the state of a sharded parameter left as this rank's DTensor."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return self.state_dict()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = self._params()

        def local(index: Any, name: str, value: Any) -> Any:
            tensor = isinstance(value, torch.Tensor | sharding.LazyRows)
            if tensor and value.ndim > 0 and name != "step":
                return sharding.shard_like(value, params[int(index)])
            return sharding.read_whole(value)

        self.optimizer.load_state_dict(
            {
                **state,
                "state": {
                    index: {name: local(index, name, value) for name, value in entry.items()}
                    for index, entry in state["state"].items()
                },
            }
        )
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            # ZeroRedundancyOptimizer.load_state_dict puts every 0-dim state tensor (Adam's
            # "step") on the CPU, which the fused kernels refuse beside CUDA parameters
            # (pytorch#124133): back beside its parameter.
            local = self.optimizer.optim
            for group in local.param_groups:
                if not (group.get("fused") or group.get("capturable")):
                    continue  # other kernels keep "step" on the CPU themselves
                for param in group["params"]:
                    entry = local.state.get(param, {})
                    for name, value in entry.items():
                        if torch.is_tensor(value) and value.ndim == 0:
                            entry[name] = value.to(param.device)


class SchedulerState:
    """The LR schedule's step count, and this run's optimizer settings put back after loading.

    `optimizer.load_state_dict` restores each group's lr, momentum, weight decay, betas (and
    the kernel choice), `scheduler.load_state_dict` the peak lrs (`base_lrs`): without this a
    changed --optim.lr or --optim.weight_decay would be ignored while the new checkpoint's
    config records it. The step count (`last_epoch`) and the optimizer's per-parameter state
    (momentum buffers, Adam moments) stay as loaded; the lr becomes this run's schedule at the
    current step. Register it after the optimizer. Changes are logged as checkpoint -> now.
    """

    def __init__(
        self, scheduler: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer
    ) -> None:
        self.scheduler, self.optimizer = scheduler, optimizer
        # What this run's config built: loading replaces it with the checkpoint's values.
        self.configured = [
            {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
        ]
        self.base_lrs = list(scheduler.base_lrs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
        changed: dict[str, tuple[Any, Any]] = {}
        groups = self.optimizer.param_groups
        for group, wanted, base_lr in zip(groups, self.configured, self.base_lrs, strict=True):
            if group.get("initial_lr") != base_lr:
                changed.setdefault("peak lr", (group.get("initial_lr"), base_lr))
            group["initial_lr"] = base_lr
            for key, value in wanted.items():
                if key not in ("lr", "initial_lr") and group.get(key) != value:
                    changed.setdefault(key, (group.get(key), value))
                    group[key] = value
        scheduler = self.scheduler
        scheduler.base_lrs = list(self.base_lrs)
        lrs = [
            base_lr * lr_lambda(scheduler.last_epoch)
            for lr_lambda, base_lr in zip(scheduler.lr_lambdas, self.base_lrs, strict=True)
        ]
        for group, lr in zip(groups, lrs, strict=True):
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


class ScalerState:
    """The fp16 GradScaler (an empty state when disabled: bf16 and fp32 need none)."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scaler.load_state_dict(state)
        elif self.scaler.is_enabled():
            log.warning("the checkpoint has no fp16 GradScaler state: starting a fresh scaler")


class RngState:
    """Every rank's random generators (python, numpy, torch, CUDA): a collective to save.

    Resumed on another world size there is no saved state for some ranks: every rank then
    reseeds deterministically from (seed, rank, step).
    """

    def __init__(self, info: DistInfo, seed: int, position: Position) -> None:
        self.info, self.seed, self.position = info, seed, position

    def state_dict(self) -> dict[str, Any]:
        return {"per_rank": distributed.all_gather_object(rng_state())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        per_rank = state["per_rank"]
        if len(per_rank) == self.info.world_size:
            set_rng_state(per_rank[self.info.rank])
            return
        seed_everything(self.seed + self.info.rank + 7919 * self.position.step)
        log.info("world size changed: random generators reseeded from (seed, rank, step)")


# ---------------------------------------------------------------------------------------------
# The manager


# ---------------------------------------------------------------------------------------------
# Sample ledger

_P = 2_147_483_647  # 2^31 - 1: index hashes stay below it, so sums of 2^32 of them fit int64


def index_hashes(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent hashes in [0, 2^31 - 1) of dataset indices (below 2^31)."""
    h1 = (indices.to(torch.int64) * 1103515245 + 12345) % _P
    h2 = (h1 * 48271 + 11) % _P
    return h1, h2


class SampleLedger:
    """Which samples an epoch trained on: their count and two sums of index hashes.

    The sums do not depend on order, rank or restarts, so the epoch's digest over all ranks
    and all restarts equals the digest of the set of samples it saw: a replayed or skipped
    sample changes it. Checkpoints carry the global totals of the epoch so far.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.carried = [0, 0, 0]  # global totals of this epoch before this process started it
        self.local = torch.zeros(3, dtype=torch.int64)

    def start_epoch(self, epoch: int, carried: list[int] | None = None) -> None:
        self.epoch = epoch
        self.carried = list(carried) if carried else [0, 0, 0]
        self.local.zero_()

    def state_dict(self) -> dict[str, Any]:
        """Collective: the epoch's global totals so far."""
        totals, _ = self.totals()
        return {"epoch": self.epoch, "totals": totals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start_epoch(int(state["epoch"]), list(state["totals"]))

    def add(self, indices: torch.Tensor) -> None:
        h1, h2 = index_hashes(indices)
        self.local += torch.stack(
            [torch.tensor(len(indices), dtype=torch.int64), h1.sum(), h2.sum()]
        )

    def totals(self) -> tuple[list[int], list[list[int]]]:
        """Collective: (global totals of the epoch, this process's part on each rank)."""
        per_rank = distributed.all_gather_object(self.local.tolist())
        totals = [sum(column) for column in zip(self.carried, *per_rank, strict=True)]
        return totals, per_rank


def digest(totals: list[int]) -> str:
    count, h1, h2 = totals
    return f"{count}:{h1:x}:{h2:x}"


# ---------------------------------------------------------------------------------------------
# RNG states


def rng_state() -> dict[str, Any]:
    """This process's random generators, in types `torch.load(weights_only=True)` accepts."""
    version, mt_state, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(mt_state), gauss],
        "numpy": [
            np_kind,
            torch.from_numpy(np_keys.astype(np.int64)),
            np_pos,
            np_has_gauss,
            np_gauss,
        ],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state(
        (np_kind, np_keys.cpu().numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss)
    )
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
