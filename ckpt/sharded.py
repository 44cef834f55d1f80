"""The sharded checkpoint format: a folder `step_<N>/` in which every rank writes its own
pieces of the tensors (rank_<r>.<token>.pt, a token per save) in parallel, rank 0 the rest of
the state (meta.<token>.pt), and a manifest {"format": "sharded", "step", "files": {name:
{"bytes", "crc32"}}}, written last.

Who writes what (no byte twice):
- a DTensor sharded on dim 0 (FSDP2 parameters and their optimizer state): each rank its
  own rows (torch.chunk's split); under hybrid only the ranks of the first replica;
- any other tensor: the lowest rank that holds it, whole. Tensors every rank holds are not
  all the same on every rank (each rank's BatchNorm statistics moved with its own batch
  since the step began), and a checkpoint holds rank 0's, as a single-file one does.
Who reads what: at a resume each rank reads only the rows it keeps (load_sharded's `lazy`),
from the rank files that hold them.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import sharding
from ckpt import atomic, fence, retention
from ckpt.atomic import CheckpointError

log = logging.getLogger(__name__)

SHARDED = "sharded"  # the manifest's "format" of a sharded checkpoint


def flatten(state: Any, marker: str = "__tensor__") -> tuple[Any, list[tuple[str, Any]]]:
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


def unflatten(skeleton: Any, tensors: dict[int, torch.Tensor], marker: str = "__tensor__") -> Any:
    if isinstance(skeleton, dict):
        if skeleton.keys() == {marker}:
            return tensors[int(skeleton[marker])]
        return {key: unflatten(item, tensors, marker) for key, item in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(unflatten(item, tensors, marker) for item in skeleton)
    return skeleton


_PLAIN_TYPES = frozenset((int, float, bool, str, type(None)))


def _own_rows(value: Any) -> tuple[int, int, bool] | None:
    """(start, stop, writes) of this rank's rows of a DTensor sharded on dim 0
    (sharding.dim0_rows); `writes`: this rank is in the first replica (hybrid)."""
    rows = sharding.dim0_rows(value)
    if rows is None:
        return None
    mesh, placements = value.device_mesh, value.placements
    replicated = [i for i, p in enumerate(placements) if p.is_replicate()]
    return *rows, all(mesh.get_local_rank(i) == 0 for i in replicated)


def _pieces(
    leaves: list[tuple[str, Any]], rank: int, gather: Callable[[Any], list[Any]]
) -> tuple[dict[str, tuple[torch.Tensor, int, int]], list[dict[str, Any]]]:
    """What this rank writes ({name: (rows, start, stop)}) and every rank's description of
    its leaves ({name: (shape, dtype, sharded)}), by the module's rules. `gather` is the
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


def _write_pieces(path: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """`atomic.write_checked`, renamed into place; {"bytes", "crc32"} of what was written."""
    tmp, size, crc = atomic.write_checked(path, payload)
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
    skeleton, leaves = flatten(state)
    folder = directory / f"step_{step}"
    token = gather(os.urandom(4).hex() if rank == 0 else None)[0]
    error: BaseException | None = None
    mine: dict[str, tuple[torch.Tensor, int, int]] = {}
    every: list[dict[str, Any]] = []
    try:
        mine, every = _pieces(leaves, rank, gather)
        model = {name: piece for name, (piece, _, _) in mine.items() if name.startswith("/model/")}
        retention.require_finite(model, step)
        if rank == 0:
            if check is not None:
                check()
            directory.mkdir(parents=True, exist_ok=True)
            retention.remove_stale_temporaries(directory)
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
            tensors = payload["tensors"].items()
            host["tensors"] = {n: atomic.own_storage(t.cpu().contiguous()) for n, t in tensors}
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
            atomic.fsync_dir(folder)
            manifest = {"format": SHARDED, "step": plan.step, "meta": meta, "files": listed}
            payload = (json.dumps(manifest) + "\n").encode()
            atomic.write_bytes(retention.manifest_path(folder), lambda f: f.write(payload))
            for stale in folder.iterdir():  # a re-save's predecessor, vouched for no longer
                if stale.name not in listed:
                    fence.check(stale)  # never a deletion in a run dir taken over
                    stale.unlink(missing_ok=True)
            retention.after_save(directory, plan.step, keep, accuracy)
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
    manifest_file = retention.manifest_path(folder)
    try:
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
        if manifest.get("format") != SHARDED or not isinstance(files, dict):
            raise ValueError("not a sharded checkpoint's manifest")
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {folder} has no manifest {manifest_file.name}: its save did not finish"
        ) from None
    except (ValueError, KeyError, TypeError) as err:  # an OSError is the storage's, raised
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
        if checksums and (crc := atomic.file_crc32(file)) != expected["crc32"]:
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
        if (instead := atomic.not_about_content(err, f"checkpoint file {file}")) is not None:
            raise instead from err
        raise CheckpointError(f"checkpoint file {file} cannot be loaded: {err}") from err


