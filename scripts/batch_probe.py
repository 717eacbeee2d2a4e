"""Does SGLang prefill requests that share a cached prefix in one batch when they reach it together?

One pinned testbed worker (`kvrep_dev.testbed`: the `wide` model, `--disable-overlap-schedule`): a ~2,000-token
prefix is cached first, then six requests of that prefix plus ~30 unique tokens are sent `--gaps` apart (0: at
once), and their times to first token are printed; the worker's log (`--logs`) has SGLang's "Prefill batch" lines
(`#new-seq`). The simulated engine (`radix_sync/sim/worker.py::SimWorker._start`) puts every request waiting at an
iteration's start into one prefill batch; this checks that against SGLang's scheduler.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/batch_probe.py
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrep_dev import testbed  # noqa: E402
from kvrep_dev.cluster import Worker, stream_generate  # noqa: E402


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega", "sigma")) + str(rng.randrange(100))
                    for _ in range(n // 4))  # ~4 tokens a word


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gaps", default="0,0.03,0.1", help="seconds between the six sends, per round")
    p.add_argument("--logs", type=Path, default=ROOT / "logs" / "batch-probe")
    p.add_argument("--url", default=None, help="send to this front door (a running `kvrep up` router, or a worker) "
                                               "instead of starting a worker")
    p.add_argument("--key", default=None, help="with --url: a bearer token to send")
    args = p.parse_args()
    rng = random.Random(1)
    prefix = words(rng, 2000)
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else None
    w = None
    if args.url is None:
        w = Worker("batch-probe", testbed.MODEL, args.logs, kvrep=False, cpu=testbed.core_for(0),
                   max_total_tokens=16384, extra_args=testbed.WORKER_ARGS)
    url = args.url or w.url
    try:
        if w is not None:
            w.wait_ready()
        for _ in range(3):  # the prefix cached, the first forwards of each shape done
            stream_generate(url, prefix + " " + words(rng, 30), 4, headers=headers)
        for gap in (float(g) for g in args.gaps.split(",")):
            out: dict[int, float] = {}

            def send(i: int, text: str) -> None:
                out[i] = stream_generate(url, text, 8, headers=headers)[0]
            threads = []
            for i in range(6):
                t = threading.Thread(target=send, args=(i, prefix + " " + words(rng, 30)))
                t.start()
                threads.append(t)
                time.sleep(gap)
            for t in threads:
                t.join()
            print(f"sent {gap:.2f} s apart: TTFT {', '.join(f'{out[i]:.3f}' for i in range(6))} s")
            time.sleep(1.0)
    finally:
        if w is not None:
            w.stop()
    if w is not None:
        print(f"SGLang's prefill batches: grep 'Prefill batch' {args.logs}/*.log")


if __name__ == "__main__":
    main()
