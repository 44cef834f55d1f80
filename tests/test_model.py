from __future__ import annotations

import re
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import model as models
from config import ConfigError, ModelConfig
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


# ---------------------------------------------------------------------------------------------
# Any model: torchvision builders by name, factories, weights


def test_torchvision_builder_takes_the_data_channels_and_classes() -> None:
    torch.manual_seed(0)
    model = models.build(ModelConfig(name="resnet18"), (1, 28, 28), 7)
    torch.manual_seed(0)
    reference = torchvision.models.resnet18(num_classes=7)  # built for RGB
    assert model.conv1.in_channels == 1 and model.fc.out_features == 7
    # The RGB stem summed over its input channels: a gray image gives what its RGB copy gave.
    torch.testing.assert_close(model.conv1.weight, reference.conv1.weight.sum(1, keepdim=True))
    gray = torch.rand(2, 1, 28, 28)
    model.eval(), reference.eval()
    torch.testing.assert_close(model(gray), reference(gray.expand(-1, 3, -1, -1)))


def test_a_fitted_stem_sees_a_repeated_image_as_the_original_stem_sees_it() -> None:
    conv = nn.Conv2d(3, 8, 3)
    rgb = torch.rand(2, 3, 9, 9)
    reference = nn.functional.conv2d(rgb, conv.weight)
    six = nn.functional.conv2d(torch.cat([rgb, rgb], 1), models.fit_stem_weight(conv.weight, 6))
    torch.testing.assert_close(six, reference)
    gray = rgb[:, :1]
    one = nn.functional.conv2d(gray, models.fit_stem_weight(conv.weight, 1))
    torch.testing.assert_close(one, nn.functional.conv2d(gray.expand(-1, 3, -1, -1), conv.weight))


def test_aux_heads_are_off_so_training_gets_plain_logits() -> None:
    model = models.build(ModelConfig(name="googlenet"), (3, 64, 64), 5).train()
    assert model(torch.rand(2, 3, 64, 64)).shape == (2, 5)


def test_an_unknown_name_is_bad_input_with_the_nearest_names() -> None:
    with pytest.raises(ConfigError, match=r"'resnet19' is not a model.*resnet18"):
        models.check(ModelConfig(name="resnet19"))
    assert {"mini_resnet", "resnet50", "vit_b_16", "convnext_tiny"} <= set(models.names())


def test_an_input_too_small_for_the_model_is_bad_input_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"model.name=convnext_tiny cannot take 1x28x28 inputs"):
        models.build(ModelConfig(name="convnext_tiny"), (1, 28, 28), 10)
    with pytest.raises(ConfigError, match=r"model.name=vit_b_16 cannot take 3x64x64"):
        models.build(ModelConfig(name="vit_b_16"), (3, 64, 64), 10)


def write_module(tmp_path, monkeypatch, source: str) -> str:
    """A module of the user's in the current directory; returns its (unique) name."""
    name = f"user_models_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_factory adds the directory
    return name


def test_a_factory_gets_channels_classes_and_kwargs(tmp_path, monkeypatch) -> None:
    name = write_module(
        tmp_path,
        monkeypatch,
        """
        from torch import nn

        def linear(*, in_channels, num_classes, hidden):
            return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 64, hidden),
                                 nn.Linear(hidden, num_classes))
        """,
    )
    cfg = ModelConfig(factory=f"{name}:linear", kwargs='{"hidden": 5}')
    model = models.build(cfg, (2, 8, 8), 3)
    assert [m.out_features for m in model if isinstance(m, nn.Linear)] == [5, 3]
    for kwargs, why in [
        ("{}", "missing a required argument: 'hidden'"),
        ('{"depth": 2, "hidden": 5}', "got an unexpected keyword argument 'depth'"),
    ]:
        wrong = ModelConfig(factory=f"{name}:linear", kwargs=kwargs)
        with pytest.raises(
            ConfigError,
            match=f"model.factory={name}:linear cannot be called "
            f"with model.kwargs={re.escape(kwargs)}: {why}",
        ):
            models.build(wrong, (2, 8, 8), 3)
    # A TypeError inside the user's code is theirs to see, with its traceback.
    with pytest.raises(TypeError, match="must be tuple of ints"):
        models.build(ModelConfig(factory=f"{name}:linear", kwargs='{"hidden": "5"}'), (2, 8, 8), 3)


