"""Image files: the user's `root/<class>/<image>` folders, decoded with torchvision.io
(libjpeg-turbo, libpng, libwebp, giflib) to 8-bit RGB and transformed as torchvision's
classification references transform them: RandomResizedCrop and a horizontal flip for
training, resize then center crop for evaluation.

A scan (`scan`) reads each real folder once, however many symbolic links reach it, and never
for two classes; it skips hidden entries and says what it left out.

Every random choice of a training sample (the crop's area, aspect and place, the flip) comes
from a hash of (seed, epoch, index), so a sample gets the same crop whichever rank or loader
worker reads it, and a resumed run (on any world size) sees exactly the crops an uninterrupted
one would have. Images stay uint8 until they reach the device (inputs.loaders.Preprocess
normalises there): four times less to decode into, copy and collate than float.

Where the files are decoded is data.decode's choice (auto.decode). By default the loader
workers decode them on the CPU (`ImageFolder.__getitem__`, `augmented_item`). With
data.decode=device the workers only read each file's bytes (`encoded_item`) and the training
process decodes a whole batch at once on its device (`decode_batch`: nvJPEG on a GPU), then
crops and resizes there with the same transforms; on a CPU that path gives exactly the worker
path's pixels.
"""

from __future__ import annotations

import logging
import math
import os
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset

from config import IGNORED as SKIPPED  # a skipped image's label: left out of every count
from config import ConfigError

log = logging.getLogger(__name__)
# torchvision 0.29 deprecates its image decoders in favour of TorchCodec 0.16 (which needs torch
# >= 2.11); they are the same libjpeg-turbo and libpng, and the GPU image's torchvision has them.
warnings.filterwarnings("ignore", "The image decoding and encoding", DeprecationWarning)

# What torchvision.io decodes (it reads the format from the bytes, not the name): the JPEG
# family under all its extensions (.jfif, .jpe and .jif are JFIF's own), PNG, WebP and GIF.
EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".jif", ".png", ".webp", ".gif")
# Images torchvision.io cannot decode here (torchvision's ImageFolder reads some through PIL).
OTHER_IMAGES = (".bmp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".avif", ".heic", ".heif")
OTHER_IMAGES += (".jxl", ".jp2", ".j2k", ".ico", ".tga", ".dng", ".cr2", ".nef", ".arw")
DECODE_CHUNK = 32  # images decoded at once on the device (decode_batch)
RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's aspect-ratio range (torchvision's default)
SPLIT = -1  # the owner of the split folder itself in a scan (no class)
NAMED = 3  # examples a scan's warnings name


class UnreadableImage(OSError):
    """An image file that cannot be read or decoded; the message names it."""


