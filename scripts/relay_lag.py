"""How fast the routers of one coordinator learn each other's sends (the send relay, `radix_sync.coordinator.relay`),
and what relaying costs a request, live: real router and coordinator processes, stub workers (no SGLang).

Per round, the same open-loop (Poisson) request list goes through `--routers` routers in turn (request k through
router k mod N) twice, relay on and relay off (`--no-peer-sends`), in alternating order; the routers are started
afresh for each arm. Printed per round and pooled: the relay lag (another router's `sent` event to this router
counting it: the `kvrep_router_peer_send_lag_seconds` histograms of every router, summed; buckets, so a quantile is
"at most" its bucket's upper end), events posted and dropped, and the client's latency through the routers, on/off
ratio of the median and P99. The simulator's design study (docs/bench.md "Many routers, one directory, in the
simulator") found a relay within ~5 ms takes back most of what several routers cost.

    .venv/bin/python scripts/relay_lag.py --routers 4 --rate 200 --num-requests 2000 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrep_dev.cluster import Coordinator, Proc, Router, free_port, local_keys  # noqa: E402

METRIC = "kvrep_router_peer_send_lag_seconds"


def stub(name: str, logs: Path, key: str, delay_s: float) -> Proc:
    port = free_port()
    proc = Proc(f"stub-{name}", [sys.executable, "-m", "kvrep_dev.stub_worker", "--port", str(port), "--name", name,
                                 "--delay-s", str(delay_s), "--api-key", key], logs / f"stub-{name}.log")
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def histogram(routers: list[Router]) -> tuple[list[tuple[float, float]], float]:
    """Returns: the routers' lag histograms summed: [(upper bound, cumulative count)], and the sum of lags."""
    buckets: dict[float, float] = {}
    total = 0.0
    for r in routers:
        req = urllib.request.Request(r.url + "/metrics", headers=r.admin())
        text = urllib.request.urlopen(req, timeout=10).read().decode()
        for fam in text_string_to_metric_families(text):
            if fam.name != METRIC:
                continue
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
                elif s.name.endswith("_sum"):
                    total += s.value
    return sorted(buckets.items()), total


def quantile_bound(hist: list[tuple[float, float]], q: float) -> float:
    """Returns: the upper end of the bucket holding quantile `q` (inf past the last finite one)."""
    n = hist[-1][1] if hist else 0.0
    for le, count in hist:
        if n and count >= q * n:
            return le
    return float("nan")


async def drive(urls: list[str], prompts: list[list[int]], gaps: list[float]) -> list[float]:
    lat: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(k: int) -> None:
            t0 = time.perf_counter()
            body = {"input_ids": prompts[k], "sampling_params": {"max_new_tokens": 4}}
            async with session.post(urls[k % len(urls)] + "/generate", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}")
            lat.append(time.perf_counter() - t0)

        tasks = []
        for k, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(k)))
        await asyncio.gather(*tasks)
    return lat


def arm(relay: bool, args, tmp: Path, keys: Path, coord: Coordinator, workers: tuple[str, ...],
        prompts, gaps) -> dict:
    extra = () if relay else ("--no-peer-sends",)
    routers = [Router(tmp, keys, coordinator=coord, workers=workers, name=f"router-{i}-{int(relay)}",
                      extra_args=extra) for i in range(args.routers)]
    try:
        for r in routers:
            r.wait_http(r.url + "/health", 30)
        asyncio.run(drive([r.url for r in routers], prompts[:len(routers)], [0.0] * len(routers)))  # (all serving)
        if relay:
            deadline = time.monotonic() + 30
            while not all(r.status(0)["coordinator"]["send_relay"]["routers"] >= args.routers for r in routers):
                if time.monotonic() > deadline:
                    raise TimeoutError("the routers did not all join the send relay")
                time.sleep(0.1)
        lat = asyncio.run(drive([r.url for r in routers], prompts, gaps))
        time.sleep(0.5)
        hist, total = histogram(routers)
        relays = [r.status(0)["coordinator"]["send_relay"] for r in routers]
    finally:
        for r in routers:
            r.stop(5)
    n = hist[-1][1] if hist else 0.0
    out = {"relay": relay, "p50_s": statistics.median(lat), "p99_s": sorted(lat)[int(0.99 * len(lat))],
           "lag_events": n, "posted": sum(x["posted"] for x in relays), "dropped": sum(x["dropped"] for x in relays),
           "posts": sum(x.get("posts", 0) for x in relays),
           "answers": sum(x["peers"].get("answers", 0) for x in relays)}
    if n:
        out.update(lag_mean_s=total / n, lag_p50_le_s=quantile_bound(hist, 0.5),
                   lag_p99_le_s=quantile_bound(hist, 0.99),
                   lag_le={str(le): round(c / n, 4) for le, c in hist})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=200.0, help="requests/s over all routers (open loop, Poisson)")
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--delay-s", type=float, default=0.005, help="stub workers' time per output token (4 tokens)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="relay-lag-"))
    keys = local_keys(tmp / "keys")
    key = (keys / "worker-api-key").read_text().strip()
    coord = Coordinator(tmp, extra_args=("--policy", "none"))
    stubs = [stub(n, tmp, key, args.delay_s) for n in ("A", "B")]
    rows = []
    try:
        coord.wait_ready()
        for s in stubs:
            s.wait_http(s.url + "/health", 30)
        for rnd_i in range(args.rounds):
            prompts = [[rnd.randrange(1, 30000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
            gaps = [rnd.expovariate(args.rate) for _ in range(args.num_requests)]
            order = (True, False) if rnd_i % 2 == 0 else (False, True)
            res = {on: arm(on, args, tmp, keys, coord, tuple(s.url for s in stubs), prompts, gaps) for on in order}
            on, off = res[True], res[False]
            row = {"round": rnd_i, "on": on, "off": off, "p50_ratio": on["p50_s"] / off["p50_s"],
                   "p99_ratio": on["p99_s"] / off["p99_s"]}
            rows.append(row)
            nan = float("nan")
            print(f"round {rnd_i}: lag mean {on.get('lag_mean_s', nan) * 1e3:.2f} ms, p50 <= "
                  f"{on.get('lag_p50_le_s', nan) * 1e3:g} ms, p99 <= {on.get('lag_p99_le_s', nan) * 1e3:g} ms over "
                  f"{on['lag_events']:.0f} events ({on['posted']} posted in {on['posts']} posts, {on['answers']} feed "
                  f"answers, {on['dropped']} dropped); "
                  f"latency on/off p50 {row['p50_ratio']:.3f}x p99 {row['p99_ratio']:.3f}x "
                  f"(off p50 {off['p50_s'] * 1e3:.1f} ms, p99 {off['p99_s'] * 1e3:.1f} ms)", flush=True)
    finally:
        for s in stubs:
            s.stop(5)
        coord.stop(5)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
