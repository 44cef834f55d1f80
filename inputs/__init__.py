"""What a run trains on, from the files to the device: the built-in sources (`sources`), a
data.factory's datasets and their checks (`user`), image folders (`imagefolder`), which
samples each rank sees (`sampling`), the training augmentation (`augment`), the loaders
that bring batches to the device (`loaders`), and a training sample that fails to load
(`failures`). `data.py` is the interface the training loop calls; import these modules
themselves (`from inputs import sampling`): this package re-exports nothing.
"""
