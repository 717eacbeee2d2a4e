"""Workloads: the simulated request, sessions (closed loop), arrival processes and the trace loaders.

A workload gives the engine its initial arrivals and, when a session's request finishes, the session's next
request (issued after its recorded think time). Trace formats are recognised by content:
Mooncake JSONL (`timestamp, input_length, output_length, hash_ids`, 512-token pages), Azure CSV
(`TIMESTAMP, ContextTokens, GeneratedTokens`: arrivals only, no prefix information) and a directory of Claude
Code session files (`*.json` / `*.json.gz`, schema in shared/traces/README.md, 64-token pages).
"""

from __future__ import annotations

import csv
import gzip
import json
import random
import zlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional


class SimRequest:
    """One request and everything the simulator records about it (mutable; owned by the engine)."""

    __slots__ = ("rid", "arrival_s", "prompt_len", "output_len", "pages", "namespace", "class_key", "stop",
                 "session", "hint_fanout", "hint_delay_s", "think_s",
                 # runtime
                 "worker", "ready_s", "admitted", "cached_len", "remaining_new", "reserved", "lock_page",
                 "est_new", "est_pairs", "est_cached", "join_step", "first_token_s", "finish_s", "copy_hit_len",
                 "global_match_len", "inflight_xfer", "followup", "host_len", "load_s", "door")

    def __init__(self, rid: int, prompt_len: int, output_len: int, pages: list[int], namespace: int = 0,
                 class_key: str = "", stop: Optional[str] = None, session: Optional["Session"] = None,
                 arrival_s: float = 0.0, think_s: float = 0.0) -> None:
        self.rid = rid
        self.arrival_s = arrival_s
        self.prompt_len = prompt_len
        self.output_len = max(1, output_len)
        self.pages = pages
        self.namespace = namespace
        self.class_key = class_key
        self.stop = stop
        self.session = session
        self.hint_fanout = 0
        self.hint_delay_s = 0.0
        self.think_s = think_s
        self.worker = -1
        self.ready_s = 0.0
        self.admitted = False
        self.cached_len = 0
        self.remaining_new = 0
        self.reserved = 0
        self.lock_page: Optional[int] = None
        self.est_new = 0
        self.est_pairs = 0.0
        self.est_cached = 0
        self.join_step = 0
        self.first_token_s = -1.0
        self.finish_s = -1.0
        self.copy_hit_len = 0
        self.global_match_len = 0
        self.inflight_xfer = None
        self.followup = False
        """The planner's tracker saw this arrival continue a finished request (a session's next turn)."""
        self.host_len = 0
        """Tokens of `cached_len` loaded back from the worker's host tier (`EngineConfig.host_tier_ratio`)."""
        self.load_s = 0.0
        """Load-back time of those tokens, not yet charged to a prefill iteration, s."""
        self.door = 0
        """The front door (router) that placed it (`Engine.routers`)."""


@dataclass
class TurnSpec:
    """One request of a session template."""

    prompt_len: int
    output_len: int
    pages: list[int]
    stop: Optional[str]
    think_s: float
    """Tool or human time before this request, s."""


def request_key(req: SimRequest) -> str:
    """Identifies a request of a workload independently of the order requests were created in (session turns and
    branches get their ids when they are issued, which differs between a live replay and the simulator): its
    namespace, length and pages."""
    return f"{req.namespace}:{req.prompt_len}:{len(req.pages)}:{zlib.crc32(repr(req.pages).encode()):08x}"


class Session:
    """A closed-loop sequence of requests: the next one is issued `think_s` after the previous one finishes."""

    __slots__ = ("turns", "index", "namespace", "class_key", "prev_node")

    def __init__(self, turns: list[TurnSpec], namespace: int, class_key: str) -> None:
        self.turns = turns
        self.index = 0
        self.namespace = namespace
        self.class_key = class_key
        self.prev_node: Optional[int] = None


