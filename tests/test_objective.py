"""The objective (objective/): losses against hand formulas and torch's own, auxiliary
classifiers, top-5 in training, the metric factory against a hand count at 1, 2 and 3 ranks,
and real runs with each loss (e2e)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import final_state, launch, rows, run_ranks, tiny_job_args
from torch import nn

import engine
import exitcodes
import model as models
from ckpt import parts
from config import IGNORED, AugConfig, Config, LossConfig, MetricsConfig, ModelConfig
from inputs import failures, mixing
from metrics import flops_per_sample
from objective import losses, targets
from schema import ConfigError

CPU = torch.device("cpu")


def softmax_rows(logits: torch.Tensor) -> list[list[float]]:
    """Softmax of each row with Python floats: the hand reference's probabilities."""
    out = []
    for row in logits.tolist():
        exps = [math.exp(x) for x in row]
        out.append([e / sum(exps) for e in exps])
    return out


def hand_focal(logits, target, gamma, weight=None, smoothing=0.0) -> float:
    """Focal loss by hand: -sum_c w_c q_c (1 - p_c)^gamma log p_c per sample; the mean over the
    weights of the targets (indices) or over the rows (float targets)."""
    p, num_classes = softmax_rows(logits), logits.shape[1]
    w = weight or [1.0] * num_classes
    total, denominator = 0.0, 0.0
    for i, row in enumerate(p):
        if target.is_floating_point():
            q, denominator = target[i].tolist(), denominator + 1
        elif int(target[i]) == IGNORED:
            continue
        else:
            q = [1.0 if c == int(target[i]) else 0.0 for c in range(num_classes)]
            denominator += w[int(target[i])]
        q = [qc * (1 - smoothing) + smoothing / num_classes for qc in q]
        total -= sum(
            w[c] * q[c] * (1 - row[c]) ** gamma * math.log(row[c]) for c in range(num_classes)
        )
    return total / denominator


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 0.1], [0.2, 0.3, -2.0, 1.5], [-0.5, 1.0, 0.0, 0.7]])
INDEX = torch.tensor([0, IGNORED, 3])
MIXED = torch.tensor([[0.7, 0.3, 0.0, 0.0], [0.0, 0.0, 0.4, 0.6], [0.25, 0.25, 0.5, 0.0]])


@pytest.mark.parametrize("target", [INDEX, MIXED], ids=["indices", "probabilities"])
@pytest.mark.parametrize("weight", [None, [1.0, 2.0, 0.5, 3.0]], ids=["unweighted", "weighted"])
def test_focal_loss_equals_the_hand_formula_and_cross_entropy_at_gamma_zero(target, weight):
    w = torch.tensor(weight) if weight else None
    for gamma in (0.0, 0.5, 2.0):
        got = losses.focal_loss(LOGITS, target, gamma, w, smoothing=0.1)
        assert got.item() == pytest.approx(hand_focal(LOGITS, target, gamma, weight, 0.1), rel=1e-5)
    # gamma 0 is torch's cross-entropy, weights, smoothing and its mean's rule included
    # (aten/src/ATen/native/LossNLL.cpp, cross_entropy_loss_label_smoothing: the smoothed
    # term over the summed weights of the targets; probability targets: over the rows)
    reference = F.cross_entropy(LOGITS, target, weight=w, label_smoothing=0.1)
    torch.testing.assert_close(losses.focal_loss(LOGITS, target, 0.0, w, 0.1), reference)


def test_focal_focuses_on_hard_samples() -> None:
    easy, hard = torch.tensor([[4.0, 0.0]]), torch.tensor([[0.0, 0.0]])
    label = torch.tensor([0])
    ratio_focal = losses.focal_loss(hard, label, 2.0) / losses.focal_loss(easy, label, 2.0)
    ratio_ce = F.cross_entropy(hard, label) / F.cross_entropy(easy, label)
    assert ratio_focal > 10 * ratio_ce


def objective_of(num_classes: int = 4, **loss: object) -> losses.Objective:
    cfg = Config(loss=LossConfig(**loss))  # type: ignore[arg-type]
    return losses.build(cfg, num_classes, INDEX, CPU)


