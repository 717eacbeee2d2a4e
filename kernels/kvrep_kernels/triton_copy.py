"""Triton page-copy kernel: every layer, K and V, in one launch; used for CUDA pools.

Called by `kvrep_kernels.page_copy` (gather and scatter are the same kernel with source and destination
swapped). Tested on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``) bit-exactly against
`kvrep_kernels.torch_copy`.

Work decomposition (grid = (num_chunks, num_tensors)):

    tensor t  = one pool tensor (k0, v0, k1, v1, ... or MLA l0, l1, ...); its base address and the base of
                its pages inside the buffer come from two int64 pointer tables, so all layers share a launch
    chunk c   = up to `max_pages` consecutive pages of one run of consecutive page ids:
                pool pages  src_page[c] .. src_page[c]+n[c]-1   <->   buffer pages dst_page[c] .. +n[c]-1

    address of element (token tk, head h, dim d) of page p of tensor t
        = base[t] + p * page_stride + tk * tok_stride + h * head_stride + d        (elements; d stride is 1)

When both sides store a page in the same dense order (the usual case: NHD pool -> NHD buffer, HND pool ->
HND buffer) the kernel copies a page as one flat span (``FLAT``); otherwise it computes (tk, h, d) per
element, which is how an NHD pool is transposed into an HND buffer and back. A FLAT copy whose addresses and
strides the host finds 16-byte aligned (the usual case: torch allocations, pages of whole vectors) runs
`_copy_pages_aligned_kernel` instead, written so the compiler can prove the alignment: 16-byte loads and stores.
Data are moved as integers of the element width, so any dtype (bf16, fp16, fp32, fp8-as-uint8) is copied
bit-exactly. Page ids are bounds-checked on the host (`plan.make_plan`) before the launch.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .plan import CopyPlan

_TL_BITS = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
LAUNCHES = {"aligned": 0, "general": 0}
"""Launches of each kernel in this process (which one a geometry gets: tests, benchmarks)."""
CHUNK_BYTES = 64 * 1024  # bytes one program copies at most (per tensor); ~1e4 programs for a 32K prefix
MAX_BLOCK = 4096


@triton.jit
def _copy_pages_kernel(
    src_ptrs, dst_ptrs,                                  # int64[num_tensors]: base addresses
    chunk_src_page, chunk_dst_page, chunk_num_pages,     # int64[num_chunks]
    src_page_stride, src_tok_stride, src_head_stride,    # elements
    dst_page_stride, dst_tok_stride, dst_head_stride,
    page_elems, num_heads, head_dim,
    ELEM: tl.constexpr, FLAT: tl.constexpr, BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    t = tl.program_id(1)
    src = tl.load(src_ptrs + t).to(tl.pointer_type(ELEM))
    dst = tl.load(dst_ptrs + t).to(tl.pointer_type(ELEM))
    src_page = tl.load(chunk_src_page + c)
    dst_page = tl.load(chunk_dst_page + c)
    num_pages = tl.load(chunk_num_pages + c)
    offs = tl.arange(0, BLOCK)
    for j in range(num_pages):
        src_base = src + (src_page + j) * src_page_stride
        dst_base = dst + (dst_page + j) * dst_page_stride
        for e0 in range(0, page_elems, BLOCK):
            e = e0 + offs
            mask = e < page_elems
            if FLAT:
                src_off = e
                dst_off = e
            else:  # e enumerates the page in (token, head, dim) order
                d = e % head_dim
                row = e // head_dim
                h = row % num_heads
                tk = row // num_heads
                src_off = tk * src_tok_stride + h * src_head_stride + d
                dst_off = tk * dst_tok_stride + h * dst_head_stride + d
            vals = tl.load(src_base + src_off, mask=mask)
            tl.store(dst_base + dst_off, vals, mask=mask)


@triton.jit
def _copy_pages_aligned_kernel(
    src_anchor, dst_anchor,                              # pointers (16-byte aligned): a pool tensor / the buffer
    src_offs, dst_offs,                                  # int64[num_tensors]: each tensor's base - anchor, elements
    chunk_src_page, chunk_dst_page, chunk_num_pages,     # int64[num_chunks]
    src_page_vecs, dst_page_vecs, page_vecs,             # page strides and page length, in 16-byte vectors
    VEC: tl.constexpr, BLOCK: tl.constexpr,
):
    """The FLAT copy when the host checked that every base, page stride and page length is a multiple of 16
    bytes: written so the compiler can prove it (pointer arguments it specializes as 16-byte aligned, offsets that
    are multiples of `VEC` elements), which gives 16-byte loads and stores (`ld.global.v4.b32`) instead of one
    load per element (a base address cast from an integer carries no alignment)."""
    c = tl.program_id(0)
    t = tl.program_id(1)
    src = src_anchor + (tl.load(src_offs + t) // VEC) * VEC
    dst = dst_anchor + (tl.load(dst_offs + t) // VEC) * VEC
    src_page = tl.load(chunk_src_page + c)
    dst_page = tl.load(chunk_dst_page + c)
    num_pages = tl.load(chunk_num_pages + c)
    offs = tl.arange(0, BLOCK)
    page_elems = page_vecs * VEC
    for j in range(num_pages):
        src_base = src + (src_page + j) * (src_page_vecs * VEC)
        dst_base = dst + (dst_page + j) * (dst_page_vecs * VEC)
        for e0 in range(0, page_elems, BLOCK):
            e = e0 + offs
            mask = e < page_elems
            vals = tl.load(src_base + e, mask=mask)
            tl.store(dst_base + e, vals, mask=mask)


def aligned(ptrs: list[int], strides_bytes: list[int]) -> bool:
    """Whether the 16-byte kernel applies: every address and every byte stride a multiple of 16."""
    return all(x % 16 == 0 for x in ptrs) and all(x % 16 == 0 for x in strides_bytes)


def _page_offsets(tok_stride: int, head_stride: int, page_size: int, num_heads: int) -> torch.Tensor:
    tk = torch.arange(page_size)[:, None]
    h = torch.arange(num_heads)[None, :]
    return (tk * tok_stride + h * head_stride).flatten()


def _chunks(plan: CopyPlan, max_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split each run into chunks of at most ``max_pages`` pages: (pool_start, buf_start, num_pages)."""
    lens = plan.run_lens
    per_run = (lens + max_pages - 1) // max_pages
    run_of_chunk = torch.repeat_interleave(torch.arange(lens.numel()), per_run)
    first_chunk = torch.cumsum(per_run, 0) - per_run
    k = torch.arange(run_of_chunk.numel()) - first_chunk[run_of_chunk]  # chunk index within its run
    offset = k * max_pages
    num = torch.clamp(lens[run_of_chunk] - offset, max=max_pages)
    return plan.run_pool_starts[run_of_chunk] + offset, plan.run_buf_starts[run_of_chunk] + offset, num


