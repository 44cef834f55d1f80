"""The Trainer's resume bookkeeping, checkpointed state and guards, without launching processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tiny_job_args

import auto
import build
import parallel
import resilience
import train
from ckpt import parts, retention, single, storage
from ckpt.atomic import CheckpointError
from ckpt.manager import FORMAT, CheckpointManager, RunRecord
from cli import parse_args
from config import CkptConfig, Config, ConfigError
from distributed import DistInfo
from runpaths import RunPaths

CPU = torch.device("cpu")
ONE = DistInfo(0, 0, 1, CPU)


def build_on_cpu(cfg: Config, splits: Any, info: DistInfo) -> torch.nn.Module:
    """build.build_model with the settings resolved as the Trainer resolves them."""
    channels_last = auto.channels_last(cfg.model.channels_last, info.device)
    return build.build_model(cfg, splits, info, channels_last, parallel.Layout.of(cfg.dist, info))


PARTS = ("position", "rng", "model", "optimizer", "scheduler", "scaler", "ledger")


class Recorder:
    """A stateful part that remembers what it was given."""

    def __init__(self, value: Any = None) -> None:
        self.value, self.loaded = value, None

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.loaded = saved


def saved_state(cfg: Config, **overrides) -> dict:
    saved = {
        "format": FORMAT,
        "model": {},
        "optimizer": {},
        "scheduler": {},
        "scaler": {},
        "position": {"step": 30, "epoch": 1, "samples_in_epoch": 1280},
        "step": 30,
        "world_size": 1,
        "global_batch_size": 128,
        "config": cfg.to_dict(),
        "rng": {"per_rank": []},
        "ledger": {"epoch": 1, "totals": [1280, 0, 0]},
        "data_fingerprint": "abc",
    }
    return {**saved, **overrides}


def manager_with(
    cfg: Config, info: DistInfo = ONE, **given: Any
) -> tuple[CheckpointManager, parts.Position]:
    """A manager with the Trainer's parts: a real Position, Recorders for the rest."""
    record = RunRecord.of(cfg, info.world_size, num_train=60000, data_fingerprint="abc")
    manager = CheckpointManager(cfg.ckpt, RunPaths(cfg.run.dir), record, info, ckpt_format="file")
    position = parts.Position()
    for name in PARTS:
        manager.register(name, given.get(name, position if name == "position" else Recorder()))
    return manager, position


def resume(cfg: Config, saved: dict, info: DistInfo = ONE, name: str = "c.pt") -> parts.Position:
    manager, position = manager_with(cfg, info)
    manager.restore(Path(name), saved)
    return position


def test_position_continues_mid_epoch() -> None:
    cfg = Config()
    pos = resume(cfg, saved_state(cfg))
    assert (pos.step, pos.epoch, pos.samples_in_epoch) == (30, 1, 1280)


def test_a_checkpoint_of_the_previous_format_resumes_where_it_stood() -> None:
    cfg = Config()
    old = {key: value for key, value in saved_state(cfg).items() if key != "format"}
    del old["position"]
    old.update(epoch=1, samples_in_epoch=1280, step_in_epoch=10, rng=[])
    pos = resume(cfg, old)
    assert (pos.step, pos.epoch, pos.samples_in_epoch) == (30, 1, 1280)


def test_a_checkpoint_of_a_newer_format_is_refused() -> None:
    cfg = Config()
    with pytest.raises(CheckpointError, match="c.pt has format 3, newer"):
        resume(cfg, saved_state(cfg, format=3))


def test_mid_epoch_resume_with_another_world_size_is_reported(caplog) -> None:
    cfg = Config()
    with caplog.at_level("WARNING"):
        pos = resume(cfg, saved_state(cfg, world_size=2, global_batch_size=256))
    assert pos.samples_in_epoch == 1280  # the sampler hands the new ranks the rest of the epoch
    assert "global batch 256 (2 ranks) -> 128 (1 ranks)" in caplog.text


