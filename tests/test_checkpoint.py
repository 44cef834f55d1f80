from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, run_ranks
from torch import nn

import engine
from ckpt import atomic, retention, sharded, single, storage, writer
from ckpt.atomic import CheckpointError
from config import Config, OptimConfig
from distributed import DistInfo
from model import MiniResNet
from optim import schedules, spec

CPU = torch.device("cpu")


def training_objects(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    model = MiniResNet(in_channels=1, num_classes=10, widths=(8, 16))
    optimizer = spec.build_optimizer(
        model, OptimConfig(name="adamw", lr=1e-3, warmup_steps=2), "foreach"
    )
    scheduler = schedules.build_scheduler(optimizer, OptimConfig(warmup_steps=2), total_steps=20)
    scaler = torch.amp.GradScaler("cpu", enabled=True, init_scale=1024.0)
    return model, optimizer, scheduler, scaler


def take_steps(objs: tuple, steps: int, seed: int) -> None:
    model, optimizer, scheduler, scaler = objs
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 1, 28, 28, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        engine.train_step(model, [(x, y)], optimizer, scaler, nn.CrossEntropyLoss(), None, 1.0)
        scheduler.step()


def state_of(objs: tuple, step: int) -> dict:
    model, optimizer, scheduler, scaler = objs
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "step": step,
        "config": Config().to_dict(),
    }


def test_round_trip_restores_everything_and_training_continues_identically(tmp_path) -> None:
    original = training_objects()
    take_steps(original, 3, seed=1)
    path = single.save(state_of(original, 3), tmp_path, step=3, keep=2, accuracy=None)
    restored = training_objects(seed=99)  # different init: everything must come from the file
    state = storage.load(path, CPU)
    model, optimizer, scheduler, scaler = restored
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    assert state["step"] == 3 and scheduler.last_epoch == 3
    assert scaler.get_scale() == original[3].get_scale()
    # The independent reference: the uninterrupted run, two more steps.
    take_steps(original, 2, seed=5)
    take_steps(restored, 2, seed=5)
    for key, value in original[0].state_dict().items():
        assert torch.equal(value, restored[0].state_dict()[key]), key
    for a, b in zip(
        original[1].state_dict()["state"].values(),
        restored[1].state_dict()["state"].values(),
        strict=True,
    ):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert original[2].get_last_lr() == restored[2].get_last_lr()


def test_checkpoint_loads_with_weights_only(tmp_path) -> None:
    objs = training_objects()
    path = single.save(state_of(objs, 1), tmp_path, step=1, keep=1, accuracy=None)
    state = torch.load(path, weights_only=True)
    assert set(state["model"]) == set(objs[0].state_dict())


