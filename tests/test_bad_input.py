"""Bad input, end to end: every case runs the real entry point as a subprocess.

What is proven for each bad command line, config file, data path, run dir or checkpoint:
the job exits with a positive status (not killed by a signal) within a bound that separates
"failed fast" from "hung until a collective timed out" (dist.timeout_s stays at its 300 s
default); its output names the offending field or file and the bad value; no process it
started (torchrun workers, which get sessions of their own, included) is left running; and no
file under the test's directory appeared, disappeared or changed (sha256 and mtime), in
particular in the pre-populated run dir it was pointed at.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO, train_command, unboxed

pytestmark = pytest.mark.e2e

# Failing fast vs hanging until a collective timed out (dist.timeout_s: 300 s). The bounds leave
# room for a loaded CI machine over what the slowest case takes (pytest --durations shows it).
PYTHON_BOUND_S = 20.0  # python train.py: imports, and data loading for the data cases
TORCHRUN_BOUND_S = 45.0  # the launcher and 2 ranks
RUN_BOUND_S = 120.0  # a tiny run that is meant to train, on a loaded machine
LEAK_GRACE_S = 2.0
TOKEN_VAR = "BAD_INPUT_TEST_TOKEN"  # inherited by every descendant, whatever its session

# A valid, tiny run: each case appends the one bad setting (a later --key wins). The command
# line beats a --config file, so a TOML case must set a key that is not in these lists.
COMMON_ARGS = (
    "--run.dir={run}",
    "--data.root={data}",
    "--data.batch_size=32",
    "--data.num_workers=0",
    "--train.epochs=1",
    "--log.tensorboard=false",
)
# Settings that another dataset or model would ignore, and so refuse: a case with another
# dataset or model leaves them out (Case.dataset, Case.model).
SYNTHETIC_DATA = (
    "--data.dataset=synthetic",
    "--data.synthetic_train_size=256",
    "--data.synthetic_eval_size=64",
)
SMALL_MODEL = ("--model.widths=4,8,8",)
BASE_ARGS = (*COMMON_ARGS, *SYNTHETIC_DATA, *SMALL_MODEL)
NOT_FOUND = "does not exist|not found|No such file"


def make_blocker(tmp: Path) -> None:
    """A regular file where the run dir's parent directory should be."""
    (tmp / "blocker").write_text("a file, not a directory\n")


def make_corrupt_fashion_mnist(tmp: Path) -> None:
    """All four files torchvision looks for, none of them a valid IDX file."""
    raw = tmp / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("train-images", "train-labels", "t10k-images", "t10k-labels"):
        kind = "idx3" if name.endswith("images") else "idx1"
        (raw / f"{name}-{kind}-ubyte").write_bytes(b"\x00\x00\x08\x7fgarbage" * 8)


def make_imagefolder(tmp: Path, val_classes: tuple[str, ...] = ("cats", "dogs")) -> Path:
    """data/img/{train,val}/<class>/*.png with four small valid images per class."""
    from PIL import Image

    root = tmp / "data" / "img"
    for split, classes in (("train", ("cats", "dogs")), ("val", val_classes)):
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (12, 12), (60 * i, 100, 30)).save(folder / f"{i}.png")
    return root


def make_imagefolder_unknown_val_class(tmp: Path) -> None:
    make_imagefolder(tmp, val_classes=("cats", "dogs", "owls"))


def make_imagefolder_with_truncated_image(tmp: Path) -> None:
    """A PNG cut short after its header: it opens, then fails to decode (no path in PIL's
    'image file is truncated')."""
    import io

    import numpy as np
    from PIL import Image

    root = make_imagefolder(tmp)
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, "PNG")
    whole = buffer.getvalue()
    (root / "train" / "dogs" / "broken.png").write_bytes(whole[: len(whole) * 6 // 10])


def make_python_version_differ_on_rank_1(tmp: Path) -> None:
    """A sitecustomize (on PYTHONPATH) that makes rank 1 report another Python version."""
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, platform\n"
        "if os.environ.get('RANK') == '1':\n"
        "    platform.python_version = lambda: '3.0.1'\n"
    )


def make_user_modules(tmp: Path) -> None:
    """A module of the user's (on PYTHONPATH) whose factories return the wrong things."""
    (tmp / "site").mkdir()
    (tmp / "site" / "user_wrong.py").write_text(
        "def model(**kwargs):\n    return 'a model'\n\ndef data(**kwargs):\n    return [1, 2, 3]\n"
    )


def make_resnet18_weights(tmp: Path) -> None:
    import torch
    import torchvision

    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), tmp / "resnet18.pt")


