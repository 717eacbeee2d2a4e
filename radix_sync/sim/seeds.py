"""Several seeds of the same comparison: per policy, the mean of each figure over the seeds and its 95% confidence
interval (Student's t, n - 1 degrees of freedom: the half-width t x s / sqrt(n))."""

from __future__ import annotations

import math
from typing import Callable

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""The 97.5% quantile of Student's t with 1..30 degrees of freedom (two-sided 95%)."""

METRICS: dict[str, Callable[[dict], float]] = {
    "ttft_mean_s": lambda r: r["ttft_s"]["mean"],
    "ttft_p50_s": lambda r: r["ttft_s"]["p50"],
    "ttft_p90_s": lambda r: r["ttft_s"]["p90"],
    "ttft_p99_s": lambda r: r["ttft_s"]["p99"],
    "ttft_floor_p99_s": lambda r: r.get("ttft_floor_s", {}).get("p99", math.nan),
    "tpot_p50_s": lambda r: r["tpot_s"]["p50"],
    "num_requests": lambda r: r["num_requests"],
    "throughput_rps": lambda r: r["throughput_rps"],
    "prefix_hit_rate": lambda r: r["prefix_hit_rate"],
    "copies": lambda r: r["replication"]["count"],
    "copy_gbytes": lambda r: r["replication"]["bytes"] / 1e9,
    "useful_bytes_frac": lambda r: r["replication"]["useful_bytes_frac"],
    "wall_s": lambda r: r.get("wall_s", 0.0),
}


def t_quantile(dof: int) -> float:
    """Returns: the 97.5% quantile of Student's t with `dof` degrees of freedom (1.96 above 30)."""
    if dof < 1:
        raise ValueError(f"dof={dof!r} must be >= 1")
    return T975[dof - 1] if dof <= len(T975) else 1.96


def mean_ci(values: list[float]) -> dict:
    """Returns: {"mean", "ci95" (half-width; 0 for one value), "values"}."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    m = sum(values) / n
    if n == 1:
        return {"mean": m, "ci95": 0.0, "values": list(values)}
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    return {"mean": m, "ci95": t_quantile(n - 1) * s / math.sqrt(n), "values": list(values)}


def summarize_seeds(runs: dict[int, list[dict]]) -> dict[str, dict[str, dict]]:
    """Args:
        runs: seed -> that seed's result records (one per policy, as `RunStats.to_dict` plus `wall_s`).
    Returns:
        policy -> metric -> `mean_ci` over the seeds, policies in the order of the first seed.
    """
    seeds = sorted(runs)
    out: dict[str, dict[str, dict]] = {}
    for r in runs[seeds[0]]:
        name = r["policy"]
        recs = [next(x for x in runs[s] if x["policy"] == name) for s in seeds]
        out[name] = {k: mean_ci([float(f(x)) for x in recs]) for k, f in METRICS.items()}
    return out


def format_seed_table(summary: dict[str, dict[str, dict]], num_seeds: int) -> str:
    """Returns: a fixed-width table, one row per policy, each figure as mean +- 95% CI half-width."""
    cols = (("ttft mean", "ttft_mean_s", 1.0, 3), ("p50", "ttft_p50_s", 1.0, 3), ("p90", "ttft_p90_s", 1.0, 3),
            ("p99", "ttft_p99_s", 1.0, 3), ("p99 floor", "ttft_floor_p99_s", 1.0, 3),
            ("tpot p50 ms", "tpot_p50_s", 1e3, 1), ("hit%", "prefix_hit_rate", 100.0, 1),
            ("copies", "copies", 1.0, 0), ("GB", "copy_gbytes", 1.0, 1))
    width = 16
    head = f"{'policy':<18}" + "".join(f"{c[0]:>{width}}" for c in cols)
    lines = [f"{num_seeds} seeds: mean +- 95% CI (t-distribution); p99 floor: no policy's P99 can be below it "
             "(TtftFloor)", head, "-" * len(head)]
    for name, m in summary.items():
        cells = []
        for _, key, scale, digits in cols:
            v = m[key]
            cells.append(f"{v['mean'] * scale:.{digits}f}+-{v['ci95'] * scale:.{digits}f}".rjust(width))
        lines.append(f"{name:<18}" + "".join(cells))
    return "\n".join(lines)
