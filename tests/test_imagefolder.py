"""Image folders against independent references: PIL's decoding, torchvision's transforms and
RandomResizedCrop's own sampler."""

from __future__ import annotations

import os
import random
import statistics
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

import data
from config import ConfigError, DataConfig
from distributed import DistInfo
from inputs import imagefolder, sampling

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
    make_folder(tmp_path, {"a": 2, "b": 1}, size=(50, 36))
    dataset = folder(tmp_path, size=24)
    image, label = dataset[1]
    reference = v2.Compose([v2.Resize(int(24 / 0.875), antialias=True), v2.CenterCrop(24)])
    decoded = imagefolder.read(str(tmp_path / "a" / "1.jpg"))
    assert label == 0 and torch.equal(image, reference(decoded))


def test_training_view_is_the_keyed_crop_resized_and_maybe_flipped(tmp_path) -> None:
    make_folder(tmp_path, {"a": 1, "b": 1}, size=(64, 48))
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
    make_folder(tmp_path, {"a": 3, "b": 1}, size=(64, 48))
    first = data.Augmented(folder(tmp_path), seed=5, padding=2, enabled=True)
    second = data.Augmented(folder(tmp_path), seed=5, padding=2, enabled=True)
    assert torch.equal(first[(3, 2)][0], second[(3, 2)][0]) and first[(3, 2)][2] == 2
    assert not torch.equal(first[(3, 2)][0], first[(4, 2)][0])
    plain = data.Augmented(folder(tmp_path), seed=5, padding=2, enabled=False)
    assert torch.equal(plain[(3, 2)][0], folder(tmp_path)[2][0])  # augment off: the eval view


def test_skip_policy_blanks_an_unreadable_image_and_leaves_it_uncounted(tmp_path, caplog) -> None:
    make_folder(tmp_path, {"a": 1, "b": 1})
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
    keys = [sampling.mix64(7, 1, i) for i in range(n)]
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
    make_folder(tmp_path, {"a": 3, "b": 1})
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


# ---------------------------------------------------------------------------------------------
# Every PNG colour type and bit depth, 16-bit PNGs, GIFs