def test_same_global_batch_on_another_world_size_changes_no_math(caplog) -> None:
    cfg = parse_args(["--data.global_batch_size=256"])
    saved = saved_state(cfg, world_size=4, global_batch_size=256)
    with caplog.at_level("WARNING"):
        resume(cfg, saved, DistInfo(0, 0, 2, CPU, "gloo"))  # both: 256 per optimizer step
    assert "change the training math" not in caplog.text


def test_a_setting_newer_than_the_checkpoint_is_a_change_only_off_its_default(caplog) -> None:
    """Before, a checkpoint from before train.deterministic existed resumed with the warning
    'train.deterministic None -> False': a change of nothing."""
    cfg = Config()
    older = cfg.to_dict()
    del older["train"]["deterministic"]
    with caplog.at_level("WARNING"):
        resume(cfg, saved_state(cfg, config=older))
    assert "change the training math" not in caplog.text, caplog.text
    on = parse_args(["--train.deterministic=true"])
    with caplog.at_level("WARNING"):
        resume(on, saved_state(on, config=older))
    assert "train.deterministic '(not in that version)' -> True" in caplog.text, caplog.text


def test_position_beyond_this_dataset_is_refused() -> None:
    cfg = Config()
    position = {"step": 30, "epoch": 1, "samples_in_epoch": 70000}
    with pytest.raises(ConfigError, match="c.pt is 70000 samples into epoch 1.*60000"):
        resume(cfg, saved_state(cfg, position=position))


def test_checkpoint_from_elsewhere_is_named() -> None:
    cfg = Config()
    saved = saved_state(cfg)
    del saved["scaler"], saved["rng"], saved["world_size"]
    with pytest.raises(CheckpointError, match="x.pt lacks rng, scaler, world_size"):
        resume(cfg, saved, name="x.pt")


def test_changed_math_settings_are_reported(caplog) -> None:
    old = parse_args(["--optim.lr=0.1", "--model.widths=8,16"])
    new = parse_args(["--optim.lr=0.05", "--model.widths=8,16", "--data.num_workers=0"])
    with caplog.at_level("WARNING"):
        resume(new, saved_state(old))
    assert "optim.lr 0.1 -> 0.05" in caplog.text and "num_workers" not in caplog.text


def test_model_mismatch_names_the_checkpoint() -> None:
    cfg = parse_args(["--model.widths=8,16"])
    splits = train.data.DataSplits(None, None, (1, 28, 28), 10, (0.5,), (0.25,))  # type: ignore[arg-type]
    model = build_on_cpu(cfg, splits, ONE)
    other = build_on_cpu(parse_args(["--model.widths=8,32"]), splits, ONE)
    manager, _ = manager_with(cfg, model=parts.ModelState(model))
    with pytest.raises(
        CheckpointError, match=r"old.pt does not fit this run's model.*use a new run.dir"
    ):
        manager.restore(Path("old.pt"), saved_state(cfg, model=other.state_dict()))


