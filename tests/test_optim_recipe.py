"""The optimizer side of the recipe (optim/): weight decay by kind of parameter, the
optim.param_groups factory and its frozen groups, the schedules, and the weight average's
every-N updates, each against a hand-written expectation or torch's own schedulers."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import final_state, launch, run_ranks, tiny_job_args
from torch import nn

from config import ConfigError, OptimConfig
from model import MiniResNet
from optim import groups, spec

EXAMPLE = "examples.param_groups:fine_tuning"
WD = 5e-4  # OptimConfig's default weight decay
LR = 0.2  # and peak rate


def rates(model: nn.Module, cfg: OptimConfig, planned=()) -> dict[str, tuple[float, float]]:
    """(lr, weight decay) of each parameter name in the optimizer built for `model`."""
    optimizer = spec.build_optimizer(model, cfg, "foreach", planned)
    by_id = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, tuple[float, float]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            assert by_id[id(param)] not in out, "a parameter in two optimizer groups"
            out[by_id[id(param)]] = (group["lr"], group["weight_decay"])
    return out


def mini() -> MiniResNet:
    torch.manual_seed(0)
    return MiniResNet(in_channels=1, num_classes=10, widths=(4, 8, 8))


# -- weight decay by kind ---------------------------------------------------------------------


def test_the_default_groups_are_the_two_of_before_in_the_same_order() -> None:
    """Without the new keys the optimizer holds what it always held: [p.ndim >= 2 at
    optim.weight_decay, the rest at 0], each in model.parameters() order (checkpoints of
    earlier runs hold these two groups)."""
    for model in (mini(), _resnet18()):
        optimizer = spec.build_optimizer(model, OptimConfig(), "foreach")
        params = list(model.parameters())
        assert [g["weight_decay"] for g in optimizer.param_groups] == [WD, 0.0]
        assert optimizer.param_groups[0]["params"] == [p for p in params if p.ndim >= 2]
        assert optimizer.param_groups[1]["params"] == [p for p in params if p.ndim < 2]


class Kinds(nn.Module):
    """One parameter of every kind: conv weight and bias, BatchNorm, LayerNorm over one and
    two dimensions, GroupNorm, PReLU, a linear layer, a learned scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, bias=True)
        self.bn = nn.BatchNorm2d(2)
        self.gn = nn.GroupNorm(1, 2)
        self.ln = nn.LayerNorm(4)
        self.ln2d = nn.LayerNorm((2, 2))
        self.act = nn.PReLU(2)
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(()))


def test_norm_and_bias_weight_decay_follow_torchvisions_split_by_hand() -> None:
    cfg = OptimConfig(weight_decay=0.1, norm_weight_decay=0.01, bias_weight_decay=0.001)
    expected = {
        "conv.weight": 0.1,
        "conv.bias": 0.001,
        "bn.weight": 0.01,
        "bn.bias": 0.01,  # a norm layer's shift: the norm rate
        "gn.weight": 0.01,
        "gn.bias": 0.01,
        "ln.weight": 0.01,
        "ln.bias": 0.01,
        "ln2d.weight": 0.1,  # 2-D: decays as it always did
        "ln2d.bias": 0.1,
        "act.weight": 0.0,  # 1-D, neither norm nor bias: no decay, as before
        "fc.weight": 0.1,
        "fc.bias": 0.001,
        "scale": 0.0,
    }
    got = rates(Kinds(), cfg)
    assert {name: wd for name, (_, wd) in got.items()} == expected
    assert {lr for lr, _ in got.values()} == {LR}
    defaults = rates(Kinds(), OptimConfig(weight_decay=0.1))
    by_ndim = {n: 0.1 if p.ndim >= 2 else 0.0 for n, p in Kinds().named_parameters()}
    assert {name: wd for name, (_, wd) in defaults.items()} == by_ndim


# -- the parameter-group factory --------------------------------------------------------------


def test_the_example_factorys_groups_on_miniresnet_by_hand() -> None:
    model = mini()
    cfg = OptimConfig(
        param_groups=EXAMPLE, param_groups_kwargs='{"head": "head", "frozen": ["stem"]}'
    )
    planned = groups.plan(model, cfg)
    backbone, head = LR * 0.1, LR
    expected = {
        "head.weight": (head, WD),
        "head.bias": (head, 0.0),
    }
    for stage, shortcut in ((0, False), (1, True), (2, True)):
        for conv in ("conv1", "conv2"):
            expected[f"stages.{stage}.{conv}.weight"] = (backbone, WD)
        for norm in ("norm1", "norm2"):
            expected[f"stages.{stage}.{norm}.weight"] = (backbone, 0.0)
            expected[f"stages.{stage}.{norm}.bias"] = (backbone, 0.0)
        if shortcut:
            expected[f"stages.{stage}.shortcut.0.weight"] = (backbone, WD)
            expected[f"stages.{stage}.shortcut.1.weight"] = (backbone, 0.0)
            expected[f"stages.{stage}.shortcut.1.bias"] = (backbone, 0.0)
    assert rates(model, cfg, planned) == expected
    frozen = ["stem.0.weight", "stem.1.weight", "stem.1.bias"]
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == frozen


