"""Checkpoints: atomic, verified writes by rank 0, retention, and safe loading on every rank.

Layout of `<run.dir>/checkpoints/`:
    step_<N>.pt             the state, written by `torch.save`
    step_<N>.manifest.json  {"file", "bytes", "crc32", "step"}: written last, after the .pt is
                            durable, so a checkpoint without one is incomplete
    best.json               {"step", "accuracy"} of the best evaluated checkpoint

Every file is written to a temporary name in the same directory, fsynced, renamed over its
final name and the directory fsynced: a crash at any point leaves the previous checkpoints
as they were and at worst an incomplete new one, which loading recognises and skips.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d+)\.pt$")
BEST_FILE = "best.json"
_READ_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the reason."""

    exit_code = 2  # bad input: a restart cannot fix it


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".pt") + ".manifest.json")


def next_manifest_path(path: Path) -> Path:
    """The manifest of a replacement of `path` while it is being renamed into place."""
    return path.with_name(path.name.removesuffix(".pt") + ".manifest.next.json")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_temporary(path: Path, write: Callable[[BinaryIO], Any]) -> Path:
    """Call `write(file)` on a temporary file next to `path` and fsync it; return its path.

    A failed write removes the temporary file and raises an OSError naming `path`.
    """
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
    return tmp


def atomic_write_bytes(path: Path, write: Callable[[BinaryIO], Any], sync_dir: bool = True) -> None:
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
        _fsync_dir(path.parent)


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


