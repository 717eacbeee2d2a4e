"""Synthetic workloads: agent sessions, tree-search fan-out, shared-prefix bursts with Zipf popularity.

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

    def __post_init__(self) -> None:
        for name in ("page_len", "agent_system_len", "agent_num_tenants", "agent_new_len", "agent_output_len",
                     "fanout_k", "fanout_prefix_min_len", "fanout_branch_len", "fanout_output_len",
                     "shared_num_prefixes", "shared_prefix_min_len", "shared_suffix_len", "shared_output_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.agent_mean_turns < 1 or not 0 <= self.agent_p_end_turn <= 1:
            raise ValueError(f"agent_mean_turns={self.agent_mean_turns!r} must be >= 1, agent_p_end_turn="
                             f"{self.agent_p_end_turn!r} in [0, 1]")
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


GENERATORS = {"agent": AgentWorkload, "fanout": FanoutWorkload, "shared-prefix": SharedPrefixWorkload}
