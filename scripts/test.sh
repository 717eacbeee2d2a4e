#!/usr/bin/env bash
# The test command: set up the environment in .venv/ (sglang==0.5.23, the local test models, the libcuda stand-in
# on driverless hosts), then run the whole suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/env.sh
set +e
# no paths given: pyproject's testpaths (tests/); paths given: only those
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  # pytest's "no tests collected": fine for a selection that matches nothing, an error for the whole suite.
  if [ "$#" -gt 0 ]; then echo "[test] no tests matched the selection: $*"; exit 0; fi
  echo "[test] error: the suite collected no tests"; exit 1
fi
exit "$rc"