class Workload:
    """Base: a list of open-loop requests and sessions with start times."""

    page_len = 64
    name = "workload"

    def __init__(self) -> None:
        self.open_requests: list[SimRequest] = []
        self.session_starts: list[tuple[float, Session]] = []
        self._next_rid = 0

    def new_rid(self) -> int:
        self._next_rid += 1
        return self._next_rid - 1

    def session_request(self, session: Session, arrival_s: float) -> Optional[SimRequest]:
        """Returns: the session's next request issued at `arrival_s`, or None when the session is over."""
        if session.index >= len(session.turns):
            return None
        t = session.turns[session.index]
        session.index += 1
        return SimRequest(self.new_rid(), t.prompt_len, t.output_len, t.pages, session.namespace,
                          session.class_key, t.stop, session, arrival_s)

    def next_think_s(self, session: Session) -> Optional[float]:
        """Returns: the think time before the session's next request, or None when the session is over."""
        if session.index >= len(session.turns):
            return None
        return session.turns[session.index].think_s


def arrival_times(rng: random.Random, rate: float, duration_s: float, process: str = "poisson",
                  burst_cv: float = 3.0) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson or bursty (gamma renewal, coefficient of variation
    `burst_cv`) process with mean rate `rate`/s."""
    if rate <= 0:
        raise ValueError(f"rate={rate!r} must be > 0")
    if process not in ("poisson", "bursty"):
        raise ValueError(f"arrival process {process!r} must be poisson or bursty")
    out, t = [], 0.0
    shape = 1.0 / (burst_cv * burst_cv)
    while True:
        if process == "poisson":
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
        if t >= duration_s:
            return out
        out.append(t)


def detect_format(path: Path) -> str:
    """Recognises a trace by content: `claude` (directory of session files), `mooncake` (JSONL) or `azure`."""
    if path.is_dir():
        if any(path.glob("*.json.gz")) or any(path.glob("*.json")):
            return "claude"
        raise ValueError(f"{path}: directory without *.json / *.json.gz session files")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        head = f.read(4096)
    first = head.lstrip().splitlines()[0] if head.strip() else ""
    if first.startswith("{"):
        obj = json.loads(first) if first.rstrip().endswith("}") else {}
        if "hash_ids" in obj and "input_length" in obj:
            return "mooncake"
        if "requests" in head and "hash_ids" in head:
            return "claude"
    if "ContextTokens" in first and "TIMESTAMP" in first.upper():
        return "azure"
    raise ValueError(f"{path}: unrecognised trace format (first line {first[:80]!r})")


def _rescale(times: list[float], rate: Optional[float]) -> list[float]:
    if not times:
        return times
    t0 = times[0]
    times = [t - t0 for t in times]
    if rate:
        span = times[-1] if times[-1] > 0 else 1.0
        k = (len(times) / rate) / span
        times = [t * k for t in times]
    return times


class MooncakeWorkload(Workload):
    """Mooncake JSONL: open-loop arrivals at the recorded (or rescaled) times; ids are global (shared)."""

    page_len = 512
    name = "mooncake"

    def __init__(self, path: Path, rate: Optional[float], duration_s: Optional[float], max_context_len: int) -> None:
        super().__init__()
        rows = [json.loads(line) for line in open(path) if line.strip()]
        times = _rescale([r["timestamp"] / 1000.0 for r in rows], rate)
        for t, r in zip(times, rows):
            if duration_s is not None and t >= duration_s:
                break
            out = max(1, int(r["output_length"]))
            prompt = min(int(r["input_length"]), max_context_len - out)
            pages = list(r["hash_ids"][: prompt // self.page_len])
            self.open_requests.append(SimRequest(self.new_rid(), prompt, out, pages, 0, "mooncake", None, None, t))


class AzureWorkload(Workload):
    """Azure LLM inference CSV: arrivals and lengths only; every prompt is unique (no prefix information)."""

    page_len = 64
    name = "azure"

    def __init__(self, path: Path, rate: Optional[float], duration_s: Optional[float], max_context_len: int) -> None:
        super().__init__()
        rows = list(csv.DictReader(open(path)))
        stamps = []
        for r in rows:
            ts = r.get("TIMESTAMP") or r.get("timestamp")
            stamps.append(datetime.fromisoformat(ts.strip()[:26]).timestamp())
        order = sorted(range(len(rows)), key=lambda i: stamps[i])
        times = _rescale([stamps[i] for i in order], rate)
        next_page = 1
        for t, i in zip(times, order):
            if duration_s is not None and t >= duration_s:
                break
            out = max(1, int(rows[i]["GeneratedTokens"]))
            prompt = max(1, min(int(rows[i]["ContextTokens"]), max_context_len - out))
            n = prompt // self.page_len
            pages = list(range(next_page, next_page + n))
            next_page += n
            self.open_requests.append(SimRequest(self.new_rid(), prompt, out, pages, 0, "azure", None, None, t))


def _flatten_claude(reqs: list, out: list[TurnSpec], page_len: int, max_context_len: int) -> None:
    for r in reqs:
        if r.get("type") == "subagent":
            # NOTE: a sub-agent runs while its parent waits for the tool result, so its requests are inserted
            # in order into the parent's sequence (same namespace: ids are session-local).
            _flatten_claude(r.get("requests", []), out, page_len, max_context_len)
            continue
        o = max(1, int(r.get("out", 1)))
        prompt = max(1, min(int(r["in"]), max_context_len - o))
        pages = list(r.get("hash_ids", []))[: prompt // page_len]
        out.append(TurnSpec(prompt, o, pages, r.get("stop") or None, float(r.get("think_time") or 0.0)))


class ClaudeWorkload(Workload):
    """Claude Code sessions: started by an arrival process at `rate` sessions/s; each session replays one file's
    requests closed-loop (next request `think_time` after the previous finishes). Prompts longer than the model's
    context are cut to their first pages (prefix sharing is kept). Ids are per session instance."""

    page_len = 64
    name = "claude"

    def __init__(self, path: Path, rate: float, duration_s: float, max_context_len: int, seed: int,
                 arrival: str = "poisson", max_turns: Optional[int] = None) -> None:
        super().__init__()
        files = [path] if path.is_file() else sorted(list(path.glob("*.json.gz")) + list(path.glob("*.json")))
        if not files:
            raise ValueError(f"{path}: no session files")
        templates = []
        for f in files:
            opener = gzip.open if f.suffix == ".gz" else open
            with opener(f, "rt") as fh:
                d = json.load(fh)
            bl = int(d.get("block_size", self.page_len))
            if bl != self.page_len:
                raise ValueError(f"{f}: block_size {bl} != {self.page_len}")
            turns: list[TurnSpec] = []
            _flatten_claude(d.get("requests", []), turns, self.page_len, max_context_len)
            if turns:
                turns[0].think_s = 0.0
                templates.append(turns[:max_turns] if max_turns else turns)
        rng = random.Random(seed)
        for k, t in enumerate(arrival_times(rng, rate, duration_s, arrival)):
            tpl = templates[rng.randrange(len(templates))]
            ns = k + 1
            shift = ns << 32
            turns = [TurnSpec(x.prompt_len, x.output_len, [shift | p for p in x.pages], x.stop, x.think_s)
                     for x in tpl]
            self.session_starts.append((t, Session(turns, ns, "claude")))


def load_trace(path: str, rate: Optional[float], duration_s: Optional[float], max_context_len: int, seed: int,
               arrival: str = "poisson", max_turns: Optional[int] = None) -> Workload:
    """Loads any supported trace from a file or directory path.

    Args:
        path: a Mooncake JSONL file, an Azure CSV file, or a directory of Claude Code session files.
        rate: requests/s for arrival traces (rescales time), sessions/s for session traces.
        duration_s: cut arrivals (or session starts) at this time.
        max_context_len: model context; longer prompts are cut to their leading pages.
        seed: seed of the session arrival process.
        arrival: `poisson` or `bursty` session starts.
        max_turns: cap on requests per session (None: all).
    Returns:
        the workload.
    """
    p = Path(path)
    kind = detect_format(p)
    if kind == "mooncake":
        return MooncakeWorkload(p, rate, duration_s, max_context_len)
    if kind == "azure":
        return AzureWorkload(p, rate, duration_s, max_context_len)
    if rate is None or duration_s is None:
        raise ValueError("a session trace needs --rate (sessions/s) and --duration-s")
    return ClaudeWorkload(p, rate, duration_s, max_context_len, seed, arrival, max_turns)
