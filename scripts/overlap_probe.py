"""Does a finished prefill's first token wait for the next batch's compute? (SGLang's overlap scheduler on a CPU.)

SGLang's overlap scheduler (`Scheduler.event_loop_overlap`, sglang 0.5.23 `srt/managers/scheduler.py`) launches
batch N+1 before it processes batch N's result. On a GPU the launch returns at once (kernels are queued), so N's
first tokens go out while N+1 computes. On a CPU the launch *is* the compute: N's first tokens go out only after
N+1's forward. This probe sends two cold prompts of `--tokens` tokens to one pinned testbed worker, the second
`--gap-s` after the first (so it is queued while the first computes), and prints both times to first token, with
SGLang's default (overlap on) and with `--disable-overlap-schedule`, `--rounds` times each, interleaved.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/overlap_probe.py --rounds 3
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrep_dev.cluster import Worker, stop_all, stream_generate  # noqa: E402
from kvrep_dev import testbed  # noqa: E402


def prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega", "sigma")) + str(rng.randrange(100))
                    for _ in range(n // 4))  # ~4 tokens a word


def pair(url: str, tokens: int, gap_s: float, rng: random.Random) -> tuple[float, float]:
    out = [0.0, 0.0]

    def send(i: int, text: str) -> None:
        out[i] = stream_generate(url, text, max_new_tokens=4)[0]
    a = threading.Thread(target=send, args=(0, prompt(rng, tokens)))
    b = threading.Thread(target=send, args=(1, prompt(rng, tokens)))
    a.start()
    time.sleep(gap_s)
    b.start()
    a.join()
    b.join()
    return out[0], out[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--gap-s", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--logs", type=Path, default=ROOT / "logs" / "overlap-probe")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    workers = {}
    try:
        for name, extra in (("overlap", ()), ("no-overlap", ("--disable-overlap-schedule",))):
            w = Worker(name, testbed.MODEL, args.logs, kvrep=False, cpu=testbed.core_for(len(workers)),
                       max_total_tokens=16384, extra_args=extra)
            workers[name] = w
        for w in workers.values():
            w.wait_ready()
        rng = random.Random(0)
        res = {name: [] for name in workers}
        for name, w in workers.items():  # warm-up: first forwards of a shape are slow
            pair(w.url, args.tokens, args.gap_s, rng)
        for _ in range(args.rounds):
            for name, w in workers.items():
                res[name].append(pair(w.url, args.tokens, args.gap_s, rng))
        for name, rows in res.items():
            first = statistics.median(r[0] for r in rows)
            second = statistics.median(r[1] for r in rows)
            print(f"{name:<11} first prompt TTFT median {first:.3f} s, second {second:.3f} s  "
                  f"({', '.join(f'{a:.2f}/{b:.2f}' for a, b in rows)})")
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v).replace(str(ROOT) + "/", "") for k, v in vars(args).items()
                                                      if k != "json"},
                                             "ttft_s": res}, indent=1))
    finally:
        stop_all(list(workers.values()))


if __name__ == "__main__":
    main()
