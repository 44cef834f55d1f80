from __future__ import annotations

import dataclasses
import pickle
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import needs_fashion_mnist
from PIL import Image
from torch.utils.data import Subset
from torchvision import datasets

import auto
import data
from config import ConfigError, DataConfig
from distributed import DistInfo
from inputs import sources

CPU = torch.device("cpu")


def info(rank: int = 0, world_size: int = 1) -> DistInfo:
    return DistInfo(rank, rank, world_size, CPU)


def train_loader(splits: data.DataSplits, cfg: DataConfig, info: DistInfo, seed: int) -> Any:
    """data.build_train_loader with data.loader resolved as the run resolves it (auto.loader)."""
    kind = auto.loader(cfg.loader, cfg.source, data.in_memory_numel(splits.train), info.device)
    return data.build_train_loader(splits, cfg, info, seed, kind)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_train_shards_are_disjoint_equal_and_cover_all_but_the_remainder(world_size) -> None:
    dataset = data.make_synthetic(1001, (1, 8, 8), 10, seed=0)
    shards = []
    for rank in range(world_size):
        sampler = data.EpochSampler(dataset, info(rank, world_size), seed=3)
        sampler.set_epoch(5)
        shards.append([index for epoch, index in sampler])
        assert all(epoch == 5 for epoch, _ in sampler)
    seen = [i for shard in shards for i in shard]
    assert len({len(s) for s in shards}) == 1  # equal lengths: no rank waits in a collective
    assert len(seen) == len(set(seen)) == 1001 - 1001 % world_size
    assert set(seen) <= set(range(1001))


