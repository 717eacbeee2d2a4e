"""The router's Prometheus metrics (`GET /metrics`), through `prometheus_client`, in a registry of its own.

One `RouterMetrics` per `radix_sync.router.service.Router`: its private `CollectorRegistry` keeps two routers in
one process (tests, `scripts/bench_router.py`) from sharing or clashing series. Updated on the event loop thread.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE
from prometheus_client.registry import Collector

DECISION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""Routing decision latency buckets, s (a decision is a directory match, or a lookup over loopback, plus the
policy)."""
PULL_WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
"""How long a request waited for its copy on the critical path, s (a pull's deadline is at most a few s)."""

PEER_LAG_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
"""Relay lag of another router's send, s (the simulator: within ~5 ms it takes back most of what several routers
cost, docs/bench.md)."""


class _ReadAtScrape(Collector):
    """A counter kept elsewhere (the coordinator link's), read when scraped."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._read())


class RouterMetrics:
    """The router's series (all prefixed `kvrep_router_`).

    Args:
        arrivals_dropped: returns the number of arrival reports not delivered to the coordinator so far (read
            at each scrape).
    """

    def __init__(self, arrivals_dropped: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter("kvrep_router_requests", "Requests proxied, by worker, endpoint and routing mode.",
                                ("worker", "endpoint", "mode"), registry=reg)
        self.upstream_failures = Counter("kvrep_router_upstream_failures",
                                         "Upstream attempts that failed, by worker and reason.",
                                         ("worker", "reason"), registry=reg)
        self.failovers = Counter("kvrep_router_failovers", "Requests sent to a later choice after a failure.",
                                 registry=reg)
        self.fallback_decisions = Counter("kvrep_router_fallback_decisions",
                                          "Decisions made from the router's own view (coordinator unreachable).",
                                          registry=reg)
        self.unauthorized = Counter("kvrep_router_unauthorized", "Requests refused with 401.", registry=reg)
        self.refused = Counter("kvrep_router_refused",
                               "Requests refused before any worker saw them, by reason (admin_auth: no or a wrong "
                               "admin token; bad_request: e.g. a token id outside the vocabulary; too_large; "
                               "rate_limited: hints).", ("reason",), registry=reg)
        self.no_worker = Counter("kvrep_router_no_worker", "Requests refused with 503 (no worker reachable).",
                                 registry=reg)
        reg.register(_ReadAtScrape("kvrep_router_arrivals_dropped",
                                   "Arrival reports not delivered to the coordinator.", arrivals_dropped))
        self.decision_seconds = Histogram("kvrep_router_decision_seconds",
                                          "Time to pick a worker (tokenize, lookup, policy).",
                                          buckets=DECISION_BUCKETS_S, registry=reg)
        self.kv_hints = Counter("kvrep_router_kv_hints",
                                "Actions of SGLang's `kv_hints` envelope (radix_sync.kv_hints) on proxied requests, by "
                                "outcome (sent: recorded by the coordinator; refused: the coordinator said no; "
                                "unauthorized: the caller may not hint, see /kvrep/hints; rate_limited; "
                                "unreachable: no coordinator). The request is served whatever the outcome.",
                                ("outcome",), registry=reg)
        self.prefill_speed = Gauge("kvrep_router_prefill_speed_scale",
                                   "What the router multiplies its profile's prefill times by: the median measured / "
                                   "predicted time to first token of the requests that ran alone (1: not learned "
                                   "yet, or --no-speed-calibration).", registry=reg)
        self.prefill_speed.set(1.0)
        # copies on the critical path (`--pull`, radix_sync.router.pull)
        self.pulls_started = Counter("kvrep_router_pulls_started",
                                     "Copies on the critical path asked of the coordinator.", registry=reg)
        self.pulls_done = Counter("kvrep_router_pulls_done",
                                  "Pulls done before their deadline (the request went to the copy's target).",
                                  registry=reg)
        self.pulls_fallen_back = Counter("kvrep_router_pulls_fallen_back",
                                         "Pulls given up, by reason (refused, unreachable, failed, deadline, "
                                         "unknown_worker): the request went to the best option without a copy.",
                                         ("reason",), registry=reg)
        self.pull_wait_seconds = Histogram("kvrep_router_pull_wait_seconds",
                                           "Time a request waited for its pull, whatever the outcome.",
                                           buckets=PULL_WAIT_BUCKETS_S, registry=reg)

        self.peer_send_lag_seconds = Histogram(
            "kvrep_router_peer_send_lag_seconds",
            "From another router's send to this router counting it (the coordinator's send relay; wall clocks, so "
            "across hosts only as good as their clock sync).", buckets=PEER_LAG_BUCKETS_S, registry=reg)

    def render(self) -> bytes:
        """Returns: every series in the Prometheus text format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