def test_the_manager_works_from_its_config_section_and_the_record_alone(tmp_path, caplog) -> None:
    """No Config: ckpt.* (keep=1), the run dir's paths and a record written by hand. It saves
    the record beside the parts, resumes the newest checkpoint into fresh parts, reports what
    the record says changed, and refuses another optimizer named by the record."""
    config = {"optim": {"name": "sgd", "lr": 0.1}, "run": {"dir": str(tmp_path)}}
    record = RunRecord(config, "0123abcd4567", 32, "sgd", num_train=64, data_fingerprint="d1")

    def manager(record: RunRecord) -> tuple[CheckpointManager, parts.Position, Recorder]:
        made = CheckpointManager(CkptConfig(keep=1), RunPaths(tmp_path), record, ONE, "file")
        position, weights = parts.Position(), Recorder(torch.arange(3.0))
        made.register("position", position)
        made.register("model", weights)
        return made, position, weights

    first, position, _ = manager(record)
    for step in (2, 4):
        position.step, position.samples_in_epoch = step, 16 * step
        first.save(step)
    assert [step for step, _ in retention.list_checkpoints(tmp_path / "checkpoints")] == [4]
    saved = torch.load(tmp_path / "checkpoints" / "step_4.pt", weights_only=True)
    assert (saved["config"], saved["config_hash"]) == (config, "0123abcd4567")
    assert (saved["global_batch_size"], saved["world_size"], saved["classes"]) == (32, 1, None)
    assert saved["data_fingerprint"] == "d1"

    changed = RunRecord(
        {"optim": {"name": "sgd", "lr": 0.2}}, "x", 64, "sgd", num_train=64, data_fingerprint="d2"
    )
    second, position, weights = manager(changed)
    with caplog.at_level("WARNING"):
        resumed = second.resume()
    assert resumed is not None and resumed.path == tmp_path / "checkpoints" / "step_4.pt"
    assert (position.step, position.samples_in_epoch) == (4, 64)
    assert torch.equal(weights.loaded["value"], torch.arange(3.0))
    assert "optim.lr 0.1 -> 0.2; global batch 32 (1 ranks) -> 64 (1 ranks); the training or " in (
        caplog.text
    )
    adamw = RunRecord({}, "x", 32, "adamw", num_train=64, data_fingerprint="d1")
    with pytest.raises(ConfigError, match="optim.name='adamw' cannot resume checkpoint"):
        manager(adamw)[0].resume()


def test_a_checkpoint_records_the_whole_config_of_the_run(tmp_path) -> None:
    """What the Trainer hands its manager: the config as cfg.to_dict() and cfg.fingerprint()
    give it, and the global batch (16 per rank x 1 rank x 2 micro-steps, by hand)."""
    args = ["--train.epochs=1", "--train.grad_accum_steps=2", "--optim.lr=0.3"]
    cfg = parse_args([f"--run.dir={tmp_path}", *TINY, *args])
    handler = resilience.PreemptionHandler(cfg.run.preempt_signals)
    with train.Trainer(cfg, ONE, handler) as trainer:
        trainer.fit()
    saved = torch.load(tmp_path / "checkpoints" / "step_2.pt", weights_only=True)
    assert saved["config"] == cfg.to_dict() and saved["config_hash"] == cfg.fingerprint()
    assert (saved["global_batch_size"], saved["world_size"]) == (32, 1)


def test_a_part_is_registered_once_and_must_be_stateful() -> None:
    manager, _ = manager_with(Config())
    with pytest.raises(ValueError, match="'model' is registered already"):
        manager.register("model", Recorder())
    with pytest.raises(ValueError, match="'step' is registered already or reserved"):
        manager.register("step", Recorder())
    with pytest.raises(TypeError, match="object has no state_dict"):
        manager.register("ema", object())  # type: ignore[arg-type]


TINY = tiny_job_args(
    data_synthetic_train_size=64,
    data_synthetic_eval_size=32,
    model_widths="4,8",
    log_mfu=False,
    dist_preflight=False,
)


