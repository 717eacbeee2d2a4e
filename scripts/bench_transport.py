"""Benchmark the worker->worker data plane against a raw TCP socket carrying the same bytes, in the same run.

Two processes on loopback: this one is the source, a spawned child the target. Geometry: Llama-3.1-8B on one
rank (32 layers, 8 KV heads, head_dim 128, bf16, page size 16), 128 KiB per token.

  raw    source `sendall`s the payload; target `recv_into`s a pre-faulted buffer and acks: the loopback ceiling.
  kvrep  the data plane's own code on both ends: the source sends the header and page chunks with
         `dataplane.wire.chunk_frames` (per-chunk xxh64, zero-copy frames, the agent's send-queue bound); the target
         runs the agent's receive path: `check_header`, a staging buffer from `StagingPool` (reused across
         transfers, as in the agent), `Incoming.add_chunk` (verify + stage every chunk), `Incoming.finish`, then
         `TransferAccepted`. The scheduler-side gather/scatter is not included (see docs/kernels.md).

    .venv/bin/python scripts/bench_transport.py --sizes 64M,1G --chunk-bytes 4M --repeats 3

Nothing here asserts a speed; results and their reading: docs/transport.md.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import shlex
import socket
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402
import zmq  # noqa: E402

from radix_sync import protocol as p  # noqa: E402
from sglang_kvrep.dataplane.checks import LocalGeometry, check_header  # noqa: E402
from sglang_kvrep.dataplane.staging import Incoming, StagingPool  # noqa: E402
from sglang_kvrep.dataplane.wire import chunk_frames  # noqa: E402

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


def target_main(zmq_port: int, tcp_port: int, ready) -> None:
    torch.set_num_threads(1)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 64)
    router.bind(f"tcp://127.0.0.1:{zmq_port}")
    lsock = socket.create_server(("127.0.0.1", tcp_port))
    ready.set()
    staging = StagingPool(2 << 30)
    raw_buf = None
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(lsock.fileno(), zmq.POLLIN)
    incoming: dict[str, Incoming] = {}
    while True:
        events = dict(poller.poll())
        if lsock.fileno() in events:
            conn, _ = lsock.accept()
            size = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "big")
            if size == 0:
                return
            if raw_buf is None or raw_buf.numel() < size:
                raw_buf = torch.zeros(size, dtype=torch.uint8)  # pre-faulted, like the reused staging buffer
            view = memoryview(raw_buf.numpy())[:size]
            got = 0
            while got < size:
                got += conn.recv_into(view[got:], size - got)
            conn.sendall(b"k")
            conn.close()
        if router in events:
            while True:
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                peer, msg = frames[0], p.decode_data_plane(frames[1].bytes)
                now = time.monotonic()
                if isinstance(msg, p.TransferHeader):
                    err = check_header(msg, GEOMETRY, free_replica_tokens=1 << 40)
                    assert err is None, err
                    incoming[msg.transfer_id] = Incoming(msg, peer, staging.acquire(msg.num_bytes), now, now)
                elif isinstance(msg, p.TransferChunk):
                    err = incoming[msg.transfer_id].add_chunk(msg, frames[2].buffer, now)
                    assert err is None, err
                elif isinstance(msg, p.TransferEnd):
                    inc = incoming.pop(msg.transfer_id)
                    assert inc.finish() is None
                    staging.release(inc.storage)
                    router.send_multipart([peer, p.encode(p.TransferAccepted(msg.transfer_id, 0))])


def run_raw(tcp_port: int, payload: torch.Tensor) -> float:
    data = memoryview(payload.numpy())
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", tcp_port)) as s:
        s.sendall(len(data).to_bytes(8, "big"))
        s.sendall(data)
        assert s.recv(1) == b"k"
    return time.perf_counter() - t0


def run_kvrep(sock: zmq.Socket, payload: torch.Tensor, chunk_bytes: int) -> float:
    h = header_for(payload.numel(), chunk_bytes)
    whole = payload[:h.num_bytes].view(NUM_LAYERS, h.num_pages, -1)
    t0 = time.perf_counter()
    sock.send(p.encode(h))
    for i in range(h.num_chunks):
        first = i * h.pages_per_chunk
        chunk = whole[:, first:first + h.pages_per_chunk].contiguous()  # what the source gathers per chunk
        sock.send_multipart(chunk_frames(h, i, chunk), copy=False)
    sock.send(p.encode(p.TransferEnd(h.transfer_id)))
    reply = p.decode_data_plane(sock.recv_multipart()[-1])
    assert isinstance(reply, p.TransferAccepted), reply
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64M,1G")
    ap.add_argument("--chunk-bytes", default="4M")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    zmq_port, tcp_port = 47811, 47812
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=target_main, args=(zmq_port, tcp_port, ready), daemon=True)
    child.start()
    ready.wait(60)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 16)
    sock.connect(f"tcp://127.0.0.1:{zmq_port}")
    chunk = parse_size(args.chunk_bytes)
    print(f"command: {' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}")
    print(f"{'size':>6} {'raw GB/s':>9} {'kvrep GB/s':>11} {'ratio':>6}   (best of {args.repeats})")
    try:
        for size_text in args.sizes.split(","):
            size = parse_size(size_text) // PAGE_BYTES * PAGE_BYTES
            payload = torch.randint(0, 256, (size,), dtype=torch.uint8)
            run_raw(tcp_port, payload), run_kvrep(sock, payload, chunk)  # warm-up (faults the target's buffers)
            raw, ours = [], []
            for _ in range(args.repeats):
                raw.append(run_raw(tcp_port, payload))
                ours.append(run_kvrep(sock, payload, chunk))
            raw_gbps, our_gbps = size / min(raw) / 1e9, size / min(ours) / 1e9
            print(f"{size_text:>6} {raw_gbps:9.2f} {our_gbps:11.2f} {our_gbps / raw_gbps:6.2f}")
            del payload
    finally:
        with socket.create_connection(("127.0.0.1", tcp_port)) as s:
            s.sendall((0).to_bytes(8, "big"))
        child.join(10)
        sock.close(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
