"""Sharded checkpoints (ckpt/sharded.py save_sharded / load_sharded): every rank writes its own
piece, the manifest lists every file's size and CRC-32, loading never unpickles anything but
tensors and plain data, a bad shard is named and skipped, and a re-save never leaves a step
without a complete checkpoint.

One-process tests pass save_sharded a world of one (its gather and agreement are parameters);
the spawned test runs 2 real ranks with FSDP2 shards and DDP-style replicated tensors, and
compares what a single process loads with what the ranks gathered themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, run_ranks

import sharding
from ckpt import atomic, retention, sharded, storage, writer
from ckpt.atomic import CheckpointError
from config import ConfigError

CPU = torch.device("cpu")


def save_collectively(state: dict, directory: Path, step: int, info) -> None:
    """sharded.save_sharded as the manager calls it at 2 ranks (keep 2, no accuracy)."""
    import distributed

    sharded.save_sharded(
        state,
        directory,
        step,
        2,
        None,
        info.rank,
        gather=distributed.all_gather_object,
        agree=lambda error, what: distributed.raise_if_any_failed(info, error, what),
    )


def alone(error: BaseException | None, what: str) -> None:
    """raise_if_any_failed for a world of one."""
    if error is not None:
        raise error


def save_alone(state: dict, directory: Path, step: int, keep: int = 5) -> Path:
    return sharded.save_sharded(
        state, directory, step, keep, None, 0, gather=lambda obj: [obj], agree=alone
    )


def a_state(step: int, value: float) -> dict:
    return {
        "model": {"w": torch.full((5, 3), value), "b": torch.arange(4.0)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "step": step,
        "config": {"optim": {"name": "sgd"}},
    }


def test_a_writer_process_writes_the_same_sharded_checkpoint(tmp_path) -> None:
    """ckpt.async_save's path: the pieces and meta.pt handed to a writer process, the
    manifest after it. What loads equals the state as it was when handed over (the tensors
    change right after), and the synchronous save of the same state (meta.pt holds tensor
    placeholders of its own: the writer's transport must not replace them)."""
    state = a_state(4, 2.5)
    expected = {key: value.clone() for key, value in state["model"].items()}
    plan = sharded.prepare_sharded(state, tmp_path / "async", 4, 0, lambda obj: [obj], alone)
    saver = writer.ProcessSaver()
    try:
        saver.write_sharded(plan)
        state["model"]["w"].add_(1.0)  # training goes on
        written = saver.wait()
    finally:
        saver.close()
    sharded.finish_sharded(plan, written, None, 5, None, 0, lambda obj: [obj], alone)
    got = storage.load(tmp_path / "async" / "step_4", CPU)
    for key, value in expected.items():
        assert torch.equal(got["model"][key], value), key
    assert got["optimizer"]["state"][0]["step"].item() == 3.0
    state["model"]["w"].sub_(1.0)
    sync = save_alone(state, tmp_path / "sync", 4)

    def meta(folder: Path) -> dict:
        manifest = json.loads(retention.manifest_path(folder).read_text())
        return torch.load(folder / manifest["meta"], weights_only=True)

    # The same skeleton: placeholders, not tensors (the writer's transport replaced them)
    assert meta(tmp_path / "async" / "step_4")["skeleton"] == meta(sync)["skeleton"]


def test_a_sharded_checkpoint_round_trips_whole(tmp_path) -> None:
    folder = save_alone(a_state(2, 1.5), tmp_path, 2)
    manifest = json.loads(retention.manifest_path(folder).read_text())
    assert manifest["format"] == "sharded" and manifest["step"] == 2
    assert set(manifest["files"]) == {p.name for p in folder.iterdir()}
    for name, entry in manifest["files"].items():
        assert (folder / name).stat().st_size == entry["bytes"]
    state = storage.load(folder, CPU)
    assert torch.equal(state["model"]["w"], torch.full((5, 3), 1.5))
    assert torch.equal(state["model"]["b"], torch.arange(4.0))
    assert state["optimizer"]["param_groups"] == [{"lr": 0.1}]
    assert state["optimizer"]["state"][0]["step"].item() == 3.0
    assert [step for step, _ in retention.list_checkpoints(tmp_path)] == [2]


class Payload:
    """Unpickling this runs a shell command that leaves a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("which", ["meta", "rank"])
def test_a_pickle_payload_in_any_file_of_a_sharded_checkpoint_never_runs(tmp_path, which) -> None:
    """The payload replaces a file and the manifest is rewritten to vouch for it (as an
    attacker with write access would): loading refuses it by name, and nothing runs."""
    folder = save_alone(a_state(2, 1.0), tmp_path, 2)
    manifest_file = retention.manifest_path(folder)
    manifest = json.loads(manifest_file.read_text())
    victim = next(name for name in manifest["files"] if name.startswith(which))
    marker = tmp_path / "pwned"
    torch.save({"tensors": Payload(marker)}, folder / victim)  # torch's own zip format
    manifest["files"][victim] = {
        "bytes": (folder / victim).stat().st_size,
        "crc32": atomic.file_crc32(folder / victim),
    }
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"{victim}.*refused"):
        storage.load(folder, CPU)
    assert not marker.exists()


def test_a_truncated_shard_is_named_and_the_resume_takes_the_previous_checkpoint(
    tmp_path, caplog
) -> None:
    save_alone(a_state(1, 1.0), tmp_path / "checkpoints", 1)
    folder = save_alone(a_state(2, 2.0), tmp_path / "checkpoints", 2)
    shard = next(folder.glob("rank_0.*.pt"))
    shard.write_bytes(shard.read_bytes()[:-100])
    with caplog.at_level("WARNING"):
        path, state = storage.load_for_resume("auto", tmp_path, CPU)
    assert path.name == "step_1" and state["step"] == 1
    assert f"{shard} is" in caplog.text and "truncated" in caplog.text


def test_a_missing_shard_is_named(tmp_path) -> None:
    folder = save_alone(a_state(1, 1.0), tmp_path, 1)
    shard = next(folder.glob("rank_0.*.pt"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lacks its file {shard.name}"):
        storage.load(folder, CPU)


def test_a_resave_of_a_step_that_dies_before_its_manifest_leaves_the_old_one_whole(
    tmp_path, monkeypatch
) -> None:
    """A resumed run preempted at the step it started from saves that step again: until the
    new manifest replaces the old one, the old files stay and load."""
    folder = save_alone(a_state(2, 1.0), tmp_path, 2)
    real = atomic.write_bytes

    def dies_at_the_manifest(path, *args, **kwargs):
        if path.name.endswith(".manifest.json"):
            raise OSError(5, "killed before the manifest")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(atomic, "write_bytes", dies_at_the_manifest)
    with pytest.raises(OSError):
        save_alone(a_state(2, 9.0), tmp_path, 2)
    monkeypatch.undo()
    assert torch.equal(storage.load(folder, CPU)["model"]["w"], torch.full((5, 3), 1.0))
    save_alone(a_state(2, 9.0), tmp_path, 2)  # the re-save that finishes
    assert torch.equal(storage.load(folder, CPU)["model"]["w"], torch.full((5, 3), 9.0))
    listed = json.loads(retention.manifest_path(folder).read_text())["files"]
    assert {p.name for p in folder.iterdir()} == set(listed)  # the old files are gone


def test_retention_removes_old_sharded_checkpoints_whole(tmp_path) -> None:
    for step in (1, 2, 3):
        save_alone(a_state(step, float(step)), tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_2",
        "step_2.manifest.json",
        "step_3",
        "step_3.manifest.json",
    ]


# ---------------------------------------------------------------------------------------------
# Two real ranks


def _two_ranks(info, directory: str) -> dict:
    import torch.distributed as dist
    from torch import nn

    import parallel
    from config import DistConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))  # 5 and 3 rows: uneven
    replicated = torch.arange(10.0).reshape(5, 2)  # held whole by both ranks
    par = parallel.parallelize(model, info, DistConfig(strategy="fsdp", fsdp_units="Linear"))
    state = {
        "model": par.bare.state_dict(),  # DTensor shards
        "extra": {"replicated": replicated, "mine": torch.full((2,), float(info.rank))},
        "step": 4,
    }
    save_collectively(state, Path(directory), 4, info)
    whole = {key: value.full_tensor() for key, value in par.bare.state_dict().items()}
    sizes = {p.name: p.stat().st_size for p in (Path(directory) / "step_4").iterdir()}
    dist.barrier()
    return {"whole": whole, "sizes": sizes}


@pytest.mark.spawn
def test_two_ranks_each_write_their_own_shard_and_one_process_loads_it_whole(tmp_path) -> None:
    results = run_ranks(_two_ranks, 2, tmp_path, str(tmp_path / "checkpoints"))
    folder = tmp_path / "checkpoints" / "step_4"
    names = sorted(name.split(".")[0] for name in results[0]["sizes"])
    assert names == ["meta", "rank_0", "rank_1"]
    state = storage.load(folder, CPU)  # no process group: as a 1-rank resume does
    for key, value in results[0]["whole"].items():
        assert torch.equal(state["model"][key], value), key
    assert torch.equal(state["extra"]["replicated"], torch.arange(10.0).reshape(5, 2))
    assert torch.equal(state["extra"]["mine"], torch.zeros(2))  # every rank's: rank 0's kept
    # Each rank wrote its own rows of the sharded parameters (torch.chunk: 3 and 2 of 5);
    # rank 0 alone the tensors every rank holds.
    rank_0 = torch.load(next(folder.glob("rank_0.*.pt")), weights_only=True)
    rank_1 = torch.load(next(folder.glob("rank_1.*.pt")), weights_only=True)
    assert rank_0["rows"]["/model/0.weight"] == [0, 3]
    assert rank_1["rows"]["/model/0.weight"] == [3, 5]
    assert rank_0["rows"]["/extra/replicated"] == [0, 5]
    assert "/extra/replicated" not in rank_1["rows"]


def consolidate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/consolidate_checkpoint.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_consolidate_writes_one_file_that_loads_with_weights_only(tmp_path) -> None:
    state = a_state(7, 2.5)
    state["ema"] = {"updates": 3, "weights": {"w": torch.full((5, 3), 0.5)}}
    folder = save_alone(state, tmp_path / "checkpoints", 7)
    weights = tmp_path / "weights.pt"
    proc = consolidate(str(folder), f"--weights={weights}", "--trained")
    assert proc.returncode == 0, proc.stderr
    loaded = torch.load(weights, weights_only=True)
    assert loaded.keys() == {"w", "b"} and torch.equal(loaded["w"], torch.full((5, 3), 2.5))
    # The weights the run evaluated by default: the average (before: the model's, whose
    # accuracy was never the one logged).
    for average, extra in ((tmp_path / "average.pt", "--ema"), (tmp_path / "evaluated.pt", "")):
        assert (
            consolidate(str(folder), f"--weights={average}", *filter(None, [extra])).returncode == 0
        )
        assert torch.equal(torch.load(average, weights_only=True)["w"], torch.full((5, 3), 0.5))
    out = tmp_path / "one"
    assert consolidate(str(folder), f"--out={out}").returncode == 0
    whole = storage.load(out / "step_7.pt", CPU)  # a checkpoint file with its manifest
    assert torch.equal(whole["model"]["w"], torch.full((5, 3), 2.5)) and whole["step"] == 7
    again = consolidate(str(folder), f"--weights={weights}", "--trained")
    assert again.returncode == 2 and "exists already" in again.stderr


def test_consolidate_refuses_a_damaged_checkpoint_naming_the_file(tmp_path) -> None:
    folder = save_alone(a_state(7, 2.5), tmp_path, 7)
    shard = next(folder.glob("rank_0.*.pt"))
    shard.write_bytes(shard.read_bytes()[:-10])
    proc = consolidate(str(folder), f"--weights={tmp_path / 'w.pt'}")
    assert proc.returncode == 2 and str(shard) in proc.stderr
    assert not (tmp_path / "w.pt").exists()


def test_a_view_is_written_as_its_own_bytes_not_its_whole_storage(tmp_path) -> None:
    """A state holding a slice of a bigger tensor (what a resumed optimizer held before
    sharding.shard_like copied its rows): the rank file of a sharded checkpoint and a
    single-file checkpoint hold the slice's bytes, not the whole storage it views (torch.save
    writes a tensor's whole storage: torch/serialization.py, persistent_id records the
    storage, not the view). Before the fix the sharded rank file was 4,001,829 bytes for a
    4 KB slice."""
    from ckpt import single

    whole = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB
    view = whole[1000:2000]  # 4 KB, the same storage
    state = {**a_state(3, 1.0), "model": {"w": view}}
    folder = save_alone(state, tmp_path / "sharded", 3)
    sizes = {p.name.split(".")[0]: p.stat().st_size for p in folder.iterdir()}
    assert sizes["rank_0"] < 100_000, sizes
    assert torch.equal(storage.load(folder, CPU)["model"]["w"], whole[1000:2000])
    path = single.save(state, tmp_path / "single", 3, 5, None)
    assert path.stat().st_size < 100_000
    assert torch.equal(storage.load(path, CPU)["model"]["w"], whole[1000:2000])


def test_a_loaded_shard_is_a_copy_of_its_rows_not_a_view_of_the_whole() -> None:
    """sharding.shard_like cuts this rank's rows of a loaded whole tensor for a DTensor
    parameter: a view would keep the whole tensor alive in the optimizer (each rank file of
    the next checkpoint then grew from 302.8 MB to 504.6 MB in the issue's run). Here the
    shard must not share the whole tensor's storage (it did before the fix)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import sharding

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        like = distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)])
        full = torch.arange(12.0).reshape(6, 2)
        local = sharding.shard_like(full, like).to_local()
        assert torch.equal(local, full)
        assert local.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    finally:
        dist.destroy_process_group()


