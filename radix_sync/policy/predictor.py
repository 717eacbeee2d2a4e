"""Demand prediction: how many requests will extend a prefix node, and when.

Signals, strongest first: explicit hints (fan-out of K branches, keep-alive during a tool call), session
continuation (after a response ends with a tool call or a turn, the next request arrives after a gap whose
distribution `GapModel` learns online per class and stop reason; the probability of a follow-up decays with the
time already elapsed through the gap's survival function, and a silent session counts as abandoned once that
posterior falls below `abandon_p`), popularity (recent hit rate with burst
detection). `DemandPredictor.predict` is a pure function of a `PrefixView`, `now` and the learned gap models.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

from radix_sync.policy.snapshot import PrefixView


@dataclass(frozen=True)
class PredictorConfig:
    """Priors and windows of the demand predictor."""

    gap_min_s: float = 0.05
    """Lower edge of the gap histogram, s."""
    gap_max_s: float = 7200.0
    """Upper edge of the gap histogram, s (longer gaps fall in the last bin)."""
    num_gap_bins: int = 48
    """Log-spaced histogram bins."""
    prior_weight: float = 4.0
    """Pseudo-observations given to the prior gap distribution."""
    prior_median_tool_s: float = 10.0
    """Prior median gap after a response that ended with a tool call, s."""
    prior_median_turn_s: float = 120.0
    """Prior median gap after any other response, s."""
    prior_sigma: float = 1.2
    """Prior log-normal sigma (natural log)."""
    prior_continue_tool: float = 0.9
    """Prior probability that a tool-call response is followed by another request."""
    prior_continue_turn: float = 0.5
    """Prior probability that another response is followed by another request."""
    popularity_window_s: float = 30.0
    """Window for the long-run hit rate, s."""
    burst_window_s: float = 3.0
    """Window for the burst hit rate, s."""
    min_hits: int = 3
    """A window's hit rate counts only from this many hits in it (the burst window's and the long window's alike;
    fewer in both: no popularity). Two hits within 3 s extrapolated to 20 requests in a 30 s horizon (live agent
    sessions: 19 of 342 such predicted requests came), and two within 30 s made most of the live planner's first
    bets, none used (docs/bench.md, "A burst needs three hits"); a crowd has three within its first seconds.
    1: any hit (the rule before)."""
    abandon_p: float = 0.02
    """A silent session counts as abandoned once the posterior probability of a follow-up is below this."""

    def __post_init__(self) -> None:
        if not 0 < self.gap_min_s < self.gap_max_s:
            raise ValueError(f"gap range ({self.gap_min_s!r}, {self.gap_max_s!r}) must satisfy 0 < min < max")
        if self.min_hits < 1:
            raise ValueError(f"min_hits={self.min_hits!r} must be >= 1")
        if self.num_gap_bins < 2:
            raise ValueError(f"num_gap_bins={self.num_gap_bins!r} must be >= 2")
        for name in ("prior_weight", "prior_median_tool_s", "prior_median_turn_s", "prior_sigma",
                     "popularity_window_s", "burst_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        for name in ("prior_continue_tool", "prior_continue_turn", "abandon_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in [0, 1]")


class Demand(NamedTuple):
    """Predicted demand for one prefix node within a horizon.

    NOTE: a NamedTuple (as immutable as the frozen dataclass it was, several times cheaper to build): a plan tick
    predicts every candidate's demand, a thousand of them at 100,000 prefixes."""

    expected_count: float
    """Expected number of requests extending the node within the horizon."""
    arrival_s: float
    """Representative arrival time of those requests (absolute)."""
    horizon_s: float
    """Absolute end of the prediction window."""
    source: str
    """`hint`, `session`, `popularity` or `none`."""