def file_crc32(path: Path) -> str:
    """CRC-32 of a file as 8 hex digits: detects truncation, bit flips and garbage (not
    tampering; that is what weights_only loading guards against), at several GB/s."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_<N>.pt` in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def read_best(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / BEST_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _remove_stale_temporaries(directory: Path) -> None:
    """Delete temporary files left by a save that was killed (only rank 0 of one job writes
    here, and never two saves at once, so no temporary file belongs to a live save)."""
    for path in directory.glob(".*.tmp"):
        path.unlink(missing_ok=True)
    # A re-save killed between its rename and its manifest: the second manifest becomes the
    # manifest if it vouches for the bytes in place, else it vouches for nothing.
    for pending in directory.glob("step_*.manifest.next.json"):
        path = pending.with_name(pending.name.removesuffix(".manifest.next.json") + ".pt")
        try:
            size, crc = _read_manifest(pending)
            settled = path.is_file() and (path.stat().st_size, file_crc32(path)) == (size, crc)
        except (OSError, CheckpointError):
            settled = False
        if settled:
            os.replace(pending, manifest_path(path))
        else:
            pending.unlink(missing_ok=True)


def save(
    state: dict[str, Any], directory: Path, step: int, keep: int, accuracy: float | None
) -> Path:
    """Write `state` as `step_<step>.pt` with its manifest, update best.json, prune old ones.

    Call on rank 0 only. The new file is fsynced and its size checked before its manifest
    (with the CRC-32 of the bytes written) exists, and pruning happens only after that: the
    newest good checkpoint is never removed before its successor is verified.
    """
    require_finite(state.get("model", {}), step)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(directory)
    path = directory / f"step_{step}.pt"
    hashed: list[_HashingWriter] = []

    def write(f: BinaryIO) -> None:
        writer = _HashingWriter(f)
        torch.save(state, writer)
        hashed.append(writer)
        f.flush()

    # Re-saving a step (a resumed run saves again the step it was preempted at) must not
    # invalidate the good checkpoint of that step before its replacement is durable: the new
    # bytes go to a temporary file first, a second manifest vouches for them before they are
    # renamed over the old ones, and only then does the manifest proper change. At every
    # point the file under the final name matches one of the two manifests.
    replacing = path.exists() or manifest_path(path).exists()
    tmp = write_temporary(path, write)
    # Verified before any manifest vouches for it: complete (the size on disk is what was
    # written, after fsync) and checksummed from the very bytes torch.save produced. Reading it
    # back now would only read the page cache, not the disk, at the cost of a second pass.
    expected = f"{hashed[0].crc32:08x}"
    if tmp.stat().st_size != hashed[0].bytes:
        size = tmp.stat().st_size
        tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"checkpoint {path} is {size} bytes on disk, {hashed[0].bytes} were written: the "
            "storage lost part of the write"
        )
    manifest = {"file": path.name, "bytes": hashed[0].bytes, "crc32": expected, "step": step}
    payload = (json.dumps(manifest) + "\n").encode()
    if replacing:
        atomic_write_bytes(next_manifest_path(path), lambda f: f.write(payload))
    # The manifest's write below fsyncs the directory for this rename too. Until then a crash
    # may lose the new name: loading skips a manifest without its file, and the older ones
    # remain.
    os.replace(tmp, path)
    atomic_write_bytes(manifest_path(path), lambda f: f.write(payload))
    next_manifest_path(path).unlink(missing_ok=True)
    best = read_best(directory)
    if best is not None and best["step"] > step:  # left by an abandoned later run: stale
        best = None
    if accuracy is not None and (best is None or accuracy > best["accuracy"]):
        best = {"step": step, "accuracy": accuracy}
        best_payload = json.dumps(best).encode()
        atomic_write_bytes(directory / BEST_FILE, lambda f: f.write(best_payload))
    _prune(directory, keep, step, best["step"] if best else None)
    log.info("saved checkpoint %s (%d bytes, crc32 %s)", path, hashed[0].bytes, expected)
    return path


def require_finite(model_state: dict[str, Any], step: int) -> None:
    """Refuse to save a model holding NaN or Inf (one fused norm over all float tensors; the
    offending entry is looked up only when that norm is not finite)."""
    floats = {k: v for k, v in model_state.items() if torch.is_tensor(v) and v.is_floating_point()}
    if not floats:
        return
    norms = torch._foreach_norm([v.float() for v in floats.values()])
    if bool(torch.stack(norms).isfinite().all()):
        return
    bad = next((k for k, v in floats.items() if not bool(torch.isfinite(v).all())), None)
    if bad is None:  # finite values whose norm overflows: nothing to refuse
        return
    raise FloatingPointError(f"refusing to checkpoint step {step}: {bad} holds NaN or Inf values")


def _prune(directory: Path, keep: int, saved_step: int, best_step: int | None) -> None:
    """Delete all but the newest `keep` checkpoints up to `saved_step`, and the best one.

    Checkpoints of later steps (unloadable ones that a resume skipped) are left alone; the one
    just written is always kept. A checkpoint's .pt goes before its manifest, so a kill in
    between leaves an incomplete checkpoint (skipped), never a manifest that vouches for nothing.
    """
    older = [(step, path) for step, path in list_checkpoints(directory) if step <= saved_step]
    for step, path in older[:-keep]:
        if step not in (best_step, saved_step):
            path.unlink(missing_ok=True)
            manifest_path(path).unlink(missing_ok=True)
    for orphan in directory.glob("step_*.manifest*.json"):
        stem = orphan.name.removesuffix(".json").removesuffix(".next").removesuffix(".manifest")
        if not orphan.with_name(stem + ".pt").exists():
            orphan.unlink(missing_ok=True)


def refuse_later_checkpoints(run_dir: str | Path, start_step: int, resume: str) -> None:
    """Refuse to start at `start_step` in a run dir holding checkpoints of later steps.

    They belong to another run (or a later point of this one): continuing would interleave two
    histories and retention would delete one of them. With `resume=auto` the later ones are
    the unloadable checkpoints it skipped, which are kept and overwritten as the run reaches them.
    """
    if resume == "auto":
        return
    directory = checkpoint_dir(run_dir)
    given = Path(resume)
    if given.is_dir() and given.resolve() in (Path(run_dir).resolve(), directory.resolve()):
        return  # this run's own directory, named explicitly: the same as auto
    later = [step for step, _ in list_checkpoints(directory) if step > start_step]
    if later:
        raise CheckpointError(
            f"{directory} already holds checkpoints of steps {later}, later than step "
            f"{start_step} where this run (ckpt.resume={resume}) starts; they belong to another "
            "run: use a new --run.dir or move them away"
        )


def _read_manifest(manifest_file: Path) -> tuple[int, str]:
    """(bytes, crc32) a manifest vouches for; FileNotFoundError when there is none."""
    try:
        manifest = json.loads(manifest_file.read_text())
        return int(manifest["bytes"]), str(manifest["crc32"])
    except FileNotFoundError:
        raise
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise CheckpointError(f"checkpoint manifest {manifest_file} is unreadable: {err}") from None


def verify(path: Path) -> None:
    """Check `path` against its manifest: present, complete, same bytes as were written.

    While a re-save of the same step is renamed into place, a second manifest
    (`step_<N>.manifest.next.json`) vouches for the new bytes: either version is accepted.
    """
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
    manifest_file = manifest_path(path)
    vouched = []
    for candidate in (manifest_file, next_manifest_path(path)):
        with contextlib.suppress(FileNotFoundError):
            vouched.append(_read_manifest(candidate))
    if not vouched:
        raise CheckpointError(
            f"checkpoint {path} has no manifest {manifest_file.name}: its save did not finish"
        )
    if all(size != expected_bytes for expected_bytes, _ in vouched):
        raise CheckpointError(
            f"checkpoint {path} is {size} bytes but its manifest says {vouched[0][0]}: "
            "truncated or overwritten"
        )
    actual = file_crc32(path)
    if all((size, actual) != manifest for manifest in vouched):
        raise CheckpointError(
            f"checkpoint {path} fails its checksum (crc32 {actual}, manifest says "
            f"{vouched[0][1]}): the file is corrupted"
        )


def load(path: str | Path, device: torch.device) -> dict[str, Any]:
    """Verify `path` against its manifest, then load it onto `device` with `weights_only=True`.

    `weights_only` unpickles tensors, containers and plain values only: a file carrying any
    other Python object is refused and none of its code runs. There is no unsafe fallback.
    """
    path = Path(path)
    verify(path)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint {path} is refused: it holds Python objects that safe loading "
            f"(torch.load weights_only=True) does not allow, so it was not written by this "
            f"pipeline or was tampered with; nothing in it was run ({first_line})"
        ) from err
    except Exception as err:  # torch reports truncation as a bare zip-reader error
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {err}") from err
    if not isinstance(state, dict) or not {"model", "step"} <= state.keys():
        raise CheckpointError(
            f"checkpoint {path} has no 'model' and 'step' entries: not a "
            "checkpoint of this pipeline"
        )
    return state


def load_for_resume(
    resume: str, run_dir: str | Path, device: torch.device
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint `--ckpt.resume` asks for, loaded, or None to start from scratch.

    `auto` takes the newest checkpoint that verifies and loads, skipping (with a warning) any
    that do not; if checkpoints exist but none loads it raises rather than silently starting
    over. A directory (a run dir, or its checkpoints/ folder) is searched the same way, and
    must hold a usable checkpoint.
    """
    if resume == "never":
        return None
    if resume != "auto":
        given = Path(resume)
        if not given.is_dir():
            return given, load(resume, device)
        directory = given / "checkpoints" if (given / "checkpoints").is_dir() else given
        found = _newest_usable(directory, device)
        if found is None:
            raise CheckpointError(
                f"ckpt.resume={resume}: no checkpoint in {directory} (step_<N>.pt files); "
                "give a run dir, its checkpoints/ folder or a checkpoint file"
            )
        return found
    return _newest_usable(checkpoint_dir(run_dir), device)


