"""The SGLang plugin entry point (`sglang.srt.plugins` group): adds the flags, arranges what the extension needs
from SGLang (the `priority` eviction policy, KV events routed to our publisher) and starts a `WorkerAgent` in the
scheduler process.

Without `--enable-kv-replication` every hook returns straight away: no agent, no thread, no socket, and SGLang
behaves exactly as without the plugin. Nothing here may raise into SGLang's scheduler loop: agent errors are
logged and the agent disables itself, leaving a plain SGLang worker.
"""
from __future__ import annotations

import argparse
import json
import logging

from sglang_kvrep import compat
from sglang_kvrep.config import KvrepConfig, add_cli_args, from_namespace

log = logging.getLogger("kvrep.plugin")

_agent = None  # the WorkerAgent of this scheduler process, if any


class KvrepFlagConflict(SystemExit):
    """Raised at start-up when the user's flags cannot work together with --enable-kv-replication."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: --enable-kv-replication: {message}")


def register() -> None:
    compat.register_hook(compat.ADD_CLI_ARGS, _after_add_cli_args, "AFTER")
    compat.register_hook(compat.FROM_CLI_ARGS, _before_from_cli_args, "BEFORE")
    compat.register_hook(compat.FROM_CLI_ARGS, _after_from_cli_args, "AFTER")
    compat.register_hook(compat.SCHEDULER_INIT, _after_scheduler_init, "AFTER")
    compat.register_hook(compat.SCHEDULER_INGEST, _around_ingest, "AROUND")
    compat.register_hook(compat.CACHE_MATCH_PREFIX, _after_match_prefix, "AFTER")
    compat.register_hook(compat.CACHE_EVICT_FOR_ALLOC, _around_evict_for_alloc, "AROUND")
    for kind, target in compat.WEIGHT_UPDATE_HOOKS.items():
        compat.register_hook(target, _after_weight_update(kind), "AFTER")
    from sglang_kvrep.events import KvrepEventPublisher

    compat.register_event_publisher("kvrep", KvrepEventPublisher)


# ------------------------------------------------------------------------------------------- launcher side
def _after_add_cli_args(result, parser, *args, **kwargs):
    add_cli_args(parser)
    return result


def arrange_server_flags(ns: argparse.Namespace) -> KvrepConfig:
    """Check the user's flags and set what the extension needs. Mutates `ns`.

    Raises:
        KvrepFlagConflict: a flag the user set explicitly conflicts with replication.
        ValueError: a bad --kvrep-* value.
    """
    flags = compat.read_launch_flags(ns)
    if flags.disable_radix_cache:
        raise KvrepFlagConflict("--disable-radix-cache leaves nothing to replicate")
    if flags.enable_priority_scheduling:
        raise KvrepFlagConflict("--enable-priority-scheduling gives requests priorities below the replicas' "
                                "eviction priority; run without it")
    for flag, size in (("--tp-size", flags.tp_size), ("--pp-size", flags.pp_size), ("--dp-size", flags.dp_size)):
        if size > 1:
            raise KvrepFlagConflict(f"{flag} > 1 is not supported yet (replica inserts must be mirrored per rank)")
    policy = flags.radix_eviction_policy
    if policy != "priority":
        if flags.radix_eviction_policy_explicit:
            raise KvrepFlagConflict(f"--radix-eviction-policy {policy} cannot evict replicas first; use priority "
                                    "(or leave the flag out and the extension sets it)")
        compat.set_launch_flags(ns, radix_eviction_policy="priority")
    user_events = flags.kv_events_config
    events = {"publisher": "kvrep"}
    inner = ""
    if user_events:
        try:
            cfg = json.loads(user_events)
        except json.JSONDecodeError as exc:
            raise KvrepFlagConflict(f"--kv-events-config is not JSON: {exc}") from None
        if cfg.get("format", "default") != "default":
            raise KvrepFlagConflict("--kv-events-config format must be 'default' (the directory uses SGLang's "
                                    "default page hashes)")
        if cfg.get("publisher", "null") not in ("null", "kvrep"):
            # Keep the user's publisher: ours forwards every batch to it (its config travels in ours).
            inner = json.dumps(cfg)
        events = {**cfg, "publisher": "kvrep"}
    compat.set_launch_flags(ns, kv_events_config=json.dumps(events))
    return from_namespace(ns, host=flags.host, port=flags.port, inner_kv_events=inner)


def _before_from_cli_args(*args, **kwargs):
    ns = compat.launch_namespace(args)
    if ns is not None and compat.replication_enabled(ns):
        try:
            compat.check_sglang_version()
        except RuntimeError as exc:
            raise KvrepFlagConflict(str(exc)) from None
        try:
            compat.attach_config(ns, arrange_server_flags(ns).to_json())
        except ValueError as exc:
            raise KvrepFlagConflict(str(exc)) from None
    return None


def _after_from_cli_args(server_args, *args, **kwargs):
    ns = compat.launch_namespace(args)
    text = compat.attached_config(ns) if ns is not None else None
    if text:
        compat.attach_config(server_args, text)
    return server_args


# ------------------------------------------------------------------------------------------ scheduler side
def _after_scheduler_init(result, scheduler, *args, **kwargs):
    global _agent
    text = compat.scheduler_config(scheduler)
    if not text or _agent is not None:
        return result
    try:
        if not compat.is_publisher_rank():
            return result
        from sglang_kvrep.agent import start_agent

        _agent = start_agent(compat.SchedulerView(scheduler), KvrepConfig.from_json(text))
    except Exception:
        log.exception("kvrep: could not start the worker agent; serving as plain SGLang")
        _agent = None
    return result


def _around_ingest(original, scheduler, *args, **kwargs):
    result = original(scheduler, *args, **kwargs)
    agent = _agent
    if agent is not None and agent.view.is_of(scheduler):
        agent.on_iteration_safe()
    return result


def _after_match_prefix(result, cache, params, *args, **kwargs):
    agent = _agent
    if agent is not None:
        agent.on_request_match_safe(params, result)
    return result


def _around_evict_for_alloc(original, cache, params, *args, **kwargs):
    """Demoted chains go first: what they free is taken off the tokens SGLang's own eviction then looks for (its
    availability target, or its reclaim quota when the allocator passes a predicate, which also stops ours), and
    added to what the call reports as evicted."""
    agent = _agent
    freed = 0
    if agent is not None and agent.demoted and agent.view.owns_cache(cache):
        want = compat.evict_request_tokens(params)
        if want > 0:
            freed = agent.evict_demoted_safe(want, compat.reclaim_predicate(kwargs))
            if freed > 0:
                params = compat.with_evict_tokens(params, max(0, want - freed))
    result = original(cache, params, *args, **kwargs)
    if freed > 0:
        compat.add_evicted_tokens(result, freed)
    return result


def _after_weight_update(kind: str):
    """The hook after SGLang's `update_weights_from_<kind>` (scheduler thread): the agent of that scheduler takes
    a new fingerprint and says hello with it."""

    def hook(result, manager, recv_req=None, *args, **kwargs):
        agent = _agent
        if agent is not None:
            update = compat.finished_weight_update(kind, result, manager, recv_req)
            if update.scheduler is None or agent.view.is_of(update.scheduler):
                agent.on_weights_updated_safe(update)
        return result

    hook.__name__ = f"_after_update_weights_from_{kind}"
    return hook