class GapModel:
    """Online histogram of gaps (s) on log-spaced bins, seeded with a log-normal prior and a continue probability."""

    def __init__(self, cfg: PredictorConfig, prior_median_s: float, prior_continue: float) -> None:
        lo, hi, n = math.log(cfg.gap_min_s), math.log(cfg.gap_max_s), cfg.num_gap_bins
        self.edges_s = [math.exp(lo + (hi - lo) * i / n) for i in range(n + 1)]
        self.counts = [0.0] * n
        mu, sig = math.log(prior_median_s), cfg.prior_sigma
        cdf = [0.5 * (1.0 + math.erf((math.log(e) - mu) / (sig * math.sqrt(2.0)))) for e in self.edges_s]
        cdf[0], cdf[-1] = 0.0, 1.0
        for i in range(n):
            self.counts[i] = cfg.prior_weight * (cdf[i + 1] - cdf[i])
        self.num_continued = cfg.prior_weight * prior_continue
        self.num_ended = cfg.prior_weight * (1.0 - prior_continue)
        self.num_open = 0.0
        """Responses still waiting for their follow-up (censored observations), as last reported."""
        self.open_alive = 0.0
        """Their expected number of follow-ups still to come (sum of `p_alive`), as last reported."""
        self._cum: Optional[list[float]] = None

    def observe_gap(self, gap_s: float) -> None:
        """Records one observed gap (a follow-up arrived `gap_s` after the response)."""
        i = bisect.bisect_right(self.edges_s, gap_s) - 1
        self.counts[min(max(i, 0), len(self.counts) - 1)] += 1.0
        self.num_continued += 1.0
        self._cum = None

    def observe_end(self) -> None:
        """Records a response that was never followed up."""
        self.num_ended += 1.0

    def observe_late_followup(self, gap_s: float) -> None:
        """Records a follow-up that arrived after its response had been counted as abandoned: the end is taken
        back and the gap recorded."""
        self.num_ended = max(0.0, self.num_ended - 1.0)
        self.observe_gap(gap_s)

    def observe_open(self, num_open: float, expected_alive: float) -> None:
        """Reports the responses still waiting for a follow-up: `num_open` of them, of which `expected_alive`
        (the sum of their `p_alive`) are expected to be followed up. They enter `p_continue` as censored data
        (one EM step per report), so silence lowers the estimate long before anything counts as abandoned."""
        self.num_open = num_open
        self.open_alive = expected_alive

    @property
    def p_continue(self) -> float:
        """Probability that a follow-up comes at all: (continued + expected alive among the open) / all."""
        return (self.num_continued + self.open_alive) / (self.num_continued + self.num_ended + self.num_open)

    def survival(self, gap_s: float) -> float:
        """P(gap > gap_s | a follow-up comes)."""
        return 1.0 - self.cdf(gap_s)

    def p_alive(self, elapsed_s: float) -> float:
        """Posterior probability that a follow-up is still to come, `elapsed_s` after the response with none yet.

        With c = p_continue and S the survival function of the gap: c S(e) / (1 - c + c S(e)). It decays with
        the elapsed time, faster when the learned gaps are short.
        """
        c = self.p_continue
        alive = c * self.survival(elapsed_s)
        dead = 1.0 - c
        return alive / (alive + dead) if alive + dead > 1e-12 else 0.0

    def abandon_after_s(self, abandon_p: float) -> float:
        """Elapsed time (s) after which `p_alive` is below `abandon_p`: S(e) < p (1 - c) / (c (1 - p))."""
        c = self.p_continue
        if c <= 0.0:
            return 0.0
        s_max = abandon_p * (1.0 - c) / (c * (1.0 - abandon_p))
        if s_max >= 1.0:
            return 0.0
        return self.quantile(1.0 - s_max)

    def p_within(self, elapsed_s: float, horizon_s: float) -> float:
        """P(the follow-up arrives within `horizon_s` | none in the first `elapsed_s`):
        c (S(e) - S(e + h)) / (1 - c + c S(e))."""
        c = self.p_continue
        s0 = self.survival(elapsed_s)
        den = 1.0 - c + c * s0
        return c * (s0 - self.survival(elapsed_s + horizon_s)) / den if den > 1e-12 else 0.0

    def cdf(self, gap_s: float) -> float:
        """P(gap <= gap_s | a follow-up comes), interpolated log-linearly inside a bin."""
        if self._cum is None:
            total, acc, cum = sum(self.counts), 0.0, [0.0]
            for c in self.counts:
                acc += c
                cum.append(acc / total)
            self._cum = cum
        e = self.edges_s
        if gap_s <= e[0]:
            return 0.0
        if gap_s >= e[-1]:
            return 1.0
        i = bisect.bisect_right(e, gap_s) - 1
        frac = math.log(gap_s / e[i]) / math.log(e[i + 1] / e[i])
        return self._cum[i] + frac * (self._cum[i + 1] - self._cum[i])

    def quantile(self, q: float) -> float:
        """Smallest gap g (s) with cdf(g) >= q (inverse of the log-linear interpolation)."""
        self.cdf(self.edges_s[0] * 2.0)  # builds the cumulative table
        cum, e = self._cum, self.edges_s
        q = min(max(q, 0.0), 1.0)
        i = bisect.bisect_left(cum, q) - 1
        i = min(max(i, 0), len(e) - 2)
        lo, hi = cum[i], cum[i + 1]
        frac = 0.0 if hi <= lo else (q - lo) / (hi - lo)
        return e[i] * (e[i + 1] / e[i]) ** frac


