"""The coordinator's plan tick alone, in one process: `ClusterState` filled with `bench_coordinator`'s workload
(the same facts, applied through `ClusterState.handle`, no sockets), then the live `kvrep` policy's `decide`
timed `--ticks` times (shadow: nothing is sent, every tick plans the same demand). Prints the tick time, a
digest of the decisions (equal digests: equal decisions, to check that a speed-up changed no decision), and with
`--profile` the top of a cProfile of the ticks; also the ingest rate of `handle` alone (no sockets).

    nice -n 19 .venv/bin/python scripts/bench_plan_tick.py                      # 64 workers x 100,000 prefixes
    nice -n 19 .venv/bin/python scripts/bench_plan_tick.py --workers 1000 --profile
    nice -n 19 .venv/bin/python scripts/bench_plan_tick.py --opcodes      # work per tick, whatever else runs
    nice -n 19 .venv/bin/python scripts/bench_plan_tick.py --pause-s 0.25  # a pause between ticks, as live
    nice -n 19 .venv/bin/python scripts/bench_plan_tick.py --ticks 12 --settle  # + the collector's settle

It also prints the steady ticks apart from the first (which builds what the later ones keep).
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_coordinator import Workload, build_prefixes, demand_messages, interleave  # noqa: E402
from radix_sync import protocol as p  # noqa: E402
from radix_sync.coordinator.live_planner import LIVE_SCORING_BUDGET, LivePlanner  # noqa: E402
from radix_sync.coordinator.policies import LIVE_POLICIES  # noqa: E402
from radix_sync.policy.planner import PlannerConfig  # noqa: E402
from radix_sync.coordinator.state import ClusterState, StateConfig  # noqa: E402
from radix_sync.gc_pacing import GcPacer  # noqa: E402
from radix_sync.policy.rules import RuleConfig  # noqa: E402


class _Offline:
    """`bench_coordinator.SyntheticWorker`'s message planning without a socket."""

    def __init__(self, index: int, wl: Workload) -> None:
        from bench_coordinator import SyntheticWorker

        self._w = SyntheticWorker.__new__(SyntheticWorker)
        self._w.id, self._w.index, self._w.wl, self._w.seq = f"w{index:04d}", index, wl, 0

    def __getattr__(self, name):
        return getattr(self._w, name)