# A child that loads the newest checkpoint of a run dir under a real memory limit: RLIMIT_DATA
# at its own VmData plus `headroom` MB, which since Linux 4.7 counts every private writable
# mapping (mm/mmap.c, is_data_mapping): the heap, glibc's mmap'd blocks and torch.load's
# MAP_PRIVATE file mappings alike. What it prints: how the load ended.
_LOAD_UNDER_LIMIT = """
import resource, sys
from pathlib import Path
import torch
from ckpt import storage

def vm_data():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
limit = vm_data() + int(sys.argv[2]) * 2**20
resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
try:
    path, state = storage.load_for_resume("auto", sys.argv[1], torch.device("cpu"))
    print("LOADED", path.name)
except BaseException as err:
    print("RAISED", type(err).__name__, err)
"""


def load_under_limit(run_dir: Path, headroom_mb: int) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_UNDER_LIMIT, str(run_dir), str(headroom_mb)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", ["sharded", "single"])
def test_running_out_of_memory_while_loading_is_not_corruption_and_never_falls_back(
    tmp_path, kind
) -> None:
    """Two checkpoints, the newest too big for the memory a child process may still take
    (RLIMIT_DATA, 96 MB above what it holds; the newest holds 256 MB): loading it fails with
    the allocator's error, and the child learns exactly that (a MemoryError naming the
    checkpoint), never that the checkpoint "is malformed" or "cannot be loaded", and the older
    one is not tried. Before the fix: "LOADED step_1.pt" / "LOADED step_1" (the newest skipped
    as unusable, the older one resumed); the same limit with room for 256 MB loads step_2."""
    from ckpt import single

    directory = tmp_path / "checkpoints"
    small, big = a_state(1, 1.0), a_state(2, 2.0)
    big["model"]["w"] = torch.ones(64, 2**20)  # 256 MB
    for state in (small, big):
        if kind == "sharded":
            save_alone(state, directory, state["step"])
        else:
            single.save(state, directory, state["step"], 5, None)
    newest = "step_2" if kind == "sharded" else "step_2.pt"
    said = load_under_limit(tmp_path, headroom_mb=96)
    assert said.startswith("RAISED MemoryError loading checkpoint"), said
    assert newest in said and "ran out of memory" in said, said
    assert "malformed" not in said and "step_1" not in said, said
    assert load_under_limit(tmp_path, headroom_mb=1024) == f"LOADED {newest}"