def test_mini_resnet_kwargs_cannot_bypass_its_checked_settings() -> None:
    with pytest.raises(ConfigError, match=r"sets widths: for mini_resnet set model.widths"):
        models.build(ModelConfig(kwargs='{"widths": [0]}'), (1, 28, 28), 10)
    with pytest.raises(ConfigError, match=r"model.name=mini_resnet cannot be called .*'depth'"):
        models.build(ModelConfig(kwargs='{"depth": 3}'), (1, 28, 28), 10)


@pytest.mark.parametrize(
    ("source", "function", "message"),
    [
        ("raise ImportError('no module named helper')", "f", r"cannot import module .*helper"),
        ("x = 1", "f", r"has no function 'f'"),
        ("def f(**kwargs):\n    return 'a model'", "f", r"returned str, not a torch.nn.Module"),
    ],
)
def test_a_factory_that_fails_is_bad_input_naming_it(
    tmp_path, monkeypatch, source, function, message
) -> None:
    name = write_module(tmp_path, monkeypatch, source)
    with pytest.raises(ConfigError, match=f"model.factory={name}:{function}.*{message}"):
        models.build(ModelConfig(factory=f"{name}:{function}"), (1, 8, 8), 2)


def test_pretrained_weights_keep_the_body_fit_the_stem_and_leave_the_classifier(
    tmp_path,
) -> None:
    torch.manual_seed(1)
    source = torchvision.models.resnet18()  # 1000 classes, RGB: an ImageNet-style file
    path = tmp_path / "weights.pt"
    # As DDP's module saves it, under "state_dict" (Lightning, timm and others nest it so).
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, path)
    torch.manual_seed(2)
    model = models.build(ModelConfig(name="resnet18"), (1, 32, 32), 10)
    classifier = model.fc.weight.clone()
    models.load_weights(model, str(path))
    assert torch.equal(model.layer3[1].conv2.weight, source.layer3[1].conv2.weight)
    assert torch.equal(model.bn1.running_var, source.bn1.running_var)
    torch.testing.assert_close(model.conv1.weight, source.conv1.weight.sum(1, keepdim=True))
    assert torch.equal(model.fc.weight, classifier)  # 10 classes, not 1000: as built


class TwoHeads(nn.Module):
    """A distilled DeiT's shape: a class head and a distillation head of the same shape, whose
    logits are averaged at inference."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.body = nn.Linear(12, 16)
        self.head = nn.Linear(16, num_classes)
        self.head_dist = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.body(x.flatten(1)).relu()
        return (self.head(features) + self.head_dist(features)) / 2


def test_a_model_with_two_classifier_heads_fine_tunes_from_its_own_weights(tmp_path) -> None:
    """Before, only the last Linear counted as the classifier: `head` of the 1000-class file
    was 'misshapen' and the weights could not be used at all."""
    path = tmp_path / "deit.pt"
    source = TwoHeads(1000)
    torch.save(source.state_dict(), path)
    model = TwoHeads(10)
    heads = (model.head.weight.clone(), model.head_dist.weight.clone())
    models.load_weights(model, str(path))
    assert torch.equal(model.body.weight, source.body.weight)
    assert torch.equal(model.head.weight, heads[0]) and torch.equal(
        model.head_dist.weight, heads[1]
    )


def test_weights_that_do_not_fit_are_bad_input_naming_the_keys(tmp_path) -> None:
    path = tmp_path / "mini.pt"
    torch.save(MiniResNet(in_channels=1, num_classes=10).state_dict(), path)
    model = models.build(ModelConfig(name="resnet18"), (1, 32, 32), 10)
    with pytest.raises(ConfigError, match=r"does not fit.*missing: conv1.weight.*unexpected: stem"):
        models.load_weights(model, str(path))


class RunsCode:
    """Unpickling it creates `marker`: what a malicious weights file could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_a_weights_file_that_would_run_code_is_refused(tmp_path) -> None:
    path, marker = tmp_path / "evil.pt", tmp_path / "code-ran"
    torch.save({"model": RunsCode(marker)}, path)
    model = MiniResNet(in_channels=1, num_classes=10)
    with pytest.raises(ConfigError, match=r"model.weights=.*evil.pt cannot be loaded"):
        models.load_weights(model, str(path))
    assert not marker.exists()
    with pytest.raises(ConfigError, match="does not exist"):
        models.load_weights(model, str(tmp_path / "absent.pt"))


