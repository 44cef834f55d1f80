"""Image folders against independent references: PIL's decoding, torchvision's transforms and
RandomResizedCrop's own sampler."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

import data
import imagefolder
from config import ConfigError, DataConfig
from distributed import DistInfo

CPU = torch.device("cpu")


def noise_image(path: Path, size: tuple[int, int], seed: int = 0, mode: str = "RGB") -> None:
    """A real image file of smooth noise (JPEG compresses it like a photo)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 255, (size[1] // 8 + 1, size[0] // 8 + 1, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize(size, Image.Resampling.BICUBIC).convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, quality=92) if path.suffix == ".jpg" else image.save(path)


def make_folder(root: Path, classes: dict[str, int], size: tuple[int, int] = (48, 40)) -> None:
    for name, count in classes.items():
        for i in range(count):
            noise_image(root / name / f"{i}.jpg", size, seed=hash((name, i)) % 1000)


def folder(root: Path, size: int = 32, scale=(0.08, 1.0), skip: bool = False):
    return imagefolder.ImageFolder(root, size, 0.875, scale, skip)


def test_scan_sorts_classes_and_files_and_ignores_other_files(tmp_path, caplog) -> None:
    make_folder(tmp_path, {"b": 2, "a": 3})
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    noise_image(tmp_path / "a" / ".hidden.jpg", (8, 8))
    noise_image(tmp_path / "b" / "deeper" / "x.PNG", (8, 8))
    noise_image(tmp_path / "b" / "old.bmp", (8, 8))  # left out, with a warning naming it
    with caplog.at_level("WARNING"):
        classes, samples = imagefolder.scan(tmp_path)
    assert "1 image files in formats this pipeline does not read are left out" in caplog.text
    assert "b/old.bmp" in caplog.text
    assert classes == ["a", "b"]
    assert [(Path(p).relative_to(tmp_path).as_posix(), label) for p, label in samples] == [
        ("a/0.jpg", 0),
        ("a/1.jpg", 0),
        ("a/2.jpg", 0),
        ("b/0.jpg", 1),
        ("b/1.jpg", 1),
        ("b/deeper/x.PNG", 1),
    ]


def test_a_class_folder_without_images_is_bad_input_naming_it(tmp_path) -> None:
    make_folder(tmp_path, {"a": 1})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"class folder {tmp_path / 'empty'} holds no images"):
        imagefolder.scan(tmp_path)


def test_decoding_matches_pil(tmp_path) -> None:
    noise_image(tmp_path / "x.png", (37, 23))
    noise_image(tmp_path / "x.jpg", (37, 23))
    noise_image(tmp_path / "gray.jpg", (20, 16), mode="L")
    for name in ("x.png", "x.jpg", "gray.jpg"):
        ours = imagefolder.read(str(tmp_path / name))
        with Image.open(tmp_path / name) as image:
            pil = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
        assert ours.dtype == torch.uint8 and ours.shape == pil.shape
        # PNG is lossless: equal. JPEG decoders may round the last bit differently.
        limit = 0 if name.endswith("png") else 2
        assert (ours.int() - pil.int()).abs().max() <= limit, name