def _peak_rss(reset: bool = False) -> int:
    """This process's peak RSS in bytes (VmHWM); `reset`: first bring the peak down to the
    current RSS (clear_refs "5", Linux 4.0; test_strategies.py's _peak_rss says why not
    ru_maxrss)."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _save_big(info, directory: str) -> None:
    """A 2-rank fsdp model of 32 MB, its AdamW state after one step, saved sharded."""
    from torch import nn

    import parallel
    from ckpt import parts
    from config import DistConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024))  # 8.4 M parameters
    par = parallel.parallelize(model, info, DistConfig(strategy="fsdp", fsdp_units="Linear"))
    optimizer = torch.optim.AdamW(par.bare.parameters(), lr=0.1)
    par.model(torch.randn(4, 1024)).sum().backward()
    optimizer.step()
    state = {
        "model": parts.ModelState(par.bare).sharded_state_dict(),
        "optimizer": parts.OptimizerState(optimizer).sharded_state_dict(),
        "step": 1,
    }
    save_collectively(state, Path(directory), 1, info)


def _resume_big(info, folder: str) -> dict:
    """This rank's fresh fsdp model and optimizer resumed from the checkpoint `folder` (the
    manager's lazy load), what it read of the rank files, and the whole tensors it holds."""
    from torch import nn

    import parallel
    from ckpt import parts
    from config import DistConfig

    torch.manual_seed(1)  # other initial weights: the checkpoint's must replace them
    model = nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024))
    par = parallel.parallelize(model, info, DistConfig(strategy="fsdp", fsdp_units="Linear"))
    optimizer = torch.optim.AdamW(par.bare.parameters(), lr=0.1)
    before = _peak_rss(reset=True)
    state = storage.load(Path(folder), CPU, verified=True, lazy=("model", "optimizer"))
    parts.ModelState(par.bare).load_state_dict(state["model"])
    parts.OptimizerState(optimizer).load_state_dict(state["optimizer"])
    del state
    grown = _peak_rss() - before
    weights = {k: sharding.host_full_tensor(v) for k, v in par.bare.state_dict().items()}
    moments = {
        (i, name): sharding.host_full_tensor(value)
        for i, entry in optimizer.state_dict()["state"].items()
        for name, value in entry.items()
    }
    return {"grown": grown, "weights": weights, "moments": moments}