def test_epochs_reshuffle_and_skip_resumes_the_same_order() -> None:
    dataset = data.make_synthetic(64, (1, 8, 8), 10, seed=0)
    sampler = data.EpochSampler(dataset, info(1, 2), seed=0)
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != epoch0
    sampler.set_epoch(0, consumed=20)  # 10 samples on each of the 2 ranks
    assert list(sampler) == epoch0[10:] and len(sampler) == len(epoch0) - 10


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2), (2, 1), (1, 4)])
def test_resuming_with_another_world_size_sees_each_remaining_sample_once(before, after) -> None:
    """Consume part of an epoch on `before` ranks, finish it on `after` ranks: no sample twice,
    none of the epoch missed beyond the tail dropped to keep ranks equal. The reference is
    DistributedSampler's own permutation, rebuilt here with torch.randperm."""
    n, seed, epoch, per_rank_done = 101, 7, 3, 9
    dataset = data.make_synthetic(n, (1, 4, 4), 10, seed=0)
    seen = []
    for rank in range(before):
        sampler = data.EpochSampler(dataset, info(rank, before), seed=seed)
        sampler.set_epoch(epoch)
        seen += [index for _, index in list(sampler)[:per_rank_done]]
    consumed = before * per_rank_done
    for rank in range(after):
        sampler = data.EpochSampler(dataset, info(rank, after), seed=seed)
        sampler.set_epoch(epoch, consumed=consumed)
        seen += [index for e, index in sampler if e == epoch]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    expected = order[: consumed + (n - consumed) // after * after]
    assert sorted(seen) == sorted(expected) and len(set(seen)) == len(seen)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_shards_cover_every_sample_exactly_once(world_size) -> None:
    shards = [list(data.ShardSampler(1001, info(r, world_size))) for r in range(world_size)]
    seen = sorted(i for shard in shards for i in shard)
    assert seen == list(range(1001))


def test_augmentation_depends_only_on_seed_epoch_and_index() -> None:
    base = data.make_synthetic(32, (1, 28, 28), 10, seed=0)
    aug = data.Augmented(base, seed=1, padding=2, enabled=True)
    again = data.Augmented(base, seed=1, padding=2, enabled=True)
    assert torch.equal(aug[(3, 7)][0], again[(3, 7)][0])
    outputs = {aug[(epoch, 7)][0].numpy().tobytes() for epoch in range(20)}
    assert len(outputs) > 5  # crops and flips vary across epochs
    image, label, index = aug[(0, 7)]
    assert (
        image.shape == (1, 28, 28)
        and image.dtype == torch.uint8
        and label == base[7][1]
        and index == 7
    )


def test_crop_is_a_shifted_window_of_the_padded_image() -> None:
    base = data.make_synthetic(4, (1, 12, 12), 10, seed=0)
    image = base[2][0]
    padded = torch.nn.functional.pad(image, (2, 2, 2, 2))
    windows = {
        padded[:, t : t + 12, s : s + 12].numpy().tobytes() for t in range(5) for s in range(5)
    }
    windows |= {
        padded[:, t : t + 12, s : s + 12].flip(-1).numpy().tobytes()
        for t in range(5)
        for s in range(5)
    }
    aug = data.Augmented(base, seed=0, padding=2, enabled=True)
    for epoch in range(10):
        assert aug[(epoch, 2)][0].numpy().tobytes() in windows


def test_two_ranks_see_the_same_samples_as_one_rank_with_twice_the_batch() -> None:
    splits = data.DataSplits(
        data.make_synthetic(256, (1, 8, 8), 10, seed=0),
        data.make_synthetic(8, (1, 8, 8), 10, seed=1),
        (1, 8, 8),
        10,
        (0.5,),
        (0.25,),
    )
    cfg = DataConfig(batch_size=8, num_workers=0)
    one = train_loader(splits, DataConfig(batch_size=16, num_workers=0), info(), 0)
    data.set_epoch(one, 2)
    images_one, labels_one, _ = next(iter(one))
    parts = []
    for rank in range(2):
        loader = train_loader(splits, cfg, info(rank, 2), 0)
        data.set_epoch(loader, 2)
        parts.append(next(iter(loader)))
    key = lambda imgs, lbls: sorted(  # noqa: E731
        (img.numpy().tobytes(), int(lbl)) for img, lbl in zip(imgs, lbls, strict=True)
    )
    merged_images = torch.cat([p[0] for p in parts])
    merged_labels = torch.cat([p[1] for p in parts])
    assert key(merged_images, merged_labels) == key(images_one, labels_one)


def test_loader_with_workers_matches_loader_without(tmp_path) -> None:
    splits = data.DataSplits(
        data.make_synthetic(128, (1, 8, 8), 10, seed=0),
        data.make_synthetic(8, (1, 8, 8), 10, seed=1),
        (1, 8, 8),
        10,
        (0.5,),
        (0.25,),
    )
    batches = []
    for workers in (0, 2):
        loader = train_loader(
            splits, DataConfig(batch_size=16, num_workers=workers, loader="dataloader"), info(), 0
        )
        data.set_epoch(loader, 1)
        batches.append([b[0] for b in loader])
    assert all(torch.equal(a, b) for a, b in zip(*batches, strict=True))


def test_subset_takes_the_first_n_of_a_seeded_shuffle() -> None:
    cfg = DataConfig(dataset="synthetic", synthetic_train_size=100, subset=10)
    a = data.build_datasets(cfg, seed=4, info=info())
    b = data.build_datasets(cfg, seed=4, info=info())
    c = data.build_datasets(cfg, seed=5, info=info())
    assert len(a.train) == 10
    assert a.train.indices == b.train.indices != c.train.indices
    expected = torch.randperm(100, generator=torch.Generator().manual_seed(4))[:10].tolist()
    assert a.train.indices == expected


def test_subset_larger_than_dataset_is_rejected() -> None:
    cfg = DataConfig(dataset="synthetic", synthetic_train_size=100, subset=101)
    with pytest.raises(ValueError, match="data.subset=101 exceeds the 100"):
        data.build_datasets(cfg, seed=0, info=info())


def test_synthetic_is_deterministic_and_shaped() -> None:
    cfg = DataConfig(dataset="synthetic", synthetic_shape=(3, 32, 32), synthetic_num_classes=4)
    a = data.build_datasets(cfg, seed=0, info=info())
    b = data.build_datasets(cfg, seed=1, info=info())
    assert torch.equal(a.train.images, b.train.images)  # independent of the training seed
    assert a.train.images.shape[1:] == (3, 32, 32) and a.num_classes == 4
    assert set(a.train.labels.tolist()) == {0, 1, 2, 3}


def test_missing_fashion_mnist_without_download_names_path_and_fix(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST", tmp_path / "absent")
    cfg = DataConfig(root=str(tmp_path / "data"), download=False)
    with pytest.raises(data.DatasetNotFoundError) as err:
        data.build_datasets(cfg, seed=0, info=info())
    message = str(err.value)
    assert str(tmp_path / "data") in message and "dataset-fashion-mnist" in message
    assert "--data.download=true" in message


@needs_fashion_mnist
def test_fashion_mnist_from_debian_package(tmp_path) -> None:
    cfg = DataConfig(root=str(tmp_path), download=False)
    splits = data.build_datasets(cfg, seed=0, info=info())
    assert len(splits.train) == 60000 and len(splits.eval) == 10000
    assert splits.train.images.shape[1:] == (1, 28, 28)
    assert sorted(set(splits.eval.labels.tolist())) == list(range(10))
    assert not list((tmp_path / "FashionMNIST" / "raw").glob(".*tmp"))


def _write_cifar_batch(path: Path, images: np.ndarray, labels: list[int]) -> None:
    # CIFAR-10's python format: a pickled dict, images as N x 3072 uint8 rows in CHW order.
    with path.open("wb") as f:
        pickle.dump(
            {
                "data": images.reshape(len(images), -1),
                "labels": labels,
                "batch_label": "x",
                "filenames": ["f"] * len(images),
            },
            f,
            protocol=2,
        )


def test_cifar10_reads_the_real_file_format(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 6, 3, 32, 32), dtype=np.uint8)
    for i in range(5):
        _write_cifar_batch(folder / f"data_batch_{i + 1}", images[i], [i, 1, 2, 3, 4, 5])
    _write_cifar_batch(folder / "test_batch", images[0], [9, 8, 7, 6, 5, 4])
    with (folder / "batches.meta").open("wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    # torchvision checks the official files' MD5s; these stand-ins only need to exist.
    monkeypatch.setattr(datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(datasets.cifar, "check_integrity", lambda path, md5=None: True)
    splits = data.build_datasets(
        DataConfig(dataset="cifar10", root=str(tmp_path), download=False), seed=0, info=info()
    )
    assert len(splits.train) == 30 and len(splits.eval) == 6 and splits.in_channels == 3
    image, label = splits.train[6]
    assert torch.equal(image, torch.from_numpy(images[1, 0])) and label == 1
    assert splits.eval[0][1] == 9


def test_cifar10_missing_names_the_folder(tmp_path) -> None:
    cfg = DataConfig(dataset="cifar10", root=str(tmp_path), download=False)
    with pytest.raises(data.DatasetNotFoundError, match="cifar-10-batches-py"):
        data.build_datasets(cfg, seed=0, info=info())


def test_imagefolder_resizes_and_keeps_classes(tmp_path) -> None:
    for split, count in (("train", 3), ("val", 2)):
        for cls in ("cat", "dog"):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (40 + i, 30), color=(i * 40, 100, 200)).save(folder / f"{i}.jpg")
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path), image_size=16)
    splits = data.build_datasets(cfg, seed=0, info=info())
    assert len(splits.train) == 6 and len(splits.eval) == 4 and splits.num_classes == 2
    image, label = splits.eval[3]
    assert image.shape == (3, 16, 16) and image.dtype == torch.uint8 and label == 1