def _resnet18() -> nn.Module:
    from torchvision.models import resnet18

    torch.manual_seed(0)
    return resnet18(num_classes=10)


def test_the_example_factorys_groups_on_torchvisions_resnet18_by_hand() -> None:
    """The fine-tuning recipe: fc at optim.lr, layer1-4 at a tenth, the stem frozen, with the
    reference's norm decay 0 and biases at optim.weight_decay (--bias-weight-decay unset)."""
    model = _resnet18()
    cfg = OptimConfig(
        weight_decay=1e-4,
        bias_weight_decay=1e-4,
        param_groups=EXAMPLE,
        param_groups_kwargs='{"frozen": ["conv1", "bn1"], "backbone_lr_scale": 0.1}',
    )
    got = rates(model, cfg, groups.plan(model, cfg))
    assert got.pop("fc.weight") == pytest.approx((LR, 1e-4))
    assert got.pop("fc.bias") == pytest.approx((LR, 1e-4))
    for name, (lr, wd) in got.items():
        assert name.startswith(("layer1.", "layer2.", "layer3.", "layer4.")), name
        conv = ".conv" in name or name.endswith("downsample.0.weight")
        assert (lr, wd) == pytest.approx((LR * 0.1, 1e-4 if conv else 0.0)), name
    # 62 parameters: the stem's 3 (frozen), 8 blocks of 6, 3 downsamples of 3, fc's 2
    assert len(got) == 62 - 3 - 2
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("bn1"))


def given(model: nn.Module, groups: object) -> object:
    """A factory returning what param_groups_kwargs gives it (the refusals below)."""
    return groups


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([{"params": ["head"]}, {"params": ["head.bias"]}], "'head.bias' is in two groups"),
        ([{"name": "x", "params": ["stages.9"]}], "group 'x' names 'stages.9', which is no"),
        ([{"name": "x", "params": ["hea"]}], "'hea', which is no parameter or module"),
        ([{"name": "x", "params": []}], "group 'x' names no parameters"),
        ([{"params": ["stem", "stages", "head"], "frozen": True}], "freezes every parameter"),
        ([{"name": "x", "params": ["head"], "lr": 0.1, "lr_scale": 2}], "both lr and lr_scale"),
        ([{"name": "x", "params": ["head"], "lr_scale": 0}], "lr_scale=0 must be a number > 0"),
        ([{"name": "x", "params": ["head"], "frozen": True, "lr": 1}], "is frozen: it takes no"),
        ([{"name": "x", "params": ["head"], "decay": 0}], "unknown keys ['decay']"),
        ({"params": ["head"]}, "returned dict, not a list of dicts"),
    ],
)
def test_bad_groups_are_refused_naming_the_group_and_the_fault(returned, message) -> None:
    import json

    cfg = OptimConfig(
        param_groups="test_optim_recipe:given",
        param_groups_kwargs=json.dumps({"groups": returned}),
    )
    model = mini()
    with pytest.raises(ConfigError, match="optim.param_groups=test_optim_recipe:given") as err:
        groups.plan(model, cfg)
    assert message in str(err.value)
    assert all(p.requires_grad for p in model.parameters())  # refused before freezing any


def test_a_frozen_groups_batchnorm_stays_in_eval_through_every_train_call() -> None:
    """Frozen: no gradient, and BatchNorm's statistics never move, whatever calls .train():
    the model's own train() and a deepcopy's (FLOP counting copies the model)."""
    model = mini()
    cfg = OptimConfig(
        param_groups=EXAMPLE, param_groups_kwargs='{"head": "head", "frozen": ["stem"]}'
    )
    groups.plan(model, cfg)
    stem_bn, stage_bn = model.stem[1], model.stages[0].norm1
    before = {k: v.clone() for k, v in stem_bn.state_dict().items()}
    for module in (model, copy.deepcopy(model)):
        module.eval()
        module.train()
        held, trained = module.stem[1], module.stages[0].norm1
        assert not held.training and trained.training
    moved = stage_bn.running_mean.clone()
    model.train()
    model(torch.randn(8, 1, 16, 16))
    for key, value in stem_bn.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not torch.equal(stage_bn.running_mean, moved)  # a trained group's statistics move