def make_float_data(tmp: Path) -> None:
    """A data factory (on PYTHONPATH) whose images are float: used as they are, never
    normalised (data.DataSplits)."""
    (tmp / "site").mkdir()
    (tmp / "site" / "user_float.py").write_text(
        "import torch\n\n"
        "def data(**kwargs):\n"
        "    split = [(torch.rand(1, 8, 8), i % 2) for i in range(64)]\n"
        "    return {'train': split, 'eval': split, 'num_classes': 2, 'input_shape': (1, 8, 8)}\n"
    )


@dataclass(frozen=True)
class Case:
    """One bad input. `{run}`, `{data}`, `{tmp}` and `{toml}` in args and patterns are paths."""

    id: str
    args: tuple[str, ...]
    field: str | None = None  # the config key the message must name, right next to `value`
    value: str | None = None
    patterns: tuple[str, ...] = ()  # further regexes the output must match
    torchrun: bool = False
    toml: str | None = None  # text of {toml}, written before the run
    prepare: Callable[[Path], None] | None = None
    exit_code: int | None = None  # the exact status required, where one is (2: bad input)
    env: tuple[tuple[str, str], ...] = ()  # extra environment variables
    dataset: tuple[str, ...] = SYNTHETIC_DATA  # () for a case that sets its own
    model: tuple[str, ...] = SMALL_MODEL  # () for a case with a torchvision or factory model


def world_size_named(n: int) -> str:
    """Regex: the message states the world size `n` ("world size 2", "world_size=2", "2 ranks")."""
    return rf"world[ _]size\D{{0,4}}{n}(?!\d)|\b{n} ranks?\b"