# ---------------------------------------------------------------------------------------------
# Training-mode outputs, unused parameters, torchvision's aux-logit and convolutional heads


@pytest.mark.parametrize(
    ("name", "size", "head", "dropped"),
    [
        ("googlenet", 64, "fc", ("aux1.", "aux2.")),
        ("inception_v3", 80, "fc", ("AuxLogits.",)),
        ("squeezenet1_0", 64, "classifier.1", ()),
    ],
)
def test_torchvision_models_fine_tune_from_torchvision_state_dicts(
    tmp_path, name, size, head, dropped
) -> None:
    """A state dict as torchvision's own model holds it (aux heads on, 1000 classes), built here
    with random weights instead of downloaded: the body loads, the aux heads are left out as
    torchvision's builders leave them out for aux_logits=False (googlenet() and inception_v3()
    in torchvision/models/googlenet.py, inception.py), and the classifier (a 1x1 convolution for
    squeezenet) starts untrained for the 5 classes."""
    torch.manual_seed(3)
    extra = {} if name.startswith("squeezenet") else {"init_weights": False}
    saved = torchvision.models.get_model(name, weights=None, num_classes=1000, **extra).state_dict()
    path = tmp_path / f"{name}.pt"
    torch.save(saved, path)
    torch.manual_seed(4)
    model = models.build(ModelConfig(name=name), (3, size, size), 5)
    classifier = model.get_submodule(head).weight.clone()
    models.load_weights(model, str(path))
    own = model.state_dict()
    body = [k for k in saved if not k.startswith((f"{head}.", *dropped))]
    assert body and all(torch.equal(own[k], saved[k]) for k in body)
    assert torch.equal(model.get_submodule(head).weight, classifier)  # as built, 5 classes
    model.train()
    assert model(torch.rand(2, 3, size, size)).shape == (2, 5)  # plain logits to train on


def test_aux_logits_turned_on_are_built_and_train_as_namedtuples_of_logits() -> None:
    # Refused before loss.aux_weight (objective/losses.py) weighed the auxiliary logits.
    cfg = ModelConfig(name="googlenet", kwargs='{"aux_logits": true}')
    model = models.build(cfg, (3, 64, 64), 5).train()
    out = model(torch.rand(2, 3, 64, 64))
    assert type(out).__name__ == "GoogLeNetOutputs"
    assert [tuple(x.shape) for x in out] == [(2, 5)] * 3
    assert model.eval()(torch.rand(2, 3, 64, 64)).shape == (2, 5)  # evaluation: plain logits


USER_MODELS = """
import torch
from torch import nn

class WithFeatures(nn.Module):
    def __init__(self, in_channels, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.LazyLinear(8))
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        features = self.body(x)
        logits = self.head(features)
        return (logits, features) if self.training else logits

class Unused(nn.Module):
    def __init__(self, in_channels, num_classes):
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))
        self.projection = nn.Linear(4, 4)  # never called
        self.frozen = nn.Linear(4, 4).requires_grad_(False)  # frozen: fine for DDP

    def forward(self, x):
        return self.head(x)

def with_features(*, in_channels, num_classes):
    return WithFeatures(in_channels, num_classes)

def unused(*, in_channels, num_classes):
    return Unused(in_channels, num_classes)
"""


def test_a_factory_returning_a_tuple_in_training_is_refused(tmp_path, monkeypatch) -> None:
    name = write_module(tmp_path, monkeypatch, USER_MODELS)
    expected = (
        rf"model.factory={name}:with_features returns tuple in training mode for a batch of two "
        r"1x4x4 inputs, not logits of shape \(2, 3\)"
    )
    with pytest.raises(ConfigError, match=expected):
        models.build(ModelConfig(factory=f"{name}:with_features"), (1, 4, 4), 3)


def test_parameters_without_gradient_are_refused_naming_them(tmp_path, monkeypatch) -> None:
    """DDP (find_unused_parameters=False) raises at the first step on a parameter that got no
    gradient: named before training, with dist.find_unused_parameters (before, the advice was
    only "remove or freeze", for an option this pipeline did not have); built with it."""
    name = write_module(tmp_path, monkeypatch, USER_MODELS)
    with pytest.raises(
        ConfigError,
        match=(
            r"no gradient in training: projection.weight, "
            r"projection.bias\. DistributedDataParallel.*--dist.find_unused_parameters=true"
        ),
    ):
        models.build(ModelConfig(factory=f"{name}:unused"), (1, 4, 4), 3)
    models.build(ModelConfig(factory=f"{name}:unused"), (1, 4, 4), 3, unused_ok=True)


