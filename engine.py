"""The math of training: optimizer, LR schedule, precision, one optimizer step, evaluation.

Plain functions with no I/O and no rank checks. Nothing here calls `.item()` or otherwise
waits for the device, except `evaluate`, which returns Python numbers once at the end.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import auto
import distributed
from config import IGNORED, OptimConfig

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


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, impl: str | None = None
) -> torch.optim.Optimizer:
    """SGD or AdamW; weight decay on conv/linear weights only, not on norm scales or biases.
    `impl` is optim.impl as already resolved (the Trainer's auto.Auto); else resolved here."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    device = next(model.parameters()).device
    kernels = optimizer_kernels(impl or auto.optimizer_impl(cfg.impl, device))
    if cfg.name == "sgd":
        return torch.optim.SGD(
            groups,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov and cfg.momentum > 0,
            **kernels,
        )
    beta1, beta2 = cfg.betas
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(beta1, beta2), **kernels)


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
    the mean over all of them, the same as one batch of the combined size. DDP averages over
    ranks, so the step equals one step on the global batch.
    """
    device = micro_batches[0][0].device
    num_micro = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    labelled = torch.zeros((), device=device, dtype=torch.long)
    for i, (images, labels) in enumerate(micro_batches):
        # Only the last micro-step all-reduces; forward AND backward sit inside no_sync.
        with distributed.gradient_sync(model, enabled=i == num_micro - 1):
            with autocast(device, amp_dtype):
                logits = model(images)
                loss = loss_fn(logits, labels)
            scaler.scale(loss / num_micro).backward()
        counted = (labels != IGNORED).sum()  # the loss is the mean over these
        loss_sum += loss.detach().float() * counted
        correct += (logits.detach().argmax(dim=1) == labels).sum()
        labelled += counted
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    max_norm = grad_clip if grad_clip > 0 else math.inf
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    num_samples = sum(len(labels) for _, labels in micro_batches)
    return StepStats(loss_sum, correct, num_samples, grad_norm, labelled)


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
    weights, so every rank holds the same average, without communication.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.model = distributed.unwrap_model(model)
        self.decay = decay
        self.updates = 0
        self.averaged = copy.deepcopy(self.model).eval().requires_grad_(False)
        self._params = [p for p in self.model.parameters()]
        self._averages = [p for p in self.averaged.parameters()]

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

    @torch.no_grad()
    def for_evaluation(self) -> nn.Module:
        """The averaged weights with the model's current buffers."""
        for mine, theirs in zip(self.averaged.buffers(), self.model.buffers(), strict=True):
            mine.copy_(theirs)
        return self.averaged

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "weights": self.averaged.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        self.averaged.load_state_dict(state["weights"])


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
) -> EvalResult:
    """Exact loss and accuracy over every rank's shard: (sum, count) all-reduced, no padding.
    `flip`: the logits are the mean of the image's and its mirror image's (test-time
    augmentation, data.eval_flip).

    Runs the bare module: a forward through the DDP wrapper would broadcast buffers, a
    collective that ranks with fewer evaluation batches would never join.
    """
    bare = distributed.unwrap_model(model)
    was_training = bare.training
    bare.eval()
    totals = torch.zeros(3, device=device, dtype=torch.float64)  # loss sum, correct, count
    for images, labels in batches:
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
