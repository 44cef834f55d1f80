"""Put a checkpoint's pieces back together into one file.

    python scripts/consolidate_checkpoint.py CHECKPOINT --out DIR
    python scripts/consolidate_checkpoint.py CHECKPOINT --weights FILE [--trained]

CHECKPOINT is a sharded checkpoint's folder (run.dir/checkpoints/step_<N>) or a checkpoint
file. It is checked against its manifest (every file's size and CRC-32) and loaded safely
(torch.load weights_only=True: nothing but tensors and plain data is unpickled).

--out DIR writes the whole state as DIR/step_<N>.pt with its manifest: a checkpoint in one
file, which `--ckpt.resume=DIR/step_<N>.pt` continues at any world size and strategy.
--weights FILE writes the state_dict the run evaluated alone (weightfiles.evaluated_weights: the
weight average when train.ema_decay was on, else the model's), which `--model.weights=FILE` and
`torch.load(FILE, weights_only=True)` read; with --trained, the model's as the last step left
it (--ema insists on the average).

Exit 0 on success; 2, naming the file and the reason, for a checkpoint that does not verify
or load, or an output that exists already.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's flat modules

import torch  # noqa: E402

from ckpt import atomic, retention, single, storage  # noqa: E402
from ckpt.atomic import CheckpointError  # noqa: E402
from weightfiles import evaluated_weights  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a step_<N> folder or step_<N>.pt file")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", type=Path, help="directory for step_<N>.pt and its manifest")
    target.add_argument("--weights", type=Path, help="file for the model's state_dict alone")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--ema", action="store_true", help="with --weights: the weight average")
    which.add_argument("--trained", action="store_true", help="with --weights: the model's")
    args = parser.parse_args(argv)
    try:
        state = storage.load(args.checkpoint, torch.device("cpu"))
        step = int(state["step"])
        if args.weights is not None:
            if args.weights.exists():
                raise CheckpointError(f"--weights={args.weights} exists already")
            if args.ema and "ema" not in state:
                raise CheckpointError(
                    f"checkpoint {args.checkpoint} has no weight average (train.ema_decay was "
                    "off): leave --ema out"
                )
            weights = state["model"] if args.trained else evaluated_weights(state)
            what = "the model's" if weights is state["model"] else "the weight average's"
            atomic.write_bytes(args.weights, lambda f: torch.save(weights, f))
            print(f"wrote {args.weights}: {len(weights)} tensors of step {step} ({what})")
            return 0
        written = args.out / f"step_{step}.pt"
        if written.exists() or retention.manifest_path(written).exists():
            raise CheckpointError(f"{written} exists already")
        single.save(state, args.out, step, keep=1_000_000, accuracy=None)
        print(f"wrote {written} and its manifest (step {step})")
        return 0
    except (CheckpointError, OSError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
