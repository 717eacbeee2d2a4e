"""What the cycle collector costs on the page indexes a fleet keeps in Python: the coordinator's exact directory
(`bench_plan_tick.filled_state`: 64 workers x 100,000 prefixes, 400,000 page holdings), a router's mirror of it
(`DirectoryReplica`, from a snapshot of 200,000 pages with 2 holders each of 64 workers) and a page tree
(`PageTree`: a router's approximate view of one worker, the simulator's cache of one; 3,200 prompts of 64 pages).
Prints, for each: the objects the collector tracks, a full collection's time (best of 3) and memory per page
(tracemalloc); for the mirror also the time to apply 100,000 feed changes and to match 2,000 prompts of 64 pages,
for the tree the time to insert its prompts and to evict half of it.

A full collection stops every thread of the process (the coordinator's loop and admin API, a router's event
loop): its time is a pause that grows with the directory. Nothing here asserts a speed; results: docs/router.md
("The directory mirror") and docs/coordinator-scale.md ("Pages as bytes").

    .venv/bin/python scripts/bench_directory_gc.py [--only coordinator|mirror|tree] [--mirror-pages N]
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from radix_sync.router.directory_replica import DirectoryReplica  # noqa: E402


def full_collect_ms(repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def coordinator() -> None:
    from bench_coordinator import Workload
    from bench_plan_tick import filled_state

    tracemalloc.start()
    st, _, holdings = filled_state(Workload(), 1000.0)
    mem, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    gc.collect()
    print(f"coordinator directory: {holdings:,} page holdings, {st.directory.num_pages():,} pages; "
          f"{len(gc.get_objects()):,} objects tracked; full collection {full_collect_ms():.1f} ms; "
          f"{mem / holdings:.0f} B per holding (state and demand included)")
    del st


def mirror(num_pages: int = 200_000, num_workers: int = 64) -> None:
    rng = random.Random(0)
    workers = [f"http://10.0.0.{i}:30000" for i in range(num_workers)]
    snapshot: dict[str, list[int]] = {w: [] for w in workers}
    pages = [rng.getrandbits(63) for _ in range(num_pages)]
    for h in pages:
        for w in rng.sample(workers, 2):
            snapshot[w].append(h)
    base = len(gc.get_objects())
    tracemalloc.start()
    r = DirectoryReplica()
    r.apply({"epoch": "e", "seq": 1, "snapshot": snapshot})
    mem, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del snapshot
    gc.collect()
    changes = [[1, rng.choice(workers), rng.choice(pages)] for _ in range(50_000)]
    changes += [[-1, rng.choice(workers), rng.choice(pages)] for _ in range(50_000)]
    t0 = time.perf_counter()
    r.apply({"epoch": "e", "seq": 2, "changes": changes})
    apply_ms = 1e3 * (time.perf_counter() - t0)
    prompts = [pages[i:i + 64] for i in range(0, 64 * 2000, 64)]
    t0 = time.perf_counter()
    for q in prompts:
        r.match(q)
    match_ms = 1e3 * (time.perf_counter() - t0)
    del changes, prompts
    gc.collect()
    print(f"router mirror: {num_pages:,} pages x 2 holders of {num_workers} workers; "
          f"{max(0, len(gc.get_objects()) - base):,} more objects tracked; full collection {full_collect_ms():.1f} ms; "
          f"{mem / num_pages:.0f} B per page; 100,000 changes applied in {apply_ms:.1f} ms; "
          f"2,000 64-page prompts matched in {match_ms:.1f} ms")


def tree(num_prompts: int = 3200, pages_per_prompt: int = 64) -> None:
    from radix_sync.policy.pagetree import PageTree

    rng = random.Random(0)
    prompts = [[rng.getrandbits(50) * 1000 + j for j in range(pages_per_prompt)] for _ in range(num_prompts)]
    base = len(gc.get_objects())
    tracemalloc.start()
    t = PageTree()
    t0 = time.perf_counter()
    for i, q in enumerate(prompts):
        t.insert(q, len(q), float(i))
    insert_ms = 1e3 * (time.perf_counter() - t0)
    mem, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    gc.collect()
    tracked = max(0, len(gc.get_objects()) - base - len(prompts))
    collect_ms = full_collect_ms()
    t0 = time.perf_counter()
    t.evict(len(t) // 2)
    evict_ms = 1e3 * (time.perf_counter() - t0)
    print(f"page tree: {len(prompts) * pages_per_prompt:,} pages; {tracked:,} more objects tracked; full collection "
          f"{collect_ms:.1f} ms; {mem / (len(prompts) * pages_per_prompt):.0f} B per page; inserted in "
          f"{insert_ms:.0f} ms; half evicted in {evict_ms:.0f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("coordinator", "mirror", "tree"))
    ap.add_argument("--mirror-pages", type=int, default=200_000)
    args = ap.parse_args()
    print(f"command: {' '.join(sys.argv)}")
    if args.only in (None, "mirror"):
        mirror(args.mirror_pages)
    if args.only in (None, "tree"):
        tree()
    if args.only in (None, "coordinator"):
        coordinator()
    return 0


if __name__ == "__main__":
    sys.exit(main())