def test_class_weights_are_torchs_weighted_cross_entropy() -> None:
    weights = (1.0, 2.0, 0.5, 3.0)
    objective = objective_of(class_weights=weights)
    reference = nn.CrossEntropyLoss(weight=torch.tensor(weights), label_smoothing=0.1)
    torch.testing.assert_close(objective(LOGITS, INDEX), reference(LOGITS, INDEX))
    torch.testing.assert_close(objective(LOGITS, MIXED), reference(LOGITS, MIXED))
    default = losses.build(Config(), 4, INDEX, CPU)  # today's loss, exactly
    assert torch.equal(
        default(LOGITS, INDEX), nn.CrossEntropyLoss(label_smoothing=0.1)(LOGITS, INDEX)
    )


def test_class_weights_of_another_length_are_bad_input_naming_key_and_value() -> None:
    with pytest.raises(
        ConfigError, match=r"loss.class_weights: 1.0,2.0 gives 2 weights.*4 classes"
    ):
        objective_of(class_weights=(1.0, 2.0))


def test_bce_is_one_sigmoid_per_class_by_hand() -> None:
    multi_hot = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    weights = [1.0, 2.0, 0.5, 3.0]
    hand = 0.0
    for row, truth in zip(LOGITS.tolist(), multi_hot.tolist(), strict=True):
        for c, (x, y) in enumerate(zip(row, truth, strict=True)):
            sigma = 1 / (1 + math.exp(-x))
            hand -= weights[c] * (y * math.log(sigma) + (1 - y) * math.log(1 - sigma))
    got = objective_of(name="bce", class_weights=tuple(weights))(LOGITS, multi_hot)
    assert got.item() == pytest.approx(hand / 12, rel=1e-5)
    # class indices are one-hot rows; IGNORED rows are left out
    one_hot = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 1.0]])
    expected = F.binary_cross_entropy_with_logits(LOGITS[[0, 2]], one_hot)
    torch.testing.assert_close(objective_of(name="bce")(LOGITS, INDEX), expected)


def test_top1_and_top5_of_a_float_row_are_taken_against_its_highest_targets() -> None:
    logits = torch.arange(12.0).reshape(2, 6).flip(1)  # classes ranked 0, 1, 2, ... per row
    mixed = torch.tensor([[0.2, 0.0, 0.0, 0.0, 0.0, 0.8], [0.0, 0.6, 0.4, 0.0, 0.0, 0.0]])
    top = targets.top(logits)
    assert targets.hits(top, mixed)[:, 0].tolist() == [False, False]  # argmax 5, then 1
    assert targets.hits(top, mixed).any(1).tolist() == [False, True]  # 5 is not in 0..4
    multi_hot = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 1.0], [0.0] * 6])
    assert targets.hits(top, multi_hot).any(1).tolist() == [True, False]  # any label; none


def test_training_counts_top1_and_top5_as_a_hand_count() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 12)
    images, labels = torch.randn(10, 6), torch.tensor([0, 1, 2, 3, 4, 5, 6, IGNORED, 2, 3])
    logits = model(images).detach()
    ranked = logits.argsort(dim=1, descending=True).tolist()
    counted = [i for i, y in enumerate(labels.tolist()) if y != IGNORED]
    top1 = sum(ranked[i][0] == labels[i] for i in counted)
    top5 = sum(int(labels[i]) in ranked[i][:5] for i in counted)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = engine.make_scaler(CPU, None)
    halves = [(images[:5], labels[:5]), (images[5:], labels[5:])]
    stats = engine.forward_backward(model, halves, optimizer, scaler, objective_of(), None, 0.0)
    assert (int(stats.correct), int(stats.top5), int(stats.labelled)) == (top1, top5, 9)
    assert 0 < top1 < top5 < 9  # the counts can tell the two apart


def test_googlenet_aux_loss_is_main_plus_weighted_aux_by_hand_and_trains_a_step() -> None:
    """torchvision's reference script (references/classification/train.py, train_one_epoch)
    passes the whole output to the criterion and has no recipe for auxiliary logits; PyTorch's
    fine-tuning tutorial weighs inception_v3's by 0.4: loss.aux_weight's default."""
    cfg = ModelConfig(name="googlenet", kwargs='{"aux_logits": true, "init_weights": false}')
    torch.manual_seed(0)
    model = models.build(cfg, (3, 32, 32), 5).train()
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 4, 2])
    objective = objective_of(aux_weight=0.3)
    torch.manual_seed(1)  # the same dropout masks in both forwards
    out = model(images)
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    hand = ce(out.logits, labels) + 0.3 * (
        ce(out.aux_logits1, labels) + ce(out.aux_logits2, labels)
    )
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = engine.make_scaler(CPU, None)
    torch.manual_seed(1)
    stats = engine.train_step(model, [(images, labels)], optimizer, scaler, objective, None, 0.0)
    assert (stats.loss_sum / stats.labelled).item() == pytest.approx(hand.item(), rel=1e-6)
    moved = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
    assert all(moved)  # the auxiliary heads' parameters included
    assert model.eval()(images).shape == (4, 5)  # evaluation: plain logits


