"""scoring.py: top-5, per-class accuracy and the confusion matrix, against hand computations.
Exactness across 1, 2 and 3 ranks: test_ddp.py::test_exact_evaluation_for_any_world_size."""

from __future__ import annotations

import json

import pytest
import torch

import engine
import scoring
from config import IGNORED

CPU = torch.device("cpu")


def test_top5_per_class_and_confusion_equal_a_hand_count_and_leave_ignored_samples_out() -> None:
    logits = torch.tensor(
        [
            [9.0, 8, 7, 6, 5, 4, 3],  # label 0: top-1 hit
            [9.0, 8, 7, 6, 5, 4, 3],  # label 4: 5th highest, a top-5 hit only
            [9.0, 8, 7, 6, 5, 4, 3],  # label 5: 6th highest, missed by both
            [0.0, 1, 2, 3, 4, 5, 6],  # label 6: top-1 hit
            [0.0, 1, 2, 3, 4, 5, 6],  # IGNORED: counted nowhere
        ]
    )
    labels = torch.tensor([0, 4, 5, 6, IGNORED])
    counts = scoring.EvalCounts(CPU, num_classes=7, confusion=True)
    counts.add(logits, labels)
    result = counts.reduce()
    assert result.num_samples == 4
    assert result.accuracy == 2 / 4
    assert result.top5 == 3 / 4
    assert result.class_count == (1, 0, 0, 0, 1, 1, 1)
    assert result.class_correct == (1, 0, 0, 0, 0, 0, 1)
    assert result.per_class_accuracy() == [1.0, None, None, None, 0.0, 0.0, 1.0]
    expected = [[0] * 7 for _ in range(7)]
    expected[0][0] = expected[4][0] = expected[5][0] = expected[6][6] = 1
    assert [list(row) for row in result.confusion] == expected


def test_with_fewer_than_five_classes_every_sample_is_a_top5_hit() -> None:
    counts = scoring.EvalCounts(CPU, num_classes=3)
    counts.add(torch.tensor([[0.0, 1, 2], [2.0, 1, 0]]), torch.tensor([0, 1]))
    result = counts.reduce()
    assert (result.accuracy, result.top5) == (0.0, 1.0)
    assert result.confusion == ()  # not asked for


def test_many_classes_count_per_class_but_no_confusion_matrix() -> None:
    classes = scoring.CONFUSION_MAX_CLASSES + 1
    counts = scoring.EvalCounts(CPU, num_classes=classes, confusion=True)
    counts.add(torch.eye(classes)[:3], torch.tensor([0, 1, 5]))
    result = counts.reduce()
    assert result.confusion == ()
    assert sum(result.class_count) == 3 and sum(result.class_correct) == 2


def test_engine_evaluate_reports_top5_and_the_report_names_the_classes() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6, 7))
    images, labels = torch.rand(16, 1, 2, 3), torch.randint(0, 7, (16,))
    result = engine.evaluate(
        model,
        [(images[:9], labels[:9]), (images[9:], labels[9:])],
        CPU,
        None,
        num_classes=7,
        confusion=True,
    )
    with torch.no_grad():
        logits = model(images)
    ranked = logits.argsort(dim=1, descending=True)[:, :5]
    hand = sum(int(label in ranked[i].tolist()) for i, label in enumerate(labels.tolist()))
    assert result.top5 == pytest.approx(hand / 16)
    names = [f"class{c}" for c in range(7)]
    report = json.loads(json.dumps(scoring.report(result, names, step=12)))
    assert report["top1"] == result.accuracy and report["step"] == 12
    assert [row["name"] for row in report["per_class"]] == names
    assert sum(row["count"] for row in report["per_class"]) == 16
    assert sum(map(sum, report["confusion"])) == 16