def test_new_checkpointed_state_is_one_registration(tmp_path) -> None:
    """An extra part (here a running mean of the weights, as an EMA would keep) registered
    with the Trainer's checkpoint manager is saved in every checkpoint and handed back,
    exactly, to the next run that resumes from it."""

    class WeightMean:
        def __init__(self, model: torch.nn.Module) -> None:
            self.model, self.mean, self.count, self.loaded = model, None, 0, None

        def update(self) -> None:
            flat = torch.cat([p.detach().flatten() for p in self.model.parameters()])
            self.count += 1
            self.mean = flat if self.mean is None else self.mean + (flat - self.mean) / self.count

        def state_dict(self) -> dict[str, Any]:
            return {"mean": self.mean, "count": self.count}

        def load_state_dict(self, saved: dict[str, Any]) -> None:
            self.loaded = saved

    def run(epochs: int) -> WeightMean:
        cfg = parse_args([f"--run.dir={tmp_path}", f"--train.epochs={epochs}", *TINY])
        handler = resilience.PreemptionHandler(cfg.run.preempt_signals)
        with train.Trainer(cfg, ONE, handler) as trainer:
            mean = WeightMean(trainer.model)
            trainer.checkpoints.register("weight_mean", mean)  # the one line that adds state
            original = trainer.train_step

            def step_and_update() -> resilience.Verdict:
                verdict = original()
                mean.update()
                return verdict

            trainer.train_step = step_and_update  # type: ignore[method-assign]
            trainer.fit()
        return mean

    first = run(epochs=1)
    saved = torch.load(tmp_path / "checkpoints" / "step_4.pt", weights_only=True)
    assert saved["weight_mean"]["count"] == 4 and torch.equal(
        saved["weight_mean"]["mean"], first.mean
    )
    second = run(epochs=2)
    assert second.loaded is not None and second.loaded["count"] == 4
    assert torch.equal(second.loaded["mean"], first.mean)


def test_syncbatch_on_cpu_ranks_is_refused_with_advice_the_model_takes() -> None:
    """model.norm=group is mini_resnet's only (config refuses it for any other model): the
    advice for a torchvision model is batch alone (before: "batch or group" for every model)."""
    splits = train.data.DataSplits(None, None, (3, 32, 32), 10, (0.5,), (0.25,))  # type: ignore[arg-type]
    for model, advice in [([], "batch or group"), (["--model.name=resnet18"], "batch")]:
        cfg = parse_args(["--model.norm=syncbatch", *model])
        with pytest.raises(ConfigError, match=rf"needs CUDA .*; use model.norm={advice} on CPU$"):
            build_on_cpu(cfg, splits, DistInfo(0, 0, 2, CPU, "gloo"))
        parse_args([f"--model.norm={advice.split()[-1]}", *model])  # the advice is accepted


def test_fresh_run_in_a_used_run_dir_is_refused(tmp_path) -> None:
    single.save({"model": {}, "step": 40}, storage.checkpoint_dir(tmp_path), 40, 2, None)
    with pytest.raises(CheckpointError, match=r"steps \[40\].*new --run.dir"):
        storage.refuse_later_checkpoints(tmp_path, 0, "never")
    storage.refuse_later_checkpoints(tmp_path, 40, "path/to/step_40.pt")  # nothing later
    storage.refuse_later_checkpoints(tmp_path, 10, "auto")  # later ones were unloadable


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path) -> None:
    for step in (10, 20):
        single.save({"model": {}, "step": step}, tmp_path, step, keep=1, accuracy=0.9)
    # An unloadable later checkpoint that resume=auto skipped, and a stale best.json from it.
    (tmp_path / "step_30.pt").write_bytes(b"")
    (tmp_path / "best.json").write_text('{"step": 30, "accuracy": 0.99}')
    single.save({"model": {}, "step": 25}, tmp_path, 25, keep=1, accuracy=0.5)
    assert [s for s, _ in retention.list_checkpoints(tmp_path)] == [25, 30]
    assert retention.read_best(tmp_path) == {"step": 25, "accuracy": 0.5}


def test_rng_states_round_trip_through_a_checkpoint(tmp_path) -> None:
    """Every generator a rank draws from continues where it stood (weights_only loading)."""
    import random

    import numpy as np

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)  # advance them somewhere
    state = parts.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    path = tmp_path / "rng.pt"
    torch.save({"rng": [state]}, path)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    parts.set_rng_state(torch.load(path, weights_only=True)["rng"][0])
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert again[0] == expected[0] and again[1] == expected[1]
    assert torch.equal(again[2], expected[2])


