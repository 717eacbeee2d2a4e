"""A KV-event publisher SGLang instantiates for `--kv-events-config '{"publisher": "kvrep"}'` (set by the plugin).

SGLang's own recorder and SHA-256 page-hash chain produce the events; `publish()` runs on the scheduler thread at
SGLang's flush points and only converts each batch into our facts and appends them to `SINK`, which the worker
agent's I/O thread drains. If the user had configured a publisher of their own, every batch is forwarded to it.
"""
from __future__ import annotations

import collections
import json
import logging
import os
from typing import Any, Callable, Optional

from sglang_kvrep import compat

log = logging.getLogger("kvrep.events")

# ("stored", namespace, [(hash, parent, tokens), ...], medium) | ("removed", [hashes]) | ("cleared",)
SINK: "collections.deque[tuple]" = collections.deque()
# Called after a batch was appended to SINK (the worker agent sets it to wake its I/O thread, so the coordinator's
# directory learns new pages within milliseconds, not at the I/O thread's next poll timeout).
ON_PUBLISH: Optional[Callable[[], None]] = None


def convert(event: Any) -> Optional[tuple]:
    kind = compat.event_kind(event)
    if kind == "stored":
        hashes = list(event.block_hashes)
        tokens = list(event.token_ids)
        per_page = len(tokens) // max(1, len(hashes))
        blocks, parent = [], event.parent_block_hash
        for i, h in enumerate(hashes):
            blocks.append((h, parent, tokens[i * per_page:(i + 1) * per_page]))
            parent = h
        medium = str(getattr(event.medium, "value", event.medium) or "GPU")
        return ("stored", event.cache_salt or "", blocks, medium)
    if kind == "removed":
        medium = str(getattr(event.medium, "value", event.medium) or "GPU")
        return ("removed", list(event.block_hashes), medium)
    if kind == "cleared":
        return ("cleared",)
    return None


class KvrepEventPublisher(compat.event_publisher_base()):
    def __init__(self, attn_dp_rank: int = 0, **config: Any) -> None:
        self._inner = None
        inner = os.environ.get("KVREP_INNER_KV_EVENTS")
        if inner:
            cfg = json.loads(inner)
            kind = cfg.pop("publisher")
            cfg.pop("format", None)
            params = {**config, **{k: v for k, v in cfg.items() if k in config}}
            self._inner = compat.create_event_publisher(kind, attn_dp_rank, **params)

    def publish(self, events) -> None:
        if self._inner is not None:
            self._inner.publish(events)
        added = False
        for event in events.events:
            fact = convert(event)
            if fact is not None:
                SINK.append(fact)
                added = True
        if added and ON_PUBLISH is not None:
            ON_PUBLISH()

    def shutdown(self) -> None:
        if self._inner is not None:
            self._inner.shutdown()

    def describe_local_source(self, block_size: int):
        return self._inner.describe_local_source(block_size) if self._inner is not None else None