def write_png(
    path: Path,
    samples: np.ndarray,
    colour_type: int,
    bit_depth: int,
    palette: np.ndarray | None = None,
    transparency: bytes | None = None,
) -> None:
    """A real PNG file written chunk by chunk as the PNG specification lays it out (W3C PNG
    2nd edition: 5.2 signature, 5.3 chunk layout with CRC-32, 11.2.2 IHDR, 11.2.3 PLTE, 11.3.2.1
    tRNS, 7.2 scanlines: big-endian samples, sub-byte samples packed from the high bit, each row
    led by its filter byte, 0 = none). `samples`: (H, W, channels) ints below 2**bit_depth.

    PIL writes no 16-bit colour PNG and torchvision.io.encode_png only uint8 (encode_png.cpp:
    "Input tensor dtype should be uint8"), hence this writer."""
    height, width = samples.shape[:2]
    rows = samples.reshape(height, -1)
    if bit_depth == 16:
        packed = [row.astype(">u2").tobytes() for row in rows]
    elif bit_depth == 8:
        packed = [row.astype(np.uint8).tobytes() for row in rows]
    else:  # each sample's low `bit_depth` bits, most significant first, rows padded to bytes
        bits = [
            np.unpackbits(row.astype(np.uint8)[:, None], axis=1)[:, 8 - bit_depth :] for row in rows
        ]
        packed = [np.packbits(b.ravel()).tobytes() for b in bits]

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
    if palette is not None:
        out += chunk(b"PLTE", palette.astype(np.uint8).tobytes())
    if transparency is not None:
        out += chunk(b"tRNS", transparency)
    out += chunk(b"IDAT", zlib.compress(b"".join(b"\x00" + row for row in packed)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(out + chunk(b"IEND", b""))


# (colour type, bit depth, channels in the file): every combination PNG allows (spec 11.2.2).
PNG_KINDS = [
    (0, 1, 1), (0, 2, 1), (0, 4, 1), (0, 8, 1), (0, 16, 1),  # grayscale
    (2, 8, 3), (2, 16, 3),  # RGB
    (3, 1, 1), (3, 2, 1), (3, 4, 1), (3, 8, 1),  # palette
    (4, 8, 2), (4, 16, 2),  # grayscale + alpha
    (6, 8, 4), (6, 16, 4),  # RGBA
]  # fmt: skip


def expected_rgb8(samples: np.ndarray, colour_type: int, bit_depth: int, palette) -> torch.Tensor:
    """By hand: palette indices looked up; alpha dropped; gray repeated in R, G and B; gray of
    1, 2 or 4 bits scaled to 8 by bit replication (libpng's png_set_expand_gray_1_2_4_to_8,
    which torchvision's decode_png.cpp calls); 16 bits to 8 by dropping the low byte (v >> 8:
    torchvision.transforms.v2.functional._misc.to_dtype_image with scale=True divides a uint16
    by 2**(16 - 8) and truncates)."""
    if colour_type == 3:
        return torch.from_numpy(palette[samples[..., 0]].astype(np.uint8)).permute(2, 0, 1)
    values = samples.astype(np.int64)
    if bit_depth == 16:
        values = values >> 8
    elif bit_depth < 8:
        values = values * (255 // (2**bit_depth - 1))
    colour = values[..., :3] if colour_type in (2, 6) else np.repeat(values[..., :1], 3, axis=2)
    return torch.from_numpy(colour.astype(np.uint8)).permute(2, 0, 1)


@pytest.mark.parametrize(("colour_type", "bit_depth", "channels"), PNG_KINDS)
def test_every_png_colour_type_and_bit_depth_reads_as_8_bit_rgb(
    tmp_path, colour_type, bit_depth, channels
) -> None:
    """torchvision.io.decode_image returns uint16 for 16-bit PNGs (torchvision/io/image.py,
    decode_image's docstring; decode_png.cpp allocates UInt16 when bit_depth == 16): every kind
    must reach the pipeline as uint8 RGB with the values computed by hand."""
    rng = np.random.default_rng(colour_type * 100 + bit_depth)
    top = 2 ** (8 if colour_type == 3 and bit_depth == 8 else bit_depth)
    samples = rng.integers(0, top, (5, 7, channels))
    samples[0, 0] = top - 1  # the extremes: 0 and the largest value stay 0 and 255
    samples[0, 1] = 0
    palette = rng.integers(0, 256, (2**bit_depth, 3)) if colour_type == 3 else None
    path = tmp_path / f"c{colour_type}_{bit_depth}.png"
    write_png(path, samples, colour_type, bit_depth, palette)
    image = imagefolder.read(str(path))
    assert image.dtype == torch.uint8 and image.shape == (3, 5, 7)
    assert torch.equal(image, expected_rgb8(samples, colour_type, bit_depth, palette))


def test_pngs_with_a_transparency_chunk_read_as_rgb(tmp_path) -> None:
    """tRNS makes palette and gray images carry alpha once expanded: still 3 channels."""
    rng = np.random.default_rng(1)
    palette = rng.integers(0, 256, (4, 3))
    indices = rng.integers(0, 4, (6, 5, 1))
    write_png(tmp_path / "p.png", indices, 3, 8, palette, transparency=bytes([0, 128]))
    gray = rng.integers(0, 256, (6, 5, 1))
    write_png(tmp_path / "g.png", gray, 0, 8, transparency=struct.pack(">H", 7))
    for name, samples, kind in (("p.png", indices, 3), ("g.png", gray, 0)):
        image = imagefolder.read(str(tmp_path / name))
        assert torch.equal(image, expected_rgb8(samples, kind, 8, palette)), name


def test_pil_16_bit_grayscale_png_reads_as_its_high_byte(tmp_path) -> None:
    """PIL's mode 'I;16' writes a 16-bit grayscale PNG (colour type 0, depth 16)."""
    values = np.random.default_rng(2).integers(0, 65536, (9, 11), dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "x.png")
    image = imagefolder.read(str(tmp_path / "x.png"))
    high = torch.from_numpy((values >> 8).astype(np.uint8))
    assert image.dtype == torch.uint8 and torch.equal(image, high.expand(3, 9, 11))


def twin_pngs(root: Path, name: str, seed: int) -> None:
    """`name`.png in 8 bits and `name`_16.png in 16 bits whose high bytes are the 8-bit file's
    (the low bytes random): the same picture, so the same training and evaluation views."""
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (23, 31, 3))
    write_png(root / f"{name}.png", rgb, 2, 8)
    write_png(root / f"{name}_16.png", rgb * 256 + rng.integers(0, 256, rgb.shape), 2, 16)


def test_a_folder_mixing_8_and_16_bit_pngs_trains_on_the_same_pixels(tmp_path) -> None:
    """Each 16-bit image's views equal its 8-bit twin's; the loader's batches mix them."""
    for label, name in enumerate(("a", "b")):
        for i in range(2):
            twin_pngs(tmp_path / name, f"{i}", seed=10 * label + i)
    images = folder(tmp_path, size=16)
    paths = [Path(path).name for path, _ in images.samples]
    assert paths == ["0.png", "0_16.png", "1.png", "1_16.png"] * 2
    for i in range(0, len(images), 2):
        assert torch.equal(images[i][0], images[i + 1][0]), paths[i]
        assert torch.equal(images.augmented_item(i, 5)[0], images.augmented_item(i + 1, 5)[0])
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path), image_size=16, batch_size=4)
    splits = data.DataSplits(images, images, (3, 16, 16), 2, (0.5,) * 3, (0.2,) * 3)
    loader = data.build_train_loader(splits, cfg, DistInfo(0, 0, 1, CPU), 0, "dataloader")
    batches = list(loader)
    assert sum(len(labels) for _, labels, _ in batches) == 8
    assert all(images.dtype == torch.uint8 for images, _, _ in batches)
    data.close_loader(loader)


