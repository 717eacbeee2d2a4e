"""Where a policy's TTFT goes, and where it loses to another policy, request by request (simulator analysis).

    python scripts/sim_gap.py --generator agent --rate 100 --duration-s 300 --seed 1 --policies kvrep,free_copies

Per policy: requests by how they were routed (as they were: `plain`; waiting for a planned copy in flight:
`inflight`; pulling the prefix on the request's path: `pull`), with their TTFT and the part of it spent waiting for
the copy; session first turns against follow-ups. Then the first two policies' requests are paired (same request
of the workload, `request_key`) and the first policy's excess TTFT is split into requests that found fewer tokens
cached than under the second policy (history evicted, or recomputed elsewhere) and the rest (copy waits and
queueing), with the largest losses listed. Analysis only; the policies never see any of this.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radix_sync.policy.cost import load_profile  # noqa: E402
from radix_sync.sim.cli import analysis_parser, build_workload, engine_config, planner_config  # noqa: E402
from radix_sync.sim.engine import Engine  # noqa: E402
from radix_sync.sim.policies import build_policy  # noqa: E402
from radix_sync.sim.workload import request_key  # noqa: E402


@dataclass
class Done:
    """One finished request as the analysis sees it."""

    ttft_s: float
    copy_wait_s: float
    route: str
    prompt_len: int
    cached_len: int
    first_turn: bool


def run_policy(args: argparse.Namespace, name: str) -> tuple[dict[str, Done], int]:
    """Runs one policy; returns its finished requests by `request_key`, and the workload's page length."""
    profile = load_profile(args.profile)
    wl = build_workload(args, profile.max_context_len)
    pcfg = planner_config(args.planner, args.endpoint_wait)
    eng = Engine(profile, wl, build_policy(name, profile, wl.page_len, args.seed, pcfg),
                 engine_config(args, args.duration_s))
    routes: dict[int, str] = {}
    execute = eng._execute_route

    def on_route(req, route, now):
        routes[req.rid] = "pull" if route.pull_from is not None else ("inflight" if route.wait_inflight else "plain")
        execute(req, route, now)

    eng._execute_route = on_route
    seen_sessions: set[int] = set()
    out: dict[str, Done] = {}
    record = eng.stats.on_finish

    def on_finish(req):
        s = id(req.session) if req.session is not None else None
        first = s is None or s not in seen_sessions
        if s is not None:
            seen_sessions.add(s)
        out[request_key(req)] = Done(req.first_token_s - req.arrival_s, max(0.0, req.ready_s - req.arrival_s),
                                     routes.get(req.rid, "plain"), req.prompt_len, req.cached_len, first)
        record(req)

    eng.stats.on_finish = on_finish
    eng.run()
    return out, wl.page_len


def policy_report(name: str, done: dict[str, Done]) -> list[str]:
    rows = list(done.values())
    total = sum(d.ttft_s for d in rows)
    lines = [f"{name}: {len(rows)} requests, TTFT mean {total / len(rows):.4f} s (sum {total:.1f} s)"]
    for route in ("plain", "inflight", "pull"):
        rs = [d for d in rows if d.route == route]
        if rs:
            lines.append(f"  routed {route:<9}{len(rs):6d}  TTFT mean {statistics.mean(d.ttft_s for d in rs):.4f} s"
                         f"  copy wait mean {statistics.mean(d.copy_wait_s for d in rs):.4f} s"
                         f" (sum {sum(d.copy_wait_s for d in rs):.1f} s)  prompt {statistics.mean(d.prompt_len for d in rs):.0f}"
                         f"  cached {statistics.mean(d.cached_len for d in rs):.0f}")
    for label, first in (("first turns", True), ("follow-ups", False)):
        rs = [d.ttft_s for d in rows if d.first_turn == first]
        if rs:
            lines.append(f"  {label:<16}{len(rs):6d}  TTFT mean {statistics.mean(rs):.4f} s  sum {sum(rs):.1f} s")
    return lines


def pair_report(a: str, da: dict[str, Done], b: str, db: dict[str, Done], page_len: int, top: int) -> list[str]:
    common = [k for k in da if k in db]
    diff = sorted(((da[k].ttft_s - db[k].ttft_s, k) for k in common), reverse=True)
    lost = [(x, k) for x, k in diff if da[k].cached_len < db[k].cached_len - page_len]
    rest = [(x, k) for x, k in diff if da[k].cached_len >= db[k].cached_len - page_len]
    lines = [f"{a} vs {b}: {len(common)} requests in both; TTFT sum {sum(da[k].ttft_s for k in common):.1f} s vs "
             f"{sum(db[k].ttft_s for k in common):.1f} s",
             f"  fewer tokens cached under {a}: {len(lost):5d} requests, excess {sum(x for x, _ in lost):7.1f} s",
             f"  as many cached:             {len(rest):5d} requests, excess {sum(x for x, _ in rest):7.1f} s "
             f"(of which copy waits {sum(da[k].copy_wait_s for _, k in rest):.1f} s)"]
    for x, k in diff[:top]:
        ra, rb = da[k], db[k]
        lines.append(f"    +{x:.3f} s  {a} {ra.ttft_s:.3f} ({ra.route}, copy wait {ra.copy_wait_s:.3f}) vs {b} "
                     f"{rb.ttft_s:.3f}  prompt {ra.prompt_len}  cached {ra.cached_len} vs {rb.cached_len}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    """`kvrep sim`'s workload and engine flags, and this script's."""
    p = analysis_parser(__doc__.splitlines()[0], "kvrep,free_copies")
    p.add_argument("--top", type=int, default=10, help="largest paired losses to list")
    return p


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    if args.duration_s is None:
        p.error("--duration-s is needed")
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    runs, page_len = {}, 0
    for name in names:
        runs[name], page_len = run_policy(args, name)
        print("\n".join(policy_report(name, runs[name])), flush=True)
    if len(names) >= 2:
        print("\n".join(pair_report(names[0], runs[names[0]], names[1], runs[names[1]], page_len, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
