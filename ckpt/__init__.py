"""Checkpointing, in one place: what a checkpoint holds (`parts`), when and how a run saves
and resumes (`manager`), the on-disk format with its guarantees (`storage`), and the run
directory a job owns while it runs (`rundir`).

Import the modules themselves (`from ckpt import single`, then `single.save`): this package
re-exports nothing, so a test that wraps `single.save` wraps the one every caller uses.
"""
