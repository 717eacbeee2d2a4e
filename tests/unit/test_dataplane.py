"""The target-side checks and staging of the data plane, without sockets."""
import pytest
import torch
import xxhash

from radix_sync import protocol as p
from sglang_kvrep.dataplane import Incoming, LocalGeometry, StagingPool, TokenBucket, check_header

GEO = LocalGeometry("fp", 4, "torch.bfloat16", "NHD", (2, 4, 2, 8), num_layers=3, itemsize=2)


def header(**kw):
    num_pages = kw.pop("num_pages", 2)
    nbytes = GEO.num_bytes(num_pages)
    fields = dict(transfer_id="t", replication_id="r", auth_token="x", source_id="s", fingerprint="fp",
                  namespace="", token_ids=list(range(num_pages * 4)), page_size=4, num_pages=num_pages,
                  dtype="torch.bfloat16", layout="NHD", buffer_shape=GEO.buffer_shape(num_pages), num_bytes=nbytes,
                  num_chunks=2, checksum=0, checksum_kind="xxh64", ttl_s=5.0)
    fields.update(kw)
    return p.TransferHeader(**fields)


def test_good_header_passes():
    assert check_header(header(), GEO, free_replica_tokens=100) is None
    assert GEO.num_bytes(2) == 3 * 2 * 2 * 4 * 2 * 8 * 2


@pytest.mark.parametrize("kw,needle", [
    (dict(fingerprint="other"), "fingerprint mismatch"),
    (dict(page_size=8), "page size mismatch"),
    (dict(dtype="torch.float16"), "dtype/layout mismatch"),
    (dict(token_ids=[1, 2, 3]), "do not fill"),
    (dict(buffer_shape=[3, 2, 2, 4, 2, 4]), "buffer shape"),
    (dict(num_bytes=10), "payload size"),
    (dict(num_chunks=0), "chunk count"),
    (dict(ttl_s=0.0), "bad ttl"),
])
def test_each_bad_field_is_named(kw, needle):
    assert needle in check_header(header(**kw), GEO, free_replica_tokens=100)


def test_budget_is_checked_before_buffering():
    assert "budget" in check_header(header(), GEO, free_replica_tokens=7)


def test_incoming_assembles_verifies_and_rejects():
    payload = bytes(range(256)) * (GEO.num_bytes(2) // 256)
    h = header(checksum=xxhash.xxh64_intdigest(payload))
    half = len(payload) // 2
    inc = Incoming(h, b"peer", torch.empty(len(payload) + 100, dtype=torch.uint8), 0.0, 0.0)
    assert inc.finish().startswith("incomplete")
    assert inc.add_chunk(p.TransferChunk("t", 1, half, half), memoryview(payload[half:]), 1.0) is None
    assert "repeated" in inc.add_chunk(p.TransferChunk("t", 1, half, half), memoryview(payload[half:]), 1.0)
    assert "out of bounds" in inc.add_chunk(p.TransferChunk("t", 0, half + 1, half), memoryview(payload[:half]), 1)
    assert inc.add_chunk(p.TransferChunk("t", 0, 0, half), memoryview(payload[:half]), 2.0) is None
    assert inc.finish() is None and bytes(inc.buffer.numpy()) == payload and inc.last_progress_s == 2.0
    inc.storage[5] ^= 1
    assert "checksum mismatch" in inc.finish()


def test_staging_pool_reuses_best_fit_and_is_bounded():
    pool = StagingPool(max_bytes=1000)
    a, b = pool.acquire(600), pool.acquire(300)
    pool.release(a)
    pool.release(b)
    assert pool.cached_bytes() == 900
    assert pool.acquire(200) is b and pool.acquire(500) is a
    pool.release(pool.acquire(2000))  # bigger than the cap: not kept
    assert pool.cached_bytes() == 0
    pool.release(torch.empty(700, dtype=torch.uint8))
    pool.release(torch.empty(600, dtype=torch.uint8))  # 1300 > 1000: the smallest goes
    assert pool.cached_bytes() == 700


def test_token_bucket():
    bucket = TokenBucket(rate_bytes_s=100.0, burst_bytes=50)
    t = bucket.t
    assert bucket.wait_s(50, t) == 0.0
    assert bucket.wait_s(50, t) == pytest.approx(0.5)
    assert bucket.wait_s(50, t + 0.5) == 0.0
    assert TokenBucket(0.0, 10).wait_s(10**9, t) == 0.0
