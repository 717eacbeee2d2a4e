"""Validation and run planning shared by the torch and Triton page-copy backends.

`make_plan` checks the pool tensors, the page ids and the transfer buffer *before* any byte moves, and splits
the page list into runs of consecutive page ids; each run is one slice copy per layer (torch) or a few
programs (Triton). Nothing here copies KV data.

Pool tensor forms accepted (one tensor per layer and per K/V; fused per-layer allocations are just views):

    NHD pool (SGLang default):      (rows, H, D)          page p = rows [p*ps, (p+1)*ps)
    HND pool (SGLANG_USE_HND_KVCACHE): (num_pages, H, ps, D)
    MLA pool:                       (rows, 1, D)          (NHD with H == 1)

Page 0 is SGLang's padding page (slot 0 is the dummy slot), so valid page ids are 1 .. num_pages-1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .geometry import LAYOUTS, PoolGeometry


@dataclass(frozen=True)
class CopyPlan:
    """A validated copy between a list of pool tensors and a transfer buffer."""

    geometry: PoolGeometry
    """Geometry derived from the pool tensors; ``layout`` is the *buffer* layout."""
    pool_layout: str
    """``"NHD"`` for (rows, H, D) pool tensors, ``"HND"`` for (num_pages, H, ps, D)."""
    pools: tuple[torch.Tensor, ...]
    """Pool tensors in buffer order: k0, v0, k1, v1, ... for MHA; l0, l1, ... for MLA."""
    num_pool_pages: int
    """Pages addressable in each pool tensor (page ids must be < this)."""
    page_ids: torch.Tensor
    """The requested page ids, int64 on the CPU."""
    run_pool_starts: torch.Tensor
    """First pool page of each run of consecutive page ids (int64, CPU)."""
    run_buf_starts: torch.Tensor
    """Buffer page index where each run starts (int64, CPU)."""
    run_lens: torch.Tensor
    """Pages in each run (int64, CPU)."""

    @property
    def num_pages(self) -> int:
        return int(self.page_ids.numel())


def page_ids_to_cpu(page_ids: torch.Tensor) -> torch.Tensor:
    """Validate the dtype/rank of ``page_ids`` and return them as a contiguous int64 CPU tensor.

    NOTE: for a device tensor this synchronizes with its stream; pass CPU page ids on the hot path.
    """
    if not isinstance(page_ids, torch.Tensor):
        raise TypeError(f"page_ids must be a torch.Tensor, got {type(page_ids).__name__}")
    if page_ids.dim() != 1:
        raise ValueError(f"page_ids must be 1-D, got shape {tuple(page_ids.shape)}")
    if page_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"page_ids must be int64 (or int32), got {page_ids.dtype}")
    return page_ids.to(device="cpu", dtype=torch.int64).contiguous()


def compute_runs(page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split page ids into maximal runs of consecutive ids.

    Args:
        page_ids: int64 CPU tensor.
    Returns:
        ``(pool_starts, buf_starts, lens)``: run r copies pool pages
        ``pool_starts[r] .. pool_starts[r]+lens[r]-1`` to buffer pages ``buf_starts[r] ..``.
    """
    n = page_ids.numel()
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty, empty
    breaks = torch.nonzero(page_ids[1:] != page_ids[:-1] + 1).flatten() + 1
    buf_starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    lens = torch.diff(buf_starts, append=torch.tensor([n], dtype=torch.int64))
    return page_ids[buf_starts], buf_starts, lens


def _check_pools(k_buffers, v_buffers, page_size: int) -> tuple[tuple[torch.Tensor, ...], str, str]:
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    kind = "mla" if v_buffers is None else "mha"
    ks = list(k_buffers)
    if not ks:
        raise ValueError("k_buffers is empty")
    if kind == "mha":
        vs = list(v_buffers)
        if len(vs) != len(ks):
            raise ValueError(f"got {len(ks)} K buffers but {len(vs)} V buffers")
        pools = tuple(t for kv in zip(ks, vs) for t in kv)
    else:
        pools = tuple(ks)
    ref = pools[0]
    for i, t in enumerate(pools):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pool tensor {i} is a {type(t).__name__}, not a torch.Tensor")
        if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
            raise ValueError(
                f"pool tensor {i} is {tuple(t.shape)} {t.dtype} on {t.device}; "
                f"tensor 0 is {tuple(ref.shape)} {ref.dtype} on {ref.device}: all layers must match"
            )
    if ref.dim() == 3:
        pool_layout = "NHD"
    elif ref.dim() == 4 and kind == "mha" and ref.shape[2] == page_size:
        pool_layout = "HND"
    else:
        raise ValueError(
            f"pool tensors must be (rows, H, D) or, for HND MHA pools, (num_pages, H, page_size={page_size}, D); "
            f"got {tuple(ref.shape)}"
        )
    return pools, kind, pool_layout


