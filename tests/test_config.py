from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers import REPO, unboxed

import cli
from cli import parse_args
from config import Config, ConfigError, load_factory


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
    for key in cli.field_types():
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
            "--optim.name=adamw",
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
    ("argv", "suggestion"),
    [
        (["--train.epoch=3"], "--train.epochs"),
        (["--data.batchsize=3"], "--data.batch_size"),
        (["--optimizer.lr=0.1"], "--optim.lr"),  # a misspelt section
        (["--train.epoch", "3"], "--train.epochs"),  # the value as the next argument
        (["--Data.batch_size=3"], "--data.batch_size"),
        # tyro 1.0.17 scores the whole `--key=value` token (difflib, cutoff 0.8, in
        # _backends/_tyro_help_formatting.py): these got no suggestion, or lost it when the
        # value grew longer.
        (["--data.datset=synthetic"], "--data.dataset"),
        (["--train.epochs_=3"], "--train.epochs"),
        (["--model.widht=" + "16," * 12 + "16"], "--model.widths"),
        (["--optim.learning_rate=0.1"], None),  # nothing close: no guess
    ],
)
def test_unknown_key_is_named_with_the_nearest_key(argv, suggestion, capsys) -> None:
    """Suggested by key alone, whatever the value (tyro's box is not read)."""
    reason, _ = rejected(argv, capsys)
    key = argv[0].split("=")[0]
    assert reason.startswith(f"unknown option {key}"), reason
    if suggestion:
        assert reason.endswith(f"did you mean {suggestion}? (--help lists every key)"), reason
    else:
        assert "did you mean" not in reason and reason.endswith("(--help lists every key)")


