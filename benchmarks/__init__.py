"""The pipeline's benchmarks: each figure measured against a reference in the same run.

    python -m benchmarks [--quick] ...              the figures (benchmarks/run.py)
    python -m benchmarks.imagefolder [--quick] ...  image-folder loading vs torchvision's recipe

Run them from the repository root: the library's flat modules are imported from there.
"""
