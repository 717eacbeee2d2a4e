"""Do several routers send a burst's requests to the same worker? Live: real router and coordinator processes, stub
workers (no SGLang) that the coordinator knows as idle and holding nothing, so every fresh prompt ties on expected
TTFT at every worker.

Per round, the same bursts go through `--routers` routers (request j of a burst through router j mod N, the burst's
requests a fraction of a millisecond apart, bursts `--gap-s` apart, open loop: with short answers, `--tokens 2`, each
burst finds the workers drained; with long ones they overlap and find the workers' loads unequal) twice: ties drawn
(the default, `--tie-draws`: each router takes the less loaded of two tied workers it draws at random while the
send relay says others serve; with the stubs equally loaded, a random one) and not (`--no-tie-draws`: by the load and turn every router shares, as before stop 58),
order alternating, routers started afresh per arm. Both relay their sends (the default). Printed per round and
pooled: the share of requests sent to a worker that another request of the same burst went to (`collisions`: 0 for a
burst no larger than the workers spread perfectly, 1 for every burst on one worker; uniform random choices share with
probability 1 - (1 - 1/W)^(B-1) for W workers and bursts of B: 0.58 at 4 and 4), and of the decisions the routers
logged (their last 256 each), how many drew their ties (`ties: drawn`).

    .venv/bin/python scripts/tie_herd.py --routers 4 --workers 4 --bursts 150 --rounds 3
    .venv/bin/python scripts/tie_herd.py --routers 4 --workers 4 --bursts 300 --gap-s 0.05 --tokens 50 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvrep_dev.cluster import Coordinator, Router, local_keys  # noqa: E402
from radix_sync import protocol as p  # noqa: E402
from relay_lag import stub  # noqa: E402

PAGE = 16
STUB_TOKEN_S = 0.002
"""The stubs' time per output token."""


def hello(coord: Coordinator, wid: str, url: str) -> zmq.Socket:
    """Registers stub `url` as worker `wid` with the coordinator (what a worker's agent says first); the socket is
    kept open (the worker stays known)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(coord.endpoint)
    sock.send(p.encode(p.Hello(worker_id=wid, http_url=url, data_endpoint="tcp://127.0.0.1:1", fingerprint="f",
                               fingerprint_fields={}, page_size=PAGE, pool_capacity_tokens=100_000,
                               replica_budget_tokens=25_000)))
    if not (sock.poll(10_000) and isinstance(p.decode_for_worker(sock.recv()), p.HelloAck)):
        raise RuntimeError(f"the coordinator did not accept {wid}")
    return sock


def collisions(served: list[list[str]]) -> float:
    """Returns: the share of requests sent to a worker another request of the same burst was also sent to."""
    shared = sum(c for burst in served for c in Counter(burst).values() if c > 1)
    return shared / max(1, sum(map(len, served)))


async def drive(urls: list[str], bursts: list[list[list[int]]], gap_s: float, tokens: int) -> list[list[str]]:
    """Sends each burst (request j through urls[j mod N], all at once), `gap_s` after the one before (open loop:
    earlier answers may still be streaming, each `tokens` outputs long). Returns: per burst, the worker that served
    each request."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(url: str, prompt: list[int]) -> str:
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": tokens}}
            async with session.post(url + "/generate", json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {data}")
                return data["meta_info"]["served_by"]

        tasks = []
        for burst in bursts:
            tasks.append(asyncio.gather(*(one(urls[j % len(urls)], q) for j, q in enumerate(burst))))
            await asyncio.sleep(gap_s)
        return [list(x) for x in await asyncio.gather(*tasks)]


def arm(draws: bool, args, tmp: Path, keys: Path, coord: Coordinator, workers: tuple[str, ...], bursts) -> dict:
    extra = () if draws else ("--no-tie-draws",)
    routers = [Router(tmp, keys, coordinator=coord, workers=workers, name=f"router-{i}-{int(draws)}",
                      extra_args=extra) for i in range(args.routers)]
    try:
        for r in routers:
            r.wait_http(r.url + "/health", 30)
        warm = [[[random.randrange(1, 30000) for _ in range(64)] for _ in routers]]
        asyncio.run(drive([r.url for r in routers], warm, 0.0, 2))  # (every router serving: on the relay)
        deadline = time.monotonic() + 30
        while not all(r.status(0)["coordinator"]["send_relay"]["routers"] >= args.routers for r in routers):
            if time.monotonic() > deadline:
                raise TimeoutError("the routers did not all join the send relay")
            time.sleep(0.1)
        time.sleep(0.5)
        served = asyncio.run(drive([r.url for r in routers], bursts, args.gap_s, args.tokens))
        decisions = [d for r in routers for d in r.status(256)["last_decisions"]]
    finally:
        for r in routers:
            r.stop(5)
    modes = Counter(d["mode"] for d in decisions)
    return {"draws": draws, "collisions": collisions(served), "served": served, "modes": dict(modes),
            "drawn": sum(1 for d in decisions if d.get("ties") == "drawn"), "logged": len(decisions)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4, help="stub workers")
    ap.add_argument("--burst", type=int, default=4, help="requests per burst (request j through router j mod N)")
    ap.add_argument("--bursts", type=int, default=150, help="bursts per arm and round")
    ap.add_argument("--gap-s", type=float, default=0.1, help="between bursts (open loop)")
    ap.add_argument("--tokens", type=int, default=2,
                    help="outputs per answer, 2 ms each at the stubs (2: a burst ends before the next; 50: ~100 ms, "
                         "so bursts overlap and the workers' loads differ when the next arrives)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="tie-herd-"))
    keys = local_keys(tmp / "keys")
    key = (keys / "worker-api-key").read_text().strip()
    coord = Coordinator(tmp, extra_args=("--policy", "none", "--worker-timeout-s", "600"))
    stubs = [stub(chr(ord("A") + i), tmp, key, STUB_TOKEN_S) for i in range(args.workers)]
    socks = []
    rows = []
    try:
        coord.wait_ready()
        for i, s in enumerate(stubs):
            s.wait_http(s.url + "/health", 30)
            socks.append(hello(coord, f"w{i}", s.url))
        for k in range(args.rounds):
            bursts = [[[rnd.randrange(1, 30000) for _ in range(args.prompt_len)] for _ in range(args.burst)]
                      for _ in range(args.bursts)]
            order = (True, False) if k % 2 == 0 else (False, True)
            res = {d: arm(d, args, tmp, keys, coord, tuple(s.url for s in stubs), bursts) for d in order}
            rows.append({"round": k, "drawn": res[True], "shared": res[False]})
            print(f"round {k}: requests sharing a worker with another of their burst: ties drawn "
                  f"{res[True]['collisions']:.3f}, by shared load and turn {res[False]['collisions']:.3f} "
                  f"({args.bursts} bursts of {args.burst} through {args.routers} routers to {args.workers} workers; "
                  f"decisions logged drawn {res[True]['drawn']}/{res[True]['logged']} and "
                  f"{res[False]['drawn']}/{res[False]['logged']}, modes {res[True]['modes']} / "
                  f"{res[False]['modes']})", flush=True)
    finally:
        for s in socks:
            s.close(0)
        for s in stubs:
            s.stop(5)
        coord.stop(5)
    pooled = {name: collisions([b for row in rows for b in row[name]["served"]]) for name in ("drawn", "shared")}
    print(f"pooled over {len(rows)} rounds: ties drawn {pooled['drawn']:.3f}, by shared load and turn "
          f"{pooled['shared']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "pooled": pooled, "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