def test_resuming_with_other_class_folders_is_refused_naming_them() -> None:
    """A label is a class's index: a renamed, added or removed class folder silently re-labels
    the data, so the checkpoint's class list must match."""
    cfg = Config()
    classes = ("cat", "dog", "fox")
    record = RunRecord.of(cfg, 1, 60000, "abc", classes)
    manager = CheckpointManager(cfg.ckpt, RunPaths(cfg.run.dir), record, ONE, "file")
    manager.register("position", parts.Position())
    assert manager._meta(3, None, False)["classes"] == list(classes)
    manager.restore(Path("same.pt"), saved_state(cfg, classes=["cat", "dog", "fox"]))
    with pytest.raises(
        ConfigError,
        match=r"old.pt was trained on the classes \[cat, dog, owl\].*gone: owl.*new: fox",
    ):
        manager.restore(Path("old.pt"), saved_state(cfg, classes=["cat", "dog", "owl"]))
    manager.restore(Path("older.pt"), saved_state(cfg))  # written before classes were saved


def test_a_warmup_longer_than_a_quarter_of_the_run_is_shortened() -> None:
    """By hand: 20 steps, warmup asked for 100, given 5; then cosine from step 5 to 19."""
    import math

    from optim import schedules, spec

    model = torch.nn.Linear(2, 2)
    optimizer = spec.build_optimizer(model, parse_args(["--optim.lr=1.0"]).optim, "foreach")
    scheduler = schedules.build_scheduler(optimizer, parse_args([]).optim, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    expected = [(s + 1) / 5 for s in range(5)]
    expected += [0.5 * (1 + math.cos(math.pi * (s - 5) / 14)) for s in range(5, 20)]
    assert lrs == pytest.approx(expected)


def test_weight_average_by_hand() -> None:
    """ema <- d x ema + (1 - d) x weights after each step, d = min(decay, (1 + n) / (10 + n));
    buffers come from the model as they are."""
    from optim import ema

    model = torch.nn.BatchNorm1d(2)
    average = ema.WeightAverage(model, decay=0.5)
    expected = model.weight.detach().clone()
    for n, value in enumerate((1.0, 3.0, -2.0, 5.0)):
        with torch.no_grad():
            model.weight.fill_(value)
        average.update()
        decay = min(0.5, (1 + n) / (10 + n))
        expected = decay * expected + (1 - decay) * value
    model.running_mean.fill_(7.0)
    with average.applied() as evaluated:
        torch.testing.assert_close(evaluated.weight, expected)
        assert evaluated.running_mean.tolist() == [7.0, 7.0]
    assert model.weight.tolist() == [5.0, 5.0]  # the trained weights are back after the block
    saved = average.state_dict()
    assert saved["weights"]["running_mean"].tolist() == [7.0, 7.0]  # a loadable state_dict
    restored = ema.WeightAverage(torch.nn.BatchNorm1d(2), decay=0.5)
    restored.load_state_dict(saved)
    assert restored.updates == 4
    torch.testing.assert_close(restored.state_dict()["weights"]["weight"], expected)
    restored.restart()  # after loading model.weights: the average starts from the weights
    assert restored.updates == 0
    assert restored.state_dict()["weights"]["weight"].tolist() == [1.0, 1.0]  # BatchNorm's init


def test_flip_evaluation_averages_the_logits_of_each_image_and_its_mirror() -> None:
    import engine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6, 3))
    images, labels = torch.rand(4, 1, 2, 3), torch.tensor([0, 1, 2, 1])
    result = engine.evaluate(model, [(images, labels)], CPU, None, flip=True)
    with torch.no_grad():
        logits = (model(images) + model(images.flip(-1))) / 2
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert result.loss == pytest.approx(loss)
    assert result.accuracy == (logits.argmax(1) == labels).float().mean().item()
    plain = engine.evaluate(model, [(images, labels)], CPU, None)
    assert plain.loss != pytest.approx(loss)  # the flip changed the logits


