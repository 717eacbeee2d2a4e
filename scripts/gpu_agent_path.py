"""One replication through the real worker agent, end to end, on a GPU (issue 18 items 1 and 3): two agents (a
source and a target, each its own CUDA pool, `CudaOps` copy stream and a forward stream kept busy like SGLang's),
each with its real I/O thread and the real ZeroMQ data plane over loopback, and a stand-in coordinator (a ROUTER
speaking the real protocol: `HelloAck`, `ExpectReplica`, `ReplicatePages`). A prefix cached on the source is
replicated to the target; checked: the target's pages are bit-identical to the source's, the prefix is inserted
into the target's tree, the source's lock is released, no slot leaks; measured: the replication's wall time and
rate, the parts the target reports (receive, scatter, insert), and how long each scheduler step (`on_iteration`)
held the scheduler thread. On a GPU, each transfer also has the scheduler thread capture a CUDA graph in global
mode while it is in flight (as SGLang does after a weight update): a CUDA call from an agent's I/O thread would
invalidate it.

What is not real here: SGLang (not on the GPU image: its radix tree and allocator are stand-ins below, its
event-publisher base class a stub when SGLang cannot be imported) and its forwards (a `torch.cuda._sleep` of
`--forward-ms` per step on each worker's forward stream; the scheduler loop waits for the previous step's, as
SGLang's overlap scheduler does). Both agents and the loop share one Python process (one GIL; separate processes in
a real fleet): harsh to the rates, not generous.

    PYTHONPATH=kernels:. python3 scripts/gpu_agent_path.py --tokens 4096,32768 --json out.json      # CUDA
    PYTHONPATH=kernels:. python3 scripts/gpu_agent_path.py --device cpu --tokens 256 --layers 2      # CPU
"""
from __future__ import annotations

import argparse
import gc
import select
import json
import logging
import statistics
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "kernels"), str(ROOT)]


