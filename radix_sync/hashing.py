"""SGLang's chained page hashes, recomputed without SGLang, so the coordinator can look up any prompt.

SGLang 0.5.23's KV events name a page by `hash_str_to_int64(h_i)` where
`h_i = SHA256(h_{i-1} || page tokens as little-endian uint32)` (hex digests, `h_{-1}` absent at the root), and,
for a request namespaced by `cache_salt` S (no LoRA), the chain is seeded with
`h_{-1} = SHA256(b"sglang-cache-salt-v1\\0" || S)` (`srt/mem_cache/utils.py`, `compute_node_event_hash_values`;
`srt/mem_cache/events.py`). The first 8 bytes of a digest, big-endian and signed, are the published int64.

Only full pages are hashed (a partial tail page is never in the radix tree). The unit tests pin these values
against `sglang.srt.mem_cache.utils.get_hash_str` when sglang is importable.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

_SALT_TAG = b"sglang-cache-salt-v1\0"


def namespace_seed(namespace: str) -> Optional[bytes]:
    """The 32-byte digest that seeds a namespace's chain (None for the default namespace)."""
    if not namespace:
        return None
    return hashlib.sha256(_SALT_TAG + namespace.encode("utf-8")).digest()


def digest_to_int64(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


def page_digests(token_ids: Sequence[int], page_size: int, namespace: str = "",
                 prior: Optional[bytes] = None) -> list[bytes]:
    """SHA-256 digests of each full page of `token_ids`, chained from `prior` (or the namespace seed).

    Raises:
        ValueError: bad page size or a token id outside uint32 (SGLang hashes those on another path).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    num_pages = len(token_ids) // page_size
    if prior is None:
        prior = namespace_seed(namespace)
    out: list[bytes] = []
    fmt = f"<{page_size}I"
    for i in range(num_pages):
        page = token_ids[i * page_size:(i + 1) * page_size]
        try:
            packed = struct.pack(fmt, *page)
        except struct.error:
            raise ValueError(f"token ids must be uint32, got one in {list(page)[:4]}...") from None
        h = hashlib.sha256(prior + packed) if prior is not None else hashlib.sha256(packed)
        prior = h.digest()
        out.append(prior)
    return out


def chain_digest(prior: Optional[bytes], page: Sequence[int]) -> bytes:
    """The digest of one page chained from `prior` (its parent's digest, or the namespace seed; None: the default
    namespace's root). The coordinator checks a reported page with it, from its parent's digest (`PrefixDirectory`
    keeps one per page), in O(page) and not O(prefix).

    Raises:
        ValueError: a token id outside uint32.
    """
    return chain_digest_packed(prior, pack_page(page))


def pack_page(page: Sequence[int]) -> bytes:
    """A page's token ids as SGLang hashes them: little-endian uint32.

    Raises:
        ValueError: a token id outside uint32.
    """
    try:
        return _page_struct(len(page)).pack(*page)
    except struct.error:
        raise ValueError(f"token ids must be uint32, got one in {list(page)[:4]}...") from None


def chain_digest_packed(prior: Optional[bytes], packed: bytes) -> bytes:
    """`chain_digest` of a page already packed (`pack_page`)."""
    return hashlib.sha256(prior + packed).digest() if prior is not None else hashlib.sha256(packed).digest()


_STRUCTS: dict[int, struct.Struct] = {}


def _page_struct(page_size: int) -> struct.Struct:
    """The packer of a page of `page_size` little-endian uint32 (compiled once per size: a fact's pages share it)."""
    packer = _STRUCTS.get(page_size)
    if packer is None:
        if len(_STRUCTS) >= 64:  # (page sizes are few; bound it anyway)
            _STRUCTS.clear()
        packer = _STRUCTS[page_size] = struct.Struct(f"<{page_size}I")
    return packer


def page_hashes(token_ids: Sequence[int], page_size: int, namespace: str = "") -> list[int]:
    """The int64 block hashes SGLang publishes for the full pages of `token_ids` in `namespace`."""
    return [digest_to_int64(d) for d in page_digests(token_ids, page_size, namespace)]