def f1_objective() -> losses.Objective:
    cfg = Config(metrics=MetricsConfig(factory="examples.custom_objective:f1_counts"))
    return losses.build(cfg, 5, torch.tensor([0, 1]), CPU)


def eval_set() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    labels = torch.randint(0, 5, (37,))
    labels[[4, 20]] = IGNORED
    return nn.Linear(8, 5), torch.randn(37, 8), labels


def evaluate_shard(info) -> dict[str, float]:
    """This rank's share of eval_set (every world_size-th sample, batches of 4), evaluated."""
    model, images, labels = eval_set()
    objective = f1_objective()  # built by each rank, as the Trainer builds it
    mine = slice(info.rank, None, info.world_size)
    batches = zip(images[mine].split(4), labels[mine].split(4), strict=True)
    result = engine.evaluate(model, batches, CPU, None, num_classes=5, objective=objective)
    return {"f1": result.metrics["f1"], "loss": result.loss, "n": result.num_samples}


@pytest.mark.parametrize(
    "world_size",
    [1, pytest.param(2, marks=pytest.mark.spawn), pytest.param(3, marks=pytest.mark.spawn)],
)
def test_the_metric_factory_equals_a_hand_count_at_any_world_size(tmp_path, world_size) -> None:
    model, images, labels = eval_set()
    tp = wrong = 0
    for logit_row, label in zip(model(images).tolist(), labels.tolist(), strict=True):
        if label == IGNORED:
            continue
        predicted = logit_row.index(max(logit_row))
        tp += predicted == label
        wrong += 2 * (predicted != label)  # a false positive and a false negative
    results = run_ranks(evaluate_shard, world_size, tmp_path)
    for result in results:  # every rank holds the whole evaluation's figures
        assert result["f1"] == pytest.approx(2 * tp / (2 * tp + wrong), rel=1e-12)
        assert result["n"] == 35


def test_evaluation_reports_the_focal_loss_without_smoothing_or_weights() -> None:
    model, images, labels = eval_set()
    objective = objective_of(5, name="focal", gamma=2.0, class_weights=(1.0, 2.0, 1.0, 1.0, 1.0))
    result = engine.evaluate(model, [(images, labels)], CPU, None, objective=objective)
    hand = hand_focal(model(images).detach(), labels, 2.0)  # the mean per counted sample
    assert result.loss == pytest.approx(hand, rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Real runs (train.py as a subprocess)

F1 = "examples.custom_objective:f1_counts"


@pytest.mark.e2e
def test_focal_loss_with_class_weights_and_a_metric_trains_at_two_ranks(tmp_path) -> None:
    run_dir = tmp_path / "run"
    args = tiny_job_args(
        run_dir,
        loss_name="focal",
        loss_class_weights=[1, 2, 1, 1, 1, 1, 1, 1, 1, 1],
        metrics_factory=F1,
        train_max_steps=8,
        log_every_steps=4,
    )
    done = launch(2, *args)
    assert done.returncode == 0, done.output[-3000:]
    for row in rows(run_dir, "train") + rows(run_dir, "eval"):
        assert 0 <= row["accuracy"] <= row["top5"] <= 1 and 0 <= row["f1"] <= 1, row
        assert math.isfinite(row["loss"])
    assert " top5 " in done.output and " f1 " in done.output  # the log lines say them too
    report = (run_dir / "eval_report.json").read_text()
    assert '"f1": ' in report


@pytest.mark.e2e
@pytest.mark.parametrize(
    "settings",
    [
        {"loss_factory": "examples.custom_objective:poly1", "loss_kwargs": '{"epsilon": 2.0}'},
        {"loss_name": "model", "model_factory": "examples.custom_objective:self_scoring_cnn"},
    ],
    ids=["loss.factory", "loss.name=model"],
)
def test_a_loss_factory_and_a_model_computed_loss_train(tmp_path, settings) -> None:
    run_dir = tmp_path / "run"
    if "model_factory" in settings:
        settings = {**settings, "model_widths": None}  # a mini_resnet setting
    done = launch(None, *tiny_job_args(run_dir, train_max_steps=6, log_every_steps=3, **settings))
    assert done.returncode == 0, done.output[-3000:]
    train = rows(run_dir, "train")
    assert len(train) == 2 and all(math.isfinite(r["loss"]) for r in train)
    assert 0 <= rows(run_dir, "eval")[-1]["top5"] <= 1


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--loss.class_weights=1,2,3", "loss.class_weights: 1.0,2.0,3.0 gives 3 weights"),
        ("--loss.factory=examples.custom_objective:poly2", "has no function 'poly2'"),
        ("--metrics.factory=nowhere.at_all:f1", "cannot import module 'nowhere.at_all'"),
        ('--metrics.kwargs={"top": 2}', "unexpected keyword argument 'top'"),
    ],
    ids=["class_weights", "loss.factory", "metrics.factory", "metrics.kwargs"],
)
def test_a_bad_objective_is_exit_2_naming_key_and_value(tmp_path, flag, says) -> None:
    args = tiny_job_args(tmp_path / "run", f"--metrics.factory={F1}", flag, train_max_steps=1)
    done = launch(None, *args)
    assert done.returncode == exitcodes.EXIT_BAD_INPUT, done.output[-3000:]
    assert says in done.output
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


