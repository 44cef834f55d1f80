"""aug's per-sample parts: the automatic augmentation policies (against torchvision's own
transforms under the sample's seed), the repeated-augmentation sampler (against the reference
recipe's RASampler construction, by hand), the separate evaluation sizes of an image folder,
and the loader choices and refusals they bring."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_imagefolder import make_folder
from torchvision import transforms as T
from torchvision.transforms.v2 import functional as F

import auto
import data
from cli import parse_args
from config import AugConfig, Config, ConfigError, DataConfig
from distributed import DistInfo
from inputs import imagefolder
from inputs.augment import Augmented, policy
from inputs.sampling import EpochSampler, mix64, sample_key

CPU = torch.device("cpu")
BILINEAR = T.InterpolationMode.BILINEAR
REFERENCES = {  # as torchvision's references/classification/presets.py builds them
    "ra": lambda: T.RandAugment(interpolation=BILINEAR, magnitude=9),
    "ta_wide": lambda: T.TrivialAugmentWide(interpolation=BILINEAR),
    "augmix": lambda: T.AugMix(interpolation=BILINEAR, severity=3),
    "autoaugment": lambda: T.AutoAugment(T.AutoAugmentPolicy.IMAGENET, interpolation=BILINEAR),
}


def info(rank: int = 0, world_size: int = 1) -> DistInfo:
    return DistInfo(rank, rank, world_size, CPU)


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("channels", [1, 3])
def test_a_policy_is_torchvisions_transform_seeded_by_the_samples_key(name, channels) -> None:
    """Augmented applies the policy after the crop and flip; each item equals torchvision's
    transform run on the cropped image with the global generator seeded from the key, and
    loading it leaves the global generator as it was (dropout's stream is the rank's)."""
    base = data.make_synthetic(8, (channels, 20, 20), 3, seed=1)
    augmented = Augmented(base, 11, 2, True, policy(name))
    plain = Augmented(base, 11, 2, True)
    changed = 0
    for index in range(8):
        torch.manual_seed(index)
        before = torch.get_rng_state()
        image, label, got_index = augmented[(4, index)]
        assert torch.get_rng_state().equal(before)
        cropped = plain[(4, index)][0]
        torch.manual_seed(mix64(sample_key(11, 4, index), 3))
        want = REFERENCES[name]()(cropped)
        assert torch.equal(image, want) and got_index == index
        assert label == int(base.labels[index]) and image.dtype == torch.uint8
        changed += not torch.equal(image, cropped)
    assert changed >= 4


def test_a_policy_is_a_pure_function_of_the_key_and_copies_differ() -> None:
    base = data.make_synthetic(4, (3, 24, 24), 3, seed=1)
    one, two = (Augmented(base, 0, 2, True, policy("ta_wide")) for _ in range(2))
    assert torch.equal(one[(2, 1)][0], two[(2, 1)][0])
    copies = [one[(2, 1, copy)][0] for copy in range(4)]  # aug.repeated_augment's copies
    assert torch.equal(copies[0], one[(2, 1)][0])  # copy 0 is the plain key
    assert len({tuple(c.flatten().tolist()) for c in copies}) == 4


def test_policies_run_on_an_image_folders_crops(tmp_path) -> None:
    make_folder(tmp_path, {"a": 2, "b": 2}, size=(40, 30))
    folder = imagefolder.ImageFolder(tmp_path, 16, 0.875, (0.3, 1.0), False)
    augmented = Augmented(folder, 3, 0, True, policy("ra"))
    image, label, _ = augmented[(0, 2)]
    crop = folder.augmented_item(2, sample_key(3, 0, 2))[0]
    torch.manual_seed(mix64(sample_key(3, 0, 2), 3))
    assert torch.equal(image, REFERENCES["ra"]()(crop)) and label == 1


def reference_ra_shards(n: int, world_size: int, reps: int, seed: int, epoch: int) -> list[list]:
    """torchvision's references/classification/sampler.py RASampler, by hand: the epoch's
    permutation (seeded seed + epoch), each index `reps` times in a row, rank r taking every
    world_size-th from r; here the epoch is the first n of that order, split evenly."""
    g = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g).repeat_interleave(reps).tolist()[:n]
    copies = [k % reps for k in range(n)]
    per_rank = n // world_size
    return [
        [(epoch, order[k], copies[k]) for k in range(r, n, world_size)][:per_rank]
        for r in range(world_size)
    ]


@pytest.mark.parametrize("world_size,reps", [(1, 3), (2, 3), (3, 4), (4, 2)])
def test_repeated_augment_hands_each_rank_the_reference_share(world_size, reps) -> None:
    dataset = range(50)
    shards = []
    for rank in range(world_size):
        sampler = EpochSampler(dataset, info(rank, world_size), 7, repeats=reps)
        sampler.set_epoch(2)
        shards.append(list(sampler))
    assert shards == reference_ra_shards(50, world_size, reps, 7, 2)
    seen = [key for shard in shards for key in shard]
    assert len(seen) == 50 // world_size * world_size  # an epoch stays len(dataset) long
    assert len(set(seen)) == len(seen)  # each copy once
    if reps <= world_size:  # a sample's copies land on different ranks
        for shard in shards:
            assert len({index for _, index, _ in shard}) == len(shard)


@pytest.mark.parametrize("before,after", [(2, 2), (2, 3)])
def test_repeated_augment_resumes_mid_epoch_with_the_rest_of_the_keys(before, after) -> None:
    dataset = range(60)
    full = [key for shard in reference_ra_shards(60, 1, 3, 1, 0) for key in shard]
    consumed = 2 * before * 5  # two steps of 5 per rank
    first = []
    for rank in range(before):
        sampler = EpochSampler(dataset, info(rank, before), 1, repeats=3)
        sampler.set_epoch(0)
        first += list(sampler)[:10]
    rest = []
    for rank in range(after):
        sampler = EpochSampler(dataset, info(rank, after), 1, repeats=3)
        sampler.set_epoch(0, consumed)
        rest += list(sampler)
    assert sorted(first) == sorted(full[:consumed])
    assert sorted(rest) == sorted(full[consumed : consumed + len(rest)])
    assert len(rest) == (60 - consumed) // after * after


def test_repeats_of_one_are_todays_sampler_and_todays_keys() -> None:
    plain, one = EpochSampler(range(30), info(1, 2), 4), EpochSampler(range(30), info(1, 2), 4, 1)
    plain.set_epoch(3, 6)
    one.set_epoch(3, 6)
    assert list(plain) == list(one) and all(len(key) == 2 for key in one)
    assert sample_key(4, 3, 9) == mix64(4, 3, 9) != sample_key(4, 3, 9, 1)


def test_eval_sizes_resize_and_crop_as_torchvision_and_default_as_before(tmp_path) -> None:
    make_folder(tmp_path, {"a": 2, "b": 1}, size=(50, 36))
    decoded = imagefolder.read(str(tmp_path / "a" / "1.jpg"))
    sized = imagefolder.ImageFolder(tmp_path, 16, 0.875, (0.08, 1.0), False, eval_size=(20, 26))
    image, _ = sized[1]
    assert torch.equal(image, F.center_crop(F.resize(decoded, [26], antialias=True), [20, 20]))
    assert sized.augmented_item(1, 5)[0].shape == (3, 16, 16)  # the training crop
    crop_only = imagefolder.ImageFolder(tmp_path, 16, 0.8, (0.08, 1.0), False, eval_size=(20, 0))
    want = F.center_crop(F.resize(decoded, [int(20 / 0.8)], antialias=True), [20, 20])
    assert torch.equal(crop_only[1][0], want)
    default = imagefolder.ImageFolder(tmp_path, 16, 0.875, (0.08, 1.0), False)
    assert (default.eval_crop_size, default.resize_size) == (16, int(16 / 0.875))
    cfg = DataConfig(dataset="imagefolder", image_size=176, eval_crop_size=224)
    assert cfg.eval_size == (224, 256)
    assert DataConfig(eval_resize_size=232, eval_crop_size=224).eval_size == (224, 232)


def test_an_image_folder_dataset_trains_and_evaluates_at_its_own_sizes(tmp_path) -> None:
    """Through data.build_datasets and both loaders, as a run builds them: 176 -> 232 -> 224
    in miniature (train crop 12, eval resize 20, eval crop 16)."""
    for split in ("train", "val"):
        make_folder(tmp_path / split, {"cat": 4, "dog": 4}, size=(30, 26))
    cfg = DataConfig(
        dataset="imagefolder",
        root=str(tmp_path),
        image_size=12,
        eval_resize_size=20,
        eval_crop_size=16,
        batch_size=4,
        eval_batch_size=8,
        num_workers=0,
    )
    splits = data.build_datasets(cfg, 0, info())
    train = data.build_train_loader(splits, cfg, info(), 0, "dataloader", "workers")
    data.set_epoch(train, 0)
    evaluated, _ = next(iter(data.build_eval_loader(splits, cfg, info(), 0, "workers")))
    assert next(iter(train))[0].shape == (4, 3, 12, 12) and evaluated.shape == (8, 3, 16, 16)
    decoded = imagefolder.read(splits.eval.samples[0][0])
    want = F.center_crop(F.resize(decoded, [20], antialias=True), [16, 16])
    assert torch.equal(evaluated[0], want)


def test_device_decoding_evaluates_at_the_eval_sizes_too(tmp_path) -> None:
    make_folder(tmp_path, {"a": 3, "b": 2}, size=(44, 30))
    (tmp_path / "b" / "bad.jpg").write_bytes(b"not a jpeg")
    images = imagefolder.ImageFolder(tmp_path, 12, 0.875, (0.08, 1.0), True, eval_size=(20, 24))
    items = [images.encoded_item(i) for i in range(len(images))]
    encoded, paths, labels = ([item[k] for item in items] for k in range(3))
    evaluated, _ = images.decode_batch(encoded, paths, torch.tensor(labels), None, CPU)
    trained, _ = images.decode_batch(encoded, paths, torch.tensor(labels), [1] * 6, CPU)
    assert evaluated.shape == (6, 3, 20, 20) and trained.shape == (6, 3, 12, 12)
    for i in range(len(images)):
        assert torch.equal(evaluated[i], images[i][0]), paths[i]


def test_eval_sizes_are_for_image_folders_and_checked() -> None:
    with pytest.raises(ConfigError, match="eval_resize_size"):
        DataConfig(dataset="imagefolder", eval_crop_size=224, eval_resize_size=200)
    with pytest.raises(ConfigError, match="eval_crop_size"):
        DataConfig(dataset="imagefolder", eval_crop_size=4)
    with pytest.raises(ConfigError, match="data.eval_crop_size=64 is for data.dataset=imagefo"):
        parse_args(["--data.eval_crop_size=64"])  # train.py exits 2 on a ConfigError


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--aug.ra_magnitude=31"], "aug.ra_magnitude: 31"),
        (["--aug.random_erase=1.5"], "aug.random_erase: 1.5"),
        (["--aug.mixup_alpha=-1"], "aug.mixup_alpha: -1.0"),
        (["--aug.repeated_augment=0"], "aug.repeated_augment: 0"),
        (["--aug.augmix_severity=3"], "aug.augmix_severity=3 is for aug.auto_augment=augmix"),
        (
            ["--aug.auto_augment=ra", "--data.loader=device"],
            "aug.auto_augment=ra cannot be combined with data.loader=device",
        ),
        (
            ["--aug.repeated_augment=3", "--data.dataset=imagefolder", "--data.decode=device"],
            "aug.repeated_augment=3 cannot be combined with data.decode=device",
        ),
        (
            ["--aug.auto_augment=ta_wide", "--data.dataset=imagefolder", "--data.decode=device"],
            "aug.auto_augment=ta_wide cannot be combined with data.decode=device",
        ),
    ],
)
def test_bad_aug_settings_are_refused_naming_key_and_value(argv, named) -> None:
    with pytest.raises(ConfigError) as err:  # train.py exits 2 on it (test_bad_input)
        parse_args(argv)
    assert named in " ".join(str(err.value).split())


def test_auto_picks_the_dataloader_for_a_policy_and_worker_decoding_for_repeats() -> None:
    policy_on = Config(aug=AugConfig(auto_augment="ta_wide"))
    repeats = AugConfig(repeated_augment=2)
    assert auto.resolve(policy_on, info(), in_memory_numel=1000).loader == "dataloader"
    assert auto.resolve(Config(aug=repeats), info(), in_memory_numel=1000).loader == "device"
    assert auto.resolve(Config(aug=AugConfig(mixup_alpha=0.2)), info(), 1000).loader == "device"
    assert auto.resolve(Config(), info(), in_memory_numel=1000).loader == "device"
    for aug in (policy_on.aug, repeats):  # before the GPU decoder's check is looked at
        workers = bool(aug.worker_only("decode"))
        assert auto.decode("auto", True, torch.device("cuda"), 1.0, workers) == "workers"


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_device_loader_yields_the_dataloaders_repeated_batches_bit_for_bit(world_size):
    """aug.repeated_augment on the device loader: its batched crops and flips hashed with the
    copy (mix64_many's extra round) against the per-sample DataLoader path, resumed mid-epoch."""
    base = data.make_synthetic(300, (3, 12, 12), 10, seed=0)
    splits = data.DataSplits(base, base, (3, 12, 12), 10, (0.5,) * 3, (0.25,) * 3)
    aug = AugConfig(repeated_augment=3)
    batches = {}
    for kind in ("dataloader", "device"):
        cfg = DataConfig(batch_size=16, num_workers=0, loader=kind, crop_padding=2)
        loader = data.build_train_loader(
            splits, cfg, info(world_size - 1, world_size), 5, kind, "none", aug
        )
        data.set_epoch(loader, 2, consumed=32 * world_size)
        batches[kind] = list(loader)
    assert len(batches["device"]) == len(batches["dataloader"]) > 3
    for ours, reference in zip(batches["device"], batches["dataloader"], strict=True):
        for a, b in zip(ours, reference, strict=True):
            assert torch.equal(a, b)


def test_a_train_loader_with_every_per_sample_aug_yields_keyed_batches(tmp_path: Path) -> None:
    """data.build_train_loader end to end: the batches are the policy's images of the
    repeated keys, in the sampler's order, at 2 ranks."""
    splits = data.DataSplits(
        data.make_synthetic(40, (3, 16, 16), 4, seed=2),
        data.make_synthetic(8, (3, 16, 16), 4, seed=3),
        (3, 16, 16),
        4,
        (0.5,) * 3,
        (0.25,) * 3,
    )
    cfg = DataConfig(dataset="synthetic", batch_size=5, num_workers=0)
    aug = AugConfig(auto_augment="ra", repeated_augment=3)
    loader = data.build_train_loader(splits, cfg, info(1, 2), 9, "dataloader", "none", aug)
    data.set_epoch(loader, 1)
    keys = list(loader.sampler)
    images, labels, indices = next(iter(loader))
    reference = Augmented(splits.train, 9, cfg.crop_padding, True, policy("ra"))
    for row, key in enumerate(keys[:5]):
        assert len(key) == 3 and indices[row] == key[1]
        assert torch.equal(images[row], reference[key][0])


def test_the_resnet50_recipe_file_states_torchvisions_published_recipe() -> None:
    """configs/imagenet_resnet50.toml through the command line's parser, against the flags of
    torchvision's ResNet50_Weights.IMAGENET1K_V2 recipe (its docs' training command)."""
    cfg = parse_args([f"--config={Path(__file__).parents[1] / 'configs/imagenet_resnet50.toml'}"])
    assert cfg.aug == AugConfig(
        auto_augment="ta_wide",
        random_erase=0.1,
        mixup_alpha=0.2,
        cutmix_alpha=1.0,
        repeated_augment=4,
    )
    assert cfg.data.dataset == "imagefolder" and cfg.data.global_batch_size == 128 * 8
    assert (cfg.data.image_size, cfg.data.eval_size) == (176, (224, 232))
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay) == ("sgd", 0.5, 2e-5)
    assert (cfg.optim.momentum, cfg.optim.nesterov, cfg.optim.grad_clip) == (0.9, False, 0.0)
    assert cfg.optim.label_smoothing == 0.1 and cfg.optim.min_lr_ratio == 0.0
    assert (cfg.optim.norm_weight_decay, cfg.optim.bias_weight_decay) == (0.0, 2e-5)
    assert (cfg.optim.schedule, cfg.optim.warmup) == ("cosine", "linear")
    assert (cfg.optim.warmup_epochs, cfg.optim.warmup_factor) == (5, 0.01)
    assert (cfg.train.ema_decay, cfg.train.ema_every_steps) == (0.99998, 32)
    assert cfg.train.ema_adjust and cfg.train.ema_warmup_reset
    assert cfg.model.name == "resnet50" and cfg.train.epochs == 600


