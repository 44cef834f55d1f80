"""Checkpoints: atomic, verified writes, retention, and safe loading on every rank.

Layout of `<run.dir>/checkpoints/`:
    step_<N>.pt             a checkpoint in one file, written by rank 0 with `torch.save`
    step_<N>/               a sharded checkpoint: rank_<r>.pt (rank r's pieces of the tensors)
                            and meta.pt (the rest of the state, and where each tensor's rows
                            are), every rank writing its own file in parallel
    step_<N>.manifest.json  written last, after the files are durable, so a checkpoint without
                            one is incomplete: {"file", "bytes", "crc32", "step"} for one file;
                            {"format": "sharded", "step", "files": {name: {"bytes", "crc32"}}}
                            for a sharded one
    best.json               {"step", "accuracy"} of the best evaluated checkpoint

Every file is written to a temporary name in the same directory, fsynced, renamed over its
final name and the directory fsynced: a crash at any point leaves the previous checkpoints
as they were and at worst an incomplete new one, which loading recognises and skips. Loading
unpickles nothing but tensors and plain data (`torch.load(weights_only=True)`), for every file
of either kind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import shutil
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

import distributed

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d+)(\.pt)?$")  # a file, or a sharded checkpoint's folder
SHARDED = "sharded"  # the manifest's "format" of a sharded checkpoint
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
    """(step, path) of every checkpoint in `directory` (`step_<N>.pt` files and `step_<N>`
    folders), oldest first."""
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
    for path in [*directory.glob(".*.tmp"), *directory.glob("step_*/.*.tmp")]:
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
    # Re-saving a step (a resumed run saves again the step it was preempted at) must not
    # invalidate the good checkpoint of that step before its replacement is durable: the new
    # bytes go to a temporary file first, a second manifest vouches for them before they are
    # renamed over the old ones, and only then does the manifest proper change. At every
    # point the file under the final name matches one of the two manifests.
    replacing = path.exists() or manifest_path(path).exists()
    tmp, size, expected = _write_checked(path, on_host(state))
    manifest = {"file": path.name, "bytes": size, "crc32": expected, "step": step}
    payload = (json.dumps(manifest) + "\n").encode()
    if replacing:
        atomic_write_bytes(next_manifest_path(path), lambda f: f.write(payload))
    # The manifest's write below fsyncs the directory for this rename too. Until then a crash
    # may lose the new name: loading skips a manifest without its file, and the older ones
    # remain.
    os.replace(tmp, path)
    atomic_write_bytes(manifest_path(path), lambda f: f.write(payload))
    next_manifest_path(path).unlink(missing_ok=True)
    _finish(directory, step, keep, accuracy)
    log.info("saved checkpoint %s (%d bytes, crc32 %s)", path, size, expected)
    return path


def on_host(state: Any, _copies: dict[int, torch.Tensor] | None = None) -> Any:
    """`state` with every tensor in host memory (a tensor that appears twice, copied once).
    torch.save records each tensor's device, and `torch.load` without map_location puts it
    back there: a file saved from a GPU would not load on a machine without one (seen on an
    H200: the writer process's copies were on the host, the synchronous save's on cuda:0).
    Host tensors are not copied."""
    copies = {} if _copies is None else _copies
    if torch.is_tensor(state):
        if state.device.type == "cpu":
            return state.detach()
        if id(state) not in copies:
            copies[id(state)] = state.detach().cpu()
        return copies[id(state)]
    if isinstance(state, dict):
        return {key: on_host(value, copies) for key, value in state.items()}
    if isinstance(state, list | tuple) and not hasattr(state, "_fields"):
        return type(state)(on_host(value, copies) for value in state)
    return state


def _finish(directory: Path, step: int, keep: int, accuracy: float | None) -> None:
    """After a checkpoint's manifest: best.json, then pruning the older ones."""
    best = read_best(directory)
    if best is not None and best["step"] > step:  # left by an abandoned later run: stale
        best = None
    if accuracy is not None and (best is None or accuracy > best["accuracy"]):
        best = {"step": step, "accuracy": accuracy}
        best_payload = json.dumps(best).encode()
        atomic_write_bytes(directory / BEST_FILE, lambda f: f.write(best_payload))
    _prune(directory, keep, step, best["step"] if best else None)


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
    just written is always kept; older ones without a manifest (their save was killed) go. A
    checkpoint's .pt goes before its manifest, so a kill in between leaves an incomplete
    checkpoint (skipped), never a manifest that vouches for nothing.
    """
    older = [(step, path) for step, path in list_checkpoints(directory) if step <= saved_step]
    complete = []
    for step, path in older:
        if manifest_path(path).exists() or step == saved_step:
            complete.append((step, path))
        else:  # its save was killed before the manifest: it can never load, and must not
            remove(path)  # take the place of a good checkpoint among the `keep` newest
    for step, path in complete[:-keep]:
        if step not in (best_step, saved_step):
            remove(path)
            manifest_path(path).unlink(missing_ok=True)
    for orphan in directory.glob("step_*.manifest*.json"):
        stem = orphan.name.removesuffix(".json").removesuffix(".next").removesuffix(".manifest")
        if not orphan.with_name(stem + ".pt").exists() and not orphan.with_name(stem).is_dir():
            orphan.unlink(missing_ok=True)


def remove(path: Path) -> None:
    """Delete a checkpoint's file or folder (not its manifest)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
    if path.is_dir():
        verify_sharded(path)
        return
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