def load_sharded(
    folder: Path, device: torch.device, verified: bool = False, lazy: Collection[str] = ()
) -> dict[str, Any]:
    """The state of the sharded checkpoint `folder` with whole tensors, whatever the world size
    that wrote it. They stay in host memory (`device` is not used): each part moves its own
    share to its device, so under fsdp a device never holds a whole model.

    `lazy`: the parts (top-level keys) whose tensors of one or more dimensions come as
    sharding.LazyRows, read when the part takes them: each rank then reads only the rows it
    keeps (sharding.shard_like), and only the files that hold them."""
    manifest = verify_sharded(folder, checksums=not verified)
    meta = _safe_load(folder / manifest["meta"], mmap=False)
    try:
        skeleton, table = meta["skeleton"], meta["tensors"]
        eager, deferred = _Pieces(folder), _Pieces(folder)
        tensors: dict[int, Any] = {}
        for index, entry in table.items():
            shape, dtype = tuple(entry["shape"]), getattr(torch, entry["dtype"])
            pieces = _tiled(folder, index, entry, shape)
            part = pieces[0][1].split("/")[1] if pieces else ""
            if shape and part in lazy:
                tensors[int(index)] = sharding.LazyRows(
                    shape, dtype, deferred.reader(pieces, shape, dtype)
                )
            else:
                tensors[int(index)] = eager.read(pieces, shape, dtype, 0, shape[0] if shape else 0)
        state = unflatten(skeleton, tensors)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as err:
        if (instead := atomic.not_about_content(err, f"checkpoint {folder}")) is not None:
            raise instead from err
        raise CheckpointError(f"checkpoint {folder} is malformed: {err}") from err
    if not isinstance(state, dict) or not {"model", "step"} <= state.keys():
        raise CheckpointError(
            f"checkpoint {folder} has no 'model' and 'step' entries: not a checkpoint of this "
            "pipeline"
        )
    return state


def _tiled(folder: Path, index: Any, entry: dict[str, Any], shape: tuple[int, ...]) -> list[Any]:
    """The pieces of a tensor of the meta table, by their first row, once their row ranges are
    checked to tile 0..rows exactly: each starts where the one before stopped (a count of rows
    would pass two overlapping ranges and leave rows unwritten: garbage); a 0-dim tensor has
    one piece."""
    pieces = sorted(entry["pieces"], key=lambda piece: piece[2])
    name = pieces[0][1] if pieces else f"tensor {index}"
    ranges = [(start, stop) for _, _, start, stop in pieces]
    if not shape:
        if ranges != [(0, 0)]:
            raise CheckpointError(f"checkpoint {folder}: {name} (0-dim) has pieces {ranges}")
        return pieces
    edges = [0, *(edge for bounds in ranges for edge in bounds), shape[0]]
    if all(start <= stop for start, stop in ranges) and edges[0::2] == edges[1::2]:
        return pieces
    raise CheckpointError(
        f"checkpoint {folder}: the pieces of {name} hold rows {ranges}, which do not cover its "
        f"{shape[0]} rows once each: its meta file was altered"
    )


class _Pieces:
    """The rank files of a sharded checkpoint, each opened (memory-mapped: only the pages read
    are loaded) when a piece of it is first read, and what was read."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.opened: dict[str, dict[str, torch.Tensor]] = {}
        self.bytes_read = 0

    def piece(self, file: str, name: str) -> torch.Tensor:
        if file not in self.opened:
            self.opened[file] = _safe_load(self.folder / file, mmap=True)["tensors"]
        return self.opened[file][name]

    def read(
        self, pieces: list[Any], shape: tuple[int, ...], dtype: torch.dtype, start: int, stop: int
    ) -> torch.Tensor:
        """Rows [start, stop) of the tensor made of `pieces` (a 0-dim one: itself), a tensor
        of their own: only the pieces that hold them are read."""
        if not shape:
            return self.piece(pieces[0][0], pieces[0][1]).clone()
        out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        for file, name, first, end in pieces:
            low, high = max(first, start), min(end, stop)
            if low >= high:
                continue
            piece = self.piece(file, name)
            if tuple(piece.shape) != (end - first, *shape[1:]) or piece.dtype != dtype:
                raise CheckpointError(
                    f"checkpoint file {self.folder / file}: {name} holds {piece.dtype} "
                    f"{list(piece.shape)}, not rows {first}..{end} of {dtype} {list(shape)}"
                )
            out[low - start : high - start] = piece[low - first : high - first]
        self.bytes_read += out.nbytes
        return out

    def reader(
        self, pieces: list[Any], shape: tuple[int, ...], dtype: torch.dtype
    ) -> Callable[[int, int], torch.Tensor]:
        def read(start: int, stop: int) -> torch.Tensor:
            return self.read(pieces, shape, dtype, start, stop)

        return read
