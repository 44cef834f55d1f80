"""Checkpointing, in one place: what a checkpoint holds (`parts`), when and how a run saves
and resumes (`manager`, with `writer` for saves in a background process), the run's checkpoint
directory (`storage`: loading and resuming; `retention`: names, best.json, pruning), the two
on-disk formats (`single`, `sharded`) over atomic, verified writes (`atomic`), and the run
directory a job owns while it runs (`rundir`).

Import the modules themselves (`from ckpt import single`, then `single.save`): this package
re-exports nothing, so a test that wraps `single.save` wraps the one every caller uses.
"""
