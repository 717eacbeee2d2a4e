"""`kvrep up`: a local cluster in one command (coordinator, N SGLang workers with the plugin, the router).

Waits until everything is healthy, prints the URLs, and on Ctrl-C or SIGTERM (or when any process dies) stops
everything it started, by process group, leaving nothing behind. One log file per process in `--logs`.

Secure by default with no extra step: the cluster's secrets are created once in `<logs>/keys/` (0600,
`kvrep_dev.cluster.local_keys`): the workers run with SGLang's `--api-key` from `worker-api-key` (a client that
talks to a worker directly is refused; the router sends the key), and the router's admin routes need the tokens
of `router-tokens.json`.
"""
from __future__ import annotations

import shutil
import time

from kvrep_dev.bench import testbed_worker_kwargs
from kvrep_dev.cluster import (ROOT, Coordinator, Proc, Router, Worker, local_keys, make_keys, model_path,
                               stop_all)
from kvrep_dev.report import up_progress as _say


def run_up(args) -> int:
    logs = ROOT / args.logs  # an absolute --logs replaces ROOT
    # Ctrl-C and SIGTERM unwind this function at any point (kvrep_dev.cli runs it under stop_on_signals), and the
    # finally below stops everything started so far.
    procs: list[Proc] = []
    try:
        # fresh keys beside the logs: CurveZMQ on every ZMQ plane, as across hosts, the workers' API key, the
        # router's tokens and the tenant secret, with no step for the user
        shutil.rmtree(logs / "keys", ignore_errors=True)  # a dev cluster's keys live as long as its run
        keys = local_keys(make_keys(logs / "keys", max(args.workers, 1)))
        coord = Coordinator(logs, extra_args=("--policy", args.policy, "--mode", args.mode, "--profile", args.profile),
                            admin_port=args.admin_port or None, keys=keys)
        procs.append(coord)
        coord.wait_ready()
        _say(f"coordinator: admin {coord.admin}  workers connect to {coord.endpoint}")
        workers = []
        for i in range(args.workers):
            tb = testbed_worker_kwargs(args, i)
            w = Worker(f"worker-{i}", args.model, logs, coordinator=coord.endpoint,
                       max_total_tokens=args.max_total_tokens, page_size=args.page_size,
                       api_key_file=keys / "worker-api-key", keys=keys, key_name=f"worker-{i}", **tb)
            procs.append(w)
            workers.append(w)
        for i, w in enumerate(workers):
            _say(f"waiting for worker-{i} ({w.url}) ...")
            w.wait_ready()
        coord.wait_workers([w.worker_id for w in workers], timeout_s=60)
        extra = ("--page-size", str(args.page_size), "--profile", args.profile)
        if args.tenants:
            extra += ("--tenants", args.tenants)
        if getattr(args, "pull", False):
            extra += ("--pull",)
        router = Router(logs, keys, coordinator=coord.admin, tokenizer=model_path(args.model),
                        port=args.router_port or None, extra_args=extra,
                        coordinator_tokens=getattr(coord, "tokens_path", None))  # the coordinator's own, if it has
        procs.append(router)
        router_url = router.url
        router.wait_http(router_url + "/health", timeout_s=120)
        _say("cluster ready")
        print(f"  router       {router_url}   (OpenAI and SGLang endpoints; /kvrep/status with a router token)")
        print(f"  coordinator  {coord.admin}   (/workers /replications /status)")
        for w in workers:
            print(f"  worker       {w.url}   (needs the key in {keys / 'worker-api-key'}: use the router)")
        print(f"  keys         {keys}   (router-tokens.json: the router's admin read/write tokens)")
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
        stop_all(procs)
        _say("stopped")
