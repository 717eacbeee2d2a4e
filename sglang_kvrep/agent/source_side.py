"""The source side of a replication, on SGLang's scheduler thread: lock the cached prefix, gather its pages chunk by
chunk on the agent's copy stream (`sglang_kvrep.device`), hand finished host memory to the I/O side, release the
prefix when every copy is done. A mixin of `sglang_kvrep.agent.scheduler_side.WorkerAgent` (its state is the
agent's: `gathers`, `sent_chunks`, `cancelled`, `view`, `ops`, `config`)."""
from __future__ import annotations

import collections
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from kvrep_kernels import gather_pages, slots_to_page_ids
from radix_sync import protocol as p
from sglang_kvrep.agent import mailbox as m
from sglang_kvrep.device import HostSlots, host_copy

log = logging.getLogger("kvrep.agent")
MAX_AHEAD = 4
"""Chunks a source gathers ahead of what the I/O thread has sent (bounds memory under a bandwidth cap)."""
GATHER_SLICE_S = 0.005
"""Scheduler-thread time a source spends gathering per iteration."""
GATHER_BATCH_BYTES = 64 << 20
"""With asynchronous copies, one gather covers up to this many bytes of chunks (each then copied to its own host
slot): issuing a gather costs ~1.6 ms of the scheduler thread (Python: plan, tables, Triton's launcher; measured on
an H200 with 4 MiB chunks), which paced a source at ~2 GB/s and took the whole `GATHER_SLICE_S` of every step."""
DEVICE_AHEAD_BYTES = 256 << 20
"""With asynchronous copies (a GPU pool) the bound is bytes of pinned host memory instead: a launch takes
microseconds of the scheduler thread, and 4 chunks a step would pace a 4 GiB replica by the scheduler's steps
(~16 MiB a step) instead of the link. It is also the most pinned memory the chunks take, over all jobs
(`HostSlots`, allocated when the agent starts and kept)."""


CPU_HOST_SLOTS = 32
"""With synchronous copies (a CPU pool) chunks are gathered straight into reused host slots as well: at most this
many, allocated as needed and kept. They cover a job's gather-ahead (`MAX_AHEAD`) plus a peer's send queue
(`SNDHWM` 16) and pyzmq's late release of frames already sent. A fresh 4 MiB buffer per chunk cost its page faults on
the scheduler thread each time, and the source's side of a transfer ~0.05-0.1x of raw TCP's rate
(docs/transport.md, "Gathering into reused buffers")."""