def _record_crcs(path: Path) -> list[int]:
    """The CRC-32 each record of a torch.save zip file declares (read by Python's zipfile)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return [info.CRC for info in archive.infolist() if info.file_size]


def test_checkpoints_carry_one_checksum_and_torch_save_is_left_as_it_was(tmp_path) -> None:
    """Checkpoints are written without torch.save's CRC-32 of each zip record: the manifest's
    CRC-32 of the whole file is the check. The records' CRCs guard nothing on load: a bit
    flipped in a tensor of a plain torch.save file, CRCs and all, loads with weights_only
    (mmap or not) as a wrong value without an error. A checkpoint still loads and equals its
    state; the manifest's CRC is that of the bytes on disk (zlib, independently); and
    torch.save outside a checkpoint write, after a good one and after a failed one, computes
    record CRCs again."""
    import struct
    import zlib

    save_config = atomic.torch_save_config()
    if save_config is None:
        pytest.skip("this torch has no switch for the zip records' CRCs")
    plain = tmp_path / "user.pt"
    torch.save({"w": torch.full((256,), 1.0)}, plain)
    assert 0 not in _record_crcs(plain)
    raw = bytearray(plain.read_bytes())
    at = raw.find(struct.pack("<256f", *[1.0] * 256))
    raw[at + 2] ^= 0x01  # 1.0 -> 1.0000153 (a mantissa bit of the first value)
    plain.write_bytes(bytes(raw))
    for mmap in (False, True):
        flipped = torch.load(plain, weights_only=True, mmap=mmap)["w"]
        assert flipped[0].item() != 1.0 and torch.equal(flipped[1:], torch.full((255,), 1.0))

    objs = training_objects()
    state = state_of(objs, 1)
    path = single.save(state, tmp_path, step=1, keep=3, accuracy=None)
    crcs = _record_crcs(path)
    assert crcs and set(crcs) == {0}
    manifest = json.loads(retention.manifest_path(path).read_text())
    assert manifest["crc32"] == f"{zlib.crc32(path.read_bytes()):08x}"
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())

    torch.save({"w": torch.arange(100.0)}, plain)
    assert 0 not in _record_crcs(plain)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom during write")

    with pytest.raises(RuntimeError, match="boom"):
        single.save({"model": {}, "bad": Unpicklable()}, tmp_path, step=2, keep=3, accuracy=None)
    torch.save({"w": torch.arange(100.0)}, plain)
    assert 0 not in _record_crcs(plain) and save_config.compute_crc32


def _save_from_ddp(info: DistInfo, run_dir: str) -> list[str]:
    from distributed import unwrap_model, wrap_model

    torch.manual_seed(0)
    ddp = wrap_model(MiniResNet(in_channels=1, num_classes=10, widths=(8, 16)), info)
    assert type(ddp).__name__ == "DistributedDataParallel"
    if info.is_main:
        single.save(
            {"model": unwrap_model(ddp).state_dict(), "step": 0},
            storage.checkpoint_dir(run_dir),
            step=0,
            keep=1,
            accuracy=None,
        )
    return []


@pytest.mark.spawn
def test_checkpoint_written_under_ddp_has_no_prefixes(tmp_path) -> None:
    run_ranks(_save_from_ddp, 2, tmp_path, str(tmp_path))
    state = torch.load(tmp_path / "checkpoints" / "step_0.pt", weights_only=True)
    bare = MiniResNet(in_channels=1, num_classes=10, widths=(8, 16))
    assert list(state["model"]) == list(bare.state_dict())
    bare.load_state_dict(state["model"])  # strict: exact keys


def test_unwrap_strips_compile_and_ddp_wrappers() -> None:
    from distributed import unwrap_model

    model = MiniResNet(in_channels=1, num_classes=10, widths=(8,))
    compiled = torch.compile(model)
    assert unwrap_model(compiled) is model


def test_retention_keeps_newest_and_best(tmp_path) -> None:
    accuracies = {1: 0.5, 2: 0.9, 3: 0.6, 4: 0.7, 5: None}
    for step, acc in accuracies.items():
        single.save({"model": {}, "step": step}, tmp_path, step=step, keep=2, accuracy=acc)
    assert [s for s, _ in retention.list_checkpoints(tmp_path)] == [2, 4, 5]
    assert json.loads((tmp_path / "best.json").read_text()) == {"step": 2, "accuracy": 0.9}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage", "bitflip", "no_manifest"])
def test_unusable_checkpoint_is_named_and_auto_resume_falls_back(tmp_path, damage) -> None:
    directory = storage.checkpoint_dir(tmp_path)
    for step in (10, 20):
        single.save(
            {"model": {"w": torch.full((64,), float(step))}, "step": step},
            directory,
            step=step,
            keep=5,
            accuracy=None,
        )
    newest = directory / "step_20.pt"
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one bit, inside a tensor's bytes: torch.load alone accepts it
    damaged = {
        "truncate": bytes(raw[: len(raw) // 2]),
        "empty": b"",
        "garbage": b"not a checkpoint" * 10,
        "bitflip": bytes(raw),
        "no_manifest": newest.read_bytes(),
    }[damage]
    newest.write_bytes(damaged)
    if damage == "no_manifest":
        retention.manifest_path(newest).unlink()
    reason = {
        "truncate": "manifest says",
        "empty": "empty",
        "garbage": "manifest says",
        "bitflip": "fails its checksum",
        "no_manifest": "has no manifest",
    }[damage]
    with pytest.raises(CheckpointError, match=f"step_20.pt.*{reason}"):
        storage.load(newest, CPU)
    path, state = storage.load_for_resume("auto", tmp_path, CPU)
    assert path.name == "step_10.pt" and state["step"] == 10


def test_auto_resume_refuses_to_start_over_when_no_checkpoint_loads(tmp_path) -> None:
    directory = storage.checkpoint_dir(tmp_path)
    directory.mkdir(parents=True)
    (directory / "step_5.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint.*step_5.pt"):
        storage.load_for_resume("auto", tmp_path, CPU)


def test_resume_never_and_empty_dir(tmp_path) -> None:
    assert storage.load_for_resume("never", tmp_path, CPU) is None
    assert storage.load_for_resume("auto", tmp_path, CPU) is None
    with pytest.raises(CheckpointError, match="missing.pt does not exist"):
        storage.load_for_resume(str(tmp_path / "missing.pt"), tmp_path, CPU)


def test_failed_write_leaves_previous_checkpoint_and_no_partial_file(tmp_path) -> None:
    single.save({"model": {}, "step": 1}, tmp_path, step=1, keep=1, accuracy=None)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom during write")

    with pytest.raises(RuntimeError, match="boom"):
        single.save(
            {"model": {}, "step": 2, "bad": Unpicklable()}, tmp_path, step=2, keep=1, accuracy=None
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1.manifest.json", "step_1.pt"]
    assert storage.load(tmp_path / "step_1.pt", CPU)["step"] == 1


# ---------------------------------------------------------------------------------------------
# Safe loading: pickle payloads are refused and never run


class Payload:
    """Unpickling this creates `marker`: proof that code from the file ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class EvalPayload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w').close()",))