def test_imagefolder_without_val_split_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(data.DatasetNotFoundError, match="val"):
        data.build_datasets(DataConfig(dataset="imagefolder", root=str(tmp_path)), 0, info())


def test_preprocess_normalises_on_device() -> None:
    splits = data.DataSplits(None, None, (1, 28, 28), 10, (0.5,), (0.25,))  # type: ignore[arg-type]
    images, labels = data.Preprocess(splits, CPU, channels_last=False)(
        torch.tensor([[[[0, 255]]]], dtype=torch.uint8), torch.tensor([3])
    )
    torch.testing.assert_close(images, torch.tensor([[[[-2.0, 2.0]]]]))
    assert labels.tolist() == [3]


@pytest.mark.parametrize(("augment", "padding"), [(True, 2), (True, 0), (False, 2)])
def test_device_path_yields_the_dataloader_batches_bit_for_bit(augment, padding) -> None:
    """The batched on-device gather, crop and flip against the per-sample DataLoader path:
    every batch of a resumed epoch on rank 1 of 2, from a data.subset (a Subset)."""
    base = data.make_synthetic(600, (3, 12, 12), 10, seed=0)
    train_set = Subset(base, list(range(0, 600, 2)))
    splits = data.DataSplits(train_set, base, (3, 12, 12), 10, (0.5,) * 3, (0.25,) * 3)
    batches = {}
    for loader_kind in ("dataloader", "device"):
        cfg = DataConfig(
            batch_size=16, num_workers=0, loader=loader_kind, augment=augment, crop_padding=padding
        )
        loader = train_loader(splits, cfg, info(1, 2), seed=11)
        assert isinstance(loader, data.DeviceLoader) == (loader_kind == "device")
        data.set_epoch(loader, 4, consumed=64)
        batches[loader_kind] = list(loader)
    assert len(batches["device"]) == len(batches["dataloader"]) == (300 - 64) // 2 // 16
    for ours, reference in zip(batches["device"], batches["dataloader"], strict=True):
        for a, b in zip(ours, reference, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_device_path_needs_an_in_memory_dataset(tmp_path) -> None:
    from config import ConfigError

    with pytest.raises(ConfigError, match="data.loader=device needs an in-memory dataset"):
        auto.loader("device", "imagefolder", None, CPU)


def user_factory(monkeypatch, made: Any) -> DataConfig:
    """A data.factory (in a module of its own) that returns `made`."""
    module = types.ModuleType("user_data_for_test")
    module.make = lambda root, **kwargs: made(root, **kwargs) if callable(made) else made  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "user_data_for_test", module)
    return DataConfig(factory="user_data_for_test:make", kwargs='{"n": 40}', num_workers=0)


