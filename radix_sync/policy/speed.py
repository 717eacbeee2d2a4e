"""The fleet's prefill speed, learned online from requests that ran alone (`SpeedCalibration`).

A cost profile is measured once, on one machine (`radix_sync/profiles/`); the workers a router prices may be
faster or slower (another GPU, another model, another CPU of the same kind). Priced with a profile 3x too slow,
a router and a planner see every queue three times as long as it is: a worker busy for a second looks busy for
three, the planner copies a session's prefix away from a source that is idle again before the next turn comes,
and a pull looks cheap against a prefill it cannot beat. Measured on the CPU testbed (stop 46, agent sessions):
the lone cold prompts' time to first token was 0.32-0.47x of what `cpu-wide` predicted.

What it learns from: a request sent to a worker with nothing running or queued (`runs_alone`, as the router saw
it when it decided), not waiting for a copy: its time to first token is its own prefill (with one decode step and
the request's own overheads, which the profile's prefill overhead stands for). The scale is the median of
measured / predicted over the last `window` such requests (robust to the one that met a burst the router did not
see), 1.0 until `min_samples` came, and bounded to [`lo`, `hi`]. It multiplies every prefill term
(`CostModel.prefill_scale`); a profile's shape (per-token against per-pair terms) is not refitted.

Pure: token counts and seconds in, a scale out. The live router and the simulated one feed it the same way (the
router's `forward`, `ExpectedTtftRouter.on_first_token`); the coordinator's planner takes its scale from the
samples its routers report with each finished request (`FinishReport.alone_new_tokens`).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional

from radix_sync.policy.cost import CostProfile
from radix_sync.policy.snapshot import WorkerView


def runs_alone(w: WorkerView, now: float) -> bool:
    """Whether a request sent to `w` now would run alone: nothing running, queued or in an iteration there."""
    return w.num_running == 0 and w.num_waiting == 0 and w.waiting_new_tokens == 0 and w.busy_until_s <= now


class SpeedCalibration:
    """Measured / predicted prefill time of the last `window` requests that ran alone; `scale` is their median."""

    def __init__(self, window: int = 64, min_samples: int = 8, lo: float = 0.05, hi: float = 20.0) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"window={window!r}, min_samples={min_samples!r}: need 1 <= min_samples <= window")
        if not 0.0 < lo <= 1.0 <= hi:
            raise ValueError(f"lo={lo!r}, hi={hi!r}: need 0 < lo <= 1 <= hi")
        self.window, self.min_samples, self.lo, self.hi = window, min_samples, lo, hi
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        """(uncached tokens, cached tokens, measured seconds) of the last requests that ran alone."""
        self.num_observed = 0
        self._scale: Optional[tuple[int, str, float]] = None
        """(samples seen, profile name, scale) of the last `scale` call."""

    def observe(self, new_len: int, cached_len: int, measured_s: float) -> bool:
        """Feeds one request that ran alone. Returns: whether it was kept (non-negative counts, a finite time
        > 0 and at most an hour)."""
        if new_len < 0 or cached_len < 0 or not (math.isfinite(measured_s) and 0.0 < measured_s <= 3600.0):
            return False
        self.samples.append((int(new_len), int(cached_len), float(measured_s)))
        self.num_observed += 1
        return True

    def scale(self, profile: CostProfile) -> float:
        """Returns: the median of measured / `profile`-predicted over the samples kept, within [lo, hi]; 1.0 with
        fewer than `min_samples` (taken again only when a sample came since the last call)."""
        kept = self._scale
        if kept is not None and kept[0] == self.num_observed and kept[1] == profile.name:
            return kept[2]
        ratios = [s / p for n, c, s in self.samples if (p := profile.prefill_s(n, c)) > 0.0]
        value = (min(self.hi, max(self.lo, statistics.median(ratios))) if len(ratios) >= self.min_samples
                 else 1.0)
        self._scale = (self.num_observed, profile.name, value)
        return value

    def status(self, profile: CostProfile) -> dict:
        """Returns: what `/status` shows of it."""
        return {"scale": round(self.scale(profile), 4), "samples": len(self.samples),
                "observed": self.num_observed, "min_samples": self.min_samples}
