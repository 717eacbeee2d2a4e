"""Triton page-copy kernel vs the torch reference, bit-exact, through Triton's interpreter on the CPU.

The kernel is decorated while ``TRITON_INTERPRET=1`` is set (a module fixture reloads
`kvrep_kernels.triton_copy` under the variable and reloads it again without it afterwards), so the
interpreter covers these tests only and no other module's Triton kernels. The CUDA test at the end runs the
compiled kernel (its own fixture clears the variable, which the module fixture keeps set until the file ends,
and reloads the module) and is skipped only where no CUDA device exists.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import kvrep_kernels as kk
from kvrep_kernels import plan as plan_mod
from kvrep_kernels.testing import bits_equal, make_pool, oracle_gather, page_list, zeros_like_pool

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
CASES = [  # (pool kind, buffer layout); non-matching pairs exercise the kernel's transposing (non-FLAT) path
    ("separate", "NHD"), ("separate", "HND"), ("fused", "NHD"), ("hnd_pool", "HND"), ("hnd_pool", "NHD"),
    ("mla", "NHD"),
]


@pytest.fixture(scope="module")
def triton_copy():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    from kvrep_kernels import triton_copy as module
    module = importlib.reload(module)
    from triton.runtime.interpreter import InterpretedFunction
    assert isinstance(module._copy_pages_kernel, InterpretedFunction)
    yield module
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old
    importlib.reload(module)


@pytest.fixture
def compiled_copy():
    """`kvrep_kernels.triton_copy` decorated without the interpreter, for this test only: the module fixture's
    ``TRITON_INTERPRET=1`` stays set until the whole file is done, so it is cleared here and put back after."""
    from triton.runtime.interpreter import InterpretedFunction

    old = os.environ.pop("TRITON_INTERPRET", None)
    try:
        module = importlib.reload(importlib.import_module("kvrep_kernels.triton_copy"))
        assert not isinstance(module._copy_pages_kernel, InterpretedFunction)
        yield module
    finally:
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old
        importlib.reload(importlib.import_module("kvrep_kernels.triton_copy"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind,layout", CASES)
def test_triton_matches_reference(triton_copy, kind, layout, page_size, dtype):
    # MLA gets a head_dim whose page is not a power of two (masked tail of the last block).
    pool = make_pool(kind, dtype, page_size, num_pages=10, head_dim=24 if kind == "mla" else 8, seed=page_size)
    ids = torch.tensor(page_list(pool.num_pages, gen_seed=5))
    ref = kk.gather_pages(pool.k, pool.v, ids, page_size, layout=layout, backend="torch")
    got = kk.gather_pages(pool.k, pool.v, ids, page_size, layout=layout, backend="triton")
    assert bits_equal(got, ref)
    assert bits_equal(got, oracle_gather(pool, ids.tolist(), layout))

    dst_ref, dst_tri = zeros_like_pool(pool), zeros_like_pool(pool)
    kk.scatter_pages(ref, dst_ref.k, dst_ref.v, ids, page_size, layout=layout, backend="torch")
    kk.scatter_pages(ref, dst_tri.k, dst_tri.v, ids, page_size, layout=layout, backend="triton")
    assert all(bits_equal(a, b) for a, b in zip(dst_ref.tensors, dst_tri.tensors))


def test_long_runs_are_split_into_chunks(triton_copy, monkeypatch):
    pool = make_pool("fused", torch.bfloat16, 4, num_pages=30, seed=9)
    ids = torch.tensor(list(range(3, 13)) + [20, 1] + list(range(22, 29)))
    plan = plan_mod.make_plan(pool.k, pool.v, ids, 4, "NHD")
    assert [t.tolist() for t in triton_copy._chunks(plan, 3)] == [
        [3, 6, 9, 12, 20, 1, 22, 25, 28],  # pool start page of each chunk
        [0, 3, 6, 9, 10, 11, 12, 15, 18],  # buffer start page
        [3, 3, 3, 1, 1, 1, 3, 3, 1],       # pages
    ]
    page_bytes = 4 * 2 * 8 * 2
    monkeypatch.setattr(triton_copy, "CHUNK_BYTES", 3 * page_bytes)  # the launch above: 3 pages per program
    got = kk.gather_pages(pool.k, pool.v, ids, 4, backend="triton")
    assert bits_equal(got, oracle_gather(pool, ids.tolist(), "NHD"))
    dst = zeros_like_pool(pool)
    kk.scatter_pages(got, dst.k, dst.v, ids, 4, backend="triton")
    assert bits_equal(oracle_gather(dst, ids.tolist(), "NHD"), got)


def test_triton_float8_pool_and_repeats(triton_copy):
    pool = make_pool("separate", torch.float8_e4m3fn, 16, num_pages=6, seed=2)
    ids = torch.tensor([4, 4, 1, 5])
    got = kk.gather_pages(pool.k, pool.v, ids, 16, backend="triton")
    assert bits_equal(got, oracle_gather(pool, ids.tolist(), "NHD"))


@pytest.mark.parametrize("kind,layout", [("separate", "NHD"), ("mla", "NHD"), ("fused", "NHD")])
def test_a_launch_described_once_is_reused_for_other_pages_and_buffers_but_never_across_pools(triton_copy, kind,
                                                                                              layout):
    """The 16-byte kernel's per-tensor offsets are uploaded once per (pools, direction, page count): every later
    chunk of a transfer uploads its chunk table only. Other pages, another buffer of as many pages, the other
    direction and another pool of the same shape all stay bit-exact; the pools and the direction are the key."""
    pool = make_pool(kind, torch.bfloat16, 16, num_pages=12, head_dim=8, seed=5)
    other = make_pool(kind, torch.bfloat16, 16, num_pages=12, head_dim=8, seed=6)
    triton_copy._LAUNCHES_KEPT.clear()
    targets = []  # (kept alive: a freed pool's addresses may come back for the next one)
    for ids in ([3, 4, 5], [9, 1, 10], [2, 11, 6]):
        out = kk.gather_pages(pool.k, pool.v, torch.tensor(ids), 16, layout=layout, backend="triton")
        assert bits_equal(out, oracle_gather(pool, ids, layout))
        dst = zeros_like_pool(pool)
        targets.append(dst)
        kk.scatter_pages(out, dst.k, dst.v, torch.tensor(ids), 16, layout=layout, backend="triton")
        assert bits_equal(oracle_gather(dst, ids, layout), out)
    kept = dict(triton_copy._LAUNCHES_KEPT)
    assert all(launch.aligned for launch in kept.values())
    assert len(kept) == 1 + 3  # the gathers share one; each scatter's pool is another
    out = kk.gather_pages(other.k, other.v, torch.tensor([3, 4, 5]), 16, layout=layout, backend="triton")
    assert bits_equal(out, oracle_gather(other, [3, 4, 5], layout))  # not the first pool's offsets
    assert len(triton_copy._LAUNCHES_KEPT) == 5
    out = kk.gather_pages(pool.k, pool.v, torch.tensor([3, 4]), 16, layout=layout, backend="triton")
    assert bits_equal(out, oracle_gather(pool, [3, 4], layout)) and len(triton_copy._LAUNCHES_KEPT) == 6


def test_triton_checks_bounds_before_launch(triton_copy):
    pool = make_pool("separate", torch.float16, 16, num_pages=6)
    buf = kk.gather_pages(pool.k, pool.v, torch.tensor([1, 2]), 16, backend="triton")
    before = [t.clone() for t in pool.tensors]
    with pytest.raises(IndexError, match="page id 6 at position 1"):
        kk.scatter_pages(torch.zeros_like(buf), pool.k, pool.v, torch.tensor([1, 6]), 16, backend="triton")
    with pytest.raises(IndexError, match="page id 0 at position 0"):
        kk.gather_pages(pool.k, pool.v, torch.tensor([0, 2]), 16, backend="triton")
    assert all(bits_equal(a, b) for a, b in zip(before, pool.tensors))


@pytest.mark.parametrize("kind,layout,dtype,page_size,head_dim,path", [
    ("separate", "NHD", torch.bfloat16, 16, 128, "aligned"),  # Llama-3.1-8B's pages: whole 16-byte vectors
    ("hnd_pool", "HND", torch.bfloat16, 16, 128, "aligned"),
    ("mla", "NHD", torch.bfloat16, 1, 576, "aligned"),
    ("separate", "NHD", torch.uint8, 1, 3, "general"),        # a 6-byte page: no 16-byte vector fits
    ("separate", "HND", torch.bfloat16, 16, 128, "general"),  # transposed inside the page: not FLAT
    ("fused", "NHD", torch.uint8, 2, 4, "general/aligned"),   # 16-byte pages, V 19 rows of 8 bytes in (the
                                                               # scatter's target: separate K, V tensors)
])
def test_aligned_geometries_take_the_16_byte_kernel_bit_exactly(triton_copy, kind, layout, dtype, page_size,
                                                                head_dim, path):
    """Issue 18 item 2: where the host finds every base and stride 16-byte aligned the vector kernel runs (its
    loads are 16 bytes on sm_90: the next test), else the general one; both bit-exact against the oracle."""
    pool = make_pool(kind, dtype, page_size, num_pages=8, head_dim=head_dim, seed=3)
    ids = torch.tensor([3, 4, 5, 1, 7])
    def ran(op):
        before = dict(triton_copy.LAUNCHES)
        op()
        [kernel] = [k for k in before if triton_copy.LAUNCHES[k] != before[k]]
        return kernel

    out = []
    path_gather = ran(lambda: out.append(kk.gather_pages(pool.k, pool.v, ids, page_size, layout=layout,
                                                         backend="triton")))
    assert bits_equal(out[0], oracle_gather(pool, ids.tolist(), layout))
    dst = zeros_like_pool(pool)
    path_scatter = ran(lambda: kk.scatter_pages(out[0], dst.k, dst.v, ids, page_size, layout=layout,
                                                backend="triton"))
    assert bits_equal(oracle_gather(dst, ids.tolist(), layout), out[0])
    assert (path_gather, path_scatter) == tuple(path.split("/")) * (2 // len(path.split("/")))


@pytest.mark.parametrize("kind,layout,dtype,page_size,head_dim", [
    ("separate", "NHD", torch.bfloat16, 16, 128), ("fused", "NHD", torch.uint8, 2, 4), ("hnd_pool", "HND",
                                                                                        torch.float16, 4, 8),
    ("mla", "NHD", torch.bfloat16, 1, 24)])
def test_warm_up_runs_the_pools_kernels_on_a_scratch_pool_and_never_touches_the_pool(triton_copy, kind, layout,
                                                                                     dtype, page_size, head_dim):
    """Issue 18 item 2: compiled once at agent start. The warm-up launches the very kernel variants (aligned or
    general, gather and scatter) the pool's copies will, on two scratch pages, and leaves the pool as it was."""
    pool = make_pool(kind, dtype, page_size, num_pages=6, head_dim=head_dim, seed=4)
    before_bits = [t.clone() for t in pool.tensors]
    ids = torch.tensor([2, 3])
    launches = dict(triton_copy.LAUNCHES)
    assert kk.warm_up(pool.k, pool.v, page_size, layout=layout, backend="triton")
    warm = {k: triton_copy.LAUNCHES[k] - launches[k] for k in launches}
    launches = dict(triton_copy.LAUNCHES)
    buf = kk.gather_pages(pool.k, pool.v, ids, page_size, layout=layout, backend="triton")
    kk.scatter_pages(buf, pool.k, pool.v, ids, page_size, layout=layout, backend="triton")
    real = {k: triton_copy.LAUNCHES[k] - launches[k] for k in launches}
    assert warm == real and sum(warm.values()) == 2
    assert all(bits_equal(a, b) for a, b in zip(before_bits, pool.tensors))
    assert kk.warm_up(pool.k, pool.v, page_size, layout=layout) is False  # CPU pools copy with torch: nothing


