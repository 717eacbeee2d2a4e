"""The one door to SGLang internals (sglang==0.5.23, checked by `check_sglang_version` when replication is
enabled): every SGLang import, attribute and signature the plugin relies on lives in this package, so a version
bump is a change to it and its tests only. Here: hook targets and what the hooks' arguments mean, the launcher's
flags, the extension's config on `ServerArgs`, KV events; the live scheduler's handles are `SchedulerView`
(`sglang_kvrep.compat.scheduler`).

Everything here that touches the tree cache or the allocator must be called on the scheduler thread.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from sglang_kvrep.compat.scheduler import SchedulerView
from sglang_kvrep.compat.serving import (WEIGHT_UPDATE_HOOKS, WeightUpdate, finished_weight_update,
                                         kv_serving_flags, lora_adapters)
from sglang_kvrep.compat.version import SUPPORTED_SGLANG, check_sglang_version, sglang_version

__all__ = ["SUPPORTED_SGLANG", "SchedulerView", "WEIGHT_UPDATE_HOOKS", "WeightUpdate", "check_sglang_version",
           "finished_weight_update", "kv_serving_flags", "lora_adapters", "sglang_version"]

# Hook targets (dotted paths resolved by SGLang's HookRegistry in every process that loads plugins).
ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"
SCHEDULER_INGEST = "sglang.srt.managers.scheduler.Scheduler.ingest_requests"
CACHE_MATCH_PREFIX = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.match_prefix"
CACHE_EVICT_FOR_ALLOC = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evict_for_alloc"
"""Every allocation-driven eviction (a prefill's or a decode step's slots, a replica's install) goes through it;
`evict` (the agent's own replica expiry) does not."""

CONFIG_ATTR = "_kvrep_config"
"""The attribute that carries the extension's config (JSON): on the launcher's namespace from the BEFORE hook of
`from_cli_args` to its AFTER hook, then on the `ServerArgs` built from it, which reaches the scheduler process
whole (`from_cli_args` copies only `ServerArgs`'s own fields from the namespace, hence the AFTER hook)."""


def register_hook(target: str, fn: Callable, kind: str) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, fn, getattr(HookType, kind))


# ------------------------------------------------------------------------------------------ launcher side
def launch_namespace(hook_args: tuple) -> Optional[argparse.Namespace]:
    """The launcher's parsed flags among the positional arguments of a `from_cli_args` hook, or None."""
    return next((a for a in hook_args if isinstance(a, argparse.Namespace)), None)


def replication_enabled(ns: argparse.Namespace) -> bool:
    """Whether the launch asked for replication (`--enable-kv-replication`, added by `sglang_kvrep.config`)."""
    return bool(getattr(ns, "enable_kv_replication", False))


@dataclass(frozen=True)
class LaunchFlags:
    """What the extension reads of SGLang's own launch flags (`sglang.launch_server`'s parsed namespace)."""

    host: str
    port: int
    disable_radix_cache: bool
    enable_priority_scheduling: bool
    tp_size: int
    pp_size: int
    dp_size: int
    radix_eviction_policy: str
    radix_eviction_policy_explicit: bool
    """The user gave `--radix-eviction-policy` (SGLang records it)."""
    kv_events_config: Optional[str]


def read_launch_flags(ns: argparse.Namespace) -> LaunchFlags:
    return LaunchFlags(
        host=getattr(ns, "host", "127.0.0.1") or "127.0.0.1",
        port=getattr(ns, "port", 30000),
        disable_radix_cache=bool(getattr(ns, "disable_radix_cache", False)),
        enable_priority_scheduling=bool(getattr(ns, "enable_priority_scheduling", False)),
        tp_size=getattr(ns, "tp_size", 1) or 1,
        pp_size=getattr(ns, "pp_size", 1) or 1,
        dp_size=getattr(ns, "dp_size", 1) or 1,
        radix_eviction_policy=getattr(ns, "radix_eviction_policy", "lru"),
        radix_eviction_policy_explicit=bool(getattr(ns, "_radix_eviction_policy_explicitly_set", False)),
        kv_events_config=getattr(ns, "kv_events_config", None),
    )


def set_launch_flags(ns: argparse.Namespace, *, radix_eviction_policy: Optional[str] = None,
                     kv_events_config: Optional[str] = None) -> None:
    """Set SGLang launch flags the extension needs (before SGLang builds its `ServerArgs` from `ns`)."""
    if radix_eviction_policy is not None:
        ns.radix_eviction_policy = radix_eviction_policy
    if kv_events_config is not None:
        ns.kv_events_config = kv_events_config


def attach_config(launch: Any, text: str) -> None:
    """Put the extension's config (JSON) on the launcher's namespace or on `ServerArgs` (`CONFIG_ATTR`)."""
    setattr(launch, CONFIG_ATTR, text)


def attached_config(launch: Any) -> Optional[str]:
    """The extension's config attached to the launcher's namespace or to `ServerArgs`, or None (replication is
    off)."""
    return getattr(launch, CONFIG_ATTR, None)


def scheduler_config(scheduler: Any) -> Optional[str]:
    """The extension's config in a scheduler's `ServerArgs`, or None."""
    return attached_config(scheduler.server_args)


def process_config() -> Optional[str]:
    """The extension's config in this process's published `ServerArgs` (SGLang publishes them in the scheduler
    process before it builds the scheduler), or None."""
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except Exception:  # nothing published in this process
        return None
    return attached_config(server_args) if server_args is not None else None


# ------------------------------------------------------------------------------------ hooks' arguments
@dataclass(frozen=True)
class RequestMatch:
    """A request's prompt matched against the tree (`match_prefix`'s params and result)."""

    rid: Optional[str]
    namespace: str
    token_ids: Any
    """The request's whole key (a sequence of token ids, not copied)."""
    matched_len: int
    """Tokens matched on the device."""
    key_len: int
    kv_hints: Any = None
    """The request's `kv_hints` envelope as JSON values (SGLang decoded and shape-checked it: `Req.kv_hints`,
    `sglang/srt/managers/kv_hints.py`), or None."""


def matched_request(params: Any, result: Any) -> Optional[RequestMatch]:
    """What a `match_prefix` call matched for a request, or None when the call was not for a request."""
    req = getattr(params, "req", None)
    if req is None:
        return None
    key = params.key
    hints = getattr(req, "kv_hints", None)
    if hints is not None and not isinstance(hints, (dict, list)):
        import msgspec

        hints = msgspec.to_builtins(hints)  # SGLang's KvHintsEnvelope struct
    return RequestMatch(rid=getattr(req, "rid", None), namespace=key.cache_salt or "", token_ids=key.token_ids,
                        matched_len=int(result.device_prefix_len), key_len=len(key.token_ids), kv_hints=hints)


def evict_request_tokens(params: Any) -> int:
    """Tokens an `evict_for_alloc` call asks for (full-attention component)."""
    return int(getattr(params, "num_tokens", 0) or 0)


def with_evict_tokens(params: Any, num_tokens: int) -> Any:
    """`evict_for_alloc` params asking for `num_tokens` instead."""
    return dataclasses.replace(params, num_tokens=num_tokens)


def reclaim_predicate(kwargs: dict) -> Optional[Callable[[], bool]]:
    """The allocator's "reclaimed enough" predicate passed to `evict_for_alloc`, if any."""
    return kwargs.get("allocation_reclaim_satisfied")


def add_evicted_tokens(result: Any, num_tokens: int) -> None:
    """Count `num_tokens` more as evicted in an `evict_for_alloc` result."""
    if hasattr(result, "num_tokens_evicted"):
        result.num_tokens_evicted += num_tokens


def is_publisher_rank() -> bool:
    """True on the rank that owns the tree's events and the extension (pp 0, attn-tp 0, attn-cp 0)."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    return par.pp_rank == 0 and par.attn_tp_rank == 0 and par.attn_cp_rank == 0


# ------------------------------------------------------------------------------------------------ KV events
@dataclass(frozen=True)
class KvStored:
    """Pages cached: (page hash, parent hash, the page's token ids) per page, parents first."""

    namespace: str
    blocks: list[tuple[int, Optional[int], list[int]]]
    medium: str


@dataclass(frozen=True)
class KvRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(frozen=True)
class KvCleared:
    pass


KvEvent = Union[KvStored, KvRemoved, KvCleared]


def read_kv_event(event: Any) -> Optional[KvEvent]:
    """SGLang's KV event struct as our fact (None for kinds we do not use)."""
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    if isinstance(event, BlockStored):
        hashes = list(event.block_hashes)
        tokens = list(event.token_ids)
        per_page = len(tokens) // max(1, len(hashes))
        blocks, parent = [], event.parent_block_hash
        for i, h in enumerate(hashes):
            blocks.append((h, parent, tokens[i * per_page:(i + 1) * per_page]))
            parent = h
        return KvStored(event.cache_salt or "", blocks, _medium(event))
    if isinstance(event, BlockRemoved):
        return KvRemoved(list(event.block_hashes), _medium(event))
    if isinstance(event, AllBlocksCleared):
        return KvCleared()
    return None


def _medium(event: Any) -> str:
    return str(getattr(event.medium, "value", event.medium) or "GPU")


def batch_events(batch: Any) -> list:
    """The events of a published `KVEventBatch`."""
    return batch.events


def register_event_publisher(name: str, ctor: Callable[..., Any]) -> None:
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory

    if name not in EventPublisherFactory._registry:
        EventPublisherFactory.register_publisher(name, ctor)


def event_publisher_base() -> type:
    from sglang.srt.disaggregation.kv_events import EventPublisher

    return EventPublisher


def create_event_publisher(kind: str, attn_dp_rank: int, **config: Any):
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory

    return EventPublisherFactory._registry[kind](attn_dp_rank=attn_dp_rank, **config)