@pytest.mark.e2e
def test_a_preempted_focal_run_resumes_exactly(tmp_path) -> None:
    """The focal loss and the metric hold no state: a run stopped by SIGTERM and resumed ends
    bit for bit where an uninterrupted one does."""
    from helpers import assert_same_training_state

    settings = {"loss_name": "focal", "loss_gamma": 1.5, "metrics_factory": F1, "train_epochs": 2}
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    assert launch(None, *tiny_job_args(reference, **settings)).returncode == 0
    first = launch(None, *tiny_job_args(run_dir, **settings), faults="sigterm@step=5")
    assert first.returncode == exitcodes.EXIT_PREEMPTED, first.output[-3000:]
    second = launch(None, *tiny_job_args(run_dir, **settings))
    assert second.returncode == 0, second.output[-3000:]
    assert_same_training_state(final_state(run_dir), final_state(reference))
    assert [r["f1"] for r in rows(run_dir, "eval")] == [r["f1"] for r in rows(reference, "eval")]


def test_multi_hot_labels_of_a_data_factory_are_checked_and_served_as_float_rows() -> None:
    from inputs.user import BadLabel, SampleChecked, check_labels

    image = torch.zeros(1, 8, 8, dtype=torch.uint8)
    row = torch.tensor([1.0, 0.0, 1.0])
    check_labels("d", [row, torch.tensor([0.0, 0.0, 0.0])], 3)
    with pytest.raises(BadLabel, match=r"d\[1\] has label .*float tensors of 3 values"):
        check_labels("d", [row, torch.tensor([1.0, 0.0])], 3)  # another length
    with pytest.raises(BadLabel, match=r"d\[1\] has label 2"):
        check_labels("d", [row, 2], 3)  # kinds mixed: a batch could not stack them
    with pytest.raises(BadLabel, match=r"d\[0\] has label"):
        check_labels("d", [torch.tensor([1.5, 0.0, 0.0])], 3)  # outside [0, 1]
    served = SampleChecked([(image, row.double())], "d", 3, (1, 8, 8))[0][1]
    assert served.dtype == torch.float32 and torch.equal(served, row)


@pytest.mark.e2e
def test_bce_multi_label_trains_at_two_ranks_and_evaluates(tmp_path) -> None:
    run_dir = tmp_path / "run"
    args = tiny_job_args(
        run_dir,
        data_dataset=None,
        data_synthetic_train_size=None,
        data_synthetic_eval_size=None,
        data_factory="examples.custom_objective:bright_quadrants",
        loss_name="bce",
        metrics_factory=F1,
        train_epochs=3,
        log_every_steps=8,
    )
    done = launch(2, *args)
    assert done.returncode == 0, done.output[-3000:]
    evals = rows(run_dir, "eval")
    assert len(evals) == 3 and all(r["num_samples"] == 128 for r in evals)
    assert evals[-1]["loss"] < evals[0]["loss"]  # it learns from multi-hot targets
    assert all(0 <= r["f1"] <= 1 for r in evals + rows(run_dir, "train"))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--loss.gamma=1"], "loss.gamma=1 is for loss.name=focal only"),
        (["--loss.name=bce", "--optim.label_smoothing=0.2"], "for loss.name=cross_entropy and"),
        (["--loss.name=model", "--loss.class_weights=1,2"], "this run has loss.name=model"),
        ([f"--loss.factory={F1}", "--loss.name=focal"], "for a run without loss.factory only"),
        (["--loss.aux_weight=0"], "invalid value for loss.aux_weight: 0.0"),
        (["--loss.class_weights=1,-1"], "invalid value for loss.class_weights: (1.0, -1.0)"),
        (['--loss.kwargs={"num_classes": 3}', f"--loss.factory={F1}"], "num_classes is passed"),
    ],
)
def test_objective_settings_a_run_would_ignore_or_cannot_use_are_refused(argv, says) -> None:
    from cli import parse_args

    with pytest.raises(ConfigError) as refused:
        parse_args(argv)
    assert says in str(refused.value)


