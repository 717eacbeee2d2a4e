#!/usr/bin/env bash
# The main job: set up the environment (first run: ~5 min, ~11 GB, cached afterwards), then `kvrep demo`: a local
# cluster (coordinator, one CPU SGLang worker per core with the plugin, our router; docs/testbed.md) replays agent sessions (Claude Code traces)
# and a tree-search fan-out twice, with the coordinator in shadow mode (today's routing, no copies) and in active
# mode, and prints a side-by-side table plus a PNG of the TTFT CDFs (logs/demo/). ~5 min on 2 cores.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/env.sh
exec .venv/bin/kvrep demo "$@"
