"""kvrep_kernels: copy KV pages between an SGLang pool and a transfer buffer, and checksum the payload.

Imported by the worker agent (sglang_kvrep). Depends on torch only; Triton is imported lazily, the first
time a CUDA (or forced ``backend="triton"``) copy runs. Nothing here imports sglang: pools are passed in as
lists of per-layer tensors (``pool.k_buffer``, ``pool.v_buffer`` or ``pool.kv_buffer``).
"""

from .checksum import (CHECKSUM_KINDS, PayloadDigest, default_kind, payload_checksum, payload_digest, pieces_checksum,
                       verify_payload)
from .geometry import PoolGeometry
from .page_copy import gather_pages, scatter_pages, slots_to_page_ids, warm_up

__all__ = [
    "CHECKSUM_KINDS",
    "PayloadDigest",
    "PoolGeometry",
    "default_kind",
    "gather_pages",
    "payload_checksum",
    "pieces_checksum",
    "payload_digest",
    "scatter_pages",
    "slots_to_page_ids",
    "verify_payload",
    "warm_up",
]
