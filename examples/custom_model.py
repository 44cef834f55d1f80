"""Your own model, trained by the pipeline without editing it:

    torchrun --nproc-per-node=2 train.py --model.factory=examples.custom_model:small_cnn \
        --model.kwargs='{"width": 48, "dropout": 0.25}'

The factory is called with the data's `in_channels` and `num_classes`, plus model.kwargs. It
returns any torch.nn.Module mapping a float batch (N, C, H, W) to logits (N, num_classes); the
pipeline wraps it in DistributedDataParallel, autocast, torch.compile and channels_last as
configured. Dropout and every other random draw are fine: checkpoints carry the generators.
At start-up one batch goes through it in training mode too: it must return the logits alone
there as well (no tuple of auxiliary outputs), and every parameter that requires a gradient
must get one (DDP fails on one that does not; freeze it with requires_grad_(False)).
"""

from __future__ import annotations

import torch
from torch import nn


def conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


def small_cnn(
    *, in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.2
) -> nn.Module:
    """Three conv-BN-ReLU stages, each halving the resolution, then dropout and a linear head."""
    return nn.Sequential(
        conv_block(in_channels, width),
        nn.MaxPool2d(2),
        conv_block(width, 2 * width),
        nn.MaxPool2d(2),
        conv_block(2 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(4 * width, num_classes),
    )


class ResidualMLP(nn.Module):
    """x + W2 gelu(W1 norm(x)): the repeated block that `--dist.fsdp_units=auto` shards as
    one unit (the non-torch.nn class repeated most, by parameters)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def wide_mlp(
    *, in_channels: int, num_classes: int, width: int = 1024, hidden: int = 4096, depth: int = 6
) -> nn.Module:
    """A model whose memory is its training state, not its activations: `depth` residual MLP
    blocks on an 8x8 pooling of the image. The default holds 50.4 M parameters (202 MB in
    fp32; with AdamW about 0.8 GB of training state per rank under ddp, half of it per rank
    under fsdp at 2 ranks). docs/strategies.md trains it."""
    return nn.Sequential(
        nn.AdaptiveAvgPool2d(8),
        nn.Flatten(),
        nn.Linear(in_channels * 64, width),
        *(ResidualMLP(width, hidden) for _ in range(depth)),
        nn.LayerNorm(width),
        nn.Linear(width, num_classes),
    )