CASES = [
    Case(
        "unknown_key",
        ("--train.epoch=3",),
        patterns=(r"train\.epoch\b", r"did you mean --train\.epochs\?"),
        exit_code=2,
    ),
    Case(  # tyro's own suggestion depended on the value's length: none for this one
        "unknown_key_with_a_long_value",
        ("--data.datset=synthetic",),
        patterns=(r"--data\.datset=synthetic; did you mean --data\.dataset\?",),
        exit_code=2,
    ),
    Case(
        "unknown_section",
        ("--optimizer.lr=0.1",),
        patterns=(r"optimizer\.lr", r"did you mean|--help"),
    ),
    Case("missing_value", ("--train.epochs",), patterns=(r"--train\.epochs\b", "(?i)missing val")),
    Case("int_given_text", ("--train.epochs=abc",), "train.epochs", "abc"),
    Case("bool_given_maybe", ("--data.augment=maybe",), "data.augment", "maybe"),
    Case("negative_batch_size", ("--data.batch_size=-8",), "data.batch_size", "-8"),
    Case("zero_batch_size", ("--data.batch_size=0",), "data.batch_size", "0"),
    Case("zero_epochs", ("--train.epochs=0",), "train.epochs", "0"),
    Case("lr_nan", ("--optim.lr=nan",), "optim.lr", "nan"),
    Case("lr_negative", ("--optim.lr=-0.1",), "optim.lr", "-0.1"),
    Case("lr_inf", ("--optim.lr=inf",), "optim.lr", "inf"),
    Case("dataset_choice", ("--data.dataset=imagenet",), "data.dataset", "imagenet"),
    Case("amp_choice", ("--train.amp=fp8",), "train.amp", "fp8"),
    Case("mixup_negative", ("--aug.mixup_alpha=-0.2",), "aug.mixup_alpha", "-0.2", exit_code=2),
    Case(  # a policy runs per sample in the DataLoader's workers, not on the device loader
        "policy_on_the_device_loader",
        ("--aug.auto_augment=ra", "--data.loader=device"),
        "aug.auto_augment",
        "ra",
        exit_code=2,
    ),
    Case("widths_empty", ("--model.widths=",), patterns=(r"model\.widths\W{1,4}(\(\)|''|empty)",)),
    Case("widths_non_numeric", ("--model.widths=16,x",), "model.widths", "16,x"),
    Case(  # trained widths 4,8 before
        "widths_with_an_empty_element",
        ("--model.widths=4,,8",),
        "model.widths",
        "4,,8",
        exit_code=2,
    ),
    Case(  # an unset variable turned the preemption checkpoint off
        "preempt_signals_empty",
        ("--run.preempt_signals=",),
        patterns=(r"run\.preempt_signals: '' \(empty\)", r"\bnone\b"),
        exit_code=2,
    ),
    Case(  # trained on cifar10; the sizes did nothing
        "synthetic_sizes_on_another_dataset",
        ("--data.dataset=cifar10", "--data.download=false"),
        "data.synthetic_train_size",
        "256",
        patterns=(r"data\.dataset=cifar10",),
        exit_code=2,
    ),
    Case(  # normalised nothing: float images are used as they are
        "data_mean_for_float_images",
        ("--data.factory=user_float:data", "--data.mean=0.5"),
        "data.mean",
        "0.5",
        patterns=(r"data\.factory=user_float:data",),
        prepare=make_float_data,
        env=(("PYTHONPATH", "{tmp}/site"),),
        exit_code=2,
        dataset=(),
    ),
    Case("dropout_one", ("--model.dropout=1",), "model.dropout", "1.0"),
    Case("grad_accum_zero", ("--train.grad_accum_steps=0",), "train.grad_accum_steps", "0"),
    Case("timeout_zero", ("--dist.timeout_s=0",), "dist.timeout_s", "0"),
    Case(
        "subset_exceeds_dataset",
        ("--data.subset=1000",),
        "data.subset",
        "1000",
        patterns=(r"\b256\b",),  # the dataset's size
        exit_code=2,
    ),
    Case(
        "batch_exceeds_shard",
        ("--data.batch_size=300",),
        "data.batch_size",
        "300",
        patterns=(r"\b256\b",),  # the shard's size
        exit_code=2,
    ),
    Case(
        # (a val/ lacking a class trains it and names it: tests/test_data.py)
        "imagefolder_val_has_a_class_training_lacks",
        ("--data.dataset=imagefolder", "--data.root={data}/img"),
        patterns=("{data}/img/val", "owls", "the training split lacks"),
        prepare=make_imagefolder_unknown_val_class,
        exit_code=2,
        dataset=(),
    ),
    Case(
        "unknown_model_name",
        ("--model.name=resnet19",),
        "model.name",
        "'resnet19'",
        patterns=("resnet18", "--model.list"),
        exit_code=2,
        model=(),
    ),
    Case(
        "input_too_small_for_the_model",
        ("--model.name=convnext_tiny",),
        patterns=(r"model\.name=convnext_tiny cannot take 1x28x28 inputs", "data.image_size"),
        exit_code=2,
        model=(),
    ),
    Case(
        "model_factory_not_importable",
        ("--model.factory=no_such_module:build",),
        patterns=(r"model\.factory=no_such_module:build", "ModuleNotFoundError"),
        exit_code=2,
        model=(),
    ),
    Case(
        "model_factory_returns_no_module",
        ("--model.factory=user_wrong:model",),
        patterns=(r"model\.factory=user_wrong:model returned str, not a torch\.nn\.Module",),
        prepare=make_user_modules,
        env=(("PYTHONPATH", "{tmp}/site"),),
        exit_code=2,
        model=(),
    ),
    Case(
        "data_factory_returns_a_list",
        ("--data.factory=user_wrong:data",),
        patterns=(r"data\.factory=user_wrong:data returned list",),
        prepare=make_user_modules,
        env=(("PYTHONPATH", "{tmp}/site"),),
        exit_code=2,
        dataset=(),
    ),
    Case(
        "weights_do_not_fit",
        ("--model.weights={tmp}/resnet18.pt", "--run.dir={tmp}/fresh_run"),
        patterns=("{tmp}/resnet18.pt", "does not fit", r"missing: stem\.0\.weight", "conv1"),
        prepare=make_resnet18_weights,
        exit_code=2,
    ),
    Case(
        "global_batch_not_divisible_by_accum",
        ("--data.global_batch_size=100", "--train.grad_accum_steps=3"),
        "data.global_batch_size",
        "100",
        patterns=(world_size_named(1),),
    ),
    Case(
        "toml_missing", ("--config={tmp}/absent.toml",), patterns=("{tmp}/absent.toml", NOT_FOUND)
    ),
    Case(
        "toml_corrupt",
        ("--config={toml}",),
        patterns=("{toml}", r"line \d+"),
        toml="[train\nepochs = 2\n",
    ),
    Case(
        "toml_unknown_key",
        ("--config={toml}",),
        patterns=(r"train\.epohcs", r"did you mean train\.epochs\?", "{toml}"),
        toml="[train]\nepohcs = 2\n",
        exit_code=2,
    ),
    Case(  # the table's value won, the quoted dotted key was dropped
        "toml_key_set_twice",
        ("--config={toml}",),
        patterns=("{toml}", r"data\.eval_batch_size is set twice"),
        toml='"data.eval_batch_size" = 64\n[data]\neval_batch_size = 32\n',
        exit_code=2,
    ),
    Case(
        "toml_wrong_type",
        ("--config={toml}",),
        "data.eval_batch_size",
        "big",
        toml='[data]\neval_batch_size = "big"\n',  # a key BASE_ARGS does not override
    ),
    Case("toml_lr_nan", ("--config={toml}",), "optim.lr", "nan", toml="[optim]\nlr = nan\n"),
    Case(
        "imagefolder_root_missing",
        ("--data.dataset=imagefolder", "--data.root={tmp}/no_such_dir"),
        patterns=("{tmp}/no_such_dir/train", NOT_FOUND),
        dataset=(),
    ),
    Case(
        "corrupt_dataset_files",
        ("--data.dataset=fashion_mnist", "--data.download=false"),
        patterns=("{data}/FashionMNIST/raw",),
        prepare=make_corrupt_fashion_mnist,
        dataset=(),
    ),
    Case(
        "corrupt_checkpoint",
        ("--ckpt.resume={run}/checkpoints/step_5.pt",),
        patterns=("{run}/checkpoints/step_5.pt",),
    ),
    # Under torchrun: the failure of one rank (or a world-size dependent check) must end both.
    Case(
        "global_batch_not_divisible",
        ("--data.global_batch_size=102", "--train.grad_accum_steps=2"),
        "data.global_batch_size",
        "102",
        patterns=(world_size_named(2),),
        torchrun=True,
    ),
    Case(
        "missing_dataset",
        ("--data.dataset=cifar10", "--data.download=false"),
        patterns=("{data}/cifar-10-batches-py",),
        torchrun=True,
        dataset=(),
    ),
    Case(
        "unwritable_run_dir",
        ("--run.dir={tmp}/blocker/run",),
        "run.dir",
        "{tmp}/blocker/run",
        torchrun=True,
        prepare=make_blocker,
    ),
    Case(
        "preflight_mismatch",
        (),
        patterns=(r"python differs", r"3\.0\.1", r"exitcode\s*:\s*2\b"),
        torchrun=True,
        prepare=make_python_version_differ_on_rank_1,
        env=(("PYTHONPATH", "{tmp}/site"),),
    ),
    Case(
        "resume_checkpoint_missing",
        ("--ckpt.resume=/nonexistent/step_3.pt",),
        patterns=("/nonexistent/step_3.pt", NOT_FOUND),
        torchrun=True,
    ),
]