@pytest.mark.spawn
def test_each_rank_reads_only_the_rows_it_keeps(tmp_path) -> None:
    """A 2-rank fsdp checkpoint (weights and AdamW moments: 101 MB of tensors) resumed at 2 and
    at 3 ranks: each rank's peak RSS grows by about twice its share of the tensors (the pages
    of its rows in the memory-mapped rank file, and its copy of them; measured 0.67-0.84 of
    the whole at 2 ranks, 0.60-0.73 at 3), and the tensors equal what one process loads whole.
    Before the fix every rank built each tensor whole from every rank file (what lazy=() still
    does): its peak grew by 2.0 times the whole, and this failed at 2 ranks."""
    run_ranks(_save_big, 2, tmp_path, str(tmp_path / "checkpoints"))
    folder = tmp_path / "checkpoints" / "step_1"
    whole = storage.load(folder, CPU)
    total = sum(
        t.nbytes
        for part in (whole["model"], *whole["optimizer"]["state"].values())
        for t in part.values()
        if t.ndim > 0
    )
    for world in (2, 3):
        for rank, got in enumerate(run_ranks(_resume_big, world, tmp_path, str(folder))):
            # 2/world of the whole, half again for page-granular mapping (a fault maps the page
            # cache's folio around it) and the allocator: below one whole copy from 3 ranks on
            assert got["grown"] < 2 * total / world * 1.5, (world, rank, got["grown"], total)
            for key, value in whole["model"].items():
                assert torch.equal(got["weights"][key], value), key
            for (index, name), value in got["moments"].items():
                assert torch.equal(value, whole["optimizer"]["state"][index][name])


