"""MiniResNet: a small residual network for 28x28 and 32x32 images. It knows nothing of DDP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

Norm = Literal["batch", "syncbatch", "group", "none"]


def make_norm(kind: Norm, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "syncbatch":
        # Converted to SyncBatchNorm by nn.SyncBatchNorm.convert_sync_batchnorm when wrapped in
        # DDP; plain BatchNorm in a single process (SyncBatchNorm needs a process group).
        return nn.BatchNorm2d(channels)
    if kind == "group":
        # Per-sample statistics: results do not depend on how a batch is split across ranks
        # or micro-steps, which is what the DDP equivalence tests rely on.
        return nn.GroupNorm(num_groups=min(8, channels), num_channels=channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}: choose batch, syncbatch, group or none")


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al., 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: Norm) -> None:
        super().__init__()
        bias = norm == "none"
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=bias)
        self.norm1 = make_norm(norm, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=bias)
        self.norm2 = make_norm(norm, out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=bias),
                make_norm(norm, out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class MiniResNet(nn.Module):
    """Stem, stages of BasicBlocks with increasing widths, global average pooling, linear head.

    Each stage after the first halves the spatial resolution, so any input of at least
    2 ** (len(widths) - 1) pixels a side works (1x28x28 Fashion-MNIST, 3x32x32 CIFAR-10, ...).
    """

    def __init__(
        self,
        *,
        in_channels: int,
        num_classes: int,
        widths: Sequence[int] = (16, 32, 64),
        blocks_per_stage: int = 1,
        norm: Norm = "batch",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not widths or min(widths) < 1:
            raise ValueError(f"widths must be positive channel counts, got {tuple(widths)}")
        bias = norm == "none"
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=bias),
            make_norm(norm, widths[0]),
            nn.ReLU(inplace=True),
        )
        blocks: list[nn.Module] = []
        channels = widths[0]
        for stage, width in enumerate(widths):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(channels, width, stride, norm))
                channels = width
        self.stages = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        # Before the classifier; an Identity when off, so no random number is drawn then.
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.head = nn.Linear(channels, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        # Zero the last norm of each residual branch so every block starts as the identity:
        # trains faster and more stably (Goyal et al., 2017).
        for m in self.modules():
            if isinstance(m, BasicBlock) and isinstance(m.norm2, nn.BatchNorm2d | nn.GroupNorm):
                nn.init.zeros_(m.norm2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(self.dropout(torch.flatten(self.pool(x), 1)))
