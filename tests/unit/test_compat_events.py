"""SGLang's KV events, read through the compatibility package into our facts, and what our publisher does with a
batch: every fact to the sink the agent's I/O thread drains, the I/O thread rung once."""
import pytest
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from sglang_kvrep import compat, events


def test_events_become_typed_facts():
    stored = BlockStored(block_hashes=[11, 12], parent_block_hash=10, token_ids=list(range(8)), block_size=4,
                         lora_id=None, medium="GPU", cache_salt="tenant")
    assert compat.read_kv_event(stored) == compat.KvStored("tenant", [(11, 10, [0, 1, 2, 3]), (12, 11, [4, 5, 6, 7])],
                                                           "GPU")
    bare = BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None)
    assert compat.read_kv_event(bare) == compat.KvStored("", [(5, None, [1, 2])], "GPU")  # no medium: the GPU
    assert compat.read_kv_event(BlockRemoved(block_hashes=[11], medium="CPU")) == compat.KvRemoved([11], "CPU")
    assert compat.read_kv_event(AllBlocksCleared()) == compat.KvCleared()
    assert compat.read_kv_event(object()) is None


def test_the_publisher_fills_the_sink_and_rings_once_per_batch(monkeypatch):
    monkeypatch.setattr(compat, "process_config", lambda: None)
    rings = []
    monkeypatch.setattr(events, "ON_PUBLISH", lambda: rings.append(1))
    monkeypatch.setattr(events, "SINK", type(events.SINK)())
    pub = events.KvrepEventPublisher(attn_dp_rank=0)
    pub.publish(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[1]), AllBlocksCleared()]))
    assert list(events.SINK) == [compat.KvRemoved([1], "GPU"), compat.KvCleared()] and rings == [1]
    pub.publish(KVEventBatch(ts=0.0, events=[]))
    assert rings == [1]  # nothing new: no wake-up


@pytest.mark.parametrize("found", ["0.5.22", "0.6.0", "unknown"])
def test_version_check_names_both_versions(found):
    with pytest.raises(RuntimeError, match=rf"supports sglang 0\.5\.23 only, but sglang {found} is installed"):
        compat.check_sglang_version(found)
    compat.check_sglang_version("0.5.23")