def test_a_policy_on_self_augmented_or_float_samples_is_refused_naming_it() -> None:
    """torchvision's policies read float images as [0, 1] intensities, and a dataset that
    augments its own samples is left alone by data.augment: both refused (train.py: exit 2)."""
    images = data.make_synthetic(16, (3, 8, 8), 2, seed=0)
    cfg = DataConfig(dataset="synthetic", batch_size=4, num_workers=0)
    aug = AugConfig(auto_augment="ra")
    shape = (3, 8, 8)
    own = data.DataSplits(images, images, shape, 2, (0.5,) * 3, (0.2,) * 3, augmented=True)
    with pytest.raises(ConfigError, match="aug.auto_augment=ra cannot be combined with"):
        data.build_train_loader(own, cfg, info(), 0, "dataloader", "none", aug)
    floats = torch.utils.data.TensorDataset(images.images.float() / 255, images.labels)
    as_float = data.DataSplits(floats, floats, shape, 2, (0.5,) * 3, (0.2,) * 3)
    with pytest.raises(ConfigError, match="aug.auto_augment=ra needs uint8 images"):
        data.build_train_loader(as_float, cfg, info(), 0, "dataloader", "none", aug)
    plain = data.DataSplits(images, images, shape, 2, (0.5,) * 3, (0.2,) * 3)
    assert data.build_train_loader(plain, cfg, info(), 0, "dataloader", "none", aug)