@dataclass(frozen=True)
class _Launch:
    """What a copy's launch needs that depends on the pools, the direction and the buffer's page count only (not on
    which pages): the kernel choice, strides and, for the 16-byte kernel, the per-tensor offsets table on the
    device. Kept per (pool tensors, strides, direction, pages, buffer alignment, stream), so a copy like an earlier
    one (every chunk of a transfer, after the first) uploads its chunk table only."""

    aligned: bool
    flat: bool
    src_strides: tuple[int, int, int]
    dst_strides: tuple[int, int, int]
    offsets: "torch.Tensor | None"
    """16-byte kernel: int64 [src offsets..., dst offsets...] from the anchors (the pool's first tensor, the
    buffer), on the device; None for the general kernel (its tables hold the buffer's address: one per call)."""
    block: int
    warps: int


_LAUNCHES_KEPT: "collections.OrderedDict[tuple, _Launch]" = collections.OrderedDict()
KEEP_LAUNCHES = 64
"""Launch descriptions kept (least recently used dropped first): a handful of page counts per direction."""


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    # NOTE: from pinned memory, asynchronously: a pageable upload blocks the calling thread until the stream
    # reaches it, and the agent's copy stream waits behind SGLang's forward (the fence), so a blocking upload held
    # the scheduler thread for the forward in flight (measured on an H200: 5.4 ms a step under 5 ms forwards).
    # PyTorch's caching host allocator keeps the pinned table until the upload is done.
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _describe(plan: CopyPlan, buffer: torch.Tensor, gather: bool) -> tuple[_Launch, list[int], list[int]]:
    """Checks every stride and shape the kernels rely on and chooses the kernel; also returns the per-tensor
    source and destination addresses (the general kernel's tables)."""
    g = plan.geometry
    pools = plan.pools
    ref = pools[0]
    ps, H, D, P = g.page_size, g.num_kv_heads, g.head_dim, plan.num_pages
    page_elems = g.page_elems()
    itemsize = ref.element_size()

    # Pool side: every tensor has the same strides, unit stride along head_dim.
    for t in pools:
        assert t.stride() == ref.stride(), f"pool strides differ: {t.stride()} vs {ref.stride()}"
        assert t.stride(-1) == 1, f"pool head_dim stride must be 1, got {t.stride()}"
        assert t.data_ptr() % itemsize == 0
    if plan.pool_layout == "NHD":
        assert ref.dim() == 3 and ref.shape[1:] == (H, D)
        pool_page, pool_tok, pool_head = ps * ref.stride(0), ref.stride(0), ref.stride(1)
    else:
        assert ref.dim() == 4 and ref.shape[1:] == (H, ps, D)
        pool_page, pool_tok, pool_head = ref.stride(0), ref.stride(2), ref.stride(1)
    pool_ptrs = [t.data_ptr() for t in pools]

    # Buffer side: contiguous (L, P, 2, ps, H, D) / (L, P, 2, H, ps, D) / MLA (L, P, ps, H, D).
    assert buffer.is_contiguous() and tuple(buffer.shape) == g.buffer_shape(P)
    assert buffer.dtype == ref.dtype and buffer.device == ref.device
    if g.kind == "mha":
        buf_page = 2 * page_elems
        buf_ptrs = [buffer.data_ptr() + ((i // 2) * P * 2 + i % 2) * page_elems * itemsize for i in range(len(pools))]
    else:
        buf_page = page_elems
        buf_ptrs = [buffer.data_ptr() + i * P * page_elems * itemsize for i in range(len(pools))]
    buf_tok, buf_head = (H * D, D) if g.layout == "NHD" else (D, ps * D)

    pool_offs = _page_offsets(pool_tok, pool_head, ps, H)
    buf_offs = _page_offsets(buf_tok, buf_head, ps, H)
    dense = torch.equal(torch.sort(buf_offs).values, torch.arange(ps * H) * D)
    flat = dense and torch.equal(pool_offs, buf_offs)
    if gather:
        src_ptrs, dst_ptrs = pool_ptrs, buf_ptrs
        src_strides, dst_strides = (pool_page, pool_tok, pool_head), (buf_page, buf_tok, buf_head)
    else:
        src_ptrs, dst_ptrs = buf_ptrs, pool_ptrs
        src_strides, dst_strides = (buf_page, buf_tok, buf_head), (pool_page, pool_tok, pool_head)
    aligned_copy = flat and itemsize in _INT_OF and aligned(
        [*src_ptrs, *dst_ptrs], [src_strides[0] * itemsize, dst_strides[0] * itemsize, page_elems * itemsize])
    offsets = None
    if aligned_copy:  # offsets from the anchors (a pool tensor, the buffer): the same for every buffer of P pages
        src_base, dst_base = (ref, buffer) if gather else (buffer, ref)
        offs = [(x - src_base.data_ptr()) // itemsize for x in src_ptrs] + \
            [(x - dst_base.data_ptr()) // itemsize for x in dst_ptrs]
        offsets = _upload(torch.tensor(offs, dtype=torch.int64), ref.device)
    block = min(MAX_BLOCK, triton.next_power_of_2(page_elems))
    launch = _Launch(aligned_copy, flat, src_strides, dst_strides, offsets, block, 4 if block <= 1024 else 8)
    return launch, src_ptrs, dst_ptrs


def copy_pages(plan: CopyPlan, buffer: torch.Tensor, *, gather: bool) -> None:
    """Launch the copy for a validated ``plan``: pool -> ``buffer`` if ``gather`` else ``buffer`` -> pool.

    Asserts every stride and shape the kernel relies on (once per pools, direction and page count: `_Launch`).
    """
    g = plan.geometry
    if plan.num_pages == 0:
        return
    pools = plan.pools
    ref = pools[0]
    itemsize = ref.element_size()
    stream = torch.cuda.current_stream(ref.device).cuda_stream if ref.is_cuda else 0
    key = (tuple((t.data_ptr(), t.stride()) for t in pools), ref.shape, ref.dtype, ref.device, plan.pool_layout,
           g, plan.num_pages, gather, buffer.data_ptr() % 16, stream)
    launch = _LAUNCHES_KEPT.get(key)
    src_ptrs = dst_ptrs = None
    if launch is None or not launch.aligned:
        launch, src_ptrs, dst_ptrs = _describe(plan, buffer, gather)
        if launch.aligned:
            _LAUNCHES_KEPT[key] = launch
            while len(_LAUNCHES_KEPT) > KEEP_LAUNCHES:
                _LAUNCHES_KEPT.popitem(last=False)
    else:
        _LAUNCHES_KEPT.move_to_end(key)
        assert buffer.is_contiguous() and tuple(buffer.shape) == g.buffer_shape(plan.num_pages)
        assert buffer.dtype == ref.dtype and buffer.device == ref.device

    page_elems = g.page_elems()
    max_pages = max(1, CHUNK_BYTES // (page_elems * itemsize))
    pool_start, buf_start, num = _chunks(plan, max_pages)
    src_page, dst_page = (pool_start, buf_start) if gather else (buf_start, pool_start)
    n_t, n_c = len(pools), num.numel()
    if launch.aligned:  # anchors: a pool tensor and the buffer, as integers of the element width (bit-exact)
        dev = _upload(torch.cat([src_page, dst_page, num]), ref.device)
        pool_anchor, buf_anchor = ref.view(_INT_OF[itemsize]), buffer.view(_INT_OF[itemsize])
        src_anchor, dst_anchor = (pool_anchor, buf_anchor) if gather else (buf_anchor, pool_anchor)
        vec = 16 // itemsize
        _copy_pages_aligned_kernel[(n_c, n_t)](
            src_anchor, dst_anchor, launch.offsets[:n_t], launch.offsets[n_t:],
            dev[:n_c], dev[n_c:2 * n_c], dev[2 * n_c:],
            launch.src_strides[0] // vec, launch.dst_strides[0] // vec, page_elems // vec,
            VEC=vec, BLOCK=launch.block, num_warps=launch.warps,
        )
        LAUNCHES["aligned"] += 1
        return
    # one upload of the tables (addresses fit int64 on every platform we run on)
    host = torch.cat([torch.tensor([src_ptrs, dst_ptrs], dtype=torch.int64).flatten(), src_page, dst_page, num])
    dev = _upload(host, ref.device)
    src_tab, dst_tab = dev[:n_t], dev[n_t:2 * n_t]
    src_pg, dst_pg, num_pg = dev[2 * n_t:2 * n_t + n_c], dev[2 * n_t + n_c:2 * n_t + 2 * n_c], dev[2 * n_t + 2 * n_c:]
    _copy_pages_kernel[(n_c, n_t)](
        src_tab, dst_tab, src_pg, dst_pg, num_pg,
        *launch.src_strides, *launch.dst_strides,
        page_elems, g.num_kv_heads, g.head_dim,
        ELEM=_TL_BITS[itemsize], FLAT=launch.flat, BLOCK=launch.block, num_warps=launch.warps,
    )
    LAUNCHES["general"] += 1
