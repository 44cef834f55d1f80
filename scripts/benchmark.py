"""Moved to `python -m benchmarks` (benchmarks/run.py); this shim goes in the next release."""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
runpy.run_module("benchmarks.run", run_name="__main__", alter_sys=True)