def _payload_checkpoint(tmp_path: Path, variant: str, marker: str) -> Path:
    directory = storage.checkpoint_dir(tmp_path)
    objs = training_objects()
    take_steps(objs, 1, seed=0)
    state = state_of(objs, 7)
    if variant == "top_level":
        state["extra"] = Payload(marker)
    elif variant == "in_optimizer_state":
        first = next(iter(state["optimizer"]["state"].values()))
        first["exp_avg"] = Payload(marker)
    elif variant == "eval_in_config":
        state["config"]["run"]["dir"] = EvalPayload(marker)
    if variant == "legacy_format":
        path = directory / "step_7.pt"
        directory.mkdir(parents=True)
        torch.save({**state, "x": Payload(marker)}, path, _use_new_zipfile_serialization=False)
    elif variant == "raw_pickle":
        import pickle

        path = directory / "step_7.pt"
        directory.mkdir(parents=True)
        path.write_bytes(pickle.dumps({"model": {}, "step": 7, "x": Payload(marker)}))
    else:  # written by the pipeline's own save: the manifest vouches for these bytes
        return single.save(state, directory, step=7, keep=2, accuracy=None)
    digest = atomic.file_crc32(path)  # a valid manifest: only weights_only stands guard
    size = path.stat().st_size
    retention.manifest_path(path).write_text(
        json.dumps({"file": path.name, "bytes": size, "crc32": digest, "step": 7})
    )
    return path


@pytest.mark.parametrize(
    "variant",
    ["top_level", "in_optimizer_state", "eval_in_config", "legacy_format", "raw_pickle"],
)
def test_pickle_payload_is_refused_and_never_runs(tmp_path, variant) -> None:
    marker = str(tmp_path / "payload-ran")
    path = _payload_checkpoint(tmp_path, variant, marker)
    assert not os.path.exists(marker)  # saving did not run it either
    with pytest.raises(CheckpointError, match=r"step_7.pt is refused.*weights_only"):
        storage.load(path, CPU)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        storage.load_for_resume("auto", tmp_path, CPU)  # skipped, never loaded unsafely
    assert not os.path.exists(marker)


# ---------------------------------------------------------------------------------------------
# SIGKILL in the middle of a save

