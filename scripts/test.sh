#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit, multi-process (gloo) and end-to-end.
#   scripts/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --group ray  # the tests run scripts/ray_train.py too
set +e
.venv/bin/python -m pytest "$@"
status=$?
set -e
if [[ $status -eq 5 ]]; then
  echo "test.sh: pytest collected no tests: failing instead of passing silently" >&2
  exit 1
fi
exit $status
