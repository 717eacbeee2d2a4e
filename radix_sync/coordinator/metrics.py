"""The coordinator's own numbers: loop timing (for `/status`) and its Prometheus metrics (for `GET /metrics`).

`LoopStats` is written by the ZMQ loop thread (`server.Coordinator`) only. `CoordinatorMetrics` holds one
`CollectorRegistry` per coordinator (several coordinators in one process, as in tests, never share metrics); the
state's numbers are read at scrape time under the coordinator's lock, so the loop pays nothing for them.
Every name starts with `kvrep_coordinator_`.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from radix_sync.coordinator.replications import STATES

_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopStats:
    """How long the ZMQ loop spends planning and handling worker messages (the loop does both on one thread:
    a slow tick delays every worker fact behind it). Written by the loop thread, read under no lock."""

    def __init__(self, registry: CollectorRegistry, keep: int = 256) -> None:
        self.tick_s: deque[float] = deque(maxlen=keep)
        self.tick_cpu_s: deque[float] = deque(maxlen=keep)
        """CPU time of the loop thread in each tick: the tick's own work, without what it waited for (the GIL or
        the state lock held by the admin thread, the cores held by other processes)."""
        self.batch_s: deque[float] = deque(maxlen=keep)
        self.num_ticks = 0
        self.num_messages = 0
        self.max_tick_s = 0.0
        self.max_batch_s = 0.0
        self.num_facts: dict[str, int] = {}
        """Worker messages decoded, by type (`Hello`, `PagesStored`, ...)."""
        self._tick_hist = Histogram("kvrep_coordinator_tick_seconds", "Time of one policy and timer tick",
                                    buckets=_SECONDS_BUCKETS, registry=registry)
        self._tick_cpu_hist = Histogram("kvrep_coordinator_tick_cpu_seconds",
                                        "CPU time of the loop thread in one policy and timer tick (its own work; "
                                        "the wall time less waits for the GIL, the state lock and the cores)",
                                        buckets=_SECONDS_BUCKETS, registry=registry)
        self.gc_pacer = None
        """The process's `radix_sync.gc_pacing.GcPacer` when the coordinator paces the collector (`/status` shows it)."""
        self._gc_hist = Histogram("kvrep_coordinator_gc_thorough_seconds",
                                  "Pause of the loop thread for one thorough collection of the whole heap (only when "
                                  "the collector is paced: --gc-thorough-every-s)",
                                  buckets=_SECONDS_BUCKETS, registry=registry)
        self._batch_hist = Histogram("kvrep_coordinator_batch_seconds",
                                     "Time to handle one batch of worker messages (up to 1,000)",
                                     buckets=_SECONDS_BUCKETS, registry=registry)

    def tick(self, seconds: float, cpu_seconds: float) -> None:
        """One tick: its wall time and its thread's CPU time (`time.thread_time`), s."""
        self.tick_s.append(seconds)
        self.tick_cpu_s.append(cpu_seconds)
        self.num_ticks += 1
        self.max_tick_s = max(self.max_tick_s, seconds)
        self._tick_hist.observe(seconds)
        self._tick_cpu_hist.observe(cpu_seconds)

    def gc_pause(self, seconds: float) -> None:
        """After a tick, the collector pacer's thorough pass took `seconds` (0.0: none ran)."""
        if seconds > 0:
            self._gc_hist.observe(seconds)

    def batch(self, n: int, seconds: float) -> None:
        self.batch_s.append(seconds)
        self.num_messages += n
        self.max_batch_s = max(self.max_batch_s, seconds)
        self._batch_hist.observe(seconds)

    def fact(self, kind: str) -> None:
        self.num_facts[kind] = self.num_facts.get(kind, 0) + 1

    def summary(self) -> dict:
        def ms(xs: list[float], q: float) -> float:
            return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2) if xs else 0.0
        ticks, batches, cpu = list(self.tick_s), list(self.batch_s), list(self.tick_cpu_s)
        return {"ticks": self.num_ticks, "messages": self.num_messages,
                "tick_ms": {"p50": ms(ticks, 0.5), "p99": ms(ticks, 0.99), "max": round(self.max_tick_s * 1e3, 2)},
                "tick_cpu_ms": {"p50": ms(cpu, 0.5), "p99": ms(cpu, 0.99)},
                "batch_ms": {"p50": ms(batches, 0.5), "p99": ms(batches, 0.99),
                             "max": round(self.max_batch_s * 1e3, 2)},
                "gc": self.gc_pacer.summary() if self.gc_pacer is not None else {"paced": False}}


