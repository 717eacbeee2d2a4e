"""The worker agent: the extension inside one SGLang scheduler process, as two classes on two threads that talk
only through a typed mailbox.

    scheduler thread: WorkerAgent            Mailbox                  I/O thread: IoSide
    (scheduler_side.py, source_side.py)      (mailbox.py)             (io_side.py)
    ---------------------------              -------                  ------------------
    on_iteration: run commands     <---  Replicate, Install,     <--- coordinator: hello, facts (seq numbers),
                  expire replicas          Promote, Demote, Drop        resync, grants (ExpectReplica)
                  gather chunks            ChunksSent, SendCancelled   data plane: receive + verify transfers,
                  report load      --->  ToCoordinator,          --->   send gathered pages
    on_request_match: hit ------------->   PrefixMatched,               hash the matched prefix, PrefixHit,
                                           StartSend, ChunkGathered,    detect promotions
                                           Installed, InstallFailed,
                                           ReplicaRoom, Stop

One rule: the scheduler thread alone touches the radix tree, the allocator and the KV pool (between SGLang
iterations; on a GPU its copies run on the agent's own stream, fenced behind SGLang's forward stream and polled
by event, never waited for: `sglang_kvrep.device`); the I/O thread alone touches sockets and only host memory
whose copy is done. `start_agent` wires the two (the plugin calls it in the
scheduler process).
"""
from __future__ import annotations

import threading

from sglang_kvrep.agent.io_side import run_io_thread
from sglang_kvrep.agent.mailbox import Mailbox
from sglang_kvrep.agent.scheduler_side import WorkerAgent
from sglang_kvrep.compat import SchedulerView
from sglang_kvrep.config import KvrepConfig

__all__ = ["WorkerAgent", "start_agent"]


def start_agent(view: SchedulerView, config: KvrepConfig) -> WorkerAgent:
    """Build the scheduler side, start the I/O thread on the same mailbox, and return once it is up (or failed:
    then the agent is disabled and SGLang serves as usual)."""
    mailbox = Mailbox()
    agent = WorkerAgent(view, config, mailbox)
    # NOTE: receive buffers stay pageable (`StagingPool`): pinning them would make the I/O thread
    # allocate pinned memory, a CUDA call from another thread, which invalidates a CUDA-graph capture in global mode
    # (SGLang recaptures after a weight update); the I/O thread makes no CUDA call at all. The price: a GPU target's
    # upload of a transfer blocks the scheduler thread for the host-side copy (docs/gpu.md).
    thread = threading.Thread(target=run_io_thread, args=(config, agent.info, mailbox), name="kvrep-io",
                              daemon=True)
    agent.start(thread)
    return agent