# ---------------------------------------------------------------------------------------------
# Helpers: fixtures on disk, snapshots, launching, process accounting.


def populate_run_dir(run_dir: Path) -> None:
    """What an earlier run leaves behind; a failing run must leave all of it as it was."""
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text('{"train": {"epochs": 1}}\n')
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 5, "loss": 2.3}\n')
    (run_dir / "checkpoints" / "step_5.pt").write_bytes(b"not a checkpoint\x00\xff" * 64)
    (run_dir / "checkpoints" / "best.json").write_text('{"step": 5, "accuracy": 0.1}\n')
    (run_dir / "notes.txt").write_text("hand-written notes\n")


Snapshot = dict[str, tuple[str, int] | None]


def snapshot(root: Path) -> Snapshot:
    """Relative path -> (sha256, mtime_ns) for files, None for directories."""
    out: Snapshot = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_dir() and not path.is_symlink():
            out[rel] = None
        else:
            out[rel] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return out


def fill(text: str, dirs: dict[str, Path], escape: bool) -> str:
    for key, path in dirs.items():
        text = text.replace("{" + key + "}", re.escape(str(path)) if escape else str(path))
    return text


def command(torchrun: bool, args: list[str]) -> list[str]:
    return train_command(2 if torchrun else None, *args)


def processes_of(token: str, sid: int) -> list[str]:
    """Live processes in session `sid` or carrying `token` in their environment."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            environ = (stat.parent / "environ").read_bytes()
        except OSError:  # exited while we looked
            continue
        state, _ppid, pgrp, session = text.rsplit(")", 1)[1].split()[:4]
        # A zombie has exited; reaping it is its parent's (or init's) business, not the job's.
        mine = int(session) == sid or int(pgrp) == sid or f"{TOKEN_VAR}={token}".encode() in environ
        if state != "Z" and mine:
            found.append(text[: text.rindex(")") + 1])
    return found


def leftovers_after_grace(token: str, sid: int) -> list[str]:
    deadline = time.monotonic() + LEAK_GRACE_S
    while (left := processes_of(token, sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_all(token: str, sid: int) -> None:
    for entry in processes_of(token, sid):
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(int(entry.split()[0]), signal.SIGKILL)


@dataclass
class Outcome:
    returncode: int | None  # None: still running at the hard timeout, then killed
    output: str  # stdout and stderr, interleaved
    wall_s: float
    leftovers: list[str]


def launch(cmd: list[str], bound_s: float, extra_env: dict[str, str] | None = None) -> Outcome:
    """Run `cmd` in a session of its own; kill everything it started if it outlives the bound.

    Output goes to a file, not a pipe, so a leaked grandchild holding the pipe open cannot make
    the wait block.
    """
    token = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", TOKEN_VAR: token}
    env.update(extra_env or {})
    with tempfile.TemporaryFile() as out:
        started = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode: int | None = proc.wait(timeout=bound_s + 15)
        except subprocess.TimeoutExpired:
            returncode = None
            kill_all(token, proc.pid)
            proc.wait()
        wall_s = time.monotonic() - started
        leftovers = leftovers_after_grace(token, proc.pid)
        kill_all(token, proc.pid)  # never leak into later tests, even when asserting fails
        out.seek(0)
        output = out.read().decode(errors="replace")
    return Outcome(returncode, output, wall_s, leftovers)


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    """Paths that appeared, vanished or changed between two snapshots."""
    out = []
    for rel in sorted(before.keys() | after.keys()):
        if rel not in before:
            out.append(f"{rel} appeared")
        elif rel not in after:
            out.append(f"{rel} vanished")
        elif before[rel] != after[rel]:
            out.append(f"{rel} changed")
    return out


def assert_failed_cleanly(
    outcome: Outcome,
    bound_s: float,
    patterns: list[str],
    changed: list[str],
    exit_code: int | None = None,
) -> None:
    """Every requirement at once, so that one report lists all that a case gets wrong."""
    problems = []
    if outcome.returncode is None:
        problems.append(f"still running after {outcome.wall_s:.0f} s, killed")
    elif outcome.returncode <= 0:
        problems.append(f"exit status {outcome.returncode}")
    elif exit_code is not None and outcome.returncode != exit_code:
        problems.append(f"exit status {outcome.returncode}, not {exit_code}")
    if re.search(r"^Traceback \(most recent call last\)", outcome.output, re.M) and exit_code:
        problems.append("a traceback instead of a message")
    if outcome.wall_s > bound_s:
        problems.append(f"took {outcome.wall_s:.1f} s > {bound_s} s")
    readable = f"{outcome.output}\n{unboxed(outcome.output)}"
    missing = [p for p in patterns if not re.search(p, readable)]
    if missing:
        problems.append(f"output lacks {missing}")
    if outcome.leftovers:
        problems.append(f"processes left behind: {outcome.leftovers}")
    if changed:
        problems.append(f"files changed: {changed}")
    assert not problems, "; ".join(problems) + "\n" + outcome.output[-6000:]


def named(field: str, value: str) -> str:
    """Regex: `field` followed closely by `value`: `f: v`, `f=v`, `f: 'v'`, `f (v)`."""
    return rf"{re.escape(field)}[\s:=(]{{1,3}}['\"]?{re.escape(value)}(?!\w)"


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input_fails_fast_with_a_clear_message_and_changes_nothing(
    case: Case, tmp_path: Path
) -> None:
    dirs = {"run": tmp_path / "run", "data": tmp_path / "data", "toml": tmp_path / "job.toml"}
    dirs["tmp"] = tmp_path
    populate_run_dir(dirs["run"])
    dirs["data"].mkdir(exist_ok=True)
    (dirs["data"] / "README").write_text("datasets live here\n")
    if case.toml is not None:
        dirs["toml"].write_text(case.toml)
    if case.prepare is not None:
        case.prepare(tmp_path)
    base = (*COMMON_ARGS, *case.dataset, *case.model)
    if any(arg.startswith("--data.global_batch_size=") for arg in case.args):
        base = tuple(a for a in base if not a.startswith("--data.batch_size="))  # one or other
    args = [fill(a, dirs, escape=False) for a in (*base, *case.args)]
    patterns = [fill(p, dirs, escape=True) for p in case.patterns]
    if case.field is not None:
        assert case.value is not None
        patterns.append(named(case.field, fill(case.value, dirs, escape=False)))
    before = snapshot(tmp_path)

    bound_s = TORCHRUN_BOUND_S if case.torchrun else PYTHON_BOUND_S
    env = {key: fill(value, dirs, escape=False) for key, value in case.env}
    outcome = launch(command(case.torchrun, args), bound_s, env)

    changed = changes(before, snapshot(tmp_path))
    assert_failed_cleanly(outcome, bound_s, patterns, changed, case.exit_code)


def test_truncated_image_fails_naming_its_file(tmp_path: Path) -> None:
    """Found when loaded (checking every image up front would decode the whole dataset): the
    run stops with exit 2 and the image's path; the dataset is left as it was."""
    make_imagefolder_with_truncated_image(tmp_path)
    data = tmp_path / "data"
    before = snapshot(data)
    dirs = {"run": tmp_path / "run", "data": data}
    args = [fill(a, dirs, escape=False) for a in (*COMMON_ARGS, *SMALL_MODEL)]
    args += [f"--data.root={data / 'img'}", "--data.dataset=imagefolder"]
    args += ["--data.batch_size=2", "--data.image_size=8"]

    outcome = launch(command(False, args), PYTHON_BOUND_S)

    patterns = [re.escape(str(data / "img" / "train" / "dogs" / "broken.png"))]
    assert_failed_cleanly(outcome, PYTHON_BOUND_S, patterns, changes(before, snapshot(data)), 2)


