"""`python -m benchmarks`: measure the pipeline and report the ratios (benchmarks/run.py)."""

import runpy

# benchmarks.run runs as the main module, not this file: multiprocessing's spawn skips a
# package's __main__ but imports any other main module again in each rank it starts, so the
# ranks of scaling.py and strategies.py hold every module this process holds before they
# measure, as when the benchmark was one script (a rank's peak RSS is read against its RSS
# before its model is built).
if __name__ == "__main__":
    runpy.run_module("benchmarks.run", run_name="__main__", alter_sys=True)
