"""Sweeps of the simulator in one command: a markdown table, a JSON file and a PNG per sweep (issue 16, item 6).

    .venv/bin/python scripts/sweep.py --sweeps link,load,size,staleness,jitter,cost-error --out-dir docs/results
    .venv/bin/python scripts/sweep.py --quick            # smoke test: two tiny cells, two seeds, a few seconds
    .venv/bin/python scripts/sweep.py --render docs/results/fanout-link.json   # the markdown again from the JSON

Each cell runs every policy once per seed on the same workload (the workload depends on the seed only) and reports
mean and 95% CI (Student's t) of TTFT mean, P50 and P99. The "never worse" column checks issue 16's rule,
kvrep <= 1.02 x min(kvrep_pull, kvrep_pull_demote), per metric (`never_worse`).

Sweeps (one axis each; everything else as the flags say):
- `link`: --nic-gbytes-s in {3, 6, 12, 24, 50}
- `load`: --rate in --load-rates (default 20, 30, 40, 50; fan-out K=32's best faithful baseline, `pull`, saturates
  between 100 and 150: `--load-rates 60,80,100` and `150,200`, docs/simulator.md)
- `size`: --workers in {4, 8, 16, 64}, the rate scaled with the cluster (same load per worker)
- `staleness`: view staleness {0, 0.2 s}
- `jitter`: hint jitter {0, 0.25, 0.5}
- `cost-error`: the policies' cost model's compute terms x {0.7, 1.0, 1.3} (the simulated truth stays the profile)

Pure CPU, sequential; run it with `nice -n 10`. Durations and sizes are flags so a sweep fits a time budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radix_sync.policy.cost import load_profile  # noqa: E402
from radix_sync.sim.config import EngineConfig  # noqa: E402
from radix_sync.sim.engine import Engine  # noqa: E402
from radix_sync.sim.generators import GENERATORS, GeneratorConfig  # noqa: E402
from radix_sync.sim.policies import POLICIES, build_policy  # noqa: E402
from radix_sync.sim.seeds import mean_ci  # noqa: E402
from radix_sync.sim.workload import load_trace  # noqa: E402

DEFAULT_POLICIES = "pull,cache_aware,precise,kvrep_route,kvrep_pull,kvrep_pull_demote,kvrep"
SWEEPS = ("link", "load", "size", "staleness", "jitter", "cost-error")
COMPUTE_TERMS = ("prefill_overhead_s", "prefill_s_per_token", "prefill_s_per_token_pair", "decode_step_s",
                 "decode_s_per_request", "decode_s_per_ctx_token", "prefill_s_per_cached_pair")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One point of a sweep: the overrides of the base run."""

    label: str
    x: float
    """The swept value (the PNG's x axis)."""
    nic_gbytes_s: float | None = None
    rate: float | None = None
    workers: int | None = None
    view_staleness_s: float | None = None
    hint_jitter: float | None = None
    cost_factor: float = 1.0


def cells(sweep: str, args: argparse.Namespace) -> list[Cell]:
    """Returns: the cells of one sweep (ValueError for an unknown sweep)."""
    if sweep == "link":
        return [Cell(f"{g:g} GB/s", g, nic_gbytes_s=g) for g in args.link_gbytes_s]
    if sweep == "load":
        return [Cell(f"rate {r:g}", r, rate=r) for r in args.load_rates]
    if sweep == "size":
        return [Cell(f"{n} workers", n, workers=n, rate=args.rate * n / args.workers) for n in args.sizes]
    if sweep == "staleness":
        return [Cell(f"{s * 1e3:g} ms", s, view_staleness_s=s) for s in (0.0, 0.2)]
    if sweep == "jitter":
        return [Cell(f"jitter {j:g}", j, hint_jitter=j) for j in (0.0, 0.25, 0.5)]
    if sweep == "cost-error":
        return [Cell(f"cost x{f:g}", f, cost_factor=f) for f in (0.7, 1.0, 1.3)]
    raise ValueError(f"unknown sweep {sweep!r}; known: {', '.join(SWEEPS)}")


