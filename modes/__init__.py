"""Modes beside training (run.mode): evaluate a checkpoint or weights file on the evaluation
split, predict the classes of a folder of images, export the evaluated weights for inference.

Each runs at any world size under the same launchers as training (`train.main` hands each
to `dispatch.run` once the process group is up) and never takes or writes the run dir's
lease, metrics or checkpoints: a training job may hold the run dir meanwhile. docs/modes.md
shows each.
"""
