"""Where our router put a saved `kvrep bench` run's requests, per arm (every round pooled): the share on the first
worker (by URL order); of the prompts no worker held, the share on the first worker and how many were exact ties (the
same expected TTFT everywhere); the requests sent away from a worker holding at least twice the prompt's cached
prefix; and the median TTFT of the warm requests (at least half the prompt cached) for every arm, smg's included.

    .venv/bin/python scripts/placement.py bench/results/bench-agent-ties49-s3.json.gz
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics


def load(path: str) -> dict:
    raw = open(path, "rb").read()
    return json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)


def placement(run: dict) -> dict[str, dict]:
    """Per arm: requests, decisions, on_first (share), cold (prompts no worker held), cold_on_first (share), ties
    (of the cold ones, exact), sent_away, warm_median_s (None where no warm request)."""
    out: dict[str, dict] = {}
    for r in run["rows"]:
        a = out.setdefault(r["arm"], {"requests": 0, "decisions": 0, "first": 0, "sent_away": 0, "warm": [],
                                     "cold": 0, "cold_first": 0, "ties": 0})
        a["requests"] += len(r["requests"])
        a["warm"] += [q["ttft_s"] for q in r["requests"]
                      if not q.get("error") and q["prompt_tokens"] and q["cached_tokens"] * 2 >= q["prompt_tokens"]]
        dec = r.get("router_decisions") or []
        workers = sorted({d["worker"] for d in dec})
        for d in dec:
            cached = d["cached_by_worker"]  # in the ranking's order: [0] is the chosen worker
            a["decisions"] += 1
            a["first"] += d["worker"] == workers[0]
            a["sent_away"] += bool(cached) and max(cached) > 0 and cached[0] * 2 < max(cached)
            if cached and max(cached) == 0:
                a["cold"] += 1
                a["cold_first"] += d["worker"] == workers[0]
                a["ties"] += len(set(d["expected_ttft_s"])) == 1
    for a in out.values():
        a["on_first"] = a.pop("first") / a["decisions"] if a["decisions"] else None
        a["cold_on_first"] = a.pop("cold_first") / a["cold"] if a["cold"] else None
        warm = a.pop("warm")
        a["warm_median_s"] = statistics.median(warm) if warm else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a results.json(.gz) of kvrep bench")
    args = p.parse_args()
    print(f"{'arm':14s} {'requests':>8s} {'on worker 0':>11s} {'no holder':>9s} {'of them on 0':>12s} "
          f"{'exact ties':>10s} {'sent away':>9s} {'warm median s':>13s}")
    for arm, a in placement(load(args.results)).items():
        first = f"{a['on_first']:.0%}" if a["on_first"] is not None else "-"
        away = f"{a['sent_away']}" if a["decisions"] else "-"
        warm = f"{a['warm_median_s']:.3f}" if a["warm_median_s"] is not None else "-"
        cold = f"{a['cold_on_first']:.0%}" if a["cold_on_first"] is not None else "-"
        ties = f"{a['ties']}" if a["decisions"] else "-"
        print(f"{arm:14s} {a['requests']:8d} {first:>11s} {a['cold'] if a['decisions'] else '-':>9} {cold:>12s} "
              f"{ties:>10s} {away:>9s} {warm:>13s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
