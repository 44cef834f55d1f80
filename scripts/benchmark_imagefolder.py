"""Moved to `python -m benchmarks.imagefolder`; this shim goes in the next release."""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
runpy.run_module("benchmarks.imagefolder", run_name="__main__", alter_sys=True)
