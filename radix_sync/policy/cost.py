"""Cost profiles (data files with provenance) and the online-calibrated cost model policies use.

A `CostProfile` is the starting point: prefill time as a function of new and cached tokens, decode step time as a
function of batch size and context, KV bytes per token, link bandwidth and KV capacity. Profiles live as JSON in
`radix_sync/profiles/`, each with its provenance written inside. `CostModel` wraps a profile and rescales its
predictions by ratios learned from the measurements workers report (`observe_*`). The simulator uses the profile
itself as ground truth.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"


@dataclass(frozen=True)
class CostProfile:
    """Timing and capacity constants of one model on one kind of worker."""

    name: str
    """Profile name (file stem)."""
    kv_bytes_per_token: int
    """KV cache bytes per token, all layers, all tensor-parallel ranks."""
    kv_capacity_tokens: int
    """KV pool size of one worker, tokens."""
    max_context_len: int
    """Longest prompt+output the model accepts, tokens; longer trace prompts are truncated at the front page boundary."""
    chunked_prefill_len: int
    """Most prompt tokens prefilled in one iteration."""
    max_running_requests: int
    """Most requests decoding at once on one worker."""
    prefill_overhead_s: float
    """Fixed cost of one prefill iteration, s."""
    prefill_s_per_token: float
    """Linear (weights) cost per new token, s."""
    prefill_s_per_token_pair: float
    """Attention cost per (new token x context token) pair, s."""
    decode_step_s: float
    """Fixed cost of one decode iteration, s."""
    decode_s_per_request: float
    """Extra cost per request in the decode batch, s."""
    decode_s_per_ctx_token: float
    """Extra cost per context token read by the decode batch, s."""
    nic_bandwidth_bytes_per_s: float
    """Usable worker-to-worker bandwidth of one worker's link, bytes/s."""
    transfer_latency_s: float
    """Fixed cost of one transfer (setup, first byte), s."""
    prefill_s_per_cached_pair: float = 0.0
    """Cost per (context token x context token) pair of the cached prefix, paid again by every prefill piece that
    follows it, s. Zero for paged attention kernels (FlashInfer, FlashAttention), which read the cached KV once per
    new token (the `prefill_s_per_token_pair` term); SGLang's `torch_native` CPU backend recomputes attention over
    the whole sequence, so a short extension of a long cached prefix costs ~ context^2 (see cpu-local.json)."""
    provenance: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "provenance"):
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"profile {self.name!r}: {f.name}={v!r} must be a finite number >= 0")
        for name in ("kv_bytes_per_token", "kv_capacity_tokens", "max_context_len", "chunked_prefill_len",
                     "max_running_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name!r}: {name}={getattr(self, name)!r} must be > 0")

    # ---- ground-truth formulas (also the uncalibrated predictions) ----
    def prefill_piece_s(self, new_len: int, cached_len: int) -> float:
        """Compute time of prefilling `new_len` tokens after `cached_len` context tokens, without the overhead.

        Args:
            new_len: tokens computed in this piece.
            cached_len: tokens already in the KV cache before the piece.
        Returns:
            seconds.
        """
        pairs = new_len * cached_len + new_len * (new_len + 1) / 2.0
        out = new_len * self.prefill_s_per_token + pairs * self.prefill_s_per_token_pair
        if self.prefill_s_per_cached_pair and new_len > 0:
            out += cached_len * (cached_len + 1) / 2.0 * self.prefill_s_per_cached_pair
        return out

    def prefill_s(self, new_len: int, cached_len: int) -> float:
        """Time of a whole prefill of `new_len` tokens after `cached_len` cached ones, chunked, with overheads.

        Args:
            new_len: uncached prompt tokens.
            cached_len: cached prompt tokens (the prefix hit).
        Returns:
            seconds (0 when `new_len` is 0 except one overhead: the last token is always recomputed).
        """
        num_chunks = max(1, -(-new_len // self.chunked_prefill_len))
        return num_chunks * self.prefill_overhead_s + self.prefill_piece_s(new_len, cached_len)

    def decode_steps_s(self, num_steps: int, batch: int, ctx_tokens: int) -> float:
        """Time of `num_steps` decode iterations of a fixed batch whose total context grows by `batch` per step.

        Args:
            num_steps: iterations.
            batch: requests in the batch.
            ctx_tokens: total context tokens of the batch at the first step.
        Returns:
            seconds.
        """
        per = self.decode_step_s + self.decode_s_per_request * batch + self.decode_s_per_ctx_token * ctx_tokens
        return num_steps * per + self.decode_s_per_ctx_token * batch * num_steps * (num_steps - 1) / 2.0

    def transfer_s(self, num_bytes: float, bandwidth_bytes_per_s: float = 0.0) -> float:
        """Time to move `num_bytes` over an idle link.

        Args:
            num_bytes: payload.
            bandwidth_bytes_per_s: link bandwidth (0: the profile's NIC bandwidth).
        Returns:
            seconds.
        """
        bw = bandwidth_bytes_per_s or self.nic_bandwidth_bytes_per_s
        return self.transfer_latency_s + num_bytes / bw


def list_profiles() -> list[str]:
    """Returns: names of the profiles shipped in `radix_sync/profiles/`."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> CostProfile:
    """Loads a profile by name (a file in `radix_sync/profiles/`) or from a JSON file path.

    Args:
        name_or_path: e.g. `llama3.1-8b-h200` or `/some/dir/my.json`.
    Returns:
        the validated profile.
    """
    path = Path(name_or_path)
    if not (os.sep in name_or_path or name_or_path.endswith(".json")):
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(f"unknown profile {name_or_path!r}; shipped: {', '.join(list_profiles())}")
    data = json.loads(path.read_text())
    known = {f.name for f in fields(CostProfile)}
    values = {k: v for k, v in data.get("values", {}).items() if k in known}
    values["name"] = data.get("name", path.stem)
    values["provenance"] = data.get("provenance", "")
    return CostProfile(**values)


class CostModel:
    """A profile's predictions, rescaled by what the workers are measured to do.

    `prefill_scale` is set from outside: by the speed calibration (`radix_sync.policy.speed.SpeedCalibration`, the
    median measured/predicted TTFT of the requests that ran alone; the router's and the planner's), 1.0 without it.
    `transfer_scale` follows the copies measured on an idle link (`observe_transfer`, an EWMA). Decode steps are
    the profile's (nothing live measures a decode step alone).
    """

    def __init__(self, profile: CostProfile, ewma_alpha: float = 0.1) -> None:
        if not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha={ewma_alpha!r} must be in (0, 1]")
        self.profile = profile
        self._alpha = ewma_alpha
        self.prefill_scale = 1.0
        self.transfer_scale = 1.0

    def observe_transfer(self, num_bytes: float, measured_s: float) -> None:
        """Feeds one measured transfer time (idle link)."""
        predicted_s = self.profile.transfer_s(num_bytes)
        if predicted_s > 0.0 and measured_s > 0.0:
            self.transfer_scale = (1.0 - self._alpha) * self.transfer_scale + self._alpha * (measured_s / predicted_s)

    def prefill_s(self, new_len: int, cached_len: int) -> float:
        """Predicted prefill time, s (see `CostProfile.prefill_s`)."""
        return self.prefill_scale * self.profile.prefill_s(new_len, cached_len)

    def decode_steps_s(self, num_steps: int, batch: int, ctx_tokens: int) -> float:
        """Predicted decode time, s (see `CostProfile.decode_steps_s`)."""
        return self.profile.decode_steps_s(num_steps, batch, ctx_tokens)

    def transfer_s(self, num_bytes: float, bandwidth_bytes_per_s: float = 0.0) -> float:
        """Predicted transfer time on an idle link, s."""
        return self.transfer_scale * self.profile.transfer_s(num_bytes, bandwidth_bytes_per_s)