def run_cell(cell: Cell, args: argparse.Namespace, policies: list[str], seeds: list[int]) -> dict:
    """Runs every policy once per seed in `cell`. Returns: policy -> {"ttft_mean_s", "ttft_p99_s", ...: mean_ci}."""
    truth = load_profile(args.profile)
    if cell.nic_gbytes_s is not None:
        truth = dataclasses.replace(truth, nic_bandwidth_bytes_per_s=cell.nic_gbytes_s * 1e9)
    believed = dataclasses.replace(truth, **{k: getattr(truth, k) * cell.cost_factor for k in COMPUTE_TERMS})
    workers = cell.workers or args.workers
    rate = cell.rate if cell.rate is not None else args.rate
    ecfg = EngineConfig(num_workers=workers, duration_s=args.duration_s,
                        view_staleness_s=args.view_staleness_s if cell.view_staleness_s is None
                        else cell.view_staleness_s,
                        hint_jitter=args.hint_jitter if cell.hint_jitter is None else cell.hint_jitter)
    raw: dict[str, dict[str, list[float]]] = {p: {} for p in policies}
    for seed in seeds:
        for name in policies:
            if args.trace:
                wl = load_trace(args.trace, args.trace_rate, args.duration_s, truth.max_context_len, seed)
            else:
                arrival = "bursty" if args.generator == "shared-prefix" else "poisson"
                wl = GENERATORS[args.generator](GeneratorConfig(fanout_k=args.fanout_k), rate, args.duration_s,
                                                seed, truth.max_context_len, arrival)
            t0 = time.perf_counter()
            r = Engine(truth, wl, build_policy(name, believed, wl.page_len, seed), ecfg).run().to_dict()
            wall = time.perf_counter() - t0
            figures = {"ttft_mean_s": r["ttft_s"]["mean"], "ttft_p50_s": r["ttft_s"]["p50"],
                       "ttft_p99_s": r["ttft_s"]["p99"], "ttft_floor_mean_s": r["ttft_floor_s"]["mean"],
                       "ttft_floor_p99_s": r["ttft_floor_s"]["p99"], "copies": r["replication"]["count"],
                       "num_requests": r["num_requests"], "wall_s": wall}
            for k, v in figures.items():
                raw[name].setdefault(k, []).append(float(v))
            print(f"  {cell.label:<14} seed {seed} {name:<18} mean {figures['ttft_mean_s']:.3f} "
                  f"p99 {figures['ttft_p99_s']:.3f} ({wall:.1f} s)", file=sys.stderr, flush=True)
    return {p: {k: mean_ci(v) for k, v in m.items()} for p, m in raw.items()}


def never_worse(res: dict, metric: str) -> str:
    """Returns: kvrep / min(kvrep_pull, kvrep_pull_demote) and a verdict on issue 16's rule (kvrep <= 1.02x it):
    `met` (the means are within 1.02x), `within CI` (above 1.02x, but kvrep's mean minus its 95% CI half-width is
    within 1.02x the reference's mean plus its half-width: not shown worse with these seeds), `NOT met`; `n/a`
    without the policies."""
    refs = [res[p][metric] for p in ("kvrep_pull", "kvrep_pull_demote") if p in res]
    if "kvrep" not in res or not refs:
        return "n/a"
    ref = min(refs, key=lambda m: m["mean"])
    k = res["kvrep"][metric]
    ratio = k["mean"] / ref["mean"] if ref["mean"] > 0 else float("nan")
    if k["mean"] <= 1.02 * ref["mean"]:
        verdict = "met"
    elif k["mean"] - k["ci95"] <= 1.02 * (ref["mean"] + ref["ci95"]):
        verdict = "within CI"
    else:
        verdict = "NOT met"
    return f"{ratio:.2f}x {verdict}"


def reachable(res: dict, target: float = 0.7) -> str:
    """Returns: `kvrep`'s P99 floor / `kvrep_pull`'s P99, and `no` where the floor is above `target` (no policy
    could meet issue 16's "kvrep P99 <= 0.7x kvrep_pull" on these requests), `yes` otherwise; `n/a` without them."""
    if "kvrep" not in res or "kvrep_pull" not in res or "ttft_floor_p99_s" not in res["kvrep"]:
        return "n/a"
    ref = res["kvrep_pull"]["ttft_p99_s"]["mean"]
    ratio = res["kvrep"]["ttft_floor_p99_s"]["mean"] / ref if ref > 0 else float("nan")
    return f"{ratio:.2f}x {'no' if ratio > target else 'yes'}"


def render(json_path: str) -> None:
    """Rewrites the markdown of a sweep from its JSON (same stem)."""
    data = json.loads(Path(json_path).read_text())
    rows = [(Cell(**c["cell"]), c["results"]) for c in data["cells"]]
    policies = list(rows[0][1])
    Path(json_path).with_suffix(".md").write_text(markdown(data["sweep"], data["command"], rows, policies))


def fmt(m: dict) -> str:
    return f"{m['mean']:.3f} ± {m['ci95']:.3f}"


