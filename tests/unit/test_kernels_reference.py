"""Tests of the torch (CPU reference) page copies, validation, slot->page conversion and checksums."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest
import torch
import xxhash

import kvrep_kernels as kk
from kvrep_kernels import plan as plan_mod
from kvrep_kernels import torch_copy
from kvrep_kernels.testing import (
    bits_equal, make_pool, oracle_gather, page_list, random_bits, zeros_like_pool,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]
CASES = [  # (pool kind, buffer layout)
    ("separate", "NHD"), ("separate", "HND"), ("fused", "NHD"), ("fused", "HND"),
    ("hnd_pool", "HND"), ("hnd_pool", "NHD"), ("mla", "NHD"),
]


# ---------------------------------------------------------------- geometry


def test_geometry_llama8b_sizes():
    g = kk.PoolGeometry(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
    assert g.page_bytes() == 32 * 2 * 16 * 8 * 128 * 2
    assert g.buffer_shape(5) == (32, 5, 2, 16, 8, 128)
    assert kk.PoolGeometry(32, 8, 128, 16, torch.bfloat16, layout="HND").buffer_shape(5) == (32, 5, 2, 8, 16, 128)
    mla = kk.PoolGeometry(61, 1, 576, 1, "fp8_e4m3", kind="mla")
    assert mla.torch_dtype == torch.uint8
    assert mla.page_bytes() == 61 * 576 and mla.buffer_shape(3) == (61, 3, 1, 1, 576)


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("page_size", -1), ("kind", "gqa"),
                                         ("layout", "NDH"), ("dtype", "float7")])
def test_geometry_rejects_bad_fields(field, value):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="fp16")
    args[field] = value
    with pytest.raises(ValueError, match=str(value)):
        kk.PoolGeometry(**args)


# ---------------------------------------------------------------- gather / scatter against the oracle


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind,layout", CASES)
def test_torch_gather_scatter_match_oracle(kind, layout, page_size, dtype):
    pool = make_pool(kind, dtype, page_size, seed=page_size)
    ids = page_list(pool.num_pages, gen_seed=3)
    expected = oracle_gather(pool, ids, layout)

    buf = kk.gather_pages(pool.k, pool.v, torch.tensor(ids), page_size, layout=layout)
    assert buf.shape == expected.shape and bits_equal(buf, expected)

    dst = zeros_like_pool(pool)
    kk.scatter_pages(buf, dst.k, dst.v, torch.tensor(ids), page_size, layout=layout)
    # Exactly the listed pages were written, bit for bit; every other page is still zero.
    assert bits_equal(oracle_gather(dst, ids, layout), expected)
    others = [p for p in range(pool.num_pages) if p not in ids]
    assert not oracle_gather(dst, others, layout).view(torch.uint8).any()


@pytest.mark.parametrize("strategy", ["runs", "index"])
@pytest.mark.parametrize("kind,layout", CASES)
def test_both_torch_strategies_match_oracle(monkeypatch, strategy, kind, layout):
    limit = 0 if strategy == "runs" else 1 << 62
    monkeypatch.setattr(torch_copy, "GATHER_MIN_RUN_BYTES", limit)
    monkeypatch.setattr(torch_copy, "SCATTER_MIN_RUN_BYTES", limit)
    pool = make_pool(kind, torch.bfloat16, 4, num_pages=40, seed=7)
    shuffled = [p for p in (torch.randperm(39, generator=torch.Generator().manual_seed(1)) + 1).tolist()
                if not 30 <= p < 34]
    ids = torch.tensor(shuffled[:5] + [30, 31, 32, 33] + shuffled[5:20])  # one run among scattered pages
    plan = plan_mod.make_plan(pool.k, pool.v, ids, 4, layout)
    per_unit = [n for _, _, n in torch_copy.copy_units(plan, torch.empty(plan.geometry.buffer_shape(len(ids)),
                                                                          dtype=torch.bfloat16))]
    assert per_unit == ([2, 2] if kind == "fused" else [1] * len(plan.pools))  # fused K/V copied as one unit
    assert torch_copy.use_runs(plan, per_unit[0], gather=True) == (strategy == "runs")
    expected = oracle_gather(pool, ids.tolist(), layout)
    buf = kk.gather_pages(pool.k, pool.v, ids, 4, layout=layout)
    assert bits_equal(buf, expected)
    dst = zeros_like_pool(pool)
    kk.scatter_pages(buf, dst.k, dst.v, ids, 4, layout=layout)
    assert bits_equal(oracle_gather(dst, ids.tolist(), layout), expected)
    others = [p for p in range(pool.num_pages) if p not in ids.tolist()]
    assert not oracle_gather(dst, others, layout).view(torch.uint8).any()


@pytest.mark.parametrize("numpy_scatter", [True, False], ids=["numpy", "no-numpy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind,layout", CASES)
def test_page_copy_strategy_matches_oracle(monkeypatch, kind, layout, page_size, dtype, numpy_scatter):
    """The per-page memcpy path (forced here: the test pools' pages are small), with and without NumPy."""
    monkeypatch.setattr(torch_copy, "PAGE_COPY_MIN_BYTES", 0)
    if not numpy_scatter:
        def no_numpy(self):
            raise RuntimeError("Numpy is not available")
        monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    pool = make_pool(kind, dtype, page_size, seed=page_size + 1)
    ids = page_list(pool.num_pages, gen_seed=5)
    plan = plan_mod.make_plan(pool.k, pool.v, torch.tensor(ids), page_size, layout)
    assert torch_copy.use_page_copies(plan)
    expected = oracle_gather(pool, ids, layout)
    buf = kk.gather_pages(pool.k, pool.v, torch.tensor(ids), page_size, layout=layout)
    assert bits_equal(buf, expected)
    dst = zeros_like_pool(pool)
    kk.scatter_pages(buf, dst.k, dst.v, torch.tensor(ids), page_size, layout=layout)
    assert bits_equal(oracle_gather(dst, ids, layout), expected)
    others = [p for p in range(pool.num_pages) if p not in ids]
    assert not oracle_gather(dst, others, layout).view(torch.uint8).any()


def test_page_copy_strategy_is_picked_by_page_bytes():
    """Llama-8B pages (8 heads x 128, bf16): 32 KiB per tensor at ps 16 take the per-page path, 2 KiB at ps 1 not."""
    for page_size, expected in ((16, True), (2, True), (1, False)):
        pool = make_pool("fused", torch.bfloat16, page_size, num_layers=1, num_heads=8, head_dim=128, num_pages=4)
        plan = plan_mod.make_plan(pool.k, pool.v, torch.tensor([1, 2]), page_size, "NHD")
        assert torch_copy.use_page_copies(plan) == expected, page_size


def test_gather_allows_repeats_and_fills_given_out():
    pool = make_pool("separate", torch.float16, 4)
    ids = [3, 3, 5]
    out = torch.full((2, 3, 2, 4, 2, 8), 7.0, dtype=torch.float16)
    res = kk.gather_pages(pool.k, pool.v, torch.tensor(ids), 4, out=out)
    assert res is out and bits_equal(out, oracle_gather(pool, ids, "NHD"))


def test_empty_page_list():
    pool = make_pool("separate", torch.float16, 4)
    buf = kk.gather_pages(pool.k, pool.v, torch.empty(0, dtype=torch.int64), 4)
    assert buf.shape == (2, 0, 2, 4, 2, 8)
    kk.scatter_pages(buf, pool.k, pool.v, torch.empty(0, dtype=torch.int64), 4)


def test_runs_are_coalesced():
    starts, buf_starts, lens = plan_mod.compute_runs(torch.tensor([4, 5, 6, 9, 3, 4, 8, 7]))
    assert starts.tolist() == [4, 9, 3, 8, 7]
    assert buf_starts.tolist() == [0, 3, 4, 6, 7]
    assert lens.tolist() == [3, 1, 2, 1, 1]


# ---------------------------------------------------------------- validation (nothing written on error)


@pytest.mark.parametrize("bad", [0, 12, -1, 99])
def test_out_of_range_page_ids_raise_index_error(bad):
    pool = make_pool("fused", torch.bfloat16, 4)  # 12 pages: valid ids 1..11
    with pytest.raises(IndexError, match=f"page id {bad} at position 2"):
        kk.gather_pages(pool.k, pool.v, torch.tensor([1, 2, bad]), 4)
    buf = kk.gather_pages(pool.k, pool.v, torch.tensor([1, 2, 3]), 4)
    before = [t.clone() for t in pool.tensors]
    with pytest.raises(IndexError, match=f"page id {bad}"):
        kk.scatter_pages(torch.zeros_like(buf), pool.k, pool.v, torch.tensor([1, 2, bad]), 4)
    assert all(bits_equal(a, b) for a, b in zip(before, pool.tensors))


def test_scatter_rejects_repeated_ids_without_writing():
    pool = make_pool("separate", torch.float32, 4)
    buf = kk.gather_pages(pool.k, pool.v, torch.tensor([1, 2, 3]), 4)
    before = [t.clone() for t in pool.tensors]
    with pytest.raises(ValueError, match="page id 5 appears more than once"):
        kk.scatter_pages(torch.zeros_like(buf), pool.k, pool.v, torch.tensor([5, 6, 5]), 4)
    assert all(bits_equal(a, b) for a, b in zip(before, pool.tensors))


def test_shape_dtype_device_mismatches_raise_value_error():
    pool = make_pool("separate", torch.bfloat16, 4)
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="got 2 K buffers but 1 V buffers"):
        kk.gather_pages(pool.k, pool.v[:1], ids, 4)
    with pytest.raises(ValueError, match="pool tensor 3"):
        kk.gather_pages(pool.k, [pool.v[0], pool.v[1].float()], ids, 4)
    with pytest.raises(ValueError, match="expected \\(2, 2, 2, 4, 2, 8\\)"):
        kk.gather_pages(pool.k, pool.v, ids, 4, out=torch.empty(2, 2, 2, 2, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype torch.float16"):
        kk.scatter_pages(torch.empty(2, 2, 2, 4, 2, 8, dtype=torch.float16), pool.k, pool.v, ids, 4)
    with pytest.raises(ValueError, match="contiguous"):
        kk.scatter_pages(torch.empty(2, 2, 2, 4, 8, 2, dtype=torch.bfloat16).transpose(-1, -2),
                         pool.k, pool.v, ids, 4)
    with pytest.raises(ValueError, match="layout"):
        kk.gather_pages(pool.k, pool.v, ids, 4, layout="NDH")
    with pytest.raises(ValueError, match="int64"):
        kk.gather_pages(pool.k, pool.v, ids.float(), 4)
    with pytest.raises(ValueError, match="backend"):
        kk.gather_pages(pool.k, pool.v, ids, 4, backend="cuda")
    with pytest.raises(ValueError, match="CUDA pools only"):
        kk.gather_pages(pool.k, pool.v, ids, 4, wait_event=object())


# ---------------------------------------------------------------- slots_to_page_ids


def test_slots_to_page_ids():
    slots = torch.cat([torch.arange(48, 64), torch.arange(16, 32), torch.arange(160, 176)])
    assert kk.slots_to_page_ids(slots, 16).tolist() == [3, 1, 10]
    assert kk.slots_to_page_ids(torch.tensor([7, 3, 9], dtype=torch.int32), 1).tolist() == [7, 3, 9]


@pytest.mark.parametrize("slots,match", [
    ([8, 9, 10], "not a multiple of page_size=4"),
    ([9, 10, 11, 12], "slot 9 at position 0"),
    ([8, 9, 11, 10], "slot 11 at position 2"),
    ([8, 9, 10, 11, 4, 5, 6, 8], "slot 8 at position 7"),
])
def test_slots_to_page_ids_rejects_unaligned(slots, match):
    with pytest.raises(ValueError, match=match):
        kk.slots_to_page_ids(torch.tensor(slots), 4)


# ---------------------------------------------------------------- checksums


def _sum64_numpy(data: bytes) -> int:
    """Straight transcription of the sum64 definition with numpy uint64 (wrapping) arithmetic."""
    padded = data + b"\0" * (-len(data) % 8)
    w = np.frombuffer(padded, dtype="<u8")
    i = np.arange(w.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = w ^ (i * np.uint64(0x9E3779B97F4A7C15))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
        x = x * np.uint64(0x94D049BB133111EB)
    total = int(x.sum(dtype=np.uint64)) ^ len(data)
    mask = (1 << 64) - 1
    total ^= total >> 33
    total = (total * 0xFF51AFD7ED558CCD) & mask
    total ^= total >> 33
    total = (total * 0xC4CEB9FE1A85EC53) & mask
    return total ^ (total >> 33)


@pytest.mark.parametrize("nbytes", [0, 5, 8, 4096 + 3])
def test_sum64_matches_its_definition(nbytes):
    data = random_bits((nbytes,), torch.uint8, torch.Generator().manual_seed(nbytes))
    want = _sum64_numpy(bytes(data.numpy()))
    assert kk.payload_checksum(data, "sum64") == want
    assert kk.payload_checksum(bytes(data.numpy()), "sum64") == want
    assert kk.payload_checksum(memoryview(bytes(data.numpy())), "sum64") == want


def test_sum64_chunking_does_not_change_value(monkeypatch):
    from kvrep_kernels import checksum
    data = random_bits((1000,), torch.uint8, torch.Generator().manual_seed(1))
    whole = checksum.payload_checksum(data, "sum64")
    monkeypatch.setattr(checksum, "_CHUNK_WORDS", 7)
    assert checksum.payload_checksum(data, "sum64") == whole


def test_cpu_checksums_are_xxhash_of_the_raw_bytes():
    buf = random_bits((3, 5, 8), torch.bfloat16, torch.Generator().manual_seed(2))
    raw = bytes(buf.view(torch.uint8).numpy())
    assert kk.payload_checksum(buf) == xxhash.xxh3_64_intdigest(raw)  # the CPU default
    assert kk.payload_checksum(buf, "xxh64") == xxhash.xxh64(raw).intdigest()
    assert kk.payload_checksum(raw) == kk.payload_checksum(memoryview(raw)) == xxhash.xxh3_64_intdigest(raw)
    assert kk.payload_digest(buf) == kk.PayloadDigest("xxh3", xxhash.xxh3_64_intdigest(raw))


@pytest.mark.parametrize("kind", kk.CHECKSUM_KINDS)
def test_checksums_detect_a_flipped_bit_and_swapped_words(kind):
    buf = random_bits((4096,), torch.uint8, torch.Generator().manual_seed(3))
    digest = kk.PayloadDigest(kind, kk.payload_checksum(buf, kind))
    assert kk.verify_payload(buf.clone(), digest)
    flipped = buf.clone()
    flipped[1234] ^= 0x10
    assert not kk.verify_payload(flipped, digest)
    swapped = buf.clone().view(torch.int64)
    swapped[[3, 9]] = swapped[[9, 3]]
    assert not kk.verify_payload(swapped.view(torch.uint8), digest)
    assert not kk.verify_payload(buf[:-1], digest)


@pytest.mark.parametrize("kind", kk.CHECKSUM_KINDS)
def test_pieces_checksum_is_the_checksum_of_the_pieces_one_after_the_other(kind):
    # a chunk written in place: pages [2, 5) of each of 3 layers, strided in the staging buffer
    staging = random_bits((3, 7, 96), torch.uint8, torch.Generator().manual_seed(5))
    pieces = [staging[layer, 2:5] for layer in range(3)]
    assert kk.pieces_checksum(pieces, kind) == kk.payload_checksum(staging[:, 2:5].contiguous(), kind)
    assert kk.pieces_checksum(pieces[::-1], kind) != kk.payload_checksum(staging[:, 2:5].contiguous(), kind)
    assert kk.pieces_checksum([], kind) == kk.payload_checksum(b"", kind)
    with pytest.raises(ValueError, match="crc32"):
        kk.pieces_checksum(pieces, "crc32")


def test_checksum_rejects_bad_input():
    with pytest.raises(ValueError, match="crc32"):
        kk.payload_checksum(b"abc", "crc32")
    with pytest.raises(ValueError, match="contiguous"):
        kk.payload_checksum(torch.zeros(4, 4).t())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sum64_same_on_cuda_and_cpu():
    buf = random_bits((1 << 20,), torch.uint8, torch.Generator().manual_seed(4))
    assert kk.default_kind(buf.cuda()) == "sum64"
    assert kk.payload_checksum(buf.cuda()) == kk.payload_checksum(buf, "sum64")
    assert kk.payload_checksum(buf.cuda(), "xxh64") == kk.payload_checksum(buf, "xxh64")
    assert kk.payload_checksum(buf.cuda(), "xxh3") == kk.payload_checksum(buf)  # xxh3: the host's default


# ---------------------------------------------------------------- packaging


def test_kernels_folder_is_not_an_importable_package():
    root = pathlib.Path(kk.__file__).resolve().parents[2]
    assert (root / "kernels" / "kvrep_kernels" / "__init__.py").is_file()
    assert not (root / "kernels" / "__init__.py").exists()
    # A regular `kernels` package (HF's, which sglang imports) must not resolve to our folder.
    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin not in (None, "namespace"):
        assert pathlib.Path(spec.origin).resolve().parent != root / "kernels"
