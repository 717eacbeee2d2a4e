"""Synthetic workloads: agent sessions, tree-search fan-out, shared-prefix bursts with Zipf popularity, flash crowds,
resume bursts, multi-candidate jobs, and a no-sharing control.

Every generator is seeded and produces chained page ids (a page id appears under one parent only). `rate` is
requests/s on average (for agents: the session start rate is derived from the mean session length).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional

from radix_sync.sim.workload import SimRequest, Session, TurnSpec, Workload, arrival_times


@dataclass(frozen=True)
class GeneratorConfig:
    """Shape parameters of the generators (token lengths are medians of log-normals unless said otherwise)."""

    page_len: int = 64
    """Tokens per page."""
    agent_system_len: int = 12000
    """Agent: shared tools+system prefix per tenant, tokens."""
    agent_num_tenants: int = 4
    """Agent: tenants (each with its own system prefix)."""
    agent_mean_turns: float = 24.0
    """Agent: mean requests per session (geometric)."""
    agent_new_len: int = 1500
    """Agent: tokens a turn adds (tool output / user message)."""
    agent_output_len: int = 250
    """Agent: output tokens per request."""
    agent_tool_gap_s: float = 9.0
    """Agent: think time after a tool call, s (log-normal median; p90 ~ 8x)."""
    agent_turn_gap_s: float = 120.0
    """Agent: think time after an end of turn, s."""
    agent_p_end_turn: float = 0.1
    """Agent: probability a response ends the turn (else a tool call)."""
    fanout_k: int = 8
    """Fan-out: branches per tree."""
    fanout_prefix_min_len: int = 16384
    """Fan-out: shortest trunk, tokens (uniform up to twice as long)."""
    fanout_branch_len: int = 512
    """Fan-out: tokens a branch adds."""
    fanout_output_len: int = 256
    """Fan-out: output tokens per request."""
    fanout_delay_s: float = 0.5
    """Fan-out: time from the trunk's response to the branches, s."""
    shared_num_prefixes: int = 64
    """Shared-prefix: distinct prefixes."""
    shared_prefix_min_len: int = 2048
    """Shared-prefix: shortest prefix, tokens (uniform up to 8x)."""
    shared_zipf_s: float = 1.1
    """Shared-prefix: Zipf exponent of prefix popularity."""
    shared_suffix_len: int = 400
    """Shared-prefix: unique tokens after the prefix."""
    shared_output_len: int = 200
    """Shared-prefix: output tokens."""
    flash_prefix_len: int = 8192
    """Flash-crowd: the hot prefix of each crowd, tokens."""
    flash_period_s: float = 60.0
    """Flash-crowd: a new hot prefix (a launch) every this many seconds."""
    flash_ramp_s: float = 20.0
    """Flash-crowd: its request rate ramps linearly from 0 to the peak over this long, then holds."""
    flash_suffix_len: int = 256
    """Flash-crowd: unique tokens after the hot prefix (log-normal median)."""
    flash_output_len: int = 128
    """Flash-crowd: output tokens."""
    resume_history_len: int = 8192
    """Resume-burst: each session's history before its first turn, tokens (uniform up to twice as long)."""
    resume_period_s: float = 30.0
    """Resume-burst: a batch of sessions starts every period; each later turn resumes at a period boundary."""
    resume_window_s: float = 2.0
    """Resume-burst: the tool calls of a batch end within this window after the boundary, s."""
    resume_turns: int = 4
    """Resume-burst: requests per session."""
    resume_new_len: int = 512
    """Resume-burst: tokens a turn adds."""
    resume_output_len: int = 128
    """Resume-burst: output tokens per request."""
    multi_prompt_len: int = 16384
    """Multi-candidate: the long prompt of a job, tokens (uniform up to twice as long)."""
    multi_k: int = 8
    """Multi-candidate: requests per job (n > 1 / best-of-K, sent together)."""
    multi_output_len: int = 256
    """Multi-candidate: output tokens per candidate."""
    nosharing_prompt_len: int = 2048
    """No-sharing control: prompt tokens (log-normal median), every prompt unique."""
    nosharing_output_len: int = 256
    """No-sharing control: output tokens (log-normal median)."""

    def __post_init__(self) -> None:
        for name in ("page_len", "agent_system_len", "agent_num_tenants", "agent_new_len", "agent_output_len",
                     "fanout_k", "fanout_prefix_min_len", "fanout_branch_len", "fanout_output_len",
                     "shared_num_prefixes", "shared_prefix_min_len", "shared_suffix_len", "shared_output_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.agent_mean_turns < 1 or not 0 <= self.agent_p_end_turn <= 1:
            raise ValueError(f"agent_mean_turns={self.agent_mean_turns!r} must be >= 1, agent_p_end_turn="
                             f"{self.agent_p_end_turn!r} in [0, 1]")
        for name in ("flash_prefix_len", "flash_suffix_len", "flash_output_len", "resume_history_len",
                     "resume_turns", "resume_new_len", "resume_output_len", "multi_prompt_len", "multi_k",
                     "multi_output_len", "nosharing_prompt_len", "nosharing_output_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not (self.flash_period_s > 0 and 0 < self.flash_ramp_s <= self.flash_period_s and self.resume_period_s > 0
                and 0 <= self.resume_window_s <= self.resume_period_s):
            raise ValueError("flash-crowd needs 0 < ramp <= period; resume-burst 0 <= window <= period")
        if self.agent_tool_gap_s <= 0 or self.agent_turn_gap_s <= 0 or self.fanout_delay_s < 0:
            raise ValueError("gaps must be > 0 and fanout_delay_s >= 0")


def _lognormal(rng: random.Random, median: float, sigma: float = 0.8) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


class _Ids:
    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


class AgentWorkload(Workload):
    """Agent sessions: a tenant's system prefix, then turns that each append tool output and the previous
    response; think times log-normal (median 9 s after a tool call, 120 s after an end of turn)."""

    name = "agent"

    def __init__(self, cfg: GeneratorConfig, rate: float, duration_s: float, seed: int, max_context_len: int,
                 arrival: str = "poisson") -> None:
        super().__init__()
        self.page_len = cfg.page_len
        rng, ids = random.Random(seed), _Ids()
        systems = [ids.take(cfg.agent_system_len // cfg.page_len) for _ in range(cfg.agent_num_tenants)]
        session_rate = rate / cfg.agent_mean_turns
        for k, t in enumerate(arrival_times(rng, session_rate, duration_s, arrival)):
            tenant = rng.randrange(cfg.agent_num_tenants)
            pages = list(systems[tenant])
            prompt = cfg.agent_system_len + int(_lognormal(rng, cfg.agent_new_len))
            n_turns = 1
            while rng.random() > 1.0 / cfg.agent_mean_turns:
                n_turns += 1
            turns, think = [], 0.0
            for _ in range(n_turns):
                out = max(1, int(_lognormal(rng, cfg.agent_output_len, 0.6)))
                prompt = min(prompt, max_context_len - out)
                full = prompt // cfg.page_len
                if full > len(pages):
                    pages = pages + ids.take(full - len(pages))
                stop = "end_turn" if rng.random() < cfg.agent_p_end_turn else "tool_use"
                turns.append(TurnSpec(prompt, out, pages[:full], stop, think))
                think = _lognormal(rng, cfg.agent_tool_gap_s if stop == "tool_use" else cfg.agent_turn_gap_s, 1.2)
                prompt = prompt + out + int(_lognormal(rng, cfg.agent_new_len))
                if prompt + 1 >= max_context_len:
                    break
            self.session_starts.append((t, Session(turns, tenant, f"agent-t{tenant}")))


class FanoutWorkload(Workload):
    """Tree search: a trunk request over a long unique prefix; when it finishes, K branches over the trunk arrive
    together after `fanout_delay_s`. The trunk request carries an explicit fan-out hint (K branches)."""

    name = "fanout"

    def __init__(self, cfg: GeneratorConfig, rate: float, duration_s: float, seed: int, max_context_len: int,
                 arrival: str = "poisson") -> None:
        super().__init__()
        self.page_len = cfg.page_len
        rng, ids = random.Random(seed), _Ids()
        tree_rate = rate / (cfg.fanout_k + 1)
        for k, t in enumerate(arrival_times(rng, tree_rate, duration_s, arrival)):
            trunk = rng.randrange(cfg.fanout_prefix_min_len, 2 * cfg.fanout_prefix_min_len)
            trunk -= trunk % cfg.page_len
            trunk = min(trunk, max_context_len - 4 * cfg.fanout_branch_len)
            pages = ids.take(trunk // cfg.page_len)
            turns = [TurnSpec(trunk, cfg.fanout_output_len, pages, "tool_use", 0.0)]
            for _ in range(cfg.fanout_k):
                prompt = trunk + cfg.fanout_branch_len
                turns.append(TurnSpec(prompt, cfg.fanout_output_len,
                                      pages + ids.take(cfg.fanout_branch_len // cfg.page_len), "end_turn",
                                      cfg.fanout_delay_s))
            self.session_starts.append((t, Session(turns, 0, "fanout")))
        self.fanout_k = cfg.fanout_k
        self.delay_s = cfg.fanout_delay_s

    def session_request(self, session: Session, arrival_s: float) -> Optional[SimRequest]:
        req = super().session_request(session, arrival_s)
        if req is not None and session.index == 1:
            req.hint_fanout = self.fanout_k
            req.hint_delay_s = self.delay_s
        return req

    def branch_requests(self, session: Session, arrival_s: float) -> list[SimRequest]:
        """Returns: all the branches at once (called when the trunk finishes)."""
        out = []
        while session.index < len(session.turns):
            req = super().session_request(session, arrival_s)
            assert req is not None
            out.append(req)
        return out


class SharedPrefixWorkload(Workload):
    """Shared-prefix bursts: each request is one of `shared_num_prefixes` prefixes (Zipf popularity) plus a
    unique suffix; arrivals follow the chosen process (use `bursty` for bursts)."""

    name = "shared-prefix"

    def __init__(self, cfg: GeneratorConfig, rate: float, duration_s: float, seed: int, max_context_len: int,
                 arrival: str = "bursty") -> None:
        super().__init__()
        self.page_len = cfg.page_len
        rng, ids = random.Random(seed), _Ids()
        lens = [rng.randrange(cfg.shared_prefix_min_len, 8 * cfg.shared_prefix_min_len)
                for _ in range(cfg.shared_num_prefixes)]
        lens = [x - x % cfg.page_len for x in lens]
        prefixes = [ids.take(x // cfg.page_len) for x in lens]
        weights = [1.0 / (i + 1) ** cfg.shared_zipf_s for i in range(cfg.shared_num_prefixes)]
        order = list(range(cfg.shared_num_prefixes))
        rng.shuffle(order)
        for t in arrival_times(rng, rate, duration_s, arrival):
            g = order[rng.choices(range(cfg.shared_num_prefixes), weights)[0]]
            suffix = max(1, int(_lognormal(rng, cfg.shared_suffix_len)))
            out = max(1, int(_lognormal(rng, cfg.shared_output_len, 0.6)))
            prompt = min(lens[g] + suffix, max_context_len - out)
            full = prompt // cfg.page_len
            pages = prefixes[g][:full] + ids.take(max(0, full - len(prefixes[g])))
            self.open_requests.append(SimRequest(self.new_rid(), prompt, out, pages, 0, "shared", None, None, t))


class FlashCrowdWorkload(Workload):
    """Flash crowds: every `flash_period_s` a new hot prefix (a launch, a livestream) whose request rate ramps
    linearly from 0 to its peak over `flash_ramp_s`, then holds until the next one; each request is the prefix plus
    a unique suffix. The peak is set so that the mean rate is `rate` (the arrival process: Poisson, by thinning;
    `arrival` is ignored). A prediction has the ramp as warning time while the first holder fills up."""

    name = "flash-crowd"

    def __init__(self, cfg: GeneratorConfig, rate: float, duration_s: float, seed: int, max_context_len: int,
                 arrival: str = "poisson") -> None:
        super().__init__()
        self.page_len = page = cfg.page_len
        rng, ids = random.Random(seed), _Ids()
        period, ramp = cfg.flash_period_s, cfg.flash_ramp_s
        peak = rate / (1.0 - ramp / (2.0 * period))
        prefix_len = cfg.flash_prefix_len - cfg.flash_prefix_len % page
        prefixes: dict[int, list[int]] = {}
        for t in arrival_times(rng, peak, duration_s, "poisson"):
            k = int(t // period)
            if rng.random() > min(1.0, (t - k * period) / ramp):
                continue  # thinning: intensity peak x min(1, time into the crowd / ramp)
            hot = prefixes.setdefault(k, ids.take(prefix_len // page))
            out = max(1, int(_lognormal(rng, cfg.flash_output_len, 0.6)))
            prompt = min(prefix_len + max(1, int(_lognormal(rng, cfg.flash_suffix_len))), max_context_len - out)
            full = prompt // page
            pages = hot[:full] + ids.take(max(0, full - len(hot)))
            self.open_requests.append(SimRequest(self.new_rid(), prompt, out, pages, 0, "flash", None, None, t))


class ResumeBurstWorkload(Workload):
    """Resume bursts (a batch job of agent sessions): every `resume_period_s` a batch of sessions starts, each
    with its own long history (turn 1 spread over the period); every later turn of the batch resumes at a period
    boundary, within `resume_window_s` of it (the batch's tool calls end together), adding `resume_new_len` tokens
    and the previous output. The responses before a resume end with `tool_use`. Mean rate `rate` (batch size
    rate x period / turns; `arrival` is ignored)."""

    name = "resume-burst"

    def __init__(self, cfg: GeneratorConfig, rate: float, duration_s: float, seed: int, max_context_len: int,
                 arrival: str = "poisson") -> None:
        super().__init__()
        self.page_len = page = cfg.page_len
        rng, ids = random.Random(seed), _Ids()
        period, turns = cfg.resume_period_s, cfg.resume_turns
        batch = max(1, round(rate * period / turns))
        start = 0.0
        while start < duration_s:
            for _ in range(batch):
                t = start + rng.uniform(0.0, period / 2.0)
                prompt = rng.randrange(cfg.resume_history_len, 2 * cfg.resume_history_len)
                pages: list[int] = []
                for k in range(turns):
                    if t >= duration_s:
                        break
                    out = max(1, int(_lognormal(rng, cfg.resume_output_len, 0.6)))
                    prompt = min(prompt, max_context_len - out)
                    full = prompt // page
                    if full > len(pages):
                        pages = pages + ids.take(full - len(pages))
                    stop = "tool_use" if k < turns - 1 else "end_turn"
                    self.open_requests.append(SimRequest(self.new_rid(), prompt, out, pages[:full], 0, "resume",
                                                         stop, None, t))
                    prompt += out + cfg.resume_new_len
                    if prompt + 1 >= max_context_len:
                        break
                    t = start + (k + 1) * period + rng.uniform(0.0, cfg.resume_window_s)
            start += period


class MultiCandidateWorkload(Workload):
    """Multi-candidate jobs (n > 1, best-of-K): `multi_k` requests over the same long unique prompt, sent together;
    jobs arrive at rate / K (the chosen arrival process)."""

    name = "multi-candidate"

    def __init__(self, cfg: GeneratorConfig, rate: float, duration_s: float, seed: int, max_context_len: int,
                 arrival: str = "poisson") -> None:
        super().__init__()
        self.page_len = page = cfg.page_len
        rng, ids = random.Random(seed), _Ids()
        for t in arrival_times(rng, rate / cfg.multi_k, duration_s, arrival):
            prompt = rng.randrange(cfg.multi_prompt_len, 2 * cfg.multi_prompt_len)
            prompt = min(prompt, max_context_len - cfg.multi_output_len)
            pages = ids.take(prompt // page)
            for _ in range(cfg.multi_k):
                out = max(1, int(_lognormal(rng, cfg.multi_output_len, 0.6)))
                p = min(prompt, max_context_len - out)
                self.open_requests.append(SimRequest(self.new_rid(), p, out, pages[: p // page], 0, "multi", None,
                                                     None, t))


class NoSharingWorkload(Workload):
    """The control: independent requests (the chosen arrival process), every prompt unique (no page appears in two
    requests), so no cache hit, copy or demotion can help; a policy that copies must stay inert here."""

    name = "no-sharing"

    def __init__(self, cfg: GeneratorConfig, rate: float, duration_s: float, seed: int, max_context_len: int,
                 arrival: str = "poisson") -> None:
        super().__init__()
        self.page_len = page = cfg.page_len
        rng, ids = random.Random(seed), _Ids()
        for t in arrival_times(rng, rate, duration_s, arrival):
            out = max(1, int(_lognormal(rng, cfg.nosharing_output_len, 0.6)))
            prompt = min(max(1, int(_lognormal(rng, cfg.nosharing_prompt_len))), max_context_len - out)
            self.open_requests.append(SimRequest(self.new_rid(), prompt, out, ids.take(prompt // page), 0, "none",
                                                 None, None, t))


GENERATORS = {"agent": AgentWorkload, "fanout": FanoutWorkload, "shared-prefix": SharedPrefixWorkload,
              "flash-crowd": FlashCrowdWorkload, "resume-burst": ResumeBurstWorkload,
              "multi-candidate": MultiCandidateWorkload, "no-sharing": NoSharingWorkload}
