from __future__ import annotations

import pytest
import torch

from model import MiniResNet


@pytest.mark.parametrize("norm", ["batch", "syncbatch", "group", "none"])
@pytest.mark.parametrize(("shape", "num_classes"), [((1, 28, 28), 10), ((3, 32, 32), 7)])
def test_forward_shapes_and_backward(norm, shape, num_classes) -> None:
    model = MiniResNet(
        in_channels=shape[0],
        num_classes=num_classes,
        widths=(8, 16, 32),
        blocks_per_stage=2,
        norm=norm,
    )
    logits = model(torch.randn(4, *shape))
    assert logits.shape == (4, num_classes)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_keyword_only_with_defaults() -> None:
    with pytest.raises(TypeError):
        MiniResNet(1, 10)  # type: ignore[misc]
    model = MiniResNet(in_channels=1, num_classes=10)
    assert model.head.out_features == 10


def test_stages_halve_resolution_and_widen() -> None:
    model = MiniResNet(in_channels=3, num_classes=10, widths=(8, 16, 32))
    feats = model.stages(model.stem(torch.randn(1, 3, 32, 32)))
    assert feats.shape == (1, 32, 8, 8)


def test_group_norm_is_batch_split_invariant() -> None:
    # The DDP equivalence tests rely on this: per-sample normalisation, so a batch's outputs do
    # not depend on which other samples share its batch.
    model = MiniResNet(in_channels=1, num_classes=10, widths=(8, 16), norm="group").eval()
    x = torch.randn(6, 1, 28, 28)
    torch.testing.assert_close(model(x), torch.cat([model(x[:3]), model(x[3:])]))


def test_no_ddp_knowledge_in_state_dict_keys() -> None:
    keys = MiniResNet(in_channels=1, num_classes=10).state_dict().keys()
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in keys)
