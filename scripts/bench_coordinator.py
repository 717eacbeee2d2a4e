"""How far one coordinator goes: facts ingested per second, plan-tick time, directory memory per page and admin
lookup latency under load, with synthetic workers over real ZMQ sockets to a real `kvrep coordinator` process
(no SGLang).

Phases, in one run:
  1. hello    : `--workers` DEALER sockets each say hello.
  2. ingest   : every worker reports its pages (`PagesStored`, `--blocks-per-msg` verified pages a message, chains
                root to leaf) as fast as the coordinator takes them; then one barrier fact a worker (a `SourceSent`
                for no replication: refused with an `Error` reply, which comes back only after every earlier fact
                of that worker was applied). Facts ingested/s = pages recorded / (first send .. last barrier reply).
  3. demand   : loads (a `--busy-fraction` of the workers with queued prefills) and prefix hits: `--hot` prefixes
                hit `--hits-per-hot` times each (each one a planner candidate) and `--cold-hits` single hits.
  4. tick     : the coordinator plans on its own tick (shadow mode: decisions are recorded, nothing is sent, so
                every tick plans the same demand again: the steady worst case); tick time is the mean of
                `kvrep_coordinator_tick_seconds` over `--ticks` ticks, from `/metrics`.
Throughout phases 2-4 one client thread looks prefixes up (`POST /directory/lookup`, the router's way, by page
hashes) back to back; latency percentiles are reported per phase. Memory: the coordinator's RSS after the hellos
and after the ingest, per page recorded.

The workload is built and encoded before anything is timed. The last two lines printed are the ingest rate and
the plan-tick time (what `--quick` is for):

    nice -n 19 .venv/bin/python scripts/bench_coordinator.py --quick              # 64 workers x 100,000 prefixes
    nice -n 19 .venv/bin/python scripts/bench_coordinator.py --workers 1000       # the 1,000-worker point
    nice -n 19 .venv/bin/python scripts/bench_coordinator.py --quick --json out.json
"""
from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from radix_sync import protocol as p  # noqa: E402
from radix_sync.hashing import chain_digest, digest_to_int64, namespace_seed  # noqa: E402
from kvrep_dev.cluster import Coordinator, http_json  # noqa: E402

BARRIER_ID = "bench-barrier"
"""The replication id of the barrier fact (no such replication: the coordinator refuses it with an Error)."""


