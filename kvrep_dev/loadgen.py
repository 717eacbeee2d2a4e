"""Replays a simulator workload against a live HTTP endpoint (our router, `smg`, or one SGLang server).

The live benchmarks and the demo use the very workload objects the simulator runs (`radix_sync.sim`): the
same generators and trace loaders, scaled down to what a CPU cluster can serve (`scale_workload`), then rendered
to text (`Renderer`: every page id becomes a fixed run of one-token words, so two requests that share pages in
the simulator share exactly those tokens live) and sent with the same arrival process, the same closed-loop
sessions (a session's next request leaves its think time after the previous response ends) and the same
fan-out (a hint with the trunk, all branches together after the trunk's response). The simulator can then run
the identical scaled workload for its validation against the live numbers.

Each request is a streaming SGLang `/generate` call with `text` (routers that match on text, like
smg's `cache_aware` policy, see the same prompt our router tokenizes); TTFT and end-to-end time are
measured at the client, cached tokens come from SGLang's `meta_info`.
"""
from __future__ import annotations

import asyncio
import copy
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Optional

from radix_sync.sim.workload import SimRequest, Workload, request_key


@dataclass(frozen=True)
class Scale:
    """How a workload is shrunk for a CPU cluster."""

    token_factor: float = 1.0
    """Multiplies every length (pages keep their identity: a page becomes round(page_len * factor) tokens)."""
    max_prompt_tokens: int = 4096
    """Live prompts are cut to their leading pages at this length (prefix sharing is kept)."""
    max_output_tokens: int = 16
    """Output lengths are capped here (decode is slow on a CPU and TTFT is what replication changes)."""
    think_factor: float = 1.0
    """Multiplies think times (tool / human gaps)."""
    max_think_s: float = 5.0
    """Think times are capped here."""

    def __post_init__(self) -> None:
        if not self.token_factor > 0 or self.max_prompt_tokens < 1 or self.max_output_tokens < 1:
            raise ValueError(f"invalid scale {self!r}")
        if self.think_factor < 0 or self.max_think_s < 0:
            raise ValueError(f"invalid scale {self!r}")


def scale_workload(wl: Workload, scale: Scale) -> Workload:
    """Returns: a deep copy of `wl` with lengths, outputs and think times scaled (the input is not changed).

    A page of `wl.page_len` tokens becomes `max(1, round(page_len * token_factor))` tokens; a prompt keeps its
    pages (cut at `max_prompt_tokens`) plus its scaled unaligned tail.
    """
    out = copy.deepcopy(wl)
    k = max(1, round(wl.page_len * scale.token_factor))
    max_pages = scale.max_prompt_tokens // k

    def prompt(n: int, pages: list[int]) -> tuple[int, list[int]]:
        tail = max(0, n - len(pages) * wl.page_len)
        pages = pages[:max_pages]
        n2 = len(pages) * k + int(round(tail * scale.token_factor))
        return max(1, min(n2, scale.max_prompt_tokens)), pages

    def output(n: int) -> int:
        return max(2, min(scale.max_output_tokens, n))

    def think(s: float) -> float:
        return min(scale.max_think_s, s * scale.think_factor)

    for r in out.open_requests:
        r.prompt_len, r.pages = prompt(r.prompt_len, r.pages)
        r.output_len = output(r.output_len)
    for _, s in out.session_starts:
        for t in s.turns:
            t.prompt_len, t.pages = prompt(t.prompt_len, t.pages)
            t.output_len = output(t.output_len)
            t.think_s = think(t.think_s)
    if hasattr(out, "delay_s"):
        out.delay_s = think(out.delay_s)
    out.page_len = k
    return out


def workload_size(wl: Workload) -> dict:
    """Returns: request count and prompt tokens of a workload (sessions counted turn by turn)."""
    reqs = [(r.prompt_len, r.output_len) for r in wl.open_requests]
    reqs += [(t.prompt_len, t.output_len) for _, s in wl.session_starts for t in s.turns]
    return {"requests": len(reqs), "prompt_tokens": sum(p for p, _ in reqs), "output_tokens": sum(o for _, o in reqs)}


