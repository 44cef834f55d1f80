"""The base of every config section: its error, its checks, and the factory specs it names.

`config.Config` composes the sections (config.py and recipe.py); every section subclasses
`Section` and states its checks with `_require`, one per line, so a bad value gets one message
naming the key, the value and the fix.
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A bad key, type or value in the configuration; the message says which and how to fix it."""


def finite(x: float) -> float:
    """`x`, or NaN when it is not finite: then every comparison in a check fails."""
    return x if math.isfinite(x) else math.nan


def image_shape(shape: tuple[int, ...]) -> bool:
    return len(shape) == 3 and min(shape) >= 1 and min(shape[1:]) >= 8


FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
FACTORY_FIX = "write package.module:function"
RESERVED_KWARGS = {
    "model.kwargs": ("in_channels", "num_classes"),
    "data.kwargs": ("root",),
    "optim.param_groups_kwargs": ("model",),
    "loss.kwargs": ("num_classes",),
    "metrics.kwargs": ("num_classes",),
}


def json_object(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object, or None when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def load_factory(key: str, spec: str) -> Callable[..., Any]:
    """The function `package.module:function` names (config key `key`), imported from the
    current directory or PYTHONPATH; a ConfigError naming the module, function and error."""
    module_name, _, function_name = spec.partition(":")
    if os.getcwd() not in sys.path:  # `python train.py` puts the script's folder there, not .
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or any error the module raises while importing
        raise ConfigError(
            f"{key}={spec}: cannot import module {module_name!r} "
            f"({type(err).__name__}: {err}); it must be importable from the current "
            "directory or PYTHONPATH"
        ) from None
    target: Any = module
    for part in function_name.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        names = [name for name in dir(module) if callable(getattr(module, name, None))]
        near = difflib.get_close_matches(function_name, names, n=1)
        hint = f"; did you mean {module_name}:{near[0]}?" if near else ""
        raise ConfigError(
            f"{key}={spec}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
            f"function {function_name!r}{hint}"
        )
    return target


MINI_RESNET = "mini_resnet"
# The label of a sample that is in the batch but not counted (an unreadable image skipped by
# data.bad_images=skip, or a factory's own): cross-entropy's default ignore_index, so its loss
# and gradient are 0.
IGNORED = -100
# dist.strategy values that shard parameters (FSDP2): parallel.py
SHARDED_STRATEGIES = ("fsdp", "hybrid")
NO_SIGNALS = "none"  # run.preempt_signals=none: no preemption checkpoint
SIGNAL_NAMES = (
    "use signal names such as SIGTERM,SIGUSR2 (SIGKILL and SIGSTOP cannot be caught), or none "
    "alone for no preemption checkpoint"
)


class Section:
    """A config section: `_require` states one check per line."""

    _name: ClassVar[str]

    def _require(self, field_name: str, ok: bool, fix: str) -> None:
        if not ok:
            value = getattr(self, field_name)
            raise ConfigError(f"invalid value for {self._name}.{field_name}: {value!r} ({fix})")

    def _require_factory(
        self, factory_field: str = "factory", kwargs_field: str = "kwargs"
    ) -> None:
        """factory is empty or package.module:function; kwargs is a JSON object without the
        keywords the pipeline passes itself. kwargs is stored in one canonical spelling."""
        factory: str = getattr(self, factory_field)
        ok = not factory or bool(FACTORY.fullmatch(factory))
        self._require(factory_field, ok, FACTORY_FIX)
        kwargs = json_object(getattr(self, kwargs_field).strip() or "{}")
        self._require(kwargs_field, kwargs is not None, 'give a JSON object such as {"depth": 4}')
        assert kwargs is not None
        reserved = RESERVED_KWARGS[f"{self._name}.{kwargs_field}"]
        taken = sorted(set(kwargs) & set(reserved))
        self._require(kwargs_field, not taken, f"{', '.join(taken)} is passed by the pipeline")
        object.__setattr__(self, kwargs_field, json.dumps(kwargs, sort_keys=True))