def test_overlapping_row_ranges_in_a_tampered_meta_are_refused(tmp_path) -> None:
    """A meta whose pieces of `w` (5 rows) are rows 0..3 and 1..3 of two stored tensors, with
    a manifest updated to match: 3 + 2 rows is the count of `w`'s rows, but rows 3 and 4 are
    in no piece. Before the fix this loaded, rows 3 and 4 whatever torch.empty held; the
    ranges must tile 0..5 exactly."""
    state = a_state(2, 1.0)
    state["model"] |= {"a": torch.ones(3, 3), "b": torch.ones(2, 3)}
    folder = save_alone(state, tmp_path, 2)
    manifest_file = retention.manifest_path(folder)
    manifest = json.loads(manifest_file.read_text())
    meta_file = folder / manifest["meta"]
    meta = torch.load(meta_file, weights_only=True)
    for entry in meta["tensors"].values():
        if entry["pieces"][0][1] == "/model/w":
            rank_file = entry["pieces"][0][0]
            entry["pieces"] = [[rank_file, "/model/a", 0, 3], [rank_file, "/model/b", 1, 3]]
    torch.save(meta, meta_file)
    manifest["files"][meta_file.name] = {
        "bytes": meta_file.stat().st_size,
        "crc32": atomic.file_crc32(meta_file),
    }
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError, match=r"hold rows \[\(0, 3\), \(1, 3\)\], which do not cover its 5 rows"
    ):
        storage.load(folder, CPU)


def test_model_weights_takes_a_sharded_checkpoint_by_its_folder_or_its_manifest(tmp_path) -> None:
    """--model.weights given a sharded checkpoint's folder said "no such file"; given its
    manifest, torch's weights_only advice. Both now load the checkpoint's model whole, as a
    resume does (verified, weights_only)."""
    from torch import nn

    import model as model_module
    from cli import parse_args

    torch.manual_seed(0)
    saved = nn.Linear(3, 5)
    state = {**a_state(2, 1.0), "model": dict(saved.state_dict())}
    folder = save_alone(state, tmp_path, 2)
    for given in (folder, retention.manifest_path(folder)):
        parse_args([f"--model.weights={given}"])  # accepted by the config
        fresh = nn.Linear(3, 5)
        model_module.load_weights(fresh, str(given))
        assert torch.equal(fresh.weight, saved.weight) and torch.equal(fresh.bias, saved.bias)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="a folder without a checkpoint manifest"):
        model_module.load_weights(nn.Linear(3, 5), str(empty))
