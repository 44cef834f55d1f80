"""inputs.mixing: mixup, cutmix and random erasing of a training batch, against batches built by
hand and against torchvision's own transforms, and the loss and accuracy of float targets."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torchvision import transforms
from torchvision.transforms import v2

import engine
from config import IGNORED, AugConfig
from inputs import mixing
from inputs.sampling import mix64

NUM_CLASSES = 5


@dataclass
class At:
    epoch: int
    step: int


def batch(n: int = 6, size: tuple[int, int] = (12, 10)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, *size, generator=gen), torch.randint(NUM_CLASSES, (n,), generator=gen)


def onehot(labels: torch.Tensor) -> torch.Tensor:
    return torch.eye(NUM_CLASSES)[labels]


def test_nothing_on_returns_the_batch_itself() -> None:
    images, labels = batch()
    out = mixing.BatchAugment(AugConfig(), 0, 0, NUM_CLASSES)(images, labels, At(0, 0))
    assert out[0] is images and out[1] is labels


def test_mixup_equals_torchvisions_mixup_given_the_same_weight() -> None:
    """torchvision.transforms.v2.MixUp (the reference recipe's) pairs each sample with the
    batch rolled by one (v2/_augment.py, MixUp._transform: `inpt.roll(1, 0)`); its weight is
    drawn from its Beta, which is replaced by ours here so the two draw the same."""
    images, labels = batch()
    mixer = mixing.BatchAugment(AugConfig(mixup_alpha=0.2), 7, 1, NUM_CLASSES)
    mixed, targets = mixer(images, labels, At(2, 30))
    draw = mixer.draw(mixer.key(2, 30, 0), images.shape[-2:])
    assert draw.kind == "mixup" and 0 < draw.lam < 1
    reference = v2.MixUp(alpha=0.2, num_classes=NUM_CLASSES)
    reference._dist = type("Fixed", (), {"sample": lambda self, *a: torch.tensor([draw.lam])})()
    want_images, want_targets = reference(images, labels)
    torch.testing.assert_close(mixed, want_images)
    torch.testing.assert_close(targets, want_targets)


def test_cutmix_equals_a_batch_built_by_hand_from_the_same_box() -> None:
    images, labels = batch()
    mixer = mixing.BatchAugment(AugConfig(cutmix_alpha=1.0), 3, 0, NUM_CLASSES)
    for step in range(20):  # boxes of every shape: clipped at the borders too
        mixed, targets = mixer(images, labels, At(1, step))
        draw = mixer.draw(mixer.key(1, step, 0), images.shape[-2:])
        y1, y2, x1, x2 = draw.box
        want = images.clone()
        for i in range(len(images)):
            partner = (i - 1) % len(images)
            for y in range(y1, y2):
                for x in range(x1, x2):
                    want[i, :, y, x] = images[partner, :, y, x]
        assert torch.equal(mixed, want)
        own = 1 - (y2 - y1) * (x2 - x1) / (12 * 10)  # the box's real area
        assert draw.lam == pytest.approx(own)
        want_targets = own * onehot(labels) + (1 - own) * onehot(labels.roll(1))
        torch.testing.assert_close(targets, want_targets)
        assert torch.allclose(targets.sum(1), torch.ones(len(labels)))


@pytest.mark.parametrize("lam", [0.05, 0.4, 0.9])
def test_cutmix_box_and_weight_equal_torchvisions_cutmix_given_the_same_draws(lam) -> None:
    """torchvision.transforms.v2.CutMix (v2/_augment.py, CutMix._transform): centre
    (torch.randint(W), torch.randint(H)), half-sides int(0.5 * sqrt(1 - lam) * side), clipped,
    the weight corrected by the box's area. Its lam is fixed to ours, its centre read from
    the global generator it draws from; ours gets the same centre."""
    images, labels = batch(6, (21, 17))
    for seed in range(10):
        reference = v2.CutMix(alpha=1.0, num_classes=NUM_CLASSES)
        reference._dist = type("Fixed", (), {"sample": lambda self, *a: torch.tensor([lam])})()
        torch.manual_seed(seed)
        centre_x, centre_y = int(torch.randint(17, (1,))), int(torch.randint(21, (1,)))
        torch.manual_seed(seed)
        want_images, want_targets = reference(images, labels)
        draw = mixing.cutmix_draw(lam, (centre_y, centre_x), (21, 17))
        mixed, targets = mixing.mix(images, labels, NUM_CLASSES, draw)
        assert torch.equal(mixed, want_images)
        torch.testing.assert_close(targets, want_targets)


def test_both_on_pick_each_about_half_the_time_and_every_draw_is_a_pure_function() -> None:
    mixer = mixing.BatchAugment(AugConfig(mixup_alpha=0.2, cutmix_alpha=1.0), 0, 0, NUM_CLASSES)
    kinds = [mixer.draw(mixer.key(0, step, 0), (8, 8)).kind for step in range(400)]
    assert 150 < kinds.count("cutmix") < 250
    again = mixing.BatchAugment(AugConfig(mixup_alpha=0.2, cutmix_alpha=1.0), 0, 0, NUM_CLASSES)
    assert [again.draw(again.key(0, s, 0), (8, 8)) for s in range(400)] == [
        mixer.draw(mixer.key(0, s, 0), (8, 8)) for s in range(400)
    ]
    other_rank = mixing.BatchAugment(AugConfig(mixup_alpha=0.2), 0, 1, NUM_CLASSES)
    assert other_rank.key(0, 0, 0) != mixer.key(0, 0, 0)


def test_each_micro_batch_of_a_step_draws_anew_and_a_resumed_run_draws_the_same() -> None:
    images, labels = batch()
    cfg = AugConfig(mixup_alpha=1.0)
    run = mixing.BatchAugment(cfg, 0, 0, NUM_CLASSES)
    first = [run(images, labels, At(0, s))[1] for s in (4, 4, 5, 5)]  # 2 micro-batches a step
    assert not torch.equal(first[0], first[1])
    resumed = mixing.BatchAugment(cfg, 0, 0, NUM_CLASSES)  # a new process, at step 5
    assert torch.equal(resumed(images, labels, At(0, 5))[1], first[2])
    assert torch.equal(resumed(images, labels, At(0, 5))[1], first[3])


def test_an_ignored_sample_is_counted_nowhere_and_mixed_into_no_other() -> None:
    images, labels = batch()
    labels[2] = IGNORED
    mixer = mixing.BatchAugment(AugConfig(mixup_alpha=1.0), 0, 0, NUM_CLASSES)
    mixed, targets = mixer(images, labels, At(0, 0))
    lam = mixer.draw(mixer.key(0, 0, 0), images.shape[-2:]).lam
    assert torch.equal(targets[2], torch.zeros(NUM_CLASSES))  # its own row: nothing
    assert torch.equal(mixed[3], images[3])  # its partner's: itself, whole
    assert torch.equal(targets[3], onehot(labels[3:4])[0])
    torch.testing.assert_close(mixed[4], lam * images[4] + (1 - lam) * images[3])


def test_a_skipped_sample_leaves_a_mixed_batch_and_only_the_ledger_otherwise() -> None:
    images, labels = batch()
    labels[2] = IGNORED
    indices = torch.arange(len(labels))
    mixing_on = mixing.BatchAugment(AugConfig(mixup_alpha=1.0), 0, 0, NUM_CLASSES)
    kept_images, kept_labels, kept = mixing_on.counted_only(images, labels, indices)
    assert kept.tolist() == [i for i in range(len(labels)) if i != 2]
    assert torch.equal(kept_images, images[kept]) and torch.equal(kept_labels, labels[kept])
    plain = mixing.BatchAugment(AugConfig(), 0, 0, NUM_CLASSES)
    same_images, same_labels, kept = plain.counted_only(images, labels, indices)
    assert same_images is images and same_labels is labels  # the loss leaves IGNORED out
    assert kept.tolist() == [i for i in range(len(labels)) if i != 2]


def test_random_erasing_is_torchvisions_under_the_rows_seed() -> None:
    """Each row equals torchvision's RandomErasing(p, value=0) run with the global generator
    seeded as the row's key says (transforms.py, RandomErasing.forward: the coin, then
    get_params); the global generator is left as it was."""
    images, labels = batch(16, (24, 24))
    mixer = mixing.BatchAugment(AugConfig(random_erase=0.5), 5, 0, NUM_CLASSES)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    erased, same_labels = mixer(images, labels, At(3, 9))
    assert torch.equal(torch.get_rng_state(), before) and same_labels is labels
    key = mixer.key(3, 9, 0)
    reference = transforms.RandomErasing(p=0.5, value=0)
    changed = 0
    for row in range(16):
        torch.manual_seed(mix64(key, 2, row))
        want = reference(images[row].clone())
        assert torch.equal(erased[row], want)
        changed += not torch.equal(want, images[row])
    assert 2 <= changed <= 14


def test_float_targets_train_with_cross_entropy_and_score_against_their_argmax() -> None:
    """engine.forward_backward on float targets: the loss is CrossEntropyLoss's over every row
    (objective/targets.py: a float row always counts), the accuracy counts the argmax of each
    row."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    images = torch.randn(4, 4)
    targets = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.2, 0.8], [0.1, 0.0, 0.9], [0.6, 0.4, 0.0]])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = engine.make_scaler(torch.device("cpu"), None)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    stats = engine.forward_backward(
        model, [(images, targets)], optimizer, scaler, loss_fn, None, 0.0
    )
    logits = model(images).detach()
    rows = [0, 1, 2, 3]
    smoothed = targets[rows] * 0.9 + 0.1 / 3
    want = -(smoothed * logits[rows].log_softmax(1)).sum(1).mean()
    assert stats.loss_sum.item() == pytest.approx(4 * want.item(), rel=1e-5)
    assert stats.labelled.item() == 4
    hits = sum(int(logits[r].argmax() == targets[r].argmax()) for r in rows)
    assert stats.correct.item() == hits


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_multi_hot_rows_are_mixed_as_they_are(kind) -> None:
    """Before: a data.factory's multi-hot float rows raised in one_hot ("one_hot is only
    applicable to index tensor of type LongTensor") at the first mixed step. Now each target
    is lam x its own row + (1 - lam) x the row before it, checked against rows mixed by hand;
    a multi-hot row always counts (objective/targets.py), even an all-zero one."""
    images, _ = batch(4, (4, 4))
    multi = torch.tensor(
        [[1.0, 0, 1, 0, 0], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 1]]
    )  # row 2: no label on, still a sample that counts
    draw = mixing.Draw("mixup", 0.3) if kind == "mixup" else mixing.cutmix_draw(0.5, (2, 2), (4, 4))
    mixed, got = mixing.mix(images, multi, NUM_CLASSES, draw)
    lam = draw.lam
    rows = multi.tolist()  # rows[-1]: the first row's partner is the last (rolled by one)
    hand = [
        [lam * a + (1 - lam) * b for a, b in zip(rows[i], rows[i - 1], strict=True)]
        for i in range(4)
    ]
    torch.testing.assert_close(got, torch.tensor(hand))
    if kind == "mixup":
        torch.testing.assert_close(mixed[0], lam * images[0] + (1 - lam) * images[3])
    mixer = mixing.BatchAugment(AugConfig(cutmix_alpha=1.0), 0, 0, NUM_CLASSES)
    assert mixer(images, multi, At(0, 0))[1].shape == (4, NUM_CLASSES)  # the trainer's path