def test_gifs_are_read_as_their_first_frame(tmp_path, caplog) -> None:
    """torchvision.io.decode_image reads GIFs (decode_image.cpp: the GIF87a/GIF89a signature
    goes to decode_gif, which ignores the read mode and always gives RGB), an animated one as
    (frames, 3, H, W). The reference is PIL's first frame."""
    rng = np.random.default_rng(3)
    frames = [Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)) for _ in range(3)]
    frames = [frame.convert("P") for frame in frames]
    (tmp_path / "a").mkdir()
    frames[0].save(tmp_path / "a" / "moving.gif", save_all=True, append_images=frames[1:])
    gray = Image.fromarray(rng.integers(0, 256, (12, 10), dtype=np.uint8))
    gray.save(tmp_path / "a" / "gray.gif")
    make_folder(tmp_path, {"b": 1})
    for name in ("moving.gif", "gray.gif"):
        ours = imagefolder.read(str(tmp_path / "a" / name))
        with Image.open(tmp_path / "a" / name) as image:  # the first frame
            pil = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
        assert ours.dtype == torch.uint8 and torch.equal(ours, pil), name
    with caplog.at_level("WARNING"):
        _, samples = imagefolder.scan(tmp_path)
    assert [Path(p).name for p, _ in samples] == ["gray.gif", "moving.gif", "0.jpg"]
    assert "left out" not in caplog.text


# ---------------------------------------------------------------------------------------------
# What the scan walks: links, hidden entries, loose files, one class, non-UTF-8 names


def relative_samples(root: Path, samples) -> list[tuple[str, int]]:
    return [(os.path.relpath(path, root), label) for path, label in samples]