_SAVE_AGAIN = """
import sys, torch, faults
from ckpt import single, storage, writer
faults.install_from_environment()
state = {"model": {"w": torch.full((200_000,), 2.0)}, "step": 2}
single.save(state, storage.checkpoint_dir(sys.argv[1]), step=2, keep=1, accuracy=0.5)
"""


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("stage", "survivor"),
    [("begin", 1), ("partial", 1), ("written", 1), ("renamed", 1), ("manifest", 2)],
)
def test_sigkill_during_save_leaves_a_loadable_checkpoint(tmp_path, stage, survivor) -> None:
    """A real SIGKILL at each stage of writing step 2 (keep=1: step 1 is due for deletion).
    Before the manifest exists step 1 must survive; after it, step 2 is complete."""
    directory = storage.checkpoint_dir(tmp_path)
    single.save({"model": {"w": torch.full((200_000,), 1.0)}, "step": 1}, directory, 1, 1, 0.9)
    env = {
        **os.environ,
        "TRAIN_FAULTS": f"sigkill@save={stage}",
        "PYTHONPATH": f"{REPO}:{REPO / 'tests'}",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _SAVE_AGAIN, str(tmp_path)], env=env, cwd=REPO, timeout=120
    )
    assert proc.returncode == -9  # really killed, at that point
    names = {p.name for p in directory.iterdir()}
    if stage in ("partial", "written"):
        assert any(name.endswith(".tmp") for name in names), names  # the write was cut short
    path, state = storage.load_for_resume("auto", tmp_path, CPU)
    assert state["step"] == survivor and path.name == f"step_{survivor}.pt"
    assert torch.equal(state["model"]["w"], torch.full((200_000,), float(survivor)))
    # The next save cleans up what the killed one left behind.
    single.save({"model": {}, "step": 3}, directory, 3, 1, None)
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]


_RESAVE = """
import sys, torch, faults
from ckpt import single, storage, writer
faults.install_from_environment()
state = {"model": {"w": torch.full((200_000,), 3.0)}, "step": 2}
single.save(state, storage.checkpoint_dir(sys.argv[1]), step=2, keep=1, accuracy=0.5)
"""


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("stage", "value"),
    [("begin", 2.0), ("partial", 2.0), ("written", 2.0), ("renamed", 3.0), ("manifest", 3.0)],
)
def test_sigkill_during_a_resave_of_the_same_step_keeps_it_loadable(tmp_path, stage, value) -> None:
    """A resumed run saves again the step it was preempted at. With keep=1 that step's
    checkpoint is the only one: a kill at any stage of the re-save must leave it loadable, as
    the old bytes until the new ones are renamed into place, as the new ones after."""
    directory = storage.checkpoint_dir(tmp_path)
    single.save({"model": {"w": torch.full((200_000,), 2.0)}, "step": 2}, directory, 2, 1, 0.4)
    env = {
        **os.environ,
        "TRAIN_FAULTS": f"sigkill@save={stage}",
        "PYTHONPATH": f"{REPO}:{REPO / 'tests'}",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _RESAVE, str(tmp_path)], env=env, cwd=REPO, timeout=120
    )
    assert proc.returncode == -9
    path, state = storage.load_for_resume("auto", tmp_path, CPU)
    assert path.name == "step_2.pt"
    assert torch.equal(state["model"]["w"], torch.full((200_000,), value))
    single.save({"model": {}, "step": 3}, directory, 3, 1, None)  # cleans up what was left
    left = os.listdir(directory)
    assert not [name for name in left if name.endswith(".tmp") or ".next." in name], left


# ---------------------------------------------------------------------------------------------
# Asynchronous saving


@pytest.fixture(scope="module")
def saver():
    """One writer process for the module's tests (spawning one imports torch: seconds)."""
    process_saver = writer.ProcessSaver()
    yield process_saver
    process_saver.close()


