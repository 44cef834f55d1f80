"""metrics.factory: the user's metric, as named sums and counts the pipeline reduces.

`function(num_classes=C, **metrics.kwargs)` returns a callable `metric(logits, targets)` that
gives, for one batch, `{name: (sum, count)}` (tensors on the logits' device, or numbers). The
pipeline adds them up on the device (no sync per step), all-reduces them with the loss and
accuracy (once per log interval in training, once per evaluation) and logs name = sum / count
in train and eval rows. The logits are detached float32 [N, C]; targets as targets.py says.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from typing import Any

import torch

from config import ConfigError, load_factory
from recipe import MetricsConfig

# Row fields the pipeline writes itself (train and eval rows, eval_report.json); saturation's
# end in _min, _median, _max.
BUILT_IN = frozenset(
    [
        "kind",
        "step",
        "epoch",
        "time_s",
        "lr",
        "loss",
        "accuracy",
        "top5",
        "samples_per_s",
        "data_wait_frac",
        "skipped_steps",
        "step_ms",
        "data_ms",
        "fwd_bwd_ms",
        "optimizer_ms",
        "allreduce_ms",
        "skipped_steps_total",
        "tflops_per_rank",
        "mfu",
        "num_samples",
        "epoch_samples_seen",
        "epoch_sample_digest",
        "sample_digest_per_rank",
        "top1",
        "per_class",
        "confusion",
    ]
)
NAME = re.compile(r"[A-Za-z_]\w*")


class UserMetric:
    """The factory's metric with its names fixed: `measure` gives [sum, count] per name."""

    def __init__(self, fn: Callable[..., Any], names: tuple[str, ...], where: str) -> None:
        self.fn, self.names, self.where = fn, names, where

    def measure(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Float64 [2 x names]: each name's sum, then its count, for one batch."""
        got = self.fn(logits.detach().float(), target)
        if not isinstance(got, dict) or tuple(got) != self.names:
            found = list(got) if isinstance(got, dict) else type(got).__name__
            raise ConfigError(f"{self.where}: returned {found}, and at start-up {self.names}")
        pairs = [_pair(self.where, name, value, logits.device) for name, value in got.items()]
        return torch.stack([v for pair in pairs for v in pair])

    def values(self, sums: list[float]) -> dict[str, float]:
        """name -> sum / count from the reduced [sum, count] pairs (NaN for a zero count)."""
        return {
            name: sums[2 * i] / sums[2 * i + 1] if sums[2 * i + 1] else float("nan")
            for i, name in enumerate(self.names)
        }


def _pair(
    where: str, name: str, value: Any, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise ConfigError(f"{where}: {name!r} is {value!r}, not a (sum, count) pair")
    out = []
    for part in value:
        tensor = torch.as_tensor(part, device=device)
        if tensor.numel() != 1:
            raise ConfigError(
                f"{where}: {name!r} holds a tensor of {tuple(tensor.shape)}: "
                "give a sum and a count, each one number"
            )
        out.append(tensor.reshape(()).double())
    return out[0], out[1]


def make(key: str, spec: str, kwargs: str, num_classes: int) -> Any:
    """What the factory `spec` (config key `key`) returns for num_classes and the kwargs; a
    keyword it does not take is bad input naming the key, not a TypeError."""
    factory = load_factory(key, spec)
    given = json.loads(kwargs)
    try:
        inspect.signature(factory).bind(num_classes=num_classes, **given)
    except TypeError as err:
        section = key.partition(".")[0]
        fix = f"{key}={spec} cannot be called with {section}.kwargs={kwargs}: {err}"
        raise ConfigError(fix) from None
    except ValueError:  # no signature to check (a builtin): the call will say
        pass
    return factory(num_classes=num_classes, **given)


def load(cfg: MetricsConfig, num_classes: int, *samples: torch.Tensor) -> UserMetric | None:
    """metrics.factory's metric, called once on zero logits and each of `samples` (batches of
    real targets, as evaluation and as training pass them): names that are identifiers and no
    built-in row field, the same for every kind of targets, (sum, count) pairs."""
    if not cfg.factory:
        return None
    where = f"metrics.factory={cfg.factory}"
    made = make("metrics.factory", cfg.factory, cfg.kwargs, num_classes)
    if not callable(made):
        raise ConfigError(f"{where} returned {type(made).__name__}, not a callable metric")
    metric = None
    for sample in samples:
        logits = torch.zeros(len(sample), num_classes, device=sample.device)
        try:
            got = made(logits, sample)
        except Exception as err:
            raise ConfigError(
                f"{where}: the metric fails on logits {tuple(logits.shape)} and targets "
                f"{sample.dtype} {tuple(sample.shape)} ({type(err).__name__}: {err})"
            ) from None
        if not isinstance(got, dict) or not got:
            raise ConfigError(
                f"{where}: the metric returned {type(got).__name__}; return {{name: (sum, count)}}"
            )
        for name in got:
            clash = name in BUILT_IN or str(name).endswith(("_min", "_median", "_max"))
            if not isinstance(name, str) or not NAME.fullmatch(name) or clash:
                raise ConfigError(
                    f"{where}: metric name {name!r} is taken by a built-in field or is no "
                    "identifier: rename it (e.g. 'f1' or 'recall_macro')"
                )
        metric = metric or UserMetric(made, tuple(got), where)
        metric.measure(logits, sample)  # every value a (sum, count) pair, the same names
    return metric