def test_a_symlink_loop_in_a_class_folder_is_not_followed(tmp_path, caplog) -> None:
    """`os.walk(followlinks=True)` has no cycle detection (its documentation says so: "be
    aware that setting followlinks to True can lead to infinite recursion"): `a/loop -> ..`
    walked the whole split again, and again, as class a, until the path was too long."""
    make_folder(tmp_path, {"a": 2, "b": 3})
    (tmp_path / "a" / "loop").symlink_to("..")
    (tmp_path / "b" / "deeper").mkdir()
    (tmp_path / "b" / "deeper" / "self").symlink_to(".")
    with caplog.at_level("WARNING"):
        _, samples = imagefolder.scan(tmp_path)
    expected = [("a/0.jpg", 0), ("a/1.jpg", 0), ("b/0.jpg", 1), ("b/1.jpg", 1), ("b/2.jpg", 1)]
    assert relative_samples(tmp_path, samples) == expected
    assert "2 symbolic links lead to a folder that holds them (a loop)" in caplog.text
    assert f"{tmp_path / 'a' / 'loop'} -> {tmp_path}" in caplog.text
    assert f"{tmp_path / 'b' / 'deeper' / 'self'}" in caplog.text


def test_linked_folders_are_read_once_and_never_under_two_classes(tmp_path, caplog) -> None:
    """A folder outside the split linked into a class counts as that class's, once however
    many links reach it; a link from one class into another's folder is refused by name (its
    images would carry two labels)."""
    make_folder(tmp_path / "split", {"a": 1, "b": 1})
    make_folder(tmp_path / "outside", {"extra": 2})
    split = tmp_path / "split"
    (split / "a" / "more").symlink_to(tmp_path / "outside" / "extra")
    (split / "a" / "wider").symlink_to(tmp_path / "outside")  # holds extra/ a second time
    with caplog.at_level("WARNING"):
        _, samples = imagefolder.scan(split)
    assert relative_samples(split, samples) == [
        ("a/0.jpg", 0),
        ("a/more/0.jpg", 0),
        ("a/more/1.jpg", 0),
        ("b/0.jpg", 1),
    ]
    assert f"{split / 'a' / 'wider' / 'extra'} (the folder {split / 'a' / 'more'})" in caplog.text
    (split / "b" / "theirs").symlink_to(tmp_path / "outside" / "extra")
    with pytest.raises(ConfigError, match=r"split/b/theirs is the folder .*split/a/more \(class "):
        imagefolder.scan(split)
    (split / "b" / "theirs").unlink()
    (split / "b" / "sibling").symlink_to("../a")
    with pytest.raises(ConfigError, match=r"split/b/sibling is the folder .*split/a \(class 'a'"):
        imagefolder.scan(split)


def test_hidden_files_and_folders_in_class_folders_are_skipped_and_said(tmp_path, caplog) -> None:
    make_folder(tmp_path, {"a": 2, "b": 1})
    noise_image(tmp_path / "a" / ".ipynb_checkpoints" / "0-checkpoint.jpg", (8, 8))
    noise_image(tmp_path / "b" / "._0.jpg", (8, 8))  # macOS's resource fork
    (tmp_path / ".ipynb_checkpoints").mkdir()  # beside the class folders: no class either
    with caplog.at_level("INFO"):
        _, samples = imagefolder.scan(tmp_path)
    assert relative_samples(tmp_path, samples) == [("a/0.jpg", 0), ("a/1.jpg", 0), ("b/0.jpg", 1)]
    assert caplog.text.count("are skipped") == 1  # said once for the split
    assert "3 hidden files and folders (names starting with '.') are skipped" in caplog.text
    assert ".ipynb_checkpoints" in caplog.text


def test_images_directly_in_the_split_folder_are_named(tmp_path, caplog) -> None:
    make_folder(tmp_path, {"a": 1, "b": 1})
    for i in range(4):
        noise_image(tmp_path / f"loose{i}.jpg", (8, 8))
    (tmp_path / "README.txt").write_text("not an image")
    with caplog.at_level("WARNING"):
        _, samples = imagefolder.scan(tmp_path)
    assert len(samples) == 2
    assert f"{tmp_path}: 4 image files lie directly in it, in no class folder" in caplog.text
    assert str(tmp_path / "loose0.jpg") in caplog.text


