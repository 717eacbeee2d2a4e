"""What a target checks before it stages or writes a byte of a transfer: the header against the local geometry
and replica budget (`check_header`), and against the coordinator's grant (`check_grant`); and what every worker
checks of the timings it reports (`finite_s`). Pure functions, called on the agent's threads by
`sglang_kvrep.agent`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from kvrep_kernels import CHECKSUM_KINDS
from radix_sync import protocol as p

DTYPES = {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16, "torch.float32": torch.float32,
          "torch.uint8": torch.uint8, "torch.float8_e4m3fn": torch.uint8, "torch.float8_e5m2": torch.uint8}
"""Wire dtype name -> the torch dtype a received buffer is viewed as."""


@dataclass(frozen=True)
class LocalGeometry:
    """What a target compares an incoming header against."""

    fingerprint: str
    page_size: int
    dtype: str
    layout: str
    page_shape: tuple[int, ...]
    """Shape of one page of one layer in the buffer, e.g. (2, ps, H, D) for MHA NHD."""
    num_layers: int
    itemsize: int

    def buffer_shape(self, num_pages: int) -> list[int]:
        return [self.num_layers, num_pages, *self.page_shape]

    def num_bytes(self, num_pages: int) -> int:
        return math.prod(self.buffer_shape(num_pages)) * self.itemsize


def check_header(h: p.TransferHeader, local: LocalGeometry, free_replica_tokens: int) -> Optional[str]:
    """Returns an error message, or None when the transfer may proceed. Checked before a byte is buffered."""
    if h.fingerprint != local.fingerprint:
        return f"fingerprint mismatch: source {h.fingerprint} != target {local.fingerprint}"
    if h.page_size != local.page_size:
        return f"page size mismatch: {h.page_size} != {local.page_size}"
    if h.dtype != local.dtype or h.layout != local.layout:
        return f"dtype/layout mismatch: {h.dtype}/{h.layout} != {local.dtype}/{local.layout}"
    if h.num_pages < 1 or len(h.token_ids) != h.num_pages * h.page_size:
        return f"{len(h.token_ids)} token ids do not fill {h.num_pages} pages of {h.page_size}"
    if any((not isinstance(t, int)) or t < 0 for t in h.token_ids):
        return "token ids must be non-negative integers"
    if list(h.buffer_shape) != local.buffer_shape(h.num_pages):
        return f"buffer shape {list(h.buffer_shape)} != expected {local.buffer_shape(h.num_pages)}"
    if h.num_bytes != local.num_bytes(h.num_pages):
        return f"payload size {h.num_bytes} != expected {local.num_bytes(h.num_pages)}"
    if h.pages_per_chunk < 1 or h.num_chunks != -(-h.num_pages // h.pages_per_chunk):
        return f"bad chunking: {h.num_chunks} chunks of {h.pages_per_chunk} pages for {h.num_pages} pages"
    if not h.ttl_s > 0:
        return f"bad ttl {h.ttl_s}"
    if h.checksum_kind not in CHECKSUM_KINDS:
        return f"unknown checksum kind {h.checksum_kind!r} (known: {', '.join(CHECKSUM_KINDS)})"
    if len(h.token_ids) > free_replica_tokens:
        return f"replica budget exceeded: {len(h.token_ids)} tokens > {free_replica_tokens} free"
    return None


def check_grant(h: p.TransferHeader, grant: p.ExpectReplica) -> Optional[str]:
    """Does this authenticated transfer stay within what the coordinator authorized? Returns an error message."""
    if h.source_id != grant.source_id or h.namespace != grant.namespace or h.page_size != grant.page_size:
        return "transfer does not match its authorization (source, namespace or page size)"
    if h.num_pages > len(grant.block_hashes):
        return f"transfer of {h.num_pages} pages exceeds the {len(grant.block_hashes)} authorized"
    return None


def finite_s(seconds: float) -> float:
    """A measured duration fit to report: itself when finite and >= 0, else 0.0 (no sample). A NaN or an inf
    reported once would stay in the coordinator's averages for good; a negative one (a clock step) is no time."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) and value >= 0.0 else 0.0
