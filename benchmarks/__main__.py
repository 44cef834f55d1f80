"""`python -m benchmarks`: measure the pipeline and report the ratios (benchmarks/run.py)."""

import sys

from benchmarks import run

if __name__ == "__main__":
    sys.exit(run.main())