def _stub_sglang_if_absent() -> bool:
    """`sglang_kvrep.events` subclasses SGLang's event publisher at import; where SGLang is not installed (the GPU
    image) a bare base class stands in (nothing here publishes events). Returns whether it did."""
    try:
        import sglang.srt.disaggregation.kv_events  # noqa: F401
        return False
    except ImportError:
        pass
    names = ["sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.disaggregation.kv_events"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[names[-1]].EventPublisher = type("EventPublisher", (), {})
    return True


STUBBED = _stub_sglang_if_absent()

import msgspec  # noqa: E402,F401  (fails early and clearly where the image lacks it)
import zmq  # noqa: E402

from radix_sync import protocol as p  # noqa: E402
from radix_sync.hashing import page_hashes  # noqa: E402
from sglang_kvrep.agent import start_agent  # noqa: E402
from sglang_kvrep.config import KvrepConfig  # noqa: E402


class PoolView:
    """A stand-in for SGLang's scheduler as the agent sees it (`compat.SchedulerView`): a real pool of `layers` K
    and V buffers (rows = tokens, (heads, dim) each; page 0 is padding, as SGLang's), a page allocator, and a flat
    "tree" of inserted prefixes. Slots handed out live on the pool's device, as SGLang's do."""

    def __init__(self, device: torch.device, *, layers: int, heads: int, dim: int, dtype: torch.dtype,
                 page_size: int, capacity_tokens: int, seed: int, forward_stream=None) -> None:
        self.device, self.page_size = device, page_size
        self.num_pages = capacity_tokens // page_size + 1
        rows = self.num_pages * page_size
        gen = torch.Generator(device=device).manual_seed(seed)
        bits = torch.int16 if torch.empty((), dtype=dtype).element_size() == 2 else torch.int32

        def buf():
            return torch.randint(-2**15, 2**15 - 1, (rows, heads, dim), generator=gen, device=device,
                                 dtype=torch.int32).to(bits).view(dtype)

        self.k = [buf() for _ in range(layers)]
        self.v = [buf() for _ in range(layers)]
        self.free_pages = list(range(self.num_pages - 1, 0, -1))  # pop() hands out 1, 2, ...
        self.entries: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        self.locks: dict[str, int] = {}
        self.lock_count = self.unlock_count = 0
        self._forward = forward_stream

    # -- what the agent calls
    def fingerprint_fields(self):
        return {"model": "llama-3.1-8b-shaped", "dtype": str(self.k[0].dtype), "page_size": str(self.page_size)}

    def kv_buffers(self):
        return self.k, self.v, "NHD"

    def pool_capacity_tokens(self):
        return (self.num_pages - 1) * self.page_size

    def forward_stream(self):
        return self._forward

    def load_back_stream(self):
        return None

    def add_idle_wakeup(self, fd) -> None:
        pass

    def flush_kv_events(self) -> None:
        pass

    def is_idle(self) -> bool:
        return False

    def load(self):
        free = len(self.free_pages) * self.page_size
        return {"num_running_reqs": 1, "num_waiting_reqs": 0, "num_waiting_tokens": 0, "available_tokens": free,
                "evictable_tokens": 0}

    def waiting_wants(self, token_ids, namespace) -> bool:
        return False

    def match(self, token_ids, namespace):
        best, node = 0, None
        for i, (tokens, _) in enumerate(self.entries.get(namespace, [])):
            n = 0
            for a, b in zip(tokens, token_ids):
                if a != b:
                    break
                n += 1
            n = n // self.page_size * self.page_size
            if n > best:
                best, node = n, (namespace, i, n)
        return best, node

    def lock(self, node):
        self.lock_count += 1
        name = f"lock{self.lock_count}"
        self.locks[name] = 1
        return name

    def unlock(self, lock) -> None:
        del self.locks[lock]
        self.unlock_count += 1

    def path_slots(self, node):
        ns, i, n = node
        return self.entries[ns][i][1][:n]

    def alloc_slots(self, num_tokens: int) -> torch.Tensor:
        pages = -(-num_tokens // self.page_size)
        if pages > len(self.free_pages):
            raise RuntimeError("out of KV memory")
        ids = torch.tensor([self.free_pages.pop() for _ in range(pages)], dtype=torch.int64)
        slots = (ids[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)[:num_tokens]
        return slots.to(self.device)

    def free_slots(self, slots: torch.Tensor) -> None:
        pages = sorted(set((slots.cpu() // self.page_size).tolist()))
        self.free_pages.extend(reversed(pages))

    def insert(self, token_ids, namespace, slots, priority) -> int:
        self.entries.setdefault(namespace, []).append((tuple(token_ids), slots))
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    # -- the harness's
    def cache(self, token_ids) -> torch.Tensor:
        """Cache `token_ids` (a prefill): slots from the allocator, the pool's random bytes as its KV."""
        slots = self.alloc_slots(len(token_ids))
        self.insert(token_ids, "", slots, 0)
        return slots

    def pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The bytes of the pool rows at `slots`, every layer's K and V (on the host)."""
        idx = slots.to(self.device)
        return torch.stack([torch.stack([k[idx], v[idx]]) for k, v in zip(self.k, self.v)]).cpu()


class Coordinator:
    """The coordinator's side of the protocol, enough for one replication at a time."""

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.workers: dict[str, tuple[bytes, p.Hello]] = {}
        self.facts: list = []

    def poll(self) -> None:
        while self.sock.poll(0):
            rid, data = self.sock.recv_multipart()
            msg = p.decode_for_coordinator(data)
            if isinstance(msg, p.Hello):
                self.workers[msg.worker_id] = (rid, msg)
                self.sock.send_multipart([rid, p.encode(p.HelloAck(coordinator_id="gpu-agent-path"))])
            else:
                self.facts.append(msg)

    def send(self, worker_id: str, msg) -> None:
        self.sock.send_multipart([self.workers[worker_id][0], p.encode(msg)])

    def fact(self, kind, replication_id: str):
        for f in self.facts:
            if isinstance(f, kind) and getattr(f, "replication_id", None) == replication_id:
                return f
        return None


IDLE_POLL_S = 0.05
SLEEP_CLOCK_HZ = 1.98e9
"""The H200's boost clock: `torch.cuda._sleep` counts cycles (the steps' real length is measured: loop_step_ms)."""


class Loop:
    """The scheduler loops of both workers, on this thread: each step queues a forward (`forward_ms` on the
    worker's forward stream), runs the agent's `on_iteration` (timed), then waits for the previous step's
    forward (overlap scheduling: the CPU runs one step ahead of the device). With no forwards (idle workers) it
    sleeps on the agents' bells between steps, as SGLang's idle poller does with `--sleep-on-idle` (it spun before:
    holding the GIL, it starved the I/O threads, and a 4 GiB replica took 3-82 s from one run to the next)."""

    def __init__(self, workers, forward_ms: float, device: torch.device) -> None:
        self.workers = workers  # [(agent, view, forward stream)]
        self.cuda = device.type == "cuda"
        self.cycles = int(forward_ms * 1e-3 * SLEEP_CLOCK_HZ) if self.cuda and forward_ms > 0 else 0
        self.prev: list = []
        self.step_s: dict[str, list[float]] = {a.config.worker_id: [] for a, _, _ in workers}
        self.syncs: Optional[dict[str, int]] = {} if self.cuda else None
        """Synchronizing CUDA calls PyTorch saw in the source's steps (where, how often)."""
        self.loop_s: list[float] = []
        """Whole steps (both agents and the wait for the previous forwards): the forwards' pace as it was."""
        self.steps = 0

    def step(self) -> None:
        t_step = time.perf_counter()
        events = []
        for agent, view, fwd in self.workers:
            if self.cuda and self.cycles:
                with torch.cuda.stream(fwd):
                    torch.cuda._sleep(self.cycles)
                    ev = torch.cuda.Event()
                    ev.record(fwd)
                    events.append(ev)
            t0 = time.perf_counter()
            if self.syncs is not None and agent is self.workers[0][0]:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        agent.on_iteration_safe()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                for w in seen:
                    key = f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:120]}"
                    self.syncs[key] = self.syncs.get(key, 0) + 1
            else:
                agent.on_iteration_safe()
            self.step_s[agent.config.worker_id].append(time.perf_counter() - t0)
        for ev in self.prev:
            ev.synchronize()
        self.prev = events
        self.steps += 1
        if not events:  # idle: sleep in the poller until a bell rings, as SGLang's `--sleep-on-idle` does
            select.select([a.mailbox.scheduler_bell_fd for a, _, _ in self.workers], [], [], IDLE_POLL_S)
        self.loop_s.append(time.perf_counter() - t_step)

    def drain(self) -> None:
        for ev in self.prev:
            ev.synchronize()
        self.prev = []


class PartTimes:
    """Wall time of the source's parts on the scheduler thread (which one holds it under busy forwards?), and the
    synchronizing CUDA calls PyTorch sees there (`torch.cuda.set_sync_debug_mode("warn")`)."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = {}
        self.syncs: dict[str, int] = {}
        self._undo: list = []

    def wrap(self, owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                self.parts.setdefault(label, []).append(time.perf_counter() - t0)

        setattr(owner, name, timed)
        self._undo.append((owner, name, real))

    def restore(self) -> None:
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)
        self._undo.clear()

    def summary(self) -> dict:
        return {k: {"n": len(v), "total_ms": round(sum(v) * 1e3, 2), "max_ms": round(max(v) * 1e3, 3)}
                for k, v in self.parts.items()}


def instrument(times: PartTimes) -> None:
    import kvrep_kernels.triton_copy as tc
    from sglang_kvrep import device as dv
    from sglang_kvrep.agent import source_side as ss

    times.wrap(ss, "gather_pages", "gather_pages")
    times.wrap(ss, "host_copy", "host_copy")
    times.wrap(ss.SourceSide, "_issue_chunk", "issue_chunk")
    times.wrap(ss.SourceSide, "_hand_done", "hand_done")
    times.wrap(dv.HostSlots, "take", "slot_take")
    times.wrap(dv.CudaOps, "fence", "fence")
    times.wrap(dv.CudaOps, "record", "record")
    times.wrap(dv.CudaOps, "to_host", "to_host")
    times.wrap(tc, "copy_pages", "copy_pages")
    times.wrap(tc, "_chunks", "plan_chunks")


def capture_now(device: torch.device, seconds: float = 0.2, mode: str = "global") -> str:
    """What SGLang's scheduler thread does after a weight update: capture a CUDA graph in global mode (here for
    `seconds`, while both agents' I/O threads go on sending and receiving). Returns "ok" or the error."""
    x = torch.full((1024, 1024), 0.5, device=device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up before capturing, as PyTorch asks: cuBLAS's handle and workspace
        torch.tanh(x @ x * 1e-3)   # are made at the first product, which a capture refuses
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(graph, capture_error_mode=mode):
            y, end = x, time.perf_counter() + seconds
            while time.perf_counter() < end:
                y = torch.tanh(y @ x * 1e-3)
        graph.replay()
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # noqa: BLE001 (reported)
        return "FAILED: " + repr(exc)[:300]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run_case(args, device: torch.device, tokens: int, page_size: int, forward_ms: float, coord: Coordinator,
             case: int) -> dict:
    dtype = getattr(torch, args.dtype)
    streams = [torch.cuda.Stream(device=device) if device.type == "cuda" else None for _ in range(2)]
    geo = dict(layers=args.layers, heads=args.heads, dim=args.head_dim, dtype=dtype, page_size=page_size,
               capacity_tokens=tokens + 4 * page_size * 64)
    src_view = PoolView(device, seed=1, forward_stream=streams[0], **geo)
    dst_view = PoolView(device, seed=2, forward_stream=streams[1], **geo)
    names = (f"src{case}", f"dst{case}")
    t0 = time.perf_counter()
    agents = []
    for name, view in zip(names, (src_view, dst_view)):
        num_bytes = tokens * args.layers * 2 * args.heads * args.head_dim * dtype.itemsize
        cfg = KvrepConfig(coordinator=coord.endpoint, worker_id=name, http_url="http://127.0.0.1:1",
                          replica_budget_tokens=tokens + page_size, transfer_timeout_s=args.timeout_s,
                          load_interval_s=3600.0,
                          staging_bytes=num_bytes + (1 << 20) if args.pinned_staging else 256 << 20)
        agents.append(start_agent(view, cfg))
    start_s = time.perf_counter() - t0  # kernel warm-up (compiling the copy kernels) included
    src, dst = agents
    loop = Loop([(src, src_view, streams[0]), (dst, dst_view, streams[1])], forward_ms, device)
    deadline = time.monotonic() + 60
    while not all(n in coord.workers for n in names):
        coord.poll()
        loop.step()
        if time.monotonic() > deadline:
            raise RuntimeError("the agents never said hello")
    token_ids = list(range(1000, 1000 + tokens))
    src_slots = src_view.cache(token_ids)
    dst_free_before = len(dst_view.free_pages)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rid = f"rep{case}"
    coord.send(names[1], p.ExpectReplica(replication_id=rid, source_id=names[0], namespace="", page_size=page_size,
                                         block_hashes=page_hashes(token_ids, page_size, ""), auth_token="tok",
                                         expires_in_s=120.0))
    while coord.fact(p.ReplicaExpected, rid) is None:
        coord.poll()
        loop.step()
        if time.monotonic() > deadline:
            raise RuntimeError("the target never acknowledged the grant")
    for s in [*loop.step_s.values(), loop.loop_s]:
        s.clear()
    times = PartTimes()
    instrument(times)
    if loop.syncs is not None:
        loop.syncs.clear()
    steps0 = loop.steps
    t_start = time.perf_counter()
    coord.send(names[0], p.ReplicatePages(replication_id=rid, auth_token="tok", token_ids=token_ids, namespace="",
                                          target_id=names[1], target_endpoint=coord.workers[names[1]][1].data_endpoint,
                                          target_fingerprint=coord.workers[names[1]][1].fingerprint, ttl_s=300.0))
    deadline = time.monotonic() + args.timeout_s
    stored = failed = sent = None
    capture = local = gc_off = "not run" if device.type == "cuda" and args.capture_at_s > 0 else None
    while time.monotonic() < deadline:
        coord.poll()
        if capture == "not run" and time.perf_counter() - t_start >= args.capture_at_s:
            capture = capture_now(device) if stored is None else "the replication had ended"
        elif local == "not run" and time.perf_counter() - t_start >= args.capture_at_s + 0.3:
            # thread-local mode: another thread's unsafe call no longer counts, this thread's own still does
            local = capture_now(device, mode="thread_local") if stored is None else "the replication had ended"
        elif gc_off == "not run" and time.perf_counter() - t_start >= args.capture_at_s + 0.6:
            # global again with Python's cyclic collector off: is it a collection on another thread freeing
            # CUDA objects?
            gc.disable()
            try:
                gc_off = capture_now(device) if stored is None else "the replication had ended"
            finally:
                gc.enable()
        loop.step()
        stored = coord.fact(p.ReplicaStored, rid)
        failed = coord.fact(p.ReplicationFailed, rid)
        sent = sent or coord.fact(p.SourceSent, rid)
        if stored is not None or failed is not None:
            break
    wall_s = time.perf_counter() - t_start
    steps = loop.steps - steps0
    while time.monotonic() < deadline and (src.gathers or dst.replicas.pending or sent is None) and failed is None:
        coord.poll()  # the source's lock goes once its last copy is done; SourceSent may trail the install
        loop.step()
        sent = sent or coord.fact(p.SourceSent, rid)
    loop.drain()
    times.restore()
    out = {"source_parts": times.summary(), "source_sync_calls": dict(loop.syncs or {}),"tokens": tokens, "page_size": page_size, "forward_ms": forward_ms, "start_s": round(start_s, 3),
           "capture_during_transfer": capture, "capture_thread_local_during_transfer": local,
           "capture_gc_off_during_transfer": gc_off,
           "num_bytes": tokens * args.layers * 2 * args.heads * args.head_dim * dtype.itemsize}
    if stored is None:
        out["error"] = failed.error if failed is not None else "timed out"
        out["ok"] = False
    else:
        [(_, dst_slots)] = dst_view.entries[""]
        same = torch.equal(dst_view.pages_of(dst_slots).view(torch.uint8),
                           src_view.pages_of(src_slots).view(torch.uint8))
        out.update({
            "identical": same, "inserted_len": stored.inserted_len, "wall_s": round(wall_s, 3),
            "gb_per_s": round(out["num_bytes"] / wall_s / 1e9, 3), "receive_s": round(stored.receive_s, 3),
            "scatter_s": round(stored.scatter_s, 4), "insert_s": round(stored.insert_s, 4),
            "source_gather_s": round(sent.gather_s, 3) if sent else None,
            "source_send_s": round(sent.send_s, 3) if sent else None,
            "scheduler_steps": steps,
            "loop_step_ms_median": round(statistics.median(loop.loop_s) * 1e3, 3) if loop.loop_s else 0.0,
            "step_ms": {w: {"median": round(statistics.median(s) * 1e3, 3) if s else 0.0,
                            "p99": round(percentile(s, 0.99) * 1e3, 3), "max": round(max(s, default=0) * 1e3, 3)}
                        for w, s in loop.step_s.items()},
            "source_host_slots": len(src._host_slots.slots) if src._host_slots is not None else 0,
            "target_pinned_staging": bool(args.pinned_staging and device.type == "cuda"),
            "source_locks_left": len(src_view.locks), "source_jobs_left": len(src.gathers),
            "target_installs_left": len(dst.replicas.pending),
            "target_pages_used": dst_free_before - len(dst_view.free_pages),
            "target_pages_expected": -(-tokens // page_size),
        })
        out["ok"] = bool(same and stored.inserted_len == tokens and not src_view.locks and not src.gathers
                         and not dst.replicas.pending and out["target_pages_used"] == out["target_pages_expected"])
    for a in agents:
        a.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", default="4096,32768", help="prefix lengths, one case each")
    ap.add_argument("--page-sizes", default="16")
    ap.add_argument("--forward-ms", default="0,5", help="forward step lengths to run each case under (CUDA only)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--timeout-s", type=float, default=90.0)
    ap.add_argument("--pinned-staging", action=argparse.BooleanOptionalAction, default=True,
                    help="size --kvrep-staging-bytes to the replica (the target receives into pinned memory and "
                         "uploads in one asynchronous copy); --no-pinned-staging: the 256 MiB default")
    ap.add_argument("--capture-at-s", type=float, default=0.2,
                    help="capture a CUDA graph in global mode on the scheduler thread this long into each transfer "
                         "(0: never)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    coord = Coordinator()
    controls = {}
    if device.type == "cuda" and args.capture_at_s > 0:  # the capture itself, with no agent in the process
        controls = {"first_capture_no_agents": capture_now(device), "second_capture_no_agents": capture_now(device)}
        print(json.dumps(controls), flush=True)
    results, case = [], 0
    forwards = [float(x) for x in args.forward_ms.split(",")] if device.type == "cuda" else [0.0]
    for ps in (int(x) for x in args.page_sizes.split(",")):
        for n in (int(x) for x in args.tokens.split(",")):
            for fwd in forwards:
                try:
                    res = run_case(args, device, n, ps, fwd, coord, case)
                except Exception as exc:  # one case failing does not stop the next
                    logging.exception("case %d failed", case)
                    res = {"tokens": n, "page_size": ps, "forward_ms": fwd, "ok": False, "error": repr(exc)}
                case += 1
                results.append(res)
                print(json.dumps(res), flush=True)
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "sglang_stubbed": STUBBED,
           "capture_controls": controls, "cases": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print("%-7s %-4s %-6s %-9s %-8s %-8s %-10s %-10s %s" % ("tokens", "ps", "fwd_ms", "identical", "wall_s", "GB/s",
                                                          "src_p99ms", "dst_p99ms", "ok"))
    for r in results:
        if r.get("capture_during_transfer"):
            print("tokens %s fwd %s: capture during the transfer: global %s; thread-local %s; gc off %s" % (
                r["tokens"], r["forward_ms"], r["capture_during_transfer"][:60],
                str(r.get("capture_thread_local_during_transfer"))[:60],
                str(r.get("capture_gc_off_during_transfer"))[:60]))
    for r in results:
        steps = r.get("step_ms", {})
        p99 = [v["p99"] for v in steps.values()] or ["-", "-"]
        print("%-7s %-4s %-6s %-9s %-8s %-8s %-10s %-10s %s" % (
            r["tokens"], r["page_size"], r["forward_ms"], r.get("identical", "-"), r.get("wall_s", "-"),
            r.get("gb_per_s", "-"), p99[0], p99[-1], r["ok"] or r.get("error")))
    captures_ok = all(r.get("capture_during_transfer") in (None, "ok", "not run", "the replication had ended")
                      for r in results)
    return 0 if all(r["ok"] for r in results) and captures_ok else 1


if __name__ == "__main__":
    sys.exit(main())
