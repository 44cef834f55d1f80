"""The data interface the training loop calls: datasets, loaders, epochs.

`build_datasets` loads a built-in source (inputs.sources) or a data.factory's datasets
(inputs.user) and checks them; `build_train_loader` and `build_eval_loader` pick the loader
(inputs.loaders), its sampler (inputs.sampling) and the augmentation (inputs.augment);
`set_epoch` advances the training sampler. Samples travel as uint8 tensors (4x less to copy
than float) and are normalised on the device in `Preprocess`.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import torch
from torch.utils.data import DataLoader, Subset

import distributed
from config import IGNORED, AugConfig, ConfigError, DataConfig
from distributed import DistInfo
from inputs import imagefolder
from inputs.augment import Augmented, policy
from inputs.failures import NamedSamples
from inputs.loaders import (
    DecodingLoader,
    DeviceLoader,
    Encoded,
    Preprocess,
    StopSafeLoader,
    close_loader,
    collate_encoded,
    loader_options,
    worker_pids,
)
from inputs.mixing import BatchAugment
from inputs.sampling import EpochSampler, ShardSampler
from inputs.sources import (
    BUILDERS,
    DEBIAN_FASHION_MNIST,
    STATS,
    DatasetNotFoundError,
    DataSplits,
    ImageTensors,
    folder_of,
    in_memory,
    in_memory_numel,
    jpeg_share,
    make_synthetic,
)
from inputs.user import (
    SPLITS,
    BadLabel,
    UserData,
    check_labels,
    check_normalisation,
    known_labels,
    user_data,
)

# What other modules use from here: the interface, and the types and helpers it hands out.
__all__ = [
    "DEBIAN_FASHION_MNIST",
    "STATS",
    "Augmented",
    "BadLabel",
    "BatchAugment",
    "DataSplits",
    "DatasetNotFoundError",
    "DecodingLoader",
    "DeviceLoader",
    "EpochSampler",
    "ImageTensors",
    "Preprocess",
    "ShardSampler",
    "UserData",
    "build_datasets",
    "build_eval_loader",
    "build_train_loader",
    "close_loader",
    "fingerprint",
    "folder_of",
    "in_memory_numel",
    "jpeg_share",
    "make_synthetic",
    "set_epoch",
    "worker_pids",
]


def build_datasets(cfg: DataConfig, seed: int, info: DistInfo) -> DataSplits:
    """Load (and if allowed download) the dataset; one process per node touches the disk first.

    Local rank 0 prepares the files while the others wait (up to data.prepare_timeout_s, with
    progress logged), then every rank loads. The wait ends for every rank also when
    preparation fails, so a missing dataset fails fast everywhere instead of hanging the others.
    """
    builder = user_data if cfg.factory else BUILDERS[cfg.dataset]
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
    if not cfg.factory:  # a factory's are checked in user_data, and served by SampleChecked
        for split in SPLITS:
            labels = known_labels(getattr(splits, split))
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
                value = label.tolist() if isinstance(label, torch.Tensor) else int(label)
                digest.update(as_bytes.numpy().tobytes() + str(value).encode())
        digest.update(str(len(dataset)).encode())  # type: ignore[arg-type]
    return digest.hexdigest()[:12]


def build_train_loader(
    splits: DataSplits,
    cfg: DataConfig,
    info: DistInfo,
    seed: int,
    loader: str,
    decode: str = "workers",
    aug: AugConfig | None = None,
) -> DataLoader | DeviceLoader | DecodingLoader:
    """The training loader: `DeviceLoader` or a DataLoader, as `loader` says (device or
    dataloader: data.loader as auto.loader resolved it, in the run's auto.Auto record). An image
    folder's DataLoader decodes in its workers, or with `decode="device"` (auto.decode) in a
    `DecodingLoader`. aug's policy runs in the DataLoader's workers only, and its repeated
    copies not in a DecodingLoader (auto.loader and auto.decode pick the paths)."""
    aug = aug or AugConfig()
    if splits.augmented:  # the dataset's own augmentation, not ours on top (inputs.user)
        cfg = replace(cfg, augment=False)
    transform = policy(aug.auto_augment, aug.ra_magnitude, aug.augmix_severity)
    if transform is not None:
        _check_policy_input(splits, f"aug.auto_augment={aug.auto_augment}", cfg.source)
    augmented = Augmented(splits.train, seed, cfg.crop_padding, cfg.augment, transform)
    dataset = NamedSamples(augmented, splits.train, cfg.source)  # a failure names its sample
    sampler = EpochSampler(dataset, info, seed, aug.repeated_augment)
    if len(sampler) < cfg.batch_size:
        raise ConfigError(
            f"data.batch_size={cfg.batch_size} exceeds a rank's shard: each of the "
            f"{info.world_size} ranks gets {len(sampler)} of the {len(dataset)} training "
            "samples; lower data.batch_size (or use fewer ranks)"
        )
    assert loader != "device" or not aug.worker_only("loader"), "auto.loader picks workers"
    assert decode != "device" or not aug.worker_only("decode"), "auto.decode picks workers"
    if loader == "device":
        base = in_memory(splits.train)
        assert base is not None, "auto.loader chose the device path for a dataset read from files"
        _check_mixable(base, aug, cfg.source)
        return DeviceLoader(base, sampler, cfg, seed, info.device)
    options = {"batch_size": cfg.batch_size, "sampler": sampler, "drop_last": True}
    options |= loader_options(cfg, info, seed)
    if decode == "device":  # the decoders read pageable memory: nothing to pin
        options["pin_memory"] = False
        files = NamedSamples(Encoded(splits.train), splits.train, cfg.source)
        encoded = StopSafeLoader(files, collate_fn=collate_encoded, **options)
        return DecodingLoader(encoded, seed, cfg.augment, info.device, train=True)
    return StopSafeLoader(dataset, **options)


def _check_mixable(base: ImageTensors, aug: AugConfig, source: str) -> None:
    """Mixing on the device loader's batches needs every sample labelled: a DataLoader's batch
    leaves IGNORED samples out on the CPU before mixing (BatchAugment.counted_only), while the
    device path would need a sync with the device at every step to do the same."""
    ignored = int((base.labels == IGNORED).sum()) if aug.mixing else 0
    if ignored:
        raise ConfigError(
            f"{source} labels {ignored} training samples {IGNORED} (left out), and "
            "aug.mixup_alpha / aug.cutmix_alpha mix every sample of the device loader's "
            "batches: use --data.loader=dataloader, which leaves them out before mixing"
        )


def _check_policy_input(splits: DataSplits, key: str, source: str) -> None:
    """Refuse a policy where it would not do what it says: on a dataset that augments its own
    samples (as data.augment leaves them alone), or on float images (torchvision's policies
    read a float image as [0, 1] intensities; a factory's may be normalised already)."""
    if splits.augmented:
        raise ConfigError(
            f"{key} cannot be combined with {source}, whose training samples come augmented "
            "(augmented=True): leave aug.auto_augment at none, or let the dataset augment alone"
        )
    if len(splits.train) and splits.train[0][0].is_floating_point():  # type: ignore[arg-type]
        raise ConfigError(
            f"{key} needs uint8 images, and {source} returns float images: return uint8 images "
            "(normalised on the device with data.mean and data.std), or leave aug.auto_augment "
            "at none"
        )


def build_eval_loader(
    splits: DataSplits, cfg: DataConfig, info: DistInfo, seed: int, decode: str = "workers"
) -> DataLoader | DecodingLoader:
    """The evaluation loader: every sample once over all ranks (ShardSampler), decoded as
    `decode` says (see build_train_loader)."""
    sampler = ShardSampler(len(splits.eval), info)  # type: ignore[arg-type]
    options = {"batch_size": cfg.eval_batch_size, "sampler": sampler}
    options |= loader_options(cfg, info, seed)
    if decode == "device":
        options["pin_memory"] = False
        encoded = StopSafeLoader(Encoded(splits.eval), collate_fn=collate_encoded, **options)
        return DecodingLoader(encoded, seed, False, info.device, train=False)
    return StopSafeLoader(splits.eval, **options)


def set_epoch(
    loader: DataLoader | DeviceLoader | DecodingLoader, epoch: int, consumed: int = 0
) -> None:
    """The one place that advances the training sampler: call once at the top of every epoch.

    `consumed`: samples of the epoch already trained on, summed over ranks (0 for a new epoch).
    """
    sampler = loader.sampler
    assert isinstance(sampler, EpochSampler)
    sampler.set_epoch(epoch, consumed)
