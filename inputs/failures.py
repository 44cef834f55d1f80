"""A training sample that fails to load: named, classed, and agreed on by every rank.

`NamedSamples` wraps the training dataset so that an exception from loading a sample names
the sample (its index, and its file for an image folder) and says what kind of failure it is:
`BadSample` (bad input, exit 2: a retry fails the same way) or `SampleIOError` (a transient
storage error, exit 74, by exitcodes.TRANSIENT_ERRNOS). A DataLoader worker's exception
reaches the training process rebuilt from its text (torch/_utils.py, ExceptionWrapper.reraise:
`exc_type(msg)`, the worker's traceback in `msg`): both classes recover their own message and
errno from that text. `StepLoad` loads one step's micro-batches (`StandIn`s where loading
failed); the training loop checkpoints the steps trained, then calls `raise_on_every_rank`.
"""

from __future__ import annotations

import errno as errnos
import logging
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

import distributed
import exitcodes
from config import ConfigError
from distributed import DistInfo
from inputs.sources import folder_index, folder_of

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


def _own_text(cls: type, text: str) -> str:
    """`text` as raised, or, for a DataLoader worker's exception rebuilt in the training process,
    the message after the worker traceback's last line naming `cls`."""
    marker = f"{cls.__module__}.{cls.__qualname__}: "
    return text.rpartition(marker)[2].strip() if marker in text else text


class BadSample(ConfigError):
    """A training sample that cannot be loaded as it is (a corrupt file, a dataset that raises):
    bad input, named. `details`: the original traceback's text, for a dataset's own code."""

    def __init__(self, text: str, details: str = "") -> None:
        own = _own_text(BadSample, text)
        super().__init__(own)
        self.details = details or (text if own != text else "")


class SampleIOError(OSError):
    """A training sample whose read failed with a transient storage error (EIO, ESTALE, ...):
    retryable. Built as (errno, text); rebuilt from a worker's text, the errno is read back."""

    def __init__(self, *args: Any) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            text = _own_text(SampleIOError, args[0])
            found = re.match(r"\[Errno (\d+)\] (.*)", text, re.DOTALL)
            args = (int(found[1]), found[2]) if found else (errnos.EIO, text)
        super().__init__(*args)


def transient_errno(err: BaseException) -> int | None:
    """The errno of a transient storage error in `err` or what it was raised from (an image
    folder's UnreadableImage keeps the read's OSError as its context), else None."""
    for cause in (err, err.__cause__, err.__context__):
        if isinstance(cause, OSError) and cause.errno in exitcodes.TRANSIENT_ERRNOS:
            return cause.errno
    return None


class NamedSamples(Dataset):
    """A training dataset (keyed by (epoch, index) pairs or indices) whose loading failures name
    the sample: `where` (data.factory=... or data.dataset=...), its index, and its file."""

    def __init__(self, dataset: Dataset, base: Dataset, where: str) -> None:
        self.dataset, self.base, self.where = dataset, base, where
        self.folder = getattr(dataset, "folder", None)  # inputs.loaders.Encoded's, read there

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        try:
            return self.dataset[key]
        except MemoryError:
            raise
        except Exception as err:
            raise self.failure(key[1] if isinstance(key, tuple) else key, err) from err

    def failure(self, index: int, err: Exception) -> Exception:
        """`err` as BadSample or SampleIOError, naming sample `index` (and its file)."""
        indices = getattr(self.base, "indices", None)  # data.subset: the dataset's own index
        what = f"{self.where}: train[{index if indices is None else indices[index]}]"
        cause = f"{type(err).__name__}: {err}"
        folder = folder_of(self.base)
        if folder is not None:
            path = folder.samples[folder_index(self.base, index)][0]
            cause = str(err) if path in str(err) else f"{path}: {cause}"  # the file, once
        text = f"{what} failed to load: {cause}"
        code = transient_errno(err)
        if code is not None:
            return SampleIOError(code, text)
        details = "" if isinstance(err, OSError) else "".join(traceback.format_exception(err))
        advice = "fix or remove it, then run the same command (it resumes from the checkpoint"
        return BadSample(f"{text}: {advice} of the steps trained)", details)


class StandIn:
    """Zeros of a training micro-batch's shape, preprocessed: what a rank whose batch failed to
    load runs instead, so that it still joins the step's collectives (DDP's all-reduce, FSDP's
    gathers) and then the step's vote (resilience.StepGuard), which stops every rank. Its
    `labels` are zeros of the kind the loss gets in training (Objective.zero_targets: float
    rows for multi-hot or mixed targets): it is not mixed, and the loss must not raise."""

    def __init__(
        self, preprocess: Callable[[torch.Tensor, torch.Tensor], Batch], shape: Any, labels: Any
    ) -> None:
        self.preprocess, self.shape, self.labels = preprocess, tuple(shape), labels

    def __call__(self) -> Batch:
        zeros = torch.zeros(len(self.labels), *self.shape, dtype=torch.uint8)
        return self.preprocess(zeros, self.labels)


@dataclass
class StepLoad:
    """One optimizer step's micro-batches and their sample indices (for the ledger, once the
    step is agreed on), or, when loading failed here (`error`), as many stand-ins."""

    batches: list[Batch] = field(default_factory=list)
    indices: list[torch.Tensor] = field(default_factory=list)
    error: Exception | None = None

    @classmethod
    def load(
        cls, next_batch: Callable[[], tuple[Batch, torch.Tensor]], count: int, stand_in: StandIn
    ) -> StepLoad:
        loaded = cls()
        try:
            for _ in range(count):
                batch, indices = next_batch()
                loaded.batches.append(batch)
                loaded.indices.append(indices)
        except Exception as err:  # re-raised on this rank by raise_on_every_rank
            return cls([stand_in() for _ in range(count)], [], err)
        return loaded


def log_failure(error: Exception | None, step: int) -> None:
    """On the rank whose batch failed: what failed (and, for a dataset's own code, where)."""
    if error is None:
        return
    log.error("step %d: %s", step, error)
    details = getattr(error, "details", "")
    if details:
        log.error("%s", details)


def _exit_class(error: BaseException) -> int:
    if isinstance(error, OSError):
        return exitcodes.exit_for_os_error(error)
    return exitcodes.EXIT_BAD_INPUT if distributed.is_bad_input(error) else exitcodes.EXIT_FAILED


def raise_on_every_rank(info: DistInfo, error: Exception | None, step: int) -> None:
    """Collective, after the steps trained are checkpointed: the rank(s) whose batch failed
    raise their error (exit 2 for a bad sample, 74 for a transient read); the others raise a
    PeerError with the same exit code when every failure had it, else 1."""
    codes = (exitcodes.EXIT_BAD_INPUT, exitcodes.EXIT_IO)
    mine = _exit_class(error) if error is not None else None
    flags = torch.tensor([float(error is not None)] + [float(mine == c) for c in codes])
    summed = distributed.all_reduce_sum(flags.to(info.device)).tolist()
    failed, same = int(summed[0]), [int(n) for n in summed[1:]]
    if error is not None:
        raise error
    code = next((c for c, n in zip(codes, same, strict=True) if n == failed), 1)
    raise distributed.PeerError(
        f"loading the batch of step {step} failed on {failed} other rank(s); see their errors",
        exit_code=code,
    )
