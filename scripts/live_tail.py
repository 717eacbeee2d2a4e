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


def match_decisions(requests: list[dict], decisions: list[dict], slack_s: float = 0.5,
                    wait_s: float = 5.0) -> dict[int, dict]:
    """Returns: index into `requests` -> the router's decision for it.

    A decision that names the request (`request_id`, the client's `X-Request-Id`) is joined by it. Older runs'
    decisions name none, and a router keeps its last 256 decisions over its life, so a cell's list starts with
    the previous cells': those are joined in time. The router's clock and the client's are offset by a constant
    (both monotonic), found as the most common `time_s - sent_s` (0.1 s bins) over the pairs of equal prompt
    length; each request then takes the unused decision of its prompt length whose offset is closest to it,
    within `slack_s` before and `wait_s` after (a pull on the critical path dispatches later). Failover
    dispatches (`attempt` > 0) are not decisions of their own."""
    decisions = [d for d in decisions if not d.get("attempt")]
    by_id = {d["request_id"]: d for d in decisions if d.get("request_id") is not None}
    out: dict[int, dict] = {}
    if by_id:
        for i, q in enumerate(requests):
            if q.get("request_id") in by_id:
                out[i] = by_id[q["request_id"]]
        return out
    by_len: dict[int, list[dict]] = collections.defaultdict(list)
    for d in decisions:
        by_len[d["prompt_len"]].append(d)
    bins = collections.Counter(round(d["time_s"] - q["sent_s"], 1) for q in requests
                               for d in by_len.get(q["prompt_tokens"], ()))
    if not bins:
        return out
    top = max(bins.values())
    offset = min(b for b, n in bins.items() if n == top)
    used: set[int] = set()
    for i, q in sorted(enumerate(requests), key=lambda iq: iq[1]["sent_s"]):
        best = None
        for d in by_len.get(q["prompt_tokens"], ()):
            lag = d["time_s"] - q["sent_s"] - offset
            if id(d) not in used and -slack_s <= lag <= wait_s and (best is None or lag < best[0]):
                best = (lag, d)
        if best is not None:
            used.add(id(best[1]))
            out[i] = best[1]
    return out


def kinds(requests: list[dict], decisions: list[dict] = ()) -> list[tuple[float, str, int]]:
    """Returns: (TTFT s, kind, new tokens) of each answered request, in send order. With the router's `decisions`
    (each with `prompt_len`, `time_s` and `cached_by_worker`, joined to requests by `match_decisions`), a lost
    history is "history missed where sent" when the worker it went to had it cached by the directory when the
    request was routed, "history elsewhere" when only another worker had it, else "history nowhere" (evicted
    everywhere, or the prompt does not extend the session's previous one: a trace's subagent turns share its
    session)."""
    answered = sorted((q for q in requests if q.get("error") is None and q.get("ttft_s") is not None),
                      key=lambda q: q["sent_s"])
    joined = match_decisions(answered, list(decisions))
    out, previous = [], {}
    for i, q in enumerate(answered):
        session = str(q["key"]).split(":")[0]
        prev = previous.get(session)
        decision = joined.get(i)
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
        lines.append(f"{workload} {arm}: {len(out)} requests, mean {statistics.mean(ttft):.3f} s, P99 {p99:.3f} s; "
                     f"{len(tail)} >= 0.9 x P99: " + ", ".join(parts) + "; of all: "
                     + ", ".join(f"{k} {every[k]}" for k in KINDS if every[k]))
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
