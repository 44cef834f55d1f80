"""train.py's resume bookkeeping and guards, without launching processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import checkpoint
import train
from config import Config, ConfigError, parse_args
from distributed import DistInfo

CPU = torch.device("cpu")
ONE = DistInfo(0, 0, 1, CPU)


def saved_state(cfg: Config, **overrides) -> dict:
    state = {
        "model": {},
        "optimizer": {},
        "scheduler": {},
        "scaler": {},
        "step": 30,
        "epoch": 1,
        "samples_in_epoch": 1280,
        "step_in_epoch": 10,
        "world_size": 1,
        "global_batch_size": 128,
        "config": cfg.to_dict(),
        "rng": [],
        "ledger": {"epoch": 1, "totals": [1280, 0, 0]},
        "data_fingerprint": "abc",
    }
    return {**state, **overrides}


def resume(cfg: Config, state: dict, info: DistInfo = ONE, name: str = "c.pt") -> train.Position:
    return train.resume_position(cfg, info, Path(name), state, 60000, "abc")


def test_position_continues_mid_epoch() -> None:
    cfg = Config()
    pos = resume(cfg, saved_state(cfg))
    assert (pos.step, pos.epoch, pos.samples_in_epoch) == (30, 1, 1280)


def test_mid_epoch_resume_with_another_world_size_is_reported(caplog) -> None:
    cfg = Config()
    with caplog.at_level("WARNING"):
        pos = resume(cfg, saved_state(cfg, world_size=2, global_batch_size=256))
    assert pos.samples_in_epoch == 1280  # the sampler hands the new ranks the rest of the epoch
    assert "global batch 256 (2 ranks) -> 128 (1 ranks)" in caplog.text


def test_same_global_batch_on_another_world_size_changes_no_math(caplog) -> None:
    cfg = parse_args(["--data.global_batch_size=256"])
    state = saved_state(cfg, world_size=4, global_batch_size=256)
    with caplog.at_level("WARNING"):
        resume(cfg, state, DistInfo(0, 0, 2, CPU, "gloo"))  # both: 256 per optimizer step
    assert "change the training math" not in caplog.text


def test_position_beyond_this_dataset_is_refused() -> None:
    cfg = Config()
    with pytest.raises(ConfigError, match="c.pt is 70000 samples into epoch 1.*60000"):
        resume(cfg, saved_state(cfg, samples_in_epoch=70000))


def test_checkpoint_from_elsewhere_is_named() -> None:
    cfg = Config()
    state = saved_state(cfg)
    del state["step_in_epoch"], state["scaler"], state["rng"]
    with pytest.raises(checkpoint.CheckpointError, match="x.pt lacks scaler, step_in_epoch, rng"):
        resume(cfg, state, name="x.pt")


def test_changed_math_settings_are_reported(caplog) -> None:
    old = parse_args(["--optim.lr=0.1", "--model.widths=8,16"])
    new = parse_args(["--optim.lr=0.05", "--model.widths=8,16", "--data.num_workers=0"])
    with caplog.at_level("WARNING"):
        resume(new, saved_state(old))
    assert "optim.lr 0.1 -> 0.05" in caplog.text and "num_workers" not in caplog.text


def test_model_mismatch_names_the_checkpoint() -> None:
    cfg = parse_args(["--model.widths=8,16"])
    splits = train.data.DataSplits(None, None, 1, 10, (0.5,), (0.25,))  # type: ignore[arg-type]
    model = train.build_model(cfg, splits, ONE)
    other = train.build_model(parse_args(["--model.widths=8,32"]), splits, ONE)
    optimizer = train.engine.build_optimizer(model, cfg.optim)
    scheduler = train.engine.build_scheduler(optimizer, cfg.optim, 10)
    state = saved_state(cfg, model=other.state_dict())
    with pytest.raises(checkpoint.CheckpointError, match="old.pt does not fit this run's model"):
        train.load_states(
            Path("old.pt"), state, model, optimizer, scheduler, train.engine.make_scaler(CPU, None)
        )


def test_syncbatch_on_cpu_ranks_is_refused() -> None:
    cfg = parse_args(["--model.norm=syncbatch"])
    splits = train.data.DataSplits(None, None, 1, 10, (0.5,), (0.25,))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="model.norm=syncbatch needs CUDA"):
        train.build_model(cfg, splits, DistInfo(0, 0, 2, CPU, "gloo"))


def test_fresh_run_in_a_used_run_dir_is_refused(tmp_path) -> None:
    checkpoint.save({"model": {}, "step": 40}, checkpoint.checkpoint_dir(tmp_path), 40, 2, None)
    with pytest.raises(checkpoint.CheckpointError, match=r"steps \[40\].*new --run.dir"):
        checkpoint.refuse_later_checkpoints(tmp_path, 0, "never")
    checkpoint.refuse_later_checkpoints(tmp_path, 40, "path/to/step_40.pt")  # nothing later
    checkpoint.refuse_later_checkpoints(tmp_path, 10, "auto")  # later ones were unloadable


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path) -> None:
    for step in (10, 20):
        checkpoint.save({"model": {}, "step": step}, tmp_path, step, keep=1, accuracy=0.9)
    # An unloadable later checkpoint that resume=auto skipped, and a stale best.json from it.
    (tmp_path / "step_30.pt").write_bytes(b"")
    (tmp_path / "best.json").write_text('{"step": 30, "accuracy": 0.99}')
    checkpoint.save({"model": {}, "step": 25}, tmp_path, 25, keep=1, accuracy=0.5)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [25, 30]
    assert checkpoint.read_best(tmp_path) == {"step": 25, "accuracy": 0.5}


def test_rng_states_round_trip_through_a_checkpoint(tmp_path) -> None:
    """Every generator a rank draws from continues where it stood (weights_only loading)."""
    import random

    import numpy as np

    import resilience

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)  # advance them somewhere
    state = resilience.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    path = tmp_path / "rng.pt"
    torch.save({"rng": [state]}, path)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    resilience.set_rng_state(torch.load(path, weights_only=True)["rng"][0])
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert again[0] == expected[0] and again[1] == expected[1]
    assert torch.equal(again[2], expected[2])