def _average_beside_a_held_batchnorm(info, values: torch.Tensor) -> tuple:
    from distributed import average_buffers

    model = nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    groups.hold_in_eval(model[0])
    with torch.no_grad():
        model[0].running_mean.copy_(values)
        model[1].running_mean.fill_(float(info.rank))
    average_buffers(model)
    return model[0].running_mean.clone(), model[1].running_mean.clone()


@pytest.mark.spawn
def test_averaging_statistics_over_3_ranks_leaves_a_held_batchnorms_alone(tmp_path) -> None:
    """Before evaluating, BatchNorm statistics are averaged over ranks: sum, then / 3. For a
    frozen layer's (the same on every rank) that is not the identity in floating point: values
    x with (x + x + x) / 3 != x stay x, while a training layer's are still averaged."""
    x = torch.rand(10000, generator=torch.Generator().manual_seed(0))
    values = x[(x + x + x) / 3 != x][:4]
    assert len(values) == 4
    for held, trained in run_ranks(_average_beside_a_held_batchnorm, 3, tmp_path, values):
        assert torch.equal(held, values)
        assert torch.equal(trained, torch.full((4,), 1.0))  # (0 + 1 + 2) / 3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero", "fsdp"])
def test_frozen_weights_and_batchnorm_statistics_stay_bit_for_bit_under_torchrun(
    tmp_path, strategy
) -> None:
    """2 ranks train 6 steps from a weights file whose statistics are not BatchNorm's
    initial ones: the frozen stem and first stage end torch.equal to the file (running
    statistics and num_batches_tracked included), the rest has trained."""
    torch.manual_seed(1)
    start = MiniResNet(in_channels=1, num_classes=10, widths=(4, 8, 8)).state_dict()
    for key, value in start.items():
        if "running" in key:
            value.copy_(torch.rand_like(value) + 0.5)
    torch.save(start, tmp_path / "start.pt")
    args = tiny_job_args(
        tmp_path / "run",
        model_weights=tmp_path / "start.pt",
        optim_param_groups=EXAMPLE,
        optim_param_groups_kwargs='{"head": "head", "frozen": ["stem", "stages.0"]}',
        optim_warmup_steps=1,
        train_max_steps=6,
        dist_strategy=strategy,
        dist_timeout_s=60,
    )
    proc = launch(2, *args)
    assert proc.returncode == 0, proc.output[-4000:]
    final = final_state(tmp_path / "run")["model"]
    frozen = [key for key in start if key.startswith(("stem.", "stages.0."))]
    assert len(frozen) == 6 + 2 * 6  # conv weight and BN (weight, bias, 2 statistics, count)
    for key in frozen:
        assert torch.equal(final[key], start[key]), key
    for key in ("head.weight", "stages.1.conv1.weight", "stages.1.norm1.running_mean"):
        assert not torch.equal(final[key], start[key]), key


# -- schedules ---------------------------------------------------------------------------------

TOTAL, SPE = 60, 6  # steps in the run, steps per epoch


def lrs(cfg: OptimConfig, total: int = TOTAL, spe: int = SPE) -> list[list[float]]:
    """Each group's lr at every step, as the trainer sees it: read, step, then schedule.step()
    (two groups: the second at a tenth of the peak, as a param_groups factory gives it)."""
    from optim import schedules

    a, b = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": cfg.lr / 10}], lr=cfg.lr)
    scheduler = schedules.build_scheduler(optimizer, cfg, total, spe)
    out = []
    for _ in range(total):
        out.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return out


