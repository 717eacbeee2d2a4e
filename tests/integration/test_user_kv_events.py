"""A user's own `--kv-events-config` ZMQ publisher keeps working with the plugin on: SGLang's own subscriber
protocol (multipart topic, 8-byte sequence, msgpack batch) receives the stored blocks of a prompt, and the
coordinator's directory learns the same pages from our publisher, which wraps the user's (`sglang_kvrep/events.py`).
"""
import json
import time

import msgspec
import pytest
import zmq

from kvrep_dev.cluster import free_port
from tests.integration.conftest import PAGE_SIZE, joined_worker, prompt, wait_until

pytestmark = pytest.mark.server


def _stored_tokens(payload: bytes) -> list[list[int]]:
    """Token ids of every BlockStored event in one batch, decoded the way a user's subscriber does: with SGLang's
    own `KVEventBatch` type."""
    from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch

    batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
    return [list(e.token_ids) for e in batch.events if isinstance(e, BlockStored)]


def test_users_zmq_publisher_receives_batches_and_directory_learns_pages(cluster):
    port = free_port()
    user_cfg = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True, "topic": "user-kv"}
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"user-kv")
    sub.setsockopt(zmq.RCVTIMEO, 500)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        with joined_worker(cluster, "E-user-events",
                           extra_args=("--max-running-requests", "2", "--kv-events-config", json.dumps(user_cfg))) as w:
            sub.connect(f"tcp://127.0.0.1:{port}")
            time.sleep(1.0)  # a SUB socket joins a PUB late: give the subscription time to reach the publisher
            ids = prompt(4242, 6 * PAGE_SIZE)
            w.generate(ids, max_new_tokens=2)

            received: list[list[int]] = []
            seqs: list[int] = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and sum(len(t) for t in received) < len(ids) - PAGE_SIZE:
                try:
                    topic, seq, payload = sub.recv_multipart()
                except zmq.Again:
                    continue
                assert topic == b"user-kv"
                seqs.append(int.from_bytes(seq, "big", signed=True))
                received += _stored_tokens(payload)
            stored = [t for block in received for t in block]
            assert seqs == sorted(seqs), seqs
            # the user's subscriber saw the prompt's pages, in order, as SGLang publishes them
            assert stored[:5 * PAGE_SIZE] == ids[:5 * PAGE_SIZE], (len(stored), stored[:20], ids[:20])

            # and our directory learnt the same pages from the same events
            wait_until(lambda: cluster.lookup(ids).get(w.worker_id, 0) >= 5 * PAGE_SIZE, 20,
                       what="the coordinator's directory holding the prompt's pages on the worker")
    finally:
        sub.close()
        ctx.term()
