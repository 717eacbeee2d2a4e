"""What makes a live arm's P99 TTFT (`kvrep bench` results): the requests at or above 0.9x the P99, by kind, pooled
over a cell's rounds; the live counterpart of `scripts/sim_tail.py`.

    .venv/bin/python scripts/live_tail.py bench/results/bench-agent-hits-s2.json.gz [more.json.gz ...]

A request is its session's first turn (the first of its session in the round: its history is new, no policy could
have it cached unless another session shares it), a follow-up whose previous prompt was still cached where it ran
("history cached": cached tokens >= that prompt less one page), or a follow-up that found less (with the
router's decisions: "history missed where sent", the worker it was sent to had it by the directory when it was
routed; "history elsewhere", only another worker had it; "history nowhere",
none had it: evicted, or the prompt does not extend the previous one; "history lost" where no decision matches).
The session is the first field of each request's `key`. Per arm: the tail's kinds with their mean new (uncached)
tokens, and the kinds of all requests.
"""
from __future__ import annotations

import collections
import gzip
import json
import statistics
import sys

KINDS = ("first turn", "history cached", "history missed where sent", "history elsewhere", "history nowhere",
         "history lost")
PAGE_TOKENS = 64
"""Slack for "history cached": a follow-up's cache may stop up to a page short of its previous prompt."""


def _cached_at(decision: dict, worker) -> int:
    """Returns: the tokens the router's directory said `worker` had cached for the request (0 if not ranked)."""
    ranked, cached = decision.get("ranked") or [], decision.get("cached_by_worker") or []
    return cached[ranked.index(worker)] if worker in ranked and ranked.index(worker) < len(cached) else 0


def kinds(requests: list[dict], decisions: list[dict] = ()) -> list[tuple[float, str, int]]:
    """Returns: (TTFT s, kind, new tokens) of each answered request, in send order. With the router's `decisions`
    (each with `prompt_len` and `cached_by_worker`, matched to requests by prompt length in time order), a lost
    history is "history elsewhere" when another worker had it cached when the request was routed, else "history
    nowhere" (evicted everywhere, or the prompt does not extend the session's previous one: a trace's subagent
    turns share its session)."""
    by_len: dict[int, list[dict]] = collections.defaultdict(list)
    for d in sorted(decisions, key=lambda d: d["time_s"]):
        by_len[d["prompt_len"]].append(d)
    out, previous = [], {}
    for q in sorted((q for q in requests if q.get("error") is None and q.get("ttft_s") is not None),
                    key=lambda q: q["sent_s"]):
        session = str(q["key"]).split(":")[0]
        prev = previous.get(session)
        seen = by_len.get(q["prompt_tokens"])
        decision = seen.pop(0) if seen else None
        if prev is None:
            kind = "first turn"
        elif q["cached_tokens"] >= prev - PAGE_TOKENS:
            kind = "history cached"
        elif decision is None:
            kind = "history lost"
        elif _cached_at(decision, decision.get("worker")) >= prev - PAGE_TOKENS:
            kind = "history missed where sent"
        elif max(decision.get("cached_by_worker") or [0]) >= prev - PAGE_TOKENS:
            kind = "history elsewhere"
        else:
            kind = "history nowhere"
        out.append((q["ttft_s"], kind, q["prompt_tokens"] - q["cached_tokens"]))
        previous[session] = q["prompt_tokens"]
    return out


def report(data: dict) -> list[str]:
    """Returns: one line per (workload, arm), its rounds pooled."""
    pooled: dict[tuple[str, str], list] = collections.defaultdict(list)
    for row in data["rows"]:
        pooled[(row["workload"], row["arm"])] += kinds(row["requests"], row.get("router_decisions") or ())
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
                     + ", ".join(parts) + "; of all: " + ", ".join(f"{k} {every[k]}" for k in KINDS if every[k]))
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