def test_turning_the_weight_average_on_at_a_resume_starts_it_from_the_resumed_weights(
    caplog,
) -> None:
    """A checkpoint written without train.ema_decay resumes with it: the average starts from
    the weights just loaded (a warning says so) instead of the run failing on a missing part.
    Any other missing part is still refused."""
    from optim import ema

    cfg = Config()
    model = torch.nn.Linear(2, 2)
    saved = saved_state(cfg, model={"weight": torch.full((2, 2), 3.0), "bias": torch.zeros(2)})
    manager, _ = manager_with(cfg, model=parts.ModelState(model))
    average = ema.WeightAverage(model, decay=0.9)
    manager.register("ema", average, ("train.ema_decay", average.restart))
    with caplog.at_level("WARNING"):
        manager.restore(Path("c.pt"), saved)
    assert "train.ema_decay was not set when checkpoint c.pt was written" in caplog.text
    assert average.updates == 0
    assert torch.equal(average.state_dict()["weights"]["weight"], torch.full((2, 2), 3.0))
    without_ledger = {key: value for key, value in saved.items() if key != "ledger"}
    with pytest.raises(CheckpointError, match="c.pt lacks ledger"):
        manager.restore(Path("c.pt"), without_ledger)


def test_samples_labelled_ignore_are_named_as_such_not_as_unreadable_images(
    tmp_path, monkeypatch, caplog
) -> None:
    """A data.factory's samples labelled -100 (cross_entropy's ignore_index) are left out of
    the evaluation's count; the warning said "unreadable images" (data.bad_images=skip's
    cause) for them. Of 32 samples, 5 are labelled -100: 27 counted, by hand."""
    import types

    labels = [-100 if i % 7 == 3 else i % 2 for i in range(32)]  # 3, 10, 17, 24, 31: ignored
    samples = [(torch.full((1, 8, 8), 60 + 100 * max(y, 0), dtype=torch.uint8), y) for y in labels]
    module = types.ModuleType("ignored_labels_for_test")
    module.make = lambda root: {  # type: ignore[attr-defined]
        "train": samples * 2,
        "eval": samples,
        "num_classes": 2,
        "input_shape": (1, 8, 8),
    }
    monkeypatch.setitem(sys.modules, "ignored_labels_for_test", module)
    model_and_run = [a for a in TINY if not a.startswith(("--data.dataset", "--data.synthetic_"))]
    factory = ["--data.factory=ignored_labels_for_test:make", *model_and_run, "--train.epochs=1"]
    cfg = parse_args([f"--run.dir={tmp_path}", *factory])
    handler = resilience.PreemptionHandler(cfg.run.preempt_signals)
    with caplog.at_level("WARNING"), train.Trainer(cfg, ONE, handler) as trainer:
        summary = trainer.fit()
    assert summary["eval_num_samples"] == 27
    assert "evaluated 27 of the 32 samples: 5 are labelled -100, the ignore label" in caplog.text
    assert "unreadable" not in caplog.text


def test_train_deterministic_turns_on_deterministic_kernels(monkeypatch) -> None:
    """train.deterministic: torch's deterministic mode (warn only) and cuDNN's deterministic
    algorithms, with the cuBLAS workspace setting cuBLAS needs for it (read at its first
    handle); off by default. The GPU half is tests/test_gpu.py (resumes bit for bit)."""
    from cli import parse_args
    from distributed import DistInfo

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # restored (or removed) afterwards
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    info = DistInfo(0, 0, 1, torch.device("cpu"))
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    try:
        build.configure_cuda(parse_args([]), info)
        assert not torch.are_deterministic_algorithms_enabled()
        build.configure_cuda(parse_args(["--train.deterministic=true"]), info)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic = before[1]


def test_resuming_with_other_augmentation_is_reported_as_a_change_of_the_math(caplog) -> None:
    """aug.* changes what is trained on (the review found it missing from MATH_SECTIONS: a
    resume with another mixup alpha said nothing)."""
    from cli import parse_args

    old, new = parse_args([]), parse_args(["--aug.mixup_alpha=0.2"])
    with caplog.at_level("WARNING"):
        resume(new, saved_state(old))
    assert "aug.mixup_alpha 0.0 -> 0.2" in caplog.text
