"""Checks of the simulator against a saved `kvrep bench` run (docs/bench.md, "The simulator on the testbed as
measured" and "Out of sample"): each prints the numbers quoted there. No cluster is started, except by `cores`
(a matmul loop) and `cpu` (samples /proc while a command runs).

  shapes RUN...              lone requests' measured / `cpu-wide` TTFT by shape (new and cached tokens)
  lone RUN                   lone requests: simulated vs measured TTFT, same request, same cache state
  seeds RUN WORKLOAD A,B N   the simulated A/B TTFT ratio over N workload seeds (mean and P99)
  tpot RUN WORKLOAD ARM      TPOT by how many other requests decode at the same time, live vs simulated
  batches RUN WORKLOAD ARM   the simulator's requests per prefill batch, and running requests at each prefill
  cores [SECONDS]            a bf16 512x1024 @ 1024x4096 matmul loop on core 0 alone, then on both cores at once
  cpu OUT -- COMMAND...      runs COMMAND, sampling every process's CPU time every 5 s; prints CPU by process kind
                             over the span when both SGLang schedulers ran

RUN: a results.json or .json.gz (`bench/results/`). Usage: .venv/bin/python scripts/sim_load_gap.py CHECK ...
"""
from __future__ import annotations

import argparse
import collections
import copy
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from kvrep_dev import bench, calibration  # noqa: E402
from radix_sync.policy.cost import load_profile  # noqa: E402


def load(path: str):
    """Returns: (results, bench args, rows with requests, the run's measured machine)."""
    p = Path(path)
    d = json.loads(gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_text())
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    args = ap.parse_args([])
    for k, v in d["args"].items():
        if k == "trace" and not Path(v).exists():
            v = str(bench.DEFAULT_TRACE)
        if hasattr(args, k):
            setattr(args, k, v)
    rows = [r for r in d["rows"] if r.get("requests")]
    return d, args, rows, bench.measure_machine(rows, d.get("speed"),
                                                overlap=bool(d.get("args", {}).get("overlap_schedule", True)))


def sim(d, args, machine, workload: str, arm: str, seed: int):
    wl = bench.build_workload(workload, args)
    return bench.simulate(copy.deepcopy(wl), arm, args.workers, seed, args.profile, args.max_total_tokens,
                          args.max_running, d.get("speed"), machine=machine,
                          overlap_lag=bool(d.get("args", {}).get("overlap_schedule", True)))


def shapes(paths: list[str]) -> None:
    p = load_profile("cpu-wide")
    pts = [s for path in paths for s in calibration.isolated_requests(load(path)[2])]
    print(f"{len(pts)} lone requests")
    for lo, hi, cached in [(0, 64, True), (64, 512, True), (512, 4096, True), (0, 512, False), (512, 1500, False),
                           (1500, 4096, False)]:
        s = [(n, c, t) for n, c, t in pts if lo <= n < hi and (c > 0) == cached]
        if s:
            print(f"new {lo}-{hi} {'cached' if cached else 'cold':<6} n={len(s):<4} measured/cpu-wide median "
                  f"{statistics.median(t / p.prefill_s(n, c) for n, c, t in s):.2f}")


def lone(path: str) -> None:
    d, args, rows, machine = load(path)
    for r in rows:
        if r.get("repeat", 0) != 0 or r["arm"] != "shadow":
            continue
        s = sim(d, args, machine, r["workload"], "shadow", args.seed)
        twins: dict = {}
        for x in s["requests"]:
            twins.setdefault(x["key"], []).append(x)
        errs: dict = {True: [], False: []}
        for q in calibration._alone([r], "ttft_s"):
            cands = twins.get(q["key"])
            if not cands:
                continue
            x = min(cands, key=lambda x: abs(x["sent_s"] - q["sent_s"]))
            if x["cached_tokens"] == q["cached_tokens"]:
                errs[bool(q["cached_tokens"])].append(x["ttft_s"] / q["ttft_s"] - 1)
        for hit, e in errs.items():
            if e:
                print(f"{r['workload']:<8} lone {'hits' if hit else 'cold':<5} n={len(e):<4} simulated/measured - 1: "
                      f"median {statistics.median(e):+.1%}")


def seeds(path: str, workload: str, arms: str, n: int) -> None:
    d, args, _, machine = load(path)
    a, b = arms.split(",")
    ratios: dict = {"mean": [], "p99": []}
    for seed in range(n):
        args.seed = seed
        ta, tb = (sim(d, args, machine, workload, arm, seed)["ttft_s"] for arm in (a, b))
        for k in ratios:
            ratios[k].append(ta[k] / tb[k])
    for k, v in ratios.items():
        print(f"{workload} {a}/{b} {k} over {n} seeds: median {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]")


def _by_overlap(reqs: list[dict]) -> dict:
    out = collections.defaultdict(list)
    ok = [q for q in reqs if q.get("e2e_s") and q.get("ttft_s") and (q.get("output_tokens") or 0) > 1]
    for q in ok:
        a, b = q["sent_s"] + q["ttft_s"], q["sent_s"] + q["e2e_s"]
        k = sum(1 for o in ok if o is not q and o["sent_s"] < b and o["sent_s"] + o["e2e_s"] > a)
        out[min(k, 6)].append((q["e2e_s"] - q["ttft_s"]) / (q["output_tokens"] - 1))
    return out