@pytest.mark.parametrize(
    ("toml", "key", "suggestion"),
    [
        ("[train]\nepohcs = 2\n", "train.epohcs = 2", "train.epochs"),
        ('[data]\ndatset = "synthetic"\n', "data.datset = 'synthetic'", "data.dataset"),
        ("[optimizer]\nlr = 0.1\n", "optimizer.lr = 0.1", "optim.lr"),
        ('"model.widht" = [8, 16]\n', "model.widht = [8, 16]", "model.widths"),
    ],
)
def test_unknown_key_in_toml_is_named_with_the_nearest_key(
    toml, key, suggestion, tmp_path, capsys
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    reason, _ = rejected(["--config", str(path)], capsys)
    assert reason == f"config file '{path}': unknown key {key}; did you mean {suggestion}?"


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--optim.lr=0"], "optim.lr", "0.0"),
        (["--optim.lr=-1"], "optim.lr", "-1.0"),
        (["--optim.lr=nan"], "optim.lr", "nan"),
        (["--data.batch_size=0"], "data.batch_size", "0"),
        # Ignored or misleading together (the review): the resize given overrides crop_ratio,
        # and unaugmented training would take the evaluation's crop, not data.image_size.
        (
            ["--data.dataset=imagefolder", "--data.eval_resize_size=300", "--data.crop_ratio=0.9"],
            "data.crop_ratio",
            "0.9",
        ),
        (
            ["--data.dataset=imagefolder", "--data.eval_crop_size=200", "--data.augment=false"],
            "data.eval_crop_size",
            "200",
        ),
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
    assert explained == ""  # said once, by the reason (tyro's box repeated it above before)


def test_train_py_says_a_bad_value_once() -> None:
    """Before, tyro's box and the error line both gave the reason: printed twice."""
    done = subprocess.run(
        [sys.executable, "train.py", "--data.batch_size=abc"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == "error: --data.batch_size: 'abc' is not an integer\n", done.stderr


def test_a_key_in_the_wrong_toml_section_is_pointed_to_its_section(tmp_path, capsys) -> None:
    """`[data] lr = 0.1` got "(--help lists every key)": the section spoils the score."""
    toml = tmp_path / "job.toml"
    toml.write_text("[data]\nlr = 0.1\n")
    reason, _ = rejected(["--config", str(toml)], capsys)
    assert reason.endswith("unknown key data.lr = 0.1; did you mean optim.lr?"), reason
    assert "did you mean --optim.lr?" in rejected(["--model.lr=0.1"], capsys)[0]


def test_a_factory_function_misspelt_gets_the_nearest_name(tmp_path, monkeypatch) -> None:
    (tmp_path / "mymodels.py").write_text("def small_cnn(num_classes):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"no function 'smallcnn'; did you mean mymodels:small_cnn\?"
    ):
        load_factory("model.factory", "mymodels:smallcnn")


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
    for argv in (["--train.epochs"], ["--train.epochs", "--optim.lr=0.1"]):
        reason = rejected(argv, capsys)[0]
        assert reason == "missing value for --train.epochs: write --train.epochs=VALUE", reason
    assert rejected(["epochs=3"], capsys)[0] == (
        "unexpected argument 'epochs=3': options start with --; did you mean --train.epochs=3?"
    )
    assert "missing value for '--config'" in rejected(["--config"], capsys)[0]


def test_help_lists_every_field_with_default(capsys) -> None:
    text = help_text(capsys)
    for key in cli.field_types():
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


# ---------------------------------------------------------------------------------------------
# Nothing accepted and then ignored (issue 21, B.3): each setting below did nothing at all.


def test_weights_that_do_not_exist_are_refused_at_parse_time(tmp_path, capsys) -> None:
    """Even where they would not be loaded (a run dir with checkpoints): a path that names no
    file is a typo, whatever the run dir holds."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    missing = tmp_path / "w.pt"
    reason, _ = rejected([f"--run.dir={tmp_path / 'run'}", f"--model.weights={missing}"], capsys)
    assert f"model.weights: {str(missing)!r}" in reason and "no such file" in reason, reason
    missing.write_bytes(b"")  # existence is checked here; what the file holds, when loaded
    assert parse_args([f"--model.weights={missing}"]).model.weights == str(missing)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--model.name=resnet18", "--model.factory=m:f"], ("model.name=resnet18", "m:f")),
        # The default's own name, given explicitly, is ignored just the same.
        (["--model.factory=m:f", "--model.name=mini_resnet"], ("model.name=mini_resnet",)),
        (["--data.dataset=synthetic", "--data.factory=m:f"], ("data.dataset=synthetic",)),
        (["--data.factory=m:f", "--data.dataset=fashion_mnist"], ("data.dataset=fashion_mnist",)),
    ],
)
def test_a_name_beside_a_factory_is_refused(argv, named, capsys) -> None:
    reason, _ = rejected(argv, capsys)
    assert all(text in reason for text in named), reason
    assert "factory=m:f" in reason, reason


@pytest.mark.parametrize(
    ("argv", "setting", "choice"),
    [
        (["--data.dataset=cifar10", "--data.image_size=64"], "data.image_size=64", "cifar10"),
        (["--data.crop_ratio=0.9"], "data.crop_ratio=0.9", "data.dataset=fashion_mnist"),
        (["--data.dataset=synthetic", "--data.bad_images=skip"], "data.bad_images=skip", "synth"),
        (["--data.decode=workers"], "data.decode=workers", "data.dataset=fashion_mnist"),
        (["--data.crop_scale=0.5,1"], "data.crop_scale=0.5,1", "fashion_mnist"),
        (["--data.synthetic_train_size=100"], "data.synthetic_train_size=100", "fashion_mnist"),
        (
            ["--data.dataset=imagefolder", "--data.synthetic_shape=3,32,32"],
            "data.synthetic_shape=3,32,32",
            "data.dataset=imagefolder",
        ),
        (
            ["--data.factory=m:f", "--data.synthetic_num_classes=3"],
            "data.synthetic_num_classes=3",
            "data.factory=m:f",
        ),
        (["--data.dataset=imagefolder", "--data.crop_padding=4"], "data.crop_padding=4", "image"),
        (["--data.dataset=synthetic", "--data.download=false"], "data.download=false", "synth"),
        (["--optim.betas=0.8,0.99"], "optim.betas=0.8,0.99", "optim.name=sgd"),
        (["--optim.name=adamw", "--optim.momentum=0.8"], "optim.momentum=0.8", "adamw"),
        (["--optim.name=adamw", "--optim.nesterov=false"], "optim.nesterov=false", "adamw"),
        # Explicitly the default: still ignored by a torchvision model.
        (["--model.name=resnet18", "--model.widths=16,32,64"], "model.widths=16,32,64", "res"),
        (["--model.factory=m:f", "--model.stem_stride=1"], "model.stem_stride=1", "m:f"),
        # Replaced by the derived value before this check existed, without a word.
        (
            ["--data.global_batch_size=256", "--data.batch_size=64"],
            "data.batch_size=64",
            "data.global_batch_size=256",
        ),
        # torch's DataLoader takes prefetch_factor only with workers (it raises otherwise).
        (["--data.num_workers=0", "--data.prefetch_factor=8"], "prefetch_factor=8", "workers=0"),
    ],
)
def test_a_field_another_choice_ignores_is_refused(argv, setting, choice, capsys) -> None:
    reason, _ = rejected(argv, capsys)
    assert setting in reason and choice in reason, reason


def test_fields_with_their_own_choice_are_accepted() -> None:
    cfg = parse_args(
        [
            "--data.dataset=imagefolder",
            "--data.image_size=64",
            "--data.crop_ratio=0.9",
            "--data.crop_scale=0.5,1",
            "--data.bad_images=skip",
            "--data.decode=workers",
            "--optim.name=adamw",
            "--optim.betas=0.8,0.99",
            "--model.name=resnet18",
        ]
    )
    assert (cfg.data.image_size, cfg.optim.betas, cfg.model.name) == (64, (0.8, 0.99), "resnet18")
    cfg = parse_args(
        ["--data.dataset=synthetic", "--data.synthetic_train_size=100", "--data.crop_padding=3"]
    )
    assert (cfg.data.synthetic_train_size, cfg.data.crop_padding) == (100, 3)
    cfg = parse_args(["--optim.momentum=0.8", "--optim.nesterov=false", "--model.widths=8,16"])
    assert (cfg.optim.momentum, cfg.optim.nesterov, cfg.model.widths) == (0.8, False, (8, 16))


def test_settings_this_placement_ignores_are_named() -> None:
    """DDP's knobs at world size 1 (distributed.wrap_model returns the bare model) and
    train.cuda_fast_math on a CPU (build.configure_cuda sets CUDA's flags) do nothing: said
    at start, given explicitly or not; not refused, since one config file may serve runs at
    every scale and on every device."""
    given = cli.given_settings(["--dist.static_graph=true", "--train.cuda_fast_math=true"])
    assert cli.ignored_here(given, 2, "cuda") == []
    alone_on_cpu = cli.ignored_here(given, 1, "cpu")
    assert alone_on_cpu == [
        "dist.static_graph=true has no effect at world size 1 (no DistributedDataParallel): "
        "ignored",
        "train.cuda_fast_math=true has no effect on a CPU (cuDNN and TF32 are CUDA's): ignored",
    ]
    assert cli.ignored_here(cli.given_settings(["--data.batch_size=8"]), 1, "cpu") == []


def test_a_field_ignored_because_of_a_file_names_the_file(tmp_path, capsys) -> None:
    """The recipe sets synthetic sizes, the command line switches the dataset: the message
    says where the ignored value came from."""
    toml = tmp_path / "synthetic.toml"
    toml.write_text('[data]\ndataset = "synthetic"\nsynthetic_train_size = 100\n')
    reason, _ = rejected(["--config", str(toml), "--data.dataset=cifar10"], capsys)
    assert reason.startswith(f"config file '{toml}': data.synthetic_train_size=100"), reason
    assert "data.dataset=cifar10" in reason


@pytest.mark.parametrize(
    ("argv", "value"),
    [
        (["--model.widths=16,,32"], "16,,32"),
        (["--model.widths=16,32,"], "16,32,"),
        (["--data.mean=0.5,,0.5"], "0.5,,0.5"),
        (["--log.profile_steps=,5"], ",5"),
    ],
)
def test_a_list_with_an_empty_element_is_refused(argv, value, capsys) -> None:
    """16,,32 was read as 16,32: a slip that trained another model."""
    reason, _ = rejected(argv, capsys)
    field = argv[0][2:].split("=")[0]
    assert reason.startswith(f"--{field}: {value!r} has an empty element"), reason


def test_an_empty_list_keeps_its_documented_meaning() -> None:
    cfg = parse_args(["--data.mean=", "--data.std=", "--log.profile_steps="])
    assert (cfg.data.mean, cfg.data.std, cfg.log.profile_steps) == ((), (), ())


def test_preemption_signals_are_turned_off_only_by_name(tmp_path, capsys) -> None:
    """An empty value (`--run.preempt_signals=$UNSET`) is refused: it would turn the
    preemption checkpoint off. `none` says so on purpose."""
    for argv in (["--run.preempt_signals="], ["--run.preempt_signals", ""]):
        reason, _ = rejected(argv, capsys)
        assert reason.startswith("run.preempt_signals: '' (empty)"), reason
        assert "none" in reason
    toml = tmp_path / "signals.toml"
    toml.write_text("[run]\npreempt_signals = []\n")
    reason, _ = rejected([f"--config={toml}"], capsys)
    assert reason.startswith(f"config file '{toml}': run.preempt_signals: '' (empty)"), reason
    assert parse_args(["--run.preempt_signals=none"]).run.preempt_signals == ()
    assert parse_args(["--run.preempt_signals=SIGUSR1"]).run.preempt_signals == ("SIGUSR1",)
    reason, _ = rejected(["--run.preempt_signals=none,SIGTERM"], capsys)
    assert "run.preempt_signals" in reason and "none" in reason, reason


def test_several_config_files_are_merged(tmp_path, capsys) -> None:
    """Each file's keys apply (the second file used to replace the first); a key in two files
    is refused, naming both; the command line beats every file."""
    base, more = tmp_path / "base.toml", tmp_path / "more.toml"
    base.write_text("[train]\nepochs = 3\n[optim]\nlr = 0.05\n")
    more.write_text("[data]\nbatch_size = 16\n")
    cfg = parse_args(["--config", str(base), f"--config={more}", "--optim.lr=0.01"])
    assert (cfg.train.epochs, cfg.data.batch_size, cfg.optim.lr) == (3, 16, 0.01)
    more.write_text("[train]\nepochs = 4\n")
    reason, _ = rejected(["--config", str(base), "--config", str(more)], capsys)
    assert "train.epochs" in reason and str(base) in reason and str(more) in reason, reason
    assert "train.epochs" in rejected([f"--config={base}", f"--config={base}"], capsys)[0]


@pytest.mark.parametrize(
    "text",
    [
        '"optim.lr" = 0.1\n[optim]\nlr = 0.2\n',  # a quoted dotted key, then the table
        "optim.lr = 0.1\n[optim]\nlr = 0.2\n",  # tomllib refuses this one itself
    ],
    ids=["quoted_dotted_key_and_table", "bare_dotted_key_and_table"],
)
def test_one_field_set_twice_in_a_file_is_refused(text, tmp_path, capsys) -> None:
    toml = tmp_path / "twice.toml"
    toml.write_text(text)
    reason, _ = rejected(["--config", str(toml)], capsys)
    assert reason.startswith(f"config file '{toml}'"), reason
    assert re.search(r"optim\.lr|\('optim',\)", reason), reason


@pytest.mark.parametrize("argv", [["--config="], ["--config", ""]])
def test_an_empty_config_flag_names_the_flag_not_a_directory(argv, capsys) -> None:
    reason, _ = rejected(argv, capsys)
    assert reason.startswith("--config: '' (empty)"), reason
    assert "'.'" not in reason


def test_a_recipe_files_setting_overridden_from_the_command_line_is_said_not_refused(
    tmp_path, capsys
) -> None:
    """docs/debugging.md advises `--data.num_workers=0` on top of a recipe file that sets
    data.prefetch_factor (configs/imagefolder_resnet50.toml), and a recipe's data.batch_size
    may meet a --data.global_batch_size: the later source's choice wins and the file's value
    is named as having no effect. Both from one source are still refused (the review found
    the recipes refused with exit 2)."""
    toml = tmp_path / "recipe.toml"
    toml.write_text("[data]\nbatch_size = 64\nprefetch_factor = 4\n")
    argv = [f"--config={toml}", "--data.num_workers=0", "--data.global_batch_size=128"]
    cfg = parse_args(argv)
    assert cli.notices(cfg, argv, 2, "cuda") == [
        f"config file '{toml}': data.batch_size=64 has no effect: this run has "
        "data.global_batch_size=128",
        f"config file '{toml}': data.prefetch_factor=4 has no effect: this run has "
        "data.num_workers=0",
    ]
    toml.write_text("[data]\nbatch_size = 64\nglobal_batch_size = 128\n")
    reason, _ = rejected([f"--config={toml}"], capsys)
    assert "data.batch_size=64 is for runs without data.global_batch_size" in reason
