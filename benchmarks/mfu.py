"""Model FLOPs utilisation: mfu.

- mfu: FLOP/s of training (FlopCounterMode count x measured steps/s) / FLOP/s of the fastest
  of a few large matmuls in the training dtype on the same device.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

import distributed
import metrics
from benchmarks.common import Plan, Spread, rates, timed
from benchmarks.pipeline import Bare, Rig, bare_forward_backward

# Square matmul sizes tried for the peak; the fastest counts. On CPU the best is not always
# the largest, and below what oneDNN's convolutions reach (BENCHMARKS.md, "MFU").
MATMUL_SIZES = {"cpu": (512, 1024, 2048), "cuda": (4096, 8192)}


def step_flops(bare: Bare) -> int:
    """FLOPs of one optimizer step's forwards and backwards, counted by PyTorch's dispatcher.

    Counted on the bare module (no DDP or compile wrapper). The optimizer update and the
    clip are elementwise and left out, as MFU conventionally does.
    """
    model = distributed.unwrap_model(bare.model)
    with FlopCounterMode(display=False) as counter:
        for images, labels in itertools.islice(itertools.cycle(bare.batches), bare.accum):
            bare_forward_backward(bare, model, images, labels)
    bare.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int, plan: Plan) -> Spread:
    """FLOP/s of a square matmul of `size` in `dtype`."""
    a, b, out = (torch.randn(size, size, device=device).to(dtype) for _ in range(3))
    torch.mm(a, b, out=out)  # warm-up: kernel selection, allocation
    once = timed(lambda: torch.mm(a, b, out=out), device)
    iterations = max(1, math.ceil(plan.min_round_s / once))

    def matmuls() -> None:
        for _ in range(iterations):
            torch.mm(a, b, out=out)

    seconds = [timed(matmuls, device) for _ in range(plan.repeats)]
    return rates(seconds, 2 * size**3 * iterations)


def measure_mfu(rig: Rig, plan: Plan, step_rate: float) -> dict[str, Any]:
    """Training FLOP/s over the peak that training's MFU divides by (metrics.peak_flops: the
    datasheet for known GPUs, else the fastest large matmul), with the matmul rates of a few
    sizes in the training dtype, measured here with the same threads, for context."""
    flops = step_flops(rig.bare)
    dtype = rig.bare.amp_dtype or torch.float32
    device = rig.info.device
    by_size = {size: matmul_flops(device, dtype, size, plan) for size in MATMUL_SIZES[device.type]}
    peak, source = metrics.peak_flops(device, dtype)
    achieved = flops * step_rate / rig.samples_per_step
    return {
        "flops_per_step": flops,
        "model_flops_per_s": achieved,
        "peak_flops_per_s": peak,
        "peak_source": source,
        "matmul_flops_per_s_by_size": {size: rate for size, rate in by_size.items()},
        "mfu": achieved / peak,
    }
