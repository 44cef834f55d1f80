"""The `data.factory` contract: what a user's factory returns (`UserData`), and the checks that
turn a mistake in it (a shape, a label, a normalisation) into bad input naming the fix.
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Subset

from config import IGNORED, ConfigError, DataConfig, load_factory
from inputs.sources import DataSplits, in_memory_numel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UserData:
    """What a `data.factory` function returns (or a mapping with these keys).

    `train` and `eval` are map-style datasets (`__len__`, `__getitem__(index)`) of
    `(image, label)` pairs: image a (C, H, W) tensor of `input_shape`, uint8 (normalised on the
    device with `mean` and `std`, in [0, 1] units, default 0.5 for both; float images are used
    as they are, so mean and std are refused for them); label an int in [0, num_classes) (a
    NumPy integer or a one-element integer tensor will do), or -100 for a sample no loss
    counts; or, for multi-label data (loss.name=bce), a float tensor of num_classes values in
    [0, 1] (multi-hot), the same kind in every sample. Labels are checked before training
    when they can be read without loading images (a list of samples, a `labels` or `targets`
    attribute), else as each sample is loaded.
    Training samples get this pipeline's augmentation (random crop, flip: data.augment, keyed
    by seed, epoch and index) and sampler. A dataset that augments its own samples says so with
    `augmented=True`: data.augment then leaves them alone (its random draws are its own, so a
    resumed run repeats an uninterrupted one only if they are keyed the same way).
    """

    train: Dataset
    eval: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    classes: tuple[str, ...] | None = None
    augmented: bool = False


def user_data(cfg: DataConfig) -> DataSplits:
    """The datasets data.factory returns (`UserData`), checked on their first samples and on
    their labels, and served checked (`SampleChecked`)."""
    where = f"data.factory={cfg.factory}"
    factory = load_factory("data.factory", cfg.factory)
    kwargs = json.loads(cfg.kwargs)
    _check_factory_call(factory, where, cfg.kwargs, kwargs)
    made = factory(root=cfg.root, **kwargs)
    if isinstance(made, Mapping):
        known = {f.name for f in fields(UserData)}
        unknown = sorted(set(made) - known)
        if unknown or not {"train", "eval", "num_classes", "input_shape"} <= made.keys():
            raise ConfigError(
                f"{where} returned a mapping with keys {sorted(made)}: it needs train, eval, "
                "num_classes, input_shape, and may have mean, std, classes"
            )
        made = UserData(**made)
    if not isinstance(made, UserData):
        raise ConfigError(
            f"{where} returned {type(made).__name__}: return a data.UserData (or a mapping "
            "with its fields: train, eval, num_classes, input_shape)"
        )
    num_classes, shape = _classes_and_shape(where, made)
    images = {split: _check_sample(where, split, getattr(made, split), shape) for split in SPLITS}
    splits = {}
    for split in SPLITS:
        dataset = getattr(made, split)
        check_labels(f"{where}: {split}", known_labels(dataset), num_classes)
        if in_memory_numel(dataset) is None:  # ImageTensors' labels are int64, all checked
            dataset = SampleChecked(dataset, f"{where}: {split}", num_classes, shape)
        splits[split] = dataset
    uint8 = any(image.dtype == torch.uint8 for image in images.values())
    mean, std = _factory_stats(where, made, uint8, shape[0])
    classes = tuple(made.classes) if made.classes is not None else None
    _say_augmentation(where, made, cfg)
    return DataSplits(
        splits["train"], splits["eval"], shape, num_classes, mean, std, classes, made.augmented
    )


def _say_augmentation(where: str, made: UserData, cfg: DataConfig) -> None:
    """Whose augmentation the training samples get, said once: a dataset with transforms of
    its own got this pipeline's crop and flip on top of them without a word."""
    if made.augmented:
        log.info("%s: training samples come augmented by the dataset (data.augment is off)", where)
        return
    if not cfg.augment:
        return
    shift = f"a random shift of up to {cfg.crop_padding} pixels and " if cfg.crop_padding else ""
    ours = f"{shift}a 50% horizontal flip (data.augment)"
    own = [n for n in ("transform", "transforms") if getattr(made.train, n, None) is not None]
    if own:
        log.warning(
            "%s: the training dataset has its own %s, and gets %s on top: if it augments, return "
            "UserData(..., augmented=True) or set --data.augment=false",
            where,
            own[0],
            ours,
        )
    else:
        log.info("%s: training samples get %s", where, ours)


