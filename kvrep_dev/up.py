"""`kvrep up`: a local cluster in one command (coordinator, N SGLang workers with the plugin, the router).

Waits until everything is healthy, prints the URLs, and on Ctrl-C or SIGTERM (or when any process dies) stops
everything it started, by process group, leaving nothing behind. One log file per process in `--logs`.
"""
from __future__ import annotations

import sys
import time

from kvrep_dev.bench import testbed_worker_kwargs
from kvrep_dev.cluster import ROOT, Coordinator, Proc, Worker, free_port, model_path


def _say(msg: str) -> None:
    print(f"[kvrep up] {msg}", flush=True)


def run_up(args) -> int:
    logs = ROOT / args.logs  # an absolute --logs replaces ROOT
    # Ctrl-C and SIGTERM unwind this function at any point (kvrep_dev.cli runs it under stop_on_signals), and the
    # finally below stops everything started so far.
    procs: list[Proc] = []
    try:
        coord = Coordinator(logs, extra_args=("--policy", args.policy, "--mode", args.mode, "--profile", args.profile),
                            admin_port=args.admin_port or None)
        procs.append(coord)
        coord.wait_ready()
        _say(f"coordinator: admin {coord.admin}  workers connect to {coord.endpoint}")
        workers = []
        for i in range(args.workers):
            tb = testbed_worker_kwargs(args, i)
            w = Worker(f"worker-{i}", args.model, logs, coordinator=coord.endpoint,
                       max_total_tokens=args.max_total_tokens, page_size=args.page_size, **tb)
            procs.append(w)
            workers.append(w)
        for i, w in enumerate(workers):
            _say(f"waiting for worker-{i} ({w.url}) ...")
            w.wait_ready()
        coord.wait_workers([w.worker_id for w in workers], timeout_s=60)
        router_port = args.router_port or free_port()
        argv = [sys.executable, "-m", "radix_sync.cli", "router", "--port", str(router_port), "--coordinator",
                coord.admin, "--tokenizer", model_path(args.model), "--page-size", str(args.page_size),
                "--profile", args.profile]
        if args.tenants:
            argv += ["--tenants", args.tenants]
        if getattr(args, "pull", False):
            argv.append("--pull")
        router = Proc("router", argv, logs / "router.log")
        procs.append(router)
        router_url = f"http://127.0.0.1:{router_port}"
        router.wait_http(router_url + "/health", timeout_s=120)
        _say("cluster ready")
        print(f"  router       {router_url}   (OpenAI and SGLang endpoints; /kvrep/status)")
        print(f"  coordinator  {coord.admin}   (/workers /replications /status)")
        for w in workers:
            print(f"  worker       {w.url}")
        print(f"  logs         {logs}")
        print("  Ctrl-C stops everything.", flush=True)
        while True:
            time.sleep(1.0)
            dead = [p.name for p in procs if not p.alive()]
            if dead:
                _say(f"process(es) exited: {', '.join(dead)}; shutting down")
                return 1
    finally:
        _say("stopping")
        for proc in reversed(procs):
            proc.stop()
        _say("stopped")