def test_a_data_factory_gets_root_and_kwargs_and_feeds_the_sampler(monkeypatch) -> None:
    def make(root: str, n: int) -> dict:
        train = [(torch.full((2, 8, 8), i, dtype=torch.uint8), i % 3) for i in range(n)]
        return {"train": train, "eval": train[:5], "num_classes": 3, "input_shape": (2, 8, 8)}

    cfg = user_factory(monkeypatch, make)
    splits = data.build_datasets(cfg, 0, info())
    assert len(splits.train) == 40 and splits.input_shape == (2, 8, 8) and splits.num_classes == 3
    assert splits.mean == (0.5, 0.5) and splits.classes is None
    loader = train_loader(
        splits, dataclasses.replace(cfg, augment=False, batch_size=4), info(1, 2), 0
    )
    data.set_epoch(loader, 0)
    seen = [int(i) for _, _, indices in loader for i in indices]
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    assert seen == order[1::2]  # rank 1's stride of DistributedSampler's permutation


ONE_BY_8 = {
    "train": [(torch.zeros(1, 8, 8), 0)],
    "eval": [(torch.zeros(1, 8, 8), 1)],
    "num_classes": 2,
    "input_shape": (1, 8, 8),
}


@pytest.mark.parametrize(
    ("made", "message"),
    [
        ([1, 2], r"returned list: return a data.UserData"),
        ({"train": []}, r"returned a mapping with keys \['train'\]"),
        (
            {**ONE_BY_8, "train": []},
            "the train dataset is empty",
        ),
        (
            {
                "train": [(torch.zeros(1, 9, 8), 0)],
                "eval": [],
                "num_classes": 2,
                "input_shape": (1, 8, 8),
            },
            r"train\[0\]'s image is \(1, 9, 8\), not a tensor of \(1, 8, 8\)",
        ),
        (
            {
                "train": [(torch.zeros(1, 8, 8), 5)],
                "eval": [(torch.zeros(1, 8, 8), 0)],
                "num_classes": 2,
                "input_shape": (1, 8, 8),
            },
            r"train\[0\] has label 5: labels must be ints in \[0, 2\)",
        ),
        (
            {
                "train": [(torch.zeros(1, 8, 8), 0)],
                "eval": 7,
                "num_classes": 2,
                "input_shape": (1, 8, 8),
            },
            r"eval is a int, not a map-style dataset",
        ),
    ],
)
def test_a_data_factory_returning_the_wrong_thing_is_bad_input(monkeypatch, made, message) -> None:
    cfg = user_factory(monkeypatch, lambda root, n: made)
    with pytest.raises(ConfigError, match=rf"data.factory=user_data_for_test:make.*{message}"):
        data.build_datasets(cfg, 0, info())


def test_float_images_of_a_factory_are_used_as_they_are() -> None:
    splits = data.DataSplits(None, None, (1, 1, 2), 10, (0.5,), (0.25,))  # type: ignore[arg-type]
    images, _ = data.Preprocess(splits, CPU, channels_last=False)(
        torch.tensor([[[[0.25, -3.0]]]]), torch.tensor([3])
    )
    assert images.tolist() == [[[[0.25, -3.0]]]]


