"""The target-side checks and staging of the data plane, without sockets."""
import pytest
import torch

from radix_sync import protocol as p
from sglang_kvrep.dataplane.checks import LocalGeometry, check_header
from sglang_kvrep.dataplane.staging import Incoming, StagingPool
from sglang_kvrep.dataplane.wire import TokenBucket, chunk_frames, split_pages

GEO = LocalGeometry("fp", 4, "torch.bfloat16", "NHD", (2, 4, 2, 8), num_layers=3, itemsize=2)


def header(**kw):
    num_pages = kw.pop("num_pages", 2)
    nbytes = GEO.num_bytes(num_pages)
    fields = dict(transfer_id="t", replication_id="r", auth_token="x", source_id="s", fingerprint="fp",
                  namespace="", token_ids=list(range(num_pages * 4)), page_size=4, num_pages=num_pages,
                  dtype="torch.bfloat16", layout="NHD", buffer_shape=GEO.buffer_shape(num_pages), num_bytes=nbytes,
                  pages_per_chunk=1, num_chunks=num_pages, checksum_kind="xxh64", ttl_s=5.0)
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
    (dict(num_chunks=3), "bad chunking"),
    (dict(pages_per_chunk=0), "bad chunking"),
    (dict(ttl_s=0.0), "bad ttl"),
    (dict(checksum_kind="md5"), "unknown checksum kind"),
])
def test_each_bad_field_is_named(kw, needle):
    assert needle in check_header(header(**kw), GEO, free_replica_tokens=100)


def test_budget_is_checked_before_buffering():
    assert "budget" in check_header(header(), GEO, free_replica_tokens=7)


def test_incoming_assembles_pages_of_every_layer_and_verifies_each_chunk():
    h = header(num_pages=3, pages_per_chunk=2, num_chunks=2)
    whole = torch.arange(h.num_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    chunks = [split_pages(h, whole.numpy().tobytes(), i) for i in range(2)]
    # chunk 0 holds pages 0-1 of every layer, chunk 1 page 2: (layers, pages, page bytes)
    assert chunks[0].shape[:2] == (3, 2) and chunks[1].shape[:2] == (3, 1)
    inc = Incoming(h, b"peer", torch.empty(h.num_bytes + 100, dtype=torch.uint8), 0.0, 0.0)
    meta1, pay1 = chunk_frames(h, 1, chunks[1])
    meta0, pay0 = chunk_frames(h, 0, chunks[0])
    assert inc.finish().startswith("incomplete")
    assert inc.add_chunk(p.decode_data_plane(meta1), pay1, 1.0) is None  # any order
    assert "repeated" in inc.add_chunk(p.decode_data_plane(meta1), pay1, 1.0)
    bad = p.decode_data_plane(meta0)
    bad.checksum ^= 1
    assert "checksum mismatch in chunk 0" in inc.add_chunk(bad, pay0, 1.0)
    short = p.decode_data_plane(meta0)
    assert "malformed" in inc.add_chunk(short, memoryview(bytes(pay0)[:-1]), 1.0)
    assert inc.add_chunk(p.decode_data_plane(meta0), pay0, 2.0) is None
    assert inc.finish() is None and inc.last_progress_s == 2.0
    assert torch.equal(inc.buffer, whole)  # the staged buffer is the whole payload in the buffer layout


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
