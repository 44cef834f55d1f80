from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py

import data  # noqa: E402

FASHION_MNIST_AVAILABLE = data.DEBIAN_FASHION_MNIST.is_dir()

# Under CI the dataset is part of the set-up: a missing one must fail the run, not skip it.
needs_fashion_mnist = pytest.mark.skipif(
    not FASHION_MNIST_AVAILABLE and not os.environ.get("CI"),
    reason=f"Fashion-MNIST not installed at {data.DEBIAN_FASHION_MNIST} "
    "(apt-get install dataset-fashion-mnist; scripts/setup.sh does it)",
)