@pytest.mark.parametrize("channels_last", [False, True])
def test_preprocess_is_the_plain_formula_bit_for_bit_in_the_asked_layout(channels_last) -> None:
    splits = data.DataSplits(None, None, (3, 5, 7), 10, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3))  # type: ignore[arg-type]
    images = torch.randint(0, 256, (4, 3, 5, 7), dtype=torch.uint8)
    out, _ = data.Preprocess(splits, CPU, channels_last)(images, torch.zeros(4))
    mean = torch.tensor([0.4, 0.5, 0.6]).view(1, 3, 1, 1) * 255
    inv_std = 1 / (torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1) * 255)
    assert torch.equal(out, (images.float() - mean) * inv_std)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=layout)


def test_fingerprint_reads_factory_images_of_any_dtype() -> None:
    """A data.factory's float or bf16 images are hashed by their bytes, as uint8 ones are."""
    samples = [(torch.full((1, 2, 2), float(i), dtype=torch.bfloat16), i % 2) for i in range(4)]
    splits = data.DataSplits(samples, samples, (1, 2, 2), 2, (0.5,), (0.5,))  # type: ignore[arg-type]
    changed = [(image + 1, label) for image, label in samples]
    other = data.DataSplits(changed, samples, (1, 2, 2), 2, (0.5,), (0.5,))  # type: ignore[arg-type]
    assert data.fingerprint(splits) != data.fingerprint(other)


# ---------------------------------------------------------------------------------------------
# A data.factory's labels, normalisation, shape and kwargs, checked before training


def eight(label: Any, dtype: torch.dtype = torch.uint8) -> tuple[torch.Tensor, Any]:
    return torch.zeros(1, 8, 8, dtype=dtype), label


class Lazy(torch.utils.data.Dataset):
    """A dataset with no list of labels to read: each is seen only when its sample loads."""

    def __init__(self, labels: list[Any]) -> None:
        self.labels_of = labels

    def __len__(self) -> int:
        return len(self.labels_of)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]:
        return eight(self.labels_of[index])


@pytest.mark.parametrize(
    ("bad", "shown"),
    [(3, "3"), (-1, "-1"), (1.0, "1.0"), (torch.tensor([0, 1]), r"tensor\(\[0, 1\]\)")],
)
@pytest.mark.parametrize("holder", ["list", "targets", "ImageTensors"])
def test_a_bad_label_past_sample_0_is_bad_input_naming_its_index_and_value(
    monkeypatch, bad, shown, holder
) -> None:
    """Before: sample 0 alone was checked, and such a label failed at its step inside
    cross_entropy or the collate function, naming no sample."""
    labels: list[Any] = [0, 1, 2, 0, 1, bad, 2]
    if holder == "ImageTensors":
        if not isinstance(bad, int):
            pytest.skip("ImageTensors holds int64 labels only")
        train: Any = data.ImageTensors(
            torch.zeros(7, 1, 8, 8, dtype=torch.uint8), torch.tensor(labels)
        )
    elif holder == "targets":
        train = Lazy(labels)
        train.targets = labels  # type: ignore[attr-defined]
    else:
        train = [eight(label) for label in labels]
    made = {"train": train, "eval": [eight(0)], "num_classes": 3, "input_shape": (1, 8, 8)}
    cfg = user_factory(monkeypatch, lambda root, n: made)
    with pytest.raises(
        ConfigError,
        match=(
            rf"make: train\[5\] has label {shown}: labels must be "
            r"ints in \[0, 3\)"
        ),
    ):
        data.build_datasets(cfg, 0, info())


def test_labels_not_listed_are_checked_as_each_sample_loads(monkeypatch) -> None:
    made = {
        "train": Lazy([0, 1] * 4),
        "eval": Lazy([0, 1, 1, 0, 0, 1, 0, 3]),
        "num_classes": 2,
        "input_shape": (1, 8, 8),
    }
    cfg = user_factory(monkeypatch, lambda root, n: made)
    splits = data.build_datasets(cfg, 0, info())
    assert [label for _, label in (splits.eval[i] for i in range(7))] == [0, 1, 1, 0, 0, 1, 0]
    with pytest.raises(data.BadLabel, match=r"make: eval\[7\] has label 3"):
        splits.eval[7]
    loader = data.build_eval_loader(splits, dataclasses.replace(cfg, eval_batch_size=4), info(), 0)
    with pytest.raises(data.BadLabel, match=r"eval\[7\] has label 3"):  # through the loader
        list(loader)


