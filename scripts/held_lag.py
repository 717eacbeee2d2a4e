"""How long after its copy landed a request held for a copy in flight went (the router's release lag).

For each router decision of a `kvrep bench` results file that was held for a copy in flight (`held_s`, recorded since
stop 51), the copy to the same worker that the coordinator finished last before the request was dispatched, and the
time between the two (both clocks are the host's monotonic clock: one host). Prints per copy origin (`kvrep`: the
planner's; `pull`: a router's pull) the count, median and largest lag, and how many of the held requests found
fewer than 90% of the tokens the router expected there once the copy landed (the most any worker held of the
prompt, `cached_by_worker`) cached (`lost`: the copy was gone when they were admitted); `--json FILE`
writes every held request. Reads results.json or the saved .json.gz.

    .venv/bin/python scripts/held_lag.py logs/held-*/results.json bench/results/bench-agent-slow52-s6.json.gz
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path


def held_requests(results: dict) -> list[dict]:
    """Returns: one record per held decision with a finished copy to its worker: arm, round, copy origin, held_s,
    lag_ms (dispatch - the copy's finish)."""
    out = []
    for row in results["rows"]:
        cached = {q.get("request_id"): q.get("cached_tokens") for q in row.get("requests") or ()}
        for d in row.get("router_decisions") or ():
            if d.get("held_s") is None:
                continue
            port = d["worker"].rsplit(":", 1)[-1]
            done = [c for c in row.get("replications") or () if c.get("finished_s") is not None
                    and c["target"].rsplit(":", 1)[-1] == port and c["finished_s"] <= d["time_s"] + 0.005]
            if done:
                c = max(done, key=lambda c: c["finished_s"])
                out.append({"arm": row["arm"], "round": row.get("repeat", 0), "origin": c["origin"],
                            "held_s": d["held_s"], "lag_ms": round((d["time_s"] - c["finished_s"]) * 1e3, 1),
                            "expected_tokens": max(d.get("cached_by_worker") or [0]),
                            "cached_tokens": cached.get(d.get("request_id"))})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    every = {}
    for f in args.results:
        raw = f.read_bytes()
        held = held_requests(json.loads(gzip.decompress(raw) if f.suffix == ".gz" else raw))
        name = f.parent.name if f.name == "results.json" else f.name.split(".")[0]
        every[name] = held
        line = [f"{name:<22}"]
        for origin in ("kvrep", "pull"):
            hs = [h for h in held if h["origin"] == origin]
            if hs:
                lags = [h["lag_ms"] for h in hs]
                lost = sum(1 for h in hs if h["cached_tokens"] is not None
                           and h["cached_tokens"] < 0.9 * h["expected_tokens"])
                line.append(f"{origin}: {len(hs)} held, lag median {statistics.median(lags):.0f} ms, "
                            f"max {max(lags):.0f}, lost {lost}")
        print("  ".join(line))
    if args.json is not None:
        args.json.write_text(json.dumps(every, indent=1) + "\n")


if __name__ == "__main__":
    main()
