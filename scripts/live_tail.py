"""What makes a live arm's P99 TTFT (`kvrep bench` results): the requests at or above 0.9x the P99, by kind, pooled
over a cell's rounds; the live counterpart of `scripts/sim_tail.py`.

    .venv/bin/python scripts/live_tail.py bench/results/bench-agent-hits-s2.json.gz [more.json.gz ...]

A request is its session's first turn (the first of its session in the round: its history is new, no policy could
have it cached unless another session shares it), a follow-up whose previous prompt was still cached where it ran
("history cached": cached tokens >= that prompt less one page), or a follow-up that found less ("history lost":
evicted, or sent where it was not). The session is the first field of each request's `key`. Per arm it prints the
tail's kinds, their mean new (uncached) tokens, and how many of all requests lost their history.
"""
from __future__ import annotations

import collections
import gzip
import json
import statistics
import sys

PAGE_TOKENS = 64
"""Slack for "history cached": a follow-up's cache may stop up to a page short of its previous prompt."""


def kinds(requests: list[dict]) -> list[tuple[float, str, int]]:
    """Returns: (TTFT s, kind, new tokens) of each answered request, in send order."""
    out, previous = [], {}
    for q in sorted((q for q in requests if q.get("error") is None and q.get("ttft_s") is not None),
                    key=lambda q: q["sent_s"]):
        session = str(q["key"]).split(":")[0]
        prev = previous.get(session)
        if prev is None:
            kind = "first turn"
        elif q["cached_tokens"] >= prev - PAGE_TOKENS:
            kind = "history cached"
        else:
            kind = "history lost"
        out.append((q["ttft_s"], kind, q["prompt_tokens"] - q["cached_tokens"]))
        previous[session] = q["prompt_tokens"]
    return out


def report(data: dict) -> list[str]:
    """Returns: one line per (workload, arm), its rounds pooled."""
    pooled: dict[tuple[str, str], list] = collections.defaultdict(list)
    for row in data["rows"]:
        pooled[(row["workload"], row["arm"])] += kinds(row["requests"])
    lines = []
    for (workload, arm), out in pooled.items():
        if not out:
            continue
        ttft = sorted(t for t, _, _ in out)
        p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
        tail = [x for x in out if x[0] >= 0.9 * p99]
        count = collections.Counter(k for _, k, _ in tail)
        every = collections.Counter(k for _, k, _ in out)
        parts = [f"{k} {n} (new {statistics.mean(x[2] for x in tail if x[1] == k):.0f} tokens)"
                 for k, n in count.most_common()]
        lines.append(f"{workload} {arm}: {len(out)} requests, P99 {p99:.3f} s; {len(tail)} >= 0.9 x P99: "
                     + ", ".join(parts) + f"; of all: {every['first turn']} first turns, "
                     f"{every['history cached']} histories cached, {every['history lost']} lost")
    return lines


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for path in argv:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            data = json.load(f)
        print(path)
        for line in report(data):
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