class Renderer:
    """Turns a request's pages into text: page `p` is `page_len` words chosen by a generator seeded with
    (`salt`, p), each word one token of the model's tokenizer (checked), so equal pages are equal tokens."""

    def __init__(self, tokenizer, salt: int = 0) -> None:
        vocab = tokenizer.get_vocab()
        words = sorted(w[1:] for w in vocab if w.startswith("\u0120") and w[1:].isalpha() and w[1:].islower()
                       and 3 <= len(w) - 1 <= 10)
        probe = words[:: max(1, len(words) // 200)][:200]
        ids = tokenizer.encode("".join(" " + w for w in probe), add_special_tokens=False)
        if len(words) < 64 or len(ids) != len(probe):
            raise ValueError(f"tokenizer has no usable one-token words ({len(words)} candidates, probe of "
                             f"{len(probe)} words gave {len(ids)} tokens)")
        self.words = words
        self.salt = salt
        self._pages: dict[int, str] = {}

    def page(self, page_id: int, n: int) -> str:
        key = page_id
        text = self._pages.get(key)
        if text is None:
            rng = random.Random(f"{self.salt}/{page_id}")
            text = "".join(" " + rng.choice(self.words) for _ in range(n))
            self._pages[key] = text
        return text

    def prompt(self, req: SimRequest, page_len: int) -> str:
        """Returns: the request's text (`prompt_len` tokens: its pages, then a tail unique to the request)."""
        parts = [self.page(p, page_len) for p in req.pages]
        tail = max(0, req.prompt_len - len(req.pages) * page_len)
        rng = random.Random(f"{self.salt}/req/{req.rid}")
        parts.append("".join(" " + rng.choice(self.words) for _ in range(tail)))
        return "".join(parts)


@dataclass
class Result:
    rid: int
    kind: str
    sent_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    error: Optional[str] = None
    key: str = ""
    """`request_key` of the request (matches the simulator's record of the same request)."""
    request_id: Optional[str] = None
    """The `X-Request-Id` it was sent with (our router records it with its decision)."""


@dataclass
class ReplayConfig:
    url: str
    hints_url: Optional[str] = None
    """Where fan-out hints go (`<router>/kvrep/hints`); None: the endpoint takes no hints."""
    more_urls: tuple[str, ...] = ()
    """Other front doors of the same fleet: request `rid` goes to `(url, *more_urls)[rid % n]` (a load balancer
    spreading requests over gateways in turn). Hints still go to `hints_url` (every router of ours forwards them
    to the same coordinator)."""
    timeout_s: float = 300.0
    api_key: Optional[str] = None
    hints_api_key: Optional[str] = None
    """Sent with hints (the router's write token, or a tenant's key); None: `api_key`."""
    num_hints_refused: int = 0
    """Hints the router answered with anything but 200 (e.g. 401: no or a wrong token; 429: rate limited)."""
    on_done: Optional[object] = None
    """Called with each Result (progress)."""
    request_id_prefix: Optional[str] = None
    """Each request is sent with `X-Request-Id: <prefix><rid>` (None: no header)."""
    results: list = field(default_factory=list)


def _front(cfg: ReplayConfig, rid: int) -> str:
    """The front door request `rid` goes to."""
    if not cfg.more_urls:
        return cfg.url
    fronts = (cfg.url, *cfg.more_urls)
    return fronts[rid % len(fronts)]


async def _one(session, cfg: ReplayConfig, req: SimRequest, text: str, kind: str, t0: float) -> Result:
    import aiohttp

    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}}
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    res = Result(req.rid, kind, time.perf_counter() - t0)
    if cfg.request_id_prefix is not None:
        res.request_id = headers["X-Request-Id"] = f"{cfg.request_id_prefix}{req.rid}"
    start = time.perf_counter()
    last = None
    try:
        async with session.post(_front(cfg, req.rid) + "/generate", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    if math.isnan(res.ttft_s):
                        res.ttft_s = time.perf_counter() - start
                    last = json.loads(data)
        res.e2e_s = time.perf_counter() - start
        meta = (last or {}).get("meta_info", {})
        res.prompt_tokens = int(meta.get("prompt_tokens", 0))
        res.cached_tokens = int(meta.get("cached_tokens", 0))
        res.output_tokens = int(meta.get("completion_tokens", 0))
        if last is None:
            res.error = "empty stream"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def replay(wl: Workload, renderer: Renderer, cfg: ReplayConfig) -> list[Result]:
    """Sends every request of `wl` (consumed: pass a fresh copy) at its time; returns the results in send order."""
    import aiohttp

    t0 = time.perf_counter()
    results: list[Result] = []
    conn = aiohttp.TCPConnector(limit=0)

    async def send(session, req: SimRequest, kind: str) -> Result:
        res = await _one(session, cfg, req, renderer.prompt(req, wl.page_len), kind, t0)
        res.key = request_key(req)
        results.append(res)
        if cfg.on_done is not None:
            cfg.on_done(res)
        return res

    async def at(t: float) -> None:
        delay = t - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)

    async def open_request(session, req: SimRequest) -> None:
        await at(req.arrival_s)
        await send(session, req, wl.name)

    async def run_session(session, start_s: float, s) -> None:
        await at(start_s)
        now = time.perf_counter() - t0
        req = wl.session_request(s, now)
        while req is not None:
            if req.hint_fanout and cfg.hints_url:
                await _hint(session, cfg, renderer.prompt(req, wl.page_len), req.hint_fanout)
            await send(session, req, wl.name)
            now = time.perf_counter() - t0
            if req.hint_fanout and hasattr(wl, "branch_requests"):
                await asyncio.sleep(req.hint_delay_s)
                branches = wl.branch_requests(s, time.perf_counter() - t0)
                await asyncio.gather(*(send(session, b, wl.name) for b in branches))
                return
            think = wl.next_think_s(s)
            if think is None:
                return
            await asyncio.sleep(think)
            req = wl.session_request(s, time.perf_counter() - t0)

    async with aiohttp.ClientSession(connector=conn) as session:
        tasks = [open_request(session, r) for r in wl.open_requests]
        tasks += [run_session(session, t, s) for t, s in wl.session_starts]
        await asyncio.gather(*tasks)
    results.sort(key=lambda r: r.sent_s)
    return results


