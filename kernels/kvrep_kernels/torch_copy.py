"""Torch page copies: the CPU implementation and the reference the Triton kernels are tested against.

Called through `kvrep_kernels.copy.gather_pages` / `scatter_pages`. Data are copied as raw bits (every dtype is
viewed as the unsigned/signed integer type of its width), so fp8-as-uint8, bf16 NaN payloads and the like
survive bit-exactly.

Three strategies, picked per call:
  * pages (when one tensor's page is at least ``PAGE_COPY_MIN_BYTES``, e.g. page size >= 2 with 8 heads of
    128 bf16): per pool tensor, one call that does one ``memcpy`` per page -- ``index_select`` into the
    strided buffer view for a gather, a NumPy fancy assignment into the pool for a scatter (torch's
    ``index_copy_``/``index_put_`` measured 3x slower than either). With runs of 1 to 256 pages it measured
    best at page size 16 (docs/kernels.md): it avoids the per-``copy_`` set-up cost of the other two;
  * runs: one slice copy per run of consecutive page ids and per copy unit -- wins when runs are long;
  * index: one ``index_select`` (into the strided buffer view, no temporary) or ``index_copy_`` per copy
    unit -- wins when the list is fragmented, e.g. page size 1 with scattered slots, where a Python call
    per run would dominate.
For runs and index, a copy unit is one pool tensor, or K and V of a layer together when they are views into
SGLang's fused per-layer allocation ``(2, rows, H, D)``: one strided view covers both, which halves the calls
and makes the buffer side of a gather one contiguous ``(P, 2, ps, H, D)`` block per layer. The pages strategy
copies K and V separately: each page of each is then one dense block on both sides, which is what lets
``index_select`` and NumPy use ``memcpy``.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .plan import CopyPlan, buffer_page_view, pool_page_view

_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Per-run slice copies when a run moves at least this many bytes per copy unit on average (measured on one
# CPU core: a copy_ call costs ~5 us; index_select is near memcpy speed, index_copy_ much slower).
GATHER_MIN_RUN_BYTES = 1 << 20
SCATTER_MIN_RUN_BYTES = 8 << 10
# Per-page memcpy copies when one page of one pool tensor is at least this big. Measured (1 CPU thread, Llama-8B
# geometry): 4 KiB pages (ps 2) and up gain over runs/index, 2 KiB pages (ps 1) lose (a call per 2 KiB row).
PAGE_COPY_MIN_BYTES = 4 << 10


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as the integer dtype of the same width (no copy)."""
    return t.view(_BITS_DTYPES[t.element_size()])


def _kv_distance(k: torch.Tensor, v: torch.Tensor) -> int | None:
    """Elements from K to V when both are equally strided views of one allocation, else None."""
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() or k.stride() != v.stride():
        return None
    dist = v.storage_offset() - k.storage_offset()
    return dist if dist > 0 else None


