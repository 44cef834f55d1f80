"""run.mode=evaluate, predict and export (modes/), end to end through train.py, against
independent references: an evaluation loop written here in plain PyTorch (the checkpoint's
weight average loaded into a freshly built MiniResNet, the evaluation images counted once),
the images behind the files predicted on, `torch.equal` of the exported tensors, and the
accuracy the training run logged, reproduced by docs/modes.md's recipe run as written.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, launch, rows, tiny_job_args, train_command

import data
import weightfiles
from cli import parse_args
from config import ConfigError, DataConfig
from distributed import DistInfo
from inputs.sources import SYNTHETIC_SEED, make_synthetic
from model import MiniResNet
from modes import common, export, predict

# The tiny job (helpers.TINY_JOB) with a weight average, so that the weights a mode must pick
# (the average) differ from the model's own.
EMA = ("--train.ema_decay=0.9", "--train.epochs=3")
EVAL_SIZE, NUM_CLASSES, SHAPE = 64, 10, (1, 28, 28)
MEAN, STD = 0.5, 0.25  # the synthetic source's normalisation (inputs/sources.py, _synthetic)


def job(run: Path, *flags: str) -> list[str]:
    return tiny_job_args(run, *EMA, *flags)


def eval_images() -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic evaluation split: what the tiny job evaluates on."""
    split = make_synthetic(EVAL_SIZE, SHAPE, NUM_CLASSES, SYNTHETIC_SEED + 2)
    return split.images, split.labels


