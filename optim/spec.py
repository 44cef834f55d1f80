"""The optimizer and its parameter groups: SGD or AdamW over the model's trainable
parameters; weight decay by kind of parameter (conv/linear weights, norm scales, biases, as
torchvision's reference splits them); optim.param_groups' groups at their own rates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from config import OptimConfig
from optim import groups


def optimizer_kernels(impl: str) -> dict[str, bool]:
    """The `fused`/`foreach` keyword arguments for a resolved `optim.impl` (auto.optimizer_impl)."""
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


# Normalization layers as torchvision's reference lists them (references/classification/
# utils.py, set_weight_decay): their 1-D parameters follow optim.norm_weight_decay.
NORM_LAYERS = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)


def decay_class(module: nn.Module, local_name: str, param: nn.Parameter) -> str:
    """Which weight decay a parameter gets: "decay" (2 or more dimensions: conv and linear
    weights, embeddings), else "norm" (a normalization layer's scale or shift), "bias" (any
    other bias), or "no_decay" (any other 1-D or scalar parameter: PReLU's slopes, a learned
    scale; torchvision's reference decays those at --wd, this pipeline never has).

    torchvision lets a set --bias-weight-decay win over --norm-weight-decay for a norm
    layer's shift; here the norm layer's rate does, so that its recipes that set only
    --norm-weight-decay (biases then at --wd) are the same here with
    optim.bias_weight_decay = optim.weight_decay."""
    if param.ndim >= 2:
        return "decay"
    if isinstance(module, NORM_LAYERS):
        return "norm"
    return "bias" if local_name == "bias" else "no_decay"


def classified(model: nn.Module) -> list[tuple[str, nn.Parameter, str]]:
    """(name, parameter, decay class) of every parameter, in `model.parameters()` order."""
    seen: set[int] = set()
    out = []
    for module_name, module in model.named_modules():
        for local_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a shared (tied) parameter: listed once, as torch does
                continue
            seen.add(id(param))
            name = f"{module_name}.{local_name}" if module_name else local_name
            out.append((name, param, decay_class(module, local_name, param)))
    return out


def decay_groups(
    params: list[tuple[nn.Parameter, str]], cfg: OptimConfig, always: bool
) -> list[dict[str, Any]]:
    """`params` split by weight decay: "decay" at optim.weight_decay, the rest at none but
    norm and bias parameters at their own rates where those are set. `always`: keep the two
    first groups even when empty (the optimizer's groups as they have always been, so that
    checkpoints of earlier runs resume)."""
    rates = {"norm": cfg.norm_weight_decay, "bias": cfg.bias_weight_decay}
    split: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": [], "norm": [], "bias": []}
    for param, kind in params:
        split["no_decay" if rates.get(kind) == 0.0 else kind].append(param)
    rates |= {"decay": cfg.weight_decay, "no_decay": 0.0}
    return [
        {"params": members, "weight_decay": rates[kind]}
        for kind, members in split.items()
        if members or (always and kind in ("decay", "no_decay"))
    ]


def param_groups(
    model: nn.Module, cfg: OptimConfig, planned: Sequence[groups.Group] = ()
) -> list[dict[str, Any]]:
    """The optimizer's groups over the trainable parameters: first those no optim.param_groups
    group names (split by `decay_groups`; without a factory the two first groups are there even
    when empty, as they always were), then each planned group's, at its own peak lr (the
    schedule multiplies it), split the same way unless it sets its own weight_decay."""
    owner = {name: g for g in planned for name in g.names}
    rest: list[tuple[nn.Parameter, str]] = []
    mine: dict[str, list[tuple[nn.Parameter, str]]] = {g.name: [] for g in planned}
    for name, param, kind in classified(model):
        if param.requires_grad:
            (mine[owner[name].name] if name in owner else rest).append((param, kind))
    out = decay_groups(rest, cfg, always=not planned)
    for group in planned:
        if group.frozen:
            continue
        members = mine[group.name]
        if group.weight_decay is not None:
            split = [{"params": [p for p, _ in members], "weight_decay": group.weight_decay}]
        else:
            split = decay_groups(members, cfg, always=False)
        out += [{**g, "lr": group.peak_lr(cfg), "name": group.name} for g in split]
    return out


def optimizer_spec(
    model: nn.Module, cfg: OptimConfig, impl: str, planned: Sequence[groups.Group] = ()
) -> tuple[type[torch.optim.Optimizer], list[dict[str, Any]], dict[str, Any]]:
    """(class, param groups, settings) of the optimizer: SGD or AdamW over `param_groups`.
    `impl` is optim.impl as resolved (auto.optimizer_impl: the run's auto.Auto record)."""
    param_groups_ = param_groups(model, cfg, planned)
    kernels = optimizer_kernels(impl)
    if cfg.name == "sgd":
        momentum = {"momentum": cfg.momentum, "nesterov": cfg.nesterov and cfg.momentum > 0}
        return torch.optim.SGD, param_groups_, {"lr": cfg.lr, **momentum, **kernels}
    beta1, beta2 = cfg.betas
    return torch.optim.AdamW, param_groups_, {"lr": cfg.lr, "betas": (beta1, beta2), **kernels}


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, impl: str, planned: Sequence[groups.Group] = ()
) -> torch.optim.Optimizer:
    """The optimizer of `optimizer_spec`, every rank holding all of its state."""
    cls, param_groups_, settings = optimizer_spec(model, cfg, impl, planned)
    return cls(param_groups_, **settings)
