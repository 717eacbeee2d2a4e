"""Issue 16's targets over every sweep's JSON (`scripts/sweep.py`): one row per cell, as docs/simulator.md shows it.

    .venv/bin/python scripts/sweep_summary.py docs/results/fanout-link.json docs/results/targets-*.json ...

Per cell: the best faithful baseline (lowest mean P99 of `pull`, `cache_aware`, `precise`, `cost`, `sticky`,
`cache_aware_v03`, `e2`, `round_robin` among those run) and its P99/P50; the ablation rows; `kvrep`'s P99 floor
(`TtftFloor`: no policy's P99 goes below its own); never worse (`sweep.never_worse`, mean / P99); the share of
`kvrep_pull`'s P99 excess over that floor which `kvrep` removes (`closed`); and the verdict
on the target that applies to the cell's workload:
- `pays` (fan-out, flash-crowd, resume-burst, multi-candidate): `kvrep` P99 <= 0.7x `kvrep_pull` and <= 0.5x the
  best baseline, asked only at links >= 12 GB/s and where the best baseline's P99 >= 3x its P50 (`not asked`
  otherwise); `unreachable` where `kvrep`'s own floor is above either bound (no copying could meet it);
- `inert` (Mooncake, no-sharing): `kvrep` mean and P99 within +2% of the best baseline;
- `never worse only` (any other workload: agent sessions, shared-prefix).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BASELINES = ("pull", "cache_aware", "precise", "cost", "sticky", "cache_aware_v03", "e2", "round_robin")
ROWS = ("kvrep_route", "kvrep_pull", "kvrep_pull_demote", "kvrep")
PAYS = ("fanout", "flash-crowd", "resume-burst", "multi-candidate")
INERT = ("mooncake", "no-sharing")


def _sweep_module():
    spec = importlib.util.spec_from_file_location("sweep", Path(__file__).resolve().parent / "sweep.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sweep", mod)
    spec.loader.exec_module(mod)
    return mod


def mean(res: dict, policy: str, metric: str) -> float:
    return res[policy][metric]["mean"]


def verdict(workload: str, res: dict, best: str, nic_gbytes_s: float) -> str:
    """Returns: the cell's target verdict (see the module docstring)."""
    if any(w in workload for w in INERT):
        ok = all(mean(res, "kvrep", m) <= 1.02 * mean(res, best, m) for m in ("ttft_mean_s", "ttft_p99_s"))
        return "inert: met" if ok else "inert: NOT met"
    if not any(w in workload for w in PAYS):
        return "never worse only"
    p99, pull = mean(res, "kvrep", "ttft_p99_s"), mean(res, "kvrep_pull", "ttft_p99_s")
    base = mean(res, best, "ttft_p99_s")
    if nic_gbytes_s < 12:
        return "pays: not asked (link < 12 GB/s)"
    if base < 3 * mean(res, best, "ttft_p50_s"):
        return "pays: not asked (best P99 < 3x P50)"
    if p99 <= 0.7 * pull and p99 <= 0.5 * base:
        return "pays: met"
    floor = res["kvrep"].get("ttft_floor_p99_s", {}).get("mean")
    if floor is not None and (floor > 0.7 * pull or floor > 0.5 * base):
        return f"pays: NOT met, unreachable (floor {floor / pull:.2f}x `kvrep_pull`, {floor / base:.2f}x best)"
    return "pays: NOT met"


def closed(res: dict) -> str:
    """Returns: the share of the P99 gap between `kvrep_pull` and `kvrep`'s floor that `kvrep` closes, (pull - kvrep)
    / (pull - floor): 100% is the floor reached, 0% no better than reacting, negative worse; `-` without a floor
    or where `kvrep_pull` is within 2% of it (nothing left to close)."""
    floor = res["kvrep"].get("ttft_floor_p99_s", {}).get("mean")
    pull, p99 = mean(res, "kvrep_pull", "ttft_p99_s"), mean(res, "kvrep", "ttft_p99_s")
    if floor is None or pull <= 1.02 * floor:
        return "-"
    return f"{100 * (pull - p99) / (pull - floor):.0f}%"


def rows(path: str, profile_nic_gbytes_s: float = 23.75) -> list[str]:
    """Returns: the markdown rows of one sweep's JSON."""
    sw = _sweep_module()
    data = json.loads(Path(path).read_text())
    workload = Path(path).stem
    out = []
    for c in data["cells"]:
        cell, res = c["cell"], c["results"]
        if "kvrep" not in res or "kvrep_pull" not in res:
            continue
        found = [b for b in BASELINES if b in res]
        best = min(found, key=lambda b: mean(res, b, "ttft_p99_s"))
        ratio = mean(res, best, "ttft_p99_s") / max(mean(res, best, "ttft_p50_s"), 1e-12)
        fmt = lambda p: f"{mean(res, p, 'ttft_mean_s'):.3f} / {mean(res, p, 'ttft_p99_s'):.3f}"  # noqa: E731
        floor = res["kvrep"].get("ttft_floor_p99_s", {}).get("mean")
        nic = cell.get("nic_gbytes_s") or profile_nic_gbytes_s
        out.append(
            f"| {workload} {cell['label']} | `{best}` {fmt(best)} ({ratio:.1f}x) | "
            + " | ".join(fmt(p) if p in res else "-" for p in ROWS)
            + f" | {'-' if floor is None else f'{floor:.3f}'}"
            + f" | {sw.never_worse(res, 'ttft_mean_s')} / {sw.never_worse(res, 'ttft_p99_s')}"
            + f" | {mean(res, 'kvrep', 'ttft_p99_s') / mean(res, 'kvrep_pull', 'ttft_p99_s'):.2f}x / "
            + f"{mean(res, 'kvrep', 'ttft_p99_s') / mean(res, best, 'ttft_p99_s'):.2f}x"
            + f" | {closed(res)} | {verdict(workload, res, best, nic)} | {res['kvrep']['copies']['mean']:.0f} |")
    return out


HEADER = ("| cell | best faithful baseline, mean / P99 (P99/P50) | `kvrep_route` | `kvrep_pull` | `kvrep_pull_demote` "
          "| `kvrep` | `kvrep` P99 floor | never worse, mean / P99 | `kvrep` P99 vs `kvrep_pull` / vs best "
          "| P99 gap to the floor closed | target "
          "| `kvrep` copies |")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for path in argv:
        for line in rows(path):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