def test_integer_labels_of_any_kind_and_the_ignore_label_are_accepted(monkeypatch, caplog) -> None:
    labels = [np.int64(1), torch.tensor(2), torch.tensor([0]), np.uint8(1), 2, -100]
    made = {
        "train": Lazy(labels),  # no list: each is converted as it loads
        "eval": [eight(label) for label in labels],  # a list: checked before training
        "num_classes": np.int64(3),  # NumPy's integers are counts too
        "input_shape": (np.int64(1), 8, 8),
    }
    cfg = user_factory(monkeypatch, lambda root, n: made)
    splits = data.build_datasets(cfg, 0, info())
    assert splits.num_classes == 3 and type(splits.num_classes) is int
    assert [splits.train[i][1] for i in range(6)] == [1, 2, 0, 1, 2, -100]
    images, batch = next(
        iter(data.build_eval_loader(splits, dataclasses.replace(cfg, eval_batch_size=6), info(), 0))
    )
    assert batch.tolist() == [1, 2, 0, 1, 2, -100] and batch.dtype == torch.int64
    assert "eval: 1 of 6 samples are labelled -100 (the ignore label)" in caplog.text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"mean": (128.0,), "std": (0.3,)},
            r"mean=128.0 is outside 0 <= mean <= 1: .*divide them by 255",
        ),
        ({"std": (64.0,)}, r"std=64.0 is outside 0 < std <= 1: .*0..255 units"),
        ({"std": (0.0,)}, r"std=0.0 is outside 0 < std <= 1"),
        ({"mean": (0.5, 0.5)}, r"mean=0.5,0.5 has 2 values; the data has 1 channels"),
        ({"std": (float("nan"),)}, r"std=nan holds a value that is not a finite number"),
    ],
)
def test_a_factory_mean_and_std_are_checked(monkeypatch, extra, message) -> None:
    """Before: 0..255 units were accepted, a wrong length failed with a traceback at the first
    batch, and std=0 trained on infinities reported as a divergence."""
    made = {"train": [eight(0)] * 4, "eval": [eight(1)], "num_classes": 2, "input_shape": (1, 8, 8)}
    cfg = user_factory(monkeypatch, lambda root, n: {**made, **extra})
    with pytest.raises(ConfigError, match=rf"data.factory=user_data_for_test:make: {message}"):
        data.build_datasets(cfg, 0, info())


def test_mean_and_std_for_float_images_are_refused_as_they_would_be_ignored(monkeypatch) -> None:
    made = {
        "train": [eight(0, torch.float32)] * 4,
        "eval": [eight(1, torch.float32)],
        "num_classes": 2,
        "input_shape": (1, 8, 8),
        "mean": (0.5,),
    }
    cfg = user_factory(monkeypatch, lambda root, n: made)
    with pytest.raises(
        ConfigError,
        match=(
            r"mean=\(0.5,\) is given for float images, which are "
            r"used as they are"
        ),
    ):
        data.build_datasets(cfg, 0, info())


def test_an_input_shape_in_hwc_order_is_refused_naming_it(monkeypatch) -> None:
    """Before: HWC images with a matching HWC input_shape trained as 16 channels of 16x1."""
    hwc = [(torch.zeros(16, 16, 1, dtype=torch.uint8), 0)] * 4
    made = {"train": hwc, "eval": hwc, "num_classes": 2, "input_shape": (16, 16, 1)}
    cfg = user_factory(monkeypatch, lambda root, n: made)
    with pytest.raises(
        ConfigError,
        match=(
            r"input_shape=\(16, 16, 1\) looks like \(H, W, C\), not "
            r"\(C, H, W\): it would train as 16 channels of 16x1 pixels"
        ),
    ):
        data.build_datasets(cfg, 0, info())


def test_a_data_kwargs_typo_is_bad_input_naming_the_key(monkeypatch) -> None:
    """Before: a TypeError traceback from the factory's call (exit 1), while the same typo in
    model.kwargs was bad input (exit 2)."""
    module = types.ModuleType("user_data_typo")

    def make(*, root: str, limit: int = 0) -> dict:
        return {
            "train": [eight(0)] * 4,
            "eval": [eight(1)],
            "num_classes": 2,
            "input_shape": (1, 8, 8),
        }

    module.make = make  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "user_data_typo", module)
    cfg = DataConfig(factory="user_data_typo:make", kwargs='{"limt": 5}')
    with pytest.raises(
        ConfigError,
        match=(
            r"data.factory=user_data_typo:make cannot be called with "
            r"data.kwargs=\{\"limt\": 5\}: .*'limt'; did you mean limit\?"
        ),
    ):
        data.build_datasets(cfg, 0, info())