def test_the_aligned_kernel_compiles_to_16_byte_loads_for_an_h200(triton_copy):
    """Compiled for sm_90 here, no GPU needed (Triton's own compiler and ptxas): the vector kernel's global loads
    and stores of data are 16 bytes; the general kernel's are one element (2 bytes for bf16) -- why it exists."""
    import re

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def ptx(fn, sig, constexprs):
        attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items()) if ty.startswith("*")}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    old = os.environ.pop("TRITON_INTERPRET", None)  # the module fixture's interpreter: not for compiling
    try:
        module = importlib.reload(importlib.import_module("kvrep_kernels.triton_copy"))
        tables = {n: "*i64" for n in ("chunk_src_page", "chunk_dst_page", "chunk_num_pages")}
        vec = ptx(module._copy_pages_aligned_kernel,
                  {"src_anchor": "*i16", "dst_anchor": "*i16", "src_offs": "*i64", "dst_offs": "*i64", **tables,
                   "src_page_vecs": "i64", "dst_page_vecs": "i64", "page_vecs": "i64",
                   "VEC": "constexpr", "BLOCK": "constexpr"}, {"VEC": 8, "BLOCK": 2048})
        general = ptx(module._copy_pages_kernel,
                      {"src_ptrs": "*i64", "dst_ptrs": "*i64", **tables,
                       **{f"{side}_{x}_stride": "i64" for side in ("src", "dst") for x in ("page", "tok", "head")},
                       "page_elems": "i64", "num_heads": "i64", "head_dim": "i64",
                       "ELEM": "constexpr", "FLAT": "constexpr", "BLOCK": "constexpr"},
                      {"ELEM": tl.int16, "FLAT": True, "BLOCK": 2048})
    finally:
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old
        importlib.reload(importlib.import_module("kvrep_kernels.triton_copy"))
    assert "st.global.v4.b32" in vec and "ld.global.v4.b32" in vec and "st.global.b16" not in vec
    assert "st.global.b16" in general and "v4" not in general


