"""Many routers, one directory, in the simulator (issue 20 item 4): each policy behind N front doors against one, per
seed on the same workload, the k-th request through door k mod N (`PolicyBundle.doors`).

    .venv/bin/python scripts/front_doors.py --seeds 1,2,3,4,5,6,7,8 --doors 1,4,8 --out logs/front-doors.json
    .venv/bin/python scripts/front_doors.py --quick        # a smoke run: one small workload, two seeds, seconds

Prints, per workload, policy and N: the prefix hit rate (cached prompt tokens / prompt tokens), its ratio to one
door's on the same seed (mean over the seeds, 95% CI: Student's t over the per-seed ratios), and the TTFT mean and
P99 ratios likewise. Our routers (`kvrep_route`, `kvrep`) share the directory and the workers' load reports (the
coordinator's feed) and each knows only its own requests in flight; smg's gateways (`cache_aware`) share nothing:
each door keeps its own approximate tree and polls the workers' loads itself.

Pure CPU, sequential; run it with `nice -n 10`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radix_sync.policy.cost import load_profile  # noqa: E402
from radix_sync.sim.cli import add_engine_arguments, add_workload_arguments, build_workload  # noqa: E402
from radix_sync.sim.cli import engine_config  # noqa: E402
from radix_sync.sim.engine import Engine  # noqa: E402
from radix_sync.sim.policies import build_policy  # noqa: E402
from radix_sync.sim.seeds import mean_ci  # noqa: E402

WORKLOADS = {
    "agent": ["--generator", "agent", "--rate", "100", "--duration-s", "300"],
    "shared": ["--generator", "shared-prefix", "--rate", "100", "--duration-s", "300"],
    "fanout": ["--generator", "fanout", "--fanout-k", "32", "--rate", "40", "--duration-s", "300"],
}
"""Each workload's `kvrep sim` flags (16 workers, `llama3.1-8b-h200`: the simulator's defaults)."""
QUICK = {"agent": ["--generator", "agent", "--rate", "20", "--duration-s", "60", "--workers", "4"]}


def run_one(flags: list[str], seed: int, policy: str, doors: int) -> dict:
    """One simulated run; returns its hit rate, TTFT mean and P99 and request count."""
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    args = parser.parse_args([*flags, "--seed", str(seed)])
    profile = load_profile(args.profile)
    wl = build_workload(args, profile.max_context_len)
    policy_obj = build_policy(policy, profile, wl.page_len, seed, front_doors=doors)
    eng = Engine(profile, wl, policy_obj, engine_config(args, args.duration_s))
    r = eng.run().to_dict()
    out = {"hit": r["prefix_hit_rate"], "mean": r["ttft_s"]["mean"], "p99": r["ttft_s"]["p99"],
           "requests": r["num_requests"]}
    if eng.ledger is not None:  # (`--engine "--ledger-holdout F"`: the copy ledger's verdict at the run's end)
        out["ledger"] = eng.ledger.status(eng.now)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"from {', '.join(WORKLOADS)}")
    ap.add_argument("--policies", default="kvrep_route,kvrep,cache_aware")
    ap.add_argument("--doors", default="1,4,8", help="front-door counts; the first is the reference (1)")
    ap.add_argument("--seeds", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--engine", default="", metavar="FLAGS",
                    help="more `kvrep sim` engine flags for every run, e.g. '--view-staleness-s 0'")
    ap.add_argument("--out", help="write every run and the summary here (JSON)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one small workload, two seeds")
    a = ap.parse_args(argv)
    table = QUICK if a.quick else {k: WORKLOADS[k] for k in a.workloads.split(",")}
    table = {k: [*v, *a.engine.split()] for k, v in table.items()}
    seeds = [1, 2] if a.quick else [int(s) for s in a.seeds.split(",")]
    doors = [int(n) for n in a.doors.split(",")]
    if doors[0] != 1 or any(n < 1 for n in doors):
        ap.error("--doors must start with 1 (the reference) and be >= 1")
    policies = a.policies.split(",")
    runs: dict = {}
    t0 = time.perf_counter()
    for wl in table:
        for pol in policies:
            for n in doors:
                for s in seeds:
                    runs[(wl, pol, n, s)] = run_one(table[wl], s, pol, n)
            print(f"  ({wl} {pol}: {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    summary = []
    print(f"{len(seeds)} seeds; ratio = N doors / 1 door on the same seed, mean [95% CI, t over seeds]")
    print(f"{'workload':<8} {'policy':<12} {'N':>2} {'reqs':>6} {'hit%':>6} {'hit N/1':>22} {'TTFT mean N/1':>22} "
          f"{'P99 N/1':>22}")
    for wl in table:
        for pol in policies:
            for n in doors:
                cell = [runs[(wl, pol, n, s)] for s in seeds]
                one = [runs[(wl, pol, 1, s)] for s in seeds]
                row = {"workload": wl, "policy": pol, "doors": n,
                       "requests": sum(c["requests"] for c in cell) / len(cell),
                       "hit": mean_ci([c["hit"] for c in cell])}
                for key in ("hit", "mean", "p99"):
                    row[f"{key}_ratio"] = mean_ci([c[key] / o[key] for c, o in zip(cell, one)])
                summary.append(row)
                fmt = [f"{r['mean']:.3f} [{r['mean'] - r['ci95']:.3f}-{r['mean'] + r['ci95']:.3f}]"
                       for r in (row["hit_ratio"], row["mean_ratio"], row["p99_ratio"])]
                print(f"{wl:<8} {pol:<12} {n:>2} {row['requests']:>6.0f} {100 * row['hit']['mean']:>6.1f} "
                      f"{fmt[0]:>22} {fmt[1]:>22} {fmt[2]:>22}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"seeds": seeds, "workloads": {k: table[k] for k in table},
                                           "runs": [{"workload": k[0], "policy": k[1], "doors": k[2], "seed": k[3],
                                                     **v} for k, v in runs.items()],
                                           "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