def load(path: str | Path, device: torch.device, verified: bool = False) -> dict[str, Any]:
    """Verify `path` against its manifest, then load it onto `device` with `weights_only=True`.

    `weights_only` unpickles tensors, containers and plain values only: a file carrying any
    other Python object is refused and none of its code runs. There is no unsafe fallback.
    A sharded checkpoint (a folder) is put back into whole tensors; `verified`: another rank
    checked its files' checksums already (their sizes are still checked).
    """
    path = Path(path)
    if path.is_dir():
        return load_sharded(path, device, verified=verified)
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


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints: every rank writes its own pieces of the tensors, in parallel
#
# Who writes what (no byte twice):
# - a DTensor sharded on dim 0 (FSDP2 parameters and their optimizer state): each rank its
#   own rows (torch.chunk's split); under hybrid only the ranks of the first replica;
# - any other tensor: the lowest rank that holds it, whole. Tensors every rank holds are not
#   all the same on every rank (each rank's BatchNorm statistics moved with its own batch
#   since the step began), and a checkpoint holds rank 0's, as a single-file one does.


def _flatten(state: Any, marker: str = "__tensor__") -> tuple[Any, list[tuple[str, Any]]]:
    """(skeleton, leaves): `state` with each tensor replaced by {marker: its index in
    leaves}, and the leaves as (name, tensor), the name its path of keys. A state that holds
    skeletons itself (a sharded checkpoint's meta, on its way to a writer process) is
    flattened with another marker.

    On the path of every asynchronous save's hand-over (training waits for it): plain values
    are kept without a call or a name of their own."""
    leaves: list[tuple[str, Any]] = []
    plain, tensor_type = _PLAIN_TYPES, torch.Tensor

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, tensor_type):
            leaves.append((where, value))
            return {marker: len(leaves) - 1}
        if isinstance(value, dict):
            return {
                key: item if type(item) in plain else walk(item, f"{where}/{key}")
                for key, item in value.items()
            }
        if isinstance(value, list | tuple):
            if plain.issuperset(map(type, value)):  # e.g. Python's RNG state: as is
                return value
            return type(value)(walk(item, f"{where}/{i}") for i, item in enumerate(value))
        return value

    return walk(state, ""), leaves


