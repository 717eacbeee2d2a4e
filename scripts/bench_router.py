"""Routing overhead of `kvrep router`: decision time and proxy overhead at P50/P99 against stub workers.

One run, three phases at the same open-loop (Poisson) rate and the same requests (`/generate` with token ids,
`--num-prefixes` shared prefixes so the directory and the router's own view have something to match):
  1. direct   : client -> stub worker (the baseline);
  2. own-view : client -> router (static --worker list, no coordinator: the fallback rule) -> stub;
  3. directory: client -> router -> stub, with a real coordinator process whose directory fake agents filled
                (each decision is a loopback lookup at the coordinator plus the TTFT rule).
Overhead = router latency percentile - direct latency percentile; decision time comes from the router's
`x-kvrep-decision-us` answer header (tokenize + lookup + policy). Everything shares this machine's cores, so
absolute numbers include contention; compare phases of the same run.

    .venv/bin/python scripts/bench_router.py --rate 1000 --num-requests 5000
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from radix_sync import protocol as p  # noqa: E402
from radix_sync.hashing import page_hashes  # noqa: E402
from kvrep_dev.cluster import Coordinator, Proc, bearer, free_port, http_json, local_keys  # noqa: E402

PAGE = 16


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start(name: str, argv: list[str], logs: Path) -> Proc:
    return Proc(name, [sys.executable, *argv], logs / f"{name}.log")


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http_json(url, timeout=1)[0] == 200:
                return
        except (OSError, ValueError):  # not up yet, or a non-JSON health answer from a stub
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
        time.sleep(0.1)
    raise TimeoutError(url)


def fallbacks(router_url: str, headers: dict) -> int:
    """Returns: the router's count of decisions made without the coordinator's directory."""
    with urllib.request.urlopen(urllib.request.Request(router_url + "/metrics", headers=headers), timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("kvrep_router_fallback_decisions_total "):
                return int(float(line.split()[1]))
    return 0


def register(coord: Coordinator, wid: str, url: str, prompts: list[list[int]]) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(coord.endpoint)
    sock.send(p.encode(p.Hello(worker_id=wid, http_url=url, data_endpoint="tcp://127.0.0.1:1", fingerprint="f",
                               fingerprint_fields={}, page_size=PAGE, pool_capacity_tokens=1 << 20,
                               replica_budget_tokens=1 << 18)))
    assert sock.poll(5000)
    sock.recv()
    for seq, tokens in enumerate(prompts, 1):
        hashes = page_hashes(tokens, PAGE)
        blocks = [p.BlockFact(h, par, tokens[i * PAGE:(i + 1) * PAGE])
                  for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]
        sock.send(p.encode(p.PagesStored(worker_id=wid, seq=seq, namespace="", blocks=blocks)))
    return sock


async def run_phase(url: str, bodies: list[dict], rate: float, seed: int) -> tuple[list[float], list[float], int]:
    """Open loop: requests start at Poisson times regardless of answers. Returns latencies, decision times, errors."""
    rng = random.Random(seed)
    lat, dec, errors = [], [], 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def one(body: dict) -> None:
            nonlocal errors
            t0 = time.perf_counter()
            try:
                async with session.post(url + "/generate", json=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors += 1
                        return
                    if "x-kvrep-decision-us" in resp.headers:
                        dec.append(int(resp.headers["x-kvrep-decision-us"]) / 1e6)
            except aiohttp.ClientError:
                errors += 1
                return
            lat.append(time.perf_counter() - t0)

        tasks, t_next = [], time.perf_counter()
        for body in bodies:
            t_next += rng.expovariate(rate)
            delay = t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(body)))
        await asyncio.gather(*tasks)
    return lat, dec, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1000.0, help="requests/s (open loop, Poisson)")
    ap.add_argument("--num-requests", type=int, default=5000)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--num-prefixes", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--logs", default=str(ROOT / "logs" / "bench_router"))
    args = ap.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 30000) for _ in range(args.prompt_len - 32)] for _ in range(args.num_prefixes)]
    bodies = [{"input_ids": rng.choice(prefixes) + [rng.randrange(10, 30000) for _ in range(32)],
               "sampling_params": {"max_new_tokens": 1}} for _ in range(args.num_requests + args.warmup)]
    stubs = {name: (free_port(), None) for name in ("A", "B")}
    procs, socks = [], []
    try:
        for name, (port, _) in stubs.items():
            procs.append(start(f"stub-{name}", ["-m", "kvrep_dev.stub_worker", "--port", str(port),
                                                "--name", name, "--num-tokens", "1"], logs))
        urls = [f"http://127.0.0.1:{port}" for port, _ in stubs.values()]
        coord = Coordinator(logs, extra_args=("--policy", "none", "--worker-timeout-s", "3600"))
        procs.append(coord)
        coord.wait_ready()
        for i, (name, url) in enumerate(zip(stubs, urls)):
            socks.append(register(coord, f"w{name}", url, prefixes[i::2]))
        r_own, r_dir = free_port(), free_port()
        keys = local_keys(logs / "keys")  # the routers' admin tokens (for /metrics)
        common = ["-m", "radix_sync.cli", "router", "--tokenizer", "none", "--log-level", "WARNING",
                  "--state-dir", str(keys), "--admin-tokens", str(keys / "router-tokens.json")]
        procs.append(start("router-own", [*common, "--port", str(r_own), *sum((["--worker", u] for u in urls), [])],
                           logs))
        procs.append(start("router-dir", [*common, "--port", str(r_dir), *coord.router_args()], logs))
        for url in [*urls, f"http://127.0.0.1:{r_own}", f"http://127.0.0.1:{r_dir}"]:
            wait_http(url + "/health")
        phases = [("direct", urls[0]), ("own-view", f"http://127.0.0.1:{r_own}"),
                  ("directory", f"http://127.0.0.1:{r_dir}")]
        results, num_fallbacks = {}, {}
        read = bearer(keys / "router-tokens.json")
        for i, (name, url) in enumerate(phases):
            asyncio.run(run_phase(url, bodies[:args.warmup], args.rate, 100 + i))
            before = fallbacks(url, read) if name != "direct" else 0
            results[name] = asyncio.run(run_phase(url, bodies[args.warmup:], args.rate, 1))
            num_fallbacks[name] = fallbacks(url, read) - before if name != "direct" else 0
        base_lat = results["direct"][0]
        cmd = "python scripts/bench_router.py " + " ".join(sys.argv[1:])
        print(f"$ {cmd}")
        print(f"{args.num_requests} requests/phase at {args.rate:g} req/s (Poisson, open loop), prompt "
              f"{args.prompt_len} tokens, {args.num_prefixes} shared prefixes, 2 stub workers, 1 output token")
        print(f"{'phase':<10} {'lat P50 ms':>10} {'lat P99 ms':>10} {'overhead P50':>12} {'overhead P99':>12} "
              f"{'decision P50':>12} {'decision P99':>12} {'ratio P50':>9} {'errors':>6} {'own-view decisions':>18}")
        for name, (lat, dec, errors) in results.items():
            p50, p99 = pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3
            o50, o99 = p50 - pct(base_lat, 0.5) * 1e3, p99 - pct(base_lat, 0.99) * 1e3
            d50 = f"{pct(dec, 0.5) * 1e3:.3f}" if dec else "-"
            d99 = f"{pct(dec, 0.99) * 1e3:.3f}" if dec else "-"
            print(f"{name:<10} {p50:>10.3f} {p99:>10.3f} {o50:>12.3f} {o99:>12.3f} {d50:>12} {d99:>12} "
                  f"{p50 / (pct(base_lat, 0.5) * 1e3):>8.2f}x {errors:>6} {num_fallbacks[name]:>18}")
        print(f"(ms; overhead = phase percentile - direct percentile; mean latency direct "
              f"{statistics.mean(base_lat) * 1e3:.3f} ms; own-view decisions in the directory phase = lookups "
              f"that failed or were skipped while the coordinator was backing off)")
        return 0
    finally:
        for s in socks:
            s.close(0)
        for proc in reversed(procs):
            proc.stop(5)


if __name__ == "__main__":
    sys.exit(main())