def fresh_model(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    net = MiniResNet(in_channels=1, num_classes=NUM_CLASSES, widths=(4, 8, 8))
    net.load_state_dict(state)
    return net.eval()


def checkpoint(run: Path) -> dict:
    """The newest checkpoint file, read with torch.load alone (no pipeline code)."""
    newest = max((run / "checkpoints").glob("step_*.pt"), key=lambda p: int(p.stem[5:]))
    return torch.load(newest, weights_only=True)


@torch.no_grad()
def independent_evaluation(state: dict[str, torch.Tensor]) -> dict:
    """Loss sum, top-1 and top-5 hits and the confusion matrix, counted one batch at a time."""
    net = fresh_model(state)
    images, labels = eval_images()
    loss, top1, top5 = 0.0, 0, 0
    confusion = [[0] * NUM_CLASSES for _ in range(NUM_CLASSES)]
    for start in range(0, len(images), 10):
        x = (images[start : start + 10].float() / 255 - MEAN) / STD
        y = labels[start : start + 10]
        logits = net(x)
        loss += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        for row, truth in zip(logits, y.tolist(), strict=True):
            ranked = row.argsort(descending=True).tolist()
            top1 += ranked[0] == truth
            top5 += truth in ranked[:5]
            confusion[truth][ranked[0]] += 1
    return {"loss": loss / len(images), "top1": top1, "top5": top5, "confusion": confusion}


def snapshot(run: Path) -> dict[str, str]:
    """sha256 of every file of the run dir but the modes' own folders."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file()
        and p.relative_to(run).parts[0] not in ("evaluations", "predictions", "exports")
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("modes") / "run"
    proc = launch(None, *job(run))
    assert proc.returncode == 0, proc.output
    return run


# -- evaluate --------------------------------------------------------------------------------


def check_report(report: dict, run: Path, world_size: int) -> None:
    ckpt = checkpoint(run)
    expected = independent_evaluation(ckpt["ema"]["weights"])
    assert report["weights_used"] == "ema" and report["world_size"] == world_size
    assert report["num_samples"] == EVAL_SIZE
    assert report["top1"] == expected["top1"] / EVAL_SIZE
    assert report["top5"] == expected["top5"] / EVAL_SIZE
    assert report["confusion"] == expected["confusion"]
    assert report["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    counts = [sum(row) for row in expected["confusion"]]
    assert [c["count"] for c in report["per_class"]] == counts
    # The weight average was scored, not the model's last weights (they score differently).
    trained_weights = independent_evaluation(ckpt["model"])
    assert trained_weights["loss"] != pytest.approx(expected["loss"], rel=1e-5)


@pytest.mark.e2e
def test_evaluate_equals_an_independent_loop_and_leaves_the_run_dir_as_it_was(
    trained: Path,
) -> None:
    before = snapshot(trained)
    for _ in range(2):  # re-running changes nothing either
        proc = launch(None, *job(trained), "--run.mode=evaluate")
        assert proc.returncode == 0, proc.output
    reports = sorted((trained / "evaluations").glob("step_*.json"))
    assert len(reports) == 2
    check_report(json.loads(reports[-1].read_text()), trained, 1)
    assert snapshot(trained) == before


@pytest.mark.e2e
@pytest.mark.parametrize("world_size", [2, 3])
def test_evaluate_at_any_world_size_equals_the_independent_loop(
    trained: Path, tmp_path: Path, world_size: int
) -> None:
    before = snapshot(trained)
    out = tmp_path / "report.json"
    proc = launch(world_size, *job(trained), "--run.mode=evaluate", f"--run.output={out}")
    assert proc.returncode == 0, proc.output
    check_report(json.loads(out.read_text()), trained, world_size)
    assert snapshot(trained) == before


@pytest.mark.e2e
def test_evaluate_reads_a_consolidated_weights_file_as_the_checkpoint(
    trained: Path, tmp_path: Path
) -> None:
    """model.weights = a plain state dict (the EMA's, saved by torch.save): the same counts."""
    weights = tmp_path / "ema.pt"
    torch.save(checkpoint(trained)["ema"]["weights"], weights)
    out = tmp_path / "report.json"
    args = (f"--model.weights={weights}", f"--run.output={out}")
    proc = launch(None, *job(tmp_path / "elsewhere"), "--run.mode=evaluate", *args)
    assert proc.returncode == 0, proc.output
    report = json.loads(out.read_text())
    expected = independent_evaluation(checkpoint(trained)["ema"]["weights"])
    assert report["weights_used"] == "file"
    assert report["top1"] == expected["top1"] / EVAL_SIZE
    assert report["confusion"] == expected["confusion"]
    assert not (tmp_path / "elsewhere").exists()  # no run dir made for a file's evaluation


@pytest.mark.e2e
def test_evaluate_reads_verified_sharded_checkpoints_while_a_job_trains_in_the_run_dir(
    tmp_path: Path,
) -> None:
    """A 2-rank job saving sharded checkpoints every 4 steps (2 kept: older ones pruned while
    evaluate may read them) holds the run dir; evaluate at 2 ranks scores its newest verified
    checkpoint, and the job trains on to its end undisturbed (its lease kept, every evaluation
    of every epoch in its metrics)."""
    run, out = tmp_path / "run", tmp_path / "report.json"
    flags = ("--ckpt.format=sharded", "--ckpt.every_steps=4", "--train.epochs=40")
    training = subprocess.Popen(
        train_command(2, *job(run), *flags),
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not list((run / "checkpoints").glob("step_*.manifest.json")):
            assert training.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.2)
        proc = launch(2, *job(run), "--run.mode=evaluate", f"--run.output={out}")
        assert training.poll() is None, "the job ended before evaluate did: train longer"
        output, _ = training.communicate(timeout=600)
    finally:
        training.kill()
    assert proc.returncode == 0, proc.output
    assert training.returncode == 0, output
    report = json.loads(out.read_text())
    assert Path(report["weights"]).parent == run / "checkpoints"
    assert re.fullmatch(r"step_\d+", Path(report["weights"]).name)  # a sharded one's folder
    assert report["num_samples"] == EVAL_SIZE and report["weights_used"] == "ema"
    assert len(rows(run, "eval")) == 40
    assert not (run / "evaluations").exists()


# -- predict ---------------------------------------------------------------------------------


def image_folder(root: Path) -> dict[str, int]:
    """The first 25 evaluation images as lossless PNG files in nested folders (some with an
    upper-case extension), beside files predict must leave out; relative path -> index."""
    from torchvision.io import write_png

    images, _ = eval_images()
    written = {}
    for index in range(25):
        relative = Path(f"group{index % 3}") / ("deep" if index % 5 == 0 else "") / f"{index:02}"
        path = root / relative.with_suffix(".PNG" if index % 4 == 0 else ".png")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_png(images[index], str(path))
        written[path.relative_to(root).as_posix()] = index
    (root / "notes.txt").write_text("not an image")
    (root / ".hidden.png").write_bytes(b"not read")
    return written


@torch.no_grad()
def independent_predictions(
    run: Path, written: dict[str, int]
) -> dict[str, tuple[int, float, list]]:
    net = fresh_model(checkpoint(run)["ema"]["weights"])
    images, _ = eval_images()
    found = {}
    for relative, index in written.items():
        probabilities = net((images[index : index + 1].float() / 255 - MEAN) / STD).softmax(1)[0]
        top = probabilities.argsort(descending=True)[:5].tolist()
        found[relative] = (top[0], probabilities[top[0]].item(), top)
    return found


def read_predictions(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    return [
        {
            "path": row["path"],
            "label": int(row["label"]),
            "probability": float(row["probability"]),
            "top5": [{"label": int(t.split(":")[0])} for t in row["top5"].split(";")],
        }
        for row in csv.DictReader(io.StringIO(path.read_text()))
    ]


@pytest.mark.e2e
@pytest.mark.parametrize(("world_size", "suffix"), [(None, ".csv"), (2, ".jsonl"), (3, ".csv")])
def test_predict_equals_an_independent_loop_over_the_files(
    trained: Path, tmp_path: Path, world_size: int | None, suffix: str
) -> None:
    written = image_folder(tmp_path / "images")
    out = tmp_path / f"predictions{suffix}"
    args = (
        "--run.mode=predict",
        f"--data.predict_root={tmp_path / 'images'}",
        f"--run.output={out}",
    )
    before = snapshot(trained)
    proc = launch(world_size, *job(trained), *args)
    assert proc.returncode == 0, proc.output
    predicted = read_predictions(out)
    assert [row["path"] for row in predicted] == sorted(written)  # every image, in path order
    expected = independent_predictions(trained, written)
    for row in predicted:
        label, probability, top = expected[row["path"]]
        assert row["label"] == label, row["path"]
        assert row["probability"] == pytest.approx(probability, abs=1e-6), row["path"]
        assert [t["label"] for t in row["top5"]] == top, row["path"]
    assert snapshot(trained) == before


def test_predict_preprocesses_an_image_folders_files_as_its_evaluation_split(
    tmp_path: Path,
) -> None:
    """For data.dataset=imagefolder, each file's view is the evaluation sample's: decoded,
    resized and center-cropped by the split's own code (inputs/imagefolder.py)."""
    from torchvision.io import write_png

    sizes = [(20, 30), (41, 25), (16, 16), (33, 64)]
    for split in ("train", "val"):
        for index, (height, width) in enumerate(sizes):
            folder = tmp_path / split / f"class{index % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            image = torch.randint(0, 256, (3, height, width), dtype=torch.uint8)
            write_png(image, str(folder / f"{index}.png"))
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path), image_size=12, num_workers=0)
    splits = data.build_datasets(cfg, 0, DistInfo(0, 0, 1, torch.device("cpu")))
    view = predict.eval_view(splits)
    for index, (path, _) in enumerate(splits.eval.samples):
        assert torch.equal(view(path), splits.eval[index][0]), path


@pytest.mark.e2e
@pytest.mark.parametrize("bad_images", ["fail", "skip"])
def test_predict_names_an_unreadable_file_and_fails_or_skips_it(
    trained: Path, tmp_path: Path, bad_images: str
) -> None:
    written = image_folder(tmp_path / "images")
    (tmp_path / "images" / "group1" / "broken.png").write_bytes(b"\x89PNG truncated")
    out = tmp_path / "predictions.csv"
    args = (f"--data.predict_root={tmp_path / 'images'}", f"--data.bad_images={bad_images}")
    proc = launch(2, *job(trained), "--run.mode=predict", *args, f"--run.output={out}")
    assert "group1/broken.png" in proc.output
    if bad_images == "fail":
        # torchrun ends with 1 when a worker fails (launcher/api.py raises ChildFailedError),
        # its summary naming the worker's exit code, 2 (exitcodes.EXIT_BAD_INPUT).
        assert proc.returncode == 1 and "exitcode: 2" in proc.output, proc.output
        assert not out.exists()
    else:
        assert proc.returncode == 0, proc.output
        assert [row["path"] for row in read_predictions(out)] == sorted(written)


# -- export ----------------------------------------------------------------------------------


def recipe() -> str:
    """The inference recipe of docs/modes.md, as written there."""
    text = (REPO / "docs" / "modes.md").read_text()
    found = re.search(r"```python\n(# the recipe.*?)```", text, re.S)
    assert found, "docs/modes.md has no ```python block starting '# the recipe'"
    return found.group(1)


@pytest.mark.e2e
def test_export_round_trips_and_the_docs_recipe_reproduces_the_logged_accuracy(
    trained: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "exported"
    before = snapshot(trained)
    proc = launch(2, *job(trained), "--run.mode=export", f"--run.output={folder}")
    assert proc.returncode == 0, proc.output
    average = checkpoint(trained)["ema"]["weights"]
    for read in (
        torch.load(folder / "model.pt", weights_only=True),
        weightfiles.read_safetensors(folder / "model.safetensors"),
    ):
        assert read.keys() == average.keys()
        for key, value in average.items():
            assert torch.equal(read[key], value) and read[key].dtype == value.dtype, key
    spec = json.loads((folder / "model.json").read_text())
    assert spec["weights_used"] == "ema" and spec["input_shape"] == list(SHAPE)
    # The recipe, run as written, on the evaluation images: the accuracy the run logged.
    images, labels = eval_images()
    scope = {"folder": folder, "images": images}
    exec(recipe(), scope)  # the documentation's own lines (model.build checks a backward pass)
    accuracy = (scope["predicted"] == labels).float().mean().item()
    assert accuracy == rows(trained, "eval")[-1]["accuracy"]
    assert snapshot(trained) == before


def test_the_safetensors_writer_round_trips_every_dtype(tmp_path: Path) -> None:
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).bfloat16(),
        "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(7),
        "u8": torch.arange(9, dtype=torch.uint8).view(3, 3),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "strided": torch.arange(12.0).view(3, 4).t(),  # not contiguous
    }
    path = tmp_path / "t.safetensors"
    with path.open("wb") as file:
        export.write_safetensors(file, tensors)
    raw = path.read_bytes()
    header_length = int.from_bytes(raw[:8], "little")
    assert header_length % 8 == 0  # the format pads the header to 8 bytes
    read = weightfiles.read_safetensors(path)
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name


