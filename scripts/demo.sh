#!/usr/bin/env bash
# The main job: set up the environment (first run: ~5 min, ~11 GB, cached afterwards), then `kvrep demo`: a local
# cluster (coordinator, one CPU SGLang worker per core with the plugin; docs/testbed.md) replays agent sessions
# (Claude Code traces) and a tree-search fan-out through four arms on the same workers: our router with the
# coordinator in shadow mode (routing alone, no copies), `pull` (copies on the request's path only), `active`
# (predictive + reactive copies) and smg 1.13 `cache_aware` (today's SGLang router, its defaults). It prints a
# table with bootstrap CIs, the ratios active/shadow, active/pull, active/smg-ca, and a PNG of the TTFT CDFs
# (logs/demo/). Under 10 min on 2 cores.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/env.sh
exec .venv/bin/kvrep demo "$@"