def loaded_equal(path: Path, reference: dict) -> None:
    """Every tensor of checkpoint `path` equals, with its strides, `reference`'s."""
    state = storage.load(path, CPU)
    _, got = sharded.flatten(state)
    _, want = sharded.flatten(reference)
    assert [name for name, _ in got] == [name for name, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride() and a.dtype == b.dtype, name


def test_async_save_writes_the_state_as_it_was_when_called(tmp_path, saver) -> None:
    """Each save copies the state of its call into the writer's reused buffers: the second
    save is the weights after two more steps, the first keeps its own, and both load exactly
    as the synchronous save of the same state (the independent reference)."""
    objs = training_objects()
    take_steps(objs, 2, seed=0)
    at_2 = to_clone(state_of(objs, 2))
    saver.save(state_of(objs, 2), tmp_path / "async", step=2, keep=3, accuracy=None)
    take_steps(objs, 2, seed=1)  # training goes on and changes the weights in place
    at_4 = to_clone(state_of(objs, 4))
    saver.save(state_of(objs, 4), tmp_path / "async", step=4, keep=3, accuracy=0.5)
    take_steps(objs, 1, seed=2)
    saver.wait()
    single.save(at_2, tmp_path / "sync", step=2, keep=3, accuracy=None)
    for step, state in ((2, at_2), (4, at_4)):
        loaded_equal(tmp_path / "async" / f"step_{step}.pt", state)
        storage.verify(tmp_path / "async" / f"step_{step}.pt")  # its manifest vouches for it
    async_2 = storage.load(tmp_path / "async" / "step_2.pt", CPU)
    loaded_equal(tmp_path / "sync" / "step_2.pt", async_2)
    assert retention.read_best(tmp_path / "async") == {"step": 4, "accuracy": 0.5}


def to_clone(state: dict) -> dict:
    skeleton, leaves = sharded.flatten(state)
    return sharded.unflatten(skeleton, {i: t.clone() for i, (_, t) in enumerate(leaves)})


def test_async_save_keeps_channels_last_strides(tmp_path, saver) -> None:
    weight = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
    state = {"model": {"w": weight}, "step": 1}
    saver.save(state, tmp_path, step=1, keep=1, accuracy=None)
    saver.wait()
    loaded_equal(tmp_path / "step_1.pt", state)


def test_async_save_follows_leaves_whose_layout_changes_between_saves(tmp_path, saver) -> None:
    """The writer's buffers are reused by leaf index while a leaf keeps its dtype, shape and
    strides; one that changes any of them (or a leaf that is new) gets a buffer of its own.
    A non-dense view is copied into a packed buffer and saved as its values."""
    base = torch.arange(48, dtype=torch.float32)
    states = [
        {"a": torch.ones(2, 3), "b": base[::2], "c": torch.zeros(4, 3, 2, 2)},
        {"a": torch.ones(3, 2) * 2, "b": base[1::2] * 3, "c": torch.zeros(4, 3, 2, 2) + 1},
        {
            "a": torch.ones(3, 2, dtype=torch.float64),
            "b": base[::3],
            "c": torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last),
            "d": torch.arange(5),
        },
    ]
    for step, state in enumerate(states, start=1):
        saver.save({"model": state, "step": step}, tmp_path, step=step, keep=3, accuracy=None)
        saver.wait()
    for step, state in enumerate(states, start=1):
        loaded = storage.load(tmp_path / f"step_{step}.pt", CPU)["model"]
        assert loaded.keys() == state.keys()
        for name, value in state.items():
            assert torch.equal(loaded[name], value) and loaded[name].dtype == value.dtype, name
    assert storage.load(tmp_path / "step_3.pt", CPU)["model"]["c"].is_contiguous(
        memory_format=torch.channels_last
    )


def test_async_save_failure_is_raised_by_the_next_call(tmp_path, saver) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the checkpoint directory should be")
    saver.save({"model": {}, "step": 1}, blocker, step=1, keep=1, accuracy=None)
    with pytest.raises(OSError):
        saver.wait()
    saver.wait()  # reported once
    saver.save({"model": {"w": torch.ones(2)}, "step": 2}, tmp_path / "ok", 2, 1, None)
    saver.wait()  # the writer goes on after a failed write
    assert (tmp_path / "ok" / "step_2.pt").is_file()


