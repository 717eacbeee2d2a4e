"""`kvrep demo`: a local cluster (coordinator + two CPU SGLang workers with the plugin) replicating a prefix.

For each of `--repeats` fresh prompts P (`--prompt-len` tokens): worker A serves P; `POST /replicate` copies P's
KV pages from A to B; then B serves P + a new suffix (a replica hit) and, for comparison, a cold prompt of the
same length it has never seen. TTFT is the server's `first_token_latency` of a one-token request. It checks that B's greedy output equals A's, and prints the replication time
(with its breakdown) and B's time-to-first-token warm vs cold, as medians.
"""
from __future__ import annotations

import random
import statistics
import time

from kvrep_dev.cluster import ROOT, Coordinator, Worker, local_keys, stop_all
from kvrep_dev.report import copy_demo_progress as _progress


def _ttft(worker: Worker, ids: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = worker.generate(ids, max_new_tokens=1)
    client_s = time.perf_counter() - t0
    server_s = out["meta_info"].get("first_token_latency")
    return (server_s if server_s is not None else client_s), out


def run_demo(args) -> int:
    logs = ROOT / args.logs
    rng = random.Random(0)
    procs = []
    try:
        _progress("starting the coordinator")
        coord = Coordinator(logs, extra_args=("--policy", "none"))
        procs.append(coord)
        coord.wait_ready()
        _progress(f"starting two CPU SGLang workers with model '{args.model}' (~30-60 s)")
        key = local_keys(logs / "keys") / "worker-api-key"  # SGLang's --api-key: no anonymous client on a worker
        a = Worker("worker-A", args.model, logs, coordinator=coord.endpoint, max_total_tokens=65536, api_key_file=key)
        procs.append(a)
        b = Worker("worker-B", args.model, logs, coordinator=coord.endpoint, max_total_tokens=65536, api_key_file=key)
        procs.append(b)
        a.wait_ready()
        b.wait_ready()
        coord.wait_workers([a.worker_id, b.worker_id])
        _progress(f"cluster up: coordinator admin {coord.admin}, workers {a.url} {b.url}")
        _ttft(b, [rng.randrange(10, 4000) for _ in range(64)])  # warm up both workers' code paths
        _ttft(a, [rng.randrange(10, 4000) for _ in range(64)])
        rows = []
        for i in range(args.repeats):
            P = [rng.randrange(10, 4000) for _ in range(args.prompt_len)]
            suffix = [rng.randrange(10, 4000) for _ in range(16)]
            a.generate(P, 1)
            status, rep = coord.post("/replicate", {"source": a.worker_id, "target": b.worker_id, "input_ids": P,
                                                    "ttl_s": 300})
            if status != 200:
                raise RuntimeError(f"replicate refused: {rep}")
            rep = coord.wait_replication(rep["id"])
            if rep["state"] != "done":
                raise RuntimeError(f"replication failed: {rep}")
            # the replica hit first: a cold prompt first could evict it (replicas are evicted before anything else)
            warm_s, warm_out = _ttft(b, P + suffix)
            cold_ids = [rng.randrange(10, 4000) for _ in range(args.prompt_len + len(suffix))]
            cold_s, _ = _ttft(b, cold_ids)
            same = b.generate(P + suffix, 16)["output_ids"] == a.generate(P + suffix, 16)["output_ids"]
            rows.append({"replication_s": rep["total_s"], "bytes": rep["bytes"], **rep["timings_s"],
                         "cold_ttft_s": cold_s, "replica_ttft_s": warm_s,
                         "cached": warm_out["meta_info"]["cached_tokens"], "same_output": same})
            _progress(f"{i + 1}/{args.repeats}: replicated {rep['num_tokens']} tokens ({rep['bytes'] / 1e6:.1f} MB) "
                      f"in {rep['total_s'] * 1e3:.1f} ms; B TTFT cold {cold_s * 1e3:.1f} ms, "
                      f"replica {warm_s * 1e3:.1f} ms, cached {rows[-1]['cached']}, same output: {same}")
        med = {k: statistics.median(r[k] for r in rows) for k in
               ("replication_s", "bytes", "gather_s", "send_s", "receive_s", "scatter_s", "insert_s",
                "cold_ttft_s", "replica_ttft_s")}
        print()
        print(f"kvrep demo: model={args.model}, prompt={args.prompt_len} tokens, {args.repeats} repeats (medians)")
        print(f"  replication A->B            {med['replication_s'] * 1e3:8.1f} ms   ({med['bytes'] / 1e6:.1f} MB)")
        for key in ("gather_s", "send_s", "receive_s", "scatter_s", "insert_s"):
            print(f"    {key[:-2]:<25} {med[key] * 1e3:8.1f} ms")
        print(f"  TTFT on B, cold prompt      {med['cold_ttft_s'] * 1e3:8.1f} ms")
        print(f"  TTFT on B, replica hit      {med['replica_ttft_s'] * 1e3:8.1f} ms   "
              f"(ratio {med['replica_ttft_s'] / med['cold_ttft_s']:.2f}x)")
        print(f"  cached tokens on B          {statistics.median(r['cached'] for r in rows):8.0f}")
        print(f"  greedy output B == A        {all(r['same_output'] for r in rows)}")
        print(f"  logs: {logs}")
        return 0 if all(r["same_output"] for r in rows) else 1
    finally:
        stop_all(procs)