def test_resuming_with_another_loss_is_reported_as_a_change_of_the_math(caplog) -> None:
    from test_train import resume, saved_state

    from cli import parse_args

    old, new = parse_args([]), parse_args(["--loss.name=focal", "--loss.gamma=1"])
    with caplog.at_level("WARNING"):
        resume(new, saved_state(old))
    assert "loss.name 'cross_entropy' -> 'focal'" in caplog.text
    assert "loss.gamma 2.0 -> 1.0" in caplog.text


def test_a_metric_named_as_a_built_in_field_is_refused() -> None:
    from objective import metrics

    with pytest.raises(ConfigError, match=r"metric name 'top5' is taken by a built-in field"):
        metrics.load(MetricsConfig(factory="test_objective:clashing"), 3, torch.tensor([0, 1]))


def clashing(*, num_classes: int):
    return lambda logits, target: {"top5": (torch.tensor(1.0), torch.tensor(2.0))}


# ---------------------------------------------------------------------------------------------
# Targets of the kind training passes: the FLOP probe's and a failed batch's stand-in

MULTI_HOT = torch.tensor([[1.0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])


def float_rows_only(*, num_classes: int):
    """A loss.factory written for float rows (multi-hot or mixed): index targets raise."""
    return F.binary_cross_entropy_with_logits


@pytest.mark.parametrize(
    ("settings", "labels"),
    [({}, MULTI_HOT), ({"aug": AugConfig(mixup_alpha=0.2)}, torch.tensor([0, 3, 1]))],
    ids=["multi-hot", "mixup"],
)
def test_the_probe_and_the_stand_in_get_targets_of_the_kind_training_gets(settings, labels):
    """Before: log.mfu's FLOP probe called the loss with int64 zero labels, and a loss.factory
    written for float rows raised there ("Target size (torch.Size([2])) must be the same as
    input size", exit 1); a failed batch's stand-in had the same labels. Now both get zeros of
    the kind step 1 passes: the dtype and shape of a real batch after BatchAugment, and the
    probe counts what a hand count of the linear layer's matmuls gives."""
    cfg = Config(loss=LossConfig(factory="test_objective:float_rows_only"), **settings)
    objective = losses.build(cfg, 4, labels, CPU)
    images = torch.zeros(len(labels), 1, 4, 4)
    step_one = mixing.BatchAugment(cfg.aug, 0, 0, 4)(images, labels, parts.Position())[1]
    probe = objective.zero_targets(2)
    assert probe.dtype == step_one.dtype and probe.shape[1:] == step_one.shape[1:]
    assert torch.equal(probe, torch.zeros(2, 4))
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4))
    # forward x @ W^T, backward grad @ x for W (the input needs no gradient): 2 x 16 x 4 each
    assert flops_per_sample(model, images[:2], objective) == 2 * (2 * 16 * 4)
    stand_in = failures.StandIn(lambda x, y: (x.float(), y), (1, 4, 4), objective.zero_targets(3))
    batch = stand_in()
    assert batch[0].shape == (3, 1, 4, 4) and torch.equal(batch[1], torch.zeros(3, 4))
    objective(model(batch[0]), batch[1])  # the loss takes it: the step reaches its vote
    plain = losses.build(Config(), 4, torch.tensor([0, 3]), CPU)  # index data, no mixing
    assert torch.equal(plain.zero_targets(2), torch.zeros(2, dtype=torch.long))


