"""Per-run statistics: TTFT/TPOT distributions, throughput, and what copies cost and bought.

Replication figures (pulls and planned replicas together; `kvrep_shadow` reports what it would have copied):
- `count`, `bytes`: copies started and their payload;
- `useful_bytes_frac`: share of copied bytes whose copy served at least one request while active;
- `request_hit_rate`: share of requests whose prefill reused copied pages;
- `byte_hit_rate`: copied tokens reused / all prompt tokens;
- `bytes_per_prefill_s_saved`: copied bytes per second of prefill the reuse avoided (profile formula).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from radix_sync.policy.cost import CostProfile
from radix_sync.sim.workload import request_key

if TYPE_CHECKING:
    from radix_sync.sim.network import Transfer
    from radix_sync.sim.workload import SimRequest

QUANTILES = (("p50", 50), ("p90", 90), ("p95", 95), ("p99", 99))


def summarize(values: list[float]) -> dict:
    """Returns: mean and p50/p90/p95/p99 of `values` (NaN-free; zeros when empty)."""
    if not values:
        return {"mean": 0.0, **{k: 0.0 for k, _ in QUANTILES}}
    a = np.asarray(values, dtype=np.float64)
    qs = np.percentile(a, [q for _, q in QUANTILES])
    return {"mean": float(a.mean()), **{k: float(v) for (k, _), v in zip(QUANTILES, qs)}}


class TtftFloor:
    """A lower bound on each request's TTFT that no policy can beat in the simulator (`ttft_floor_s` of a result).

    For a request r of P prompt tokens: m = the leading pages of r's prompt found among the pages of the requests
    that arrived before it (strictly earlier: requests arriving together cannot use each other's prefill),
    s = min(m x page_len, P - 1) and n = P - s (>= 1: the last token is always computed, as SGLang and the simulator
    do). With the profile's C =
    `chunked_prefill_len`, o = `prefill_overhead_s`, a = `prefill_s_per_token`, b = `prefill_s_per_token_pair`:

        TTFT(r) >= F(r) = ceil(n / C) * o + a * n + b * (n * s + n * (n + 1) / 2)

    whatever the routing, copying, eviction or host tier. Proof:
    1. When r arrives, no KV of r's positions >= s exists anywhere: a page's KV comes only from the prefill of a
       request whose prompt contains it, no request that came before r contains page m + 1 of r's prefix, and the
       last token is r's own to compute. So the tokens [s, P) are computed after r's arrival (by r, or by requests
       that arrived no earlier than r).
    2. Causal attention: position k needs the KV of every position < k, so those tokens are computed in pieces by
       iterations one after the other (each starts after the previous one ended; a copy in between takes >= 0 s).
       An iteration takes at most C tokens of one request, so there are >= ceil(n / C) of them, each lasting at
       least o plus its piece (other requests' pieces and load-backs only lengthen it: `Worker._start`).
    3. A piece of k tokens after c tokens of context costs a*k + b*(k*c + k*(k+1)/2) + a term >= 0
       (`CostProfile.prefill_piece_s`); over consecutive pieces covering [s, P) the a and b parts sum to exactly
       a*n + b*(n*s + n*(n+1)/2) (each new token attends to each earlier position once).
    4. r's first token is out at the earliest when the iteration computing its last token ends.
    Over the same requests, TTFT >= F one by one implies it for the mean and for every order statistic (and numpy's
    interpolated percentiles): a run's TTFT mean, P50 and P99 are >= its `ttft_floor_s` ones. Counting a page as seen
    when it was seen in another namespace or chain only lowers F, so the bound stays valid. Tested against every
    policy: `tests/unit/test_sim_floor.py`.
    """

    def __init__(self, profile: CostProfile, page_len: int) -> None:
        self.p = profile
        self.page_len = page_len
        self.seen: dict = {}
        """Page -> the arrival time of the first request that had it."""
        self.pending: dict[int, float] = {}

    def on_arrival(self, req: "SimRequest") -> None:
        m, pages, seen, now = 0, req.pages, self.seen, req.arrival_s
        while m < len(pages) and seen.get(pages[m], now) < now:
            m += 1
        for page in pages[m:]:
            seen.setdefault(page, now)
        p = self.p
        s = min(m * self.page_len, req.prompt_len - 1)
        n = req.prompt_len - s
        self.pending[req.rid] = (-(-n // p.chunked_prefill_len) * p.prefill_overhead_s + n * p.prefill_s_per_token
                                 + (n * s + n * (n + 1) / 2.0) * p.prefill_s_per_token_pair)

    def on_finish(self, req: "SimRequest") -> float:
        return self.pending.pop(req.rid)


class RunStats:
    """Accumulates one run's measurements; `to_dict` gives the result record."""

    def __init__(self, policy: str, profile: CostProfile, page_len: int, record_requests: bool = False) -> None:
        self.policy = policy
        self.records: Optional[list[dict]] = [] if record_requests else None
        """Per finished request (`record_requests`): its `request_key`, arrival, TTFT, cached tokens, worker, end
        (`e2e_s` from arrival) and output tokens."""
        self.p = profile
        self.page_len = page_len
        self.ttft_s: list[float] = []
        self.floor = TtftFloor(profile, page_len)
        self.ttft_floor_s: list[float] = []
        """`TtftFloor`'s bound of each request in `ttft_s`, in the same order."""
        self.tpot_s: list[float] = []
        self.num_arrived = 0
        self.num_rejected = 0
        self.num_copy_failed = 0
        self.first_arrival_s = None
        self.last_finish_s = 0.0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.host_tokens = 0
        """Prompt tokens loaded back from host tiers (a part of `cached_tokens`)."""
        self.copy_count = 0
        self.copy_bytes = 0
        self.copy_records: list = []
        self.copy_hit_requests = 0
        self.copy_hit_tokens = 0
        self.prefill_s_saved = 0.0
        self.shadow_count = 0
        self.shadow_bytes = 0
        self.shadow_useful_bytes = 0
        self.num_workers = 0

    def on_arrival(self, req: "SimRequest") -> None:
        self.num_arrived += 1
        self.floor.on_arrival(req)

    def on_finish(self, req: "SimRequest") -> None:
        self.ttft_s.append(req.first_token_s - req.arrival_s)
        self.ttft_floor_s.append(self.floor.on_finish(req))
        if req.output_len > 1:
            self.tpot_s.append((req.finish_s - req.first_token_s) / (req.output_len - 1))
        if self.first_arrival_s is None or req.arrival_s < self.first_arrival_s:
            self.first_arrival_s = req.arrival_s
        self.last_finish_s = max(self.last_finish_s, req.finish_s)
        self.prompt_tokens += req.prompt_len
        self.cached_tokens += req.cached_len
        self.host_tokens += req.host_len
        if self.records is not None:
            self.records.append({"key": request_key(req), "sent_s": round(req.arrival_s, 3),
                                 "prompt_tokens": req.prompt_len, "cached_tokens": req.cached_len,
                                 "ttft_s": round(req.first_token_s - req.arrival_s, 3), "worker": req.worker,
                                 "e2e_s": round(req.finish_s - req.arrival_s, 3), "output_tokens": req.output_len})

    def on_copy_started(self, x: "Transfer") -> None:
        self.copy_count += 1
        self.copy_bytes += x.num_bytes

    def on_copy_hit(self, req: "SimRequest", matched_len: int) -> None:
        self.copy_hit_requests += 1
        self.copy_hit_tokens += req.copy_hit_len
        cached = min(matched_len, req.prompt_len - 1)
        new = req.prompt_len - cached
        used = min(req.copy_hit_len, cached)
        self.prefill_s_saved += self.p.prefill_s(new + used, cached - used) - self.p.prefill_s(new, cached)

    def on_shadow_copy(self, num_bytes: int) -> None:
        self.shadow_count += 1
        self.shadow_bytes += num_bytes

    def on_shadow_useful(self, num_bytes: int) -> None:
        self.shadow_useful_bytes += num_bytes

    def finish(self, num_workers: int) -> None:
        """The run ended on a cluster of `num_workers` workers."""
        self.num_workers = num_workers

    def to_dict(self) -> dict:
        """Returns: the JSON record of the run."""
        n = len(self.ttft_s)
        span = (self.last_finish_s - self.first_arrival_s) if n and self.first_arrival_s is not None else 0.0
        useful = sum(r.num_bytes for r in self.copy_records if r.num_hits > 0)
        rep = {
            "count": self.copy_count,
            "bytes": self.copy_bytes,
            "useful_bytes_frac": useful / self.copy_bytes if self.copy_bytes else 0.0,
            "request_hit_rate": self.copy_hit_requests / n if n else 0.0,
            "byte_hit_rate": self.copy_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "bytes_per_prefill_s_saved": self.copy_bytes / self.prefill_s_saved if self.prefill_s_saved else None,
            "failed": self.num_copy_failed,
        }
        kinds = {}
        for r in self.copy_records:
            k = kinds.setdefault(r.kind, {"landed": 0, "bytes": 0, "useful_bytes": 0})
            k["landed"] += 1
            k["bytes"] += r.num_bytes
            k["useful_bytes"] += r.num_bytes if r.num_hits else 0
        rep["by_kind"] = kinds
        if self.shadow_count:
            rep["shadow"] = {"count": self.shadow_count, "bytes": self.shadow_bytes,
                             "useful_bytes_frac": self.shadow_useful_bytes / self.shadow_bytes}
        return {
            "policy": self.policy,
            "num_requests": n,
            "num_arrived": self.num_arrived,
            "num_rejected": self.num_rejected,
            "ttft_s": summarize(self.ttft_s),
            "ttft_floor_s": summarize(self.ttft_floor_s),
            "tpot_s": summarize(self.tpot_s),
            "throughput_rps": n / span if span > 0 else 0.0,
            "prefix_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "host_hit_rate": self.host_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "replication": rep,
            **({"requests": self.records} if self.records is not None else {}),
        }


def format_table(results: list[dict]) -> str:
    """Returns: a fixed-width table of the main figures, one row per policy."""
    head = (f"{'policy':<14}{'reqs':>7}{'ttft mean':>10}{'p50':>8}{'p90':>8}{'p99':>8}{'tpot p50':>10}"
            f"{'rps':>8}{'hit%':>6}{'copies':>8}{'GB':>8}{'useful':>8}{'rhit%':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        t, p, rep = r["ttft_s"], r["tpot_s"], r["replication"]
        lines.append(f"{r['policy']:<14}{r['num_requests']:>7}{t['mean']:>10.3f}{t['p50']:>8.3f}{t['p90']:>8.3f}"
                     f"{t['p99']:>8.3f}{p['p50'] * 1e3:>8.1f}ms{r['throughput_rps']:>8.2f}"
                     f"{100 * r['prefix_hit_rate']:>6.1f}{rep['count']:>8}{rep['bytes'] / 1e9:>8.1f}"
                     f"{rep['useful_bytes_frac']:>8.2f}{100 * rep['request_hit_rate']:>7.1f}")
    return "\n".join(lines)