def test_weights_beside_a_checkpoint_are_not_loaded_and_a_warning_names_both(
    tmp_path: Path,
) -> None:
    """model.weights on a run that resumes: the checkpoint holds the weights, so the file is
    not loaded (the run ends torch.equal to the same resume without it) and a warning names
    the file and the checkpoint. A path that names no file is refused even there: exit 2,
    nothing changed (it used to be ignored in silence)."""
    import torch

    run_dir = tmp_path / "run"
    args = [fill(a, {"run": run_dir, "data": tmp_path / "data"}, False) for a in BASE_ARGS]
    first = launch(command(False, [*args, "--train.max_steps=2"]), RUN_BOUND_S)
    assert first.returncode == 0, first.output[-3000:]
    checkpoint = run_dir / "checkpoints" / "step_2.pt"
    state = torch.load(checkpoint, weights_only=True)["model"]
    weights = tmp_path / "zeros.pt"  # weights no run would reach: loading them would show
    torch.save({name: torch.zeros_like(tensor) for name, tensor in state.items()}, weights)
    shutil.copytree(run_dir, tmp_path / "reference")
    before = snapshot(run_dir)

    absent = tmp_path / "absent.pt"
    refused = launch(command(False, [*args, f"--model.weights={absent}"]), PYTHON_BOUND_S)
    patterns = [named("model.weights", str(absent))]
    assert_failed_cleanly(refused, PYTHON_BOUND_S, patterns, changes(before, snapshot(run_dir)), 2)

    more = ["--train.max_steps=4"]
    resumed = launch(command(False, [*args, *more, f"--model.weights={weights}"]), RUN_BOUND_S)
    assert resumed.returncode == 0, resumed.output[-3000:]
    warning = rf"WARNING .*model\.weights={re.escape(str(weights))} .*{re.escape(str(checkpoint))}"
    assert re.search(warning, resumed.output), resumed.output[-3000:]
    reference = [a.replace(str(run_dir), str(tmp_path / "reference")) for a in args]
    alone = launch(command(False, [*reference, *more]), RUN_BOUND_S)
    assert alone.returncode == 0, alone.output[-3000:]
    ends = [
        torch.load(d / "checkpoints" / "step_4.pt", weights_only=True)["model"]
        for d in (run_dir, tmp_path / "reference")
    ]
    assert ends[0].keys() == ends[1].keys()
    assert all(torch.equal(ends[0][name], ends[1][name]) for name in ends[0])