def _is_tool(stop: Optional[str]) -> bool:
    return stop == "tool_use"


class DemandPredictor:
    """Turns a `PrefixView` into a `Demand`, learning gap distributions per (class, stop kind) online."""

    def __init__(self, cfg: PredictorConfig = PredictorConfig()) -> None:
        self.cfg = cfg
        self._gaps: dict[tuple[str, bool], GapModel] = {}

    def gap_model(self, class_key: str, stop: Optional[str]) -> GapModel:
        """Returns: the (lazily created) gap model of a class and stop kind (tool call or not)."""
        key = (class_key, _is_tool(stop))
        m = self._gaps.get(key)
        if m is None:
            tool = key[1]
            m = GapModel(self.cfg, self.cfg.prior_median_tool_s if tool else self.cfg.prior_median_turn_s,
                         self.cfg.prior_continue_tool if tool else self.cfg.prior_continue_turn)
            self._gaps[key] = m
        return m

    def gap_models(self) -> dict[tuple[str, bool], GapModel]:
        """Returns: the gap models created so far, by (class, ended in a tool call)."""
        return dict(self._gaps)

    def observe_followup(self, class_key: str, stop: Optional[str], gap_s: float) -> None:
        """Feeds a follow-up that arrived `gap_s` after a response that ended with `stop`."""
        self.gap_model(class_key, stop).observe_gap(gap_s)

    def observe_abandoned(self, class_key: str, stop: Optional[str]) -> None:
        """Feeds a response that was never followed up."""
        self.gap_model(class_key, stop).observe_end()

    def observe_late_followup(self, class_key: str, stop: Optional[str], gap_s: float) -> None:
        """Feeds a follow-up of a response earlier fed to `observe_abandoned`."""
        self.gap_model(class_key, stop).observe_late_followup(gap_s)

    def is_abandoned(self, class_key: str, stop: Optional[str], elapsed_s: float) -> bool:
        """Whether a response with no follow-up after `elapsed_s` counts as abandoned: the posterior probability
        of a follow-up (`GapModel.p_alive`) has fallen below `abandon_p`."""
        return self.gap_model(class_key, stop).p_alive(elapsed_s) < self.cfg.abandon_p

    def abandon_after_s(self, class_key: str, stop: Optional[str]) -> float:
        """Elapsed time (s) after which a silent response of this class and stop kind counts as abandoned."""
        return self.gap_model(class_key, stop).abandon_after_s(self.cfg.abandon_p)

    def predict_all(self, nodes, now: float, horizon_s: float) -> list[Demand]:
        """`predict` of each of `nodes`, in order (popularity alone, the common case, without a call each)."""
        if type(self).predict is not DemandPredictor.predict:
            return [self.predict(node, now, horizon_s) for node in nodes]
        end = now + horizon_s
        window, burst, min_hits = self.cfg.popularity_window_s, self.cfg.burst_window_s, self.cfg.min_hits
        since_long, since_short = now - window, now - burst
        arrival = now + 0.5 * horizon_s
        none = Demand(0.0, end, end, "none")
        new = functools.partial(tuple.__new__, Demand)
        out = []
        for node in nodes:
            if node.fanout_hint > 0 or node.keepalive_until_s is not None or node.last_finish_s is not None:
                out.append(self.predict(node, now, horizon_s))
                continue
            times = node.recent_hit_times_s
            if not times:
                out.append(none)
                continue
            # (`popularity_rate`, inline)
            n = len(times)
            k = n - bisect.bisect_left(times, since_long)
            rate = k / window if k >= min_hits else 0.0
            k = n - bisect.bisect_left(times, since_short)
            if k >= min_hits and k / burst > rate:
                rate = k / burst
            # (`tuple.__new__`: a NamedTuple's own constructor is a Python function, a frame per prefix)
            out.append(new((rate * horizon_s, arrival, end, "popularity")) if rate > 0.0 else none)
        return out

    def predict(self, node: PrefixView, now: float, horizon_s: float) -> Demand:
        """Predicts the requests extending `node` within `[now, now + horizon_s]`.

        Args:
            node: the prefix node with its signals.
            now: current time, s.
            horizon_s: window length, s.
        Returns:
            the demand from the strongest available signal.
        """
        end = now + horizon_s
        if node.fanout_hint > 0:
            at = node.hint_at_s if node.hint_at_s is not None else now
            if at <= end:
                return Demand(float(node.fanout_hint), max(at, now), end, "hint")
        if node.keepalive_until_s is not None and node.keepalive_until_s >= now:
            return Demand(1.0, min(node.keepalive_until_s, end), end, "hint")
        if node.last_finish_s is not None:
            m = self.gap_model(node.class_key, node.last_stop)
            elapsed = max(0.0, now - node.last_finish_s)
            p = m.p_within(elapsed, horizon_s)
            if p > 0.0:
                f0, f1 = m.cdf(elapsed), m.cdf(elapsed + horizon_s)
                gap = m.quantile(0.5 * (f0 + f1))
                return Demand(p, max(now, node.last_finish_s + gap), end, "session")
        if node.recent_hit_times_s:
            rate = popularity_rate(node.recent_hit_times_s, now, self.cfg.popularity_window_s,
                                   self.cfg.burst_window_s, self.cfg.min_hits)
            if rate > 0.0:
                return Demand(rate * horizon_s, now + 0.5 * horizon_s, end, "popularity")
        return Demand(0.0, end, end, "none")


def popularity_rate(hit_times_s: tuple[float, ...], now: float, window_s: float, burst_window_s: float,
                    min_hits: int = 1) -> float:
    """Hit rate of a node (requests/s): the larger of the long-window and the burst-window rates, each only from
    `min_hits` hits in its window.

    Args:
        hit_times_s: hit times, oldest first.
        now: current time, s.
        window_s: long window, s.
        burst_window_s: short window, s (catches a burst before the long rate does).
        min_hits: fewest hits in a window for its rate to count.
    Returns:
        requests/s.
    """
    n = len(hit_times_s)
    k_long = n - bisect.bisect_left(hit_times_s, now - window_s)
    k_short = n - bisect.bisect_left(hit_times_s, now - burst_window_s)
    return max(k_long / window_s if k_long >= min_hits else 0.0,
               k_short / burst_window_s if k_short >= min_hits else 0.0)
