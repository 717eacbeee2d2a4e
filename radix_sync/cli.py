"""The `kvrep` command line: `kvrep coordinator`, `kvrep sim`, `kvrep demo`.

Subcommands import their modules lazily so `kvrep coordinator` never pays for torch or sglang imports.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys


def _add_coordinator(sub) -> None:
    p = sub.add_parser("coordinator", help="run the coordinator (directory, policy, admin API)")
    p.add_argument("--bind", default="tcp://127.0.0.1:5600", help="ZMQ endpoint for worker agents")
    p.add_argument("--admin-host", default="127.0.0.1")
    p.add_argument("--admin-port", type=int, default=5680, help="JSON admin API port (0: any free port)")
    p.add_argument("--policy", default="rules", choices=["rules", "none"])
    p.add_argument("--mode", default="active", choices=["active", "shadow"])
    p.add_argument("--tick-s", type=float, default=0.25)
    p.add_argument("--worker-timeout-s", type=float, default=5.0)
    p.add_argument("--replication-timeout-s", type=float, default=60.0)
    g = p.add_argument_group("rule-based policy (L, H, W, Q)")
    g.add_argument("--rule-min-prefix-len", type=int, default=512, help="L: tokens")
    g.add_argument("--rule-min-hits", type=int, default=3, help="H: hits within the window")
    g.add_argument("--rule-window-s", type=float, default=30.0, help="W: seconds")
    g.add_argument("--rule-max-queue", type=int, default=0, help="Q: holder's waiting requests must exceed it")
    g.add_argument("--rule-ttl-s", type=float, default=60.0, help="TTL of replicas the rule makes")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_run_coordinator)


def _run_coordinator(args) -> int:
    from radix_sync.coordinator.rules import RuleConfig
    from radix_sync.coordinator.server import Coordinator, CoordinatorConfig
    from radix_sync.coordinator.state import StateConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = CoordinatorConfig(
            bind=args.bind, admin_host=args.admin_host, admin_port=args.admin_port, policy=args.policy,
            mode=args.mode, tick_s=args.tick_s,
            rules=RuleConfig(args.rule_min_prefix_len, args.rule_min_hits, args.rule_window_s, args.rule_max_queue,
                             args.rule_ttl_s),
            state=StateConfig(worker_timeout_s=args.worker_timeout_s,
                              replication_timeout_s=args.replication_timeout_s))
    except ValueError as exc:
        print(f"kvrep coordinator: {exc}", file=sys.stderr)
        return 2
    coord = Coordinator(config)
    signal.signal(signal.SIGTERM, lambda *_: coord.stop())
    signal.signal(signal.SIGINT, lambda *_: coord.stop())
    print(f"kvrep coordinator: workers -> {coord.endpoint}  admin -> http://{args.admin_host}:{coord.admin_port}",
          flush=True)
    coord.serve_forever()
    return 0


def _add_sim(sub) -> None:
    try:
        from radix_sync.sim import cli as sim_cli
    except ImportError:  # the simulator is optional at import time
        return
    p = sub.add_parser("sim", help="trace-driven cluster simulator")
    sim_cli.add_arguments(p)
    p.set_defaults(func=sim_cli.run)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="start a local cluster (coordinator + CPU workers) and replicate a prefix")
    p.add_argument("--model", default="small", help="tiny | small | a model directory")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--logs", default="logs/demo", help="folder for per-process logs")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from sglang_kvrep.devtools.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrep", description="predictive speculative KV replication for SGLang")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_coordinator(sub)
    _add_sim(sub)
    _add_demo(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