@dataclass(frozen=True)
class Workload:
    num_workers: int = 64
    num_prefixes: int = 100_000
    """Distinct prefixes (chains) in the directory."""
    pages_per_prefix: int = 2
    holders: int = 2
    """Workers holding each prefix (so pages recorded = prefixes x pages_per_prefix x holders)."""
    page_size: int = 16
    num_namespaces: int = 8
    blocks_per_msg: int = 64
    """Pages one `PagesStored` carries (SGLang's events are flushed per scheduler iteration: tens of pages)."""
    num_hot: int = 1_000
    """Prefixes hit `hits_per_hot` times (each one a planner candidate: two or more recent hits)."""
    hits_per_hot: int = 4
    cold_hits: int = 16_000
    """Single hits on random prefixes (not candidates; the planner still reads them)."""
    busy_fraction: float = 0.25
    """Workers reporting queued prefills (the planner's candidates are worth scoring only with busy holders)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.num_workers <= 5000:
            raise ValueError(f"num_workers must be in [2, 5000], got {self.num_workers}")
        if not 1 <= self.holders <= self.num_workers:
            raise ValueError(f"holders must be in [1, num_workers], got {self.holders}")
        for name in ("num_prefixes", "pages_per_prefix", "page_size", "num_namespaces", "blocks_per_msg"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.num_hot <= self.num_prefixes or self.hits_per_hot < 2 or self.cold_hits < 0:
            raise ValueError("need 0 <= num_hot <= num_prefixes, hits_per_hot >= 2, cold_hits >= 0")
        if not 0.0 <= self.busy_fraction <= 1.0:
            raise ValueError(f"busy_fraction must be in [0, 1], got {self.busy_fraction}")
        if self.blocks_per_msg > p.MAX_PAGES_PER_MESSAGE:
            raise ValueError(f"blocks_per_msg must be <= {p.MAX_PAGES_PER_MESSAGE}")

    @property
    def num_holdings(self) -> int:
        """Pages the directory records: (page, worker) pairs."""
        return self.num_prefixes * self.pages_per_prefix * self.holders


@dataclass
class Prefix:
    namespace: str
    hashes: list[int]
    """Block hashes root to leaf."""
    blocks: list[p.BlockFact]
    holders: list[int]
    """Worker indices."""


def worker_id(i: int) -> str:
    return f"w{i:04d}"


def build_prefixes(wl: Workload) -> list[Prefix]:
    """Every prefix with its verified page hashes (SGLang's chained SHA-256, as the coordinator recomputes them)."""
    rng = random.Random(wl.seed)
    seeds = {f"t{n}": namespace_seed(f"t{n}") for n in range(wl.num_namespaces)}
    vocab = 32_000
    out = []
    stride = max(1, wl.num_workers // wl.holders)
    for i in range(wl.num_prefixes):
        ns = f"t{i % wl.num_namespaces}"
        prior, parent = seeds[ns], None
        hashes, blocks = [], []
        for _ in range(wl.pages_per_prefix):
            tokens = [rng.randrange(vocab) for _ in range(wl.page_size)]
            prior = chain_digest(prior, tokens)
            h = digest_to_int64(prior)
            blocks.append(p.BlockFact(h, parent, tokens))
            hashes.append(h)
            parent = h
        holders = [(i + j * stride) % wl.num_workers for j in range(wl.holders)]
        out.append(Prefix(ns, hashes, blocks, holders))
    return out


class SyntheticWorker:
    """One worker's socket and sequence numbers; messages are encoded ahead (`plan_*`) and sent later."""

    def __init__(self, ctx: zmq.Context, endpoint: str, index: int, wl: Workload) -> None:
        self.id = worker_id(index)
        self.index = index
        self.wl = wl
        self.seq = 0
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(endpoint)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def hello(self) -> bytes:
        return p.encode(p.Hello(worker_id=self.id, http_url=f"http://{self.id}", data_endpoint="tcp://127.0.0.1:1",
                                fingerprint="bench", fingerprint_fields={}, page_size=self.wl.page_size,
                                pool_capacity_tokens=1 << 24, replica_budget_tokens=1 << 20, vocab_size=32_000))

    def pages(self, chains: list[Prefix]) -> list[bytes]:
        """`PagesStored` messages of these chains, per namespace, at most `blocks_per_msg` pages each, a chain's
        pages root to leaf (a message may end mid-chain: the next one continues from a page already held)."""
        by_ns: dict[str, list[p.BlockFact]] = {}
        for c in chains:
            by_ns.setdefault(c.namespace, []).extend(c.blocks)
        out = []
        n = self.wl.blocks_per_msg
        for ns, blocks in sorted(by_ns.items()):
            for i in range(0, len(blocks), n):
                out.append(p.encode(p.PagesStored(worker_id=self.id, seq=self.next_seq(), namespace=ns,
                                                  blocks=blocks[i:i + n])))
        return out

    def load(self, busy: bool) -> bytes:
        q = 8 if busy else 0
        return p.encode(p.LoadReported(worker_id=self.id, seq=self.next_seq(), num_running_reqs=q,
                                       num_waiting_reqs=q, num_waiting_tokens=q * 2000,
                                       available_tokens=1 << 22, evictable_tokens=0, replica_tokens=0,
                                       iteration_s=0.05 if busy else 0.0))

    def hit(self, prefix: Prefix) -> bytes:
        length = len(prefix.hashes) * self.wl.page_size
        return p.encode(p.PrefixHit(worker_id=self.id, seq=self.next_seq(), namespace=prefix.namespace,
                                    block_hash=prefix.hashes[-1], matched_len=length, key_len=length + 8))

    def barrier(self) -> bytes:
        return p.encode(p.SourceSent(worker_id=self.id, seq=self.next_seq(), replication_id=BARRIER_ID,
                                     num_tokens=0, num_bytes=0, gather_s=0.0, send_s=0.0))


def interleave(per_worker: list[list[bytes]]) -> list[tuple[int, bytes]]:
    """Round-robin over the workers (as a fleet's facts arrive), keeping each worker's own order."""
    out = []
    for k in range(max((len(m) for m in per_worker), default=0)):
        for i, msgs in enumerate(per_worker):
            if k < len(msgs):
                out.append((i, msgs[k]))
    return out


def demand_messages(wl: Workload, prefixes: list[Prefix], workers: list[SyntheticWorker]
                    ) -> tuple[list[tuple[int, bytes]], int, int]:
    """Loads then hits (each from a holder of its prefix). Returns: (messages, hits, busy workers)."""
    rng = random.Random(wl.seed + 1)
    num_busy = round(wl.busy_fraction * wl.num_workers)
    busy = set(rng.sample(range(wl.num_workers), num_busy))
    loads = [(i, w.load(i in busy)) for i, w in enumerate(workers)]
    hot = rng.sample(range(wl.num_prefixes), wl.num_hot)
    hot_set = set(hot)
    targets = [i for i in hot for _ in range(wl.hits_per_hot)]
    cold_pool = [i for i in range(wl.num_prefixes) if i not in hot_set]
    targets += rng.sample(cold_pool, min(wl.cold_hits, len(cold_pool)))
    rng.shuffle(targets)
    hits = []
    for i in targets:
        pre = prefixes[i]
        w = workers[pre.holders[rng.randrange(len(pre.holders))]]
        hits.append((w.index, w.hit(pre)))
    return loads + hits, len(targets), num_busy


# --------------------------------------------------------------------------------------------- measuring
class Lookups(threading.Thread):
    """Back-to-back `POST /directory/lookup` by page hashes of random prefixes; latencies by phase."""

    def __init__(self, coord: Coordinator, prefixes: list[Prefix], page_size: int, seed: int) -> None:
        super().__init__(name="bench-lookups", daemon=True)
        self.coord, self.prefixes, self.page_size = coord, prefixes, page_size
        self.rng = random.Random(seed)
        self.phase = "idle"
        self.latencies: dict[str, list[float]] = {}
        self.errors = 0
        self.error_answers: dict[str, int] = {}
        """The failed lookups' answers: status and error, counted."""
        self._done = threading.Event()
        self._picked = threading.Event()

    def enter(self, phase: str, timeout_s: float = 10.0) -> None:
        """Start phase `phase` once a lookup is under way in it: a phase shorter than one lookup (a small run's
        ingest) still has its sample."""
        self._picked.clear()
        self.phase = phase
        if self.is_alive():
            self._picked.wait(timeout_s)

    def run(self) -> None:
        while not self._done.is_set():
            pre = self.prefixes[self.rng.randrange(len(self.prefixes))]
            phase = self.phase
            self._picked.set()
            t0 = time.perf_counter()
            status, body = http_json(self.coord.admin + "/directory/lookup",
                                     {"page_hashes": pre.hashes, "page_size": self.page_size},
                                     token=self.coord.tokens.write)  # the router's token: a lookup is a POST
            dt = time.perf_counter() - t0
            if status != 200:
                self.errors += 1
                what = f"{status} {(body or {}).get('error', '') if isinstance(body, dict) else ''}"[:200]
                self.error_answers[what] = self.error_answers.get(what, 0) + 1
            self.latencies.setdefault(phase, []).append(dt)
            self._done.wait(0.005)

    def stop(self) -> None:
        self._done.set()
        self.join(30)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def tick_totals(coord: Coordinator) -> tuple[float, int, float]:
    """(wall seconds, ticks, CPU seconds of the loop thread) of `kvrep_coordinator_tick_seconds` and
    `kvrep_coordinator_tick_cpu_seconds` so far."""
    import urllib.request

    req = urllib.request.Request(coord.admin + "/metrics", headers={"Authorization": f"Bearer {coord.tokens.read}"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        text = resp.read().decode()

    def value(name: str) -> float:
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
    return (value("kvrep_coordinator_tick_seconds_sum"), int(value("kvrep_coordinator_tick_seconds_count")),
            value("kvrep_coordinator_tick_cpu_seconds_sum"))


def send_all(workers: list[SyntheticWorker], msgs: list[tuple[int, bytes]]) -> None:
    for i, data in msgs:
        workers[i].sock.send(data)


def await_barrier(workers: list[SyntheticWorker], barriers: list[bytes], timeout_s: float) -> int:
    """Sends each worker's barrier fact (encoded in its turn: sequence numbers are in send order) and waits for
    every reply. Returns: unexpected replies (a fact refused: the count must be 0).

    Raises:
        RuntimeError: the coordinator asked a worker to resync (a sequence gap: the bench's own bug).
    """
    poller = zmq.Poller()
    for w, data in zip(workers, barriers):
        w.sock.send(data)
        poller.register(w.sock, zmq.POLLIN)
    waiting = {w.sock: w for w in workers}
    unexpected = 0
    deadline = time.monotonic() + timeout_s
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(waiting)} workers never got their barrier's reply")
        for sock, _ in poller.poll(left * 1000):
            msg = p.decode_for_worker(sock.recv())
            if isinstance(msg, p.Error) and msg.in_reply_to == "SourceSent" and BARRIER_ID in msg.error:
                poller.unregister(sock)
                waiting.pop(sock, None)
                continue
            if isinstance(msg, p.ResyncRequested):
                raise RuntimeError(f"{waiting[sock].id}: {msg.reason}")
            unexpected += 1
            print(f"  unexpected reply: {msg}", file=sys.stderr)
    return unexpected


def run(wl: Workload, num_ticks: int = 8, log_dir: Optional[Path] = None, quiet: bool = False,
        extra_args: tuple[str, ...] = ()) -> dict:
    """One run against a fresh coordinator process. Returns: the measurements and the counts they rest on."""
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    t_build = time.perf_counter()
    prefixes = build_prefixes(wl)
    say(f"built {wl.num_prefixes:,} prefixes ({wl.num_holdings:,} page holdings) in "
        f"{time.perf_counter() - t_build:.1f}s")
    tmp = tempfile.TemporaryDirectory(prefix="bench-coord-") if log_dir is None else None
    logs = Path(tmp.name) if tmp else log_dir
    coord = Coordinator(logs, extra_args=("--policy", "kvrep", "--mode", "shadow", "--worker-timeout-s", "3600",
                                          "--tick-s", "0.25", *extra_args))
    ctx = zmq.Context()
    workers: list[SyntheticWorker] = []
    lookups = None
    try:
        coord.wait_ready()
        workers = [SyntheticWorker(ctx, coord.endpoint, i, wl) for i in range(wl.num_workers)]
        for w in workers:
            w.sock.send(w.hello())
        for w in workers:
            assert w.sock.poll(60_000), f"{w.id}: no HelloAck"
            assert isinstance(p.decode_for_worker(w.sock.recv()), p.HelloAck)
        rss0 = rss_bytes(coord.pid)
        chains: list[list[Prefix]] = [[] for _ in workers]
        for pre in prefixes:
            for h in pre.holders:
                chains[h].append(pre)
        ingest = interleave([w.pages(c) for w, c in zip(workers, chains)])
        barriers1 = [w.barrier() for w in workers]
        demand, num_hits, num_busy = demand_messages(wl, prefixes, workers)
        barriers2 = [w.barrier() for w in workers]
        say(f"encoded {len(ingest):,} PagesStored and {len(demand):,} demand messages")
        lookups = Lookups(coord, prefixes, wl.page_size, wl.seed + 2)
        lookups.start()

        lookups.enter("ingest")
        t0 = time.perf_counter()
        send_all(workers, ingest)
        bad = await_barrier(workers, barriers1, timeout_s=600)
        ingest_s = time.perf_counter() - t0
        lookups.enter("status")
        t_status = time.perf_counter()
        status = coord.get("/status")[1]
        status_s = time.perf_counter() - t_status
        assert status["integrity"] == "ok", status["integrity"]
        rss1 = rss_bytes(coord.pid)
        num_pages = status["num_pages"]

        lookups.enter("demand")
        t0 = time.perf_counter()
        send_all(workers, demand)
        bad += await_barrier(workers, barriers2, timeout_s=600)
        demand_s = time.perf_counter() - t0

        lookups.enter("tick")
        s0, c0, cpu0 = tick_totals(coord)
        deadline = time.monotonic() + 600
        while True:
            time.sleep(0.2)
            s1, c1, cpu1 = tick_totals(coord)
            if c1 - c0 >= num_ticks or time.monotonic() > deadline:
                break
        status = coord.get("/status")[1]
        lookups.stop()
        refused = status["num_refused_facts"]
        num_facts = wl.num_holdings + num_hits + wl.num_workers
        out = {
            "workload": asdict(wl),
            "num_pages_recorded": num_pages,
            "num_holdings_expected": wl.num_holdings,
            "num_distinct_pages_expected": wl.num_prefixes * wl.pages_per_prefix,
            "num_ingest_messages": len(ingest),
            "num_hits": num_hits, "num_busy_workers": num_busy,
            "num_refused": {k: v for k, v in refused.items() if k != "SourceSent"},
            "num_barriers_refused": refused.get("SourceSent", 0),
            "num_unexpected_replies": bad,
            "num_tick_errors": status["num_tick_errors"],
            "status_ms": 1e3 * status_s,
            "ingest_s": ingest_s,
            "ingest_pages_per_s": wl.num_holdings / ingest_s,
            "ingest_msgs_per_s": len(ingest) / ingest_s,
            "demand_s": demand_s,
            "demand_facts_per_s": len(demand) / demand_s,
            "facts_total": num_facts,
            "num_ticks_measured": c1 - c0,
            "tick_ms": 1e3 * (s1 - s0) / max(1, c1 - c0),
            "tick_cpu_ms": 1e3 * (cpu1 - cpu0) / max(1, c1 - c0),
            "planner": status.get("planner"),
            "collector": status["loop"]["gc"],
            "rss_after_hello_bytes": rss0, "rss_after_ingest_bytes": rss1,
            "bytes_per_holding": (rss1 - rss0) / max(1, wl.num_holdings),
            "lookup_errors": lookups.errors,
            "lookup_error_answers": lookups.error_answers,
            "lookup_ms": {ph: {"n": len(xs), "p50": 1e3 * pct(xs, 0.5), "p99": 1e3 * pct(xs, 0.99),
                               "max": 1e3 * max(xs)}
                          for ph, xs in lookups.latencies.items() if xs},
        }
        return out
    finally:
        if lookups is not None and lookups.is_alive():
            lookups.stop()
        for w in workers:
            w.sock.close(0)
        ctx.term()
        coord.stop()
        if tmp is not None:
            tmp.cleanup()


def report(r: dict) -> None:
    wl = r["workload"]
    print(f"workers {wl['num_workers']}, prefixes {wl['num_prefixes']:,} x {wl['pages_per_prefix']} pages x "
          f"{wl['holders']} holders = {r['num_holdings_expected']:,} page holdings; directory records "
          f"{r['num_pages_recorded']:,} distinct pages (expected {r['num_distinct_pages_expected']:,}); "
          f"refused {r['num_refused'] or 'none'}, unexpected replies {r['num_unexpected_replies']}, "
          f"tick errors {r['num_tick_errors']}")
    print(f"directory memory: RSS {r['rss_after_hello_bytes'] / 2**20:.0f} -> "
          f"{r['rss_after_ingest_bytes'] / 2**20:.0f} MiB, {r['bytes_per_holding']:.0f} B per page holding")
    print(f"GET /status (integrity checked) after the ingest: {r['status_ms']:.0f} ms")
    if r["lookup_errors"]:
        print(f"lookup errors: {r['lookup_errors']} {r['lookup_error_answers']}")
    for ph, v in r["lookup_ms"].items():
        print(f"lookup under load [{ph:>12}]: n={v['n']:5d} p50 {v['p50']:8.2f} ms  p99 {v['p99']:8.2f} ms  "
              f"max {v['max']:8.2f} ms")
    print(f"demand: {r['num_hits']:,} hits + loads ({r['num_busy_workers']} busy workers) at "
          f"{r['demand_facts_per_s']:,.0f} facts/s; planner {r['planner']}")
    gc_ = r["collector"]
    if gc_.get("paced") is False:
        print("cycle collector: Python's own schedule (--gc-thorough-every-s 0)")
    else:
        print(f"cycle collector: paced, {gc_['settles']} ticks settled ({gc_['young_freed']:,} objects of cycles "
              f"made in them freed before freezing, longest {gc_['young_ms']['max']:.1f} ms"
              + (f"; {gc_['frozen_at_thorough']:,} frozen at the last thorough pass" if gc_['thorough_passes'] else "")
              + "); "
              f"{gc_['thorough_passes']} thorough passes (every {gc_['thorough_every_s']:g} s; longest "
              f"{gc_['thorough_ms']['max']:.1f} ms, {gc_['freed']['total']:,} objects freed)")
    print(f"ingest: {r['ingest_pages_per_s']:,.0f} facts/s ({r['num_holdings_expected']:,} pages in "
          f"{r['ingest_s']:.2f}s, {r['ingest_msgs_per_s']:,.0f} msgs/s) [target >= 200,000]")
    print(f"plan tick: {r['tick_ms']:.1f} ms (mean of {r['num_ticks_measured']} ticks, {wl['num_workers']} workers, "
          f"{wl['num_prefixes']:,} prefixes, {wl['num_hot']:,} candidates) [target <= 10 ms]; the loop thread's "
          f"CPU in it {r['tick_cpu_ms']:.1f} ms (the rest: waits for the GIL, the state lock and the cores)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Workload()
    ap.add_argument("--quick", action="store_true",
                    help="the target point (64 workers x 100,000 prefixes), 4 ticks: under a minute")
    ap.add_argument("--workers", type=int, default=d.num_workers)
    ap.add_argument("--prefixes", type=int, default=d.num_prefixes)
    ap.add_argument("--pages-per-prefix", type=int, default=d.pages_per_prefix)
    ap.add_argument("--holders", type=int, default=d.holders)
    ap.add_argument("--blocks-per-msg", type=int, default=d.blocks_per_msg)
    ap.add_argument("--hot", type=int, default=d.num_hot, help="planner candidates (prefixes hit >= 2 times)")
    ap.add_argument("--hits-per-hot", type=int, default=d.hits_per_hot)
    ap.add_argument("--cold-hits", type=int, default=d.cold_hits)
    ap.add_argument("--busy-fraction", type=float, default=d.busy_fraction)
    ap.add_argument("--ticks", type=int, default=8)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--coordinator-arg", action="append", default=[],
                    help="one more `kvrep coordinator` flag (repeat), e.g. --coordinator-arg=--max-plan-candidates=64")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    # a SIGTERM (`timeout`) unwinds like Ctrl-C, so the coordinator process is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wl = Workload(num_workers=args.workers, num_prefixes=args.prefixes, pages_per_prefix=args.pages_per_prefix,
                  holders=args.holders, blocks_per_msg=args.blocks_per_msg, num_hot=args.hot,
                  hits_per_hot=args.hits_per_hot, cold_hits=args.cold_hits, busy_fraction=args.busy_fraction,
                  seed=args.seed)
    r = run(wl, num_ticks=4 if args.quick else args.ticks, extra_args=tuple(args.coordinator_arg))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    report(r)


if __name__ == "__main__":
    main()
