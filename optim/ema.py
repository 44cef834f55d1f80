"""The weight average (train.ema_decay): an exponential moving average of the model's
weights, evaluated and checkpointed (the part "ema") instead of the last step's weights,
updated as torchvision's reference does where asked: every N-th step of an epoch
(train.ema_every_steps), its decay adjusted to the batch and run length (train.ema_adjust),
restarted from the weights through the warm-up (train.ema_warmup_reset).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import distributed
import sharding
from ckpt.parts import Position
from config import Config
from optim import schedules

log = logging.getLogger(__name__)


class WeightAverage:
    """An exponential moving average of the model's weights, the model evaluated (and kept as
    the checkpoint part "ema"): smoother than the last step's weights, so evaluation does not
    swing with the noise of the final steps.

    At each update (`after_step`), ema = decay x ema + (1 - decay) x weights, with the decay
    ramped up as min(decay, (1 + n) / (10 + n)) over the first n updates so the average is not
    dominated by the random initial weights. Buffers (BatchNorm statistics) are not averaged:
    they are taken from the model as they are when evaluating. Every rank holds the same
    weights (or, under fsdp, its shard of them), so every rank holds the same average (its
    shard), without communication.
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float,
        every_steps: int = 1,
        samples_per_step: int = 1,
        reset_until: Callable[[], int] = lambda: 0,
    ) -> None:
        self.model = distributed.unwrap_model(model)
        self.decay = decay
        self.updates = 0
        self.every_steps, self.samples_per_step = every_steps, samples_per_step
        self.reset_until = reset_until  # the warm-up's length in steps, read at each update
        named = list(self.model.named_parameters())
        self._names = [name for name, _ in named]
        self._like = [p for _, p in named]
        # This rank's values (under fsdp its shard of each parameter), and their averages.
        self._params = [sharding.local_tensor(p.detach()) for p in self._like]
        self._averages = [p.clone() for p in self._params]

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average anew from the model's weights (after loading model.weights)."""
        torch._foreach_copy_(self._averages, self._params)
        self.updates = 0

    def after_step(self, position: Position) -> None:
        """After an applied optimizer step, `position` still where it was before the step:
        update on the epoch's steps 0, N, 2N, ... (the reference's `i % model_ema_steps == 0`),
        and inside the warm-up restart from the weights instead (it resets its count there,
        so that its next update copies the weights). Derived from the position alone, so a
        resumed run updates where an uninterrupted one does."""
        if (position.samples_in_epoch // self.samples_per_step) % self.every_steps:
            return
        if position.step < self.reset_until():
            self.restart()
        else:
            self.update()

    @torch.no_grad()
    def update(self) -> None:
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self._averages, self._params, 1.0 - decay)
        self.updates += 1

    @contextlib.contextmanager
    def applied(self) -> Iterator[nn.Module]:
        """The model with the averaged weights (and its own buffers) inside this block; its
        trained weights are put back after it."""
        with torch.no_grad():
            trained = [p.clone() for p in self._params]
            torch._foreach_copy_(self._params, self._averages)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self._params, trained)

    def state_dict(self) -> dict[str, Any]:
        """Whole tensors (a collective under fsdp): the averaged weights by parameter name,
        and the model's buffers beside them, a state_dict `--model.weights` can read."""
        weights = sharding.full_state_dict(self.model)
        for name, average, like in zip(self._names, self._averages, self._like, strict=True):
            weights[name] = sharding.full_from_local(average, like)
        return {"updates": self.updates, "weights": weights}

    def sharded_state_dict(self) -> dict[str, Any]:
        """As `state_dict`, the averages of sharded parameters left as this rank's shards."""
        weights = distributed.unwrap_model(self.model).state_dict()
        for name, average, like in zip(self._names, self._averages, self._like, strict=True):
            weights[name] = sharding.like_local(average, like)
        return {"updates": self.updates, "weights": weights}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        weights = state["weights"]
        missing = [name for name in self._names if name not in weights]
        if missing:
            raise KeyError(f"the weight average lacks {', '.join(missing[:8])}")
        self.updates = int(state["updates"])
        for name, average, like in zip(self._names, self._averages, self._like, strict=True):
            average.copy_(sharding.local_tensor(sharding.shard_like(weights[name], like)))


def adjusted_decay(decay: float, samples_per_step: int, every_steps: int, epochs: int) -> float:
    """torchvision's adjustment (references/classification/train.py, after pycls): 1 - decay
    scaled by world_size x batch_size x model_ema_steps / epochs, capped at 1, so that the
    average spans about the same share of the run whatever the batch and length. Its
    world_size x batch_size is the global batch here (samples per optimizer step)."""
    return 1.0 - min(1.0, (1.0 - decay) * samples_per_step * every_steps / epochs)


def build(
    model: nn.Module,
    cfg: Config,
    samples_per_step: int,
    steps_per_epoch: int,
    total_steps: Callable[[], int],
) -> WeightAverage | None:
    """The run's weight average (None without train.ema_decay)."""
    train = cfg.train
    if not train.ema_decay:
        return None
    decay = train.ema_decay
    if train.ema_adjust:
        decay = adjusted_decay(decay, samples_per_step, train.ema_every_steps, train.epochs)
        log.info("train.ema_adjust: decay %s per update instead of %s", decay, train.ema_decay)

    def reset_until() -> int:
        if not train.ema_warmup_reset:
            return 0
        return schedules.warmup_length(cfg.optim, total_steps(), steps_per_epoch)

    return WeightAverage(model, decay, train.ema_every_steps, samples_per_step, reset_until)
