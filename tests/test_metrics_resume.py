"""metrics.jsonl and TensorBoard after a resume: each step once, time continues."""

from __future__ import annotations

import json
from pathlib import Path

import torch.utils.tensorboard

from metrics import MetricsWriter


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_rows(run_dir: Path, rows: list[dict], tail: str = "") -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows) + tail
    (run_dir / "metrics.jsonl").write_text(text)


ROWS = [
    {"kind": "train", "step": 1, "time_s": 1.0},
    {"kind": "train", "step": 2, "time_s": 2.0},
    {"kind": "eval", "step": 2, "time_s": 2.5},
    {"kind": "train", "step": 3, "time_s": 3.0},
    {"kind": "train", "step": 4, "time_s": 4.0},
]


def test_rows_past_the_checkpoint_are_dropped_and_time_continues(tmp_path) -> None:
    write_rows(tmp_path, ROWS, tail='{"kind": "train", "st')  # torn by a kill mid-write
    writer = MetricsWriter(tmp_path, True, False)
    writer.open(resume_step=2)
    writer.write({"kind": "train", "step": 3, "time_s": writer.time_offset_s + 0.5})
    writer.close()
    assert rows_of(tmp_path / "metrics.jsonl") == [*ROWS[:3], {**ROWS[3], "time_s": 3.0}]
    assert writer.time_offset_s == 2.5


def test_a_pending_evaluation_drops_the_eval_row_of_its_step(tmp_path) -> None:
    """The checkpoint owes step 2's evaluation: an eval row at 2 came from an attempt that
    evaluated and died before saving; the resumed run writes it again."""
    write_rows(tmp_path, ROWS)
    writer = MetricsWriter(tmp_path, True, False)
    writer.open(resume_step=2, pending_eval=True)
    writer.close()
    assert rows_of(tmp_path / "metrics.jsonl") == ROWS[:2]
    assert writer.time_offset_s == 2.0


def test_a_fresh_start_keeps_nothing_and_time_starts_at_zero(tmp_path) -> None:
    write_rows(tmp_path, ROWS)
    writer = MetricsWriter(tmp_path, True, False)
    writer.open(resume_step=0)
    writer.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert writer.time_offset_s == 0.0


def test_tensorboard_purges_events_past_the_checkpoint(tmp_path, monkeypatch) -> None:
    made: list[dict] = []

    class FakeWriter:
        def __init__(self, **kwargs) -> None:
            made.append(kwargs)

        def close(self) -> None:
            pass

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", FakeWriter)
    writer = MetricsWriter(tmp_path, True, True)
    writer.open(resume_step=7)
    writer.close()
    assert made and made[0]["purge_step"] == 8