def test_the_writer_finishes_a_write_through_the_signals_a_cluster_sends(tmp_path) -> None:
    """Slurm and the kubelet signal every process of a job, the writer too: it ignores them,
    and the training process (which decides what a preemption means) gets the checkpoint."""
    process_saver = writer.ProcessSaver()
    try:
        state = {"model": {"w": torch.randn(1 << 20)}, "step": 3}
        process_saver.save(state, tmp_path, step=3, keep=1, accuracy=None)
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            os.kill(process_saver.pid, signum)
        process_saver.wait()
        loaded_equal(tmp_path / "step_3.pt", state)
        assert process_saver._process.poll() is None  # alive
    finally:
        process_saver.close()
    assert process_saver._process.poll() == 0  # the socket closed: the writer ended


def _slow_writes() -> None:
    """child_setup of the next test: every save in the writer takes 30 s longer."""
    original = single.save

    def slow(*args, **kwargs):
        time.sleep(30)
        return original(*args, **kwargs)

    single.save = slow


def test_a_writer_killed_mid_write_is_a_failed_save_naming_its_signal(
    tmp_path, monkeypatch
) -> None:
    """The OOM killer takes the writer during a write: that save fails, naming the signal,
    the older checkpoints stay, and the next save starts a new writer and succeeds."""
    monkeypatch.setattr(writer, "child_setup", "test_checkpoint:_slow_writes")
    process_saver = writer.ProcessSaver()
    try:
        state = {"model": {"w": torch.ones(3)}, "step": 1}
        single.save(state, tmp_path, step=1, keep=2, accuracy=None)
        process_saver.save({**state, "step": 2}, tmp_path, step=2, keep=2, accuracy=None)
        os.kill(process_saver.pid, signal.SIGKILL)  # within its 30 s
        with pytest.raises(writer.WriterDied, match="killed by SIGKILL.*step 2"):
            process_saver.wait()
        assert [p.name for _, p in retention.list_checkpoints(tmp_path)] == ["step_1.pt"]
        storage.verify(tmp_path / "step_1.pt")
        monkeypatch.setattr(writer, "child_setup", None)
        process_saver.save({**state, "step": 3}, tmp_path, step=3, keep=2, accuracy=None)
        process_saver.wait()
        storage.verify(tmp_path / "step_3.pt")
    finally:
        process_saver.close()


