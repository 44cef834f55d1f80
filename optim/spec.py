"""The optimizer and its parameter groups: SGD or AdamW over the model's trainable
parameters, weight decay on conv/linear weights only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from config import OptimConfig


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