def ahead_chunks(chunk_bytes: int, is_async: bool) -> int:
    """Chunks a source job may have gathered and not yet sent."""
    return max(MAX_AHEAD, DEVICE_AHEAD_BYTES // max(1, chunk_bytes)) if is_async else MAX_AHEAD


@dataclass
class _GatherJob:
    header: p.TransferHeader
    lock: Any
    slots_host: torch.Tensor
    ids_ready: Any
    """The copy event of the prefix's slots to `slots_host` (a GPU pool's slots live on the device)."""
    page_ids: Optional[torch.Tensor] = None
    """CPU page ids of the prefix, root first (None until `ids_ready` is done)."""
    next_chunk: int = 0
    pending: "collections.deque[_Pending]" = field(default_factory=collections.deque)
    """Chunks issued on the copy stream, oldest first, not handed to the I/O side yet."""
    ending: Optional[str] = None
    """Why the job ends ("cancelled", an error) once its copies in flight are done (its lock held until then)."""


@dataclass
class _Pending:
    index: int
    host: torch.Tensor
    event: Any
    started_s: float
    keep: torch.Tensor
    """The gathered buffer the host copy reads (alive until the event is done)."""


class SourceSide:
    """The gather jobs of a `WorkerAgent` (scheduler thread only)."""

    _host_slots: Optional[HostSlots] = None
    slot_starved = False
    """A chunk waits for a host slot (the scheduler must not sleep: see `_keep_polling`)."""

    def host_slots(self) -> HostSlots:
        """The chunks' host memory (with asynchronous copies made when the agent starts: the geometry sizes it)."""
        if self._host_slots is None:
            page_bytes = self.geometry.num_bytes(1)
            slot_bytes = max(1, self.config.chunk_bytes // page_bytes) * page_bytes
            self._host_slots = HostSlots(self.ops, slot_bytes,
                                         DEVICE_AHEAD_BYTES // slot_bytes if self.ops.is_async else CPU_HOST_SLOTS)
        return self._host_slots

    def _replicate(self, cmd: p.ReplicatePages) -> None:
        """Source side: lock the cached prefix and start a gather job; chunks are gathered over the next
        iterations (a bounded slice each) while the I/O thread sends the ones already gathered."""
        if self.config.shadow:
            return self._fail(cmd.replication_id, "source", "worker is in shadow mode")
        if cmd.target_fingerprint != self.fingerprint:
            return self._fail(cmd.replication_id, "source", "target fingerprint differs from the source's")
        ps = self.page_size
        n = len(cmd.token_ids) // ps * ps
        matched, node = self.view.match(cmd.token_ids[:n], cmd.namespace)
        matched = matched // ps * ps
        if matched < ps:
            return self._fail(cmd.replication_id, "source", f"prefix not cached here (0 of {n} tokens)")
        lock = self.view.lock(node)
        ops = self.ops
        try:
            # NOTE: a GPU pool's slots live on the device: they come to the host on the copy stream (no wait on
            # the scheduler thread for the forward in progress); the job gathers once they are there
            with ops.stream():
                slots_host = host_copy(ops, self.view.path_slots(node)[:matched])
                ids_ready = ops.record()
        except Exception:
            self.view.unlock(lock)
            raise
        geo = self.geometry
        num_pages = matched // ps
        page_bytes = geo.num_bytes(1)
        per_chunk = max(1, self.config.chunk_bytes // page_bytes)
        header = p.TransferHeader(
            transfer_id=uuid.uuid4().hex[:16], replication_id=cmd.replication_id, auth_token=cmd.auth_token,
            source_id=self.config.worker_id, fingerprint=self.fingerprint, namespace=cmd.namespace,
            token_ids=list(cmd.token_ids[:matched]), page_size=ps, num_pages=num_pages, dtype=geo.dtype,
            layout=geo.layout, buffer_shape=geo.buffer_shape(num_pages), num_bytes=geo.num_bytes(num_pages),
            pages_per_chunk=per_chunk, num_chunks=-(-num_pages // per_chunk),
            # the I/O side checksums host memory only (a GPU pool's chunks come to pinned host memory first)
            checksum_kind="xxh3", ttl_s=cmd.ttl_s)
        self.gathers[header.transfer_id] = _GatherJob(header, lock, slots_host, ids_ready)
        self.to_io(m.StartSend(header, cmd.target_endpoint))
        self._pump_gathers()

    def _pump_gathers(self) -> None:
        """Gather the next chunks of running jobs: at most `ahead_chunks` ahead of what was sent, and at most
        `GATHER_SLICE_S` of scheduler time per iteration, so a long prefix never stalls SGLang's loop.

        Each chunk: on the copy stream, after a fence behind the forward stream, a gather into a device buffer and
        one asynchronous copy into host memory, then an event. The I/O side gets the host buffer (and checksums
        it) only once its event is done, in order; the prefix stays locked until every copy of the job is done,
        also when the job ends early (cancelled, failed)."""
        deadline = time.perf_counter() + GATHER_SLICE_S
        self.slot_starved = False
        self.cancelled.intersection_update(self.gathers)  # forget refusals of jobs that already ended
        for tid, job in list(self.gathers.items()):
            if tid in self.cancelled and job.ending is None:
                job.ending = "cancelled"
            if not self._hand_over(tid, job):
                continue
            h = job.header
            if job.page_ids is None:
                if not job.ids_ready.query():
                    continue
                try:
                    job.page_ids = slots_to_page_ids(job.slots_host, h.page_size)
                except Exception as exc:
                    log.exception("kvrep: the slots of transfer %s are not whole pages", tid)
                    job.ending = f"bad slots: {exc!r}"
                    self._hand_over(tid, job)
                    continue
            ahead = ahead_chunks(h.num_bytes // h.num_chunks, self.ops.is_async)
            while job.ending is None and job.next_chunk < h.num_chunks \
                    and job.next_chunk - self.sent_chunks.get(tid, 0) < ahead:
                if time.perf_counter() > deadline:
                    self.slot_starved = True  # (jobs not visited may wait for a slot: keep the scheduler polling)
                    return
                if not self._issue_chunk(tid, job, ahead - (job.next_chunk - self.sent_chunks.get(tid, 0))):
                    break
                self._hand_done(tid, job)
            self._hand_over(tid, job)

    def _issue_chunk(self, tid: str, job: "_GatherJob", room: int = 1) -> bool:
        """Issues the job's next chunks on the copy stream: one, gathered into a host slot, or with asynchronous
        copies up to `room` chunks of at most `GATHER_BATCH_BYTES` in one gather on the device, each chunk then
        copied into its own host slot with its own event. False when none was issued: the job is ending (that
        failed), or every host slot is in use (`job.ending` still None: the chunks are issued at a later step)."""
        h, ops = job.header, self.ops
        t0 = time.perf_counter()
        first = job.next_chunk * h.pages_per_chunk
        page_bytes = h.num_bytes // h.num_pages
        try:
            wanted = 1  # (a CPU pool: the gather writes straight into a reused host slot)
            if ops.is_async:
                wanted = min(room, h.num_chunks - job.next_chunk,
                             max(1, GATHER_BATCH_BYTES // (page_bytes * h.pages_per_chunk)))
            slots = []
            for i in range(wanted):
                pages = min(h.pages_per_chunk, h.num_pages - first - i * h.pages_per_chunk)
                slot = self.host_slots().take(page_bytes * pages)
                if slot is None:  # frees when the transport lets go of a sent chunk: nothing wakes us for that
                    self.slot_starved = True
                    break
                slots.append(slot)
            if not slots:
                return False
            last = min(h.num_pages, first + len(slots) * h.pages_per_chunk)
            k_bufs, v_bufs, layout = self.view.kv_buffers()
            issued = []
            with ops.stream():
                ops.fence()
                out = None
                if not ops.is_async:
                    shape = (h.buffer_shape[0], last - first, *h.buffer_shape[2:])
                    out = slots[0].view(k_bufs[0].dtype).view(shape)  # (what the gather would allocate)
                buffer = gather_pages(k_bufs, v_bufs, job.page_ids[first:last], h.page_size, layout=layout, out=out)
                for i, slot in enumerate(slots):
                    part = buffer[:, i * h.pages_per_chunk:(i + 1) * h.pages_per_chunk] if len(slots) > 1 else buffer
                    host = host_copy(ops, part, slot)  # (a CPU pool's gathered buffer is the host buffer)
                    issued.append((host, ops.record()))
        except Exception as exc:  # release the prefix, end the transfer, report it failed; keep serving
            log.exception("kvrep: gathering chunk %d of transfer %s failed", job.next_chunk, tid)
            job.ending = f"gather of chunk {job.next_chunk} failed: {exc!r}"
            return False
        for host, event in issued:
            job.pending.append(_Pending(job.next_chunk, host, event, t0, buffer))
            job.next_chunk += 1
        return True

    def _hand_done(self, tid: str, job: "_GatherJob") -> None:
        """The job's chunks whose copies are done go to the I/O side, in order (none once the job is ending)."""
        while job.pending and job.pending[0].event.query():
            done = job.pending.popleft()
            if job.ending is None:
                self.to_io(m.ChunkGathered(tid, done.index, done.host, time.perf_counter() - done.started_s))

    def _hand_over(self, tid: str, job: "_GatherJob") -> bool:
        """Hands the job's finished chunks to the I/O side, in order; ends the job when it is over and its copies
        are done (the lock released, a failure reported once). Returns: whether the job runs on."""
        self._hand_done(tid, job)
        finished = job.ending is None and job.page_ids is not None and job.next_chunk == job.header.num_chunks
        if not (finished or job.ending is not None) or job.pending:
            return job.ending is None and not finished
        if job.page_ids is None and not job.ids_ready.query():
            return False  # (ending: the slots' copy to the host still reads the tree's slots)
        self._end_gather(tid, job)
        if job.ending not in (None, "cancelled"):
            self.to_io(m.GatherFailed(tid, job.ending))
        return False

    def _end_gather(self, tid: str, job: "_GatherJob") -> None:
        self.view.unlock(job.lock)
        del self.gathers[tid]
        self.cancelled.discard(tid)
        self.sent_chunks.pop(tid, None)