def test_one_class_folder_is_refused_naming_it_and_the_fix(tmp_path) -> None:
    """The train/train/<class>/ nesting: one class "train", every label 0, loss 0 and accuracy
    1.0 from the first step. Refused as a data.factory with num_classes=1 is."""
    for split in ("train", "val"):
        make_folder(tmp_path / split / split, {"cat": 2, "dog": 2})
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path), image_size=16)
    with pytest.raises(ConfigError) as caught:
        data.build_datasets(cfg, 0, DistInfo(0, 0, 1, CPU))
    message = str(caught.value)
    assert f"{tmp_path / 'train'} holds one class folder, 'train' (4 images)" in message
    assert f"{tmp_path / 'train' / 'train'}" in message and "one level" in message


@pytest.mark.slow
@pytest.mark.e2e
def test_train_py_exits_2_on_one_class_folder(tmp_path) -> None:
    for split in ("train", "val"):
        make_folder(tmp_path / "img" / split / split, {"cat": 2, "dog": 2}, size=(12, 12))
    args = [f"--data.root={tmp_path / 'img'}", "--data.dataset=imagefolder"]
    done = subprocess.run(
        [sys.executable, "train.py", f"--run.dir={tmp_path / 'run'}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{tmp_path / 'img' / 'train'} holds one class folder, 'train'" in done.stderr


def test_non_utf8_file_names_load_and_are_named_readably(tmp_path, caplog) -> None:
    """Linux names are bytes; Python gives the undecodable ones as str with surrogate escapes
    (PEP 383), which torchvision.io.read_file cannot pass to C++ ("Unable to cast Python
    instance of type <class 'str'>")."""
    root = os.fsencode(tmp_path)
    make_folder(tmp_path, {"b": 1})
    os.mkdir(os.path.join(root, b"caf\xe9"))
    noise_image(Path(os.fsdecode(os.path.join(root, b"caf\xe9", b"\xff.png"))), (10, 12))
    with open(os.path.join(root, b"caf\xe9", b"bad\xe9.jpg"), "wb") as file:
        file.write(b"not an image")
    images = folder(tmp_path, size=8)
    assert images.classes == ["b", "caf\\xe9"]  # as `ls --quoting-style=escape` would show it
    assert [label for _, label in images.samples] == [0, 1, 1]
    image, label = images[2]  # caf\xe9/\xff.png
    assert label == 1 and image.shape == (3, 8, 8)
    with pytest.raises(imagefolder.UnreadableImage) as caught:
        images[1]  # caf\xe9/bad\xe9.jpg
    assert f"{tmp_path}/caf\\xe9/bad\\xe9.jpg" in str(caught.value)
    str(caught.value).encode("utf-8")  # no lone surrogate left to break a log file's encoding


def test_jpeg_extensions_torchvision_reads_are_trained_and_other_files_named(tmp_path, caplog):
    """`.jfif`, `.jpe` and `.jif` are JPEG files (the JFIF standard's own extensions; cameras
    and browsers save them), which torchvision.io decodes by content; before this they were
    dropped without a word (9 of 90 files in one user's folder). Formats no decoder here reads
    (`.heif`) and files that are no images are named, not silently dropped."""
    make_folder(tmp_path, {"a": 1, "b": 1})
    for name in ("a/x.jfif", "a/y.JPE", "b/z.jif"):
        noise_image(tmp_path / "a" / "0.jpg", (16, 16), seed=len(name))
        (tmp_path / name).write_bytes((tmp_path / "a" / "0.jpg").read_bytes())
    (tmp_path / "b" / "photo.heif").write_bytes(b"\x00\x00\x00\x18ftypheic")
    (tmp_path / "b" / "labels.csv").write_text("x,1\n")
    with caplog.at_level("INFO"):
        _, samples = imagefolder.scan(tmp_path)
    found = {Path(p).relative_to(tmp_path).as_posix() for p, _ in samples}
    assert {"a/x.jfif", "a/y.JPE", "b/z.jif"} <= found
    assert "1 image files in formats this pipeline does not read are left out" in caplog.text
    assert "b/photo.heif" in caplog.text
    assert "1 other files (not images, by their extension) are left out" in caplog.text
    assert "b/labels.csv" in caplog.text
    dataset = folder(tmp_path)
    for index, (path, _) in enumerate(samples):  # every one decodes as the JPEG it is
        assert dataset[index][0].shape == (3, 32, 32), path
