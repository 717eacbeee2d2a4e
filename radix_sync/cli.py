"""The `kvrep` command line: `kvrep coordinator`, `kvrep router`, `kvrep keys`, `kvrep sim`, `kvrep demo`,
`kvrep bench`, `kvrep copy-demo`, `kvrep up`.

Subcommands import their modules lazily so `kvrep coordinator` never pays for torch or sglang imports; the
developer commands come from `kvrep_dev.cli` through the `kvrep.commands` entry points.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys


def _add_coordinator(sub) -> None:
    # every default comes from the config dataclasses (written once, there)
    from radix_sync.coordinator.server import POLICIES, CoordinatorConfig as C
    from radix_sync.coordinator.state import StateConfig as S
    from radix_sync.gc_pacing import PROCESS_THOROUGH_EVERY_S
    from radix_sync.policy.rules import RuleConfig as R

    p = sub.add_parser("coordinator", help="run the coordinator (directory, policy, admin API)")
    p.add_argument("--bind", default=C.bind, help="ZMQ endpoint for worker agents")
    p.add_argument("--admin-host", default=C.admin_host)
    p.add_argument("--admin-port", type=int, default=C.admin_port, help="JSON admin API port (0: any free port)")
    p.add_argument("--policy", default=C.policy, choices=list(POLICIES),
                   help="kvrep: the predictive planner; demote: its session tracking and demotion, no copies; "
                        "rules: the rule-based baseline; none: admin calls only")
    p.add_argument("--profile", default=C.profile, help="cost profile of the kvrep planner (name or JSON path)")
    p.add_argument("--mode", default=C.mode, choices=["active", "shadow"])
    p.add_argument("--tick-s", type=float, default=C.tick_s)
    p.add_argument("--worker-timeout-s", type=float, default=S.worker_timeout_s)
    p.add_argument("--replication-timeout-s", type=float, default=S.replication_timeout_s)
    p.add_argument("--admin-tokens", default=C.admin_tokens, metavar="PATH",
                   help='JSON {"read": ..., "write": ...} of the admin API\'s bearer tokens (default: '
                        '<state dir>/admin-tokens.json, created 0600 when absent)')
    p.add_argument("--state-dir", default=C.state_dir,
                   help="where the coordinator creates its files (default: $XDG_STATE_HOME/kvrep or ~/.local/state/kvrep)")
    p.add_argument("--max-prompt-tokens", type=int, default=S.max_prompt_tokens,
                   help="longest prompt an admin input may carry (longer: 400)")
    p.add_argument("--max-pages-per-worker", type=int, default=S.max_pages_per_worker)
    p.add_argument("--max-hint-ttl-s", type=float, default=S.max_hint_ttl_s, help="hints' TTLs are capped to it")
    p.add_argument("--hint-rate-per-s", type=float, default=S.hint_rate_per_s, help="hints per second per tenant")
    p.add_argument("--ledger-holdout", type=float, default=S.ledger_holdout,
                   help="fraction of the prefixes the planner decides on (and, separately, that routers ask to "
                        "pull) whose copies are held back, to measure whether copies pay; shown to cost, they "
                        "pause (GET /status `ledger`, `pull_ledger`; 0: off)")
    p.add_argument("--keys", default=C.keys, metavar="DIR",
                   help="key directory from `kvrep keys`: CurveZMQ on the workers' socket, only its workers' keys "
                        "admitted, each bound to its worker id (required to bind a non-loopback address)")
    p.add_argument("--insecure", action="store_true", default=C.insecure,
                   help="bind a non-loopback address without keys anyway (no authentication, no encryption)")
    p.add_argument("--plain-worker", action="append", default=[], metavar="SPEC",
                   help="a worker without the plugin, followed through SGLang's own KV events (repeatable): "
                        "id=W,url=http://H:P,events=tcp://H:5557,page_size=N[,replay=tcp://H:P][,topic=T]"
                        "[,capacity_tokens=N]; its SGLang runs with --kv-events-config "
                        "'{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}'")
    p.add_argument("--max-msg-bytes", type=int, default=C.max_msg_bytes,
                   help="largest frame a worker may send; a larger one disconnects it unread")
    p.add_argument("--gc-thorough-every-s", type=float, default=PROCESS_THOROUGH_EVERY_S, metavar="S",
                   help="pace Python's cycle collector: what lives after each plan tick is frozen (no full "
                        "collection walks the directory mid-tick or mid-lookup) and the whole heap is collected "
                        "once every S seconds (GET /status loop.gc; 0: Python's own schedule)")
    g = p.add_argument_group("rule-based policy (L, H, W, Q)")
    g.add_argument("--rule-min-prefix-len", type=int, default=R.min_prefix_len, help="L: tokens")
    g.add_argument("--rule-min-hits", type=int, default=R.min_hits, help="H: hits within the window")
    g.add_argument("--rule-window-s", type=float, default=R.window_s, help="W: seconds")
    g.add_argument("--rule-max-queue", type=int, default=R.max_queue, help="Q: holder's waiting requests must exceed it")
    g.add_argument("--rule-ttl-s", type=float, default=R.ttl_s, help="TTL of replicas the rule makes")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_run_coordinator)


def _run_coordinator(args) -> int:
    from radix_sync.policy.rules import RuleConfig
    from radix_sync.coordinator.plain import PlainWorkerSpec
    from radix_sync.coordinator.server import Coordinator, CoordinatorConfig
    from radix_sync.coordinator.state import StateConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = CoordinatorConfig(
            bind=args.bind, admin_host=args.admin_host, admin_port=args.admin_port, policy=args.policy,
            profile=args.profile,
            mode=args.mode, tick_s=args.tick_s, keys=args.keys, insecure=args.insecure,
            max_msg_bytes=args.max_msg_bytes, gc_thorough_every_s=args.gc_thorough_every_s,
            rules=RuleConfig(args.rule_min_prefix_len, args.rule_min_hits, args.rule_window_s, args.rule_max_queue,
                             args.rule_ttl_s),
            state=StateConfig(worker_timeout_s=args.worker_timeout_s,
                              replication_timeout_s=args.replication_timeout_s,
                              max_prompt_tokens=args.max_prompt_tokens,
                              max_pages_per_worker=args.max_pages_per_worker, max_hint_ttl_s=args.max_hint_ttl_s,
                              hint_rate_per_s=args.hint_rate_per_s, ledger_holdout=args.ledger_holdout),
            admin_tokens=args.admin_tokens, state_dir=args.state_dir,
            plain_workers=tuple(PlainWorkerSpec.parse(s) for s in args.plain_worker))
        coord = Coordinator(config)
    except ValueError as exc:
        print(f"kvrep coordinator: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: coord.stop())
    signal.signal(signal.SIGINT, lambda *_: coord.stop())
    print(f"kvrep coordinator: workers -> {coord.endpoint}  admin -> http://{args.admin_host}:{coord.admin_port}",
          flush=True)
    coord.serve_forever()
    return 0


def _add_router(sub) -> None:
    # every default comes from the config dataclasses (written once, there)
    from radix_sync.policy.pull import PullConfig as P
    from radix_sync.router.config import RouterConfig as C
    from radix_sync.router.policy import RouterCosts as K

    p = sub.add_parser("router", help="run the cache-aware HTTP router in front of the workers")
    p.add_argument("--host", default=C.host)
    p.add_argument("--port", type=int, default=C.port, help="HTTP port (0: any free port)")
    p.add_argument("--coordinator", default=C.coordinator_url, help="coordinator admin URL, e.g. http://127.0.0.1:5680")
    p.add_argument("--worker", action="append", default=[], help="worker URL (repeatable; static workers)")
    p.add_argument("--tenants", default=C.tenants_path, help="JSON or TOML file: api keys -> tenant -> namespace")
    p.add_argument("--tokenizer", default="auto",
                   help="the workers' model dir or tokenizer id; 'auto': ask a worker's /model_info; 'none'")
    p.add_argument("--page-size", type=int, default=C.page_size, help="page size when no worker reported one")
    p.add_argument("--profile", default=C.profile,
                   help="cost profile for the TTFT rule (name or JSON path, e.g. cpu-local, llama3.1-8b-h200); "
                        "overrides the four cost flags below")
    p.add_argument("--prefill-s-per-token", type=float, default=K.prefill_s_per_token)
    p.add_argument("--queue-s-per-request", type=float, default=K.queue_s_per_request)
    p.add_argument("--kv-bytes-per-token", type=int, default=K.kv_bytes_per_token)
    p.add_argument("--link-gbps", type=float, default=K.link_bytes_per_s * 8 / 1e9, help="worker-to-worker copy bandwidth, Gbit/s")
    p.add_argument("--host-load-gbytes-s", type=float, default=C.host_load_bytes_per_s / 1e9, metavar="X",
                   help="the workers run SGLang's hierarchical cache: price a prefix in a worker's host-memory tier "
                        "as loaded back at X GB/s (default 0: not priced)")
    p.add_argument("--connect-timeout-s", type=float, default=C.connect_timeout_s)
    p.add_argument("--directory-feed", action=argparse.BooleanOptionalAction, default=C.directory_feed,
                   help="mirror the coordinator's directory from its change feed and match prompts locally "
                        "(--no-directory-feed: one lookup call to the coordinator per request)")
    p.add_argument("--pull", action=argparse.BooleanOptionalAction, default=C.pull,
                   help="copy a prompt's missing prefix from its best holder on the request's path when that gives "
                        "the lowest expected TTFT (the coordinator copies; the request waits, then falls back)")
    p.add_argument("--pull-min-wait-s", type=float, default=P.min_wait_s, help="shortest deadline of a pull, s")
    p.add_argument("--pull-max-wait-s", type=float, default=P.max_wait_s, help="longest deadline of a pull, s")
    p.add_argument("--pull-ttl-s", type=float, default=P.ttl_s, help="TTL of a pulled replica, s")
    p.add_argument("--speed-calibration", action=argparse.BooleanOptionalAction, default=C.speed_calibration,
                   help="scale the profile's prefill times by the workers' measured speed (the requests that ran "
                        "alone; --no-speed-calibration: the profile as it is)")
    p.add_argument("--peer-sends", action=argparse.BooleanOptionalAction, default=C.peer_sends,
                   help="relay this router's sends to the other routers of the same coordinator and count theirs as "
                        "its own (inert with one router; --no-peer-sends: learn them from the workers' next load "
                        "reports only, as before stop 57)")
    p.add_argument("--sent-pages", action=argparse.BooleanOptionalAction, default=C.sent_pages,
                   help="price a prefix this router's requests sent to a worker (not started) will compute there as "
                        "cached there (--no-sent-pages: the directory alone, as before stop 53)")
    p.add_argument("--tie-turns", action=argparse.BooleanOptionalAction, default=C.tie_turns,
                   help="workers take turns at prompts that tie on expected TTFT and load (--no-tie-turns: the "
                        "lowest id takes every tie, as before)")
    p.add_argument("--tie-draws", action=argparse.BooleanOptionalAction, default=C.tie_draws,
                   help="while other routers serve the same workers (the send relay's count), a tie on expected "
                        "TTFT goes to the less loaded of two tied workers this router draws at random "
                        "(--no-tie-draws: by load and turn, as alone)")
    p.add_argument("--read-timeout-s", type=float, default=C.read_timeout_s)
    p.add_argument("--max-connections-per-worker", type=int, default=C.max_connections_per_worker)
    p.add_argument("--worker-keepalive-s", type=float, default=C.worker_keepalive_s,
                   help="close an idle connection to a worker after this, s (below the workers' own keep-alive)")
    p.add_argument("--shutdown-timeout-s", type=float, default=C.shutdown_timeout_s)
    g = p.add_argument_group("credentials (files as `kvrep keys` writes them; the missing ones are created in "
                             "--state-dir, 0600)")
    g.add_argument("--state-dir", default=C.state_dir, help="where router-tokens.json / tenant-secret are created")
    g.add_argument("--admin-tokens", default=C.admin_tokens_path,
                   help="router-tokens.json: read/write bearer tokens of /kvrep/status, /metrics, /flush_cache, "
                        "/kvrep/hints (default: <state-dir>/router-tokens.json)")
    g.add_argument("--tenant-secret", default=C.tenant_secret_path,
                   help="hex file: namespaces are HMAC-SHA256(secret, tenant); the same file on every router "
                        "(default: <state-dir>/tenant-secret)")
    g.add_argument("--worker-api-key", default=C.worker_api_key_path,
                   help="hex file: the workers' SGLang --api-key, sent on every forwarded request")
    g.add_argument("--coordinator-tokens", default=C.coordinator_tokens_path,
                   help="the coordinator's admin-tokens.json (its write token is sent on every call)")
    g = p.add_argument_group("bounds")
    g.add_argument("--vocab-size", type=int, default=C.vocab_size,
                   help="token ids must be below it (default: the tokenizer's model vocabulary)")
    g.add_argument("--max-body-bytes", type=int, default=C.max_body_bytes)
    g.add_argument("--max-prompt-tokens", type=int, default=C.max_prompt_tokens)
    g.add_argument("--max-prompt-chars", type=int, default=C.max_prompt_chars)
    g.add_argument("--max-batch-prompts", type=int, default=C.max_batch_prompts)
    g.add_argument("--max-messages", type=int, default=C.max_messages)
    g.add_argument("--tokenize-threads", type=int, default=C.tokenize_threads)
    g.add_argument("--hints-per-s", type=float, default=C.hints_per_s, help="per-tenant hint rate")
    g.add_argument("--hints-burst", type=int, default=C.hints_burst, help="per-tenant hint burst")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_run_router)


def _run_router(args) -> int:
    import asyncio

    from radix_sync.policy.pull import PullConfig
    from radix_sync.router.config import RouterConfig
    from radix_sync.router.policy import RouterCosts
    from radix_sync.router.app import serve
    from radix_sync.router.tokenize import PromptTokenizer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        costs = RouterCosts(prefill_s_per_token=args.prefill_s_per_token, queue_s_per_request=args.queue_s_per_request,
                            kv_bytes_per_token=args.kv_bytes_per_token, link_bytes_per_s=args.link_gbps * 1e9 / 8)
        tokenizer = None if args.tokenizer in ("auto", "none") else args.tokenizer
        config = RouterConfig(host=args.host, port=args.port, coordinator_url=args.coordinator,
                              worker_urls=tuple(args.worker), tenants_path=args.tenants,
                              tokenizer=None if args.tokenizer == "none" else args.tokenizer,
                              page_size=args.page_size, costs=costs, profile=args.profile,
                              connect_timeout_s=args.connect_timeout_s,
                              read_timeout_s=args.read_timeout_s,
                              max_connections_per_worker=args.max_connections_per_worker,
                              worker_keepalive_s=args.worker_keepalive_s,
                              shutdown_timeout_s=args.shutdown_timeout_s, directory_feed=args.directory_feed,
                              host_load_bytes_per_s=args.host_load_gbytes_s * 1e9,
                              state_dir=args.state_dir, admin_tokens_path=args.admin_tokens,
                              tenant_secret_path=args.tenant_secret, worker_api_key_path=args.worker_api_key,
                              coordinator_tokens_path=args.coordinator_tokens, vocab_size=args.vocab_size,
                              max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                              max_prompt_chars=args.max_prompt_chars, max_batch_prompts=args.max_batch_prompts,
                              max_messages=args.max_messages, tokenize_threads=args.tokenize_threads,
                              hints_per_s=args.hints_per_s, hints_burst=args.hints_burst,
                              pull=args.pull, pull_policy=PullConfig(args.pull_min_wait_s, args.pull_max_wait_s,
                                                                     args.pull_ttl_s),
                              speed_calibration=args.speed_calibration, tie_turns=args.tie_turns,
                              tie_draws=args.tie_draws,
                              sent_pages=args.sent_pages, peer_sends=args.peer_sends)
        if config.profile:
            from radix_sync.policy.cost import load_profile
            load_profile(config.profile)  # fail fast on an unknown profile
        from radix_sync.router.auth import load_secrets
        secrets = load_secrets(config)  # fail fast on a bad file; creates the missing ones
        if config.tenants_path:
            from radix_sync.router.tenants import TenantTable
            TenantTable.load(config.tenants_path, secrets.tenant_secret)  # fail fast on a bad file
    except ValueError as exc:
        print(f"kvrep router: {exc}", file=sys.stderr)
        return 2
    prompt_tokenizer = PromptTokenizer.from_pretrained(tokenizer) if tokenizer else None
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(config, prompt_tokenizer, secrets))
    return 0


def _add_keys(sub) -> None:
    p = sub.add_parser("keys", help="create a cluster's keys: CurveZMQ pairs for the coordinator, each worker and "
                                    "router, the allow-list, admin tokens and the tenant and worker API secrets")
    p.add_argument("--out", required=True, metavar="DIR", help="a new directory (existing keys are never overwritten)")
    p.add_argument("--workers", type=int, required=True, help="number of worker key pairs (worker-0 ...)")
    p.add_argument("--routers", type=int, default=1, help="number of router key pairs (router-0 ...)")
    p.add_argument("--worker-ids", default="",
                   help="comma-separated worker ids bound to the keys, in order (default worker-0,worker-1,...); "
                        "a worker started with --kvrep-key-name worker-<i> takes its id from its key")
    p.set_defaults(func=_run_keys)


def _run_keys(args) -> int:
    from radix_sync.keys import KeysError, create_dir

    ids = [x.strip() for x in args.worker_ids.split(",") if x.strip()] or None
    try:
        keydir = create_dir(args.out, args.workers, args.routers, worker_ids=ids)
    except KeysError as exc:
        print(f"kvrep keys: {exc}", file=sys.stderr)
        return 2
    print(f"kvrep keys: wrote {keydir.path} (0700, files 0600)")
    print(f"  coordinator   kvrep coordinator --keys {keydir.path} ...   (needs coordinator.key_secret, allow/)")
    for name, pair in keydir.workers.items():
        print(f"  {name:<13} --kvrep-keys {keydir.path} --kvrep-key-name {name}   (worker id {pair.worker_id})")
    print("  a worker host needs coordinator.key, its own worker-<i>.key_secret and allow/; keep the rest off it")
    return 0


def _add_sim(sub) -> None:
    from radix_sync.sim import cli as sim_cli

    p = sub.add_parser("sim", help="trace-driven cluster simulator")
    sim_cli.add_arguments(p)
    p.set_defaults(func=sim_cli.run)


def _add_dev_commands(sub) -> None:
    """The developer commands (`demo`, `bench`, `copy-demo`, `up`) live in `kvrep_dev`, which needs the worker side
    (sglang, torch). They are found through the `kvrep.commands` entry-point group, so this package never imports
    them; on a host installed without them the commands are simply absent."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="kvrep.commands"):
        try:
            add = ep.load()
        except ImportError as exc:  # a base install (no [worker]/[dev] extras)
            logging.getLogger("kvrep").debug("kvrep: commands %s unavailable: %s", ep.name, exc)
            continue
        add(sub)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrep", description="predictive speculative KV replication for SGLang")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_coordinator(sub)
    _add_router(sub)
    _add_keys(sub)
    _add_sim(sub)
    _add_dev_commands(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