class _StateCollector:
    """The state's numbers, read under the coordinator's lock when scraped. `coord`: the `server.Coordinator`
    (not imported: the server imports this module)."""

    def __init__(self, coord) -> None:
        self.coord = coord

    def collect(self) -> Iterator[Metric]:
        coord = self.coord
        with coord.lock:
            st = coord.state
            num_workers, num_pages = len(st.workers), st.directory.num_pages()
            by_state = dict.fromkeys(STATES, 0)
            for rep in st.replications.values():
                by_state[rep.state] = by_state.get(rep.state, 0) + 1
            num_errors, demotions = st.num_protocol_errors, dict(coord.num_demotions)
            refused, tick_errors = dict(st.num_refused_facts), coord.num_tick_errors
            num_arrivals, num_finishes, num_hints = len(st.arrivals), len(st.finishes), len(st.hints)
            policy, mode = coord.policy.name, coord.mode
        facts = dict(coord.loop_stats.num_facts)  # a C-level copy: safe against the loop thread's inserts

        yield GaugeMetricFamily("kvrep_coordinator_workers", "Workers registered (said hello, not silent)",
                                value=num_workers)
        yield GaugeMetricFamily("kvrep_coordinator_directory_pages", "Distinct pages in the directory",
                                value=num_pages)
        reps = GaugeMetricFamily("kvrep_coordinator_replications", "Replications kept, by state",
                                 labels=["state"])
        for state, n in by_state.items():
            reps.add_metric([state], n)
        yield reps
        yield CounterMetricFamily("kvrep_coordinator_protocol_errors",
                                  "Worker messages refused as malformed", value=num_errors)
        ref = CounterMetricFamily("kvrep_coordinator_refused_facts",
                                  "Worker facts refused after decoding (unverifiable pages, not a party, expired), "
                                  "by type", labels=["type"])
        for kind, n in sorted(refused.items()):
            ref.add_metric([kind], n)
        yield ref
        yield CounterMetricFamily("kvrep_coordinator_tick_errors",
                                  "Policy ticks that raised (logged; the coordinator kept serving)", value=tick_errors)
        fam = CounterMetricFamily("kvrep_coordinator_facts", "Worker messages decoded, by type", labels=["type"])
        for kind, n in sorted(facts.items()):
            fam.add_metric([kind], n)
        yield fam
        dem = CounterMetricFamily("kvrep_coordinator_demotions",
                                  "Demotions sent to workers, or only counted in shadow mode", labels=["how"])
        for how, n in sorted(demotions.items()):
            dem.add_metric([how], n)
        yield dem
        demand = GaugeMetricFamily("kvrep_coordinator_demand_records",
                                   "Demand signals in the policy's window, by kind", labels=["kind"])
        for kind, n in (("arrival", num_arrivals), ("finish", num_finishes), ("hint", num_hints)):
            demand.add_metric([kind], n)
        yield demand
        info = GaugeMetricFamily("kvrep_coordinator_policy", "The policy running (1) and its mode",
                                 labels=["policy", "mode"])
        info.add_metric([policy, mode], 1)
        yield info


class CoordinatorMetrics:
    """One coordinator's Prometheus registry: loop histograms plus the state's numbers."""

    def __init__(self, coord) -> None:
        self.registry = CollectorRegistry()
        self.loop = LoopStats(self.registry)
        self.registry.register(_StateCollector(coord))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
