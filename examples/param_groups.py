"""Parameter groups of your own, without editing the pipeline: fine-tune a torchvision ResNet
from its weights with the new head at the full rate, the backbone at a tenth, the stem frozen:

    torchrun --nproc-per-node=2 train.py --model.name=resnet18 --model.weights=resnet18.pth \
        --optim.param_groups=examples.param_groups:fine_tuning \
        --optim.param_groups_kwargs='{"head": "fc", "frozen": ["conv1", "bn1"]}'

The factory is called with the bare model (before DDP or FSDP wrap it) and
optim.param_groups_kwargs; it returns a list of groups, each naming its parameters by name or
by module prefix. A frozen group gets no gradient, and its BatchNorm statistics stay as loaded.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def fine_tuning(
    model: nn.Module,
    head: str = "fc",
    backbone_lr_scale: float = 0.1,
    frozen: tuple[str, ...] | list[str] = (),
) -> list[dict[str, Any]]:
    """`head` (a module: "fc" in torchvision's ResNets, "head" in MiniResNet) at optim.lr,
    the modules in `frozen` ("conv1", "layer1.0") frozen, every other parameter (the
    backbone) at optim.lr x backbone_lr_scale."""

    def under(name: str, module: str) -> bool:
        return name.startswith(module + ".")

    names = [name for name, _ in model.named_parameters()]
    if not any(under(name, head) for name in names):
        raise ValueError(f"{head!r} is no module with parameters in {type(model).__name__}")
    backbone = [
        name
        for name in names
        if not under(name, head) and not any(under(name, module) for module in frozen)
    ]
    groups: list[dict[str, Any]] = [{"name": "head", "params": [head]}]
    if backbone:
        groups.append({"name": "backbone", "params": backbone, "lr_scale": backbone_lr_scale})
    if frozen:
        groups.append({"name": "frozen", "params": list(frozen), "frozen": True})
    return groups