def test_a_bad_label_in_an_in_memory_dataset_is_named_before_training(monkeypatch) -> None:
    def synthetic_with_a_bad_label(cfg: DataConfig) -> data.DataSplits:
        splits = sources._synthetic(cfg)
        splits.eval.labels[37] = 10  # type: ignore[attr-defined]
        return splits

    monkeypatch.setitem(sources.BUILDERS, "synthetic", synthetic_with_a_bad_label)
    cfg = DataConfig(dataset="synthetic", synthetic_eval_size=64)
    with pytest.raises(
        ConfigError,
        match=(
            r"data.dataset=synthetic: eval\[37\] has label 10: "
            r"labels must be ints in \[0, 10\)"
        ),
    ):
        data.build_datasets(cfg, 0, info())


def jpeg_folder(root: Path, classes: dict[str, int]) -> None:
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            Image.new("RGB", (20, 16), color=(i * 40, 90, 200)).save(root / name / f"{i}.jpg")


@pytest.mark.parametrize(
    ("layout", "root", "expected"),
    [
        # Before: "{root}/val does not exist (set --data.root to the folder holding train/ and
        # val/)", whatever the folder held.
        (("train", "valid"), "", "{root} has valid/: rename it val/ (or link it: ln -s valid"),
        ((), "", "{root} holds class folders directly (a, b, ...): make {root}/train/<class>/"),
        (("train", "val"), "train", "is a split's folder of class folders: set --data.root={root}"),
        (("x/train", "x/val"), "", "{root}/x holds train/ and val/: set --data.root={root}/x"),
    ],
)
def test_imagefolder_layout_mistakes_say_what_was_found_and_expected(
    tmp_path, layout, root, expected
) -> None:
    for split in layout:
        jpeg_folder(tmp_path / split, {"a": 2, "b": 2})
    if not layout:
        jpeg_folder(tmp_path, {"a": 2, "b": 2})
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path / root))
    with pytest.raises(data.DatasetNotFoundError) as err:
        data.build_datasets(cfg, 0, info())
    assert expected.format(root=tmp_path) in str(err.value), str(err.value)
    assert "imagefolder reads" in str(err.value)


def test_a_class_without_validation_images_trains_and_is_named(tmp_path, caplog) -> None:
    """Before, a val/ lacking a class folder (or with an empty one) was refused: the class
    could not be trained at all. Labels stay the training split's indices."""
    jpeg_folder(tmp_path / "train", {"a": 2, "b": 2, "c": 2})
    jpeg_folder(tmp_path / "val", {"a": 1, "c": 2})
    (tmp_path / "val" / "b").mkdir()  # empty; remove it and the same holds
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path), image_size=16)
    with caplog.at_level("WARNING"):
        splits = data.build_datasets(cfg, seed=0, info=info())
    assert splits.num_classes == 3 and len(splits.eval) == 3
    assert [splits.eval[i][1] for i in range(3)] == [0, 2, 2]  # c is label 2, as in training
    assert "1 classes have no images here: they are trained, and not evaluated: b" in caplog.text
    (tmp_path / "val" / "b").rmdir()
    splits = data.build_datasets(cfg, seed=0, info=info())
    assert [splits.eval[i][1] for i in range(3)] == [0, 2, 2]
    jpeg_folder(tmp_path / "val", {"d": 1})  # a class training never saw: refused by name
    with pytest.raises(ConfigError, match=r"class folders \['d'\] that the training split lacks"):
        data.build_datasets(cfg, seed=0, info=info())