def _unflatten(skeleton: Any, tensors: dict[int, torch.Tensor], marker: str = "__tensor__") -> Any:
    if isinstance(skeleton, dict):
        if skeleton.keys() == {marker}:
            return tensors[int(skeleton[marker])]
        return {key: _unflatten(item, tensors, marker) for key, item in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(_unflatten(item, tensors, marker) for item in skeleton)
    return skeleton


_PLAIN_TYPES = frozenset((int, float, bool, str, type(None)))


def _own_rows(value: Any) -> tuple[int, int, bool] | None:
    """(start, stop, writes) of this rank's rows of a DTensor sharded on dim 0
    (distributed.dim0_rows); `writes`: this rank is in the first replica (hybrid)."""
    rows = distributed.dim0_rows(value)
    if rows is None:
        return None
    mesh, placements = value.device_mesh, value.placements
    replicated = [i for i, p in enumerate(placements) if p.is_replicate()]
    return *rows, all(mesh.get_local_rank(i) == 0 for i in replicated)


def _pieces(
    leaves: list[tuple[str, Any]], rank: int, gather: Callable[[Any], list[Any]]
) -> tuple[dict[str, tuple[torch.Tensor, int, int]], list[dict[str, Any]]]:
    """What this rank writes ({name: (rows, start, stop)}) and every rank's description of
    its leaves ({name: (shape, dtype, sharded)}), by the rules above. `gather` is the
    all-gather of Python objects (a collective)."""
    from torch.distributed.tensor import DTensor

    described: dict[str, Any] = {}
    local: dict[str, tuple[torch.Tensor, int, int, bool]] = {}
    for name, value in leaves:
        dtype = str(value.dtype).removeprefix("torch.")
        if isinstance(value, DTensor):
            rows = _own_rows(value)
            if rows is None:
                raise CheckpointError(
                    f"{name}: a DTensor placed as {value.placements} cannot be saved sharded "
                    "(only dim-0 sharding is)"
                )
            described[name] = (list(value.shape), dtype, True)
            start, stop, writes = rows
            if writes and stop > start:
                local[name] = (value.to_local(), start, stop, True)
        else:
            described[name] = (list(value.shape), dtype, False)
            local[name] = (value, 0, value.shape[0] if value.ndim else 0, False)
    every = gather(described)
    mine: dict[str, tuple[torch.Tensor, int, int]] = {}
    for name, (tensor, start, stop, is_shard) in local.items():
        if is_shard or min(r for r, seen in enumerate(every) if name in seen) == rank:
            mine[name] = (tensor, start, stop)
    return mine, every


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
    tests/test_checkpoint.py). Computing both cost a quarter of a save's CPU time: 62-65 ms
    against 46-48 ms for 64 MiB on this project's 2-core VM (BENCHMARKS.md), time taken from
    training wherever the writer process has no core of its own. Zip tools (`unzip -t`)
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


def _write_checked(path: Path, payload: Any) -> tuple[Path, int, str]:
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