def make_plan(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor] | None,
    page_ids: torch.Tensor,
    page_size: int,
    layout: str,
    *,
    unique: bool = False,
) -> CopyPlan:
    """Validate pools and page ids, and plan the runs.

    Args:
        k_buffers: per-layer K tensors (MHA) or latent tensors (MLA).
        v_buffers: per-layer V tensors, or None for MLA.
        page_ids: int64 page ids, any order.
        page_size: tokens per page.
        layout: buffer layout, ``"NHD"`` or ``"HND"``.
        unique: reject repeated page ids (scatter: two buffer pages into one pool page is a bug).
    Returns:
        The plan.
    Raises:
        ValueError: bad shapes, dtypes, layout or repeated ids; IndexError: a page id out of range.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    pools, kind, pool_layout = _check_pools(k_buffers, v_buffers, page_size)
    ref = pools[0]
    if pool_layout == "NHD":
        _, H, D = ref.shape
        num_pool_pages = ref.shape[0] // page_size
    else:
        num_pool_pages, H, _, D = ref.shape
    geometry = PoolGeometry(
        num_layers=len(k_buffers), num_kv_heads=int(H), head_dim=int(D), page_size=page_size,
        dtype=ref.dtype, kind=kind, layout=layout if kind == "mha" else "NHD",
    )
    ids = page_ids_to_cpu(page_ids)
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 1 or hi >= num_pool_pages:
            bad = lo if lo < 1 else hi
            pos = int(torch.nonzero(ids == bad)[0])
            raise IndexError(
                f"page id {bad} at position {pos} is out of range: valid page ids are 1..{num_pool_pages - 1} "
                f"(page 0 is the padding page)"
            )
        if unique and torch.unique(ids).numel() != ids.numel():
            values, counts = torch.unique(ids, return_counts=True)
            raise ValueError(f"page id {int(values[counts > 1][0])} appears more than once in page_ids")
    starts, buf_starts, lens = compute_runs(ids)
    return CopyPlan(geometry, pool_layout, pools, num_pool_pages, ids, starts, buf_starts, lens)


def check_buffer(plan: CopyPlan, buffer: torch.Tensor, name: str = "buffer") -> None:
    """Raise ValueError unless ``buffer`` is a contiguous transfer buffer matching ``plan``."""
    want = plan.geometry.buffer_shape(plan.num_pages)
    ref = plan.pools[0]
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buffer).__name__}")
    if tuple(buffer.shape) != want:
        raise ValueError(f"{name} has shape {tuple(buffer.shape)}, expected {want}")
    if buffer.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {buffer.dtype}, the pool stores {ref.dtype}")
    if buffer.device != ref.device:
        raise ValueError(f"{name} is on {buffer.device}, the pool is on {ref.device}")
    if not buffer.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {buffer.stride()})")


def pool_page_view(t: torch.Tensor, pool_layout: str, page_size: int, num_pool_pages: int) -> torch.Tensor:
    """View one pool tensor as ``(num_pool_pages, ps, H, D)`` pages (token-major), sharing its storage."""
    if pool_layout == "HND":
        return t.permute(0, 2, 1, 3)
    s0, s1, s2 = t.stride()
    _, H, D = t.shape
    return t.as_strided(
        (num_pool_pages, page_size, H, D), (page_size * s0, s0, s1, s2), t.storage_offset()
    )


def buffer_page_view(buffer: torch.Tensor, plan: CopyPlan, index: int) -> torch.Tensor:
    """View the pages of pool tensor ``index`` (plan order) inside the buffer as ``(P, ps, H, D)``."""
    g = plan.geometry
    if g.kind == "mla":
        return buffer[index]
    layer, kv = divmod(index, 2)
    view = buffer[layer, :, kv]
    return view if g.layout == "NHD" else view.permute(0, 2, 1, 3)