def tpot(path: str, workload: str, arm: str) -> None:
    d, args, rows, machine = load(path)
    live: dict = collections.defaultdict(list)
    for r in rows:
        if r["workload"] == workload and r["arm"] == arm:
            for k, v in _by_overlap(r["requests"]).items():
                live[k] += v
    simulated = _by_overlap(sim(d, args, machine, workload, arm, args.seed)["requests"])
    med = lambda v: f"{statistics.median(v) * 1e3:6.1f} ms" if v else "     -"  # noqa: E731
    for k in sorted(set(live) | set(simulated)):
        print(f"{k}{'+' if k == 6 else ' '} others decoding: live n={len(live[k]):<4} TPOT {med(live[k])} | "
              f"simulated n={len(simulated.get(k, [])):<4} {med(simulated.get(k, []))}")


def batches(path: str, workload: str, arm: str) -> None:
    import radix_sync.sim.worker as wm

    d, args, _, machine = load(path)
    sizes, running = collections.Counter(), collections.Counter()
    orig = wm.SimWorker._start

    def start(self, now):
        orig(self, now)
        if self.state == wm.PREFILL:
            sizes[len(self._batch)] += 1
            running[len(self.running)] += 1
    wm.SimWorker._start = start
    try:
        sim(d, args, machine, workload, arm, args.seed)
    finally:
        wm.SimWorker._start = orig
    total = sum(sizes.values())
    print("requests per prefill batch:", ", ".join(f"{k}: {v / total:.0%}" for k, v in sorted(sizes.items())))
    print("running at a prefill:", ", ".join(f"{k}: {v / total:.0%}" for k, v in sorted(running.items())))
    print("(live, from a run's worker logs: grep 'Prefill batch' logs/RUN/logs/worker-*.log, fields #new-seq and "
          "#running-req)")


_CORE = """
import os, sys, time, torch
torch.set_num_threads(1); os.sched_setaffinity(0, {int(sys.argv[1])})
x, w = torch.randn(512, 1024, dtype=torch.bfloat16), torch.randn(1024, 4096, dtype=torch.bfloat16)
t, n = time.perf_counter(), 0
while time.perf_counter() - t < float(sys.argv[2]):
    x @ w; n += 1
print(f"core {sys.argv[1]}: {n / (time.perf_counter() - t):.1f} matmuls/s")
"""


def cores(secs: float) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", _CORE, "0", str(secs)], env=env, check=True)
    print("-- both at once:")
    procs = [subprocess.Popen([sys.executable, "-c", _CORE, str(c), str(secs)], env=env) for c in (0, 1)]
    for p in procs:
        p.wait()


def _kind(comm: str, cmd: str) -> str:
    if comm.startswith("sglang::schedu"):
        return "scheduler"
    if comm.startswith("sglang::detok"):
        return "detokenizer"
    if "sglang.launch_server" in cmd:
        return "server main (HTTP, tokenizer)"
    for key, name in (("cli router", "router"), ("cli coordinator", "coordinator"), ("kvrep bench", "bench client")):
        if key in cmd:
            return name
    return "other"


def _snapshot() -> dict:
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            comm = (p / "comm").read_text().strip()
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[p.name] = (int(fields[11]) + int(fields[12]), _kind(comm, cmd))
    return out


def cpu(out: str, command: list[str]) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    proc = subprocess.Popen(command)
    snaps = []
    while proc.poll() is None:
        snaps.append((time.monotonic(), _snapshot()))
        time.sleep(5)
    both = [(t, s) for t, s in snaps if sum(k == "scheduler" for _, k in s.values()) == 2]
    if len(both) < 2:
        print("fewer than two samples with both schedulers running")
        return
    (t0, a), (t1, b) = both[0], both[-1]
    use = collections.Counter()
    for pid, (ticks, kind) in b.items():
        if pid in a:
            use[kind] += (ticks - a[pid][0]) / tick
    span = t1 - t0
    lines = [f"{k:<32} {v:7.1f} s  {v / span:5.2f} cores" for k, v in use.most_common()]
    lines.append(f"span {span:.0f} s, CPU used {sum(use.values()):.1f} s of {os.cpu_count() * span:.0f}")
    Path(out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    a = sys.argv[1:]
    if not a or a[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    check, rest = a[0], a[1:]
    if check == "shapes":
        shapes(rest)
    elif check == "lone":
        lone(rest[0])
    elif check == "seeds":
        seeds(rest[0], rest[1], rest[2], int(rest[3]))
    elif check == "tpot":
        tpot(rest[0], rest[1], rest[2])
    elif check == "batches":
        batches(rest[0], rest[1], rest[2])
    elif check == "cores":
        cores(float(rest[0]) if rest else 6.0)
    elif check == "cpu":
        cpu(rest[0], rest[rest.index("--") + 1:])
    else:
        print(f"unknown check {check!r}\n{__doc__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