def shown(path: str | os.PathLike) -> str:
    """`path` as a message can print it: bytes that are not UTF-8 (a Latin-1 "caf\\xe9.jpg",
    which Python holds as a lone surrogate, PEP 383) as backslash escapes, as `ls -b` shows
    them. A lone surrogate would make a UTF-8 log file or marker file raise instead."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


@dataclass
class _Walk:
    """What scanning one split's class folders finds. Each real folder (by device and inode) is
    read once, for the first class that reaches it: `owners` maps it to (label, the path it was
    reached by)."""

    classes: list[str] = field(default_factory=list)
    owners: dict[tuple[int, int], tuple[int, str]] = field(default_factory=dict)
    files: list[tuple[str, int]] = field(default_factory=list)
    links: list[tuple[str, int]] = field(default_factory=list)  # links to folders, to follow
    hidden: list[str] = field(default_factory=list)
    loops: list[str] = field(default_factory=list)  # links to a folder that holds them
    again: list[str] = field(default_factory=list)  # folders reached a second time

    def claim(self, folder: str, label: int) -> bool:
        """Whether `folder` is new (now `label`'s); False when `label` already has it. A folder
        another class (or the split itself) has is refused: its images would get two labels."""
        st = os.stat(folder)
        key = (st.st_dev, st.st_ino)
        if key not in self.owners:
            self.owners[key] = (label, folder)
            return True
        owner, first = self.owners[key]
        if owner == label:
            self.again.append(f"{shown(folder)} (the folder {shown(first)})")
            return False
        where = "the split's own folder" if owner == SPLIT else f"class {self.classes[owner]!r}"
        raise ConfigError(
            f"{shown(folder)} is the folder {shown(first)} ({where}) reached through a symbolic "
            f"link from class {self.classes[label]!r}: its images would get two labels. Remove "
            "the link: each folder of images belongs to one class"
        )

    def tree(self, top: str, label: int) -> None:
        """The files under `top` for `label`, its subfolders too; links to folders are queued
        in `links` (`follow` reads them once every plain folder is claimed, so a folder that
        lies in a class is that class's, whichever links reach it first)."""
        if not self.claim(top, label):
            return
        stack = [top]
        while stack:
            folder = stack.pop()
            try:
                entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
            except OSError as err:  # os.walk would skip it without a word
                raise ConfigError(f"cannot list {shown(folder)}: {err.strerror}") from None
            for entry in entries:
                if entry.name.startswith("."):  # .ipynb_checkpoints, .DS_Store, ._x.jpg
                    self.hidden.append(shown(entry.path))
                elif not entry.is_dir():  # a file, or a dangling link: named if it is an image
                    self.files.append((entry.path, label))
                elif entry.is_symlink():
                    self.links.append((entry.path, label))
                elif self.claim(entry.path, label):
                    stack.append(entry.path)

    def follow(self) -> None:
        """Read the queued links to folders, round by round in sorted order (every rank finds
        the same samples): a link to a folder that holds it (`loop -> ..`, `self -> .`) would
        read the split again under this class, so it is left out (`loops`)."""
        while self.links:
            links, self.links = sorted(self.links), []
            for link, label in links:
                target = os.path.realpath(link)
                here = os.path.realpath(os.path.dirname(link))
                if os.path.commonpath([target, here]) == target:
                    self.loops.append(f"{shown(link)} -> {shown(target)}")
                else:
                    self.tree(link, label)


def _said(root: Path, what: str, items: Sequence[str], level: int = logging.WARNING) -> None:
    """One log line for `what` with the number of `items` and the first few, from one rank
    (every rank scans)."""
    if items and os.environ.get("RANK", "0") == "0":
        examples = ", ".join(sorted(items)[:NAMED]) + (", ..." if len(items) > NAMED else "")
        log.log(level, "%s: %d %s: %s", shown(root), len(items), what, examples)


def _class_folders(root: Path, walk: _Walk) -> tuple[list[str], list[str]]:
    """The class folder names in `root`, sorted, and the image files lying beside them."""
    names, loose = [], []
    for entry in os.scandir(root):
        if entry.name.startswith("."):
            walk.hidden.append(shown(entry.path))
        elif entry.is_dir():
            names.append(entry.name)
        elif entry.name.lower().endswith(EXTENSIONS + OTHER_IMAGES):
            loose.append(shown(entry.path))
    if not names:
        raise ConfigError(
            f"{shown(root)} has no class folders: put images in {shown(root)}/<class>/"
        )
    return sorted(names), loose


def scan(root: Path, known: Sequence[str] | None = None) -> tuple[list[str], list[tuple[str, int]]]:
    """The class folders of `root` (sorted: a label is a class's index in that order) and
    every image file under them, sorted by path. Symbolic links are followed, each real folder
    read once (`_Walk`); hidden files and folders (a name starting with '.') are skipped.

    `known`: the training split's classes, for the validation split. Its labels are indices
    into them; a class it lacks, or whose folder holds no images, is named in a warning (that
    class trains, and is not evaluated), while a class the training split lacks is refused."""
    walk = _Walk()
    names, loose = _class_folders(root, walk)
    shown_names = [shown(name) for name in names]
    classes = list(known) if known is not None else shown_names
    _refuse_unknown_classes(root, classes, shown_names)
    walk.classes = classes
    walk.claim(str(root), SPLIT)
    for name, seen in zip(names, shown_names, strict=True):
        walk.tree(os.path.join(root, name), classes.index(seen))
    walk.follow()
    found: list[list[str]] = [[] for _ in classes]
    unread, others = [], []
    for path, label in walk.files:
        if path.lower().endswith(EXTENSIONS):
            found[label].append(path)
        else:
            (unread if path.lower().endswith(OTHER_IMAGES) else others).append(shown(path))
    _report(root, walk, loose, unread)
    _said(root, "other files (not images, by their extension) are left out", others, logging.INFO)
    if known is None:
        _refuse_empty_classes(root, walk.classes, found)
    else:
        unseen = [name for name, paths in zip(classes, found, strict=True) if not paths]
        what = "classes have no images here: they are trained, and not evaluated"
        _said(root, what, unseen)
    return walk.classes, [
        (path, label) for label, paths in enumerate(found) for path in sorted(paths)
    ]


def _refuse_unknown_classes(root: Path, classes: list[str], names: list[str]) -> None:
    extra = sorted(set(names) - set(classes))
    if extra:
        raise ConfigError(
            f"{shown(root)} has class folders {extra} that the training split lacks (it has "
            f"{classes}): a label is a class's index in the training split's sorted class "
            "folders, so every class evaluated must be trained. Remove them or add them to "
            "the training split"
        )


def _report(root: Path, walk: _Walk, loose: list[str], unread: list[str]) -> None:
    """What the scan left out, and why: one line each, once."""
    _said(root, "image files lie directly in it, in no class folder, and are left out", loose)
    hidden = "hidden files and folders (names starting with '.') are skipped"
    _said(root, hidden, walk.hidden, logging.INFO)
    loops = "symbolic links lead to a folder that holds them (a loop) and are not followed"
    _said(root, loops, walk.loops)
    _said(root, "folders reached a second time through symbolic links are read once", walk.again)
    other = "image files in formats this pipeline does not read are left out (convert them to "
    _said(root, other + "JPEG or PNG to train on them)", unread)


def _refuse_empty_classes(root: Path, classes: list[str], found: list[list[str]]) -> None:
    for name, paths in zip(classes, found, strict=True):
        if not paths:
            raise ConfigError(
                f"class folder {shown(root)}/{name} holds no images (files ending in "
                f"{', '.join(EXTENSIONS)}, any case)"
            )


def _unreadable(path: str, err: Exception) -> UnreadableImage:
    return UnreadableImage(f"cannot read image {shown(path)}: {type(err).__name__}: {err}")


def read_bytes(path: str) -> torch.Tensor:
    """The file at `path` as a 1-D uint8 tensor, or UnreadableImage naming it. Read by Python,
    not torchvision.io.read_file: a name that is not UTF-8 reaches Python as a str with lone
    surrogates (PEP 383), which read_file cannot pass to C++ ("Unable to cast Python instance
    of type <class 'str'>"); open() encodes it back to the original bytes."""
    try:
        with open(path, "rb") as file:
            encoded = torch.empty(os.fstat(file.fileno()).st_size, dtype=torch.uint8)
            size = file.readinto(encoded.numpy())
    except OSError as err:  # missing, unreadable, a directory
        raise _unreadable(path, err) from None
    return encoded[:size]


def decode(encoded: torch.Tensor, path: str) -> torch.Tensor:
    """An encoded image (any format torchvision.io reads) as a uint8 RGB tensor (3, H, W) on
    the CPU, or UnreadableImage naming `path`.

    torchvision.io decodes a 16-bit PNG to uint16, 0..65535 (decode_image's docstring in
    torchvision/io/image.py; decode_png.cpp allocates UInt16 for bit depth 16): it becomes
    uint8 as torchvision's `to_dtype(..., scale=True)` makes it (the high byte, v >> 8), so
    it trains as its 8-bit version would. An animated GIF decodes to (frames, 3, H, W)
    (decode_gif.cpp, always RGB whatever the mode): its first frame is the image."""
    from torchvision import io

    try:
        image = io.decode_image(encoded, mode=io.ImageReadMode.RGB)
    except Exception as err:  # a truncated or non-image file; decode errors vary
        raise _unreadable(path, err) from None
    if image.dim() == 4:
        image = image[0]
    if image.dtype != torch.uint8:
        from torchvision.transforms.v2 import functional as F

        image = F.to_dtype(image, torch.uint8, scale=True)
    return image


def read(path: str) -> torch.Tensor:
    """The image at `path` as a uint8 RGB tensor (3, H, W), or UnreadableImage naming it."""
    return decode(read_bytes(path), path)


def is_jpeg(encoded: torch.Tensor) -> bool:
    """Whether the bytes start as a JPEG file does (the SOI marker and the next marker's 0xFF)."""
    return encoded.numel() >= 3 and encoded[:3].tolist() == [0xFF, 0xD8, 0xFF]


def is_complete_jpeg(encoded: torch.Tensor) -> bool:
    """A JPEG whose end-of-image marker (FF D9) is in its last KiB (after it, cameras may
    append padding). nvJPEG decodes a truncated file without an error, into grey pixels;
    libjpeg-turbo through torchvision refuses it, so such files go to the CPU decoder."""
    if not is_jpeg(encoded):
        return False
    tail = encoded[-1024:]
    return bool(((tail[:-1] == 0xFF) & (tail[1:] == 0xD9)).any())


def decode_many(
    encoded: Sequence[torch.Tensor], paths: Sequence[str], device: torch.device
) -> list[torch.Tensor | UnreadableImage]:
    """Each encoded image as a uint8 RGB tensor (3, H, W) on `device`, or the UnreadableImage
    naming its path.

    The JPEGs go to one batched `decode_jpeg` call on the device (nvJPEG on a GPU,
    libjpeg-turbo on a CPU); other formats, and every image of a batch the device decoder
    refused (it fails the whole call for one bad file, or for a JPEG flavour it lacks), are
    decoded one by one on the CPU and copied over.

    On a GPU the decoding runs on a stream of its own. nvJPEG's hardware engine may write its
    output before work already queued on the stream it is given has run (pytorch/vision#9606,
    meta-pytorch/torchcodec#1634), so that stream must hold nothing else: output memory the
    caching allocator recycles there is memory that only finished decodes used. The current
    stream then waits for the decoding, and the allocator for the current stream's use of the
    images (`record_stream`) before recycling them.
    """
    if device.type != "cuda":
        return _decode_many(encoded, paths, device)
    stream = _decode_stream(device)
    with torch.cuda.stream(stream):
        out = _decode_many(encoded, paths, device)
    current = torch.cuda.current_stream(device)
    current.wait_stream(stream)
    for image in out:
        if isinstance(image, torch.Tensor):
            image.record_stream(current)
    return out


_DECODE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_FALLBACK_LOGGED: list[bool] = []


def _decode_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _DECODE_STREAMS:
        _DECODE_STREAMS[device] = torch.cuda.Stream(device)
    return _DECODE_STREAMS[device]


def _decode_many(
    encoded: Sequence[torch.Tensor], paths: Sequence[str], device: torch.device
) -> list[torch.Tensor | UnreadableImage]:
    from torchvision import io

    out: list[torch.Tensor | UnreadableImage | None] = [None] * len(encoded)
    jpegs = [i for i, data in enumerate(encoded) if is_complete_jpeg(data)]
    if jpegs:
        try:
            decoded = io.decode_jpeg(
                [encoded[i] for i in jpegs], mode=io.ImageReadMode.RGB, device=device
            )
        except RuntimeError as err:  # one bad file fails the call: each image on its own below
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # nothing of the failed call still writes
                if "out of memory" in str(err) or "CUDA error" in str(err):
                    raise
            if not _FALLBACK_LOGGED:
                _FALLBACK_LOGGED.append(True)
                log.warning(
                    "the batched JPEG decoder refused a batch (%s); its images are decoded one by "
                    "one on the CPU (said once)",
                    err,
                )
            decoded = []
        for i, image in zip(jpegs, decoded, strict=False):
            out[i] = image
    for i, image in enumerate(out):
        if image is None:
            try:
                out[i] = decode(encoded[i], paths[i]).to(device, non_blocking=True)
            except UnreadableImage as err:
                out[i] = err
    return out  # type: ignore[return-value]


def device_decoding_problem(device: torch.device) -> str | None:
    """None when `decode_jpeg` works on `device` and agrees with the CPU's libjpeg-turbo (up
    to the rounding JPEG decoders differ by); else what went wrong."""
    from torchvision import io

    ys, xs = torch.meshgrid(torch.arange(48), torch.arange(64), indexing="ij")
    image = torch.stack([ys * 5, xs * 4, (ys + xs) * 2]).to(torch.uint8)
    try:
        encoded = io.encode_jpeg(image, quality=95)
        expected = io.decode_jpeg(encoded, mode=io.ImageReadMode.RGB)
        stream = _decode_stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(stream):  # a no-op for None
            got = io.decode_jpeg([encoded], mode=io.ImageReadMode.RGB, device=device)[0].cpu()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an asynchronous error shows here, not later
    except Exception as err:  # no nvJPEG in this build, a driver error, ...
        return f"{type(err).__name__}: {err}"
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"decoded a {tuple(expected.shape)} test image as {tuple(got.shape)} {got.dtype}"
    error = (got.float() - expected.float()).abs().mean().item()
    if error > 2:
        return f"decoded a test image {error:.1f} levels away from libjpeg-turbo on average"
    return None


def crop_box(
    height: int, width: int, rnd: random.Random, scale: Sequence[float]
) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (top, left, height, width): an area of `scale` of the image's
    and an aspect ratio in 3/4..4/3 (uniform in log), ten tries to fit, then the center crop
    of the image clamped to that ratio range."""
    area = height * width
    log_low, log_high = math.log(RATIO[0]), math.log(RATIO[1])
    for _ in range(10):
        target = area * rnd.uniform(scale[0], scale[1])
        aspect = math.exp(rnd.uniform(log_low, log_high))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rnd.randint(0, height - h), rnd.randint(0, width - w), h, w
    if width / height < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif width / height > RATIO[1]:
        w, h = round(height * RATIO[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class ImageFolder(Dataset):
    """`root/<class>/<image>` files as (uint8 image, label) pairs: eval view by index, the
    training view through `augmented_item` (see inputs.augment.Augmented)."""

    def __init__(
        self,
        root: Path,
        image_size: int,
        crop_ratio: float,
        crop_scale: Sequence[float],
        skip_bad: bool,
        known: Sequence[str] | None = None,
        eval_size: tuple[int, int] = (0, 0),
    ) -> None:
        self.root = root
        self.classes, self.samples = scan(root, known)
        self.image_size = image_size  # the training crop's side
        # The evaluation's center crop and the shorter side resized to before it (data.eval_size)
        self.eval_crop_size = eval_size[0] or image_size
        self.resize_size = eval_size[1] or int(self.eval_crop_size / crop_ratio)
        self.crop_scale = tuple(crop_scale)
        self.skip_bad = skip_bad

    def __len__(self) -> int:
        return len(self.samples)

    def _skip_or_raise(self, err: UnreadableImage) -> None:
        if not self.skip_bad:
            raise err
        log.warning("skipping (data.bad_images=skip): %s", err)

    def _read(self, index: int) -> tuple[torch.Tensor | None, int]:
        path, label = self.samples[index]
        try:
            return read(path), label
        except UnreadableImage as err:
            self._skip_or_raise(err)
            return None, SKIPPED

    def _blank(self, device: torch.device | str = "cpu", train: bool = True) -> torch.Tensor:
        side = self.image_size if train else self.eval_crop_size
        return torch.zeros(3, side, side, dtype=torch.uint8, device=device)

    def eval_view(self, image: torch.Tensor) -> torch.Tensor:
        """The shorter side resized to resize_size, then the center eval_crop_size square."""
        from torchvision.transforms.v2 import functional as F

        image = F.resize(image, [self.resize_size], antialias=True)
        return F.center_crop(image, [self.eval_crop_size, self.eval_crop_size])

    def train_view(self, image: torch.Tensor, key: int) -> torch.Tensor:
        """A random crop (`crop_box`) resized to image_size x image_size, then flipped
        left-right with probability 1/2; every choice drawn from `key`, the sample's hash of
        (seed, epoch, index)."""
        from torchvision.transforms.v2 import functional as F

        rnd = random.Random(key)
        top, left, h, w = crop_box(image.shape[-2], image.shape[-1], rnd, self.crop_scale)
        size = [self.image_size, self.image_size]
        image = F.resized_crop(image, top, left, h, w, size, antialias=True)
        return image.flip(-1) if rnd.random() < 0.5 else image

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Evaluation view (`eval_view`) of sample `index`."""
        image, label = self._read(index)
        return (self._blank(train=False) if image is None else self.eval_view(image)), label

    def augmented_item(self, index: int, key: int) -> tuple[torch.Tensor, int]:
        """Training view (`train_view`) of sample `index`, its choices drawn from `key`."""
        image, label = self._read(index)
        return (self._blank() if image is None else self.train_view(image, key)), label

    def encoded_item(self, index: int) -> tuple[torch.Tensor, str, int]:
        """Sample `index` undecoded, for `decode_batch`: (file bytes, path, label); an
        unreadable file skipped is empty bytes with label SKIPPED."""
        path, label = self.samples[index]
        try:
            return read_bytes(path), path, label
        except UnreadableImage as err:
            self._skip_or_raise(err)
            return torch.empty(0, dtype=torch.uint8), path, SKIPPED

    def decode_batch(
        self,
        encoded: Sequence[torch.Tensor],
        paths: Sequence[str],
        labels: torch.Tensor,
        keys: Sequence[int] | None,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of `encoded_item`s decoded on `device` (`decode_many`) and transformed there:
        the training view with `keys` (one per sample), else the evaluation view. Returns the
        uint8 batch and the labels, SKIPPED where an image was skipped; the same pixels as
        `augmented_item` / `__getitem__` when `device` is the CPU."""
        labels = labels.clone()
        views = []
        # In chunks: full-size images are large (a 12-megapixel photo is 36 MB as RGB), and a
        # chunk's are freed once cropped, before the next chunk is decoded.
        for start in range(0, len(encoded), DECODE_CHUNK):
            chunk = slice(start, start + DECODE_CHUNK)
            for i, image in enumerate(decode_many(encoded[chunk], paths[chunk], device), start):
                if isinstance(image, UnreadableImage):
                    if labels[i] != SKIPPED:  # not already skipped when its bytes were read
                        self._skip_or_raise(image)
                        labels[i] = SKIPPED
                    views.append(self._blank(device, train=keys is not None))
                elif keys is None:
                    views.append(self.eval_view(image))
                else:
                    views.append(self.train_view(image, keys[i]))
        return torch.stack(views), labels


def require_two_classes(folder: ImageFolder) -> None:
    """Refuse a training folder of one class folder: every label 0, so loss 0 and accuracy 1.0
    from the first step (the train/train/<class>/ nesting of an unpacked archive), as a
    data.factory with num_classes=1 is refused."""
    if len(folder.classes) == 1:
        only = folder.classes[0]
        raise ConfigError(
            f"{shown(folder.root)} holds one class folder, {only!r} ({len(folder)} images): a "
            f"classifier needs two classes or more. If {shown(folder.root)}/{only} holds the "
            "class folders (the train/train/<class>/ nesting), they sit one level too deep: "
            f"move them up into {shown(folder.root)}/ (data.root is the folder whose train/ and "
            "val/ hold the class folders directly)"
        )
