"""Benchmark the worker->worker data plane against a raw TCP socket carrying the same bytes, in the same run.

Two processes on loopback: this one is the source, a spawned child the target. Geometry: Llama-3.1-8B on one
rank (32 layers, 8 KV heads, head_dim 128, bf16, page size 16), 128 KiB per token.

  raw    source `sendall`s the payload; target `recv_into`s a pre-faulted buffer and acks: the loopback ceiling.
  zmq    the agent's own transport object on both ends (`ZmqTransport`, `--kvrep-transport zmq`): the source
         gathers each chunk (a contiguous copy of its pages of every layer into a reused host slot, as a CPU
         pool's scheduler thread does: `HostSlots`, `CPU_HOST_SLOTS`), at most 4 chunks ahead of the wire, and
         `push_chunk`s it; the transport sends it zero-copy with its xxh3
         checksum; the target verifies and stages every chunk (`StagingPool`, reused) and answers as soon as
         the transfer is whole (`TransferReceived` -> `answer`). Timed from `send` to the reply consumed.
  nixl   the same with `NixlTransport` (`--kvrep-transport nixl`): ZMQ control, each chunk WRITTEN by NIXL (UCX)
         straight into the target's registered staging buffer, checksummed there in place.
  mooncake the same with `MooncakeTransport` (`--kvrep-transport mooncake`): each chunk WRITTEN by Mooncake
         Transfer Engine (its TCP transport here; RDMA where the host has devices).
  The scheduler-side scatter/insert is not included (see docs/kernels.md).

    .venv/bin/python scripts/bench_transport.py --sizes 64M,1G --repeats 5
    .venv/bin/python scripts/bench_transport.py --transports nixl --ucx-tls tcp   # NIXL over UCX's TCP

`--ucx-tls` sets UCX_TLS for both processes (UCX picks shared memory between two processes of one host by
default; `tcp` forces its TCP transport, the path two hosts without RDMA would take). Nothing here asserts a speed;
results and their reading: docs/transport.md.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shlex
import socket
import statistics
import sys
import time
import uuid
from typing import Optional
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402
import zmq  # noqa: E402

from radix_sync import protocol as p  # noqa: E402
from sglang_kvrep.agent.source_side import CPU_HOST_SLOTS, MAX_AHEAD  # noqa: E402
from sglang_kvrep.config import KvrepConfig  # noqa: E402
from sglang_kvrep.dataplane.checks import LocalGeometry  # noqa: E402
from sglang_kvrep.dataplane.registry import make_transport  # noqa: E402
from sglang_kvrep.dataplane.transport import TransferFailed, TransferReceived  # noqa: E402
from sglang_kvrep.device import HostSlots, SyncOps  # noqa: E402

PAGE_SIZE, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 16, 32, 8, 128
GEOMETRY = LocalGeometry(fingerprint="bench", page_size=PAGE_SIZE, dtype="torch.bfloat16", layout="NHD",
                         page_shape=(2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM), num_layers=NUM_LAYERS, itemsize=2)
PAGE_BYTES = GEOMETRY.num_bytes(1)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def header_for(num_bytes: int, chunk_bytes: int) -> p.TransferHeader:
    num_pages = max(1, num_bytes // PAGE_BYTES)
    per_chunk = max(1, chunk_bytes // PAGE_BYTES)
    return p.TransferHeader(
        transfer_id=uuid.uuid4().hex[:12], replication_id="bench", auth_token="t", source_id="bench",
        fingerprint="bench", namespace="", token_ids=list(range(num_pages * PAGE_SIZE)), page_size=PAGE_SIZE,
        num_pages=num_pages, dtype="torch.bfloat16", layout="NHD", buffer_shape=GEOMETRY.buffer_shape(num_pages),
        num_bytes=GEOMETRY.num_bytes(num_pages), pages_per_chunk=per_chunk, num_chunks=-(-num_pages // per_chunk),
        checksum_kind="xxh3", ttl_s=60.0)


def config(port: int = 0) -> KvrepConfig:
    return KvrepConfig(data_port=port, staging_bytes=2 << 30, transfer_timeout_s=120.0)


def target_main(names: list, conn, ucx_tls: str) -> None:
    """The receiving side. Every socket binds a port the kernel picks (a fixed port can be taken on a busy host);
    the endpoints go back to the parent over `conn`."""
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    torch.set_num_threads(1)
    ctx = zmq.Context()
    poller = zmq.Poller()
    received: list = []

    def on_event(ev) -> None:
        if isinstance(ev, TransferReceived):
            received.append(ev.incoming)
        elif isinstance(ev, TransferFailed):
            print(f"target: {ev}", file=sys.stderr, flush=True)

    transports = [make_transport(name, config(), lambda h: None, on_event, ctx, poller) for name in names]
    lsock = socket.create_server(("127.0.0.1", 0))
    poller.register(lsock.fileno(), zmq.POLLIN)
    conn.send((lsock.getsockname()[1], {t.name: t.endpoint for t in transports}))
    conn.close()
    raw_buf = None
    wait_s = 0.5
    while True:
        events = dict(poller.poll(max(0.0, wait_s) * 1000))
        if lsock.fileno() in events:
            conn, _ = lsock.accept()
            size = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "big")
            if size == 0:
                for t in transports:
                    t.close()
                return
            if raw_buf is None or raw_buf.numel() < size:
                raw_buf = torch.zeros(size, dtype=torch.uint8)  # pre-faulted, like the reused staging buffer
            view = memoryview(raw_buf.numpy())[:size]
            got = 0
            while got < size:
                got += conn.recv_into(view[got:], size - got)
            conn.sendall(b"k")
            conn.close()
        wait_s = min(t.progress(events) for t in transports)
        for t in transports:
            for inc in [i for i in received if i.header.transport == t.name]:  # each transport answers its own
                received.remove(inc)
                t.answer(inc, inserted_len=0)


def run_raw(tcp_port: int, payload: torch.Tensor) -> float:
    data = memoryview(payload.numpy())
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", tcp_port)) as s:
        s.sendall(len(data).to_bytes(8, "big"))
        s.sendall(data)
        assert s.recv(1) == b"k"
    return time.perf_counter() - t0


class Source:
    """One transport of this process, driven as the agent's I/O side drives it."""

    def __init__(self, name: str, ctx: zmq.Context, endpoint: str) -> None:
        self.poller = zmq.Poller()
        self.events: list = []
        self.t = make_transport(name, config(), lambda h: None, self.events.append, ctx, self.poller)
        self.endpoint = endpoint
        self.slots: Optional[HostSlots] = None

    def run(self, payload: torch.Tensor, chunk_bytes: int) -> float:
        if self.slots is None or self.slots.slot_bytes != chunk_bytes // PAGE_BYTES * PAGE_BYTES:
            self.slots = HostSlots(SyncOps(), chunk_bytes // PAGE_BYTES * PAGE_BYTES, CPU_HOST_SLOTS)
        return self._run(payload, chunk_bytes)

    def _run(self, payload: torch.Tensor, chunk_bytes: int) -> float:
        h = header_for(payload.numel(), chunk_bytes)
        whole = payload[:h.num_bytes].view(NUM_LAYERS, h.num_pages, -1)
        t0 = time.perf_counter()
        self.t.send(h, self.endpoint)
        gathered, wait_s = 0, 0.0
        while h.transfer_id in self.t.outgoing:
            sent = self.t.outgoing[h.transfer_id].num_sent
            pushed = False
            while gathered < h.num_chunks and gathered - sent < MAX_AHEAD:  # the agent's gather-ahead bound
                first = gathered * h.pages_per_chunk
                part = whole[:, first:first + h.pages_per_chunk]
                slot = self.slots.take(part.numel())
                if slot is None:  # every slot still read by a frame libzmq has not let go of: as the agent waits
                    break
                self.t.push_chunk(h.transfer_id, gathered, slot.view(part.shape).copy_(part), 0)
                gathered += 1
                pushed = True
            # as the agent's I/O loop: a gathered chunk wakes it at once (its mailbox), else it sleeps in the poller
            timeout_ms = 0 if pushed else max(0.0, min(wait_s, 0.05)) * 1000
            wait_s = self.t.progress(dict(self.poller.poll(timeout_ms)))
        dt = time.perf_counter() - t0
        failed = [e for e in self.events if isinstance(e, TransferFailed)]
        assert not failed, failed
        self.events.clear()
        return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64M,1G")
    ap.add_argument("--chunk-bytes", default="4M")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transports", default="zmq,nixl,mooncake", help="comma-separated registered transports")
    ap.add_argument("--ucx-tls", default="", help="UCX_TLS for both processes (e.g. tcp); default: UCX's choice")
    args = ap.parse_args()
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    torch.set_num_threads(1)
    names = args.transports.split(",")
    mctx = mp.get_context("spawn")
    parent_end, child_end = mctx.Pipe(duplex=False)
    child = mctx.Process(target=target_main, args=(names, child_end, args.ucx_tls), daemon=True)
    child.start()
    child_end.close()
    try:
        tcp_port, endpoints = parent_end.recv()  # EOFError at once if the target died before it was ready
    except EOFError:
        child.join(10)
        raise SystemExit(f"the target process ended before it was ready (exit code {child.exitcode})") from None
    ctx = zmq.Context.instance()
    sources = {name: Source(name, ctx, endpoints[name]) for name in names}
    chunk = parse_size(args.chunk_bytes)
    print(f"command: {' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}")
    print(f"{'size':>6} {'raw GB/s':>9} " + " ".join(f"{n + ' GB/s':>10} {'ratio':>6} {'(median)':>8}" for n in names)
          + f"   (best of {args.repeats}, rounds interleaved; ratio = to raw TCP)")
    try:
        for size_text in args.sizes.split(","):
            size = parse_size(size_text) // PAGE_BYTES * PAGE_BYTES
            if size == 0:
                raise SystemExit(f"--sizes: {size_text} is less than one page ({PAGE_BYTES} bytes)")
            payload = torch.randint(0, 256, (size,), dtype=torch.uint8)
            run_raw(tcp_port, payload)  # warm-up (faults the target's buffers, registers NIXL's)
            for src in sources.values():
                src.run(payload, chunk)
            raw, ours = [], {name: [] for name in names}
            for _ in range(args.repeats):
                raw.append(run_raw(tcp_port, payload))
                for name, src in sources.items():
                    ours[name].append(src.run(payload, chunk))
            raw_gbps = size / min(raw) / 1e9
            cells = []
            for name in names:
                best = size / min(ours[name]) / 1e9
                ratios = [r / o for r, o in zip(raw, ours[name])]  # per round: raw time / this time
                cells.append(f"{best:10.2f} {best / raw_gbps:6.2f} {statistics.median(ratios):8.2f}")
            print(f"{size_text:>6} {raw_gbps:9.2f} " + " ".join(cells), flush=True)
            del payload
    finally:
        with socket.create_connection(("127.0.0.1", tcp_port)) as s:
            s.sendall((0).to_bytes(8, "big"))
        child.join(10)
        for src in sources.values():
            src.t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
