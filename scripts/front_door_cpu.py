"""CPU time a front door (our router, smg) and the processes beside it spend per request, and the TTFT through it.

Sends `--requests` streamed `/generate` requests sharing a ~1,900-token prefix (a distinct tail each) at `--rate`
a second (Poisson) to `--url`, and reads each process's CPU time (every thread, `/proc/PID/task/*/stat`) before and
after (this client's own included; `--idle-s`: less what each uses when idle). With a `kvrep up` cluster and smg 1.13 started in front of the same workers:

    .venv/bin/kvrep up --workers 2 --model wide --logs /tmp/up &        # prints the router and worker URLs
    .venv/bin/python -m smg.launch_router --host 127.0.0.1 --port 18888 --policy cache_aware \\
        --worker-urls W0 W1 --prometheus-port 18889 --api-key "$(cat /tmp/up/keys/worker-api-key)" &
    .venv/bin/python scripts/front_door_cpu.py --url ROUTER --pids router=PID,coord=PID,smg=PID
    .venv/bin/python scripts/front_door_cpu.py --url http://127.0.0.1:18888 \\
        --api-key-file /tmp/up/keys/worker-api-key --pids router=PID,coord=PID,smg=PID
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of `pid`."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def run(url: str, key: str, n: int, rate: float, pids: dict[str, int], seed: int, idle_s: float = 0.0) -> None:
    import aiohttp

    rnd = random.Random(seed)
    shared = " ".join(rnd.choice(WORDS) for _ in range(900))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    ttfts: list[float] = []

    async def one(session, text: str) -> None:
        body = {"text": text, "stream": True,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
        start, first = time.perf_counter(), None
        async with session.post(url + "/generate", json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for line in resp.content:
                if first is None and line.startswith(b"data:"):
                    first = time.perf_counter() - start
        ttfts.append(first if first is not None else float("nan"))

    pids = {**pids, "client": os.getpid()}
    idle = {k: 0.0 for k in pids}
    if idle_s > 0:  # each process's CPU with no request: polling loops, timers (subtracted below)
        i0, t = {k: cpu_s(p) for k, p in pids.items()}, time.monotonic()
        await asyncio.sleep(idle_s)
        span = time.monotonic() - t
        idle = {k: (cpu_s(p) - i0[k]) / span for k, p in pids.items()}
    async with aiohttp.ClientSession() as session:
        before, t0 = {k: cpu_s(p) for k, p in pids.items()}, time.monotonic()
        tasks = []
        for i in range(n):
            tail = " ".join(rnd.choice(WORDS) for _ in range(30))
            tasks.append(asyncio.create_task(one(session, f"{shared} q{i} {tail}")))
            await asyncio.sleep(rnd.expovariate(rate))
        await asyncio.gather(*tasks)
        wall, after = time.monotonic() - t0, {k: cpu_s(p) for k, p in pids.items()}
    ms = sorted(t * 1000 for t in ttfts)
    print(f"{url}: {n} requests in {wall:.1f} s; TTFT median {statistics.median(ms):.1f} ms, "
          f"mean {statistics.fmean(ms):.1f} ms")
    total = 0.0
    for k in pids:
        used = after[k] - before[k]
        extra = used - idle[k] * wall
        total += extra
        print(f"  {k:10s} {used:6.2f} s CPU   {used / n * 1000:6.2f} ms a request"
              + (f"   idle {idle[k]:.3f} cores; above idle {extra / n * 1000:6.2f} ms a request" if idle_s > 0 else ""))
    if idle_s > 0:
        print(f"  every process above idle: {total / n * 1000:.2f} ms a request")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the front door's base URL")
    p.add_argument("--api-key-file", help="a file with the key the front door wants (smg: the workers' key)")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--rate", type=float, default=4.0, help="requests a second (Poisson)")
    p.add_argument("--pids", required=True, help="NAME=PID,... the processes whose CPU time to count")
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--idle-s", type=float, default=0.0,
                   help="first measure each process's CPU this long with no request, and subtract it (0: do not)")
    args = p.parse_args()
    pids = {name: int(pid) for name, pid in (x.split("=", 1) for x in args.pids.split(","))}
    key = open(args.api_key_file).read().strip() if args.api_key_file else ""
    asyncio.run(run(args.url, key, args.requests, args.rate, pids, args.seed, args.idle_s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