RAISING_MULTI_HOT = """
import torch
import torch.nn.functional as F

class Samples(torch.utils.data.Dataset):
    def __init__(self, n, seed, bad=None):
        generator = torch.Generator().manual_seed(seed)
        self.labels = (torch.rand(n, 3, generator=generator) < 0.5).float()
        noise = torch.randint(0, 40, (n, 1, 8, 8), generator=generator)
        self.images = (noise + 60 * self.labels[:, :1].view(n, 1, 1, 1)).to(torch.uint8)
        self.bad = bad

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        if index == self.bad:
            raise ValueError(f"no such record: {index}")
        return self.images[index], self.labels[index]

def make(*, root, bad=None):
    return {"train": Samples(32, 1, bad), "eval": Samples(8, 2), "num_classes": 3,
            "input_shape": (1, 8, 8)}

def multi_label_bce(*, num_classes):
    return F.binary_cross_entropy_with_logits
"""


@pytest.mark.e2e
def test_a_failed_multi_hot_batch_skips_checkpoints_and_exits_2_on_every_rank(tmp_path) -> None:
    """Before: the rank whose multi-hot batch failed to load ran its stand-in's int64 labels
    through a loss.factory for float rows, which raised ValueError ("Target size
    (torch.Size([2])) must be the same as input size") before the step's vote; the other rank
    died in its collective ("Connection closed by peer"), exit 1, no checkpoint of the 2 steps
    trained. Now the stand-in's labels are float rows: the step is voted, step 2 is
    checkpointed, the sample named, exit 2."""
    from test_failures import sample_of

    (tmp_path / "multihot.py").write_text(RAISING_MULTI_HOT)
    bad = sample_of(0, 3, 32)
    args = [
        f"--run.dir={tmp_path / 'run'}",
        "--data.factory=multihot:make",
        f"--data.root={tmp_path}",
        f'--data.kwargs={{"bad": {bad}}}',
        "--data.batch_size=2",
        "--data.num_workers=0",
        "--loss.factory=multihot:multi_label_bce",
        "--log.mfu=false",  # its FLOP probe has its own test above
        "--train.epochs=1",
        "--model.widths=8,16",
        "--log.tensorboard=false",
    ]
    failed = launch(2, *args, env={"PYTHONPATH": str(tmp_path)})
    assert "exitcode: 2" in failed.output, failed.output[-4000:]
    assert f"data.factory=multihot:make: train[{bad}] failed to load" in failed.output
    assert "checkpoint of step 2 written" in failed.output
    assert final_state(tmp_path / "run")["step"] == 2


# ---------------------------------------------------------------------------------------------
# Factories checked at start-up on the targets training passes them

INDEX_ONLY = """
import torch
import torch.nn.functional as F

def nll(*, num_classes):
    return lambda logits, target: F.nll_loss(F.log_softmax(logits, dim=1), target)

def class_counts(*, num_classes):
    return lambda logits, target: {"seen": (torch.bincount(target.clamp_min(0)).sum(), len(target))}
"""


def test_factories_for_index_targets_are_refused_when_batches_are_mixed(tmp_path, monkeypatch):
    """Before: loss.factory and metrics.factory were checked on the eval split's index targets
    only, so a loss that takes indices only (F.nll_loss) passed the check and raised at step 1,
    where mixing passes float rows [N, C]. Now, with mixing on, they are called on one-hot float
    rows of the sampled labels too (the metric also on the indices evaluation passes)."""
    (tmp_path / "index_only.py").write_text(INDEX_ONLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    labels = torch.tensor([0, 3, IGNORED, 1])
    for key, section in [("loss", LossConfig), ("metrics", MetricsConfig)]:
        spec = "index_only:nll" if key == "loss" else "index_only:class_counts"
        plain = Config(**{key: section(factory=spec)})  # type: ignore[arg-type]
        losses.build(plain, 4, labels, CPU)  # accepted without mixing
        mixed = Config(**{key: section(factory=spec)}, aug=AugConfig(cutmix_alpha=1.0))
        with pytest.raises(ConfigError, match=rf"{key}.factory={spec}: .* torch.float32 \(3, 4\)"):
            losses.build(mixed, 4, labels, CPU)


@pytest.mark.e2e
def test_an_index_only_loss_factory_is_exit_2_at_start_up_when_batches_are_mixed(tmp_path):
    (tmp_path / "index_only.py").write_text(INDEX_ONLY)
    args = tiny_job_args(tmp_path / "run", "--loss.factory=index_only:nll", "--aug.mixup_alpha=0.2")
    done = launch(None, *args, env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == exitcodes.EXIT_BAD_INPUT, done.output[-3000:]
    assert "loss.factory=index_only:nll: its loss fails on logits" in done.output
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
