"""Atomic, verified writes of checkpoint files, and the error of a checkpoint that cannot be used.

A file is written to a temporary name beside its final one, fsynced, renamed over the final
name, and the directory fsynced. A checkpoint's bytes are checksummed (CRC-32) as torch.save
writes them, and their size on disk checked, before any manifest vouches for them. Under a
held run dir the fence (ckpt/fence.py) is checked before the temporary file is made and again
before it is renamed: a process that lost the run dir never finishes a write there.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ckpt import fence

_READ_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the reason."""

    exit_code = 2  # bad input: a restart cannot fix it


# How an allocation failure reads when torch raises it as a RuntimeError: c10's CPU allocator
# ("DefaultCPUAllocator: can't allocate memory", c10/core/impl/alloc_cpu.cpp), and "not enough
# memory" where an allocator reports it so (Windows' c10 allocator, some storage resizes).
_ALLOCATION_FAILED = ("can't allocate memory", "not enough memory")


def not_about_content(err: BaseException, what: str) -> BaseException | None:
    """What to raise instead of calling `what` (a checkpoint) unusable, when loading it failed
    for a reason that is not in its bytes: an allocation failure (a MemoryError naming `what`,
    which train.py exits on as it does on any out-of-memory) or an OSError (itself: its errno
    classes it, exitcodes.py). None when the error is about the content. An older checkpoint
    would fail the same way, or load and silently drop the newer one's training: neither is a
    reason to fall back."""
    if isinstance(err, OSError):
        return err
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, MemoryError | torch.OutOfMemoryError) or (
            isinstance(current, RuntimeError)
            and any(text in str(current) for text in _ALLOCATION_FAILED)
        ):
            first = str(current).strip().splitlines()[0] if str(current).strip() else ""
            return MemoryError(
                f"loading {what} ran out of memory ({first or type(current).__name__})"
            )
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_temporary(path: Path, write: Callable[[BinaryIO], Any]) -> Path:
    """Call `write(file)` on a temporary file next to `path` and fsync it; return its path.

    A failed write removes the temporary file and raises an OSError naming `path`. A fence
    lost meanwhile raises RunDirBusy and leaves the file (the new holder's next save removes
    it): this process deletes nothing in a run dir it lost either.
    """
    fence.check(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:  # e.g. a full disk: flush() alone would not say which file
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, f"cannot write {path}: {err.strerror or err}") from err
    except RuntimeError as err:
        tmp.unlink(missing_ok=True)
        # torch.save reports a failed write of its own (ENOSPC, EIO) as "enforce fail at
        # inline_container.cc ... unexpected pos", the OSError only in the exception's context.
        cause = _os_error_behind(err)
        if cause is None:
            raise
        raise OSError(cause.errno, f"cannot write {path}: {cause.strerror or cause}") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fence.check(path)  # last, right before the caller renames it into place
    return tmp


def write_bytes(path: Path, write: Callable[[BinaryIO], Any], sync_dir: bool = True) -> None:
    """Call `write(file)` on a temporary file next to `path`, then fsync and rename it.

    `sync_dir=False` leaves the directory's fsync to a later atomic write in the same
    directory (one directory fsync makes every rename before it durable).
    """
    tmp = write_temporary(path, write)
    try:
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, f"cannot write {path}: {err.strerror or err}") from err
    if sync_dir:
        fsync_dir(path.parent)


def _os_error_behind(err: BaseException) -> OSError | None:
    """The OSError an exception was raised from or while handling, if any."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class _HashingWriter:
    """File wrapper that checksums (CRC-32) and counts what `torch.save` writes through it."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.crc32 = 0
        self.bytes = 0

    def write(self, chunk: bytes) -> int:
        self.crc32 = zlib.crc32(chunk, self.crc32)
        self.bytes += len(chunk)
        return self.file.write(chunk)

    def flush(self) -> None:
        self.file.flush()


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (in host memory) as the only tensor of its storage: torch.save writes a
    tensor's whole storage, so a view (a slice of a loaded tensor, an FSDP2 shard of a padded
    buffer) is copied first, or the file would hold every byte of what it views. A tensor
    that spans its storage is returned as it is (its memory format, and its sharing with
    another name of the same tensor, kept)."""
    tensor = tensor.detach()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def file_crc32(path: Path) -> str:
    """CRC-32 of a file as 8 hex digits: detects truncation, bit flips and garbage (not
    tampering; that is what weights_only loading guards against), at several GB/s."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def torch_save_config() -> Any:
    """torch's settings for torch.save (`torch.utils.serialization.config.save`) where they
    hold the switch for the records' CRCs (`compute_crc32`), else None."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return None
    save_config = getattr(config, "save", None)
    return save_config if hasattr(save_config, "compute_crc32") else None


@contextlib.contextmanager
def _without_record_crcs() -> Iterator[None]:
    """torch.save without the CRC-32 of each record of its zip file, then as it was.

    The manifest's CRC-32 covers every byte of the file already, and torch.load does not check
    the records' CRCs (a flipped bit in a tensor loads as a wrong value, without an error:
    tests/test_checkpoint.py). Computing both cost a save CPU time (BENCHMARKS.md,
    "Checkpoints"), taken from training wherever the writer process has no core of its own.
    Zip tools (`unzip -t`)
    report the records' zeroed CRCs as wrong; torch.load reads the file. torch 2.14 keeps a
    setting made this way per thread (a ContextVar in torch/utils/_config_module.py), so a
    torch.save in another thread keeps its CRCs; a release that keeps it per process would
    skip them there too while a checkpoint is written. A release without the switch
    (`torch.utils.serialization.config.save.compute_crc32`) computes them.
    """
    save_config = torch_save_config()
    if save_config is None:
        yield
        return
    previous = save_config.compute_crc32
    save_config.compute_crc32 = False
    try:
        yield
    finally:
        save_config.compute_crc32 = previous


def write_checked(path: Path, payload: Any) -> tuple[Path, int, str]:
    """torch.save `payload` to a fsynced temporary file beside `path`; (that file, bytes,
    CRC-32). Verified before any manifest vouches for it: complete (the size on disk is what
    was written, after fsync) and checksummed from the very bytes torch.save produced. Reading
    it back now would only read the page cache, not the disk, at the cost of a second pass."""
    hashed: list[_HashingWriter] = []

    def write(f: BinaryIO) -> None:
        writer = _HashingWriter(f)
        with _without_record_crcs():
            torch.save(payload, writer)
        hashed.append(writer)
        f.flush()

    tmp = write_temporary(path, write)
    if tmp.stat().st_size != hashed[0].bytes:
        size = tmp.stat().st_size
        tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"checkpoint {path} is {size} bytes on disk, {hashed[0].bytes} were written: the "
            "storage lost part of the write"
        )
    return tmp, hashed[0].bytes, f"{hashed[0].crc32:08x}"
