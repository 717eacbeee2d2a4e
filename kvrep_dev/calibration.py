"""The testbed's prefill costs, measured on `kvrep bench`'s own requests: what the simulator runs on as ground truth.

`scripts/calibrate_cpu.py` measures a profile on 42 hand-made requests (one worker, no pinning; RMS residual 24%).
A bench run has thousands of requests on the testbed exactly as it is measured (pinned workers, the bench's
flags, the streamed text path), and many of them run alone: `isolated_requests` keeps a request only when no other
request of its cell was in flight at the client from its send to its first token (every earlier one had its first
token, plus a decode margin, before it was sent; the next one was sent after its first token), so its TTFT is its
own prefill on an otherwise idle worker.

A lone request's TTFT is more than its prefill where the workers ran SGLang's overlap scheduler: it streams a
prefill's first token when the next iteration (a decode step) ends, and the simulator does the same
(`EngineConfig.overlap_lag`). `prefill_part` takes that step off each sample of such a run, so that the simulator,
adding it back, reproduces the measured TTFT; a run without the overlap scheduler (the testbed since stop 53) has
no such step, and its samples are fitted whole (taking a step off them made the simulated engine one decode step,
~20 ms, faster than the workers on every request: stop 54).

`fit_prefill` fits the four prefill terms of `CostProfile.prefill_s` to such samples by non-negative least squares
on the relative error, each (new tokens, cached tokens) cell of a log-2 grid weighing the same however many
samples it has (a flash crowd's thousand short extensions would otherwise decide every term). `drift` is the
machine's speed during one run against a profile: the median measured/predicted TTFT over its isolated requests
(a shared VM drifts by ~10-20% between runs).
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Iterable, Iterator, Sequence

from radix_sync.policy.cost import CostProfile

DECODE_MARGIN_S = 0.4
"""An earlier request counts as out of the way this long after its first token (its 8 output tokens decode in
~0.1-0.3 s on the testbed)."""
LOOKBACK = 8
"""How many earlier requests of the cell are checked (sessions overlap only with their recent neighbours)."""
MIN_SAMPLES = 20
"""Fewer isolated requests than this: no fit (the caller keeps its profile)."""

Sample = tuple[int, int, float]
"""(new tokens, cached tokens, TTFT seconds) of one request as the server reported it."""


def _alone(rows: Iterable[dict], until: str) -> Iterator[dict]:
    """Yields every request of every bench row that had its cell to itself from its send to its `until` time
    (`ttft_s` or `e2e_s` after the send): every earlier one (of the last `LOOKBACK`) reached its own `until`, plus
    `DECODE_MARGIN_S`, before it was sent, and the next one was sent after it. Failed requests and requests without
    `until` are skipped."""
    for row in rows:
        reqs = sorted((q for q in row.get("requests", []) if q.get(until) and not q.get("error")),
                      key=lambda q: q["sent_s"])
        for i, q in enumerate(reqs):
            if any(p["sent_s"] + p[until] + DECODE_MARGIN_S >= q["sent_s"] for p in reqs[max(0, i - LOOKBACK):i]):
                continue
            if i + 1 < len(reqs) and reqs[i + 1]["sent_s"] <= q["sent_s"] + q[until]:
                continue
            yield q


def isolated_requests(rows: Iterable[dict]) -> list[Sample]:
    """Returns: the samples of every bench row's requests that ran alone from send to first token (see the module
    docstring); rows are `kvrep bench` result rows (`requests`: rid, sent_s, prompt_tokens, cached_tokens, ttft_s,
    error)."""
    return [(q["prompt_tokens"] - q["cached_tokens"], q["cached_tokens"], float(q["ttft_s"]))
            for q in _alone(rows, "ttft_s")]


def first_token_lag_s(profile: CostProfile, new: int, cached: int) -> float:
    """Returns: what follows a lone request's prefill before its first token streams (SGLang's overlap scheduler,
    the simulator's `overlap_lag`): one decode step of a batch of one at the prompt's length, under `profile`."""
    return profile.decode_steps_s(1, 1, new + cached)


def prefill_part(samples: Iterable[Sample], profile: CostProfile, overlap: bool = True) -> list[Sample]:
    """Returns: the samples with `first_token_lag_s` (under `profile`'s decode terms) taken off each TTFT, floored
    at 1 ms, when the workers ran the `overlap` scheduler (else the samples as they are): what the prefill terms
    are fitted to."""
    if not overlap:
        return list(samples)
    return [(n, c, max(1e-3, t - first_token_lag_s(profile, n, c))) for n, c, t in samples]


def lone_decode_steps(rows: Iterable[dict]) -> list[tuple[int, float]]:
    """Returns: (context tokens, seconds per decode step) of every request that ran alone from its send to its end
    (`_alone` on `e2e_s`), with at least 2 output tokens; rows as `isolated_requests`' with `e2e_s` and
    `output_tokens` (runs before stop 31 have neither: none)."""
    return [(int(q["prompt_tokens"]), (q["e2e_s"] - q["ttft_s"]) / (int(q["output_tokens"]) - 1))
            for q in _alone(rows, "e2e_s") if int(q.get("output_tokens") or 0) >= 2 and q.get("ttft_s")]


def decode_drift(profile: CostProfile, steps: Sequence[tuple[int, float]]) -> float:
    """Returns: the median measured/predicted decode step of `lone_decode_steps` (a batch of one at the prompt's
    context) under `profile`; 1.0 without steps."""
    if not steps:
        return 1.0
    return statistics.median(s / profile.decode_steps_s(1, 1, ctx) for ctx, s in steps)


def cell(new: int, cached: int) -> tuple[int, int]:
    """The (new, cached) sample's cell of the log-2 grid the fit and the drift weigh equally."""
    return (max(0, new).bit_length(), max(0, cached).bit_length())


def terms(new: int, cached: int) -> list[float]:
    """The four regressors of `CostProfile.prefill_s` (one chunk): overhead, new tokens, (new x context) pairs,
    (cached x cached) pairs."""
    return [1.0, float(new), new * cached + new * (new + 1) / 2.0, cached * (cached + 1) / 2.0]


def fit_prefill(samples: Sequence[Sample], balance: bool = True) -> dict:
    """Non-negative least squares on the relative error of (new, cached, s) samples.

    Args:
        samples: at least 4; more than `MIN_SAMPLES` for a fit worth using.
        balance: each cell of the log-2 (new, cached) grid weighs the same (else each sample does).
    Returns:
        {"values": the four `CostProfile` prefill fields, "rms": RMS relative residual (unweighted), "samples": n,
         "cells": how many grid cells}.
    """
    import numpy as np
    from scipy.optimize import nnls

    if len(samples) < 4:
        raise ValueError(f"fit_prefill: {len(samples)} samples, need at least 4")
    counts = Counter(cell(n, c) for n, c, _ in samples)
    x = np.array([terms(n, c) for n, c, _ in samples])
    y = np.array([t for _, _, t in samples])
    w = np.array([1.0 / math.sqrt(counts[cell(n, c)]) if balance else 1.0 for n, c, _ in samples])
    coef, _ = nnls(x / y[:, None] * w[:, None], w)
    rel = (x @ coef - y) / y
    overhead, per_token, per_pair, per_cached_pair = (float(v) for v in coef)
    return {"values": {"prefill_overhead_s": round(overhead, 6), "prefill_s_per_token": float(f"{per_token:.6g}"),
                       "prefill_s_per_token_pair": float(f"{per_pair:.6g}"),
                       "prefill_s_per_cached_pair": float(f"{per_cached_pair:.6g}")},
            "rms": float(np.sqrt(np.mean(rel ** 2))), "samples": len(samples), "cells": len(counts)}


def residuals(profile: CostProfile, samples: Sequence[Sample]) -> list[float]:
    """Returns: predicted/measured - 1 of each sample under `profile`."""
    return [profile.prefill_s(n, c) / t - 1.0 for n, c, t in samples]


def drift(profile: CostProfile, samples: Sequence[Sample]) -> float:
    """Returns: measured/predicted TTFT of the samples under `profile`, the median over the log-2 grid's cells of
    each cell's median (every cell weighs the same, as in `fit_prefill`); 1.0 without samples."""
    if not samples:
        return 1.0
    cells: dict[tuple[int, int], list[float]] = {}
    for n, c, t in samples:
        cells.setdefault(cell(n, c), []).append(t / profile.prefill_s(n, c))
    return statistics.median(statistics.median(v) for v in cells.values())
