from __future__ import annotations

import json

import pytest
import torch
from helpers import run_ranks
from torch import nn

import checkpoint
import engine
from config import Config, OptimConfig
from distributed import DistInfo
from model import MiniResNet

CPU = torch.device("cpu")


def training_objects(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    model = MiniResNet(in_channels=1, num_classes=10, widths=(8, 16))
    optimizer = engine.build_optimizer(model, OptimConfig(name="adamw", lr=1e-3, warmup_steps=2))
    scheduler = engine.build_scheduler(optimizer, OptimConfig(warmup_steps=2), total_steps=20)
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
    path = checkpoint.save(state_of(original, 3), tmp_path, step=3, keep=2, accuracy=None)
    restored = training_objects(seed=99)  # different init: everything must come from the file
    state = checkpoint.load(path, CPU)
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
    path = checkpoint.save(state_of(objs, 1), tmp_path, step=1, keep=1, accuracy=None)
    state = torch.load(path, weights_only=True)
    assert set(state["model"]) == set(objs[0].state_dict())


def _save_from_ddp(info: DistInfo, run_dir: str) -> list[str]:
    from distributed import unwrap_model, wrap_model

    torch.manual_seed(0)
    ddp = wrap_model(MiniResNet(in_channels=1, num_classes=10, widths=(8, 16)), info)
    assert type(ddp).__name__ == "DistributedDataParallel"
    if info.is_main:
        checkpoint.save(
            {"model": unwrap_model(ddp).state_dict(), "step": 0},
            checkpoint.checkpoint_dir(run_dir),
            step=0,
            keep=1,
            accuracy=None,
        )
    return []


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
        checkpoint.save({"model": {}, "step": step}, tmp_path, step=step, keep=2, accuracy=acc)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2, 4, 5]
    assert json.loads((tmp_path / "best.json").read_text()) == {"step": 2, "accuracy": 0.9}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage"])
def test_unusable_checkpoint_is_named_and_auto_resume_falls_back(tmp_path, damage) -> None:
    directory = checkpoint.checkpoint_dir(tmp_path)
    for step in (10, 20):
        checkpoint.save(
            {"model": {"w": torch.full((64,), float(step))}, "step": step},
            directory,
            step=step,
            keep=5,
            accuracy=None,
        )
    newest = directory / "step_20.pt"
    raw = newest.read_bytes()
    newest.write_bytes(
        {"truncate": raw[: len(raw) // 2], "empty": b"", "garbage": b"not a checkpoint" * 10}[
            damage
        ]
    )
    with pytest.raises(checkpoint.CheckpointError, match="step_20.pt"):
        checkpoint.load(newest, CPU)
    path, state = checkpoint.load_for_resume("auto", tmp_path, CPU)
    assert path.name == "step_10.pt" and state["step"] == 10


def test_auto_resume_refuses_to_start_over_when_no_checkpoint_loads(tmp_path) -> None:
    directory = checkpoint.checkpoint_dir(tmp_path)
    directory.mkdir(parents=True)
    (directory / "step_5.pt").write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match="no usable checkpoint.*step_5.pt"):
        checkpoint.load_for_resume("auto", tmp_path, CPU)


def test_resume_never_and_empty_dir(tmp_path) -> None:
    assert checkpoint.load_for_resume("never", tmp_path, CPU) is None
    assert checkpoint.load_for_resume("auto", tmp_path, CPU) is None
    with pytest.raises(checkpoint.CheckpointError, match="missing.pt does not exist"):
        checkpoint.load_for_resume(str(tmp_path / "missing.pt"), tmp_path, CPU)


def test_failed_write_leaves_previous_checkpoint_and_no_partial_file(tmp_path) -> None:
    checkpoint.save({"model": {}, "step": 1}, tmp_path, step=1, keep=1, accuracy=None)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom during write")

    with pytest.raises(RuntimeError, match="boom"):
        checkpoint.save(
            {"model": {}, "step": 2, "bad": Unpicklable()}, tmp_path, step=2, keep=1, accuracy=None
        )
    assert [p.name for p in tmp_path.iterdir()] == ["step_1.pt"]
    assert checkpoint.load(tmp_path / "step_1.pt", CPU)["step"] == 1