def torch_lrs(make, steps: int, lr: float = 1.0) -> list[float]:
    """The lr of torch's own scheduler `make(optimizer)` at each of `steps` steps."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = make(optimizer)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_the_default_schedule_is_todays_warmup_and_cosine_bit_for_bit() -> None:
    """By hand, as the schedule has always been written: (s + 1) / W, then
    0.5 (1 + cos(pi (s - W) / (T - W - 1)))."""
    import math

    got = lrs(OptimConfig(lr=1.0, warmup_steps=8))
    expected = [(s + 1) / 8 for s in range(8)]
    expected += [0.5 * (1 + math.cos(math.pi * min(1.0, (s - 8) / 51))) for s in range(8, 60)]
    assert [g[0] for g in got] == expected


@pytest.mark.parametrize("warmup", ["linear", "constant"])
def test_step_schedule_by_hand_and_against_torchs_steplr(warmup) -> None:
    """Warm-up 12 steps (2 epochs) from 0.01, then x 0.5 every 3 epochs (18 steps)."""
    cfg = OptimConfig(
        lr=1.0,
        warmup=warmup,
        warmup_epochs=2,
        warmup_factor=0.01,
        schedule="step",
        step_epochs=3,
        gamma=0.5,
    )
    got = lrs(cfg)
    if warmup == "linear":
        warm = [0.01 + 0.99 * (s + 1) / 12 for s in range(12)]
        # torch's LinearLR reaches 1 one step later: its step s + 1 is our step s.
        linear = torch.optim.lr_scheduler.LinearLR
        ref = torch_lrs(lambda o: linear(o, start_factor=0.01, total_iters=12), 13)[1:]
    else:
        warm = [0.01] * 12
        constant = torch.optim.lr_scheduler.ConstantLR
        ref = torch_lrs(lambda o: constant(o, factor=0.01, total_iters=12), 12)
    main = [1.0] * 18 + [0.5] * 18 + [0.25] * 12
    assert [g[0] for g in got] == pytest.approx(warm + main, rel=1e-12)
    assert [g[0] for g in got[:12]] == pytest.approx(ref, rel=1e-12)
    steplr = torch.optim.lr_scheduler.StepLR
    assert [g[0] for g in got[12:]] == pytest.approx(
        torch_lrs(lambda o: steplr(o, step_size=18, gamma=0.5), 48), rel=1e-12
    )
    assert [g[1] for g in got] == pytest.approx([g[0] / 10 for g in got], rel=1e-12)


def test_exponential_schedule_by_hand_and_against_torchs_exponentiallr() -> None:
    """x 0.8 per epoch: at each epoch's start exactly torchvision's per-epoch ExponentialLR,
    in between torch's per-step ExponentialLR at 0.8 ** (1 / 6)."""
    cfg = OptimConfig(lr=1.0, warmup_steps=0, schedule="exponential", gamma=0.8)
    got = [g[0] for g in lrs(cfg)]
    assert got == pytest.approx([0.8 ** (s / 6) for s in range(60)], rel=1e-12)
    exponential = torch.optim.lr_scheduler.ExponentialLR
    per_step = torch_lrs(lambda o: exponential(o, gamma=0.8 ** (1 / 6)), 60)
    assert got == pytest.approx(per_step, rel=1e-9)
    per_epoch = torch_lrs(lambda o: exponential(o, gamma=0.8), 10)
    assert got[::6] == pytest.approx(per_epoch, rel=1e-12)


def test_cosine_and_constant_schedules_against_torchs_schedulers() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    got = [g[0] for g in lrs(cfg)]
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR
    # Ours ends at min_lr_ratio on the run's last step: T_max = 60 - 4 - 1.
    ref = torch_lrs(lambda o: cosine(o, T_max=55, eta_min=0.1), 56)
    assert got[4:] == pytest.approx(ref, rel=1e-9)
    assert got[-1] == pytest.approx(0.1)
    flat = [g[0] for g in lrs(OptimConfig(lr=1.0, warmup_steps=4, schedule="constant"))]
    assert flat == [0.25, 0.5, 0.75] + [1.0] * 57


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--optim.gamma=0", "optim.gamma: 0.0 (must be in (0, 1])"),
        ("--optim.step_epochs=0", "optim.step_epochs: 0 (must be >= 1)"),
        ("--optim.warmup_factor=1.5", "optim.warmup_factor: 1.5 (must be in [0, 1])"),
        ("--optim.warmup=constant", "optim.warmup_factor: 0.0 (a constant warm-up at 0"),
        ("--optim.norm_weight_decay=-1", "optim.norm_weight_decay: -1.0 (must be >= 0)"),
    ],
)
def test_bad_schedule_and_decay_values_are_refused_naming_key_and_value(flag, message) -> None:
    from cli import parse_args

    with pytest.raises(ConfigError, match="invalid value for") as err:
        parse_args([flag])
    assert message in str(err.value)


# -- the weight average as the reference adjusts it ----------------------------------------