def test_the_training_check_leaves_weights_buffers_and_generator_as_built() -> None:
    torch.manual_seed(0)
    reference = MiniResNet(in_channels=1, num_classes=10, widths=(8, 16), dropout=0.5)
    after_building = torch.get_rng_state()
    torch.manual_seed(0)
    model = models.build(ModelConfig(widths=(8, 16), dropout=0.5), (1, 28, 28), 10)
    assert torch.equal(torch.get_rng_state(), after_building)  # the dropout draws undone
    theirs = reference.state_dict()
    for key, mine in model.state_dict().items():
        assert torch.equal(mine, theirs[key]), key  # BatchNorm statistics too
    assert all(p.grad is None for p in model.parameters())


def test_a_vit_image_size_not_a_multiple_of_its_patch_is_bad_input_naming_both() -> None:
    # torchvision asserts "Input shape indivisible by patch size!" (VisionTransformer.__init__):
    # before, an AssertionError traceback, exit 1.
    with pytest.raises(
        ConfigError,
        match=(
            r"vit_b_16: model.kwargs image_size=40 is not a "
            r"multiple of its patch size 16"
        ),
    ):
        models.build(ModelConfig(name="vit_b_16", kwargs='{"image_size": 40}'), (3, 40, 40), 5)


def test_weights_as_torchvisions_reference_scripts_save_them_are_read(tmp_path) -> None:
    """references/classification/train.py saves {"model", "optimizer", "lr_scheduler",
    "epoch", "args": argparse.Namespace}; before, weights_only refused the Namespace with
    torch's "Unsupported global" text. Read safely: the Namespace is a bag of attributes."""
    import argparse

    source = MiniResNet(in_channels=1, num_classes=10)
    path = tmp_path / "checkpoint.pth"
    args = argparse.Namespace(lr=0.5, model="mini", epochs=90)
    torch.save({"model": source.state_dict(), "epoch": 89, "args": args}, path)
    model = MiniResNet(in_channels=1, num_classes=10)
    models.load_weights(model, str(path))
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """A .safetensors file written by hand from its spec (github.com/huggingface/safetensors,
    "Format"): u64 little-endian header length, the JSON header, the raw bytes."""
    import json
    import struct

    names = {torch.float32: "F32", torch.int64: "I64", torch.bfloat16: "BF16"}
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, tensor in tensors.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def test_a_safetensors_file_is_read_without_the_safetensors_package(tmp_path) -> None:
    """Before, a .safetensors file went to torch.load, which cannot read it (and the package
    that can is not in the lock)."""
    source = MiniResNet(in_channels=1, num_classes=10)
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(source.state_dict()))
    model = MiniResNet(in_channels=1, num_classes=10)
    models.load_weights(model, str(path))
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    odd = {"x": torch.arange(6, dtype=torch.bfloat16).view(2, 3), "e": torch.zeros(0)}
    (tmp_path / "odd.safetensors").write_bytes(safetensors_bytes(odd))
    import weightfiles

    read = weightfiles.read_safetensors(tmp_path / "odd.safetensors")
    assert torch.equal(read["x"], odd["x"]) and read["e"].shape == (0,)


def test_a_model_that_cannot_take_the_evaluation_crop_is_refused_before_training(
    tmp_path, monkeypatch
) -> None:
    """data.eval_crop_size other than data.image_size: a fixed-input model trained at one size
    would fail at the first evaluation, after an epoch (the review's finding); the start-up
    check runs the evaluation's shape too and names its key."""
    name = write_module(
        tmp_path,
        monkeypatch,
        """
        from torch import nn

        def fixed(*, in_channels, num_classes):
            return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 64, num_classes))
        """,
    )
    cfg = ModelConfig(factory=f"{name}:fixed")
    models.build(cfg, (2, 8, 8), 3, eval_shape=(2, 8, 8))
    with pytest.raises(ConfigError, match=r"cannot take 2x10x10 inputs .*data.eval_crop_size"):
        models.build(cfg, (2, 8, 8), 3, eval_shape=(2, 10, 10))
