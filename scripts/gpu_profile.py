"""Re-measure the compute terms of the `llama3.1-8b-h200` cost profile on the GPU at hand (issue 18 item 7).

A Llama-3.1-8B-shaped model (32 layers, hidden 4096, 32 heads, 8 KV heads, intermediate 14336, bf16, random
weights: timings do not depend on the values) run with Hugging Face transformers and PyTorch's SDPA attention:
- prefill: one sequence of n tokens, no cache, for several n; fitted t = overhead + a * n + b * n^2 / 2, i.e. the
  profile's `prefill_overhead_s`, `prefill_s_per_token`, `prefill_s_per_token_pair` (pairs = n^2 / 2, causal);
- decode: one step of B sequences with C cached tokens each, for several (B, C); fitted
  t = step + r * B + c * B * C, the profile's `decode_step_s`, `decode_s_per_request`, `decode_s_per_ctx_token`.
Each time is the median of `--repeats` CUDA-event timings after a warm-up. This is the model's forward alone in
transformers, not SGLang's serving loop (no scheduler, HTTP, CUDA graphs or FlashInfer): the overhead terms are
not comparable to the profile's (which include the server's); the per-token terms are, as an upper bound on
SGLang's kernels. Printed against the profile's values, and written to `--json`.

    python3 scripts/gpu_profile.py --json out.json            # on the GPU (~1-2 min)
    python scripts/gpu_profile.py --tiny --device cpu         # the same code on a tiny model (a smoke run)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "radix_sync" / "profiles" / "llama3.1-8b-h200.json"
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, rope_theta=10000.0, max_position_embeddings=4096)


def build(geometry: dict, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**geometry, torch_dtype=torch.bfloat16)
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device (random init there: seconds on a GPU)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    return model


def timer(device: torch.device):
    if device.type == "cuda":
        def run(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
    else:
        def run(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return run


def median_time(fn, run, repeats: int) -> float:
    run(fn)
    return statistics.median(run(fn) for _ in range(repeats))


def fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)[:, None]
    return torch.linalg.lstsq(a, y).solution[:, 0].tolist()


@torch.no_grad()
def measure(model, device: torch.device, prefill_lens: list[int], decode_points: list[tuple[int, int]],
            repeats: int, vocab: int) -> dict:
    run = timer(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prefill = []
    for n in prefill_lens:
        ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
        t = median_time(lambda: model(input_ids=ids, use_cache=False), run, repeats)
        prefill.append({"tokens": n, "s": t})
    decode = []
    for batch, ctx in decode_points:
        ids = torch.randint(0, vocab, (batch, ctx), generator=gen).to(device)
        past = model(input_ids=ids, use_cache=True).past_key_values
        nxt = torch.randint(0, vocab, (batch, 1), generator=gen).to(device)
        times = []
        for _ in range(repeats + 1):
            cache = _copy_cache(past)
            times.append(run(lambda: model(input_ids=nxt, past_key_values=cache, use_cache=True)))
        decode.append({"batch": batch, "ctx": ctx, "s": statistics.median(times[1:])})
    p = fit([[1.0, r["tokens"], r["tokens"] ** 2 / 2] for r in prefill], [r["s"] for r in prefill])
    d = fit([[1.0, r["batch"], r["batch"] * r["ctx"]] for r in decode], [r["s"] for r in decode])
    return {"prefill": prefill, "decode": decode,
            "fitted": {"prefill_overhead_s": p[0], "prefill_s_per_token": p[1], "prefill_s_per_token_pair": p[2],
                       "decode_step_s": d[0], "decode_s_per_request": d[1], "decode_s_per_ctx_token": d[2]}}


def _copy_cache(past):
    """A fresh copy of a prefilled cache (a decode step appends to the one it is given)."""
    import copy

    return copy.deepcopy(past)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (smoke run of this script)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    geometry = TINY if args.tiny else LLAMA_8B
    t0 = time.perf_counter()
    model = build(geometry, device)
    built_s = time.perf_counter() - t0
    lens = [64, 128, 256] if args.tiny else [512, 2048, 4096, 8192]
    points = [(1, 64), (4, 64), (4, 256)] if args.tiny else [(1, 1024), (8, 1024), (32, 1024), (32, 4096)]
    out = measure(model, device, lens, points, args.repeats, geometry["vocab_size"])
    out.update(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", geometry=geometry,
               build_s=built_s, torch=torch.__version__,
               what="transformers + SDPA forward, random bf16 weights; not SGLang's serving loop")
    profile = json.loads(PROFILE.read_text())["values"]
    print(f"{'term':<26} {'measured':>12} {'profile':>12} {'ratio':>7}")
    for name, value in out["fitted"].items():
        ref = profile.get(name)
        ratio = f"{value / ref:7.2f}" if ref else ""
        print(f"{name:<26} {value:12.4g} {ref if ref is not None else float('nan'):12.4g} {ratio}")
    for r in out["prefill"]:
        print(f"prefill {r['tokens']:>6} tokens: {r['s'] * 1e3:9.2f} ms")
    for r in out["decode"]:
        print(f"decode batch {r['batch']:>3} ctx {r['ctx']:>5}: {r['s'] * 1e3:9.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
