"""The objective (objective/): losses against hand formulas and torch's own, auxiliary
classifiers, top-5 in training, the metric factory against a hand count at 1, 2 and 3 ranks,
and real runs with each loss (e2e)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine
import model as models
from config import IGNORED, Config, LossConfig, ModelConfig
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


def objective_of(**loss: object) -> losses.Objective:
    cfg = Config(loss=LossConfig(**loss))  # type: ignore[arg-type]
    return losses.build(cfg, 4, INDEX, CPU)


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
