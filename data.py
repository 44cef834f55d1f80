"""Datasets, samplers and loaders.

Samples travel as uint8 tensors (4x less to copy than float) and are normalised on the device
in `Preprocess`. Training augmentation (random crop + horizontal flip) is a pure function of
(seed, epoch, sample index): the same sample gets the same crop whatever the world size,
number of workers, or where a resumed run restarts, so runs are comparable and resumable.
"""

from __future__ import annotations

import difflib
import gzip
import hashlib
import inspect
import json
import logging
import math
import numbers
import os
import random
import shutil
import signal
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset

import auto
import distributed
import exitcodes
import imagefolder
from config import IGNORED, ConfigError, DataConfig, load_factory
from distributed import DistInfo

log = logging.getLogger(__name__)

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
# Per-channel mean and std of the training sets, in [0, 1] units.
STATS = {
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
SYNTHETIC_SEED = 20240601  # fixed: the synthetic task is the same whatever train.seed is


class DatasetNotFoundError(FileNotFoundError):
    """The dataset is not on disk and may not be downloaded; the message says how to get it."""


class ImageTensors(Dataset):
    """An in-memory dataset: uint8 images (N, C, H, W) and int64 labels (N,)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4 or len(images) != len(labels):
            raise ValueError(
                f"expected uint8 (N, C, H, W) images and N labels, got "
                f"{images.dtype} {tuple(images.shape)} and {tuple(labels.shape)}"
            )
        self.images = images
        self.labels = labels.long()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


@dataclass(frozen=True)
class DataSplits:
    """What a run trains and evaluates on. Images are (C, H, W) tensors: uint8 ones are
    normalised on the device with `mean` and `std` (in [0, 1] units), float ones are used as
    they are."""

    train: Dataset
    eval: Dataset
    input_shape: tuple[int, ...]  # (C, H, W) of every sample
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    classes: tuple[str, ...] | None = None  # class names by label, when the dataset has them

    @property
    def in_channels(self) -> int:
        return self.input_shape[0]


@dataclass(frozen=True)
class UserData:
    """What a `data.factory` function returns (or a mapping with these keys).

    `train` and `eval` are map-style datasets (`__len__`, `__getitem__(index)`) of
    `(image, label)` pairs: image a (C, H, W) tensor of `input_shape`, uint8 (normalised on the
    device with `mean` and `std`, in [0, 1] units, default 0.5 for both; float images are used
    as they are, so mean and std are refused for them); label an int in [0, num_classes) (a
    NumPy integer or a one-element integer tensor will do), or -100 for a sample no loss
    counts. Labels are checked before training when they can be read without loading images
    (a list of samples, a `labels` or `targets` attribute), else as each sample is loaded.
    Training samples get this pipeline's augmentation (random crop, flip: data.augment) and
    sampler; a dataset must not draw random numbers of its own, or a resumed run differs from
    an uninterrupted one.
    """

    train: Dataset
    eval: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    classes: tuple[str, ...] | None = None


# ---------------------------------------------------------------------------------------------
# Datasets


def _prepare_fashion_mnist(root: Path) -> None:
    """Copy Debian's gzipped Fashion-MNIST into torchvision's layout (once; atomic per file)."""
    raw = root / "FashionMNIST" / "raw"
    if not DEBIAN_FASHION_MNIST.is_dir() or all((raw / n).exists() for n in FASHION_MNIST_FILES):
        return
    raw.mkdir(parents=True, exist_ok=True)
    for name in FASHION_MNIST_FILES:
        target = raw / name
        if target.exists():
            continue
        tmp = raw / f".{name}.{os.getpid()}.tmp"
        with gzip.open(DEBIAN_FASHION_MNIST / f"{name}.gz", "rb") as src, tmp.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, target)  # concurrent preparers (several nodes) each write whole files
    log.info("unpacked Fashion-MNIST from %s into %s", DEBIAN_FASHION_MNIST, raw)


def _torchvision_splits(
    cls: type, name: str, cfg: DataConfig, folder: Path, offline_hint: str
) -> tuple[Any, Any]:
    """Train and test sets of a torchvision dataset class, or one error saying how to get it."""
    root = Path(cfg.root)
    try:
        return (
            cls(str(root), train=True, download=cfg.download),
            cls(str(root), train=False, download=cfg.download),
        )
    except (RuntimeError, OSError, AssertionError, ValueError, EOFError) as err:
        # Not found, corrupt (torchvision asserts on a malformed idx header), or a failed
        # download.
        if cfg.download:
            raise DatasetNotFoundError(
                f"{name} could not be downloaded into {root}: {err}. {offline_hint}"
            ) from err
        raise DatasetNotFoundError(
            f"{name} not found or unreadable under {folder} and --data.download=false "
            f"({type(err).__name__}: {err}). {offline_hint}, or pass --data.download=true"
        ) from None


def _fashion_mnist(cfg: DataConfig) -> DataSplits:
    _prepare_fashion_mnist(Path(cfg.root))
    from torchvision import datasets

    train, test = _torchvision_splits(
        datasets.FashionMNIST,
        "Fashion-MNIST",
        cfg,
        Path(cfg.root) / "FashionMNIST" / "raw",
        f"Install Debian's package dataset-fashion-mnist (files in {DEBIAN_FASHION_MNIST})",
    )
    mean, std = STATS["fashion_mnist"]
    return DataSplits(
        ImageTensors(train.data.unsqueeze(1), train.targets),
        ImageTensors(test.data.unsqueeze(1), test.targets),
        (1, 28, 28),
        10,
        mean,
        std,
        tuple(train.classes),
    )


def _cifar10(cfg: DataConfig) -> DataSplits:
    folder = Path(cfg.root) / "cifar-10-batches-py"
    from torchvision import datasets

    train, test = _torchvision_splits(
        datasets.CIFAR10,
        "CIFAR-10",
        cfg,
        folder,
        f"Copy the extracted cifar-10-batches-py folder to {folder}",
    )

    def to_tensors(ds: Any) -> ImageTensors:
        images = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).contiguous()
        return ImageTensors(images, torch.tensor(ds.targets))

    mean, std = STATS["cifar10"]
    classes = tuple(train.classes)
    return DataSplits(to_tensors(train), to_tensors(test), (3, 32, 32), 10, mean, std, classes)


def _imagefolder(cfg: DataConfig) -> DataSplits:
    root = Path(cfg.root)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise DatasetNotFoundError(
                f"imagefolder needs {root / split}/<class>/<image> folders; {root / split} "
                "does not exist (set --data.root to the folder holding train/ and val/)"
            )
    options = (cfg.image_size, cfg.crop_ratio, cfg.crop_scale, cfg.bad_images == "skip")
    train = imagefolder.ImageFolder(root / "train", *options)
    imagefolder.require_two_classes(train)  # before val: a val of one class is a mismatch
    test = imagefolder.ImageFolder(root / "val", *options)
    if test.classes != train.classes:  # labels are indices into the sorted class folders
        missing = sorted(set(train.classes) - set(test.classes))
        extra = sorted(set(test.classes) - set(train.classes))
        raise ConfigError(
            f"imagefolder class folders differ between {root / 'train'} {train.classes} and "
            f"{root / 'val'} {test.classes}: "
            + "; ".join(
                part
                for part in (
                    missing and f"{root / 'val'} lacks {missing}",
                    extra and f"{root / 'val'} has {extra}, which {root / 'train'} lacks",
                )
                if part
            )
            + ". Both need the same class folders (a label is a class's index in sorted order)"
        )
    mean, std = STATS["imagefolder"]
    shape = (3, cfg.image_size, cfg.image_size)
    return DataSplits(train, test, shape, len(train.classes), mean, std, tuple(train.classes))


def make_synthetic(
    num_samples: int, shape: Sequence[int], num_classes: int, seed: int
) -> ImageTensors:
    """Deterministic, learnable images: a smooth per-class template plus per-sample noise."""
    channels, height, width = shape
    templates_gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    coarse = torch.randn(
        num_classes, channels, max(2, height // 4), max(2, width // 4), generator=templates_gen
    )
    templates = torch.nn.functional.interpolate(
        coarse, size=(height, width), mode="bilinear", align_corners=False
    )
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (num_samples,), generator=gen)
    noise = torch.randn(num_samples, channels, height, width, generator=gen)
    images = 128 + 60 * templates[labels] + 30 * noise
    return ImageTensors(images.round().clamp(0, 255).to(torch.uint8), labels)


def _synthetic(cfg: DataConfig) -> DataSplits:
    shape = cfg.synthetic_shape
    train = make_synthetic(
        cfg.synthetic_train_size, shape, cfg.synthetic_num_classes, SYNTHETIC_SEED + 1
    )
    test = make_synthetic(
        cfg.synthetic_eval_size, shape, cfg.synthetic_num_classes, SYNTHETIC_SEED + 2
    )
    channels = shape[0]
    return DataSplits(
        train, test, shape, cfg.synthetic_num_classes, (0.5,) * channels, (0.25,) * channels
    )


def _user_data(cfg: DataConfig) -> DataSplits:
    """The datasets data.factory returns (`UserData`), checked on their first samples and on
    their labels, and served with checked labels (`LabelChecked`)."""
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
        check_labels(f"{where}: {split}", _known_labels(dataset), num_classes)
        if in_memory_numel(dataset) is None:  # ImageTensors' labels are int64, all checked
            dataset = LabelChecked(dataset, f"{where}: {split}", num_classes)
        splits[split] = dataset
    uint8 = any(image.dtype == torch.uint8 for image in images.values())
    mean, std = _factory_stats(where, made, uint8, shape[0])
    classes = tuple(made.classes) if made.classes is not None else None
    return DataSplits(splits["train"], splits["eval"], shape, num_classes, mean, std, classes)


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
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(
            f"{where}: {split} is a {type(dataset).__name__}, not a map-style dataset "
            "(__len__ and __getitem__)"
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


def _known_labels(dataset: Any) -> Sequence[Any] | torch.Tensor | None:
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
        f"(num_classes={num_classes}), or {IGNORED} for a sample left out of the loss"
    )


def check_labels(where: str, labels: Sequence[Any] | torch.Tensor | None, num_classes: int) -> None:
    """Every label an int in [0, num_classes) or IGNORED (`as_label`), else bad input naming
    the first bad index and value; the ignored ones counted in the log. `labels` None: nothing
    to check before training (`LabelChecked` checks each sample as it is loaded)."""
    if labels is None:
        return
    if isinstance(labels, torch.Tensor) and labels.ndim == 1 and not labels.is_floating_point():
        values = labels.long()  # every row at once: 60000 labels in a millisecond
    else:
        ints = [as_label(value) for value in labels]
        bad = next((i for i, value in enumerate(ints) if value is None), None)
        if bad is not None:
            raise _bad_label(where, bad, labels[bad], num_classes)
        values = torch.tensor(ints, dtype=torch.long)
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


class LabelChecked(Dataset):
    """A factory's dataset with each label checked and made an int as it is loaded: a label
    `_known_labels` could not read ahead still fails naming its sample, not deep in the loss."""

    def __init__(self, base: Dataset, where: str, num_classes: int) -> None:
        self.base, self.where, self.num_classes = base, where, num_classes

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, value = self.base[index]
        label = as_label(value)
        if label is None or not (0 <= label < self.num_classes or label == IGNORED):
            raise _bad_label(self.where, index, value, self.num_classes)
        return image, label


_BUILDERS = {
    "fashion_mnist": _fashion_mnist,
    "cifar10": _cifar10,
    "imagefolder": _imagefolder,
    "synthetic": _synthetic,
}


def build_datasets(cfg: DataConfig, seed: int, info: DistInfo) -> DataSplits:
    """Load (and if allowed download) the dataset; one process per node touches the disk first.

    Local rank 0 prepares the files while the others wait (up to data.prepare_timeout_s, with
    progress logged), then every rank loads. The wait ends for every rank also when
    preparation fails, so a missing dataset fails fast everywhere instead of hanging the others.
    """
    builder = _user_data if cfg.factory else _BUILDERS[cfg.dataset]
    prepared: list[DataSplits] = []

    def prepare() -> None:
        prepared.append(builder(cfg))

    # Bounded by data.prepare_timeout_s, not dist.timeout_s: a download may take long.
    distributed.run_on_node_leaders_bounded(
        info,
        f"the {f'data.factory={cfg.factory}' if cfg.factory else cfg.dataset} dataset to be "
        "prepared",
        prepare,
        cfg.prepare_timeout_s,
        "data.prepare_timeout_s",
        progress_every_s=min(30.0, cfg.prepare_timeout_s / 10),
    )
    splits = prepared[0] if prepared else builder(cfg)
    for name in ("mean", "std"):  # data.mean/std: the user's normalisation
        given = getattr(cfg, name)
        if given and cfg.factory and splits.train[0][0].is_floating_point():
            raise ConfigError(  # Preprocess uses float images as they are: it would do nothing
                f"data.{name}={','.join(map(str, given))} is for uint8 images, and "
                f"{cfg.source} returns float images, which are used as they are: normalise "
                f"them in the dataset, or return uint8 images, or leave data.{name} out"
            )
        if given:
            check_normalisation("", f"data.{name}", given, splits.in_channels)
            splits = replace(splits, **{name: tuple(given)})
    if not cfg.factory:  # a factory's are checked in _user_data, and served by LabelChecked
        for split in SPLITS:
            labels = _known_labels(getattr(splits, split))
            check_labels(f"{cfg.source}: {split}", labels, splits.num_classes)
    if cfg.subset:
        if cfg.subset > len(splits.train):  # type: ignore[arg-type]
            raise ConfigError(
                f"data.subset={cfg.subset} exceeds the {len(splits.train)} training samples "  # type: ignore[arg-type]
                f"of {cfg.source} (the dataset's size): use at most that, or 0 for all"
            )
        order = torch.randperm(len(splits.train), generator=torch.Generator().manual_seed(seed))  # type: ignore[arg-type]
        splits = replace(splits, train=Subset(splits.train, order[: cfg.subset].tolist()))
    return splits


def fingerprint(splits: DataSplits) -> str:
    """A short, cheap hash of what this rank will train and evaluate on (for preflight)."""
    digest = hashlib.sha256()
    for dataset in (splits.train, splits.eval):
        indices = None
        if isinstance(dataset, Subset):
            indices, dataset = dataset.indices, dataset.dataset
            digest.update(torch.tensor(indices).numpy().tobytes())
        if isinstance(dataset, ImageTensors):
            stride = max(1, len(dataset) // 256)  # every stride-th image: fast, yet sensitive
            digest.update(dataset.labels.numpy().tobytes())
            digest.update(dataset.images[::stride].contiguous().numpy().tobytes())
        elif isinstance(dataset, imagefolder.ImageFolder):
            digest.update(repr(dataset.samples).encode())
        elif len(dataset):  # type: ignore[arg-type]
            # Another map-style dataset (a data.factory's): its first, middle and last samples.
            for index in sorted({0, len(dataset) // 2, len(dataset) - 1}):  # type: ignore[arg-type]
                image, label = dataset[index]
                as_bytes = image.detach().cpu().contiguous().view(torch.uint8)  # any dtype
                digest.update(as_bytes.numpy().tobytes() + str(int(label)).encode())
        digest.update(str(len(dataset)).encode())  # type: ignore[arg-type]
    return digest.hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# Augmentation and sampling

_MASK64 = (1 << 64) - 1


def _mix64(*values: int) -> int:
    """A well-mixed 64-bit hash of integers (splitmix64 finaliser), cheap in pure Python."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h


class Augmented(Dataset):
    """Training view of a dataset, indexed by (epoch, index) pairs from `EpochSampler`.

    The crop offsets and the flip are drawn from a hash of (seed, epoch, index), so they do not
    depend on which rank or worker loads the sample, nor on where a resumed run starts.
    """

    def __init__(self, base: Dataset, seed: int, padding: int, enabled: bool) -> None:
        self.base = base
        self.seed = seed
        self.padding = padding
        self.enabled = enabled

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
        """(image, label, index): the index lets the trainer account for every sample seen."""
        epoch, index = key
        if not self.enabled:
            image, label = self.base[index]
            return image, label, index
        h = _mix64(self.seed, epoch, index)
        folder = folder_of(self.base)
        if folder is not None:  # its own training crop and flip
            return (*folder.augmented_item(folder_index(self.base, index), h), index)
        image, label = self.base[index]
        if self.padding:
            span = 2 * self.padding + 1
            top, left = h % span, (h >> 16) % span
            height, width = image.shape[-2:]
            padded = torch.nn.functional.pad(image, [self.padding] * 4)
            image = padded[..., top : top + height, left : left + width]
        if (h >> 32) & 1:
            image = image.flip(-1)
        return image, label, index


class EpochSampler(DistributedSampler):
    """DistributedSampler's seeded order and sharding, yielding (epoch, index) pairs, resumable
    at any global position of the epoch and with any world size.

    The epoch's order is DistributedSampler's permutation, seeded by (seed, epoch), the same on
    every rank. Ranks take interleaved strides of it, so after every rank has consumed c
    samples the epoch has consumed exactly the first `world_size * c` entries of the order,
    whatever the world size. `set_epoch(epoch, consumed)` hands each rank its stride of the
    rest: a resumed run (with the same or another world size) sees every remaining sample of
    the epoch once and none it already trained on. Every rank gets the same number of samples
    (the tail that does not divide evenly is dropped, as with drop_last): unequal counts would
    leave one rank waiting in a gradient all-reduce the others never join.
    """

    def __init__(self, dataset: Dataset, info: DistInfo, seed: int) -> None:
        super().__init__(
            dataset,
            num_replicas=info.world_size,
            rank=info.rank,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        self.consumed = 0

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Start `epoch` after the first `consumed` samples of its order (summed over ranks)."""
        if not 0 <= consumed <= len(self.dataset):  # type: ignore[arg-type]
            raise ValueError(f"consumed={consumed} is outside an epoch of {len(self.dataset)}")  # type: ignore[arg-type]
        super().set_epoch(epoch)
        self.consumed = consumed

    def order(self) -> list[int]:
        """This epoch's permutation of the dataset (DistributedSampler's, shuffle=True)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        start = self.consumed + self.rank
        stop = self.consumed + len(self) * self.num_replicas
        return iter(
            [(self.epoch, index) for index in self.order()[start : stop : self.num_replicas]]
        )

    def __len__(self) -> int:
        return (len(self.dataset) - self.consumed) // self.num_replicas  # type: ignore[arg-type]


class ShardSampler(Sampler[int]):
    """Every `world_size`-th index starting at `rank`: disjoint, covering, no padding.

    For evaluation: shards differ in length by at most one, which is fine because evaluation
    runs no collective per batch, only one all-reduce of (loss sum, correct, count) at the end.
    """

    def __init__(self, num_samples: int, info: DistInfo) -> None:
        self.indices = range(info.rank, num_samples, info.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _init_worker(worker_id: int) -> None:
    # A loader worker that dies of a stop signal makes the DataLoader raise in the training
    # process at once ("worker ... killed by signal"), before that process can checkpoint at
    # the next step boundary. So loader workers ignore every stop signal, however they come:
    # to their process group (torchrun, a terminal's Ctrl-C: hence a group of their own) or
    # to each process (slurmstepd, the kubelet). They end when the DataLoader shuts them down,
    # or within seconds of the training process's death (the DataLoader's watchdog).
    os.setpgid(0, 0)
    for sig in exitcodes.LOADER_IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # torch seeds each worker with base_seed + worker_id; give Python and NumPy (used by
    # user-added transforms) seeds derived from it as well.
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    np.random.seed(worker_seed)


def _loader_options(cfg: DataConfig, info: DistInfo, seed: int) -> dict[str, Any]:
    options: dict[str, Any] = {
        "num_workers": cfg.num_workers,
        "pin_memory": info.device.type == "cuda",
        "worker_init_fn": _init_worker,
        "generator": torch.Generator().manual_seed(seed + info.rank),
    }
    if cfg.num_workers > 0:
        options["persistent_workers"] = True
        options["prefetch_factor"] = cfg.prefetch_factor
    return options


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64_many(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """`_mix64(seed, epoch, index)` for an array of indices (uint64 arithmetic wraps)."""
    h = np.full(indices.shape, 0x9E3779B97F4A7C15, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for value in (
            np.uint64(seed & _MASK64),
            np.uint64(epoch & _MASK64),
            indices.astype(np.uint64),
        ):
            h = (h ^ value) * _M1
            h = (h ^ (h >> np.uint64(27))) * _M2
            h ^= h >> np.uint64(31)
    return h


def augment_batch(images: torch.Tensor, hashes: np.ndarray, padding: int) -> torch.Tensor:
    """`Augmented`'s crop and flip for a whole batch at once, on the images' device.

    One gather does both: output pixel (y, x) of a sample reads padded pixel
    (top + y, left + x), or (top + y, left + W - 1 - x) when the sample is flipped. The same
    hash bits pick the same offsets and flips as the per-sample path: bit-identical results.
    """
    device = images.device
    n, channels, height, width = images.shape
    span = np.uint64(2 * padding + 1)
    top = torch.from_numpy((hashes % span).astype(np.int64)).to(device, non_blocking=True)
    left = torch.from_numpy(((hashes >> np.uint64(16)) % span).astype(np.int64))
    flip = torch.from_numpy(((hashes >> np.uint64(32)) & np.uint64(1)).astype(bool))
    left, flip = left.to(device, non_blocking=True), flip.to(device, non_blocking=True)
    padded = torch.nn.functional.pad(images, [padding] * 4) if padding else images
    padded_width = width + 2 * padding
    ys = torch.arange(height, device=device)
    xs = torch.arange(width, device=device)
    xs = torch.where(flip[:, None], width - 1 - xs, xs)  # (n, W)
    flat = (
        (top[:, None, None] + ys[None, :, None]) * padded_width
        + left[:, None, None]
        + xs[:, None, :]
    )
    index = flat.view(n, 1, height * width).expand(n, channels, height * width)
    out = padded.reshape(n, channels, -1).gather(2, index)
    return out.view(n, channels, height, width)


class DeviceLoader:
    """Training batches from a dataset held on the device as one uint8 tensor.

    The same sampler as the DataLoader path (order, shards, resume position) and the same
    augmentation, batched: per step one index gather, one pad, one crop gather and one flip on
    the device instead of a Python call per sample, and no worker processes. Yields
    `(images, labels, indices)` like the DataLoader (indices on the CPU, for the ledger).
    """

    def __init__(
        self,
        base: ImageTensors,
        sampler: EpochSampler,
        cfg: DataConfig,
        seed: int,
        device: torch.device,
    ) -> None:
        self.images = base.images.to(device)
        self.labels = base.labels.to(device)
        self.sampler = sampler
        self.batch_size = cfg.batch_size
        self.seed = seed
        self.padding = cfg.crop_padding
        self.augment = cfg.augment
        self.device = device

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        epoch = self.sampler.epoch
        indices = np.fromiter((index for _, index in self.sampler), dtype=np.int64)
        hashes = mix64_many(self.seed, epoch, indices) if self.augment else None
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = torch.from_numpy(indices[start : start + self.batch_size])
            on_device = batch.to(self.device, non_blocking=True)
            images = self.images.index_select(0, on_device)
            if hashes is not None:
                images = augment_batch(
                    images, hashes[start : start + self.batch_size], self.padding
                )
            yield images, self.labels.index_select(0, on_device), batch


class Encoded(Dataset):
    """An image folder (or a Subset of one) read but not decoded, for data.decode=device:
    item `key` (an (epoch, index) pair from EpochSampler, or an index) is (file bytes, path,
    label, index). `DecodingLoader` decodes and transforms the batches."""

    def __init__(self, base: Dataset) -> None:
        folder = folder_of(base)
        assert folder is not None, "data.decode=device for a dataset that is no image folder"
        self.base, self.folder = base, folder

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, str, int, int]:
        index = key[1] if isinstance(key, tuple) else key
        return (*self.folder.encoded_item(folder_index(self.base, index)), index)


def jpeg_share(dataset: Dataset) -> float:
    """The share of an image folder's files named .jpg or .jpeg (1.0 for other datasets)."""
    folder = folder_of(dataset)
    if folder is None or not folder.samples:
        return 1.0
    jpegs = sum(path.lower().endswith((".jpg", ".jpeg")) for path, _ in folder.samples)
    return jpegs / len(folder.samples)


def folder_of(dataset: Dataset) -> imagefolder.ImageFolder | None:
    """The ImageFolder a dataset is, or is a Subset of; else None."""
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    return base if isinstance(base, imagefolder.ImageFolder) else None


def folder_index(dataset: Dataset, index: int) -> int:
    """Sample `index` of `dataset` (a folder or a Subset of one) as an index into the folder."""
    return dataset.indices[index] if isinstance(dataset, Subset) else index


def _collate_encoded(
    batch: list[tuple[torch.Tensor, str, int, int]],
) -> tuple[torch.Tensor, torch.Tensor, list[str], torch.Tensor, torch.Tensor]:
    """The files' bytes end to end in one tensor, with each file's size: one shared-memory
    block per batch to send from the worker (one per file would use a descriptor each)."""
    encoded, paths, labels, indices = zip(*batch, strict=True)
    sizes = torch.tensor([len(data) for data in encoded])
    return torch.cat(encoded), sizes, list(paths), torch.tensor(labels), torch.tensor(indices)


class DecodingLoader:
    """A DataLoader of `Encoded` items whose batches are decoded and transformed on the device
    (ImageFolder.decode_batch). Yields `(images, labels, indices)` for training, the crops and
    flips drawn from the same (seed, epoch, index) hashes as `Augmented`'s, or
    `(images, labels)` for evaluation, like the DataLoaders they stand in for."""

    def __init__(
        self, loader: DataLoader, seed: int, augment: bool, device: torch.device, train: bool
    ) -> None:
        self.loader = loader
        self.folder: imagefolder.ImageFolder = loader.dataset.folder  # type: ignore[attr-defined]
        self.seed, self.augment, self.device, self.train = seed, augment, device, train
        self.sampler = loader.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        epoch = getattr(self.sampler, "epoch", 0)  # fixed while an iterator runs (set_epoch)
        for flat, sizes, paths, labels, indices in self.loader:
            encoded = torch.split(flat, sizes.tolist())
            keys = None
            if self.train and self.augment:
                keys = [_mix64(self.seed, epoch, index) for index in indices.tolist()]
            images, labels = self.folder.decode_batch(encoded, paths, labels, keys, self.device)
            yield (images, labels, indices) if self.train else (images, labels)


def in_memory(dataset: Dataset) -> ImageTensors | None:
    """The dataset as one ImageTensors (a Subset materialised), or None if it is not in memory."""
    if isinstance(dataset, ImageTensors):
        return dataset
    if isinstance(dataset, Subset) and isinstance(dataset.dataset, ImageTensors):
        indices = torch.as_tensor(dataset.indices, dtype=torch.long)
        return ImageTensors(dataset.dataset.images[indices], dataset.dataset.labels[indices])
    return None


def in_memory_numel(dataset: Dataset) -> int | None:
    """Elements of the dataset's images when it is held in memory (ImageTensors, or a Subset of
    one), without copying it; None for a dataset read from files."""
    if isinstance(dataset, ImageTensors):
        return dataset.images.numel()
    if isinstance(dataset, Subset) and isinstance(dataset.dataset, ImageTensors):
        images = dataset.dataset.images
        return len(dataset.indices) * images[0].numel() if len(images) else 0
    return None


def build_train_loader(
    splits: DataSplits,
    cfg: DataConfig,
    info: DistInfo,
    seed: int,
    loader: str | None = None,
    decode: str = "workers",
) -> DataLoader | DeviceLoader | DecodingLoader:
    """The training loader: `DeviceLoader` or a DataLoader, as `loader` (device or dataloader)
    says; by default as data.loader resolves here (auto.loader). An image folder's DataLoader
    decodes in its workers, or with `decode="device"` (auto.decode) in a `DecodingLoader`."""
    dataset = Augmented(splits.train, seed, cfg.crop_padding, cfg.augment)
    sampler = EpochSampler(dataset, info, seed)
    if len(sampler) < cfg.batch_size:
        raise ConfigError(
            f"data.batch_size={cfg.batch_size} exceeds a rank's shard: each of the "
            f"{info.world_size} ranks gets {len(sampler)} of the {len(dataset)} training "
            "samples; lower data.batch_size (or use fewer ranks)"
        )
    if loader is None:
        loader = auto.loader(cfg.loader, cfg.source, in_memory_numel(splits.train), info.device)
    if loader == "device":
        base = in_memory(splits.train)
        assert base is not None, "auto.loader chose the device path for a dataset read from files"
        return DeviceLoader(base, sampler, cfg, seed, info.device)
    options = {"batch_size": cfg.batch_size, "sampler": sampler, "drop_last": True}
    options |= _loader_options(cfg, info, seed)
    if decode == "device":  # the decoders read pageable memory: nothing to pin
        options["pin_memory"] = False
        encoded = DataLoader(Encoded(splits.train), collate_fn=_collate_encoded, **options)
        return DecodingLoader(encoded, seed, cfg.augment, info.device, train=True)
    return DataLoader(dataset, **options)


def build_eval_loader(
    splits: DataSplits, cfg: DataConfig, info: DistInfo, seed: int, decode: str = "workers"
) -> DataLoader | DecodingLoader:
    """The evaluation loader: every sample once over all ranks (ShardSampler), decoded as
    `decode` says (see build_train_loader)."""
    sampler = ShardSampler(len(splits.eval), info)  # type: ignore[arg-type]
    options = {"batch_size": cfg.eval_batch_size, "sampler": sampler}
    options |= _loader_options(cfg, info, seed)
    if decode == "device":
        options["pin_memory"] = False
        encoded = DataLoader(Encoded(splits.eval), collate_fn=_collate_encoded, **options)
        return DecodingLoader(encoded, seed, False, info.device, train=False)
    return DataLoader(splits.eval, **options)


def set_epoch(
    loader: DataLoader | DeviceLoader | DecodingLoader, epoch: int, consumed: int = 0
) -> None:
    """The one place that advances the training sampler: call once at the top of every epoch.

    `consumed`: samples of the epoch already trained on, summed over ranks (0 for a new epoch).
    """
    sampler = loader.sampler
    assert isinstance(sampler, EpochSampler)
    sampler.set_epoch(epoch, consumed)


def _torch_loader(loader: DataLoader | DeviceLoader | DecodingLoader) -> Any:
    """The torch DataLoader that holds a loader's workers (a DeviceLoader has none)."""
    return loader.loader if isinstance(loader, DecodingLoader) else loader


def worker_pids(loader: DataLoader | DeviceLoader | DecodingLoader) -> list[int]:
    """The process ids of a loader's running workers (none before its first iterator, none
    for the device loader)."""
    iterator = getattr(_torch_loader(loader), "_iterator", None)
    workers = getattr(iterator, "_workers", None) or []
    return [w.pid for w in workers if w.pid is not None and w.is_alive()]


def close_loader(loader: DataLoader | DeviceLoader | DecodingLoader) -> None:
    """Stop a loader's persistent workers now. Otherwise they stop when the loader is garbage
    collected, and an interpreter that exits first waits for them forever (multiprocessing
    joins its children at exit, while the workers wait for their parent to tell them)."""
    torch_loader = _torch_loader(loader)
    iterator = getattr(torch_loader, "_iterator", None)
    if iterator is not None:
        iterator._shutdown_workers()
        torch_loader._iterator = None


class Preprocess:
    """Move a batch to the device; normalise it there when it is uint8 (float batches of a
    data.factory are used as they are)."""

    def __init__(self, splits: DataSplits, device: torch.device, channels_last: bool) -> None:
        scale = 255.0
        self.mean = torch.tensor(splits.mean, device=device).view(1, -1, 1, 1) * scale
        self.inv_std = 1.0 / (torch.tensor(splits.std, device=device).view(1, -1, 1, 1) * scale)
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # non_blocking: with pinned memory the copy overlaps with compute already queued.
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        # Change the layout while the batch is uint8 (a quarter of the bytes to move), then
        # normalise in place: one float batch allocated instead of three. On a CPU a 224-px
        # batch of 64 is 38 MB of float32, and each fresh allocation of that size is new
        # pages to fault in: the out-of-place version took 2-3x as long as this one.
        images = images.contiguous(memory_format=self.memory_format)
        if images.dtype != torch.uint8:  # a data.factory's float images: used as they are
            return images.float(), labels
        return images.float().sub_(self.mean).mul_(self.inv_std), labels