def _classes_and_shape(where: str, made: UserData) -> tuple[int, tuple[int, ...]]:
    """A factory's num_classes and input_shape as ints (Python's or NumPy's integers), the
    shape in (C, H, W) order."""
    num_classes = _count(made.num_classes)
    if num_classes is None or num_classes < 2:
        raise ConfigError(f"{where}: num_classes={made.num_classes!r} is not a count >= 2")
    shape = tuple(_count(n) or 0 for n in made.input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ConfigError(f"{where}: input_shape={made.input_shape!r} is not (C, H, W)")
    if shape[2] in (1, 3, 4) and shape[0] > 4:  # images as PIL and NumPy hold them: H, W, C
        raise ConfigError(
            f"{where}: input_shape={made.input_shape!r} looks like (H, W, C), not (C, H, W): "
            f"it would train as {shape[0]} channels of {shape[1]}x{shape[2]} pixels. Return "
            "images as (C, H, W) tensors (image.permute(2, 0, 1)) and input_shape to match"
        )
    return num_classes, shape


def _factory_stats(
    where: str, made: UserData, uint8: bool, channels: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """A factory's mean and std (0.5 when not given), checked; refused for float images,
    which Preprocess uses as they are."""
    for name in ("mean", "std"):
        given = getattr(made, name)
        if given is not None and not uint8:
            raise ConfigError(
                f"{where}: {name}={tuple(given)!r} is given for float images, which are used as "
                "they are (only uint8 images are normalised): normalise them in the dataset, "
                f"or return uint8 images, or leave {name} out"
            )
    mean = tuple(made.mean) if made.mean is not None else (0.5,) * channels
    std = tuple(made.std) if made.std is not None else (0.5,) * channels
    check_normalisation(f"{where}: ", "mean", mean, channels)
    check_normalisation(f"{where}: ", "std", std, channels)
    return mean, std


SPLITS = ("train", "eval")


def _count(value: Any) -> int | None:
    """`value` as an int when it is an integer of any kind (int, NumPy's), never a bool."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_):
        return int(value)
    return None


def _check_factory_call(factory: Any, where: str, spelled: str, kwargs: dict[str, Any]) -> None:
    """A data.kwargs key the factory does not take is bad input naming it (as model.kwargs'
    are), not a TypeError traceback from the call."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to check (a builtin): the call will say
        return
    try:
        signature.bind(root="", **kwargs)
    except TypeError as err:
        known = [name for name in signature.parameters if name != "root"]
        near = [difflib.get_close_matches(key, known, n=1) for key in kwargs if key not in known]
        hint = next((f"; did you mean {match[0]}?" for match in near if match), "")
        raise ConfigError(
            f"{where} cannot be called with data.kwargs={spelled}: {err}{hint}"
        ) from None


def check_normalisation(where: str, name: str, values: Sequence[float], channels: int) -> None:
    """A mean or std (`name`) for uint8 images, in [0, 1] units (as torchvision's Normalize
    after ToTensor): one value per channel, finite, 0 <= mean <= 1 and 0 < std <= 1. Values in
    0..255 units would train on inputs squashed near zero, a std of 0 on infinities (reported
    as a divergence)."""
    spelled = f"{name}={','.join(map(str, values))}"
    if len(values) != channels:
        raise ConfigError(
            f"{where}{spelled} has {len(values)} values; the data has {channels} channels: "
            "give one per channel"
        )
    if not all(isinstance(v, numbers.Real) and math.isfinite(v) for v in values):
        raise ConfigError(f"{where}{spelled} holds a value that is not a finite number")
    is_mean = name.endswith("mean")
    if min(values) < 0 or (min(values) == 0 and not is_mean) or max(values) > 1:
        bound = "0 <= mean <= 1" if is_mean else "0 < std <= 1"
        hint = " (0..255 units? divide them by 255)" if max(values) > 1 else ""
        raise ConfigError(
            f"{where}{spelled} is outside {bound}: uint8 images are normalised in [0, 1] "
            f"units{hint}"
        )


def _check_sample(where: str, split: str, dataset: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """A factory's dataset is map-style and not empty, and its first sample is an (image,
    label) pair with an image of the declared shape; returns that image."""
    if isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    ):
        kind = "an IterableDataset" if isinstance(dataset, IterableDataset) else "not"
        raise ConfigError(
            f"{where}: {split} is a {type(dataset).__name__}, {kind} a map-style dataset "
            "(__len__ and __getitem__(index)): the sampler shards, shuffles and resumes by "
            "index. Give the class a __getitem__, or return the samples as a list"
        )
    if len(dataset) == 0:
        raise ConfigError(f"{where}: the {split} dataset is empty")
    sample = dataset[0]
    if not (isinstance(sample, tuple | list) and len(sample) == 2):
        raise ConfigError(f"{where}: {split}[0] is not an (image, label) pair")
    image = sample[0]
    if not isinstance(image, torch.Tensor) or tuple(image.shape) != shape:
        got = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ConfigError(f"{where}: {split}[0]'s image is {got}, not a tensor of {shape}")
    if not (image.dtype == torch.uint8 or image.is_floating_point()):
        raise ConfigError(f"{where}: {split}[0]'s image is {image.dtype}: use uint8 or float")
    return image


def as_label(value: Any) -> int | None:
    """A sample's label as an int: a Python or NumPy integer, or an integer tensor of one
    element (0-d or (1,)); None for anything else (a float, a bool, a longer tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_floating_point():
            return None
        if value.is_complex():
            return None
        return int(value.reshape(()).item())
    if isinstance(value, np.ndarray):
        return as_label(torch.from_numpy(value)) if value.dtype.kind in "iu" else None
    return _count(value)


def as_target(value: Any, num_classes: int) -> int | torch.Tensor | None:
    """`as_label`, or a float tensor of `num_classes` finite values in [0, 1] (a multi-hot
    row, objective/targets.py) as float32; None for anything else."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim == 1:
        row = value.float()
        ok = len(row) == num_classes and bool(((row >= 0) & (row <= 1)).all())
        return row if ok else None
    return as_label(value)


def known_labels(dataset: Any) -> Sequence[Any] | torch.Tensor | None:
    """Every label of a dataset when they can be read without loading images: a list or tuple
    of samples, ImageTensors' `labels`, or the `labels` or `targets` attribute (one per sample)
    that torchvision's datasets and many others have; None when there is no such list."""
    base, indices = dataset, None
    if isinstance(dataset, Subset):
        base, indices = dataset.dataset, list(dataset.indices)
    if isinstance(base, list | tuple):
        labels: Any = [sample[1] for sample in base]
    else:
        found = (getattr(base, name, None) for name in ("labels", "targets"))
        labels = next(
            (v for v in found if isinstance(v, Sequence | torch.Tensor | np.ndarray)), None
        )
        if labels is None or isinstance(labels, str) or len(labels) != len(base):
            return None
    if isinstance(labels, np.ndarray):
        labels = torch.from_numpy(labels)
    if indices is None:
        return labels
    return (
        labels[torch.tensor(indices)]
        if isinstance(labels, torch.Tensor)
        else [labels[i] for i in indices]
    )


class BadLabel(ConfigError):
    """A sample whose label is not an int in [0, num_classes) nor the ignore label; the message
    names the dataset, the sample's index and the value."""


def _bad_label(where: str, index: int, value: Any, num_classes: int) -> BadLabel:
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        value = value.item()  # 10, not tensor(10)
    return BadLabel(
        f"{where}[{index}] has label {value!r}: labels must be ints in [0, {num_classes}) "
        f"(num_classes={num_classes}), or {IGNORED} for a sample left out of the loss; or, in "
        f"every sample alike, float tensors of {num_classes} values in [0, 1] (multi-hot)"
    )


def check_labels(where: str, labels: Sequence[Any] | torch.Tensor | None, num_classes: int) -> None:
    """Every label an int in [0, num_classes) or IGNORED (`as_label`), else bad input naming
    the first bad index and value; the ignored ones counted in the log. `labels` None: nothing
    to check before training (`SampleChecked` checks each sample as it is loaded)."""
    if labels is None:
        return
    if isinstance(labels, torch.Tensor) and labels.ndim == 1 and not labels.is_floating_point():
        values = labels.long()  # every row at once (BENCHMARKS.md, "Overhead")
    else:
        found = [as_target(value, num_classes) for value in labels]
        rows = isinstance(found[0], torch.Tensor) if found else False
        kind = torch.Tensor if rows else int  # one kind in every sample: batches stack them
        bad = next((i for i, value in enumerate(found) if not isinstance(value, kind)), None)
        if bad is not None:
            raise _bad_label(where, bad, labels[bad], num_classes)
        if rows:
            return
        values = torch.tensor(found, dtype=torch.long)
    wrong = ~(((values >= 0) & (values < num_classes)) | (values == IGNORED))
    if bool(wrong.any()):
        bad = int(wrong.nonzero()[0])
        raise _bad_label(where, bad, labels[bad], num_classes)
    ignored = int((values == IGNORED).sum())
    if ignored:
        log.warning(
            "%s: %d of %d samples are labelled %d (the ignore label): they are loaded but "
            "left out of the loss and of every count",
            where,
            ignored,
            len(values),
            IGNORED,
        )


class BadSample(ConfigError):
    """A sample whose image is not a tensor of the declared input_shape; the message names the
    dataset, the sample's index, its shape and the fix."""


class SampleChecked(Dataset):
    """A factory's dataset with each sample checked as it is loaded: the label made an int in
    range (one `known_labels` could not read ahead still fails naming its sample, not deep in
    the loss), and the image of `shape` (one of another size failed in the batch's stack with
    a traceback naming no sample)."""

    def __init__(self, base: Dataset, where: str, num_classes: int, shape: tuple[int, ...]):
        self.base, self.where, self.num_classes, self.shape = base, where, num_classes, shape

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int | torch.Tensor]:
        image, value = self.base[index]
        if not isinstance(image, torch.Tensor) or tuple(image.shape) != self.shape:
            got = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
            raise BadSample(
                f"{self.where}[{index}]'s image is {got}, not a tensor of input_shape="
                f"{self.shape}: a batch stacks samples of one shape, so resize or crop every "
                "sample to it in the dataset"
            )
        label = as_target(value, self.num_classes)
        if isinstance(label, torch.Tensor):
            return image, label
        if label is None or not (0 <= label < self.num_classes or label == IGNORED):
            raise _bad_label(self.where, index, value, self.num_classes)
        return image, label
