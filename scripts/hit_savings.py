"""How much of a cold prefill a cache hit saves on this host, per local model: the CPU testbed's economics.

For each model: one real CPU SGLang worker (plugin flag off, `OMP_NUM_THREADS=1`), then `--reps` rounds of
  cold: a fresh prompt of prefix+new tokens, 1 output token (nothing cached);
  hit:  a fresh prefix sent once to warm the cache, then prefix + `--new` fresh tokens, 1 output token;
and the medians of the request latencies. saving = 1 - hit/cold. On a GPU the extension of a cached prefix is
nearly free (saving ~ 1 - new/(prefix+new)); on the CPU SGLang's `torch_native` attention recomputes attention over
the cached prefix, so the saving depends on how much of the model's cost is attention.

Also prints the KV bytes per token and the per-token prefill time, from which the data plane's per-link cap that
gives this testbed a GPU's copy/prefill ratio follows (docs/testbed.md).

    python scripts/hit_savings.py --models small,wide --prefix 2000 --new 32 --reps 4
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrep_dev.cluster import Worker, model_path  # noqa: E402


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(n)]


def _timed(w: Worker, ids: list[int]) -> float:
    t0 = time.perf_counter()
    w.generate(ids, max_new_tokens=1, timeout=600)
    return time.perf_counter() - t0


def kv_bytes_per_token(model: str) -> int:
    cfg = json.loads((Path(model_path(model)) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2  # K and V, bf16


def measure(model: str, prefix: int, new: int, reps: int, seed: int, log_dir: Path) -> dict:
    rng = random.Random(seed)
    w = Worker(f"hit-{model}", model, log_dir, kvrep=False, page_size=16, max_total_tokens=4 * (prefix + new) + 64,
               extra_args=("--max-running-requests", "1"))
    try:
        w.wait_ready()
        _timed(w, _prompt(rng, 64))  # first request pays one-off costs
        cold, hit = [], []
        for _ in range(reps):  # interleaved, so drift hits both alike
            cold.append(_timed(w, _prompt(rng, prefix + new)))
            base = _prompt(rng, prefix)
            _timed(w, base)
            hit.append(_timed(w, base + _prompt(rng, new)))
            urllib.request.urlopen(urllib.request.Request(w.url + "/flush_cache", method="POST"), timeout=30).read()
    finally:
        w.stop()
    c, h = statistics.median(cold), statistics.median(hit)
    return {"model": model, "prefix": prefix, "new": new, "reps": reps, "cold_s": cold, "hit_s": hit,
            "cold_median_s": round(c, 4), "hit_median_s": round(h, 4), "saving": round(1 - h / c, 4),
            "kv_bytes_per_token": kv_bytes_per_token(model),
            "prefill_us_per_token": round(1e6 * c / (prefix + new), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,wide")
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    log_dir = ROOT / "logs" / "hit_savings"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models.split(","):
        r = measure(model, args.prefix, args.new, args.reps, args.seed, log_dir)
        rows.append(r)
        print(f"{model:6s} prefix {args.prefix} + {args.new} new: cold {r['cold_median_s']:.3f} s  "
              f"hit {r['hit_median_s']:.3f} s  saving {100 * r['saving']:.1f}%  "
              f"(median of {args.reps}; KV {r['kv_bytes_per_token']} B/token, "
              f"prefill {r['prefill_us_per_token']} us/token)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