def test_an_unreadable_image_is_named(tmp_path) -> None:
    noise_image(tmp_path / "x.jpg", (40, 40))
    whole = (tmp_path / "x.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(whole[:200])
    (tmp_path / "text.jpg").write_text("not an image at all")
    for name in ("cut.jpg", "text.jpg", "absent.jpg"):
        with pytest.raises(imagefolder.UnreadableImage, match=f"cannot read image .*{name}"):
            imagefolder.read(str(tmp_path / name))


def test_crop_boxes_follow_random_resized_crop(tmp_path) -> None:
    """Inside the image, area and aspect in range, and the same distribution of areas as
    torchvision's own RandomResizedCrop sampler draws."""
    height, width, scale = 60, 90, (0.08, 1.0)
    ours, theirs = [], []
    torch.manual_seed(0)
    for key in range(3000):
        top, left, h, w = imagefolder.crop_box(height, width, random.Random(key), scale)
        assert top >= 0 and top + h <= height and left >= 0 and left + w <= width
        assert 3 / 4 - 0.1 <= w / h <= 4 / 3 + 0.1
        ours.append(h * w / (height * width))
        _, _, h, w = v2.RandomResizedCrop.get_params(
            torch.empty(3, height, width), scale, (3 / 4, 4 / 3)
        )  # type: ignore[attr-defined]
        theirs.append(h * w / (height * width))
    assert abs(statistics.mean(ours) - statistics.mean(theirs)) < 0.02
    assert abs(statistics.stdev(ours) - statistics.stdev(theirs)) < 0.02


def test_an_impossible_crop_falls_back_to_the_clamped_center() -> None:
    # 100x10: no crop of 90-100% of the area has an aspect ratio within 3/4..4/3.
    box = imagefolder.crop_box(10, 100, random.Random(0), (0.9, 1.0))
    assert box == (0, (100 - 13) // 2, 10, 13)


def test_eval_view_is_torchvisions_resize_then_center_crop(tmp_path) -> None:
    make_folder(tmp_path, {"a": 2}, size=(50, 36))
    dataset = folder(tmp_path, size=24)
    image, label = dataset[1]
    reference = v2.Compose([v2.Resize(int(24 / 0.875), antialias=True), v2.CenterCrop(24)])
    decoded = imagefolder.read(str(tmp_path / "a" / "1.jpg"))
    assert label == 0 and torch.equal(image, reference(decoded))


def test_training_view_is_the_keyed_crop_resized_and_maybe_flipped(tmp_path) -> None:
    make_folder(tmp_path, {"a": 1}, size=(64, 48))
    dataset = folder(tmp_path, size=16, scale=(0.3, 1.0))
    decoded = imagefolder.read(str(tmp_path / "a" / "0.jpg"))
    flips = 0
    for key in range(40):
        image, label = dataset.augmented_item(0, key)
        rnd = random.Random(key)
        top, left, h, w = imagefolder.crop_box(48, 64, rnd, (0.3, 1.0))
        crop = F.resized_crop(decoded, top, left, h, w, [16, 16], antialias=True)
        flipped = rnd.random() < 0.5
        flips += flipped
        assert torch.equal(image, crop.flip(-1) if flipped else crop), key
        assert torch.equal(image, dataset.augmented_item(0, key)[0])  # a pure function of key
    assert 10 < flips < 30


def test_training_samples_are_keyed_by_seed_epoch_and_index(tmp_path) -> None:
    """Through data.Augmented, as every loader reads them: the same (epoch, index) gives the
    same crop in any instance (rank, worker, resumed run); another epoch, another crop."""
    make_folder(tmp_path, {"a": 3}, size=(64, 48))
    first = data.Augmented(folder(tmp_path), seed=5, padding=2, enabled=True)
    second = data.Augmented(folder(tmp_path), seed=5, padding=2, enabled=True)
    assert torch.equal(first[(3, 2)][0], second[(3, 2)][0]) and first[(3, 2)][2] == 2
    assert not torch.equal(first[(3, 2)][0], first[(4, 2)][0])
    plain = data.Augmented(folder(tmp_path), seed=5, padding=2, enabled=False)
    assert torch.equal(plain[(3, 2)][0], folder(tmp_path)[2][0])  # augment off: the eval view


def test_skip_policy_blanks_an_unreadable_image_and_leaves_it_uncounted(tmp_path, caplog) -> None:
    make_folder(tmp_path, {"a": 1})
    (tmp_path / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff garbage")
    with pytest.raises(imagefolder.UnreadableImage, match="broken.jpg"):
        folder(tmp_path)[1]  # a/0.jpg, a/broken.jpg
    skipping = folder(tmp_path, size=8, skip=True)
    with caplog.at_level("WARNING"):
        image, label = skipping[1]
    assert label == imagefolder.SKIPPED and not image.any() and image.shape == (3, 8, 8)
    assert "broken.jpg" in caplog.text
    assert skipping.augmented_item(1, 7)[1] == imagefolder.SKIPPED
    assert skipping[0][1] == 0


def test_imagefolder_dataset_with_custom_normalisation_and_class_list(tmp_path) -> None:
    for split in ("train", "val"):
        make_folder(tmp_path / split, {"cat": 2, "dog": 1})
    cfg = DataConfig(
        dataset="imagefolder", root=str(tmp_path), image_size=16, mean=(0.5,) * 3, std=(0.2,) * 3
    )
    splits = data.build_datasets(cfg, 0, DistInfo(0, 0, 1, CPU))
    assert splits.classes == ("cat", "dog") and splits.input_shape == (3, 16, 16)
    assert splits.mean == (0.5,) * 3 and splits.std == (0.2,) * 3
    bad = DataConfig(dataset="imagefolder", root=str(tmp_path), mean=(0.5,))
    with pytest.raises(ConfigError, match=r"data.mean=0.5 has 1 values; the data has 3 channels"):
        data.build_datasets(bad, 0, DistInfo(0, 0, 1, CPU))


def mixed_folder(root: Path) -> None:
    """JPEGs of several sizes (one grayscale, one progressive) and a PNG: every path that
    device decoding takes (batched JPEG call, PNG decoded on the CPU)."""
    make_folder(root, {"a": 3, "b": 2}, size=(50, 37))
    noise_image(root / "a" / "big.jpg", (90, 64), seed=3)
    noise_image(root / "b" / "gray.jpg", (33, 41), seed=4, mode="L")
    noise_image(root / "b" / "lossless.png", (40, 40), seed=5)
    Image.open(root / "a" / "0.jpg").save(root / "a" / "progressive.jpg", progressive=True)


def test_device_decoding_gives_the_worker_path_pixels(tmp_path) -> None:
    """decode_batch on the CPU against the worker path (`augmented_item`, `__getitem__`),
    sample by sample: bit for bit, training and evaluation views."""
    mixed_folder(tmp_path)
    images = folder(tmp_path, size=24)
    n = len(images)
    items = [images.encoded_item(i) for i in range(n)]
    encoded, paths, labels = ([item[k] for item in items] for k in range(3))
    keys = [data._mix64(7, 1, i) for i in range(n)]
    train, train_labels = images.decode_batch(encoded, paths, torch.tensor(labels), keys, CPU)
    evaluated, _ = images.decode_batch(encoded, paths, torch.tensor(labels), None, CPU)
    for i in range(n):
        expected, label = images.augmented_item(i, keys[i])
        assert torch.equal(train[i], expected) and train_labels[i] == label, paths[i]
        assert torch.equal(evaluated[i], images[i][0]), paths[i]
    assert train.shape == (n, 3, 24, 24) and train.dtype == torch.uint8


def test_device_decoding_names_or_skips_a_corrupt_file_in_a_batch(tmp_path, caplog) -> None:
    """One corrupt JPEG fails a batched decode_jpeg call as a whole: the others still decode,
    and the corrupt one is named (bad_images=fail) or blanked and logged (skip)."""
    make_folder(tmp_path, {"a": 3})
    whole = (tmp_path / "a" / "0.jpg").read_bytes()
    (tmp_path / "a" / "1.jpg").write_bytes(whole[: len(whole) // 3])  # a truncated JPEG
    (tmp_path / "a" / "2.jpg").write_bytes(b"\xff\xd8\xff not a JPEG at all")
    for skip in (False, True):
        images = folder(tmp_path, size=16, skip=skip)
        items = [images.encoded_item(i) for i in range(3)]
        encoded, paths, labels = ([item[k] for item in items] for k in range(3))
        # The truncated file never reaches the batched call (nvJPEG would decode it to grey).
        assert [imagefolder.is_complete_jpeg(e) for e in encoded] == [True, False, False]
        if not skip:
            with pytest.raises(imagefolder.UnreadableImage, match=r"cannot read image .*a/1\.jpg"):
                images.decode_batch(encoded, paths, torch.tensor(labels), None, CPU)
            continue
        with caplog.at_level("WARNING"):
            batch, labels = images.decode_batch(encoded, paths, torch.tensor(labels), None, CPU)
        assert torch.equal(batch[0], images[0][0]) and labels[0] == 0
        for i in (1, 2):
            assert labels[i] == imagefolder.SKIPPED and not batch[i].any()
            assert f"a/{i}.jpg" in caplog.text


@pytest.mark.parametrize("num_workers", [0, 1])
def test_device_decoding_loaders_yield_the_worker_loaders_batches(tmp_path, num_workers) -> None:
    """The loaders of data.decode=device and =workers on a subset of a folder, over two epochs
    and both ranks of two: the same batches, bit for bit, in the same order."""
    for split in ("train", "val"):
        mixed_folder(tmp_path / split)
    cfg = DataConfig(
        dataset="imagefolder",
        root=str(tmp_path),
        image_size=20,
        subset=7,
        batch_size=2,
        eval_batch_size=3,
        num_workers=num_workers,
    )
    for rank in (0, 1):
        info = DistInfo(rank, rank, 2, CPU)
        splits = data.build_datasets(cfg, 3, info)
        workers = data.build_train_loader(splits, cfg, info, 3, "dataloader", "workers")
        device = data.build_train_loader(splits, cfg, info, 3, "dataloader", "device")
        assert isinstance(device, data.DecodingLoader) and len(device) == len(workers) == 1
        for epoch in (0, 1):
            data.set_epoch(workers, epoch)
            data.set_epoch(device, epoch)
            for ours, theirs in zip(device, workers, strict=True):
                assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        eval_workers = data.build_eval_loader(splits, cfg, info, 3, "workers")
        eval_device = data.build_eval_loader(splits, cfg, info, 3, "device")
        batches = list(zip(eval_device, eval_workers, strict=True))
        assert sum(len(ours[1]) for ours, _ in batches) == [5, 4][rank]  # 9 images, each once
        for ours, theirs in batches:
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        for loader in (workers, device, eval_workers, eval_device):
            data.close_loader(loader)


def test_a_device_decoder_that_fails_its_check_is_reported(monkeypatch) -> None:
    """The start-up check passes on this CPU; a decoder that raises (as a GPU build without
    nvJPEG does) or decodes wrongly is reported, and auto.decode then keeps the workers."""
    from torchvision import io

    assert imagefolder.device_decoding_problem(CPU) is None
    real = io.decode_jpeg

    def failing(*args, **kwargs):
        raise RuntimeError("no nvJPEG here")

    monkeypatch.setattr(io, "decode_jpeg", failing)
    assert imagefolder.device_decoding_problem(CPU) == "RuntimeError: no nvJPEG here"

    def wrong(data, mode, device="cpu"):
        if isinstance(data, list):
            return [255 - image for image in real(data, mode=mode, device=device)]
        return real(data, mode=mode, device=device)

    monkeypatch.setattr(io, "decode_jpeg", wrong)
    assert "levels away from libjpeg-turbo" in imagefolder.device_decoding_problem(CPU)


def test_device_decoding_is_for_image_folders_only() -> None:
    with pytest.raises(ConfigError, match=r"data.decode: 'device' \(it is for imagefolder only"):
        DataConfig(decode="device")
    assert DataConfig(dataset="imagefolder", decode="device").decode == "device"