@pytest.fixture
def full_tmpfs(tmp_path: Path):
    """A 256 KiB tmpfs (needs root), unmounted afterwards."""
    mount_point = tmp_path / "full"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill_up(directory: Path) -> None:
    """Write until the filesystem refuses with ENOSPC (unbuffered: nothing left to flush)."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as err:
        assert err.errno == errno.ENOSPC, err
    finally:
        os.close(fd)


def test_full_run_dir_fails_naming_it_and_keeps_existing_files(full_tmpfs: Path) -> None:
    run_dir = full_tmpfs / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"train": {"epochs": 1}}\n')
    fill_up(full_tmpfs)
    before = snapshot(full_tmpfs)
    dirs = {"run": run_dir, "data": full_tmpfs.parent / "data"}  # synthetic: never read
    args = [fill(a, dirs, escape=False) for a in BASE_ARGS]

    outcome = launch(command(False, args), PYTHON_BOUND_S)

    patterns = [re.escape(str(run_dir)), r"No space left|ENOSPC|Errno 28"]
    assert_failed_cleanly(outcome, PYTHON_BOUND_S, patterns, changes(before, snapshot(full_tmpfs)))


def test_disk_filling_during_a_checkpoint_save_names_it_and_keeps_older_ones(
    full_tmpfs: Path,
) -> None:
    """The disk has room to start (config, metrics) but fills while torch.save writes the next
    checkpoint: exit 2 naming that checkpoint and the full disk; the earlier checkpoint, its
    manifest and best.json stay exactly as they were, and no partial file is left."""
    run_dir = full_tmpfs / "run"
    dirs = {"run": run_dir, "data": full_tmpfs.parent / "data"}  # synthetic: never read
    args = [fill(a, dirs, escape=False) for a in BASE_ARGS]
    first = launch(command(False, [*args, "--train.max_steps=2"]), PYTHON_BOUND_S)
    assert first.returncode == 0, first.output[-3000:]
    checkpoints = run_dir / "checkpoints"
    size = (checkpoints / "step_2.pt").stat().st_size
    assert size > 48 * 1024  # the next one (the same size) cannot fit in what is left free
    fill_up(full_tmpfs)
    filler = full_tmpfs / "filler"
    # Room for config.json and the metrics rows, not for the checkpoint's first record (its
    # 16 KB pickle, larger than the file's buffer: written straight through inside torch.save,
    # which reports ENOSPC as "enforce fail at inline_container.cc").
    os.truncate(filler, filler.stat().st_size - 8 * 1024)
    before = snapshot(checkpoints)

    outcome = launch(command(False, args), PYTHON_BOUND_S)  # resumes at 2, saves at 8

    patterns = [re.escape(str(checkpoints / "step_8.pt")), r"(?i)no space left"]
    changed = changes(before, snapshot(checkpoints))
    assert_failed_cleanly(outcome, PYTHON_BOUND_S, patterns, changed, exit_code=2)


def test_harness_sees_a_process_that_escaped_into_its_own_session() -> None:
    """The leak check can fail: a detached grandchild is found (then killed) by its token."""
    outcome = launch(["bash", "-c", "setsid sleep 30 & exit 3"], bound_s=5)
    assert outcome.returncode == 3
    assert any("(sleep)" in entry for entry in outcome.leftovers), outcome.leftovers