def test_the_safetensors_file_reads_with_the_safetensors_package(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {"w": torch.randn(4, 3), "b": torch.arange(3), "h": torch.randn(2).bfloat16()}
    path = tmp_path / "t.safetensors"
    with path.open("wb") as file:
        export.write_safetensors(file, tensors)
    read = safetensors_torch.load_file(str(path))
    for name, tensor in tensors.items():
        assert torch.equal(read[name], tensor), name


# -- bad input -------------------------------------------------------------------------------


def test_predict_finds_images_at_any_depth_and_refuses_an_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("a/b/x.JPG", "a/y.png", "z.webp", "a/.hidden.png", "a/readme.md"):
        (tmp_path / name).write_bytes(b"")
    found = [Path(p).relative_to(tmp_path).as_posix() for p in predict.find_images(tmp_path)]
    assert found == ["a/b/x.JPG", "a/y.png", "z.webp"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"data.predict_root=.*empty holds no images"):
        predict.find_images(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"data.predict_root=.*missing: no such folder"):
        predict.find_images(tmp_path / "missing")


def test_a_checkpoint_of_other_classes_than_the_datas_is_refused(tmp_path: Path) -> None:
    """The same number of classes in another order would score every label as another class."""
    splits = data.DataSplits(None, None, SHAPE, 2, (0.5,), (0.25,), ("cat", "dog"))  # type: ignore[arg-type]
    same = common.Weights(tmp_path / "w.pt", {}, "ema", 3, ["cat", "dog"])
    common.check_classes(same, splits, "model.weights=w.pt")
    unnamed = common.Weights(tmp_path / "w.pt", {}, "file")
    common.check_classes(unnamed, splits, "model.weights=w.pt")  # a weights file names none
    swapped = common.Weights(tmp_path / "w.pt", {}, "ema", 3, ["dog", "cat"])
    with pytest.raises(ConfigError, match=r"model.weights=w.pt was trained on the classes"):
        common.check_classes(swapped, splits, "model.weights=w.pt")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--run.mode=predict"], "run.mode=predict with data.predict_root=''"),
        (["--data.predict_root=photos"], "run.mode=train with data.predict_root='photos'"),
        (["--run.output=report.json"], "run.output=report.json is for run.mode=evaluate"),
        (["--run.mode=score"], "run.mode"),
    ],
)
def test_mode_settings_are_refused_where_the_mode_does_not_read_them(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises((ConfigError, SystemExit)) as refused:
        parse_args(argv)
    said = str(refused.value) + capsys.readouterr().err
    assert named in said, said


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("garbage_weights", "cannot be loaded"),
        ("wrong_class_count", "misshapen: head.weight (10, 8) (the model's: (5, 8))"),
        ("empty_predict_folder", "holds no images"),
        ("output_under_a_file", "is not a folder this process can write in"),
        ("output_over_metrics", "outside its evaluations/, predictions/ and exports/"),
        ("no_checkpoint", "holds no verified checkpoint"),
        ("predict_output_extension", "give a file ending in .csv or .jsonl"),
    ],
)
def test_bad_input_exits_2_naming_it_and_changes_nothing(
    trained: Path, tmp_path: Path, case: str, named: str
) -> None:
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    (tmp_path / "empty").mkdir()
    (tmp_path / "images").mkdir()
    image_folder(tmp_path / "images")
    run = trained
    args = {
        "garbage_weights": ("--run.mode=evaluate", f"--model.weights={garbage}"),
        "wrong_class_count": ("--run.mode=evaluate", "--data.synthetic_num_classes=5"),
        "empty_predict_folder": ("--run.mode=predict", f"--data.predict_root={tmp_path / 'empty'}"),
        "output_under_a_file": ("--run.mode=evaluate", f"--run.output={garbage}/report.json"),
        "output_over_metrics": ("--run.mode=evaluate", f"--run.output={trained}/metrics.jsonl"),
        "no_checkpoint": ("--run.mode=export",),
        "predict_output_extension": (
            "--run.mode=predict",
            f"--data.predict_root={tmp_path / 'images'}",
            f"--run.output={tmp_path / 'out.txt'}",
        ),
    }[case]
    if case == "no_checkpoint":
        run = tmp_path / "fresh"
    before, outside = snapshot(trained), sorted(tmp_path.rglob("*"))
    proc = launch(None, *job(run), *args)
    assert proc.returncode == 2, proc.output
    assert named in proc.output, proc.output
    assert snapshot(trained) == before and sorted(tmp_path.rglob("*")) == outside


@pytest.mark.e2e
def test_evaluate_reports_the_runs_loss_and_metric_as_training_logged_them(tmp_path) -> None:
    """Before: run.mode=evaluate scored every run with cross-entropy and dropped
    metrics.factory: a focal run's report said loss 1.034 (cross-entropy) where the run logged
    0.519 for the same weights, and had no f1. Now the report's loss and f1 equal the training
    run's last eval row (the same checkpoint: no weight average, the last step's weights)."""
    run = tmp_path / "run"
    flags = ("--loss.name=focal", "--metrics.factory=examples.custom_objective:f1_counts")
    proc = launch(None, *tiny_job_args(run, *flags))
    assert proc.returncode == 0, proc.output[-3000:]
    logged = rows(run, "eval")[-1]
    out = tmp_path / "report.json"
    proc = launch(None, *tiny_job_args(run, *flags), "--run.mode=evaluate", f"--run.output={out}")
    assert proc.returncode == 0, proc.output[-3000:]
    report = json.loads(out.read_text())
    assert report["step"] == logged["step"] and report["top1"] == logged["accuracy"]
    assert report["loss"] == pytest.approx(logged["loss"], rel=1e-6)
    assert report["f1"] == pytest.approx(logged["f1"], rel=1e-12)
