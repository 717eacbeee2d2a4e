"""What makes a policy's P99 TTFT in the simulator: the requests at or above 0.9x the P99, by kind.

    python scripts/sim_tail.py --generator agent --rate 100 --duration-s 300 --seed 1 --policies e2,kvrep,free_copies

For session workloads each tail request is a session's first turn, a follow-up whose previous prompt was still
cached where it ran ("history cached"), or a follow-up that found less than its previous prompt cached ("history
partly lost": evicted everywhere, or recomputed elsewhere). Analysis only; the policies never see the sessions.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radix_sync.policy.cost import load_profile  # noqa: E402
from radix_sync.sim.cli import analysis_parser, build_workload, engine_config, planner_config  # noqa: E402
from radix_sync.sim.engine import Engine  # noqa: E402
from radix_sync.sim.policies import build_policy  # noqa: E402


def tail_report(args: argparse.Namespace, name: str) -> str:
    profile = load_profile(args.profile)
    wl = build_workload(args, profile.max_context_len)
    pcfg = planner_config(args.planner, args.endpoint_wait)
    eng = Engine(profile, wl, build_policy(name, profile, wl.page_len, args.seed, pcfg),
                 engine_config(args, args.duration_s))
    done: list[tuple[object, object]] = []
    previous: dict[int, tuple[int, float]] = {}
    record = eng.stats.on_finish

    def on_finish(req) -> None:
        key = id(req.session) if req.session is not None else None
        done.append((req, previous.get(key) if key is not None else None))
        if key is not None:
            previous[key] = (req.prompt_len, req.finish_s)
        record(req)

    eng.stats.on_finish = on_finish
    eng.run()
    ttft = sorted(r.first_token_s - r.arrival_s for r, _ in done)
    p99 = ttft[int(0.99 * len(ttft))]
    tail = [(r, prev) for r, prev in done if r.first_token_s - r.arrival_s >= 0.9 * p99]
    kinds: dict[str, list] = {"first turn or no session": [], "history cached": [], "history partly lost": []}
    for r, prev in tail:
        if prev is None:
            kinds["first turn or no session"].append((r, prev))
        elif r.cached_len >= prev[0] - wl.page_len:
            kinds["history cached"].append((r, prev))
        else:
            kinds["history partly lost"].append((r, prev))
    lines = [f"{name}: {len(done)} requests, TTFT mean {statistics.mean(ttft):.3f} s, P99 {p99:.3f} s; "
             f"{len(tail)} requests >= 0.9 x P99:"]
    for kind, rows in kinds.items():
        if not rows:
            continue
        rs = [r for r, _ in rows]
        line = (f"  {kind:<26} {len(rows):4d}  TTFT {statistics.mean(r.first_token_s - r.arrival_s for r in rs):.3f} s"
                f"  prompt {statistics.mean(r.prompt_len for r in rs):7.0f}  cached {statistics.mean(r.cached_len for r in rs):7.0f}")
        if kind == "history partly lost":
            line += (f"  previous prompt {statistics.mean(p[0] for _, p in rows):7.0f}"
                     f"  gap since it finished {statistics.mean(r.arrival_s - p[1] for r, p in rows):.1f} s")
        lines.append(line)
    by_worker = Counter(r.worker for r, _ in tail)
    lines.append(f"  tail per worker (top 4): {by_worker.most_common(4)}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """`kvrep sim`'s workload and engine flags."""
    return analysis_parser(__doc__.splitlines()[0], "e2,kvrep,free_copies")


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    if args.duration_s is None:
        p.error("--duration-s is needed")
    for name in args.policies.split(","):
        print(tail_report(args, name.strip()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