def test_many_tensors_pass_within_a_low_descriptor_limit(tmp_path) -> None:
    """1,500 tensors (a ResNet-50 with AdamW and a weight average has about 1,100) under a
    soft limit of 256 open files in both processes: the buffers' descriptors travel in
    batches, each mapped and closed before the next."""
    script = (
        "import resource, sys, torch\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from ckpt import storage, writer\n"
        "model = {f'p{i}': torch.full((i % 7 + 1,), float(i)) for i in range(1500)}\n"
        "state = {'model': model, 'step': 1}\n"
        "s = writer.ProcessSaver()\n"
        f"s.save(state, {str(tmp_path)!r}, 1, 1, None)\n"
        "s.wait()\n"
        "state['model']['p3'] += 1\n"
        f"s.save({{**state, 'step': 2}}, {str(tmp_path)!r}, 2, 1, None)\n"
        "s.close()\n"
        f"got = storage.load({str(tmp_path / 'step_2.pt')!r}, torch.device('cpu'))['model']\n"
        "assert all(torch.equal(got[k], v) for k, v in state['model'].items())\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_the_writer_dies_with_the_training_process(tmp_path) -> None:
    """A SIGKILLed training process leaves no writer behind (PR_SET_PDEATHSIG)."""
    script = (
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from ckpt import writer\n"
        "s = writer.ProcessSaver()\n"
        "print(s.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # A bound for "eventually", not a speed claim: on a loaded machine the writer may still be
    # importing torch when its parent dies, and arms PR_SET_PDEATHSIG (then sees the parent
    # gone and exits) only after that import, seconds later.
    deadline = time.monotonic() + 120
    while Path(f"/proc/{child}").exists() and "Z" not in _state_of(child):
        if time.monotonic() > deadline:
            pytest.fail(f"writer process {child} outlived its parent by 120 s")
        time.sleep(0.05)


def test_a_script_without_a_main_guard_is_not_run_again_by_the_writer(tmp_path) -> None:
    """multiprocessing's spawn runs the user's main script again in the child (an unguarded
    one then starts a second writer and fails); the writer is a fresh interpreter instead."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from ckpt import writer\n"
        "print('script body ran', flush=True)\n"
        "s = writer.ProcessSaver()\n"
        f"s.save({{'model': {{'w': torch.ones(3)}}, 'step': 1}}, {str(tmp_path)!r}, 1, 1, None)\n"
        "s.close()\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("script body ran") == 1
    storage.verify(tmp_path / "step_1.pt")


def _state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_model_is_never_checkpointed(tmp_path, bad, saver) -> None:
    objs = training_objects()
    state = state_of(objs, 4)
    state["model"]["head.bias"] = state["model"]["head.bias"].clone()
    state["model"]["head.bias"][3] = bad
    with pytest.raises(FloatingPointError, match="step 4: head.bias holds NaN or Inf"):
        single.save(state, tmp_path, step=4, keep=2, accuracy=None)
    saver.save(state, tmp_path, step=4, keep=2, accuracy=None)  # checked in the background
    with pytest.raises(FloatingPointError, match="step 4: head.bias holds NaN or Inf"):
        saver.wait()
    assert not list(tmp_path.iterdir())
    huge = state_of(objs, 5)
    huge["model"]["head.bias"] = torch.full((10,), 3e38)  # finite, but its norm overflows
    single.save(huge, tmp_path, step=5, keep=2, accuracy=None)


@pytest.mark.parametrize("given", ["run_dir", "checkpoints_dir"])
def test_resume_from_a_directory_takes_its_newest_usable_checkpoint(tmp_path, given) -> None:
    other = tmp_path / "other_run"
    directory = storage.checkpoint_dir(other)
    for step in (3, 6, 9):
        state = {"model": {"w": torch.full((4,), float(step))}, "step": step}
        single.save(state, directory, step=step, keep=5, accuracy=None)
    (directory / "step_9.pt").write_bytes(b"torn")  # the newest does not load: skipped
    resume = str(other if given == "run_dir" else directory)
    path, state = storage.load_for_resume(resume, tmp_path / "this_run", CPU)
    assert path == directory / "step_6.pt" and state["step"] == 6
    assert torch.equal(state["model"]["w"], torch.full((4,), 6.0))
    # This run's own directory given explicitly: its later (unloadable) checkpoint is the one
    # that was skipped, as with auto, not another run's history.
    storage.refuse_later_checkpoints(other, 6, resume)
    with pytest.raises(CheckpointError, match=r"steps \[9\]"):
        storage.refuse_later_checkpoints(other, 6, str(directory / "step_6.pt"))


def test_resume_from_a_directory_without_checkpoints_says_so(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=f"no checkpoint in {tmp_path}"):
        storage.load_for_resume(str(tmp_path), tmp_path / "run", CPU)


def test_a_checkpoint_whose_save_was_killed_does_not_count_among_the_kept(tmp_path) -> None:
    """keep=2: good checkpoints of steps 100 and 200, then step 300's save killed before its
    manifest, and a resume that never saves step 300 again (another world size). Saving 350
    keeps 200 and 350; the manifest-less 300 goes, instead of taking 200's place."""
    for step in (100, 200):
        single.save({"model": {"w": torch.ones(2)}, "step": step}, tmp_path, step, 2, None)
    torch.save({"model": {}, "step": 300}, tmp_path / "step_300.pt")  # no manifest
    single.save({"model": {"w": torch.ones(2)}, "step": 350}, tmp_path, 350, 2, None)
    assert [step for step, _ in retention.list_checkpoints(tmp_path)] == [200, 350]
    storage.verify(tmp_path / "step_200.pt")