async def _hint(session, cfg: ReplayConfig, text: str, k: int) -> None:
    import aiohttp

    try:
        key = cfg.hints_api_key or cfg.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with session.post(cfg.hints_url, json={"kind": "fanout", "text": text, "k": k}, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=10)) as resp:
            await resp.read()
            if resp.status != 200:
                cfg.num_hints_refused += 1
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass  # a hint is advice: losing one costs a missed copy, never a request


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    pos = (len(xs) - 1) * q
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(results: list[Result]) -> dict:
    """Returns: TTFT/TPOT statistics, throughput, the cached-token ratio and the error count."""
    ok = [r for r in results if r.error is None and not math.isnan(r.ttft_s)]
    ttft = [r.ttft_s for r in ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    span = max((r.sent_s + r.e2e_s for r in ok), default=0.0) - min((r.sent_s for r in ok), default=0.0)

    def stats(xs: list[float]) -> dict:
        return {"mean": sum(xs) / len(xs) if xs else math.nan, "p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9),
                "p95": _pct(xs, 0.95), "p99": _pct(xs, 0.99)}

    prompt = sum(r.prompt_tokens for r in ok)
    return {"requests": len(results), "errors": len(results) - len(ok), "ttft_s": stats(ttft), "tpot_s": stats(tpot),
            "throughput_rps": len(ok) / span if span > 0 else math.nan,
            "cached_token_ratio": (sum(r.cached_tokens for r in ok) / prompt) if prompt else 0.0,
            "prompt_tokens": prompt}
