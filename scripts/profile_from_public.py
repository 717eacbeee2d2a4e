"""Derive the H200 cost profiles (`llama3.1-8b-h200`, `llama3.1-70b-h200-tp4`) from cited public measurements.

No H200 has been lent to this project, so the profiles' timing terms that public measurements pin are computed
here from those measurements (quoted below with their sources), and the rest stays analytic (the model geometry,
the roofline terms no public table isolates), each term labelled with where it comes from. When an H200 is
available, measure instead (see docs/simulator.md, "Cost profiles").

    .venv/bin/python scripts/profile_from_public.py           # rewrite both profiles' values and derivations
    .venv/bin/python scripts/profile_from_public.py --check   # exit 1 if a committed profile differs from this

Measurements used (all BF16, so the KV geometry of the profiles applies):

[TRT] NVIDIA TensorRT-LLM, docs/source/performance/perf-overview.md, "Online Serving Measurements",
      https://github.com/NVIDIA/TensorRT-LLM/blob/258c7540c03517def55d9a5aadfa9288af474e1b/docs/source/performance/perf-overview.md
      "All data in the table below was generated using version 0.14.0, with 500 requests and BF16 precision."
      Columns: Model | GPU | TP | Input Length | Output Length | QPS | Tput(req/s) | Mean TTFT(ms) | Mean ITL(ms) |
      Total Token Tput (tok/s) | Output Tput (tok/s). (The table writes the GPU as "H200 131GB HBM3".)
[VLLM] vLLM nightly performance benchmark, Buildkite build 9513 (H200), https://buildkite.com/vllm/performance-benchmark/builds/9513:
      "Input length: 32 tokens. Output length: 128 tokens. Batch size: fixed (8)." latency_llama8B_tp1 H200 834.059 ms
      mean; latency_llama70B_tp4 H200 2075.08 ms mean ("Models: llama-3.1 8B, llama-3 70B": the 70B is Llama-3, same
      geometry as 3.1). Used as a cross-check only.
[MC]  Mooncake README, https://github.com/kvcache-ai/Mooncake/blob/01b91d9bddabae761570e588906c6c5530e2a147/README.md:
      "With 40 GB of data (...) Mooncake Transfer Engine delivers up to 87 GB/s and 190 GB/s of bandwidth in 4x200
      Gbps and 8x400 Gbps RoCE networks respectively".
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "radix_sync" / "profiles"

TRT_URL = ("https://github.com/NVIDIA/TensorRT-LLM/blob/258c7540c03517def55d9a5aadfa9288af474e1b/docs/source/"
           "performance/perf-overview.md")
VLLM_URL = "https://buildkite.com/vllm/performance-benchmark/builds/9513"
MC_URL = "https://github.com/kvcache-ai/Mooncake/blob/01b91d9bddabae761570e588906c6c5530e2a147/README.md"

# [TRT] rows verbatim: (input len, output len, QPS, req/s, mean TTFT ms, mean ITL ms, total tok/s, output tok/s)
TRT_ROWS = {
    "llama3.1-8b-h200": [
        (467, 256, "2", 2, 21, 6, 1425, 504),
        (467, 16, "2", 2, 18, 5, 956, 32),
        (202, 214, "2", 2, 17, 6, 812, 418),
        (467, 16, "INF", 81, 3227, 190, 39007, 1291),
    ],
    "llama3.1-70b-h200-tp4": [
        (467, 256, "2", 2, 58, 18, 1411, 499),
        (467, 16, "2", 2, 50, 15, 956, 32),
        (202, 214, "2", 2, 43, 17, 793, 408),
        (467, 16, "INF", 29, 9074, 546, 13792, 457),
    ],
}
# [VLLM] fixed batch 8, 32 input and 128 output tokens: mean end-to-end ms (cross-check of the decode terms)
VLLM_BATCH8_MS = {"llama3.1-8b-h200": 834.059, "llama3.1-70b-h200-tp4": 2075.08}
# [MC] 190 GB/s over 8 x 400 Gb/s RoCE NICs: per NIC, what one 400 Gb/s NIC carries in a measured transfer engine
MC_PER_400G_NIC_BYTES_PER_S = 190e9 / 8
NICS = {"llama3.1-8b-h200": 1, "llama3.1-70b-h200-tp4": 4}  # one 400 Gb/s NIC per GPU (DGX H200)


def derive(name: str, analytic: dict) -> tuple[dict, dict]:
    """Returns: (values, derivation) of profile `name`; `analytic` holds its current values, whose analytic
    terms (geometry, attention pairs, per-request and per-context-token decode costs) are kept."""
    rows = TRT_ROWS[name]
    pair = analytic["prefill_s_per_token_pair"]
    per_req, per_ctx = analytic["decode_s_per_request"], analytic["decode_s_per_ctx_token"]

    def pairs(n: int) -> float:
        return n * (n + 1) / 2.0

    # prefill per token: the saturated prefill-heavy row (467 in, 16 out, unlimited QPS): input tokens/s =
    # total - output; its seconds per input token, less the analytic attention-pair share, is the per-token cost
    # (an upper bound: the 16 decode steps per request are charged to prefill too)
    isl, osl, _, _, _, _, total, out = next(r for r in rows if r[2] == "INF")
    per_input_token = 1.0 / (total - out)
    per_token = per_input_token - pairs(isl) * pair / isl
    # overhead: the low-load rows (QPS 2): mean TTFT minus the prefill compute of the input
    low = [r for r in rows if r[2] == "2"]
    overheads = [r[4] / 1e3 - (r[0] * per_token + pairs(r[0]) * pair) for r in low]
    overhead = sum(overheads) / len(overheads)
    # decode step: the low-load rows' mean ITL, less the per-request and per-context-token terms of the batch in
    # flight (Little's law: req/s x (TTFT + (OSL - 1) x ITL) requests, each with ISL + OSL/2 context on average)
    steps = []
    for r_isl, r_osl, _, rps, ttft_ms, itl_ms, _, _ in low:
        in_flight = rps * (ttft_ms / 1e3 + (r_osl - 1) * itl_ms / 1e3)
        steps.append(itl_ms / 1e3 - in_flight * (per_req + (r_isl + r_osl / 2) * per_ctx))
    step = sum(steps) / len(steps)
    nic = NICS[name] * MC_PER_400G_NIC_BYTES_PER_S
    values = {**analytic,
              "prefill_overhead_s": round(overhead, 6),
              "prefill_s_per_token": float(f"{per_token:.6g}"),
              "decode_step_s": round(step, 6),
              "nic_bandwidth_bytes_per_s": float(f"{nic:.6g}")}
    # cross-check (not fitted): [VLLM] batch 8, 32 in, 128 out
    b, i, o = 8, 32, 128
    model_ms = 1e3 * (overhead + b * i * per_token + b * pairs(i) * pair
                      + sum(step + b * per_req + b * (i + k) * per_ctx for k in range(o - 1)))
    measured = VLLM_BATCH8_MS[name]
    derivation = {
        "prefill_s_per_token": (f"[TRT] {isl} in / {osl} out at unlimited QPS: {total} - {out} = {total - out} input "
                                f"tok/s -> {per_input_token * 1e6:.2f} us per input token, less the analytic "
                                f"attention-pair share ({pairs(isl) * pair / isl * 1e6:.3f} us) = "
                                f"{per_token * 1e6:.2f} us (an upper bound: the 16 decode steps are charged to it)"),
        "prefill_overhead_s": ("[TRT] QPS-2 rows: mean TTFT minus the prefill compute of the input: "
                               + ", ".join(f"{r[0]}/{r[1]}: {r[4]} ms -> {o_ * 1e3:.2f} ms"
                                           for r, o_ in zip(low, overheads))
                               + f"; mean {overhead * 1e3:.2f} ms (server and HTTP overheads included)"),
        "decode_step_s": ("[TRT] QPS-2 rows: mean ITL less the per-request and per-context terms of the requests in "
                          "flight (Little's law): "
                          + ", ".join(f"{r[0]}/{r[1]}: {r[5]} ms -> {s * 1e3:.2f} ms" for r, s in zip(low, steps))
                          + f"; mean {step * 1e3:.2f} ms (the table rounds ITL to whole ms)"),
        "nic_bandwidth_bytes_per_s": (f"[MC] 190 GB/s over 8 x 400 Gb/s RoCE = {MC_PER_400G_NIC_BYTES_PER_S / 1e9:.2f}"
                                      f" GB/s per 400 Gb/s NIC (48% of line rate; 87 GB/s over 4 x 200 Gb/s is 87%: "
                                      f"the lower figure is used) x {NICS[name]} NIC(s), one per GPU"),
        "cross_check": (f"[VLLM] batch 8, 32 in, 128 out: measured {measured:.0f} ms end to end, this profile "
                        f"{model_ms:.0f} ms ({model_ms / measured - 1:+.0%}); not fitted"),
    }
    return values, derivation


def build(name: str) -> dict:
    path = PROFILES / f"{name}.json"
    profile = json.loads(path.read_text())
    values, derivation = derive(name, profile["values"])
    measured = ("prefill_s_per_token", "prefill_overhead_s", "decode_step_s", "nic_bandwidth_bytes_per_s")
    analytic = {k: v for k, v in profile["derivation"].items() if k not in measured and k != "cross_check"}
    profile["values"] = values
    profile["derivation"] = {**analytic, **derivation}
    profile["provenance"] = (
        "Timing terms from cited public measurements of this model on H200 (BF16), computed by "
        "`scripts/profile_from_public.py` (the sources are quoted there): prefill per token, prefill overhead and the "
        "decode step from NVIDIA TensorRT-LLM 0.14's online-serving table, the NIC bandwidth from Mooncake's "
        "transfer-engine measurement; cross-checked against vLLM's nightly fixed-batch latency. The other terms "
        "(KV geometry and capacity, attention pairs, per-request and per-context-token decode costs, chunk size) "
        "stay analytic, as derived below. Not measured by this project on an H200 (none was lent).")
    srcs = [s for s in profile.get("sources", []) if not s.startswith(("NVIDIA TensorRT-LLM", "vLLM nightly",
                                                                        "Mooncake README"))]
    profile["sources"] = srcs + [
        f"NVIDIA TensorRT-LLM 0.14 online serving measurements, H200, BF16 ({TRT_URL})",
        f"vLLM nightly performance benchmark, H200 ({VLLM_URL})",
        f"Mooncake README: transfer engine bandwidth over RoCE ({MC_URL})",
    ]
    return profile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed profile differs from the derivation")
    args = ap.parse_args()
    stale = []
    for name in TRT_ROWS:
        path = PROFILES / f"{name}.json"
        profile = build(name)
        text = json.dumps(profile, indent=2) + "\n"
        if args.check:
            if json.loads(path.read_text())["values"] != profile["values"]:
                stale.append(name)
            continue
        path.write_text(text)
        print(f"{name}: " + json.dumps({k: profile["values"][k] for k in (
            "prefill_overhead_s", "prefill_s_per_token", "decode_step_s", "nic_bandwidth_bytes_per_s")}))
        print(f"  {profile['derivation']['cross_check']}")
    if stale:
        print(f"stale (re-run scripts/profile_from_public.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