class TransformedSamples(torch.utils.data.Dataset):
    """A torchvision-style dataset with a `transform` of its own (here: none that changes)."""

    def __init__(self, n: int) -> None:
        self.transform = lambda image: image
        self.samples = [
            (torch.arange(64, dtype=torch.uint8).view(1, 8, 8) + i, i % 2) for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.samples[index]
        return self.transform(image), label


@pytest.mark.parametrize("declared", [False, True])
def test_a_factory_that_augments_its_own_samples_is_said_and_can_opt_out(
    monkeypatch, caplog, declared
) -> None:
    """Before, a factory dataset with transforms of its own got this pipeline's crop and flip
    on top without a word, and had no way to say it augments (UserData had no such field)."""
    train = TransformedSamples(32)

    def make(root: str, n: int) -> data.UserData:
        extra = {"augmented": True} if declared else {}
        return data.UserData(train, train, 2, (1, 8, 8), **extra)

    cfg = dataclasses.replace(user_factory(monkeypatch, make), batch_size=8, crop_padding=2)
    with caplog.at_level("INFO"):
        splits = data.build_datasets(cfg, 0, info())
    loader = train_loader(splits, cfg, info(), 0)
    data.set_epoch(loader, 3)
    batches = list(loader)
    unchanged = all(
        torch.equal(image, train[int(index)][0])
        for images, _, indices in batches
        for image, index in zip(images, indices, strict=True)
    )
    if declared:
        assert "training samples come augmented by the dataset (data.augment is off)" in caplog.text
        assert unchanged  # exactly the dataset's samples
    else:
        said = (
            "the training dataset has its own transform, and gets a random shift of up to 2 "
            "pixels and a 50% horizontal flip (data.augment) on top: if it augments, return "
            "UserData(..., augmented=True)"
        )
        assert said in caplog.text, caplog.text
        assert not unchanged  # shifted or flipped: our augmentation ran


class Stream(torch.utils.data.IterableDataset):
    """A stream with a length, as users write them."""

    def __len__(self) -> int:
        return 16

    def __iter__(self):
        return iter([(torch.zeros(1, 8, 8, dtype=torch.uint8), 0)] * 16)


def test_an_iterable_dataset_is_refused_naming_the_fix(monkeypatch) -> None:
    """Before, `dataset[0]` raised torch's NotImplementedError: exit 1 and a traceback."""
    cfg = user_factory(monkeypatch, lambda root, n: {**ONE_BY_8, "train": Stream()})
    with pytest.raises(ConfigError, match=r"train is a Stream, an IterableDataset a map-style"):
        data.build_datasets(cfg, 0, info())


def test_a_sample_of_another_size_is_named_by_index(monkeypatch) -> None:
    """Before, sample 5's 9x9 image failed in default_collate's torch.stack ("stack expects
    each tensor to be equal size"), naming no sample: exit 1."""
    samples = [(torch.zeros(1, 9 if i == 5 else 8, 8, dtype=torch.uint8), i % 2) for i in range(16)]

    class Sized(torch.utils.data.Dataset):  # no labels to read ahead: checked as loaded
        def __len__(self) -> int:
            return 16

        def __getitem__(self, index: int):
            return samples[index]

    made = {**ONE_BY_8, "train": Sized(), "eval": Sized()}
    cfg = dataclasses.replace(user_factory(monkeypatch, lambda root, n: made), batch_size=16)
    splits = data.build_datasets(cfg, 0, info())
    loader = train_loader(splits, dataclasses.replace(cfg, augment=False), info(), 0)
    data.set_epoch(loader, 0)
    with pytest.raises(ConfigError, match=r"train\[5\]'s image is \(1, 9, 8\), not a tensor of"):
        list(loader)


def test_mixing_ignored_samples_on_the_device_loader_is_refused_naming_the_fix() -> None:
    """A data.factory may label samples IGNORED (-100). A DataLoader's batch leaves them out on
    the CPU before mixing; the device loader's batch would mix them in (the review's finding:
    a zero target row smoothed to 1/C, trained on and counted), so that path is refused."""
    from config import IGNORED, AugConfig

    dataset = data.make_synthetic(64, (1, 8, 8), 4, seed=0)
    dataset.labels[5] = IGNORED
    splits = data.DataSplits(dataset, dataset, (1, 8, 8), 4, (0.5,), (0.25,))
    cfg = DataConfig(dataset="synthetic", batch_size=8, num_workers=0)
    mixing = AugConfig(mixup_alpha=0.2)
    with pytest.raises(ConfigError, match="labels 1 training samples -100.*data.loader=dataloader"):
        data.build_train_loader(splits, cfg, info(), 0, "device", aug=mixing)
    data.build_train_loader(splits, cfg, info(), 0, "dataloader", aug=mixing)
    data.build_train_loader(splits, cfg, info(), 0, "device", aug=AugConfig())
