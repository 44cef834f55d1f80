"""run.mode=evaluate: score weights on the configured dataset's evaluation split, exactly as a
training run's evaluation does (engine.evaluate: every sample once over all ranks, sums
reduced, the run's evaluation loss and metrics.factory), and write a JSON report:
scoring.report's totals, per-class accuracy and confusion matrix, and what was scored (the
weights, which of them, the data, the world size).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import torch

import data
import distributed
import engine
import scoring
from config import Config
from distributed import DistInfo
from modes import common
from objective import losses

log = logging.getLogger("train")


def run(cfg: Config, info: DistInfo) -> dict[str, Any]:
    splits = data.build_datasets(cfg.data, cfg.train.seed, info)
    weights = common.read_weights(cfg, info)
    where = f"model.weights={weights.path}"
    common.check_classes(weights, splits, where)
    model = common.build_model(cfg, splits, weights, info)
    output = distributed.broadcast_object(common.output_path(cfg, weights, ".json"))
    distributed.run_on_main(
        info, "checking run.output", lambda: common.check_writable(output, "file")
    )
    log.info("evaluating %s (%s weights) on %s", weights.path, weights.which, cfg.data.source)
    result = score(cfg, info, splits, model)
    report = scoring.report(result, weights.classes or splits.classes, weights.step or 0)
    report |= {
        "mode": "evaluate",
        "weights": str(weights.path),
        "weights_used": weights.which,  # ema: the run's weight average, as training evaluated
        "logged_accuracy": weights.eval_accuracy,
        "data": cfg.data.source,
        "data_root": cfg.data.root,
        "world_size": info.world_size,
    }
    text = json.dumps(report, indent=1).encode()
    distributed.run_on_main(
        info, f"writing {output}", lambda: common.write(output, lambda f: f.write(text))
    )
    log.info(
        "evaluated %d samples: top-1 %.4f, top-5 %.4f, loss %.4f; report %s",
        *(result.num_samples, result.accuracy, result.top5, result.loss, output),
    )
    return {
        "step": weights.step or 0,
        "eval_accuracy": result.accuracy,
        "eval_top5": result.top5,
        "eval_num_samples": result.num_samples,
        "output": str(output),
    }


def score(
    cfg: Config, info: DistInfo, splits: data.DataSplits, model: torch.nn.Module
) -> engine.EvalResult:
    """engine.evaluate over this rank's shard of the evaluation split (a collective), with the
    run's objective as training evaluates (its loss and metrics.factory); a sample that fails
    to load fails every rank, naming it (inputs.failures)."""
    objective = losses.build(cfg, splits.num_classes, splits.eval, info.device)
    loader = data.build_eval_loader(splits, cfg.data, info, cfg.train.seed)
    preprocess = data.Preprocess(splits, info.device, channels_last=False)
    failed: list[Exception] = []

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for_error = iter(loader)
        while True:
            try:
                images, labels = next(for_error)
            except StopIteration:
                return
            except Exception as err:  # a bad sample: every rank stops after the reduction
                failed.append(err)
                return
            yield preprocess(images, labels)

    try:
        result = engine.evaluate(
            model,
            batches(),
            info.device,
            None,  # float32: the report does not depend on a device's autocast
            cfg.data.eval_flip,
            splits.input_shape,
            splits.num_classes,
            confusion=True,
            objective=objective,
        )
    finally:
        data.close_loader(loader)
    distributed.raise_if_any_failed(
        info, failed[0] if failed else None, "loading the evaluation set"
    )
    return result
