"""A stub worker *agent* (no SGLang, no model) for the ZMQ planes' component tests: the real I/O side
(`sglang_kvrep.agent.io_side.IoSide`: the coordinator link and the data port) on its own thread, fed by a main
thread that plays the scheduler side: it caches `--pages-per-s` new pages (SGLang's KV events, chained page hashes
as SGLang computes them) and reports its load every 0.2 s. SIGUSR1 stops making pages (the link stays up).

Every 0.2 s it writes its numbers to `--stats` (JSON, replaced atomically): the data endpoint, the pages it holds,
the I/O side's link counters (hellos sent, facts dropped during an outage, coordinator restarts seen, stale resync
requests ignored), the data port's transfers under way and staging (bytes cached, tokens reserved), and the
commands the I/O side handed the scheduler side (by type; a stub executes none). Run:
`python -m kvrep_dev.stub_agent --coordinator tcp://127.0.0.1:5600 --worker-id w0 --stats /tmp/w0.json
[--keys DIR --key-name worker-0]`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

from radix_sync import protocol as p
from radix_sync.hashing import page_hashes
from sglang_kvrep import events
from sglang_kvrep.agent import mailbox as m
from sglang_kvrep.agent.io_side import IoSide
from sglang_kvrep.compat import KvStored
from sglang_kvrep.config import KvrepConfig
from sglang_kvrep.dataplane.checks import LocalGeometry

GEOMETRY = LocalGeometry("stub-fp", 4, "torch.bfloat16", "NHD", (2, 4, 2, 8), num_layers=3, itemsize=2)
"""768 bytes per page, as the transport tests use."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--worker-id", default="")
    ap.add_argument("--keys", default="")
    ap.add_argument("--key-name", default="")
    ap.add_argument("--stats", required=True)
    ap.add_argument("--pages-per-s", type=float, default=200.0)
    ap.add_argument("--max-pages", type=int, default=20_000)
    args = ap.parse_args()
    config = KvrepConfig(coordinator=args.coordinator, worker_id=args.worker_id, http_url="http://127.0.0.1:9",
                         keys=args.keys, key_name=args.key_name)
    if not config.worker_id:  # with keys: the id the key names
        from radix_sync.keys import load_dir

        config = dataclasses.replace(config, worker_id=load_dir(args.keys).pair(args.key_name).worker_id)
    info = m.WorkerInfo(fingerprint=GEOMETRY.fingerprint, fingerprint_fields={}, page_size=GEOMETRY.page_size,
                        pool_capacity_tokens=1 << 20, replica_budget_tokens=1 << 18, free_replica_tokens=1 << 18,
                        geometry=GEOMETRY)
    mailbox = m.Mailbox()
    built = threading.Event()
    holder: list[IoSide] = []

    def io_main() -> None:
        holder.append(IoSide(config, info, mailbox))
        built.set()
        holder[0].run()

    io_thread = threading.Thread(target=io_main, name="kvrep-io", daemon=True)
    io_thread.start()
    built.wait(30)
    io = holder[0]
    making = threading.Event()
    making.set()
    signal.signal(signal.SIGUSR1, lambda *_: making.clear())
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())

    ps = GEOMETRY.page_size
    tokens = [7 + i % 30_000 for i in range(args.max_pages * ps)]
    hashes = page_hashes(tokens, ps, "")
    made = 0
    commands: dict[str, int] = {}
    t0 = time.monotonic()
    next_stats = next_load = 0.0
    while not stopped.is_set():
        now = time.monotonic()
        due = min(args.max_pages, int((now - t0) * args.pages_per_s))
        if making.is_set() and due > made:
            blocks = [(hashes[i], hashes[i - 1] if i else None, tokens[i * ps:(i + 1) * ps]) for i in range(made, due)]
            events.SINK.append(KvStored(namespace="", blocks=blocks, medium="GPU"))
            made = due
            mailbox.wake_io()
        if now >= next_load:
            next_load = now + 0.2
            mailbox.post_to_io(m.ToCoordinator(p.LoadReported(
                worker_id=config.worker_id, seq=0, num_running_reqs=0, num_waiting_reqs=0, num_waiting_tokens=0,
                available_tokens=1 << 20, evictable_tokens=0, replica_tokens=0)))
        while (cmd := mailbox.take_for_scheduler()) is not None:  # commands: a stub executes none, counts them
            commands[type(cmd).__name__] = commands.get(type(cmd).__name__, 0) + 1
        mailbox.clear_bell()
        if now >= next_stats:
            next_stats = now + 0.2
            _write_stats(Path(args.stats), {"worker_id": config.worker_id, "data_endpoint": io.transport.endpoint,
                                            "pages_made": made, "making": making.is_set(), "pages_held": len(io.mirror),
                                            "transfers_incoming": len(io.transport.incoming),
                                            "staging_cached_bytes": io.transport.staging.cached_bytes(),
                                            "staging_reserved_tokens": io.staged.held_tokens(),
                                            "commands": dict(commands), **dict(io.stats)})
        time.sleep(0.01)
    mailbox.post_to_io(m.Stop())
    # NOTE: the I/O thread closes its sockets on the way out; an exit before that hung in ZeroMQ's context
    # teardown (a keyed stub took its 20 s stop timeout and a SIGKILL, 40 s of every keyed test's teardown)
    io_thread.join(10)


def _write_stats(path: Path, stats: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stats))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
