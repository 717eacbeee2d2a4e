"""The claim ratios of several `kvrep bench` runs pooled: every run's rounds together, as if one run had made them
(`kvrep_dev.bench.claim_ratios`: each ratio over every round's requests, paired by request within a round, its
bootstrap interval drawing rounds then requests; the median and range of the per-round ratios).

    .venv/bin/python scripts/pool_claims.py bench/results/bench-draws58-s2.json.gz bench/results/bench-draws58-s3.json.gz

Runs of different seeds replay different requests: each round pairs only its own. The runs should share their arms,
workers and model (checked: the arms' names and the worker count).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrep_dev.bench import claim_ratios, format_claims, load_results  # noqa: E402


def pooled_rows(paths: list[str]) -> list[dict]:
    """Returns: the rows of every run, their rounds (`repeat`) numbered on from the run before."""
    rows: list[dict] = []
    workers = set()
    for path in paths:
        data = load_results(Path(path))
        workers.add(data.get("args", {}).get("workers"))
        offset = 1 + max((r.get("repeat", 0) for r in rows), default=-1)
        rows += [{**r, "repeat": r.get("repeat", 0) + offset} for r in data["rows"] if r.get("requests")]
    if len(workers) > 1:
        raise SystemExit(f"the runs had different worker counts: {sorted(map(str, workers))}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json (or .json.gz) of `kvrep bench` runs")
    args = ap.parse_args()
    rows = pooled_rows(args.results)
    print(f"{len(args.results)} runs, {len({r['repeat'] for r in rows})} rounds pooled")
    print(format_claims(claim_ratios(rows)))


if __name__ == "__main__":
    main()
