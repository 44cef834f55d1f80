from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from helpers import REPO

import config
from config import Config, ConfigError, parse_args


def test_defaults_validate_and_every_field_is_documented() -> None:
    cfg = Config()
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            assert f.metadata.get("doc"), f"{section.name}.{f.name} has no doc"


def test_overrides_of_every_type_in_both_spellings() -> None:
    cfg = parse_args(
        [
            "--run.dir=/tmp/x",  # str
            "--train.epochs",
            "7",  # int, space-separated
            "--optim.lr=0.25",  # float
            "--data.augment=false",  # bool
            "--log.tensorboard",
            "no",  # bool, other spelling
            "--train.amp=fp16",  # Literal
            "--model.widths",
            "8,16,32,64",  # tuple[int, ...]
            "--optim.betas=0.8,0.95",  # tuple[float, ...]
        ]
    )
    assert cfg.run.dir == "/tmp/x"
    assert cfg.train.epochs == 7
    assert cfg.optim.lr == 0.25
    assert cfg.data.augment is False and cfg.log.tensorboard is False
    assert cfg.train.amp == "fp16"
    assert cfg.model.widths == (8, 16, 32, 64)
    assert cfg.optim.betas == (0.8, 0.95)
    assert Config().train.epochs != 7  # defaults untouched


def test_toml_file_and_cli_precedence(tmp_path) -> None:
    toml = tmp_path / "job.toml"
    toml.write_text(
        '"data.batch_size" = 32\n'
        "[train]\nepochs = 3\nmax_steps = 40\n"
        "[optim]\nlr = 0.05\n"
        "[model]\nwidths = [8, 16]\n"
    )
    cfg = parse_args(["--config", str(toml), "--train.epochs=5"])
    assert cfg.train.epochs == 5  # CLI beats file
    assert cfg.train.max_steps == 40  # file beats default
    assert cfg.optim.lr == 0.05
    assert cfg.model.widths == (8, 16)
    assert cfg.data.batch_size == 32
    assert cfg.data.num_workers == Config().data.num_workers  # default where neither sets it


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--train.epoch=3"], "did you mean train.epochs"),
        (["--optim.learning_rate=0.1"], "unknown config key 'optim.learning_rate'"),
        (["--data.batchsize=3"], "did you mean data.batch_size"),
    ],
)
def test_unknown_key_names_it_and_suggests(argv, expected) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_args(argv)


def test_unknown_key_in_toml_is_reported(tmp_path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("[train]\nepohcs = 2\n")
    with pytest.raises(ConfigError, match="train.epohcs.*config file.*did you mean train.epochs"):
        parse_args(["--config", str(toml)])


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--optim.lr=0"], "optim.lr", "0.0"),
        (["--optim.lr=-1"], "optim.lr", "-1.0"),
        (["--optim.lr=nan"], "optim.lr", "nan"),
        (["--data.batch_size=0"], "data.batch_size", "0"),
        (["--data.subset=-5"], "data.subset", "-5"),
        (["--train.grad_accum_steps=0"], "train.grad_accum_steps", "0"),
        (["--train.epochs=2.5"], "train.epochs", "2.5"),
        (["--train.amp=fp8"], "train.amp", "fp8"),
        (["--dist.backend=mpi"], "dist.backend", "mpi"),
        (["--dist.timeout_s=0"], "dist.timeout_s", "0"),
        (["--data.augment=maybe"], "data.augment", "maybe"),
        (["--model.widths=16,x"], "model.widths", "16,x"),
        (["--ckpt.keep=0"], "ckpt.keep", "0"),
        (["--optim.label_smoothing=1"], "optim.label_smoothing", "1.0"),
    ],
)
def test_invalid_values_name_field_and_value(argv, field, value) -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert field in str(err.value) and value in str(err.value)


def test_wrong_type_in_toml(tmp_path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text('[data]\nbatch_size = "big"\n')
    with pytest.raises(ConfigError, match="data.batch_size.*'big'.*integer"):
        parse_args(["--config", str(toml)])


def test_corrupt_or_missing_toml_names_the_file(tmp_path) -> None:
    toml = tmp_path / "broken.toml"
    toml.write_text("[train\nepochs = 2\n")
    with pytest.raises(ConfigError, match="broken.toml.*not valid TOML"):
        parse_args(["--config", str(toml)])
    with pytest.raises(ConfigError, match="nope.toml.*does not exist"):
        parse_args(["--config", str(tmp_path / "nope.toml")])


def test_missing_value_and_stray_argument() -> None:
    with pytest.raises(ConfigError, match="missing value for '--train.epochs'"):
        parse_args(["--train.epochs"])
    with pytest.raises(ConfigError, match="unexpected argument 'epochs=3'"):
        parse_args(["epochs=3"])


def test_help_lists_every_field_with_default() -> None:
    text = config.format_help()
    for key in config.field_types():
        assert f"--{key} (default:" in text
    assert "--model.widths (default: 16,32,64)" in text


def test_train_py_rejects_bad_config_before_any_process_group(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "train.py", f"--run.dir={run_dir}", "--optim.lr=-0.1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "optim.lr" in proc.stderr and "-0.1" in proc.stderr
    assert not run_dir.exists()


def test_config_round_trips_through_json() -> None:
    cfg = parse_args(["--model.widths=8,16"])
    loaded = json.loads(cfg.to_json())
    assert loaded["model"]["widths"] == [8, 16]
    assert cfg.fingerprint() != Config().fingerprint()


def test_home_directory_is_expanded_in_paths(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = parse_args(["--run.dir=~/runs/a", "--data.root=~/data", "--ckpt.resume=~/c/step_3.pt"])
    assert cfg.run.dir == f"{tmp_path}/runs/a"
    assert cfg.data.root == f"{tmp_path}/data"
    assert cfg.ckpt.resume == f"{tmp_path}/c/step_3.pt"
    assert parse_args(["--ckpt.resume=auto"]).ckpt.resume == "auto"
