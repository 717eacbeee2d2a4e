"""Bootstrap confidence intervals for the live tables of `kvrep bench` / `kvrep demo`.

A cell's TTFT mean and P99 come from one sample of requests; the interval says how far they would move on another
sample from the same run. Percentile bootstrap: `RESAMPLES` resamples drawn with replacement, with a fixed seed
(the same data gives the same interval), the interval the middle `LEVEL` of the resampled statistic. Samples
pooled over interleaved rounds are resampled within each round (stratified: every resample keeps each round's
size), so a round that ran on a slower machine weighs as much in every resample as in the data. The claim ratios
(one arm's statistic over another's, over interleaved rounds: `rounds_ratio_ci`) resample the rounds too, then the
requests within each drawn round; where both arms served the same requests (a workload replayed from one seed)
each drawn request carries both arms' values, so that what differs between requests (a cold prompt, a long one) is
not counted as a difference between the arms. P99 is the linear-interpolation percentile of
`kvrep_dev.loadgen.summarize` (numpy's default).
"""
from __future__ import annotations

import math

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
SEED = 0
STATS = {"mean": lambda a: a.mean(axis=-1), "p50": lambda a: np.quantile(a, 0.5, axis=-1),
         "p99": lambda a: np.quantile(a, 0.99, axis=-1)}
"""Statistic name -> its value over the last axis (one row per resample)."""


def _groups(samples) -> list[np.ndarray]:
    """`samples`: one sequence (one round) or a list of sequences (one per round); NaNs and Nones dropped."""
    if len(samples) and not isinstance(samples[0], (list, tuple, np.ndarray)):
        samples = [samples]
    out = [np.asarray([x for x in g if x is not None and not math.isnan(x)], dtype=float) for g in samples]
    return [g for g in out if g.size]


def resample(samples, stat: str, resamples: int = RESAMPLES, rng: np.random.Generator | None = None) -> np.ndarray:
    """Returns: `stat` of `resamples` bootstrap resamples of `samples` (rounds resampled separately, then pooled)."""
    groups = _groups(samples)
    if not groups:
        return np.full(resamples, math.nan)
    rng = rng if rng is not None else np.random.default_rng(SEED)
    drawn = [g[rng.integers(0, g.size, size=(resamples, g.size))] for g in groups]
    return STATS[stat](np.concatenate(drawn, axis=1))


def point(samples, stat: str) -> float:
    """Returns: `stat` of the pooled samples (NaN if none)."""
    groups = _groups(samples)
    return float(STATS[stat](np.concatenate(groups))) if groups else math.nan


def _interval(values: np.ndarray, level: float) -> tuple[float, float]:
    if np.isnan(values).any():
        return math.nan, math.nan
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def ci(samples, stat: str, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED) -> dict:
    """Returns: {"value": `stat` of the pooled samples, "lo", "hi": its bootstrap interval, "n": samples}."""
    lo, hi = _interval(resample(samples, stat, resamples, np.random.default_rng(seed)), level)
    return {"value": point(samples, stat), "lo": lo, "hi": hi, "n": int(sum(g.size for g in _groups(samples)))}


def rounds_ratio_ci(num, den, stat: str, paired: bool, resamples: int = RESAMPLES, level: float = LEVEL,
                    seed: int = SEED) -> dict:
    """The ratio of two arms' `stat` over interleaved rounds, with an interval that counts the rounds as samples too:
    each resample draws rounds with replacement, then each drawn round's requests; `paired`: both arms' values of
    the same drawn requests (what differs between requests, a cold prompt or a long one, is then not counted as a
    difference between the arms), else each arm's own requests of the drawn round.

    Why rounds too: the arms of a round run one after the other, and an A/A run of two identical arms (stop 44's,
    `bench/results/bench-agent-aa-s4.json.gz`) differs by up to 1.58x within a round; an interval over requests
    alone, paired or not, excludes 1.0 for it. With 3-4 rounds the round draw is coarse (few distinct draws), so the
    interval is read with the per-round range next to it.

    Args:
        num, den: per round, the requests' values in the numerator's and in the denominator's arm (paired: the same
            requests in the same order, equal lengths).
    Returns:
        {"value": stat(num) / stat(den) over every round pooled, "lo", "hi": its interval, "n": requests (pairs)}.
    """
    rounds = []
    for a, b in zip(num, den):
        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        if paired:
            keep = ~(np.isnan(a) | np.isnan(b))
            a, b = a[keep], b[keep]
        else:
            a, b = a[~np.isnan(a)], b[~np.isnan(b)]
        if a.size and b.size:
            rounds.append((a, b))
    if not rounds:
        return {"value": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    stat_of = STATS[stat]
    rng = np.random.default_rng(seed)
    out = np.empty(resamples)
    for k in range(resamples):
        drawn = [rounds[i] for i in rng.integers(0, len(rounds), len(rounds))]
        xs, ys = [], []
        for a, b in drawn:
            ia = rng.integers(0, a.size, a.size)
            xs.append(a[ia])
            ys.append(b[ia] if paired else b[rng.integers(0, b.size, b.size)])
        d = stat_of(np.concatenate(ys))
        out[k] = stat_of(np.concatenate(xs)) / d if d else math.nan
    d = float(stat_of(np.concatenate([b for _, b in rounds])))
    lo, hi = _interval(out, level)
    return {"value": float(stat_of(np.concatenate([a for a, _ in rounds]))) / d if d else math.nan, "lo": lo, "hi": hi,
            "n": int(sum(a.size for a, _ in rounds))}


def fmt(c: dict, spec: str = ".2f") -> str:
    """`[lo-hi]` of an interval (empty when there is none)."""
    if not c or math.isnan(c.get("lo", math.nan)):
        return ""
    return f"[{c['lo']:{spec}}-{c['hi']:{spec}}]"
