"""Random KV pools shaped like SGLang's, and an independent per-page oracle, for tests.

Used by tests/unit/test_kernels_*.py (and usable by the worker-agent tests to fake a pool without SGLang).
The oracle copies one page of one layer at a time with plain slicing, so it shares no code with
`kvrep_kernels.plan` or either backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POOL_KINDS = ("separate", "fused", "hnd_pool", "mla")


@dataclass(frozen=True)
class Pool:
    kind: str
    k: list
    v: list | None
    page_size: int
    num_pages: int

    @property
    def tensors(self) -> list:
        return list(self.k) + list(self.v or [])


def random_bits(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bit patterns (NaNs and all for float types)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def make_pool(kind: str, dtype: torch.dtype, page_size: int, *, num_layers: int = 2, num_heads: int = 2,
              head_dim: int = 8, num_pages: int = 12, seed: int = 0) -> Pool:
    """Build a random pool of one of `POOL_KINDS` (rows = num_pages * page_size, page 0 = padding)."""
    gen = torch.Generator().manual_seed(seed)
    rows = num_pages * page_size
    L, H, D = num_layers, num_heads, head_dim
    if kind == "separate":
        k = [random_bits((rows, H, D), dtype, gen) for _ in range(L)]
        v = [random_bits((rows, H, D), dtype, gen) for _ in range(L)]
    elif kind == "fused":  # SGLang's (2, padded_rows, H, D) per-layer allocation, K/V as views
        fused = [random_bits((2, rows + 3, H, D), dtype, gen) for _ in range(L)]
        k = [f[0, :rows] for f in fused]
        v = [f[1, :rows] for f in fused]
    elif kind == "hnd_pool":
        k = [random_bits((num_pages, H, page_size, D), dtype, gen) for _ in range(L)]
        v = [random_bits((num_pages, H, page_size, D), dtype, gen) for _ in range(L)]
    elif kind == "mla":
        k = [random_bits((rows, 1, D), dtype, gen) for _ in range(L)]
        v = None
    else:
        raise ValueError(kind)
    return Pool(kind, k, v, page_size, num_pages)


def zeros_like_pool(pool: Pool) -> Pool:
    k = [torch.zeros_like(t) for t in pool.k]
    v = None if pool.v is None else [torch.zeros_like(t) for t in pool.v]
    return Pool(pool.kind, k, v, pool.page_size, pool.num_pages)


def _page_nhd(t: torch.Tensor, kind: str, p: int, ps: int) -> torch.Tensor:
    """Page p of one pool tensor as (ps, H, D)."""
    if kind == "hnd_pool":
        return t[p].transpose(0, 1)
    return t[p * ps:(p + 1) * ps]


def oracle_gather(pool: Pool, page_ids: list[int], layout: str) -> torch.Tensor:
    """Build the expected transfer buffer page by page."""
    layers = []
    for layer in range(len(pool.k)):
        pages = []
        for p in page_ids:
            parts = [_page_nhd(pool.k[layer], pool.kind, p, pool.page_size)]
            if pool.v is not None:
                parts.append(_page_nhd(pool.v[layer], pool.kind, p, pool.page_size))
            if layout == "HND" and pool.v is not None:
                parts = [x.transpose(0, 1) for x in parts]
            pages.append(torch.stack(parts) if pool.v is not None else parts[0])
        layers.append(torch.stack(pages))
    return torch.stack(layers).contiguous()


def page_list(num_pages: int, gen_seed: int) -> list[int]:
    """A realistic, non-contiguous page list in 1..num_pages-1: a run, scattered pages, a backwards pair."""
    gen = torch.Generator().manual_seed(gen_seed)
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    run = list(range(2, 2 + min(4, num_pages - 2)))
    rest = [p for p in perm if p not in run]
    return run + rest[:3] + sorted(rest[3:5], reverse=True)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
