"""How much k CPU SGLang workers slow each other down on this machine (the simulator's `shared_cores` model).

Starts a coordinator and three CPU workers (the `small` local model unless --model), then measures the server's
time to first token of k = 1, 2, 3 requests sent at once, one per worker: cold prompts of 1,024 and 2,048 tokens,
32-token extensions of a cached 3,072-token prefix, and the decode step of 32 output tokens. Prints each as a
ratio to k = 1; the simulator's processor-sharing model predicts max(1, k / cores).

Usage: .venv/bin/python scripts/measure_contention.py [--model small] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

from kvrep_dev.cluster import Coordinator, Worker  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(5)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, 4000) for _ in range(n)]

    def at_once(calls):
        out = [None] * len(calls)

        def run(i):
            out[i] = calls[i]()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    logs = ROOT / "logs" / "contention"
    procs = []
    try:
        coord = Coordinator(logs, extra_args=("--policy", "none"))
        procs.append(coord)
        coord.wait_ready()
        workers = [Worker(f"cont-{i}", args.model, logs, coordinator=coord.endpoint, max_total_tokens=65536)
                   for i in range(3)]
        procs += workers
        for w in workers:
            w.wait_ready()
        for w in workers:  # first-call code paths
            w.generate(ids(1000), 4)
            w.generate(ids(64), 4)

        def cold(n):
            return lambda w: w.generate(ids(n), 1)["meta_info"]["first_token_latency"]

        def extension(w):
            prefix = ids(3072)
            w.generate(prefix, 1)
            return lambda: w.generate(prefix + ids(32), 1)["meta_info"]["first_token_latency"]

        def decode(w):
            m = w.generate(ids(256), 33)["meta_info"]
            return (m["e2e_latency"] - m["first_token_latency"]) / 32

        cases = {"cold 1,024 tokens": cold(1024), "cold 2,048 tokens": cold(2048)}
        print(f"{os.cpu_count()} cores; ratio of the mean over k workers at once to k = 1, median of {args.repeats}")
        print(f"{'case':<34} {'k=1 s':>7} {'k=2':>6} {'k=3':>6}   (model: {1.0:.2f} / "
              f"{max(1.0, 2 / os.cpu_count()):.2f} / {max(1.0, 3 / os.cpu_count()):.2f})")
        for name, fn in list(cases.items()) + [("32-token extension of 3,072 cached", None), ("decode step", None)]:
            per_k = []
            for k in (1, 2, 3):
                xs = []
                for _ in range(args.repeats):
                    if name.startswith("32-token"):
                        calls = [extension(w) for w in workers[:k]]  # prefixes cached first, then all at once
                    elif name == "decode step":
                        calls = [lambda w=w: decode(w) for w in workers[:k]]
                    else:
                        calls = [lambda w=w: fn(w) for w in workers[:k]]
                    xs.append(statistics.mean(at_once(calls)))
                per_k.append(statistics.median(xs))
            print(f"{name:<34} {per_k[0]:>7.3f} {per_k[1] / per_k[0]:>5.2f}x {per_k[2] / per_k[0]:>5.2f}x")
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
