"""How much of a cached prompt SGLang's radix cache evicts when it needs a little room: the whole least recently
used leaf node, or only the pages the allocation needs? The simulator's workers do what this measures
(`EngineConfig.radix_nodes`, `radix_sync.policy.pagetree.PageTree.evict`).

Starts one plain CPU SGLang worker (the `wide` local model, no kvrep plugin, a 32,768-token pool), fills its pool
with N prompts of 2,500 random tokens (one radix node each) until fewer than 400 tokens are free, sends one prompt
of 300 new tokens (it needs ~150 tokens more than are free), then asks for the first 2,000 tokens of each prompt
again and prints how many SGLang found cached, oldest first. Page-granular eviction would leave the oldest prompt's
first 2,000 tokens cached; whole-node eviction leaves none of it.

Usage: flock /tmp/kvrep-server.lock .venv/bin/python scripts/sglang_eviction.py
"""
from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from kvrep_dev.cluster import Worker  # noqa: E402

POOL_TOKENS = 32768
PROMPT_TOKENS = 2500
OUTPUT_TOKENS = 8


def main() -> int:
    logs = Path(tempfile.mkdtemp(prefix="kvrep-eviction-"))
    worker = Worker("w", "wide", logs, max_total_tokens=POOL_TOKENS, kvrep=False)
    try:
        worker.wait_ready()
        rng = random.Random(1)

        def ids(n: int) -> list[int]:
            return [rng.randrange(10, 4000) for _ in range(n)]

        def cached(prompt: list[int]) -> int:
            return int(worker.generate(prompt, OUTPUT_TOKENS)["meta_info"]["cached_tokens"])

        per_prompt = PROMPT_TOKENS + OUTPUT_TOKENS
        prompts = [ids(PROMPT_TOKENS) for _ in range(POOL_TOKENS // per_prompt)]
        for prompt in prompts:
            cached(prompt)
        free = POOL_TOKENS - len(prompts) * per_prompt
        cached(ids(300))
        found = [cached(p[:2000] + ids(3)) for p in prompts]
        print(f"SGLang pool {POOL_TOKENS} tokens; {len(prompts)} prompts of {PROMPT_TOKENS} (+{OUTPUT_TOKENS} "
              f"output) cached, ~{free} tokens free; then one prompt of 300 new tokens")
        print("tokens of each prompt's first 2,000 found cached afterwards, oldest first:", found)
        whole = found[0] == 0 and all(f == 2000 for f in found[1:])
        print("the oldest prompt went whole (SGLang evicts whole leaf nodes)" if whole else
              "not whole-node eviction as measured on 0.5.23: check the simulator's `radix_nodes`")
        return 0 if whole else 1
    finally:
        worker.stop()


if __name__ == "__main__":
    sys.exit(main())
