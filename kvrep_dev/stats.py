"""Bootstrap confidence intervals for the live tables of `kvrep bench` / `kvrep demo`.

A cell's TTFT mean and P99 come from one sample of requests; the interval says how far they would move on another
sample from the same run. Percentile bootstrap: `RESAMPLES` resamples drawn with replacement, with a fixed seed
(the same data gives the same interval), the interval the middle `LEVEL` of the resampled statistic. Samples
pooled over interleaved rounds are resampled within each round (stratified: every resample keeps each round's
size), so a round that ran on a slower machine weighs as much in every resample as in the data. A ratio's
interval resamples its numerator's and its denominator's requests independently (`ratio_ci`), unless both arms
served the same requests (a workload replayed from one seed): then the pairs are resampled together
(`paired_ratio_ci`), so that what differs between requests (a cold prompt, a long one) is not counted as a
difference between arms. P99 is the linear-interpolation percentile of `kvrep_dev.loadgen.summarize` (numpy's default).
"""
from __future__ import annotations

import math
from typing import Sequence

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


def ratio_ci(num, den, stat: str, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED) -> dict:
    """Returns: {"value": stat(num) / stat(den) over the pooled samples, "lo", "hi": its bootstrap interval}
    (numerator and denominator resampled independently, each within its rounds)."""
    rng = np.random.default_rng(seed)
    a, b = resample(num, stat, resamples, rng), resample(den, stat, resamples, rng)
    d = point(den, stat)
    with np.errstate(divide="ignore", invalid="ignore"):
        lo, hi = _interval(a / b, level)
    return {"value": point(num, stat) / d if d else math.nan, "lo": lo, "hi": hi}


def paired_ratio_ci(pairs, stat: str, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED) -> dict:
    """Returns: {"value": stat(numerator) / stat(denominator) over the pooled pairs, "lo", "hi": its bootstrap
    interval, "n": pairs}, each resample drawing request indices (within each round) and taking both arms' values of
    the same requests.

    Args:
        pairs: per round, an (n, 2) array: a request's value in the numerator's arm and in the denominator's.
    """
    rounds = [np.asarray(g, dtype=float).reshape(-1, 2) for g in pairs]
    rounds = [g[~np.isnan(g).any(axis=1)] for g in rounds]
    rounds = [g for g in rounds if len(g)]
    if not rounds:
        return {"value": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    rng = np.random.default_rng(seed)
    drawn = [g[rng.integers(0, len(g), size=(resamples, len(g)))] for g in rounds]  # (resamples, n, 2) a round
    both = np.concatenate(drawn, axis=1)
    pooled = np.concatenate(rounds)
    d = float(STATS[stat](pooled[:, 1]))
    with np.errstate(divide="ignore", invalid="ignore"):
        lo, hi = _interval(STATS[stat](both[..., 0]) / STATS[stat](both[..., 1]), level)
    return {"value": float(STATS[stat](pooled[:, 0])) / d if d else math.nan, "lo": lo, "hi": hi,
            "n": int(len(pooled))}


def fmt(c: dict, spec: str = ".2f") -> str:
    """`[lo-hi]` of an interval (empty when there is none)."""
    if not c or math.isnan(c.get("lo", math.nan)):
        return ""
    return f"[{c['lo']:{spec}}-{c['hi']:{spec}}]"
