from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py

import data  # noqa: E402

# The tiers (markers in pyproject.toml). Unmarked tests form the fast tier: no process group and
# no training run (a few start a quick helper process: bash on a script, DataLoader workers, a
# config error from train.py). spawn, e2e, multinode, slurm and container tests are `slow` as
# well, so that `-m "not slow"` is exactly the fast tier.
SLOW_TIERS = ("spawn", "e2e", "multinode", "slurm", "container")


# Image build times (tests/multinode/test_container.py), printed in the summary for CI's log.
BUILD_TIMES = pytest.StashKey[list[str]]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    times = config.stash.get(BUILD_TIMES, [])
    if times:
        terminalreporter.write_line("container image build times: " + ", ".join(times))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """DDP_TEST_TIMES=<file>: each test's wall time (set-up, call, teardown) appended as it ends,
    so that a run stopped half-way still says where its time went."""
    path = os.environ.get("DDP_TEST_TIMES")
    started = time.monotonic()
    try:
        return (yield)
    finally:
        if path:
            with open(path, "a") as out:
                out.write(f"{time.monotonic() - started:8.1f} {item.nodeid}\n")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the extended tier (marker `extended`): more launchers, signal patterns "
        "and stops of what CI already runs once; without it those tests are deselected",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(tier) for tier in SLOW_TIERS):
            item.add_marker(pytest.mark.slow)
    if not config.getoption("--extended"):
        extended = [item for item in items if item.get_closest_marker("extended")]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if not item.get_closest_marker("extended")]


FASHION_MNIST_AVAILABLE = data.DEBIAN_FASHION_MNIST.is_dir()

# Under CI the dataset is part of the set-up: a missing one must fail the run, not skip it.
needs_fashion_mnist = pytest.mark.skipif(
    not FASHION_MNIST_AVAILABLE and not os.environ.get("CI"),
    reason=f"Fashion-MNIST not installed at {data.DEBIAN_FASHION_MNIST} "
    "(apt-get install dataset-fashion-mnist; scripts/setup.sh does it)",
)
