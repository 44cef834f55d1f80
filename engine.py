"""The math of training: precision, one optimizer step, evaluation (the optimizer, its
schedule and the weight average are in optim/).

Plain functions with no I/O and no rank checks. Nothing here calls `.item()` or otherwise
waits for the device, except `evaluate`, which returns Python numbers once at the end.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import distributed
import parallel
import scoring
import sharding
from config import ConfigError
from objective import losses, targets
from scoring import EvalResult

Batch = tuple[torch.Tensor, torch.Tensor]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_scaler(device: torch.device, dtype: torch.dtype | None) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


@dataclass
class StepStats:
    """Device tensors for one optimizer step; read them (a device sync) only when logging."""

    loss_sum: torch.Tensor  # sum over this rank's samples of the training loss
    correct: torch.Tensor  # this rank's correctly classified training samples
    num_samples: int  # samples in the batches, counted or not
    grad_norm: torch.Tensor  # global gradient L2 norm before clipping
    labelled: torch.Tensor  # samples counted in loss_sum and correct (not IGNORED)
    top5: torch.Tensor | None = None  # this rank's training samples with a top-5 hit
    metric: torch.Tensor | None = None  # metrics.factory's [sum, count] pairs (objective)
    metric_names: tuple[str, ...] = ()  # their names


def forward_backward(
    model: nn.Module,
    micro_batches: Sequence[Batch],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    loss_fn: Callable[..., Any],
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
    objective = losses.as_objective(loss_fn)  # a plain (logits, targets) -> loss, or more
    loss_sum = torch.zeros((), device=device)
    correct, top5, labelled = torch.zeros(3, device=device, dtype=torch.long).unbind()
    metric = None
    parallel.sync_buffers(model)  # fsdp: rank 0's BatchNorm statistics, as DDP gives them
    for i, (images, labels) in enumerate(micro_batches):
        # Only the last micro-step reduces the gradients; forward AND backward sit inside.
        with parallel.gradient_sync(model, enabled=i == num_micro - 1):
            with autocast(device, amp_dtype):
                outputs = _forward(model, *objective.inputs(images, labels))
                logits, loss = objective.split(outputs, labels)
            scaler.scale(loss / num_micro).backward()
        counted = targets.counted(labels).sum()  # the loss is the mean over these
        loss_sum += loss.detach().float() * counted
        predicted = logits.detach().argmax(dim=1, keepdim=True)
        correct += targets.hits(predicted, labels).sum()
        top5 += targets.hits(targets.top(logits.detach()), labels).any(dim=1).sum()
        labelled += counted
        if objective.metric is not None:
            batch = objective.metric.measure(logits, labels)
            metric = batch if metric is None else metric + batch
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    max_norm = grad_clip if grad_clip > 0 else math.inf
    # Under fsdp the norm is a DTensor: its whole value, the same on every rank.
    grad_norm = sharding.full_tensor(nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    num_samples = sum(len(labels) for _, labels in micro_batches)
    names = objective.metric.names if objective.metric is not None else ()
    return StepStats(loss_sum, correct, num_samples, grad_norm, labelled, top5, metric, names)


# DDP's own words when the previous step left a parameter without its gradient
# (torch/nn/parallel/distributed.py, Reducer: "Expected to have finished reduction ...").
_UNUSED = "Expected to have finished reduction in the prior iteration"


def _forward(model: nn.Module, *inputs: torch.Tensor) -> Any:
    """The model's forward; DDP's error for parameters unused in the previous step (a model
    whose used parameters change from step to step) as bad input naming the setting."""
    try:
        return model(*inputs)
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
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    skip: bool = False,
    found_inf: torch.Tensor | None = None,
) -> None:
    """Step the optimizer with the gradients `forward_backward` left, or drop them (`skip`):
    a skipped step leaves parameters and optimizer state exactly as they were.

    `found_inf`: a float tensor on the device, 1 to skip, decided there: the fused optimizers
    read it as GradScaler hands it to them (torch/amp/grad_scaler.py, `_maybe_opt_step`:
    the `found_inf` and `grad_scale` attributes), with no host sync. torch's foreach and
    for-loop kernels refuse it (torch/optim/sgd.py, `_multi_tensor_sgd`: "Expected grad_scale
    and found_inf to be None"), so verdicts.DeviceVerdicts asks for a fused optimizer."""
    if found_inf is not None:
        optimizer.grad_scale, optimizer.found_inf = None, found_inf  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
    elif not skip:
        scaler.step(optimizer)  # with fp16 the scaler itself skips steps with inf gradients
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


class BufferSnapshot:
    """A copy of the model's buffers (BatchNorm statistics), refreshed before every step, so
    that a skipped step also leaves them as they were: its forward updated them already.
    Held as one flat tensor per device and dtype: a step's copy is one concatenation each, not
    a copy per buffer, and `restore_where` restores them on a flag decided on the device."""

    def __init__(self, model: nn.Module) -> None:
        buffers = [b for b in distributed.unwrap_model(model).buffers() if b.numel()]
        kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for buffer in buffers:
            kinds.setdefault((buffer.device, buffer.dtype), []).append(buffer)
        self.groups = list(kinds.values())
        self.flat = [torch.cat([b.detach().reshape(-1) for b in group]) for group in self.groups]
        self.saved = [
            self._views(flat, group) for flat, group in zip(self.flat, self.groups, strict=True)
        ]

    @torch.no_grad()
    def take(self) -> None:
        for flat, group in zip(self.flat, self.groups, strict=True):
            torch.cat([b.reshape(-1) for b in group], out=flat)

    @torch.no_grad()
    def restore(self) -> None:
        for saved, group in zip(self.saved, self.groups, strict=True):
            torch._foreach_copy_(group, saved)

    @torch.no_grad()
    def restore_where(self, skip: torch.Tensor) -> None:
        """`restore()` where the 0-dim bool `skip` is true, decided on the device."""
        for flat, group in zip(self.flat, self.groups, strict=True):
            kept = torch.where(skip, flat, torch.cat([b.reshape(-1) for b in group]))
            torch._foreach_copy_(group, self._views(kept, group))

    @staticmethod
    def _views(flat: torch.Tensor, group: list[torch.Tensor]) -> list[torch.Tensor]:
        """`flat` (a group's buffers one after another) as views shaped like each buffer."""
        parts = flat.split([b.numel() for b in group])
        return [part.view(b.shape) for part, b in zip(parts, group, strict=True)]


def train_step(
    model: nn.Module,
    micro_batches: Sequence[Batch],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    loss_fn: Callable[..., Any],
    amp_dtype: torch.dtype | None,
    grad_clip: float,
) -> StepStats:
    """`forward_backward` then `apply_update`: one optimizer step with no skip logic."""
    stats = forward_backward(model, micro_batches, optimizer, scaler, loss_fn, amp_dtype, grad_clip)
    apply_update(optimizer, scaler)
    return stats


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Batch],
    device: torch.device,
    amp_dtype: torch.dtype | None,
    flip: bool = False,
    input_shape: Sequence[int] | None = None,
    num_classes: int = 0,
    confusion: bool = False,
    objective: losses.Objective | None = None,
) -> EvalResult:
    """Exact loss, top-1 and top-5 accuracy over every rank's shard (scoring.EvalCounts: sums
    all-reduced, no padding); per-class counts when `num_classes` is given (the same on every
    rank), and the confusion matrix with `confusion`. `flip`: the logits are the mean of the
    image's and its mirror image's (test-time augmentation, data.eval_flip). `input_shape`: one
    sample's, for the empty batches of a sharded model. `objective`: the run's, for its
    evaluation loss and metrics.factory (default: cross-entropy, as always).

    Runs the bare module: a forward through the DDP wrapper would broadcast buffers, a
    collective that ranks with fewer evaluation batches would never join.
    """
    bare = distributed.unwrap_model(model)
    was_training = bare.training
    bare.eval()
    counts = scoring.EvalCounts(device, num_classes, confusion, objective)
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
        counts.add(logits, labels)
    bare.train(was_training)
    return counts.reduce()
