"""Where the simulator and a saved `kvrep bench` run disagree, request by request: the run's requests re-simulated as
`--resimulate` does (the run's own machine fit), paired by key, and grouped by (a) hit or miss (at least half the
prompt cached live) and whether the other worker was serving a request while this one waited for its first token,
and (b) for trees and sessions (the key's first field), whether a later request ran on the worker of the group's
first request. Per group: live and simulated median TTFT, and the median of the per-request difference.

    .venv/bin/python scripts/live_sim_gap.py bench/results/bench-fanout-ties49-s5.json.gz --arms active,pull
    .venv/bin/python scripts/live_sim_gap.py bench/results/bench-fanout-ties49-s5.json.gz --arms active --frontend
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvrep_dev.bench as b  # noqa: E402


def simulated(data: dict, rows: list[dict], workload: str, arm: str, frontend: bool) -> dict:
    """Returns: the arm's simulated requests by (key, occurrence)."""
    parser = argparse.ArgumentParser()
    b.add_arguments(parser)
    args = parser.parse_args([])
    for k, v in data.get("args", {}).items():
        if hasattr(args, k):
            setattr(args, k, v)
    machine = b.measure_machine(rows, data.get("speed"), b.SIM_MACHINE_FIT,
                                bool(data.get("args", {}).get("overlap_schedule", True)))
    wl = b.build_workload(workload, args)
    sim = b.simulate(copy.deepcopy(wl), arm, args.workers, args.seed, args.profile, args.max_total_tokens,
                     args.max_running, data.get("speed"), None, True, machine,
                     data.get("waiting_reports") != b.WAITING_REPORTS,
                     data.get("prefill_speed") == b.PREFILL_SPEED and arm not in b.FIXED_SPEED_ARMS,
                     data.get("ties") == b.TIES and arm not in b.LOWEST_ID_ARMS, frontend,
                     bool(data.get("args", {}).get("overlap_schedule", True)),
                     data.get("sent_pages") == b.SENT_PAGES and arm not in b.NOSENT_ARMS)
    return b.by_occurrence(sim["requests"])


def groups(rows: list[dict], arm: str, sim: dict) -> tuple[dict, dict]:
    """Returns: ({(hit, other_busy): [(live, sim)]}, {(hit, on_first_worker): [(live, sim)]})."""
    busy: dict = {}
    home: dict = {}
    for r in rows:
        if r["arm"] != arm:
            continue
        where = {d["request_id"]: d["worker"] for d in r.get("router_decisions", [])}
        reqs = [q for q in r["requests"] if not q.get("error") and q.get("request_id") in where]
        spans = [(q["sent_s"], q["sent_s"] + q["e2e_s"], where[q["request_id"]]) for q in reqs]
        key_of = {id(q): kn for kn, q in b.by_occurrence(r["requests"]).items()}
        first: dict = {}
        for q in sorted(reqs, key=lambda q: q["sent_s"]):
            group, w = q["key"].split(":")[0], where[q["request_id"]]
            s = sim.get(key_of.get(id(q)))
            lead = group not in first
            first.setdefault(group, w)
            if s is None:
                continue
            pair = (q["ttft_s"], s["ttft_s"])
            hit = q["cached_tokens"] * 2 >= q["prompt_tokens"] > 0
            t0, t1 = q["sent_s"], q["sent_s"] + q["ttft_s"]
            other = any(a < t1 and z > t0 and v != w for a, z, v in spans)
            busy.setdefault((hit, other), []).append(pair)
            if not lead:
                home.setdefault((hit, w == first[group]), []).append(pair)
    return busy, home


def show(title: str, names: tuple[str, str], cells: dict) -> None:
    print(f"  {title}")
    for (hit, flag), v in sorted(cells.items()):
        live = statistics.median(x for x, _ in v)
        sim = statistics.median(y for _, y in v)
        diff = statistics.median(x - y for x, y in v)
        print(f"    {'hit ' if hit else 'miss'} {names[0] if flag else names[1]:<22} n={len(v):4d}  live "
              f"{live * 1000:5.0f} ms  sim {sim * 1000:5.0f} ms  live - sim {diff * 1000:+5.0f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a saved run (results.json or .json.gz)")
    p.add_argument("--arms", required=True, help="ARM,... of the run")
    p.add_argument("--frontend", action="store_true", help="simulate with --sim-frontend-cpu")
    args = p.parse_args()
    data = b.load_results(Path(args.results))
    rows = [r for r in data["rows"] if r.get("requests")]
    for arm in args.arms.split(","):
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            raise SystemExit(f"no arm {arm!r} in {args.results}")
        sim = simulated(data, rows, mine[0]["workload"], arm, args.frontend)
        busy, home = groups(rows, arm, sim)
        print(f"{mine[0]['workload']} {arm}")
        show("by the other worker's state while waiting for the first token", ("other worker busy", "other idle"),
             busy)
        show("later requests of a tree or session, by worker", ("on the first's worker", "on another worker"), home)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