def _write_pieces(path: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """`_write_checked`, renamed into place; {"bytes", "crc32"} of what was written."""
    tmp, size, crc = _write_checked(path, payload)
    os.replace(tmp, path)
    return {"bytes": size, "crc32": crc}


@dataclass
class ShardedSave:
    """A sharded checkpoint between `prepare_sharded` and `finish_sharded`: where it goes and
    what this rank writes (`files`: {label: (path, payload)}; rank 0's include meta.pt)."""

    folder: Path
    step: int
    files: dict[str, tuple[Path, dict[str, Any]]]


def save_sharded(
    state: dict[str, Any],
    directory: Path,
    step: int,
    keep: int,
    accuracy: float | None,
    rank: int,
    gather: Callable[[Any], list[Any]],
    agree: Callable[[BaseException | None, str], None],
    check: Callable[[], None] | None = None,
) -> Path:
    """Collective: write `state` as the sharded checkpoint `step_<step>/`, each rank its own
    file in parallel; rank 0 writes meta.pt, then the manifest with every file's size and
    CRC-32, once every file is durable; then best.json and pruning, as `save` does.

    `gather`: all-gather of Python objects; `agree(error, what)`: every rank raises if any
    rank failed (distributed.raise_if_any_failed); `check()`: rank 0, before anything is
    written (the lease). Each save's files carry a token of their own: a re-save of a step
    (a resumed run preempted where it started) writes beside the files its manifest vouches
    for, and the new manifest replaces the old one in one rename; only then do the old files
    go. ckpt.async_save runs the middle part (`write_sharded`) in a writer process."""
    plan = prepare_sharded(state, directory, step, rank, gather, agree, check)
    written: dict[str, Any] = {}
    error: BaseException | None = None
    try:
        written = write_sharded(plan)
    except Exception as err:
        error = err
    return finish_sharded(plan, written, error, keep, accuracy, rank, gather, agree, check)


def prepare_sharded(
    state: dict[str, Any],
    directory: Path,
    step: int,
    rank: int,
    gather: Callable[[Any], list[Any]],
    agree: Callable[[BaseException | None, str], None],
    check: Callable[[], None] | None = None,
) -> ShardedSave:
    """Collective: who writes which rows (see above), the finite check of the model, the
    folder (rank 0, after `check`), and rank 0's meta.pt: every tensor's shape, dtype and
    pieces. The payloads hold the live tensors (their local shards): write them, or copy
    them, before training changes them."""
    skeleton, leaves = _flatten(state)
    folder = directory / f"step_{step}"
    token = gather(os.urandom(4).hex() if rank == 0 else None)[0]
    error: BaseException | None = None
    mine: dict[str, tuple[torch.Tensor, int, int]] = {}
    every: list[dict[str, Any]] = []
    try:
        mine, every = _pieces(leaves, rank, gather)
        model = {name: piece for name, (piece, _, _) in mine.items() if name.startswith("/model/")}
        require_finite(model, step)
        if rank == 0:
            if check is not None:
                check()
            directory.mkdir(parents=True, exist_ok=True)
            _remove_stale_temporaries(directory)
            folder.mkdir(exist_ok=True)
    except Exception as err:
        error = err
    agree(error, f"preparing the step {step} checkpoint")
    rows = {name: [start, stop] for name, (_, start, stop) in mine.items()}
    mine_file = folder / f"rank_{rank}.{token}.pt"
    files = {
        "mine": (mine_file, {"tensors": {n: p for n, (p, _, _) in mine.items()}, "rows": rows})
    }
    everyone = gather((mine_file.name, rows))
    if rank == 0:
        table = {}
        for index, (name, _) in enumerate(leaves):
            shape, dtype, _ = next(seen[name] for seen in every if name in seen)
            pieces_of = [[file, name, *held[name]] for file, held in everyone if name in held]
            table[index] = {"shape": shape, "dtype": dtype, "pieces": pieces_of}
        files["meta"] = (folder / f"meta.{token}.pt", {"skeleton": skeleton, "tensors": table})
    return ShardedSave(folder, step, files)


def write_sharded(plan: ShardedSave) -> dict[str, Any]:
    """This rank's files of `plan`, fsynced and renamed into place: {file name: {"bytes",
    "crc32"}}. No collective: a writer process runs it as well."""
    written = {}
    for path, payload in plan.files.values():
        host = {**payload}
        if "rows" in payload:  # the pieces, in host memory, each a tensor of its own
            host["tensors"] = {
                n: t.detach().cpu().contiguous() for n, t in payload["tensors"].items()
            }
        written[path.name] = _write_pieces(path, host)
    return written


def finish_sharded(
    plan: ShardedSave,
    written: dict[str, Any],
    error: BaseException | None,
    keep: int,
    accuracy: float | None,
    rank: int,
    gather: Callable[[Any], list[Any]],
    agree: Callable[[BaseException | None, str], None],
    check: Callable[[], None] | None = None,
) -> Path:
    """Collective, once every rank wrote its files (`written`) or failed (`error`): rank 0
    fsyncs the folder and writes the manifest last, removes a re-save's predecessor's files,
    then best.json and pruning."""
    if rank == 0 and check is not None:
        try:
            check()  # the lease again: a long write may have lost it (and been disturbed by
        except Exception as err:  # the new holder: that is the cause to report)
            error = err
    agree(error, f"writing the step {plan.step} checkpoint's shards")
    listed: dict[str, Any] = {}
    for files in gather(written):
        listed.update(files)
    folder, directory = plan.folder, plan.folder.parent
    if rank == 0:
        try:
            meta = plan.files["meta"][0].name
            _fsync_dir(folder)
            manifest = {"format": SHARDED, "step": plan.step, "meta": meta, "files": listed}
            payload = (json.dumps(manifest) + "\n").encode()
            atomic_write_bytes(manifest_path(folder), lambda f: f.write(payload))
            for stale in folder.iterdir():  # a re-save's predecessor, vouched for no longer
                if stale.name not in listed:
                    stale.unlink(missing_ok=True)
            _finish(directory, plan.step, keep, accuracy)
            total = sum(entry["bytes"] for entry in listed.values())
            log.info("saved sharded checkpoint %s (%d files, %d bytes)", folder, len(listed), total)
        except Exception as err:
            error = err
    agree(error, f"finishing the step {plan.step} checkpoint")
    return folder


def verify_sharded(folder: Path, checksums: bool = True) -> dict[str, Any]:
    """The manifest of the sharded checkpoint `folder`, after checking that every file it
    lists is there, of the size written and (with `checksums`) of the same CRC-32. The first
    bad file is named."""
    manifest_file = manifest_path(folder)
    try:
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
        if manifest.get("format") != SHARDED or not isinstance(files, dict):
            raise ValueError("not a sharded checkpoint's manifest")
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {folder} has no manifest {manifest_file.name}: its save did not finish"
        ) from None
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise CheckpointError(f"checkpoint manifest {manifest_file} is unreadable: {err}") from None
    for name, expected in files.items():
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {folder} lacks its file {name}")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"checkpoint file {file} is {size} bytes but the manifest says "
                f"{expected['bytes']}: truncated or overwritten"
            )
        if checksums and (crc := file_crc32(file)) != expected["crc32"]:
            raise CheckpointError(
                f"checkpoint file {file} fails its checksum (crc32 {crc}, manifest says "
                f"{expected['crc32']}): the file is corrupted"
            )
    return manifest


