"""A KV-event publisher SGLang instantiates for `--kv-events-config '{"publisher": "kvrep"}'` (set by the plugin).

SGLang's own recorder and SHA-256 page-hash chain produce the events; `publish()` runs on the scheduler thread at
SGLang's flush points and only converts each batch into our facts (`KvStored`, `KvRemoved`, `KvCleared`) and
appends them to `SINK`, which the worker agent's I/O thread drains. If the user had configured a publisher of their
own, every batch is forwarded to it (its config travels in `KvrepConfig.inner_kv_events`).
"""
from __future__ import annotations

import collections
import json
import logging
from typing import Any, Callable, Optional

from sglang_kvrep import compat
from sglang_kvrep.compat import KvCleared, KvEvent, KvRemoved, KvStored
from sglang_kvrep.config import KvrepConfig

__all__ = ["KvCleared", "KvEvent", "KvRemoved", "KvStored", "KvrepEventPublisher", "ON_PUBLISH", "SINK"]

log = logging.getLogger("kvrep.events")

SINK: "collections.deque[KvEvent]" = collections.deque()
# Called after a batch was appended to SINK (the worker agent sets it to wake its I/O thread, so the coordinator's
# directory learns new pages within milliseconds, not at the I/O thread's next poll timeout).
ON_PUBLISH: Optional[Callable[[], None]] = None


def inner_publisher_config(config_json: Optional[str]) -> Optional[dict]:
    """The user's own publisher config carried in the extension's config, or None."""
    if not config_json:
        return None
    inner = KvrepConfig.from_json(config_json).inner_kv_events
    return json.loads(inner) if inner else None


class KvrepEventPublisher(compat.event_publisher_base()):
    def __init__(self, attn_dp_rank: int = 0, **config: Any) -> None:
        self._inner = None
        cfg = inner_publisher_config(compat.process_config())
        if cfg:
            kind = cfg.pop("publisher")
            cfg.pop("format", None)
            params = {**config, **{k: v for k, v in cfg.items() if k in config}}
            self._inner = compat.create_event_publisher(kind, attn_dp_rank, **params)

    def publish(self, events) -> None:
        if self._inner is not None:
            self._inner.publish(events)
        added = False
        for event in compat.batch_events(events):
            fact = compat.read_kv_event(event)
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