def test_the_compiled_kernel_fixture_clears_the_interpreter(triton_copy, compiled_copy):
    """With the module fixture's interpreter setting active (as it is for the CUDA test when the file runs
    whole), `compiled_copy` gives the compiled kernel and no interpreter setting; afterwards the setting and the
    interpreted kernel are back for the rest of the file."""
    from triton.runtime.interpreter import InterpretedFunction

    assert "TRITON_INTERPRET" not in os.environ
    assert not isinstance(compiled_copy._copy_pages_kernel, InterpretedFunction)
    assert importlib.import_module("kvrep_kernels.triton_copy") is compiled_copy


def test_the_interpreter_is_back_after_the_compiled_kernel_fixture(triton_copy):
    from triton.runtime.interpreter import InterpretedFunction

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(importlib.import_module("kvrep_kernels.triton_copy")._copy_pages_kernel, InterpretedFunction)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,layout", CASES)
def test_cuda_matches_cpu_reference_on_a_side_stream(compiled_copy, kind, layout, dtype, page_size):
    """Every pool kind and layout, dtype and page size: the compiled kernel on a side stream, bit-exact against
    the CPU reference (gather, then scatter into a clean pool and gather again)."""
    pool = make_pool(kind, dtype, page_size, num_pages=40, head_dim=24 if kind == "mla" else 128, seed=1)
    ids = torch.tensor(page_list(pool.num_pages, gen_seed=8))
    ref = kk.gather_pages(pool.k, pool.v, ids, page_size, layout=layout)
    k = [t.cuda() for t in pool.k]
    v = None if pool.v is None else [t.cuda() for t in pool.v]
    side = torch.cuda.Stream()
    ready = torch.cuda.Event()
    ready.record()  # stands in for SGLang's forward stream having written the pages
    got = kk.gather_pages(k, v, ids, page_size, layout=layout, stream=side, wait_event=ready)
    side.synchronize()
    assert bits_equal(got.cpu(), ref)
    assert kk.payload_checksum(got) == kk.payload_checksum(ref, "sum64")
    dst_k = [torch.zeros_like(t) for t in k]
    dst_v = None if v is None else [torch.zeros_like(t) for t in v]
    kk.scatter_pages(got, dst_k, dst_v, ids, page_size, layout=layout)
    again = kk.gather_pages(dst_k, dst_v, ids, page_size, layout=layout)
    assert bits_equal(again.cpu(), ref)
