"""The planner's inner loop: the best copy of one prefix to any target, scored pair by pair (`best_candidate`),
and what a planning pass keeps for it about the targets (`PassTargets`), the links' memory (`LandingRoom`) and
the cost model (`CostMemo`).

For a prefix with predicted demand, every compatible target is scored at each candidate depth: the source that
lands the copy first, the expected TTFT of the prefix's requests with the copy there (`radix_sync.policy.spread`),
less the copy's link time, the memory it displaces and the delay it imposes on the pulls behind it
(`radix_sync.policy.gate`). Targets alike in every input of that score are scored once. See
`radix_sync.policy.planner` for the whole gain and the gate.

Pure: the pass's state in, the best copy (or None) out; `why` (the caller's) counts the reasons targets were
turned down. Who calls it: `KvrepPlanner._plan_node`, for every copy of every prefix a pass scores.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Optional

from radix_sync.policy.cost import CostModel
from radix_sync.policy.forecast import WaitForecast
from radix_sync.policy.gate import landing_room_tokens, pull_delay_s
from radix_sync.policy.snapshot import WorkerView
from radix_sync.policy.spread import Spread, num_spread


class PassTargets:
    """Per target, what `best_candidate` reads of it that is the same for every prefix of a planning pass (as a
    kind: `kinds`), taken again when a copy to it is accepted (`changed`); and per fingerprint the targets a copy
    may go to (`compatible`)."""

    def __init__(self, workers: tuple[WorkerView, ...], ingress: list[float], budget: list[int], free: list[int],
                 room: "LandingRoom") -> None:
        self._workers, self._ingress, self._budget, self._free, self._room = workers, ingress, budget, free, room
        self._ids: dict[tuple, int] = {}
        self.kinds = [self._kind(t) for t in range(len(workers))]
        """Per target, its kind: equal for targets equal in `_key` (a small negative int, cheap to hash, apart
        from any worker index)."""
        self._compatible: dict[str, list[int]] = {}

    def _kind(self, t: int) -> int:
        return self._ids.setdefault(self._key(t), -1 - len(self._ids))

    def _key(self, t: int) -> tuple:
        w = self._workers[t]
        return (self._ingress[t], self._budget[t], self._room.tokens[t], self._free[t], w.nic_bandwidth_bytes_per_s,
                w.busy_until_s, w.ingress_pull_rate_per_s)

    def changed(self, t: int) -> None:
        """A copy to `t` was accepted (its link, budget, memory and room changed)."""
        self.kinds[t] = self._kind(t)

    def compatible(self, fingerprint: str) -> list[int]:
        """The workers a copy from a worker with `fingerprint` may go to (same fingerprint, a link), in order."""
        out = self._compatible.get(fingerprint)
        if out is None:
            out = self._compatible[fingerprint] = [
                t for t, w in enumerate(self._workers)
                if w.fingerprint == fingerprint and w.nic_bandwidth_bytes_per_s > 0]
        return out


def source_iteration_bound_s(cfg, cost: CostModel) -> float:
    """The longest a copy on a request's path can wait for its source's iteration in progress: one chunk's prefill
    with `PlannerConfig.endpoint_wait`, 0 without."""
    return cost.prefill_s(cost.profile.chunked_prefill_len, 0) if cfg.endpoint_wait else 0.0


def source_iteration_s(cfg, cost: CostModel, source_wait_s: float) -> float:
    """What a copy on a request's path waits for at its source before its gather (`PlannerConfig.endpoint_wait`):
    the rest of the iteration in progress there when the request arrives; the iteration as the live router's
    puller takes it (`forecast.split_iteration`: the source's queued work, at most one chunk's prefill), half of it
    left on average (as the live planner takes a busy worker's iteration); 0 without endpoint waits.
    The holder of a prefix many requests want is where they queue, so its iteration is rarely over when a pull
    wants its pages: priced at the copy's transfer alone, the pull looked as good as a copy made earlier, while
    the target was free (stop 54: fan-out's hint copies refused in two rounds of three, level with `pull`; made in
    the third, 0.78x its mean)."""
    return 0.5 * min(max(0.0, source_wait_s), source_iteration_bound_s(cfg, cost))


def best_candidate(cfg, cost: CostModel, page: int, targets: "PassTargets", np_, fc: WaitForecast,
                   workers: tuple[WorkerView, ...], kvb: int, egress: list[float], ingress: list[float],
                   budget: list[int], free: list[int], room: "LandingRoom", now: float,
                   why: Optional[dict[str, int]] = None, waits: Optional[list[float]] = None,
                   host_s_per_token: float = 0.0,
                   betting: Optional[set[int]] = None) -> Optional[tuple[float, int, int, int, float, int]]:
    """Returns: (gain, target, depth, source, landing time, tier) of the best copy of one prefix (`np_`, the
    planner's plan of it) by gain per byte, or None. `cfg`: the planner's `PlannerConfig`; `page`: tokens a page;
    `targets`: the pass's `PassTargets`; `egress`, `ingress`, `budget`, `free`, `room`: the pass's links and memory
    so far. `why` counts the reasons candidates were turned down; `waits`: every worker's `fc.wait_at` the node's
    predicted arrival, when the caller has them.

    `host_s_per_token` > 0: the targets have a host-memory tier (SGLang's hierarchical cache) that loads a page
    back to the device in this many seconds a token before the prefill that hits it; every depth is then also
    scored as a copy into the target's host memory (tier 1; tier 0: the device pool): the hit's prefill is
    longer by the load, and the copy takes none of the device's replica budget or landing room and displaces no
    device cache (no memory cost: what it displaces is the host tier's least recently used pages, which the
    device had already given up). For one target the tier and depth with the larger gain win (the same bytes on
    the link either way); across targets, the larger gain per byte.

    `betting`: the targets a copy of this prefix to is still a bet (`UseCalibration.betting`): not scored."""
    L = np_.node.token_len
    limit = now + cfg.max_link_backlog_s
    depth_of, eta = np_.depth, np_.eta
    # a link's backlog counts from when its holder has the pages (a prefill or copy in flight is no backlog)
    sources = [(max(eta.get(s, now), egress[s]), s) for s in depth_of
               if (cfg.chain_sources or s not in eta)
               and egress[s] <= max(now, eta.get(s, now)) + cfg.max_link_backlog_s]
    if not sources:
        if why is not None:
            why["every source's link is booked"] = why.get("every source's link is booked", 0) + 1
        return None
    sources.sort()
    t_a = np_.demand.arrival_s
    costs = CostMemo(cost)
    prefill_s, transfer_s = costs.prefill_s, costs.transfer_s
    if waits is None:
        waits = fc.waits_at(t_a)
    # every worker's option (`_option_s`, the same arithmetic)
    n = len(workers)
    new_len = np_.new_len
    src_w = workers[np_.source]
    full = prefill_s(new_len + L, 0)
    svc_hit = prefill_s(new_len, L)
    if cfg.allow_pull and src_w.nic_bandwidth_bytes_per_s > 0:
        opts = []
        src_bw = src_w.nic_bandwidth_bytes_per_s
        gather = source_iteration_s(cfg, cost, waits[np_.source])
        for w, wait in zip(workers, waits):
            best_s = wait + full
            if w.nic_bandwidth_bytes_per_s > 0:
                pull = gather + transfer_s(L * kvb, min(src_bw, w.nic_bandwidth_bytes_per_s))
                best_s = min(best_s, max(wait, pull) + svc_hit)
            opts.append((best_s, full))
    else:
        opts = [(wait + full, full) for wait in waits]
    for w, held in depth_of.items():
        if 0 <= w < n and held > 0:
            svc = prefill_s(new_len + L - held, held)
            opts[w] = (max(waits[w], eta.get(w, fc.now) - t_a) + svc, svc)
    count = np_.demand.expected_count
    spread = Spread(opts, num_spread(count, cfg.max_spread))
    base = spread.base_s
    fp = workers[np_.source].fingerprint
    depths = []
    for frac in cfg.depth_fractions:
        depth = int(L * frac)
        depth -= depth % page
        depths.append((depth, prefill_s(new_len + L - depth, depth)))
    endpoint_wait = cfg.endpoint_wait
    room_tokens = room.tokens
    min_gain, link_cost_weight, reuse_prob = cfg.min_gain_s, cfg.link_cost_weight, cfg.displaced_reuse_prob

    def copies(w: WorkerView, t: int) -> list:
        """Per depth, what a copy to `t` is whatever `t`'s wait: a reason it is refused (a str), or (depth, bytes,
        source, landing time, hit prefill seconds, link cost, memory cost, harm, the gain if it changes none of
        the spread's values)."""
        held = depth_of.get(t, 0)
        out: list = []
        for depth, svc in depths:
            if depth <= held:
                continue
            tokens = depth - held
            device = True
            if tokens > budget[t]:
                out.append("replica budget")
                device = False
            elif tokens > room_tokens[t]:
                out.append("would evict a wanted page")
                device = False
            if not (device or host_s_per_token):
                continue
            nbytes = tokens * kvb
            # the source that lands the copy first (a holder is a source from its own arrival on)
            src, land, xfer = -1, math.inf, 0.0
            for ready, s in sources:
                if ready >= land:
                    break
                if s == t or depth_of[s] < depth:
                    continue
                x = transfer_s(nbytes, min(workers[s].nic_bandwidth_bytes_per_s, w.nic_bandwidth_bytes_per_s))
                end = max(now, ready, ingress[t]) + x
                if endpoint_wait:  # gathered after the source's iteration, installed after the target's
                    end = max(max(now, ready, ingress[t], workers[s].busy_until_s) + x, w.busy_until_s)
                if end < land:
                    src, land, xfer = s, end, x
            if src < 0:
                out.append("no source")
                continue
            # the delay it imposes on the critical-path pulls that want the two links meanwhile
            harm = (pull_delay_s(workers[src].egress_pull_rate_per_s, land - xfer, xfer, now)
                    + pull_delay_s(w.ingress_pull_rate_per_s, land - xfer, xfer, now))
            link_cost = link_cost_weight * xfer
            if device:
                displaced = max(0, tokens - free[t])
                mem_cost = reuse_prob * prefill_s(displaced, 0) if displaced else 0.0
                # (the gain where the copy changes none of the spread's values: `spread.with_option` is its base)
                flat = count * (base - base) - link_cost - mem_cost - harm
                out.append((depth, nbytes, src, land, svc, link_cost, mem_cost, harm, flat, 0))
            if host_s_per_token:
                out.append((depth, nbytes, src, land, svc + tokens * host_s_per_token, link_cost, 0.0, harm,
                            -link_cost - harm, 1))
        return out

    # NOTE: targets alike in everything the scoring reads score alike (the idle workers, mostly): each kind is
    # scored once, for the first target of its kind (the others of a kind tie with it on gain per byte, and the
    # first best wins), its reasons counted once per target. A kind is what the pass knows of the target
    # (`PassTargets.kinds`: its link, budget, memory, room, bandwidth, iteration, pull rate) and its wait (for a
    # worker that does not hold the prefix, its option is a function of these: `opts` above), or, for a holder,
    # the holder itself. What does not depend on the wait (`copies`) is taken once per kind of target.
    # `spread.with_option` depends on `opts[t]`, not on `t` (see `radix_sync.policy.spread`).
    target_kinds = targets.kinds
    compatible = targets.compatible(fp)
    booked = bet = 0
    if len(compatible) == n and max(ingress) <= limit and not betting:
        # (every worker is a target and no target's link is booked: the kinds grouped by C loops)
        keys = list(zip(target_kinds, waits))
        for t in depth_of:
            if 0 <= t < n:
                keys[t] = (t, 0.0)
        counts = Counter(keys)
        kinds = sorted((t, key) for key, t in dict(zip(reversed(keys), range(n - 1, -1, -1))).items())
    else:
        counts = {}
        kinds = []
        for t in compatible:
            if ingress[t] > limit:
                booked += 1
                continue
            if betting and t in betting:
                bet += 1
                continue
            key = (t, 0.0) if t in depth_of else (target_kinds[t], waits[t])
            num = counts.get(key)
            if num is None:
                kinds.append((t, key))
                counts[key] = 1
            else:
                counts[key] = num + 1
    if why is not None and booked:
        why["target link booked"] = why.get("target link booked", 0) + booked
    if why is not None and bet:
        why["a copy there is still a bet"] = why.get("a copy there is still a bet", 0) + bet
    best: Optional[tuple[float, int, int, int, float, int]] = None
    best_ratio = 0.0
    plans: dict[int, list] = {}
    inner, last = spread.inner, spread.last
    slower = below = 0  # (the two common reasons, counted here and added to `why` at the end)
    for t, key in kinds:
        num = counts[key]
        kind_of = key[0]
        plan = plans.get(kind_of)
        if plan is None:
            plan = plans[kind_of] = copies(workers[t], t)
        # the best copy to `t` (None: none clears the bar), its reasons counted `num` times
        wait_t, first_t = waits[t], opts[t][0]
        target_best = None
        for c in plan:
            if c.__class__ is str:
                if why is not None:
                    why[c] = why.get(c, 0) + num
                continue
            depth, nbytes, src, land, svc, link_cost, mem_cost, harm, flat, tier = c
            new_first = max(wait_t, land - t_a) + svc
            if new_first >= first_t:
                slower += num
                continue
            if last is None:
                gain = count * (base - spread.with_option(t, (new_first, svc))) - link_cost - mem_cost - harm
            elif t not in inner:
                if new_first >= last:
                    gain = flat  # (`Spread.with_option`'s answer for it: the base)
                else:
                    gain = count * (base - spread.with_option(t, (new_first, svc))) - link_cost - mem_cost - harm
            elif (flat if new_first >= last else count * (base - spread.merged((new_first, svc))) - link_cost
                  - mem_cost - harm) < min_gain:
                # NOTE: one of the k smallest options: its spread is no less than `Spread.merged` (the base when
                # the new option starts at or after the base's last value), so its gain is no more than that
                # one's (every step rounds monotonically), below the bar: the same answer without the spread's
                # heap
                below += num
                continue
            else:
                gain = count * (base - spread.with_option(t, (new_first, svc))) - link_cost - mem_cost - harm
            # depth by marginal gain: the deepest copy wins unless a shallower one nets more
            if gain < min_gain:
                below += num
            elif target_best is None or gain > target_best[0]:
                target_best = (gain, depth, src, land, nbytes, tier)
        if target_best is not None:
            gain, depth, src, land, nbytes, tier = target_best
            ratio = gain / nbytes
            if ratio > best_ratio:
                best, best_ratio = (gain, t, depth, src, land, tier), ratio
    if why is not None:
        if slower:
            why["no faster there"] = why.get("no faster there", 0) + slower
        if below:
            why["gain below minimum"] = why.get("gain below minimum", 0) + below
    return best


class CostMemo:
    """One candidate's memo of the cost model's answers (the same few arguments come back for every target):
    the same values, computed once."""

    def __init__(self, cost: CostModel) -> None:
        self._cost = cost
        self._prefill: dict[tuple[int, int], float] = {}
        self._transfer: dict[tuple[float, float], float] = {}

    def prefill_s(self, new_len: int, cached_len: int) -> float:
        key = (new_len, cached_len)
        v = self._prefill.get(key)
        if v is None:
            v = self._prefill[key] = self._cost.prefill_s(new_len, cached_len)
        return v

    def transfer_s(self, num_bytes: float, bandwidth_bytes_per_s: float = 0.0) -> float:
        key = (num_bytes, bandwidth_bytes_per_s)
        v = self._transfer.get(key)
        if v is None:
            v = self._transfer[key] = self._cost.transfer_s(num_bytes, bandwidth_bytes_per_s)
        return v


class LandingRoom:
    """Per target, the tokens a copy may still bring without evicting a wanted page (`gate.landing_room_tokens`),
    updated as the pass accepts copies (each one is incoming, then wanted)."""

    def __init__(self, workers: tuple[WorkerView, ...], wanted: list[int], wanted_ordinary: list[int]) -> None:
        self._workers = workers
        self._wanted = wanted
        self._ordinary = wanted_ordinary
        self._incoming = [0] * len(workers)
        self.tokens = [landing_room_tokens(w, wanted[i], wanted_ordinary[i]) for i, w in enumerate(workers)]

    def add(self, target: int, tokens: int) -> None:
        """A copy of `tokens` to `target` was accepted."""
        self._incoming[target] += tokens
        self._wanted[target] += tokens
        w = self._workers[target]
        self.tokens[target] = landing_room_tokens(
            w._replace(incoming_tokens=w.incoming_tokens + self._incoming[target]), self._wanted[target],
            self._ordinary[target])
