import msgspec
import pytest

from radix_sync import protocol as p


def test_roundtrip_each_direction():
    hello = p.Hello(worker_id="w", http_url="http://x", data_endpoint="tcp://x:1", fingerprint="f",
                    fingerprint_fields={"page_size": "16"}, page_size=16, pool_capacity_tokens=100,
                    replica_budget_tokens=25)
    assert p.decode_for_coordinator(p.encode(hello)) == hello
    stored = p.PagesStored(worker_id="w", seq=3, namespace="t", blocks=[p.BlockFact(1, None, [1, 2]),
                                                                          p.BlockFact(2, 1, [3, 4])])
    assert p.decode_for_coordinator(p.encode(stored)) == stored
    cmd = p.ReplicatePages(replication_id="r", auth_token="t", token_ids=[1, 2], namespace="", target_id="b",
                           target_endpoint="tcp://b:1", target_fingerprint="f", ttl_s=5.0)
    assert p.decode_for_worker(p.encode(cmd)) == cmd
    chunk = p.TransferChunk(transfer_id="t", index=0, first_page=0, num_pages=1, num_bytes=8, checksum=1)
    assert p.decode_data_plane(p.encode(chunk)) == chunk


def test_messages_are_tagged_maps_not_pickle():
    raw = p.encode(p.Error(error="x"))
    assert msgspec.msgpack.decode(raw) == {"type": "Error", "error": "x", "in_reply_to": ""}


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"garbage", msgspec.msgpack.encode({"type": "Nope"}),
                                 msgspec.msgpack.encode({"type": "Hello", "worker_id": 3}),
                                 msgspec.msgpack.encode([1, 2, 3])])
def test_malformed_is_a_protocol_error(raw):
    with pytest.raises(p.ProtocolError):
        p.decode_for_coordinator(raw)


def test_direction_is_enforced():
    # a command is not a valid worker->coordinator message
    cmd = p.DropReplica(replication_id="r")
    with pytest.raises(p.ProtocolError):
        p.decode_for_coordinator(p.encode(cmd))


def test_describe_hides_long_lists():
    stored = p.PagesStored(worker_id="w", seq=1, namespace="", blocks=[p.BlockFact(i, None, []) for i in range(9)])
    assert "[9 items]" in stored.describe()
