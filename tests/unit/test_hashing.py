import hashlib
import struct

import pytest

from radix_sync.hashing import digest_to_int64, page_digests, page_hashes


def test_chain_by_hand():
    toks = list(range(100, 132))
    d0 = hashlib.sha256(struct.pack("<16I", *toks[:16])).digest()
    d1 = hashlib.sha256(d0 + struct.pack("<16I", *toks[16:])).digest()
    assert page_digests(toks, 16) == [d0, d1]
    assert page_hashes(toks, 16) == [digest_to_int64(d0), digest_to_int64(d1)]
    assert page_hashes(toks[:31], 16) == [digest_to_int64(d0)]  # partial pages are not hashed


def test_namespace_changes_every_hash():
    toks = list(range(64))
    assert set(page_hashes(toks, 16, "a")).isdisjoint(page_hashes(toks, 16, "b"))
    assert set(page_hashes(toks, 16, "a")).isdisjoint(page_hashes(toks, 16))


def test_matches_sglang_native_hash():
    utils = pytest.importorskip("sglang.srt.mem_cache.utils")
    toks = list(range(7, 7 + 48))
    native = utils.get_hash_str(toks, None, page_size=16)
    assert [bytes.fromhex(h) for h in native] == page_digests(toks, 16)
    assert page_hashes(toks, 16) == [utils.hash_str_to_int64(h) for h in native]
    salt_seed = hashlib.sha256(b"sglang-cache-salt-v1\0" + b"tenant").hexdigest()
    salted = utils.get_hash_str(toks, salt_seed, page_size=16)
    assert page_hashes(toks, 16, "tenant") == [utils.hash_str_to_int64(h) for h in salted]


def test_bad_input():
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        page_hashes([2**32], 1)
