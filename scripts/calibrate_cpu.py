"""Measure the `cpu-local` cost profile on the local CPU SGLang cluster and write it to
radix_sync/profiles/cpu-local.json (the simulator's and the planner's starting point for CPU runs).

Starts a coordinator and two CPU workers (the `small` local model unless --model), then measures:
- prefill: time to first token at the client, the way `kvrep bench` measures it (a streaming `/generate` with a
  text prompt of one-token words, 8 output tokens: HTTP, the server's tokenization and the stream included), for
  cold prompts and for short and long extensions of cached prefixes; least squares for
  `prefill_overhead_s + prefill_s_per_token*new + prefill_s_per_token_pair*(new*cached + new*(new+1)/2)
  + prefill_s_per_cached_pair*cached*(cached+1)/2` (the last term: the torch_native CPU backend recomputes
  attention over the cached prefix on every extension);
- decode: `(e2e - ttft) / (n - 1)` of n-token requests at two context lengths and two batch sizes;
- transfer: replications of a long prefix A->B (bytes over the target's receive time, plus fixed cost).

Usage: .venv/bin/python scripts/calibrate_cpu.py [--model small] [--out radix_sync/profiles/cpu-local.json]
       .venv/bin/python scripts/calibrate_cpu.py --refit   # refit the prefill terms from the file's measurements
       .venv/bin/python scripts/calibrate_cpu.py --from-bench logs/RUN/results.json [...] --base cpu-wide \
           --out radix_sync/profiles/cpu-wide-bench.json   # prefill terms from a bench run's lone requests
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

from kvrep_dev import calibration  # noqa: E402
from kvrep_dev.cluster import Coordinator, Worker, stream_generate  # noqa: E402

MAX_TOTAL_TOKENS = 65536
CHUNKED_PREFILL = 4096  # SGLang 0.5.23's default chunked prefill size on this CPU server (see server_args log)


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(n)]


def ttft(worker: Worker, ids: list[int]) -> float:
    return worker.generate(ids, max_new_tokens=1)["meta_info"]["first_token_latency"]


def client_ttft(url: str, text: str, max_new_tokens: int = 8) -> tuple[float, int, int]:
    """Returns: (TTFT at the client in s, prompt tokens, cached tokens) of a streamed text `/generate`."""
    first, _, prompt, cached = stream_generate(url, text, max_new_tokens)
    return first, prompt, cached


def decode_step(worker: Worker, ids_list: list[list[int]], n: int) -> float:
    outs = [None] * len(ids_list)

    def run(i):
        outs[i] = worker.generate(ids_list[i], max_new_tokens=n)["meta_info"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ids_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median((m["e2e_latency"] - m["first_token_latency"]) / (n - 1) for m in outs)


VALUE_ORDER = ("kv_bytes_per_token", "kv_capacity_tokens", "max_context_len", "chunked_prefill_len",
               "max_running_requests", "prefill_overhead_s", "prefill_s_per_token", "prefill_s_per_token_pair",
               "prefill_s_per_cached_pair", "decode_step_s", "decode_s_per_request", "decode_s_per_ctx_token",
               "nic_bandwidth_bytes_per_s", "transfer_latency_s")


def fit_prefill(rows: list, balance: bool = False) -> dict:
    """The four prefill terms by non-negative least squares on relative error (`kvrep_dev.calibration.fit_prefill`;
    this script's own grid has the same repeats of every shape, so it weighs samples alike) of (new, cached, s)."""
    f = calibration.fit_prefill([tuple(r) for r in rows], balance=balance)
    return {"values": f["values"],
            "derivation": (f"non-negative least squares (relative error) over {len(rows)} requests (new, cached) -> "
                           f"time to first token at the client (streaming text /generate, 8 output tokens, as "
                           f"`kvrep bench` measures); RMS relative residual {f['rms']:.0%}. Four terms: "
                           "overhead, per new token, per (new x context) pair, and per (cached x cached) pair: the "
                           "torch_native CPU backend recomputes attention over the cached prefix on every "
                           "extension, so a short extension of a long cached prefix costs ~ context^2 (with three "
                           "terms the residual was 46%)")}


def from_bench(runs: list[str], base: str, out: str) -> int:
    """Writes a profile whose prefill terms are fitted on the isolated requests of saved `kvrep bench` runs
    (`kvrep_dev.calibration`: the testbed exactly as it is measured), its other terms `base`'s."""
    import gzip

    from radix_sync.policy.cost import load_profile

    samples, sources = [], []
    for run in runs:
        path = Path(run)
        data = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
        got = calibration.isolated_requests(data["rows"])
        samples += got
        cmd = data.get("command", "")
        sources.append(f"{path.name} ({len(got)} of {sum(len(r.get('requests', [])) for r in data['rows'])}"
                       f" requests{'; ' + cmd if cmd else ''})")
    if len(samples) < calibration.MIN_SAMPLES:
        print(f"calibrate_cpu: {len(samples)} isolated requests, need {calibration.MIN_SAMPLES}", file=sys.stderr)
        return 2
    prof = load_profile(base)
    f = calibration.fit_prefill(calibration.prefill_part(samples, prof), balance=True)
    values = {k: getattr(prof, k) for k in VALUE_ORDER}
    values.update(f["values"])
    ratio = prof.kv_bytes_per_token / prof.nic_bandwidth_bytes_per_s / f["values"]["prefill_s_per_token"]
    base_ratio = prof.kv_bytes_per_token / prof.nic_bandwidth_bytes_per_s / prof.prefill_s_per_token
    src = Path(base) if base.endswith(".json") else ROOT / "radix_sync" / "profiles" / f"{base}.json"
    base_doc = json.loads(src.read_text())
    profile = {
        "name": Path(out).stem,
        "provenance": (f"Prefill terms fitted by `.venv/bin/python scripts/calibrate_cpu.py --from-bench "
                       f"{' '.join(r if not Path(r).is_absolute() else Path(r).name for r in runs)} --base {base}` on "
                       f"{datetime.date.today().isoformat()} from the requests of those `kvrep bench` runs that "
                       f"ran alone (the CPU testbed as the bench runs it: pinned workers, its flags, the streamed "
                       f"text path); decode, transfer and limits from `{base}`. What the simulator runs on as the "
                       f"machine (`kvrep bench --simulate`); the live router and planner keep pricing with "
                       f"`{base}`."),
        "derivation": {**base_doc.get("derivation", {}),
                       "copy_to_prefill": (f"at this profile's prefill cost per new token a copy's time per token "
                                           f"over the link is {ratio:.3f} of a prefill's ({base}: {base_ratio:.3f})"),
                       "prefill": (f"non-negative least squares on relative error over {f['samples']} isolated "
                                   f"requests in {f['cells']} cells of a log-2 (new, cached) grid, each cell weighing "
                                   f"the same, each TTFT less one decode step at batch 1 (`{base}`'s decode terms: "
                                   f"the overlap scheduler's first-token lag, which the simulator adds back) "
                                   f"(kvrep_dev/calibration.py); RMS relative residual {f['rms']:.0%}; from "
                                   + "; ".join(sources) + "; `measurements.prefill`: (new, cached, TTFT s) as "
                                   "measured")},
        "fit": "from-bench",
        "values": values,
        "measurements": {"prefill": "SAMPLES"},
    }
    rows = ",\n".join(f"   [{n}, {c}, {t}]" for n, c, t in samples)  # one sample a line
    text = json.dumps(profile, indent=2).replace('"prefill": "SAMPLES"', '"prefill": [\n' + rows + "\n    ]")
    Path(out).write_text(text + "\n")
    print(json.dumps(f, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def refit(path: str) -> int:
    """Refits the prefill terms from the measurements stored in the profile (no servers started); refuses a
    `--from-bench` profile, whose fit differs (`from_bench`)."""
    profile = json.loads(Path(path).read_text())
    if profile.get("fit") == "from-bench":  # fitted otherwise (less the first-token lag, cells weighing the same)
        print(f"calibrate_cpu: {path} was written by --from-bench; rerun that (its provenance names the runs)",
              file=sys.stderr)
        return 2
    prefill = fit_prefill(profile["measurements"]["prefill"])
    values = {**profile["values"], **prefill["values"]}
    profile["values"] = {k: values[k] for k in VALUE_ORDER}
    profile["derivation"]["prefill"] = prefill["derivation"]
    Path(path).write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps(profile["values"], indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "radix_sync" / "profiles" / "cpu-local.json"))
    ap.add_argument("--refit", action="store_true", help="refit the prefill terms of --out from its measurements")
    ap.add_argument("--from-bench", nargs="+", metavar="RESULTS_JSON",
                    help="no servers: fit the prefill terms on the isolated requests of saved `kvrep bench` runs "
                         "(their results.json) and write --out with --base's other terms")
    ap.add_argument("--base", default="cpu-wide", help="with --from-bench: the profile giving the other terms")
    args = ap.parse_args()
    if args.refit:
        return refit(args.out)
    if args.from_bench:
        return from_bench(args.from_bench, args.base, args.out)
    rng = random.Random(0)
    logs = ROOT / "logs" / "calibrate"
    procs = []
    try:
        coord = Coordinator(logs, extra_args=("--policy", "none"))
        procs.append(coord)
        coord.wait_ready()
        a = Worker("cal-A", args.model, logs, coordinator=coord.endpoint, max_total_tokens=MAX_TOTAL_TOKENS)
        b = Worker("cal-B", args.model, logs, coordinator=coord.endpoint, max_total_tokens=MAX_TOTAL_TOKENS)
        procs += [a, b]
        a.wait_ready()
        b.wait_ready()
        coord.wait_workers([a.worker_id, b.worker_id])
        ttft(a, rand_ids(rng, 64))  # warm-up
        from transformers import AutoTokenizer

        from kvrep_dev.loadgen import Renderer
        from kvrep_dev.cluster import model_path

        words = Renderer(AutoTokenizer.from_pretrained(model_path(args.model))).words

        def text(n: int) -> str:  # n one-token words
            return "".join(" " + rng.choice(words) for _ in range(n))
        client_ttft(a.url, text(64))  # warm-up of the text path
        rows = []  # (new, cached, seconds): new and cached as the server reports them
        for _ in range(args.repeats):
            for n in (64, 256, 512, 1024, 2048, 3072):
                t, prompt, cached = client_ttft(a.url, text(n))
                rows.append((prompt - cached, cached, t))
            for c in (256, 1024, 2048, 3072):
                prefix = text(c)
                client_ttft(a.url, prefix, 1)
                for n in (32, 256):
                    t, prompt, cached = client_ttft(a.url, prefix + text(n))
                    rows.append((prompt - cached, cached, t))
        print(f"[calibrate] {len(rows)} prefill samples", file=sys.stderr)
        prefill = fit_prefill(rows)
        # decode: step time vs context length (batch 1) and vs batch size (short context)
        n = 33
        step_short = decode_step(a, [rand_ids(rng, 64)], n)
        step_long = decode_step(a, [rand_ids(rng, 4096)], n)
        step_batch4 = decode_step(a, [rand_ids(rng, 64) for _ in range(4)], n)
        per_ctx = max(0.0, (step_long - step_short) / (4096 - 64))
        per_req = max(0.0, (step_batch4 - step_short) / 3)
        step_fixed = max(0.0, step_short - per_req - per_ctx * 64)
        # transfer: replicate long prefixes A -> B
        reps = []
        for _ in range(args.repeats):
            prefix = rand_ids(rng, 4096)
            a.generate(prefix, 1)
            status, rep = coord.post("/replicate", {"source": a.worker_id, "target": b.worker_id,
                                                    "input_ids": prefix, "ttl_s": 600})
            assert status == 200, rep
            rep = coord.wait_replication(rep["id"])
            assert rep["state"] == "done", rep
            reps.append(rep)
        kv_bytes_per_token = int(reps[0]["bytes"] // reps[0]["num_tokens"])
        bandwidth = statistics.median(r["bytes"] / max(1e-6, r["timings_s"]["receive_s"]) for r in reps)
        latency = max(0.0, statistics.median(r["total_s"] - r["bytes"] / bandwidth for r in reps))
        values = {
            "kv_bytes_per_token": kv_bytes_per_token,
            "kv_capacity_tokens": MAX_TOTAL_TOKENS,
            "max_context_len": 32768,
            "chunked_prefill_len": CHUNKED_PREFILL,
            "max_running_requests": 64,
            **prefill["values"],
            "decode_step_s": round(step_fixed, 6),
            "decode_s_per_request": float(f"{per_req:.6g}"),
            "decode_s_per_ctx_token": float(f"{per_ctx:.6g}"),
            "nic_bandwidth_bytes_per_s": float(f"{bandwidth:.6g}"),
            "transfer_latency_s": round(latency, 6),
        }
        values = {k: values[k] for k in VALUE_ORDER}
        profile = {
            "name": Path(args.out).stem,
            "provenance": (f"Measured by `.venv/bin/python scripts/calibrate_cpu.py --model {args.model} --repeats "
                           f"{args.repeats}` on {datetime.date.today().isoformat()}: two CPU SGLang 0.5.23 workers "
                           f"(local '{args.model}' model, OMP_NUM_THREADS=1 each, --max-total-tokens "
                           f"{MAX_TOTAL_TOKENS}, page size 16) on a {os.cpu_count()}-core {platform.machine()} host; "
                           "loopback ZeroMQ data plane. Absolute times are noisy on a shared 2-core machine."),
            "derivation": {
                "prefill": prefill["derivation"],
                "decode": f"(e2e - ttft)/(n-1) with n={n}: batch 1 ctx 64 -> {step_short * 1e3:.2f} ms, "
                          f"ctx 4096 -> {step_long * 1e3:.2f} ms, batch 4 ctx 64 -> {step_batch4 * 1e3:.2f} ms",
                "transfer": f"{len(reps)} replications of 4096 tokens: bytes / target receive time; fixed cost = "
                            "total - bytes/bandwidth",
                "max_running_requests": "assumed (the CPU server's own limit is larger; 64 keeps the model honest)",
            },
            "measurements": {"prefill": rows, "replications": [
                {k: r[k] for k in ("bytes", "num_tokens", "total_s", "timings_s")} for r in reps]},
            "values": values,
        }
        Path(args.out).write_text(json.dumps(profile, indent=2) + "\n")
        print(json.dumps(values, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
