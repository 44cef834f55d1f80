"""The optimizer side of a recipe: which parameters the optimizer updates and how (`spec`:
the optimizer, its parameter groups and weight decay; `groups`: the user's groups of
optim.param_groups, frozen ones frozen), the learning-rate schedule (`schedules`), and the
weight average evaluated instead of the weights (`ema`).

Import the modules themselves (`from optim import schedules`): this package re-exports
nothing. `torch.optim` is unaffected: it is always reached as `torch.optim`.
"""
