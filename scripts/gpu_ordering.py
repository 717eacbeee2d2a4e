"""The two stream hazards of issue 18 on a real GPU, each run fenced (as the agent copies: `CudaOps.fence` before
the copy) and unfenced, with SGLang's forward stream kept busy so that the race has room to happen.

1. source: a forward still writes a cached prefix's last token when the agent gathers the prefix. The forward
   stream sleeps (`torch.cuda._sleep`), then writes a marker into the pool. Fenced, the gathered chunk holds the
   marker; unfenced, it may not (the hazard).
2. target: a late forward write lands in slots just freed and handed to a replica. The forward stream sleeps,
   then writes a marker there. Fenced, the replica's pages hold the transfer after everything; unfenced, the
   marker may overwrite them (the hazard).

The fenced runs must be correct (exit 1 otherwise); the unfenced ones say whether the hazard was seen. Also
checked: the copy's event is not done while the forward stream still sleeps (the scheduler thread would not
wait for it), and the chunk's host buffer is pinned.

3. capture: SGLang captures CUDA graphs in global mode after a weight update, on the scheduler thread; meanwhile
   the agent's I/O thread drops the chunk buffers it has sent. Shown: whether a global-mode capture survives the
   other thread freeing pinned blocks that asynchronous copies used (PyTorch's caching host allocator records an
   event then: a CUDA call; seen on an H200: it does not), dropping views of pinned blocks this thread keeps (the
   agent's `HostSlots`), and (the reason a target's receive buffers are pageable) a pinned allocation there.
   Reported, not judged, except that the agent's way ("drop_views") must survive (exit 1 otherwise).

    PYTHONPATH=kernels:. python3 scripts/gpu_ordering.py --json out.json      # needs CUDA
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "kernels"), str(ROOT)]

import kvrep_kernels as kk  # noqa: E402
from sglang_kvrep.device import CudaOps  # noqa: E402

L, H, D, PS = 4, 8, 128, 16
SLEEP_CYCLES = 200_000_000  # ~0.1 s at ~2 GHz: far longer than issuing the copy takes on the host


def pool(pages: int, device: torch.device, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    k = [torch.randn(pages * PS, H, D, generator=gen).to(torch.bfloat16).to(device) for _ in range(L)]
    v = [torch.randn(pages * PS, H, D, generator=gen).to(torch.bfloat16).to(device) for _ in range(L)]
    return k, v


def source_hazard(fenced: bool) -> dict:
    dev = torch.device("cuda")
    forward = torch.cuda.Stream()
    k, v = pool(64, dev)
    ops = CudaOps(dev, forward)
    torch.cuda.synchronize()
    ids = torch.arange(1, 17)  # the prefix: pages 1..16; its last token is row 16 * PS + PS - 1
    last_row = 16 * PS + PS - 1
    with torch.cuda.stream(forward):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in k:
            t[last_row].fill_(7.0)
    with ops.stream():
        if fenced:
            ops.fence()
        buf = kk.gather_pages(k, v, ids, PS)
        host = ops.host_buffer(buf.numel() * buf.element_size())
        ops.to_host(buf, host)
        event = ops.record()
    pending_while_forward_runs = not event.query()
    torch.cuda.synchronize()
    got = host.view(torch.bfloat16).view(buf.shape)
    saw = bool((got[:, 15, 0, PS - 1] == 7.0).all())  # K of the last token of the last page, every layer
    return {"fenced": fenced, "gather_saw_the_forwards_write": saw, "event_pending_while_forward_ran":
            pending_while_forward_runs, "host_buffer_pinned": host.is_pinned()}


def target_hazard(fenced: bool) -> dict:
    dev = torch.device("cuda")
    forward = torch.cuda.Stream()
    k, v = pool(64, dev)
    src_k, src_v = pool(64, dev, seed=1)
    payload = kk.gather_pages(src_k, src_v, torch.arange(1, 9), PS).cpu().pin_memory()
    ops = CudaOps(dev, forward)
    torch.cuda.synchronize()
    slots_pages = torch.arange(40, 48)  # the replica's pages: just freed by a request whose forward still runs
    with torch.cuda.stream(forward):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in k:
            t[40 * PS + 3].fill_(-9.0)  # the late write
    with ops.stream():
        dev_buf = ops.to_device(payload)
        if fenced:
            ops.fence()
        kk.scatter_pages(dev_buf, k, v, slots_pages, PS)
        event = ops.record()
    pending = not event.query()
    torch.cuda.synchronize()
    again = kk.gather_pages(k, v, slots_pages, PS).cpu()
    return {"fenced": fenced, "replica_intact": bool(torch.equal(again.view(torch.int16), payload.view(torch.int16))),
            "event_pending_while_forward_ran": pending}


def capture_while_io_thread(what: str) -> dict:
    """A global-mode graph capture on this thread while another thread drops pinned buffers that asynchronous copies
    used (`what` = "drop": what the agent's I/O thread did before `HostSlots`), drops views of pinned buffers this
    thread keeps ("drop_views": what it does now), or allocates a pinned one ("pin_alloc")."""
    dev = torch.device("cuda")
    copy = torch.cuda.Stream()
    src = torch.full((1 << 18,), 0.25, device=dev)  # (no RNG: a failed capture can leave the generator capturing)
    bufs, kept = [], []
    for _ in range(64):
        h = torch.empty(src.numel() * 4, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(copy):
            h.copy_(src.view(torch.uint8), non_blocking=True)
        if what == "drop_views":  # the agent's `HostSlots`: this thread keeps the block, the other drops views
            kept.append(h)
            h = h[: h.numel() // 2].view(torch.uint8).reshape(-1)
        bufs.append(h)
    x = torch.full((2048, 2048), 0.5, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as PyTorch asks: cuBLAS's handle and workspace come at the first
        torch.tanh(x @ x * 1e-3)   # product, which a capture refuses (without it every first capture failed)
    torch.cuda.synchronize()
    errors: list[str] = []
    acted = threading.Event()

    def io() -> None:
        try:
            if what in ("drop", "drop_views"):
                while bufs:
                    bufs.pop()
                    time.sleep(0.0002)
            elif what == "nothing":
                time.sleep(0.01)
            else:
                torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        except Exception as exc:  # noqa: BLE001 (reported)
            errors.append(repr(exc))
        acted.set()

    graph, thread = torch.cuda.CUDAGraph(), threading.Thread(target=io)
    capture_error = None
    try:
        with torch.cuda.graph(graph, capture_error_mode="global"):
            thread.start()
            y = x
            while not acted.is_set():  # the capture lasts until the other thread has acted
                y = torch.tanh(y @ x * 1e-3)
        graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 (reported)
        capture_error = repr(exc)[:400]
    thread.join()
    try:
        torch.cuda.synchronize()
        usable_after = bool(torch.isfinite((x @ x).sum()).item())
    except Exception as exc:  # noqa: BLE001
        usable_after = repr(exc)[:200]
    return {"other_thread": what, "capture_ok": capture_error is None, "capture_error": capture_error,
            "other_thread_error": errors[0] if errors else None, "device_usable_after": usable_after}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to show")
        return 2
    out = {"device": torch.cuda.get_device_name(), "source": [source_hazard(f) for f in (True, False)],
           "target": [target_hazard(f) for f in (True, False)]}
    out["capture"] = []
    out["capture_warm_up"] = capture_while_io_thread("nothing")  # a first capture in a process can fail alone
    for what in ("drop_views", "drop", "pin_alloc"):
        try:
            out["capture"].append(capture_while_io_thread(what))
        except Exception as exc:  # noqa: BLE001 (reported)
            out["capture"].append({"other_thread": what, "error": repr(exc)[:400]})
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    fenced_ok = out["source"][0]["gather_saw_the_forwards_write"] and out["target"][0]["replica_intact"]
    print("fenced copies correct" if fenced_ok else "FENCED COPIES WRONG")
    print("hazard seen unfenced: source %s, target %s" % (not out["source"][1]["gather_saw_the_forwards_write"],
                                                         not out["target"][1]["replica_intact"]))
    print("global-mode capture, warm-up, no other thread: %s" % out["capture_warm_up"]["capture_ok"])
    for c in out["capture"]:
        print("global-mode capture while the other thread %s: %s" % (c["other_thread"], c.get("capture_ok", c)))
    views_ok = out["capture"][0].get("capture_ok") is True
    return 0 if fenced_ok and views_ok else 1


if __name__ == "__main__":
    sys.exit(main())
