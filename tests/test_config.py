from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers import REPO, unboxed

import config
from config import Config, ConfigError, parse_args


def rejected(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """When `argv` is refused: the one-line reason (the ConfigError that train.py prints and
    exits 2 on) and tyro's explanation above it, as plain text."""
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    return str(err.value), unboxed(capsys.readouterr().err)


def help_text(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    assert done.value.code in (0, None)
    return unboxed(capsys.readouterr().out)


def test_defaults_validate_and_every_field_is_documented(capsys) -> None:
    Config()
    text = help_text(capsys)
    for key in config.field_types():
        # The key, its metavar, then words of documentation (not straight to the default).
        assert re.search(rf"--{re.escape(key)} \S+ [a-zA-Z]", text), f"{key} has no doc"


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
    ("argv", "key", "suggestion"),
    [
        (["--train.epoch=3"], "train.epoch", "--train.epochs"),
        (["--optim.learning_rate=0.1"], "optim.learning_rate", None),  # nothing close
        (["--data.batchsize=3"], "data.batchsize", "--data.batch_size"),
    ],
)
def test_unknown_key_names_it_and_suggests(argv, key, suggestion, capsys) -> None:
    reason, explained = rejected(argv, capsys)
    assert reason.startswith(f"Unrecognized options: --{key}=")
    if suggestion:
        assert reason.endswith(f"; did you mean {suggestion}?")
        assert re.search(rf"Perhaps you meant: {re.escape(suggestion)}\b", explained), explained
    assert "train.py --help" in explained


def test_unknown_key_in_toml_is_reported(tmp_path, capsys) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("[train]\nepohcs = 2\n")
    reason, explained = rejected(["--config", str(toml)], capsys)
    assert reason.startswith(f"config file '{toml}': Unrecognized options: --train.epohcs=2")
    assert reason.endswith("did you mean --train.epochs?")
    assert "Perhaps you meant: --train.epochs" in explained


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
def test_invalid_values_name_field_and_value(argv, field, value, capsys) -> None:
    reason, explained = rejected(argv, capsys)
    assert re.search(rf"{re.escape(field)}: '?{re.escape(value)}\b", reason), reason
    assert reason in explained  # the box above says the same


def test_wrong_type_in_toml(tmp_path, capsys) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text('[data]\nbatch_size = "big"\n')
    reason, _ = rejected(["--config", str(toml)], capsys)
    assert reason == f"config file '{toml}': data.batch_size = 'big' is not an integer"
    for text, expected in [
        ("[train]\nepochs = [3]\n", "train.epochs = [3] is not an integer"),
        ("[run]\ndir = 5\n", "run.dir = 5 is not a string"),
        ("[ckpt]\nresume = true\n", "ckpt.resume = True is not a string"),
        ('[model]\nwidths = ["a"]\n', "model.widths = ['a'] is not a list of integers"),
        ("[data]\naugment = 1\n", "data.augment = 1 is not true or false"),
    ]:
        toml.write_text(text)
        assert rejected(["--config", str(toml)], capsys)[0].endswith(expected), text


def test_a_file_is_checked_with_the_command_line_over_it(tmp_path, capsys) -> None:
    """The merged configuration is checked, not the file alone: a command line that repairs a
    file's combination is accepted, and a file value the command line does not set is kept
    (an integral TOML float counts as an integer)."""
    toml = tmp_path / "job.toml"
    toml.write_text("[dist]\nstatic_graph = true\n[train]\ngrad_accum_steps = 2\nepochs = 3.0\n")
    reason, _ = rejected(["--config", str(toml)], capsys)
    assert "dist.static_graph=true cannot be combined" in reason
    cfg = parse_args(["--config", str(toml), "--train.grad_accum_steps=1"])
    assert (cfg.dist.static_graph, cfg.train.grad_accum_steps, cfg.train.epochs) == (True, 1, 3)
    toml.write_text("[optim]\nlr = -1.0\n")
    assert parse_args(["--config", str(toml), "--optim.lr=0.1"]).optim.lr == 0.1


def test_corrupt_or_missing_toml_names_the_file(tmp_path) -> None:
    toml = tmp_path / "broken.toml"
    toml.write_text("[train\nepochs = 2\n")
    with pytest.raises(ConfigError, match="broken.toml.*not valid TOML"):
        parse_args(["--config", str(toml)])
    with pytest.raises(ConfigError, match="nope.toml.*does not exist"):
        parse_args(["--config", str(tmp_path / "nope.toml")])


def test_missing_value_and_stray_argument(capsys) -> None:
    assert "Missing value for argument '--train.epochs'" in rejected(["--train.epochs"], capsys)[0]
    assert "Unrecognized options: epochs=3" in rejected(["epochs=3"], capsys)[0]
    assert "missing value for '--config'" in rejected(["--config"], capsys)[0]


def test_help_lists_every_field_with_default(capsys) -> None:
    text = help_text(capsys)
    for key in config.field_types():
        assert re.search(rf"--{re.escape(key)} .*?\(default: ", text), key
    assert re.search(r"--model\.widths INT,\.\.\. .*?\(default: 16,32,64\)", text)
    assert "--data.augment {true,false}" in text and "--train.amp {auto,none,bf16,fp16}" in text


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
    assert "error: invalid value for optim.lr: -0.1 (must be a finite number > 0)" in proc.stderr
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


def test_builder_and_factory_kwargs_from_the_command_line_and_a_toml_table(tmp_path) -> None:
    cfg = parse_args(["--model.name=resnet18", '--model.kwargs={"zero_init_residual": true}'])
    assert json.loads(cfg.model.kwargs) == {"zero_init_residual": True}
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[model]\nfactory = "mymodels:net"\n[model.kwargs]\nwidth = 48\nsizes = [1, 2]\n'
        "[data.kwargs]\nlimit = 100\n"
    )
    cfg = parse_args([f"--config={toml}"])
    assert cfg.model.factory == "mymodels:net"
    assert json.loads(cfg.model.kwargs) == {"width": 48, "sizes": [1, 2]}
    assert json.loads(cfg.data.kwargs) == {"limit": 100}
    assert json.loads(Config().model.kwargs) == {}


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--model.kwargs=[1, 2]"], "model.kwargs", "'[1, 2]'"),
        (['--model.kwargs={"num_classes": 3}'], "model.kwargs", "num_classes"),
        (["--data.factory=module_without_function"], "data.factory", "module_without_function"),
        (["--model.name=resnet18", "--model.widths=8,16"], "model.widths", "(8, 16)"),
        (["--model.factory=m:f", "--model.norm=group"], "model.norm", "group"),
        (["--data.crop_scale=0.5,0.1"], "data.crop_scale", "(0.5, 0.1)"),
        (["--data.crop_ratio=1.5"], "data.crop_ratio", "1.5"),
        (["--data.mean=0.5,0.5", "--data.std=0.2"], "data.std", "(0.2,)"),
    ],
)
def test_model_and_data_choices_name_field_and_value(argv, field, value, capsys) -> None:
    reason, _ = rejected(argv, capsys)
    assert field in reason and value in reason, reason


@pytest.mark.parametrize("recipe", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_recipe_parses(recipe) -> None:
    cfg = parse_args([f"--config={recipe}"])
    assert cfg.train.epochs >= 1