def markdown(sweep: str, command: str, rows: list[tuple[Cell, dict]], policies: list[str]) -> str:
    """Returns: the sweep's markdown: the command, then one table for the mean and one for the P99."""
    out = [f"# Sweep `{sweep}`", "", f"`{command}`", "",
           "TTFT, s: mean ± 95% CI over the seeds (t-distribution). `never worse`: kvrep / min(kvrep_pull, "
           "kvrep_pull_demote), and whether kvrep <= 1.02x it within the CI.", ""]
    for metric, title in (("ttft_mean_s", "TTFT mean"), ("ttft_p50_s", "TTFT P50"), ("ttft_p99_s", "TTFT P99")):
        out += [f"## {title}", "", "| cell | " + " | ".join(f"`{p}`" for p in policies) + " | never worse |",
                "|---" * (len(policies) + 2) + "|"]
        for cell, res in rows:
            out.append(f"| {cell.label} | " + " | ".join(fmt(res[p][metric]) for p in policies)
                       + f" | {never_worse(res, metric)} |")
        out.append("")
    if all("ttft_floor_p99_s" in res[p] for _, res in rows for p in policies):
        out += ["## TTFT P99 floor", "", "`TtftFloor` (radix_sync/sim/metrics.py, proof there): no policy's P99 can be "
                "below its own floor. `reachable 0.7x`: whether `kvrep`'s floor is <= 0.7x `kvrep_pull`'s P99 "
                "(issue 16's target; `no`: `kvrep` could not meet it whatever it copied; every policy's floor is "
                "alike).", "",
                "| cell | " + " | ".join(f"`{p}`" for p in policies) + " | reachable 0.7x |",
                "|---" * (len(policies) + 2) + "|"]
        for cell, res in rows:
            out.append(f"| {cell.label} | " + " | ".join(fmt(res[p]["ttft_floor_p99_s"]) for p in policies)
                       + f" | {reachable(res)} |")
        out.append("")
    out += ["## Copies per run, simulation wall time per run (s)", "",
            "| cell | " + " | ".join(f"`{p}`" for p in policies) + " |", "|---" * (len(policies) + 1) + "|"]
    for cell, res in rows:
        out.append(f"| {cell.label} | " + " | ".join(f"{res[p]['copies']['mean']:.0f} / {res[p]['wall_s']['mean']:.1f}"
                                                     for p in policies) + " |")
    return "\n".join(out) + "\n"


def plot(sweep: str, rows: list[tuple[Cell, dict]], policies: list[str], path: str) -> None:
    """Writes a PNG: TTFT mean and P99 (with 95% CI bars) per policy against the swept value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [c.x for c, _ in rows]
    for ax, (metric, title) in zip(axes, (("ttft_mean_s", "TTFT mean, s"), ("ttft_p99_s", "TTFT P99, s"))):
        for p in policies:
            ax.errorbar(xs, [r[p][metric]["mean"] for _, r in rows], yerr=[r[p][metric]["ci95"] for _, r in rows],
                        label=p, marker="o", capsize=3)
        ax.set_xlabel(sweep)
        ax.set_ylabel(title)
        ax.set_yscale("log")
        ax.set_xticks(xs, [c.label for c, _ in rows], rotation=20, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweeps", default=",".join(SWEEPS), help=f"comma-separated, from: {', '.join(SWEEPS)}")
    ap.add_argument("--generator", default="fanout", choices=sorted(GENERATORS))
    ap.add_argument("--trace", default=None, help="a trace file instead of --generator (Mooncake JSONL, ...)")
    ap.add_argument("--trace-rate", type=float, default=None, help="rescale the trace's arrival rate")
    ap.add_argument("--fanout-k", type=int, default=32)
    ap.add_argument("--rate", type=float, default=40.0, help="requests/s of the base cell")
    ap.add_argument("--load-rates", type=lambda s: [float(x) for x in s.split(",")], default=[20.0, 30.0, 40.0, 50.0])
    ap.add_argument("--link-gbytes-s", type=lambda s: [float(x) for x in s.split(",")], default=[3, 6, 12, 24, 50])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16, 64])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--profile", default="llama3.1-8b-h200")
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--view-staleness-s", type=float, default=EngineConfig.view_staleness_s)
    ap.add_argument("--hint-jitter", type=float, default=EngineConfig.hint_jitter)
    ap.add_argument("--out-dir", default="docs/results")
    ap.add_argument("--name", default=None, help="file name prefix (default: the generator or trace name)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 4 workers, 8 s, seeds 1,2, two cells of the link sweep, three policies")
    args = ap.parse_args(argv)
    if args.quick:
        args.sweeps, args.workers, args.duration_s, args.seeds = "link", 4, 8.0, "1,2"
        args.link_gbytes_s, args.rate, args.fanout_k = [6.0, 24.0], 4.0, 8
        args.policies = "pull,kvrep_pull,kvrep"
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--render":
        render(sys.argv[2])
        return 0
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES.names():
            print(f"sweep: unknown policy {p!r}", file=sys.stderr)
            return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or (Path(args.trace).stem if args.trace else args.generator)
    command = "python scripts/sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for sweep in [s.strip() for s in args.sweeps.split(",") if s.strip()]:
        try:
            cs = cells(sweep, args)
        except ValueError as e:
            print(f"sweep: {e}", file=sys.stderr)
            return 2
        rows = []
        for c in cs:
            rows.append((c, run_cell(c, args, policies, seeds)))
        stem = out / f"{name}-{sweep}"
        stem.with_suffix(".md").write_text(markdown(sweep, command, rows, policies))
        stem.with_suffix(".json").write_text(json.dumps(
            {"command": command, "sweep": sweep, "seeds": seeds,
             "cells": [{"cell": dataclasses.asdict(c), "results": r} for c, r in rows]}, indent=1))
        plot(sweep, rows, policies, os.fspath(stem.with_suffix(".png")))
        print(f"wrote {stem}.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
