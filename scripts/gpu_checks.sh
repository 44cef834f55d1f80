#!/usr/bin/env bash
# The checks a session runs first when a GPU is lent (the device time is short: a step or two
# per call of the device tool, each under STEP_TIMEOUT_S, 540 s by default):
# the GPU tests, the benchmark on CUDA (its overhead rounds set train.verdict=device against
# host where the run's own verdicts are on the device), the default job to its end with the
# time it first reached 93%, and an NVTX timeline where nsys is installed. Every step's log and
# the summary (exit status and seconds of each) go to OUT; a failed step does not stop the rest.
#   bash scripts/gpu_checks.sh OUT [STEP ...]     STEP: tests benchmark default nsys (all)
# OUT is taken from the repository root when relative.
# Carry data/ (Fashion-MNIST, prepared here by a run of the default job) and wheels/ (tyro,
# docs/running.md "A node without registry access"). PYTHON: the interpreter (python3).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:?usage: scripts/gpu_checks.sh OUT [tests benchmark default nsys]}
shift
steps=${*:-tests benchmark default nsys}
py=${PYTHON:-python3}
limit=${STEP_TIMEOUT_S:-540}
for step in $steps; do
  case $step in
    tests | benchmark | default | nsys) ;;
    *) echo "gpu_checks.sh: unknown step '$step' (tests benchmark default nsys)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"

run_step() {  # NAME COMMAND...: the command's output to OUT/NAME.log, its status to the summary
  local name=$1 started=$SECONDS status
  shift
  timeout --signal=TERM --kill-after=20 "$limit" "$@" >"$out/$name.log" 2>&1
  status=$?  # 124: past STEP_TIMEOUT_S
  echo "$name: exit $status in $((SECONDS - started)) s" | tee -a "$out/summary.txt"
}

if ! "$py" -c "import tyro" 2>/dev/null; then
  "$py" -m pip install --no-index --find-links wheels "tyro>=1.0,<1.1" >"$out/pip.log" 2>&1
fi
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
"$py" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" \
  >>"$out/summary.txt" 2>&1

job=(train.py --config configs/fashion_mnist.toml --log.tensorboard=false)
for step in $steps; do
  case $step in
    tests) run_step tests "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py ;;
    benchmark) run_step benchmark "$py" -m benchmarks --device cuda --out "$out/benchmark.json" ;;
    default)
      run_step default "$py" "${job[@]}" --run.dir="$out/default"
      "$py" - "$out/default/metrics.jsonl" >>"$out/summary.txt" 2>&1 <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
evals = [r for r in rows if r["kind"] == "eval"]
hit = next((r for r in evals if r["accuracy"] >= 0.93), None)
print("default job: final accuracy %.4f at %.1f s; 93%% %s" % (
    evals[-1]["accuracy"], evals[-1]["time_s"],
    f"first at {hit['time_s']:.1f} s (epoch {hit['epoch']})" if hit else "not reached"))
EOF
      ;;
    nsys)
      if command -v nsys >/dev/null; then
        run_step nsys nsys profile --trace=cuda,nvtx --sample=none --force-overwrite=true \
          --output="$out/timeline" "$py" "${job[@]}" --run.dir="$out/nsys" \
          --train.max_steps=200 --log.nvtx=true
      else
        echo "nsys: not installed" | tee -a "$out/summary.txt"
      fi
      ;;
  esac
done
