"""Public page-copy entry points: gather pool pages into a transfer buffer and scatter them back.

Called by the worker agent (sglang_kvrep) on both ends of a replication: the sender gathers a prefix's pages
into a buffer in FlashInfer's paged layout (see `kvrep_kernels.geometry`), the receiver scatters the buffer
into pages it has just allocated. Everything is validated before the first byte is written.

Backend dispatch: Triton for CUDA tensors, torch for CPU tensors; ``backend="torch"|"triton"`` forces one
(Triton on CPU tensors only works under ``TRITON_INTERPRET=1``, which is how the tests run it).

Stream ordering on the GPU: the copy is enqueued on ``stream`` (default: the current stream) after
``stream.wait_event(wait_event)`` when an event is given. The caller typically records an event on SGLang's
forward stream after the forward that wrote (gather) or before the forward that reads (scatter) the pages,
passes it as ``wait_event``, and records its own event on ``stream`` after the call to learn when the copy
is done. Tensors created here (index tables, and ``out`` when not given) are allocated on ``stream`` itself,
so the caching allocator orders their reuse after the copy; the caller keeps the pool, ``out``/``buffer`` and
``page_ids`` alive until its event completes.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from . import torch_copy
from .plan import CopyPlan, check_buffer, make_plan

BACKENDS = ("auto", "torch", "triton")


def _backend(name: str, device: torch.device) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


@contextlib.contextmanager
def _on_stream(stream, wait_event, device: torch.device):
    if device.type != "cuda":
        if stream is not None or wait_event is not None:
            raise ValueError(f"stream/wait_event apply to CUDA pools only; the pool is on {device}")
        yield
        return
    stream = stream if stream is not None else torch.cuda.current_stream(device)
    if wait_event is not None:
        stream.wait_event(wait_event)
    with torch.cuda.stream(stream):
        yield


def _run(plan: CopyPlan, buffer: torch.Tensor, backend: str, gather: bool) -> None:
    if backend == "torch":
        (torch_copy.gather if gather else torch_copy.scatter)(plan, buffer)
    else:
        from . import triton_copy  # lazy: importing triton is slow and optional on CPU-only hosts

        triton_copy.copy_pages(plan, buffer, gather=gather)


def gather_pages(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor] | None,
    page_ids: torch.Tensor,
    page_size: int,
    *,
    layout: str = "NHD",
    out: torch.Tensor | None = None,
    backend: str = "auto",
    stream: "torch.cuda.Stream | None" = None,
    wait_event: "torch.cuda.Event | None" = None,
) -> torch.Tensor:
    """Copy pool pages into a transfer buffer in FlashInfer's paged layout.

    Args:
        k_buffers: per-layer K tensors ``(rows, H, D)`` (or HND ``(num_pages, H, ps, D)``); for MLA the
            per-layer latent tensors ``(rows, 1, D)``.
        v_buffers: per-layer V tensors shaped like ``k_buffers``; None for an MLA pool.
        page_ids: int64 page ids (1-D, any order, repeats allowed); buffer page i holds ``page_ids[i]``.
            CPU ids avoid a device sync.
        page_size: tokens per page (1 is fine).
        layout: buffer layout, ``"NHD"`` ``(L, P, 2, ps, H, D)`` or ``"HND"`` ``(L, P, 2, H, ps, D)``;
            MLA buffers are ``(L, P, ps, H, D)`` either way.
        out: optional contiguous buffer of the right shape, dtype and device to fill.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        stream: CUDA stream to enqueue on (default: current stream).
        wait_event: CUDA event the stream waits for before copying (e.g. recorded on the forward stream).
    Returns:
        The buffer (``out`` when given). On CUDA it is ready once ``stream`` reaches this point.
    Raises:
        ValueError: inconsistent shapes, dtypes, devices or layout; IndexError: a page id out of range.
    """
    plan = make_plan(k_buffers, v_buffers, page_ids, page_size, layout)
    device = plan.pools[0].device
    if out is not None:
        check_buffer(plan, out, "out")
    backend = _backend(backend, device)
    with _on_stream(stream, wait_event, device):
        if out is None:  # allocated on the copy stream, which is the stream that first uses it
            out = torch.empty(plan.geometry.buffer_shape(plan.num_pages), dtype=plan.pools[0].dtype, device=device)
        _run(plan, out, backend, gather=True)
    return out


def scatter_pages(
    buffer: torch.Tensor,
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor] | None,
    page_ids: torch.Tensor,
    page_size: int,
    *,
    layout: str = "NHD",
    backend: str = "auto",
    stream: "torch.cuda.Stream | None" = None,
    wait_event: "torch.cuda.Event | None" = None,
) -> None:
    """Write the pages of a transfer buffer into the pool at ``page_ids`` (inverse of `gather_pages`).

    Shapes, dtypes, devices, bounds and uniqueness of ``page_ids`` are all checked before anything is
    written, so a rejected call leaves the pool untouched.

    Args:
        buffer: contiguous buffer from `gather_pages` (same geometry and layout).
        k_buffers, v_buffers, page_size, layout, backend, stream, wait_event: as for `gather_pages`.
        page_ids: distinct int64 page ids; buffer page i is written to pool page ``page_ids[i]``.
    Raises:
        ValueError: inconsistent inputs or a repeated page id; IndexError: a page id out of range.
    """
    plan = make_plan(k_buffers, v_buffers, page_ids, page_size, layout, unique=True)
    check_buffer(plan, buffer)
    device = plan.pools[0].device
    backend = _backend(backend, device)
    with _on_stream(stream, wait_event, device):
        _run(plan, buffer, backend, gather=False)


def warm_up(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor] | None,
    page_size: int,
    *,
    layout: str = "NHD",
    backend: str = "auto",
) -> bool:
    """Compile the copy kernels a pool's gathers and scatters will launch, once, now (the worker agent calls it
    when it starts): the first copy then does not compile on SGLang's scheduler thread (~1-3 s). The copies run
    on a scratch pool of two pages with the pool's own per-tensor strides, dtype, device and relative alignment
    (the kernel variant depends on them), never on the pool itself.

    Returns:
        whether anything was compiled (False for a pool whose copies need no compiled kernel: CPU, torch).
    """
    ref = k_buffers[0]
    if _backend(backend, ref.device) != "triton":
        return False
    n = len(k_buffers) + (len(v_buffers) if v_buffers is not None else 0)
    rows_per_page = page_size if ref.dim() == 3 else 1  # NHD/MLA rows are tokens; an HND pool's rows are pages
    # each scratch tensor starts where its pool tensor does within a 16-byte line (which kernel runs depends on it)
    line = max(1, 16 // ref.element_size())
    row = ref[0].numel()
    length = -(-(2 * rows_per_page * row + line) // line) * line
    scratch = torch.zeros((n, length), dtype=ref.dtype, device=ref.device)  # (allocations are 16-byte aligned)
    offs = [t.data_ptr() % 16 // t.element_size() for t in [*k_buffers, *(v_buffers or [])]]
    shape = (2 * rows_per_page, *ref.shape[1:])
    views = [scratch[i, o:o + 2 * rows_per_page * row].view(shape) for i, o in enumerate(offs)]
    k = views[:len(k_buffers)]
    v = views[len(k_buffers):] if v_buffers is not None else None
    ids = torch.tensor([1])
    buf = gather_pages(k, v, ids, page_size, layout=layout, backend=backend)
    scatter_pages(buf, k, v, ids, page_size, layout=layout, backend=backend)
    return True


def slots_to_page_ids(slot_indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """Turn SGLang's per-token slot indices of a page-aligned prefix into page ids.

    Args:
        slot_indices: 1-D int64 (or int32) slots, root to node; a multiple of ``page_size`` long, each group of
            ``page_size`` being one whole page ``p*ps, p*ps+1, ..., p*ps+ps-1``.
        page_size: tokens per page.
    Returns:
        int64 page ids (one per group) on the device of ``slot_indices``.
    Raises:
        ValueError: wrong rank/dtype, a length that is not a multiple of ``page_size``, or a group that is not
            one aligned page (the message names the first offending position and slot).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if not isinstance(slot_indices, torch.Tensor) or slot_indices.dim() != 1:
        raise ValueError("slot_indices must be a 1-D tensor")
    if slot_indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_indices must be int64 (or int32), got {slot_indices.dtype}")
    n = slot_indices.numel()
    if n % page_size:
        raise ValueError(f"{n} slot indices is not a multiple of page_size={page_size}")
    slots = slot_indices.to(torch.int64)
    groups = slots.view(-1, page_size)
    page_ids = torch.div(groups[:, 0], page_size, rounding_mode="floor")
    expected = page_ids[:, None] * page_size + torch.arange(page_size, device=slots.device)
    bad = (groups != expected) | (groups < 0)
    if bool(bad.any()):
        pos = int(torch.nonzero(bad.flatten())[0])
        page_start = pos - pos % page_size
        raise ValueError(
            f"slot {int(slots[pos])} at position {pos} breaks page alignment: positions "
            f"{page_start}..{page_start + page_size - 1} must be slots p*{page_size}..p*{page_size}+{page_size - 1}"
        )
    return page_ids