def filled_state(wl: Workload, now: float) -> tuple[ClusterState, float, int]:
    """Returns: (the state after hellos, pages and demand; seconds `handle` took for the pages; pages)."""
    prefixes = build_prefixes(wl)
    workers = [_Offline(i, wl) for i in range(wl.num_workers)]
    st = ClusterState(StateConfig(worker_timeout_s=1e6), coordinator_id="bench")
    rids = [w.id.encode() for w in workers]
    for w, rid in zip(workers, rids):
        st.handle(rid, p.decode_for_coordinator(w.hello()), now)
    chains: list[list] = [[] for _ in workers]
    for pre in prefixes:
        for h in pre.holders:
            chains[h].append(pre)
    ingest = [(i, p.decode_for_coordinator(m)) for i, m in interleave([w.pages(c) for w, c in zip(workers, chains)])]
    t0 = time.perf_counter()
    for i, msg in ingest:
        replies = st.handle(rids[i], msg, now)
        assert not replies, replies
    ingest_s = time.perf_counter() - t0
    demand, _, _ = demand_messages(wl, prefixes, workers)
    for i, data in demand:
        assert not st.handle(rids[i], p.decode_for_coordinator(data), now)
    return st, ingest_s, wl.num_holdings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Workload()
    ap.add_argument("--workers", type=int, default=d.num_workers)
    ap.add_argument("--prefixes", type=int, default=d.num_prefixes)
    ap.add_argument("--page-size", type=int, default=d.page_size)
    ap.add_argument("--pages-per-prefix", type=int, default=d.pages_per_prefix)
    ap.add_argument("--hot", type=int, default=d.num_hot)
    ap.add_argument("--cold-hits", type=int, default=d.cold_hits)
    ap.add_argument("--busy-fraction", type=float, default=d.busy_fraction)
    ap.add_argument("--ticks", type=int, default=3)
    ap.add_argument("--policy", default="kvrep")
    ap.add_argument("--budget", type=int, default=LIVE_SCORING_BUDGET,
                    help="kvrep: the planner's max_scored_per_tick (0: no bound, every candidate scored each tick)")
    ap.add_argument("--pause-s", type=float, default=0.0,
                    help="sleep this long between ticks (the coordinator's period is 0.25 s, with other work in it): "
                         "a tick after a pause finds a colder working set than one run back to back")
    ap.add_argument("--settle", action="store_true",
                    help="after each tick, settle the cycle collector as the coordinator does (`GcPacer(300).settle()`)"
                         " and print how long it took (outside the tick's time)")
    ap.add_argument("--profile", action="store_true", help="cProfile the ticks, print the top 30 by own time")
    ap.add_argument("--opcodes", action="store_true",
                    help="count the Python opcodes each tick executes (a work measure that a loaded machine does not "
                         "change; ~10x slower ticks, their times then mean nothing)")
    args = ap.parse_args()
    wl = Workload(num_workers=args.workers, num_prefixes=args.prefixes, page_size=args.page_size,
                  pages_per_prefix=args.pages_per_prefix, num_hot=args.hot, cold_hits=args.cold_hits,
                  busy_fraction=args.busy_fraction)
    now = 1000.0
    st, ingest_s, num_pages = filled_state(wl, now)
    print(f"handle(): {num_pages / ingest_s:,.0f} pages/s without sockets ({num_pages:,} pages in {ingest_s:.2f}s)")
    if args.policy == "kvrep":
        policy = LivePlanner("cpu-local", cfg=PlannerConfig(endpoint_wait=True, max_scored_per_tick=args.budget))
    else:
        policy = LIVE_POLICIES.create(args.policy, rules=RuleConfig(), profile="cpu-local")
    prof = cProfile.Profile() if args.profile else None
    times, digests, opcodes = [], [], []
    count = [0]

    def on_opcode(frame, event, arg):
        if event == "opcode":
            count[0] += 1
        return on_opcode

    def on_call(frame, event, arg):
        frame.f_trace_opcodes = True
        return on_opcode

    pacer = GcPacer(300.0) if args.settle else None
    for k in range(args.ticks):
        t = now + 0.25 * (k + 1)
        if args.pause_s > 0:
            time.sleep(args.pause_s)
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        if args.opcodes:
            count[0] = 0
            sys.settrace(on_call)
        st.tick(t)
        decisions = policy.decide(st, t)
        if args.opcodes:
            sys.settrace(None)
            opcodes.append(count[0])
        if prof:
            prof.disable()
        times.append(time.perf_counter() - t0)
        # the decisions and what the planner made of every candidate (its reasons counted): equal digests before
        # and after a change to the planner's speed mean it decided the same
        outcomes = sorted(getattr(getattr(policy, "planner", None), "outcomes", {}).items())
        digests.append(hashlib.sha256(repr((decisions, outcomes)).encode()).hexdigest()[:16])
        settled = ""
        if pacer is not None:
            pacer.settle()
            settled = f", settle {1e3 * pacer.young_s:.2f} ms ({pacer.young_freed:,} freed so far)"
        print(f"tick {k}: {1e3 * times[-1]:.1f} ms, {len(decisions)} decisions, digest {digests[-1]}, "
              f"{getattr(policy, 'last_pass', '')}" + (f", {opcodes[-1]:,} opcodes" if args.opcodes else "")
              + settled)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if len(times) > 1:
        # (the first tick builds what the next ones keep: candidate views, per-view plans; the others are the
        # steady state of a coordinator whose demand did not change)
        print(f"steady ticks (1..{len(times) - 1}): {1e3 * min(times[1:]):.1f} ms best, "
              f"{1e3 * sum(times[1:]) / len(times[1:]):.1f} ms mean; first tick {1e3 * times[0]:.1f} ms")
    best = min(times)
    print(f"plan tick: {1e3 * best:.1f} ms best, {1e3 * sum(times) / len(times):.1f} ms mean of {len(times)} "
          + (f"({args.pause_s:g} s between ticks; " if args.pause_s > 0 else "(") + f"{wl.num_workers} workers, {wl.num_prefixes:,} prefixes, {wl.num_hot:,} candidates); "
          f"decisions digest {digests[0]}")


if __name__ == "__main__":
    main()
