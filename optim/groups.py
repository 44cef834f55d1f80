"""optim.param_groups: the user's parameter groups (a rate, a weight decay, or frozen), checked
at start-up, and frozen groups frozen before the model is wrapped.

The factory gets the bare model (and optim.param_groups_kwargs) and returns a list of groups,
each a dict: `params` (parameter names or module prefixes: "layer4" names every parameter
under it), and `name`, `lr_scale` (times optim.lr) or `lr`, `weight_decay`, `frozen`.
Parameters no group names train as without a factory. The contract and an example are in
docs/your-model-and-data.md.
"""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from config import ConfigError, OptimConfig, load_factory

log = logging.getLogger(__name__)

KEYS = {"name", "params", "lr_scale", "lr", "weight_decay", "frozen"}


@dataclass(frozen=True)
class Group:
    """One group of the factory, its entries resolved to parameter names."""

    name: str
    entries: tuple[str, ...]  # as the factory named them
    names: tuple[str, ...]  # the parameters they name, in the model's order
    lr: float | None  # the peak rate; None: optim.lr x lr_scale
    lr_scale: float
    weight_decay: float | None  # None: by optim.weight_decay, norm_ and bias_weight_decay
    frozen: bool

    def peak_lr(self, cfg: OptimConfig) -> float:
        return self.lr if self.lr is not None else cfg.lr * self.lr_scale


def matches(entry: str, name: str) -> bool:
    """Whether `entry` (a parameter's name or a module's) names parameter `name`."""
    return name == entry or name.startswith(entry + ".")


def plan(model: nn.Module, cfg: OptimConfig) -> tuple[Group, ...]:
    """The groups of optim.param_groups for `model` (none without a factory), checked: a
    ConfigError names the group and the fault. Frozen groups are frozen (`freeze`)."""
    if not cfg.param_groups:
        return ()
    where = f"optim.param_groups={cfg.param_groups}"
    factory = load_factory("optim.param_groups", cfg.param_groups)
    try:
        returned = factory(model, **json.loads(cfg.param_groups_kwargs or "{}"))
    except TypeError as err:  # the call itself, as a setting (the factory's own errors raise)
        raise ConfigError(f"{where} cannot be called as f(model, **kwargs): {err}") from err
    if not isinstance(returned, Sequence) or isinstance(returned, str | bytes):
        raise ConfigError(f"{where} returned {type(returned).__name__}, not a list of dicts")
    names = [name for name, _ in model.named_parameters()]
    groups = [_group(i, raw, names, where) for i, raw in enumerate(returned)]
    _check_disjoint(groups, where)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    trainable -= {n for g in groups if g.frozen for n in g.names}
    if not trainable:
        raise ConfigError(f"{where} freezes every parameter: nothing would train")
    freeze(model, groups)
    log.info("%s: %s", where, "; ".join(describe(g, cfg) for g in groups))
    return tuple(groups)


def describe(group: Group, cfg: OptimConfig) -> str:
    """One group as the start-up log says it: its name, size and rate."""
    rate = "frozen" if group.frozen else f"peak lr {group.peak_lr(cfg):g}"
    if group.weight_decay is not None:
        rate += f", weight decay {group.weight_decay:g}"
    return f"{group.name} ({len(group.names)} parameters, {rate})"


def _group(index: int, raw: Any, names: list[str], where: str) -> Group:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: group {index} is {type(raw).__name__}, not a dict")
    label = f"{where}: group {raw.get('name', index)!r}"
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise ConfigError(f"{label} has unknown keys {unknown} (known: {sorted(KEYS)})")
    entries = raw.get("params", ())
    if isinstance(entries, str) or not all(isinstance(e, str) for e in entries):
        raise ConfigError(f"{label}: params must be a list of parameter or module names")
    if not entries:
        raise ConfigError(f"{label} names no parameters")
    for entry in entries:
        if not any(matches(entry, name) for name in names):
            raise ConfigError(f"{label} names {entry!r}, which is no parameter or module here")
    frozen = bool(raw.get("frozen", False))
    lr, scale, decay = raw.get("lr"), raw.get("lr_scale", 1.0), raw.get("weight_decay")
    if frozen and ({"lr", "lr_scale", "weight_decay"} & set(raw)):
        raise ConfigError(f"{label} is frozen: it takes no lr, lr_scale or weight_decay")
    if lr is not None and "lr_scale" in raw:
        raise ConfigError(f"{label} gives both lr and lr_scale: give one")
    for key, value in (("lr", lr), ("lr_scale", scale)):
        if value is not None and not (isinstance(value, int | float) and value > 0):
            raise ConfigError(f"{label}: {key}={value!r} must be a number > 0")
    if decay is not None and not (isinstance(decay, int | float) and decay >= 0):
        raise ConfigError(f"{label}: weight_decay={decay!r} must be a number >= 0")
    named = tuple(n for n in names if any(matches(e, n) for e in entries))
    return Group(
        name=str(raw.get("name", f"group{index}")),
        entries=tuple(entries),
        names=named,
        lr=None if lr is None else float(lr),
        lr_scale=float(scale),
        weight_decay=None if decay is None else float(decay),
        frozen=frozen,
    )


def _check_disjoint(groups: list[Group], where: str) -> None:
    owner: dict[str, str] = {}
    for group in groups:
        for name in group.names:
            if name in owner:
                raise ConfigError(
                    f"{where}: parameter {name!r} is in two groups, {owner[name]!r} and "
                    f"{group.name!r}: each parameter belongs to one group"
                )
            owner[name] = group.name


def freeze(model: nn.Module, groups: Sequence[Group]) -> None:
    """Frozen groups: no gradient, and their BatchNorm layers held in eval mode, so their
    running statistics stay as they start (a fine-tuned backbone keeps its pretrained ones).

    A BatchNorm layer is held when all of its parameters are frozen, or, having none
    (affine=False), when a frozen group names it or a module above it. Call it before the
    model is wrapped: DDP and FSDP take the set of trainable parameters at wrapping."""
    frozen = {name for g in groups if g.frozen for name in g.names}
    entries = [entry for g in groups if g.frozen for entry in g.entries]
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        own = [f"{module_name}.{n}" if module_name else n for n, _ in module.named_parameters()]
        named = any(matches(e, module_name) for e in entries)
        if all(n in frozen for n in own) if own else named:
            hold_in_eval(module)


def hold_in_eval(module: nn.Module) -> None:
    """`module` in eval mode now and through every later `.train()` (the trainer's, and its
    parents' calls, which reach it through `module.train`): BatchNorm then normalizes with
    its running statistics and never updates them."""
    module.eval()
    module.train = types.MethodType(_stay_in_eval, module)  # type: ignore[method-assign]


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(module, False)