def copy_units(plan: CopyPlan, buffer: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """Yield ``(pool_pages, buffer_pages, tensors_per_unit)``: matching views whose dim 0 is the page axis."""
    g = plan.geometry
    buf_bits = as_bits(buffer)
    pools = [as_bits(t) for t in plan.pools]
    i = 0
    while i < len(pools):
        pool = pool_page_view(pools[i], plan.pool_layout, g.page_size, plan.num_pool_pages)
        dist = _kv_distance(pools[i], pools[i + 1]) if g.kind == "mha" and i % 2 == 0 else None
        if dist is None:
            yield pool, buffer_page_view(buf_bits, plan, i), 1
            i += 1
            continue
        # (pages, kv, ps, H, D) over the fused allocation, and the layer's (P, 2, ...) buffer block.
        a, b, c, d = pool.stride()
        pair = pool.as_strided((pool.shape[0], 2, *pool.shape[1:]), (a, dist, b, c, d), pool.storage_offset())
        layer_buf = buf_bits[i // 2]
        yield pair, layer_buf if g.layout == "NHD" else layer_buf.permute(0, 1, 3, 2, 4), 2
        i += 2


def use_runs(plan: CopyPlan, tensors_per_unit: int, gather: bool) -> bool:
    """True when per-run slice copies beat one indexed copy for this plan (few, long runs)."""
    num_runs = plan.run_lens.numel()
    run_bytes = plan.num_pages / max(num_runs, 1) * plan.geometry.page_elems() * plan.pools[0].element_size()
    limit = GATHER_MIN_RUN_BYTES if gather else SCATTER_MIN_RUN_BYTES
    return num_runs == 1 or run_bytes * tensors_per_unit >= limit


def page_units(plan: CopyPlan, buffer: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(pool_pages, buffer_pages)`` per pool tensor, K and V apart (plan order: K0, V0, K1, ...), as
    ``(num_pool_pages, ps, H, D)`` and ``(P, ps, H, D)`` integer views (what `copy_units` yields for unfused
    pools), the buffer's made with a few ``unbind`` calls instead of indexing per tensor: at the agent's chunk
    size (a few pages) building views costs more than moving the bytes."""
    g = plan.geometry
    buf_bits = as_bits(buffer)
    if g.kind == "mla":
        buf_views = buf_bits.unbind(0)
    else:
        k_all, v_all = buf_bits.unbind(2)  # (L, P, ps, H, D), or (L, P, H, ps, D) for an HND buffer
        if g.layout == "HND":
            k_all, v_all = k_all.transpose(2, 3), v_all.transpose(2, 3)
        buf_views = [t for pair in zip(k_all.unbind(0), v_all.unbind(0)) for t in pair]
    for pool, buf in zip(plan.pools, buf_views):
        yield pool_page_view(as_bits(pool), plan.pool_layout, g.page_size, plan.num_pool_pages), buf


def use_page_copies(plan: CopyPlan) -> bool:
    """True when one page of one pool tensor is big enough for a ``memcpy`` per page to beat the other ways."""
    return plan.geometry.page_elems() * plan.pools[0].element_size() >= PAGE_COPY_MIN_BYTES


def _runs(plan: CopyPlan) -> list[tuple[int, int, int]]:
    return list(zip(plan.run_pool_starts.tolist(), plan.run_buf_starts.tolist(), plan.run_lens.tolist()))


def _scatter_pages(plan: CopyPlan, buffer: torch.Tensor) -> None:
    """``pool[page_ids] = buffer pages`` per pool tensor, one ``memcpy`` per page where both sides are dense.

    NOTE: NumPy, reached through ``Tensor.numpy()`` (shared memory, no copy; the checksums use it too), because
    its fancy assignment is the one CPU scatter that copies a row with ``memcpy`` (and it releases the GIL
    meanwhile); the views are integer bit views, which NumPy copies exactly. Without NumPy, or for a CUDA pool
    copied with ``backend="torch"``: a slice copy per run.
    """
    ids = None
    if plan.pools[0].device.type == "cpu":
        try:
            ids = plan.page_ids.numpy()
        except (RuntimeError, TypeError):  # torch built without NumPy
            pass
    for dst, src in page_units(plan, buffer):
        if ids is not None:
            dst.numpy()[ids] = src.numpy()
            continue
        for pool_start, buf_start, n in _runs(plan):
            dst[pool_start:pool_start + n].copy_(src[buf_start:buf_start + n])


def gather(plan: CopyPlan, out: torch.Tensor) -> None:
    """Copy the planned pool pages into ``out`` (already validated by `plan.check_buffer`)."""
    if plan.num_pages == 0:
        return
    if use_page_copies(plan):
        for src, dst in page_units(plan, out):
            torch.index_select(src, 0, plan.page_ids, out=dst)  # one memcpy per page when both are dense
        return
    runs = _runs(plan)
    for src, dst, per_unit in copy_units(plan, out):
        if use_runs(plan, per_unit, gather=True):
            for pool_start, buf_start, n in runs:
                dst[buf_start:buf_start + n].copy_(src[pool_start:pool_start + n])
        else:
            torch.index_select(src, 0, plan.page_ids, out=dst)  # writes through the strided view, no temp


def scatter(plan: CopyPlan, buffer: torch.Tensor) -> None:
    """Copy buffer pages into the planned pool pages (inputs already validated)."""
    if plan.num_pages == 0:
        return
    if use_page_copies(plan):
        return _scatter_pages(plan, buffer)
    runs = _runs(plan)
    for dst, src, per_unit in copy_units(plan, buffer):
        if use_runs(plan, per_unit, gather=False):
            for pool_start, buf_start, n in runs:
                dst[pool_start:pool_start + n].copy_(src[buf_start:buf_start + n])
        else:
            dst.index_copy_(0, plan.page_ids, src)