def _newest_usable(directory: Path, device: torch.device) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in `directory` that loads (None if it holds none at all)."""
    errors = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            return path, load(path, device)
        except CheckpointError as err:
            log.warning("skipping unusable checkpoint: %s", err)
            errors.append(str(err))
    if errors:
        raise CheckpointError(
            f"no usable checkpoint in {directory} ({len(errors)} found, none "
            f"loads): {'; '.join(errors)}. Move {directory} away to start from scratch, or "
            "start from an earlier checkpoint in a new run dir: "
            "--ckpt.resume=PATH --run.dir=NEW_DIR"
        )
    return None


def to_host(state: Any) -> Any:
    """A copy of `state` whose tensors live in host memory, detached from the live ones."""
    if isinstance(state, torch.Tensor):
        if state.device.type == "cpu":
            return state.detach().clone()
        return state.detach().to("cpu", non_blocking=False)
    if isinstance(state, dict):
        return {key: to_host(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(to_host(value) for value in state)
    return state


class AsyncSaver:
    """Writes checkpoints in a background thread; training stalls only for the host copy.

    At most one write is in flight: `save` first waits for the previous one. A failed write
    is re-raised by the next `save` or `wait`, so no error is lost. Atomicity is `save`'s.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(
        self,
        state: dict[str, Any],
        directory: Path,
        step: int,
        keep: int,
        accuracy: float | None,
    ) -> None:
        self.wait()
        host_state = to_host(state)

        def run() -> None:
            try:
                save(host_state, directory, step, keep, accuracy)
            except BaseException as err:  # handed to the training thread by wait()
                self._error = err

        self._thread = threading.Thread(target=run, name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
