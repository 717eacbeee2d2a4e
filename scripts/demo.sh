#!/usr/bin/env bash
# The main job: set up the environment (first run: ~5 min, ~11 GB, cached afterwards), then start a local cluster
# (coordinator + two CPU SGLang workers with the plugin) and replicate prefixes with a printed report.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/env.sh
exec .venv/bin/kvrep demo "$@"
