"""Benchmark kvrep_kernels page gather/scatter against a plain copy and a naive per-layer loop.

Geometry: Llama-3.1-8B on one rank (32 layers, 8 KV heads, head_dim 128, bf16), a prefix of ``--tokens``
tokens placed in a pool the way a churned SGLang allocator leaves it: mostly contiguous runs of 128-1024
tokens at random places, plus ~5% scattered single pages. Each page size in ``--page-sizes`` is measured.

Reported per operation, all measured in the same run on the same bytes:
  plain    ``dst.copy_(src)`` of one contiguous buffer of the payload size (the bandwidth ceiling)
  naive    per layer and per K/V: ``index_select`` of the token slots (what SGLang's get_cpu_copy does)
           into a temporary, then a copy into the buffer; scatter: ``index_copy_`` of the slots
  kvrep    kvrep_kernels.gather_pages / scatter_pages (torch on CPU, Triton on CUDA)

    PYTHONPATH=kernels python scripts/bench_kernels.py --tokens 4096 --threads 1
    PYTHONPATH=kernels python scripts/bench_kernels.py --device cuda --tokens 32768
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

import kvrep_kernels as kk
from kvrep_kernels.plan import compute_runs

L, H, D, DTYPE = 32, 8, 128, torch.bfloat16


def realistic_page_ids(num_pages: int, num_pool_pages: int, page_size: int, seed: int) -> torch.Tensor:
    """Distinct page ids in 1..num_pool_pages-1: runs of 128..1024 tokens plus ~5% single pages."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.ones(num_pool_pages, dtype=torch.bool)
    free[0] = False
    ids: list[int] = []
    while len(ids) < num_pages:
        if torch.rand(1, generator=gen).item() < 0.05:
            run = 1
        else:
            run = int(torch.randint(128, 1025, (1,), generator=gen)) // page_size or 1
        run = min(run, num_pages - len(ids))
        start = int(torch.randint(1, num_pool_pages - run + 1, (1,), generator=gen))
        if bool(free[start:start + run].all()):
            free[start:start + run] = False
            ids.extend(range(start, start + run))
    return torch.tensor(ids, dtype=torch.int64)


def timed(fns: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` seconds of each callable, after one warm-up each.

    The callables are run round-robin so that load from other processes on a shared box hits all of them
    alike; the minimum is the least disturbed run.
    """
    best = {name: float("inf") for name in fns}
    for name, fn in fns.items():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def bench_page_size(page_size: int, args, device: torch.device) -> None:
    num_pages = args.tokens // page_size
    num_pool_pages = int(num_pages * 1.25) + 2
    rows = num_pool_pages * page_size
    # SGLang's fused per-layer allocation: (2, rows, H, D), K and V are views.
    fused = [torch.empty(2, rows, H, D, dtype=DTYPE, device=device).normal_() for _ in range(L)]
    k = [f[0] for f in fused]
    v = [f[1] for f in fused]
    ids = realistic_page_ids(num_pages, num_pool_pages, page_size, seed=0)
    slots = (ids[:, None] * page_size + torch.arange(page_size)).flatten().to(device)
    geometry = kk.PoolGeometry(L, H, D, page_size, DTYPE)
    payload_bytes = num_pages * geometry.page_bytes()
    buf = torch.empty(geometry.buffer_shape(num_pages), dtype=DTYPE, device=device)
    plain_dst = torch.empty_like(buf)

    def naive_gather():
        for layer in range(L):
            for kv, pool in enumerate((k[layer], v[layer])):
                tmp = torch.index_select(pool, 0, slots)
                buf[layer, :, kv].copy_(tmp.view(num_pages, page_size, H, D))

    def naive_scatter():
        for layer in range(L):
            for kv, pool in enumerate((k[layer], v[layer])):
                pool.index_copy_(0, slots, buf[layer, :, kv].reshape(-1, H, D))

    results = timed({
        "plain copy": lambda: plain_dst.copy_(buf),
        "gather naive": naive_gather,
        "gather kvrep": lambda: kk.gather_pages(k, v, ids, page_size, out=buf),
        "scatter naive": naive_scatter,
        "scatter kvrep": lambda: kk.scatter_pages(buf, k, v, ids, page_size),
    }, device, args.repeats)
    # Correctness spot check: the kvrep buffer equals the naive one.
    naive_gather()
    expected = buf.clone()
    kk.gather_pages(k, v, ids, page_size, out=buf)
    assert torch.equal(buf.view(torch.uint8), expected.view(torch.uint8))

    runs = int(compute_runs(ids)[2].numel())
    print(f"\npage_size={page_size}: {num_pages} pages in {runs} runs, payload {payload_bytes / 2**20:.0f} MiB")
    plain_gbps = payload_bytes / results["plain copy"] / 1e9
    for name, seconds in results.items():
        gbps = payload_bytes / seconds / 1e9
        print(f"  {name:14s} {seconds * 1e3:9.2f} ms {gbps:8.2f} GB/s  {gbps / plain_gbps:5.2f}x plain")
    for op in ("gather", "scatter"):
        print(f"  {op} kvrep / naive speedup: {results[f'{op} naive'] / results[f'{op} kvrep']:.2f}x")
    del fused, k, v, buf, plain_dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="prefix length in tokens (32768 on a GPU)")
    parser.add_argument("--page-sizes", default="16,1", help="comma-separated page sizes")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the dev box is shared)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per operation (best is reported)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print("command:", shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"Llama-3.1-8B geometry L={L} H={H} D={D} {DTYPE}, {args.tokens} tokens")
    for page_size in (int(x) for x in args.page_sizes.split(",")):
        if args.tokens % page_size:
            raise SystemExit(f"--tokens {args.tokens} is not a multiple of page size {page_size}")
        bench_page_size(page_size, args, device)


if __name__ == "__main__":
    main()