def test_weight_average_every_n_steps_restarting_through_the_warmup_by_hand() -> None:
    """4 steps an epoch, every 2nd step, warm-up 3 steps, decay 0.5: steps 0 and 2 restart
    from the weights (the reference's reset of n_averaged), 4 and 6 average with the ramped
    decay min(0.5, (1 + n) / (10 + n)), the odd steps do nothing."""
    from ckpt.parts import Position
    from optim import ema

    model = nn.Linear(1, 1, bias=False)
    average = ema.WeightAverage(
        model, 0.5, every_steps=2, samples_per_step=4, reset_until=lambda: 3
    )
    for step in range(8):
        with torch.no_grad():
            model.weight.fill_(float(step + 1))  # the weights the step left
        average.after_step(Position(step=step, epoch=step // 4, samples_in_epoch=step % 4 * 4))
    expected = 0.1 * 3.0 + 0.9 * 5.0  # step 2 restarted at 3, step 4: n = 0
    expected = 2 / 11 * expected + 9 / 11 * 7.0  # step 6: n = 1
    with average.applied() as evaluated:
        assert evaluated.weight.item() == pytest.approx(expected, rel=1e-6)
    assert average.updates == 2


def test_the_decay_adjustment_is_torchvisions_by_hand() -> None:
    """torchvision's ResNet recipe numbers: decay 0.99998, 32 steps, 600 epochs, a global
    batch of 1024: 1 - 2e-5 x 1024 x 32 / 600; capped at 1 - 1 = 0."""
    from optim import ema

    assert ema.adjusted_decay(0.99998, 1024, 32, 600) == pytest.approx(1 - 0.65536 / 600)
    assert ema.adjusted_decay(0.9, 1024, 32, 10) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero"])
def test_groups_step_schedule_and_ema_every_n_resume_exactly(tmp_path, strategy) -> None:
    """Stopped by SIGTERM after step 5 (mid-epoch, between two EMA updates) and resumed:
    weights, optimizer state (param groups at two rates, a frozen stem) and the average
    torch.equal to a run never stopped. The average updated on steps 3, 6, 8, 11, 14 (every
    3rd step of an 8-step epoch, the warm-up's step 0 a restart): 5 updates, by hand."""
    from test_train_e2e import assert_resumes_exactly

    args = tiny_job_args(
        None,
        optim_param_groups=EXAMPLE,
        optim_param_groups_kwargs='{"head": "head", "frozen": ["stem"]}',
        optim_schedule="step",
        optim_step_epochs=1,
        optim_gamma=0.5,
        optim_warmup_steps=3,
        train_ema_decay=0.9,
        train_ema_every_steps=3,
        train_ema_warmup_reset=True,
        train_epochs=2,
        dist_strategy=strategy,
        dist_timeout_s=60,
    )
    reference = assert_resumes_exactly(tmp_path, args, stop_after=5)
    state = final_state(reference)
    assert state["step"] == 16 and state["ema"]["updates"] == 5
    groups_saved = state["optimizer"]["param_groups"]
    assert [g.get("name") for g in groups_saved] == ["head", "head", "backbone", "backbone"]
    # Step 16 is 13 steps after the warm-up: one halving (8 steps an epoch), the backbone
    # at a tenth of the head's rate.
    assert [g["lr"] for g in groups_saved] == pytest.approx([0.1, 0.1, 0.01, 0.01])


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--optim.param_groups_kwargs={}"], "is for runs with optim.param_groups only"),
        (["--optim.step_epochs=2"], "is for optim.schedule=step only, and this run has "),
        (["--optim.schedule=constant", "--optim.gamma=0.5"], "optim.schedule=constant"),
        (["--optim.schedule=step", "--optim.min_lr_ratio=0.1"], "optim.schedule=cosine only"),
        (["--optim.warmup_epochs=1", "--optim.warmup_steps=5"], "optim.warmup_epochs=1"),
        (["--train.ema_every_steps=4"], "train.ema_decay > 0) only"),
    ],
)
def test_a_setting_the_chosen_schedule_or_average_ignores_is_refused(argv, said) -> None:
    from cli import parse_args

    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert said in str(err.value)


def test_a_checkpoint_of_other_groups_is_refused_naming_the_setting() -> None:
    """The optimizer of a run with optim.param_groups (4 groups) cannot take the state of
    one without (2 groups): refused as not fitting, the setting named."""
    from pathlib import Path

    from test_train import manager_with, saved_state

    from ckpt import parts
    from ckpt.atomic import CheckpointError
    from config import Config

    cfg = Config()
    before = spec.build_optimizer(mini(), cfg.optim, "foreach")
    model = mini()
    grouped = OptimConfig(param_groups=EXAMPLE, param_groups_kwargs='{"head": "head"}')
    after = spec.build_optimizer(model, grouped, "foreach", groups.plan(model, grouped))
    manager, _ = manager_with(cfg, optimizer=parts.OptimizerState(after))
    named = r"optim.param_groups or optim.norm_weight_decay / bias_weight_decay between 0"
    with pytest.raises(CheckpointError, match=named):
        manager.restore(Path("c.pt"), saved_state(cfg, optimizer=before.state_dict()))
