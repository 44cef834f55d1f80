"""RunPaths names every path under run.dir, byte for byte as the run dir has always held them,
and no other module spells those names itself."""

from __future__ import annotations

import re
from pathlib import Path

from runpaths import BEST_FILE, LEASE_GLOB, RunPaths

REPO = Path(__file__).resolve().parents[1]


def test_each_path_is_the_one_the_run_dir_has_always_held(tmp_path: Path) -> None:
    # Written out by hand from the code before RunPaths: ckpt/storage.py, ckpt/rundir.py,
    # ckpt/retention.py, metrics.py, instruments.py, launch.py, scripts/ray_train.py.
    paths = RunPaths(str(tmp_path))
    assert paths.root == tmp_path
    assert paths.checkpoints == tmp_path / "checkpoints"
    assert paths.best == tmp_path / "checkpoints" / "best.json"
    assert paths.metrics == tmp_path / "metrics.jsonl"
    assert paths.tensorboard == tmp_path / "tensorboard"
    assert paths.profile == tmp_path / "tensorboard" / "profile"
    assert paths.config == tmp_path / "config.json"
    assert paths.progress == tmp_path / "progress.json"
    assert paths.origin == tmp_path / "origin.json"
    assert paths.lease(0) == tmp_path / "lease.0.json"
    assert paths.lease(12) == tmp_path / "lease.12.json"
    assert paths.legacy_lease == tmp_path / "lease.json"
    assert paths.shared_check("3f9a") == tmp_path / ".shared-check-3f9a"
    assert paths.ray_markers == tmp_path / "ray" / "markers"
    assert BEST_FILE == "best.json"


def test_the_lease_glob_finds_every_generation_and_not_the_legacy_lease(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    for generation in (1, 2, 10):
        paths.lease(generation).write_text("{}")
    paths.legacy_lease.write_text("{}")
    found = sorted(p.name for p in tmp_path.glob(LEASE_GLOB))
    assert found == ["lease.1.json", "lease.10.json", "lease.2.json"]


def test_paths_are_values() -> None:
    assert RunPaths("runs/a") == RunPaths(Path("runs/a"))
    assert RunPaths("runs/a") != RunPaths("runs/b")


# The names only runpaths.py may spell (as a quoted literal, or a lease or marker pattern).
NAME = re.compile(
    r"""["'](checkpoints|metrics\.jsonl|tensorboard|profile|config\.json|progress\.json|"""
    r"""origin\.json|lease\.json|best\.json|markers|ray/markers)["']|lease\.\*\.json|"""
    r"""lease\.\{|shared-check-"""
)


def test_no_other_module_composes_a_run_dir_name() -> None:
    offenders = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.split("/")[0] in ("tests", ".venv", "data") or rel == "runpaths.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if NAME.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == [], "take these paths from runpaths.RunPaths:\n" + "\n".join(offenders)


def test_the_name_check_can_fail() -> None:
    assert NAME.search('path = run_dir / "metrics.jsonl"')
    assert NAME.search("run_dir.glob('lease.*.json')")
    assert NAME.search('run_dir / f"lease.{generation}.json"')
    assert not NAME.search("path = RunPaths(run_dir).metrics  # metrics.jsonl")
