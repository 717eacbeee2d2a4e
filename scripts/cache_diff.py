"""Where two arms of a saved `kvrep bench` run differ in cache hits: per round, the cached tokens each arm's
requests got (matched by request key), and the requests that lost or gained more than `--min-tokens` in arm B
against arm A, with the TTFT that cost or saved.

    .venv/bin/python scripts/cache_diff.py bench/results/bench-agent-ablation.json.gz pull demote
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys


def load(path: str) -> dict:
    raw = open(path, "rb").read()
    return json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)


def diff(run: dict, arm_a: str, arm_b: str, min_tokens: int = 500) -> list[dict]:
    """One dict per round in which both arms ran."""
    rows = {(r["workload"], r["arm"], r["repeat"]): r for r in run["rows"]}
    out = []
    for (workload, arm, rep), row_a in sorted(rows.items()):
        row_b = rows.get((workload, arm_b, rep))
        if arm != arm_a or row_b is None:
            continue
        a = {q["key"]: q for q in row_a["requests"]}
        b = {q["key"]: q for q in row_b["requests"]}
        both = [k for k in a if k in b]
        delta = [(b[k]["cached_tokens"] - a[k]["cached_tokens"], b[k]["ttft_s"] - a[k]["ttft_s"]) for k in both]
        lost = [d for d in delta if d[0] < -min_tokens]
        gained = [d for d in delta if d[0] > min_tokens]
        out.append({"workload": workload, "round": rep, "requests": len(both),
                    "cached_a": sum(a[k]["cached_tokens"] for k in both),
                    "cached_b": sum(b[k]["cached_tokens"] for k in both),
                    "lost": len(lost), "lost_tokens": -sum(d[0] for d in lost),
                    "lost_ttft_s": round(sum(d[1] for d in lost), 2),
                    "gained": len(gained), "gained_tokens": sum(d[0] for d in gained),
                    "gained_ttft_s": round(sum(d[1] for d in gained), 2)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("arm_a")
    ap.add_argument("arm_b")
    ap.add_argument("--min-tokens", type=int, default=500)
    args = ap.parse_args(argv)
    rounds = diff(load(args.run), args.arm_a, args.arm_b, args.min_tokens)
    if not rounds:
        print(f"no round has both {args.arm_a} and {args.arm_b}")
        return 2
    print(f"{'workload':9} {'round':>5} {'reqs':>5} {'cached ' + args.arm_a:>14} {'cached ' + args.arm_b:>14} "
          f"{'lost':>5} {'tokens':>7} {'TTFT s':>7} {'gained':>6} {'tokens':>7} {'TTFT s':>7}")
    for r in rounds:
        print(f"{r['workload']:9} {r['round']:>5} {r['requests']:>5} {r['cached_a']:>14} {r['cached_b']:>14} "
              f"{r['lost']:>5} {r['lost_tokens']:>7} {r['lost_ttft_s']:>+7.1f} {r['gained']:>6} "
              f"{r['gained_tokens']:>7} {r['gained_ttft_s']:>+7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