def _safe_load(file: Path, mmap: bool) -> Any:
    """torch.load with weights_only (and mmap: only the pages read are loaded)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint file {file} is refused: it holds Python objects that safe loading "
            f"(torch.load weights_only=True) does not allow, so it was not written by this "
            f"pipeline or was tampered with; nothing in it was run ({first_line})"
        ) from err
    except Exception as err:
        raise CheckpointError(f"checkpoint file {file} cannot be loaded: {err}") from err


def load_sharded(folder: Path, device: torch.device, verified: bool = False) -> dict[str, Any]:
    """The state of the sharded checkpoint `folder` with whole tensors, whatever the world size
    that wrote it. They stay in host memory (`device` is not used): each part moves its own
    share to its device, so under fsdp a device never holds a whole model."""
    manifest = verify_sharded(folder, checksums=not verified)
    meta = _safe_load(folder / manifest["meta"], mmap=False)
    try:
        skeleton, table = meta["skeleton"], meta["tensors"]
        opened: dict[str, dict[str, torch.Tensor]] = {}
        tensors: dict[int, torch.Tensor] = {}
        for index, entry in table.items():
            shape, dtype = tuple(entry["shape"]), getattr(torch, entry["dtype"])
            whole = torch.empty(shape, dtype=dtype)
            filled = 0
            for file, name, start, stop in entry["pieces"]:
                if file not in opened:
                    opened[file] = _safe_load(folder / file, mmap=True)["tensors"]
                piece = opened[file][name]
                if shape:
                    whole[start:stop] = piece
                else:
                    whole = piece.clone()
                filled += stop - start
            if shape and filled != shape[0]:
                raise CheckpointError(
                    f"checkpoint {folder}: {entry['pieces'][0][1] if entry['pieces'] else index}"
                    f" has {filled} of its {shape[0]} rows"
                )
            tensors[int(index)] = whole  # in host memory: each part moves its own share
        state = _unflatten(skeleton, tensors)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {folder} is malformed: {err}") from err
    if not isinstance(state, dict) or not {"model", "step"} <= state.keys():
        raise CheckpointError(
            f"checkpoint {folder} has no 'model' and 'step' entries: not a checkpoint of this "
            "pipeline"
        )
    return state
