"""The router's Prometheus metrics, rendered as text without a client library (a handful of series).

Owned by the server; all methods run on the event loop thread, so no locks.
"""
from __future__ import annotations

from collections import defaultdict

# Routing decision latency buckets, seconds (a decision is a directory lookup over loopback plus the policy).
DECISION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
                break

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.9f}", f"{name}_count {self.count}"]
        return out


class RouterMetrics:
    def __init__(self) -> None:
        self.requests = defaultdict(int)  # (worker, endpoint, mode) -> count
        self.failures = defaultdict(int)  # (worker, reason) -> count
        self.failovers = 0
        self.fallbacks = 0
        self.unauthorized = 0
        self.no_worker = 0
        self.arrivals_dropped = 0
        self.decision_s = Histogram(DECISION_BUCKETS_S)

    def render(self) -> str:
        lines = ["# HELP kvrep_router_requests_total Requests proxied, by worker, endpoint and routing mode.",
                 "# TYPE kvrep_router_requests_total counter"]
        for (worker, endpoint, mode), n in sorted(self.requests.items()):
            lines.append(f'kvrep_router_requests_total{{worker="{worker}",endpoint="{endpoint}",mode="{mode}"}} {n}')
        lines += ["# HELP kvrep_router_upstream_failures_total Upstream attempts that failed, by worker and reason.",
                  "# TYPE kvrep_router_upstream_failures_total counter"]
        for (worker, reason), n in sorted(self.failures.items()):
            lines.append(f'kvrep_router_upstream_failures_total{{worker="{worker}",reason="{reason}"}} {n}')
        for name, value, help_ in (
                ("kvrep_router_failovers_total", self.failovers, "Requests sent to a later choice after a failure."),
                ("kvrep_router_fallback_decisions_total", self.fallbacks,
                 "Decisions made from the router's own view (coordinator unreachable)."),
                ("kvrep_router_unauthorized_total", self.unauthorized, "Requests refused with 401."),
                ("kvrep_router_no_worker_total", self.no_worker, "Requests refused with 503 (no worker reachable)."),
                ("kvrep_router_arrivals_dropped_total", self.arrivals_dropped,
                 "Arrival reports not delivered to the coordinator.")):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
        lines += ["# HELP kvrep_router_decision_seconds Time to pick a worker (tokenize, lookup, policy).",
                  "# TYPE kvrep_router_decision_seconds histogram", *self.decision_s.lines("kvrep_router_decision_seconds")]
        return "\n".join(lines) + "\n"
