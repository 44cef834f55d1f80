"""The math of training: optimizer, LR schedule, precision, one optimizer step, evaluation.

Plain functions with no I/O and no rank checks. Nothing here calls `.item()` or otherwise
waits for the device, except `evaluate`, which returns Python numbers once at the end.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import distributed
import parallel
import sharding
from config import IGNORED, ConfigError, OptimConfig

Batch = tuple[torch.Tensor, torch.Tensor]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_scaler(device: torch.device, dtype: torch.dtype | None) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def optimizer_kernels(impl: str) -> dict[str, bool]:
    """The `fused`/`foreach` keyword arguments for a resolved `optim.impl` (auto.optimizer_impl)."""
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


def optimizer_spec(
    model: nn.Module, cfg: OptimConfig, impl: str
) -> tuple[type[torch.optim.Optimizer], list[dict[str, Any]], dict[str, Any]]:
    """(class, param groups, settings) of the optimizer: SGD or AdamW; weight decay on
    conv/linear weights only, not on norm scales or biases. `impl` is optim.impl as resolved
    (auto.optimizer_impl: the run's auto.Auto record)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kernels = optimizer_kernels(impl)
    if cfg.name == "sgd":
        momentum = {"momentum": cfg.momentum, "nesterov": cfg.nesterov and cfg.momentum > 0}
        return torch.optim.SGD, groups, {"lr": cfg.lr, **momentum, **kernels}
    beta1, beta2 = cfg.betas
    return torch.optim.AdamW, groups, {"lr": cfg.lr, "betas": (beta1, beta2), **kernels}


def build_optimizer(model: nn.Module, cfg: OptimConfig, impl: str) -> torch.optim.Optimizer:
    """The optimizer of `optimizer_spec`, every rank holding all of its state."""
    cls, groups, settings = optimizer_spec(model, cfg, impl)
    return cls(groups, **settings)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step`: linear warmup, then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int | Callable[[], int]
) -> LambdaLR:
    """Warmup and cosine decay over `total_steps`: a count, or a function giving it (a run
    knows its length only once it has resumed, which may be after the scheduler is built)."""
    steps = total_steps if callable(total_steps) else lambda: total_steps

    def factor(step: int) -> float:  # a function: LambdaLR saves no state of it
        total = steps()
        return lr_factor(step, warmup_steps(cfg.warmup_steps, total), total, cfg.min_lr_ratio)

    return LambdaLR(optimizer, factor)


def warmup_steps(configured: int, total_steps: int) -> int:
    """optim.warmup_steps, but at most a quarter of the run: a short run (a subset, a smoke
    test) spends three quarters of its steps at useful learning rates instead of warming up
    throughout (the Trainer warns when it shortens the warmup)."""
    return min(configured, total_steps // 4)


@dataclass
class StepStats:
    """Device tensors for one optimizer step; read them (a device sync) only when logging."""

    loss_sum: torch.Tensor  # sum over this rank's samples of the training loss
    correct: torch.Tensor  # this rank's correctly classified training samples
    num_samples: int  # samples in the batches, counted or not
    grad_norm: torch.Tensor  # global gradient L2 norm before clipping
    labelled: torch.Tensor  # samples counted in loss_sum and correct (not IGNORED)


def forward_backward(
    model: nn.Module,
    micro_batches: Sequence[Batch],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    loss_fn: nn.Module,
    amp_dtype: torch.dtype | None,
    grad_clip: float,
) -> StepStats:
    """Gradients of one optimizer step over `len(micro_batches)` accumulated micro-batches,
    unscaled and clipped, ready for `apply_update` (or to be dropped if the step is skipped).

    The loss of each micro-batch is divided by their number so the accumulated gradient is
    the mean over all of them, the same as one batch of the combined size. DDP (or FSDP's
    reduce-scatter) averages over ranks, so the step equals one step on the global batch.
    """
    device = micro_batches[0][0].device
    num_micro = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    labelled = torch.zeros((), device=device, dtype=torch.long)
    parallel.sync_buffers(model)  # fsdp: rank 0's BatchNorm statistics, as DDP gives them
    for i, (images, labels) in enumerate(micro_batches):
        # Only the last micro-step reduces the gradients; forward AND backward sit inside.
        with parallel.gradient_sync(model, enabled=i == num_micro - 1):
            keep, classes = counted_rows(labels)
            # A float target's mean runs over every row: leave out those not counted.
            rows = keep if labels.is_floating_point() else slice(None)
            with autocast(device, amp_dtype):
                logits = _forward(model, images)
                loss = loss_fn(logits[rows], labels[rows])
            scaler.scale(loss / num_micro).backward()
        counted = keep.sum()  # the loss is the mean over these
        loss_sum += loss.detach().float() * counted
        correct += ((logits.detach().argmax(dim=1) == classes) & keep).sum()
        labelled += counted
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    max_norm = grad_clip if grad_clip > 0 else math.inf
    # Under fsdp the norm is a DTensor: its whole value, the same on every rank.
    grad_norm = sharding.full_tensor(nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    num_samples = sum(len(labels) for _, labels in micro_batches)
    return StepStats(loss_sum, correct, num_samples, grad_norm, labelled)


def counted_rows(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which samples count (not IGNORED; for float targets [N, C], mixup's probabilities, a
    row that is not all zero) and the class each is scored against (a float row's argmax, as
    torchvision's reference scores mixed batches)."""
    if labels.is_floating_point():
        return labels.sum(dim=1) > 0, labels.argmax(dim=1)
    return labels != IGNORED, labels


# DDP's own words when the previous step left a parameter without its gradient
# (torch/nn/parallel/distributed.py, Reducer: "Expected to have finished reduction ...").
_UNUSED = "Expected to have finished reduction in the prior iteration"


def _forward(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The model's forward; DDP's error for parameters unused in the previous step (a model
    whose used parameters change from step to step) as bad input naming the setting."""
    try:
        return model(images)
    except RuntimeError as err:
        if _UNUSED not in str(err):
            raise
        raise ConfigError(
            "a parameter got no gradient in the previous step, and DistributedDataParallel "
            "needs every parameter's gradient in every step: a model whose used parameters "
            "change from step to step (LayerDrop, a branch taken by chance) needs "
            "--dist.find_unused_parameters=true (ddp and zero; a graph traversal every step)"
        ) from err


def apply_update(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, skip: bool = False
) -> None:
    """Step the optimizer with the gradients `forward_backward` left, or drop them (`skip`):
    a skipped step leaves parameters and optimizer state exactly as they were."""
    if not skip:
        scaler.step(optimizer)  # with fp16 the scaler itself skips steps with inf gradients
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


class BufferSnapshot:
    """A copy of the model's buffers (BatchNorm statistics), refreshed before every step, so
    that a skipped step also leaves them as they were: its forward updated them already."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = list(distributed.unwrap_model(model).buffers())
        self.saved = [b.detach().clone() for b in self.buffers]

    def take(self) -> None:
        for saved, buffer in zip(self.saved, self.buffers, strict=True):
            saved.copy_(buffer)

    def restore(self) -> None:
        with torch.no_grad():
            for saved, buffer in zip(self.saved, self.buffers, strict=True):
                buffer.copy_(saved)


class WeightAverage:
    """An exponential moving average of the model's weights, the model evaluated (and kept as
    the checkpoint part "ema"): smoother than the last step's weights, so evaluation does not
    swing with the noise of the final steps.

    After each applied optimizer step, ema = decay x ema + (1 - decay) x weights, with the decay
    ramped up as min(decay, (1 + n) / (10 + n)) over the first n updates so the average is not
    dominated by the random initial weights. Buffers (BatchNorm statistics) are not averaged:
    they are taken from the model as they are when evaluating. Every rank holds the same
    weights (or, under fsdp, its shard of them), so every rank holds the same average (its
    shard), without communication.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.model = distributed.unwrap_model(model)
        self.decay = decay
        self.updates = 0
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


def train_step(
    model: nn.Module,
    micro_batches: Sequence[Batch],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    loss_fn: nn.Module,
    amp_dtype: torch.dtype | None,
    grad_clip: float,
) -> StepStats:
    """`forward_backward` then `apply_update`: one optimizer step with no skip logic."""
    stats = forward_backward(model, micro_batches, optimizer, scaler, loss_fn, amp_dtype, grad_clip)
    apply_update(optimizer, scaler)
    return stats


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    num_samples: int  # evaluated samples summed over all ranks


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Batch],
    device: torch.device,
    amp_dtype: torch.dtype | None,
    flip: bool = False,
    input_shape: Sequence[int] | None = None,
) -> EvalResult:
    """Exact loss and accuracy over every rank's shard: (sum, count) all-reduced, no padding.
    `flip`: the logits are the mean of the image's and its mirror image's (test-time
    augmentation, data.eval_flip). `input_shape`: one sample's, for the empty batches of a
    sharded model.

    Runs the bare module: a forward through the DDP wrapper would broadcast buffers, a
    collective that ranks with fewer evaluation batches would never join.
    """
    bare = distributed.unwrap_model(model)
    was_training = bare.training
    bare.eval()
    totals = torch.zeros(3, device=device, dtype=torch.float64)  # loss sum, correct, count
    # Under fsdp a forward is a collective (each unit gathers its parameters): a rank whose
    # shard has run out of batches runs empty ones until every rank's has.
    sharded = parallel.is_sharded(bare)
    loaded = iter(batches)
    while True:
        batch = next(loaded, None)
        if sharded and not distributed.any_rank(batch is not None, device):
            break
        if batch is None:
            if not sharded:
                break
            if input_shape is None:
                raise ValueError("evaluate: a sharded model needs input_shape")
            empty = torch.zeros((0, *input_shape), device=device)
            batch = empty, torch.zeros(0, dtype=torch.long, device=device)
        images, labels = batch
        with autocast(device, amp_dtype):
            logits = bare(images).float()
            if flip:
                logits = (logits + bare(images.flip(-1)).float()) / 2
        loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
        totals[0] += loss.double()
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += (labels != IGNORED).sum()  # cross_entropy leaves IGNORED out too
    bare.train(was_training)
    loss_sum, correct, count = distributed.all_reduce_sum(totals).tolist()
    denominator = max(count, 1.0)
    return EvalResult(
        loss=loss_sum / denominator, accuracy=correct / denominator, num_samples=int(count)
    )
