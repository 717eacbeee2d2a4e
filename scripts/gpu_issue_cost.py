"""What issuing one gather costs the calling thread (issue 18: `scripts/gpu_agent_path.py` measured ~2.5 ms of the
source's scheduler thread per gather on an H200, for ~0.03 ms of GPU work), taken apart.

On a pool of Llama-3.1-8B geometry (32 layers, 8 KV heads, head dim 128, bf16, pages of 16) and the agent's own
copy stream fenced behind a busy "forward" stream (as `CudaOps` does), it times `gather_pages` + the copy into a
pinned host slot, per call, for gathers of 2, 8 and 32 pages (4, 16 and 64 MiB):

- alone, with the launch descriptions kept (`triton_copy._LAUNCHES_KEPT`, the default) and not kept (each launch
  described and its offsets uploaded again, as before they were kept);
- beside a thread doing what the agent's I/O thread does while sending (xxh3 of a 4 MiB chunk, a zero-copy
  ZeroMQ send over loopback, a receiving thread): calls that release the GIL;
- beside other Python threads, as in `gpu_agent_path.py`, where the source, the target, their I/O threads and a
  stand-in coordinator share one process and one GIL (in a fleet each worker is its own process): one thread
  spinning in Python ("spin"), and the same with `sys.setswitchinterval(0.0005)` ("spin, 0.5 ms switch").
  Every torch call drops the GIL, and taking it back from a thread running Python waits up to the switch
  interval (5 ms by default);
- and a profile (cProfile, tottime) of the kept case alone: where the rest goes.

Run with CUDA only (exit 2 without):

    PYTHONPATH=kernels:. python3 scripts/gpu_issue_cost.py [--json out.json] [--calls 200]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "kernels"), str(ROOT)]

import kvrep_kernels as kk  # noqa: E402
from kvrep_kernels import triton_copy  # noqa: E402
from sglang_kvrep.device import CudaOps, host_copy  # noqa: E402

LAYERS, HEADS, DIM, PS = 32, 8, 128, 16


def pool(tokens: int, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    rows = tokens + PS  # (page 0 is SGLang's padding page)
    k = [torch.zeros(rows, HEADS, DIM, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]
    v = [torch.zeros(rows, HEADS, DIM, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]
    return k, v


def time_calls(ops: CudaOps, k, v, pages: int, calls: int, host: torch.Tensor) -> list[float]:
    """Per call: fence, gather `pages` pages, copy into the pinned `host`, record an event (what the source's
    `_issue_chunk` does for one slot); waits for the copies only every 16 calls (outside the timing)."""
    num_pages = k[0].shape[0] // PS
    times = []
    for i in range(calls):
        first = 1 + (i * pages) % (num_pages - pages - 1)
        ids = torch.arange(first, first + pages)
        t0 = time.perf_counter()
        with ops.stream():
            ops.fence()
            buf = kk.gather_pages(k, v, ids, PS, layout="NHD")
            host_copy(ops, buf, host[:buf.numel() * buf.element_size()])
            ops.record()
        times.append(time.perf_counter() - t0)
        if i % 16 == 15:
            ops.copy_stream.synchronize()
    ops.copy_stream.synchronize()
    return times


def spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(1000):
            x += 1


def io_like(stop: threading.Event, sent: list) -> None:
    """What the agent's I/O thread does while a source sends: checksum a 4 MiB chunk of host memory (xxh3) and send
    it zero-copy over loopback ZeroMQ, to a receiving thread (the target, another process in a fleet). Both stay
    in calls that release the GIL most of the time."""
    import xxhash
    import zmq

    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    for s in (push, pull):
        s.setsockopt(zmq.LINGER, 0)
    chunk = torch.empty(4 << 20, dtype=torch.uint8, pin_memory=True)
    view = memoryview(chunk.numpy())

    def drain() -> None:
        while not stop.is_set():
            if pull.poll(50):
                pull.recv(copy=False)

    rx = threading.Thread(target=drain, daemon=True)
    rx.start()
    while not stop.is_set():
        xxhash.xxh3_64_intdigest(view)
        if push.poll(50, zmq.POLLOUT):
            push.send(view, copy=False)
            sent[0] += 1
    rx.join()
    push.close()
    pull.close()
    ctx.term()


def summary(times: list[float]) -> dict:
    ms = sorted(t * 1e3 for t in times[3:])  # (the first calls describe launches and warm the allocator)
    return {"median_ms": round(statistics.median(ms), 3), "mean_ms": round(statistics.fmean(ms), 3),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3), "max_ms": round(ms[-1], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=65536, help="pool size (tokens)")
    ap.add_argument("--spin-calls", type=int, default=25, help="calls timed beside a spinning thread")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 2
    dev = torch.device("cuda", 0)
    k, v = pool(args.tokens, dev)
    forward = torch.cuda.Stream(device=dev)
    ops = CudaOps(dev, forward)
    with ops.stream():
        kk.warm_up(k, v, PS, layout="NHD")
    page_bytes = LAYERS * 2 * PS * HEADS * DIM * 2
    host = torch.empty(32 * page_bytes, dtype=torch.uint8, pin_memory=True)
    results: dict = {"calls": args.calls, "switch_interval_s": sys.getswitchinterval()}
    keep = triton_copy.KEEP_LAUNCHES
    for pages in (2, 8, 32):
        row: dict = {}
        with torch.cuda.stream(forward):
            torch.cuda._sleep(10**9)  # the "forward" stays busy: the fence is real, the copies queue behind it
        row["kept"] = summary(time_calls(ops, k, v, pages, args.calls, host))
        triton_copy.KEEP_LAUNCHES = 0
        row["not kept"] = summary(time_calls(ops, k, v, pages, args.calls, host))
        triton_copy.KEEP_LAUNCHES = keep
        stop, sent = threading.Event(), [0]
        th = threading.Thread(target=io_like, args=(stop, sent), daemon=True)
        th.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        try:
            row["beside I/O-like sending"] = summary(time_calls(ops, k, v, pages, args.calls, host))
        finally:
            stop.set()
            th.join()
        row["beside I/O-like sending"]["sent_gb_per_s"] = round(sent[0] * (4 << 20) / (time.perf_counter() - t0)
                                                                / 1e9, 2)
        print(pages, "pages:", json.dumps(row), flush=True)
        for label, interval in (("spin", None), ("spin, 0.5 ms switch", 0.0005)):
            old = sys.getswitchinterval()
            if interval:
                sys.setswitchinterval(interval)
            stop = threading.Event()
            th = threading.Thread(target=spin, args=(stop,), daemon=True)
            th.start()
            try:  # (fewer calls: with a thread spinning, a call can take ~100 ms)
                row[label] = summary(time_calls(ops, k, v, pages, min(args.calls, args.spin_calls), host))
            finally:
                stop.set()
                th.join()
                sys.setswitchinterval(old)
        results[f"{pages} pages ({pages * page_bytes >> 20} MiB)"] = row
        print(pages, "pages:", json.dumps(row), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    time_calls(ops, k, v, 8, args.calls, host)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    results["profile_8_pages"] = out.getvalue()
    print(out.getvalue())
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
