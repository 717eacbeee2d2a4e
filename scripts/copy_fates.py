"""What became of each copy of a `kvrep bench` run: used, evicted by SGLang before any use, or left unused, per arm
and origin (`pull` or the planner's policy), with how long after landing the evicted ones went and the used ones
were first asked for.

    .venv/bin/python scripts/copy_fates.py logs/bench-agent-lru-s4 [more out-dirs ...]

Reads the out-dir's `results.json` (each row's `replications` and `router_decisions`) and its workers' logs
(`logs/worker-*.log`: the agent's `kvrep: replica R installed` and `kvrep: replica R (N tokens) evicted by SGLang
S s before its expiry` lines). A copy is "used" when a request was served from it (`promoted_tokens` > 0);
"first asked for" is the first router decision after its landing that sent a request to its target with at least
90% of the copy's tokens cached there by the directory. Nothing is judged; the counts are what the docs cite.
"""
from __future__ import annotations

import collections
import datetime
import json
import re
import sys
from pathlib import Path

INSTALLED = re.compile(r"\[(\S+ \S+)\] kvrep: replica (\S+) installed")
EVICTED = re.compile(r"\[(\S+ \S+)\] kvrep: replica (\S+) \(\d+ tokens\) evicted by SGLang [\d.]+ s before")


def evictions(log_lines) -> dict[str, float]:
    """Returns: replication id -> seconds from its install to SGLang's eviction of it (the agent's log lines)."""
    installed: dict[str, datetime.datetime] = {}
    out: dict[str, float] = {}
    for line in log_lines:
        m = INSTALLED.match(line)
        if m:
            installed[m.group(2)] = datetime.datetime.fromisoformat(m.group(1))
            continue
        m = EVICTED.match(line)
        if m and m.group(2) in installed:
            out[m.group(2)] = (datetime.datetime.fromisoformat(m.group(1)) - installed[m.group(2)]).total_seconds()
    return out


def first_ask_s(copy: dict, decisions: list[dict]) -> float | None:
    """Seconds from the copy's landing to the first decision that sent a request to its target with >= 90% of its
    tokens cached there (None: no such decision)."""
    port = copy["target"].rsplit(":", 1)[-1]
    for d in decisions:
        if d["time_s"] < copy["finished_s"] or not d["worker"].endswith(":" + port):
            continue
        if (d.get("cached_tokens") or 0) >= 0.9 * copy["num_tokens"]:
            return d["time_s"] - copy["finished_s"]
    return None


def fates(results: dict, evicted: dict[str, float]) -> dict:
    """Returns: {(arm, origin): {"used": n, "evicted before use": n, "unused": n, "evicted after s": [...],
    "used, first asked after s": [...]}}."""
    out: dict = collections.defaultdict(lambda: {"used": 0, "evicted before use": 0, "unused": 0,
                                                 "evicted after s": [], "used, first asked after s": []})
    for row in results["rows"]:
        for c in row.get("replications", []):
            f = out[(row["arm"], c["origin"])]
            if c.get("promoted_tokens", 0) > 0:
                f["used"] += 1
                t = first_ask_s(c, row.get("router_decisions", [])) if c.get("finished_s") else None
                if t is not None:
                    f["used, first asked after s"].append(round(t, 1))
            elif c["id"] in evicted:
                f["evicted before use"] += 1
                f["evicted after s"].append(round(evicted[c["id"]]))
            else:
                f["unused"] += 1
    return dict(out)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for d in map(Path, argv):
        results = json.loads((d / "results.json").read_text())
        evicted: dict[str, float] = {}
        for log in sorted((d / "logs").glob("worker-*.log")):
            evicted.update(evictions(log.read_text(errors="replace").splitlines()))
        print(d)
        for (arm, origin), f in sorted(fates(results, evicted).items()):
            print(f"  {arm:<11} {origin:<10} used {f['used']:>3}  evicted before use {f['evicted before use']:>3}"
                  f"  unused {f['unused']:>3}  evicted after s {sorted(f['evicted after s'])}"
                  f"  used, first asked after s {sorted(f['used, first asked after s'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
