"""scripts/config_docs.py: docs/configuration.md is the page config.py renders, and the check
that keeps it so can fail."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass, field
from types import ModuleType

import pytest
from helpers import REPO, unboxed

import cli
import config


def load_config_docs() -> ModuleType:
    """scripts/ is no package: import the script by path."""
    path = REPO / "scripts" / "config_docs.py"
    spec = importlib.util.spec_from_file_location("config_docs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


config_docs = load_config_docs()


def check(*args: str) -> subprocess.CompletedProcess[str]:
    """`python scripts/config_docs.py --check`, as a developer or CI runs it."""
    command = [sys.executable, "scripts/config_docs.py", "--check", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)


def rows(page: str) -> list[str]:
    return [line for line in page.splitlines() if line.startswith("| `")]


def test_the_committed_page_is_the_one_config_py_renders() -> None:
    assert (REPO / "docs" / "configuration.md").read_text() == config_docs.render()
    done = check()
    assert done.returncode == 0, done.stderr


def test_every_key_has_one_row_with_its_type_default_and_doc() -> None:
    page_rows = rows(config_docs.render())
    assert [row.split("`")[1] for row in page_rows] == list(cli.field_types())
    for row in page_rows:
        cells = row.strip("| ").split(" | ")
        assert len(cells) == 4 and all(cells), row
    # Two rows written out by hand from config.py.
    assert (
        "| `optim.grad_clip` | float | `5.0` | max global L2 norm of gradients (after "
        "unscaling); 0 = no clipping |"
    ) in page_rows
    assert (
        "| `log.profile_steps` | list of int | (empty) | START,END: record optimizer steps "
        "START..END-1 with torch.profiler into run.dir/tensorboard/profile (TensorBoard's "
        "profiler tab); empty = off |"
    ) in page_rows


def test_each_doc_on_the_page_is_the_one_help_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """The page and `train.py --help` read the same docstrings the same way."""
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    help_text = unboxed(capsys.readouterr().out)
    for row in rows(config_docs.render()):
        key, doc = row.split("`")[1], row.strip("| ").split(" | ")[3]
        assert doc.replace("\\", "") in help_text, key


def test_the_check_fails_on_a_page_with_one_line_changed(tmp_path) -> None:
    fresh = "| `data.batch_size` | int | `128` |"
    stale = "| `data.batch_size` | int | `64` |"
    page = config_docs.render()
    assert page.count(fresh) == 1
    path = tmp_path / "configuration.md"
    path.write_text(page.replace(fresh, stale))
    done = check(f"--page={path}")
    assert done.returncode == 1
    assert f"\n-{stale}" in done.stderr and f"\n+{fresh}" in done.stderr
    assert "run python scripts/config_docs.py" in done.stderr
    assert check(f"--page={tmp_path / 'missing.md'}").returncode == 1


@dataclass(frozen=True)
class LongerTrainConfig(config.TrainConfig):
    __doc__ = config.TrainConfig.__doc__

    epochs: int = 20
    """passes over the training set, twice as many"""


@dataclass(frozen=True)
class LongerConfig(config.Config):
    train: LongerTrainConfig = field(default_factory=LongerTrainConfig)


def test_a_changed_default_and_doc_change_the_page_in_their_row_only() -> None:
    """Rendered from a variant of the schema: the page follows the dataclasses, and a field
    that keeps its base class's doc keeps its row."""
    before = config_docs.render().splitlines()
    after = config_docs.render(LongerConfig).splitlines()
    assert len(after) == len(before)
    changed = [(old, new) for old, new in zip(before, after, strict=True) if old != new]
    assert changed == [
        (
            "| `train.epochs` | int | `10` | passes over the training set |",
            "| `train.epochs` | int | `20` | passes over the training set, twice as many |",
        )
    ]
