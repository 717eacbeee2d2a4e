"""The copy ledger: whether the planner's copies pay, measured live on the requests themselves (a holdout).

Pure (no I/O, no clock of its own): the coordinator's (`ClusterState.ledger`, `pull_ledger`) and the simulator's
(`EngineConfig.ledger_holdout`) are this same object, fed the same way.

Copying ahead is a bet, and the coordinator must know when it loses. In active mode each prefix the planner wants
to copy is assigned once, at random (by its hash: reproducible), to one of two groups for `attribution_s`:
`copied` (its copies are made) or `held_out` (they are not: the prefix is served as without the planner, by
routing and the router's own pulls). Each answer the routers report with its time to first token (`FinishReport.
ttft_s`) is attributed to the deepest prefix of its prompt that has a live assignment. The difference of the two
groups' mean TTFT, with a 95% interval (Welch), is the realised gain of the planner's copies over not making
them, on the same traffic, at the same time:

- `pays`: the copied group is faster (the interval's upper end below 0): new decisions are then held out at the
  lower share `holdout` x `paying_share` (the holdout is what measuring costs: a prefix held out is served
  without its copies);
- `costs`: it is slower (the lower end above 0): the planner is then **paused** (every new decision held out, so
  the system is inert) until the evidence ages out of `window_s` and the bet is probed again;
- `not shown`: neither, or fewer than `min_samples` answers in a group.

Caveats, on `/status` with the numbers: prefixes are assigned, not requests, so a handful of hot prefixes make the
interval wide; requests of a held-out prefix still compete with the copied ones for the same workers and links
(the comparison is of copying a prefix or not, within a fleet that copies others).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

COPIED, HELD_OUT = "copied", "held_out"


@dataclass(frozen=True)
class LedgerConfig:
    holdout: float = 0.2
    """Fraction of prefixes held out (0: no holdout, the ledger never judges; 1: the planner never copies)."""
    paying_share: float = 0.25
    """While the copies are shown to pay, `holdout` x this is held out (the prefixes held out then are among those
    `holdout` would hold out; 1: the same holdout whatever the verdict, as before stop 58). Measured in the simulator
    (fan-out, 16 H200 workers, one router, seeds 1-4, stop 58): holding out 0.2 of the prefixes whose copies pay cost
    1.08-1.22x the mean time to first token of copying all; answers still come to the held-out group at the lower
    share, so a change of verdict is still seen."""
    attribution_s: float = 120.0
    """How long a prefix keeps its group (answers on it count for that group meanwhile), s."""
    window_s: float = 600.0
    """Answers older than this are forgotten (so a pause ends and the bet is probed again), s."""
    min_samples: int = 30
    """Answers per group before any verdict."""
    max_samples: int = 20_000
    """Answers kept per group at most."""
    max_assigned: int = 100_000
    """Prefixes with a live group at most (the oldest are forgotten first)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.holdout <= 1.0:
            raise ValueError(f"holdout={self.holdout!r} must be in [0, 1]")
        if not 0.0 <= self.paying_share <= 1.0:
            raise ValueError(f"paying_share={self.paying_share!r} must be in [0, 1]")
        for name in ("attribution_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.min_samples < 2 or self.max_samples < self.min_samples or self.max_assigned < 1:
            raise ValueError("need 2 <= min_samples <= max_samples and max_assigned >= 1")


def _unit(block_hash: int) -> float:
    """A reproducible uniform draw in [0, 1) from a prefix hash (splitmix64's finaliser)."""
    x = (block_hash + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x / 2.0 ** 64


def welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Returns: (mean(a) - mean(b), the 95% interval's low and high ends), normal approximation with Welch's
    standard error (each list has >= 2 values)."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / (na - 1)
    vb = sum((x - mb) ** 2 for x in b) / (nb - 1)
    se = math.sqrt(va / na + vb / nb)
    d = ma - mb
    return d, d - 1.96 * se, d + 1.96 * se


class CopyLedger:
    def __init__(self, cfg: LedgerConfig = LedgerConfig()) -> None:
        self.cfg = cfg
        self._assigned: dict[int, tuple[str, float]] = {}
        """Prefix hash -> (group, until when), insertion order = assignment order."""
        self._samples: dict[str, deque[tuple[float, float]]] = {COPIED: deque(), HELD_OUT: deque()}
        """Group -> (when, TTFT s) of the answers attributed to it, oldest first."""
        self.num_answers_timed = 0
        """Answers reported with a time to first token (attributed to a group or not): the evidence flowing in."""
        self.num_decisions = {COPIED: 0, HELD_OUT: 0, "paused": 0}
        """Planner decisions made (copied), held out by the draw, and held out because the planner was paused."""

    # ------------------------------------------------------------------------------------------------ writes
    def assign(self, block_hash: int, now_s: float) -> bool:
        """A planner decision on this prefix: returns whether to make the copy. The prefix keeps its group for
        `attribution_s` from its first decision; while the ledger says `costs`, new prefixes are held out, while it
        says `pays`, a smaller share of them (`paying_share`)."""
        cfg = self.cfg
        entry = self._assigned.get(block_hash)
        if entry is None or entry[1] < now_s:
            verdict = self.verdict(now_s)[0]
            if verdict == "costs":
                group = HELD_OUT
                self.num_decisions["paused"] += 1
            else:
                group = HELD_OUT if _unit(block_hash) < self._share(verdict) else COPIED
                self.num_decisions[group] += 1
            self._assigned.pop(block_hash, None)
            self._assigned[block_hash] = (group, now_s + cfg.attribution_s)
            while len(self._assigned) > cfg.max_assigned:
                self._assigned.pop(next(iter(self._assigned)))
            entry = self._assigned[block_hash]
        return entry[0] == COPIED

    def finished(self, page_hashes: Iterable[int], ttft_s: Optional[float], now_s: float) -> Optional[str]:
        """An answer ended, with its time to first token: counts for the group of the deepest prefix of its prompt
        with a live group. Returns: the group, or None (no TTFT, or no prefix of it was decided on)."""
        if ttft_s is None or not math.isfinite(ttft_s) or ttft_s < 0:
            return None
        self.num_answers_timed += 1
        for h in reversed(list(page_hashes)):
            entry = self._assigned.get(h)
            if entry is not None and entry[1] >= now_s:
                samples = self._samples[entry[0]]
                samples.append((now_s, ttft_s))
                if len(samples) > self.cfg.max_samples:
                    samples.popleft()
                return entry[0]
        return None

    def _trim(self, now_s: float) -> None:
        cut = now_s - self.cfg.window_s
        for samples in self._samples.values():
            while samples and samples[0][0] < cut:
                samples.popleft()
        stale = [h for h, (_, until) in self._assigned.items() if until < now_s]
        for h in stale[:1024]:  # bounded work per call; the rest on later calls
            del self._assigned[h]

    # ------------------------------------------------------------------------------------------------- reads
    def _share(self, verdict: str) -> float:
        """The share of new prefixes held out under `verdict` (all while the copies cost)."""
        cfg = self.cfg
        return 1.0 if verdict == "costs" else cfg.holdout * (cfg.paying_share if verdict == "pays" else 1.0)

    def verdict(self, now_s: float) -> tuple[str, Optional[tuple[float, float, float]]]:
        """Returns: (`pays` | `costs` | `not shown`, (copied - held-out mean TTFT, its 95% interval) or None)."""
        self._trim(now_s)
        a = [t for _, t in self._samples[COPIED]]
        b = [t for _, t in self._samples[HELD_OUT]]
        if len(a) < self.cfg.min_samples or len(b) < self.cfg.min_samples:
            return "not shown", None
        d, lo, hi = welch(a, b)
        return ("costs" if lo > 0 else "pays" if hi < 0 else "not shown"), (d, lo, hi)

    def status(self, now_s: float) -> dict:
        """What `/status` shows as `ledger`."""
        verdict, diff = self.verdict(now_s)
        groups = {}
        for g, samples in self._samples.items():
            ts = [t for _, t in samples]
            groups[g] = {"answers": len(ts), "mean_ttft_s": round(sum(ts) / len(ts), 4) if ts else None}
        return {"verdict": verdict, "paused": verdict == "costs", "holdout": self.cfg.holdout,
                "holdout_now": self._share(verdict),
                "copied_minus_held_out_s": None if diff is None else [round(x, 4) for x in diff],
                "groups": groups, "decisions": dict(self.num_decisions), "prefixes_assigned": len(self._assigned),
                "answers_timed": self.num_answers_timed}
