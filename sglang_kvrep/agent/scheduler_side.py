"""The worker agent's scheduler side: `WorkerAgent`, the part of the extension that runs on SGLang's scheduler
thread. It alone touches the radix tree, the allocator and the KV pool (in `on_iteration`, between SGLang
iterations, and in SGLang's allocation path for demoted chains). It talks to the I/O side only through the typed
mailbox (`sglang_kvrep.agent.mailbox`; the picture is in `sglang_kvrep.agent`). Any exception is logged; after
repeated failures the agent disables itself and SGLang serves as usual.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from array import array
from typing import Any, Callable, Optional

from kvrep_kernels import warm_up
from radix_sync import kv_hints
from radix_sync import protocol as p
from sglang_kvrep import compat, events, fingerprint
from sglang_kvrep.agent import mailbox as m
from sglang_kvrep.agent.source_side import SourceSide
from sglang_kvrep.device import CopyOps, make_ops
from sglang_kvrep.compat import SchedulerView
from sglang_kvrep.config import KvrepConfig
from sglang_kvrep.dataplane.checks import LocalGeometry, finite_s
from sglang_kvrep.dataplane.staging import Incoming
from sglang_kvrep.replicas import PULLED_PRIORITY, ReplicaTable

log = logging.getLogger("kvrep.agent")
MAX_ERRORS = 20
MAX_COMMANDS = 64
TOUCH_WAITING_S = 0.25
"""How often the waiting requests' cached prefixes are made recent (`SchedulerView.touch_waiting_prefixes`): the
queue's dead sessions are tens of seconds older, and 128 tree walks cost well under a millisecond each."""
"""Commands run per iteration at most (the rest wait for the next one)."""
START_TIMEOUT_S = 10.0
"""How long `start` waits for the I/O side to say it is up."""


class WorkerAgent(SourceSide):
    """The scheduler side of one worker's agent. Scheduler thread only."""

    def __init__(self, view: SchedulerView, config: KvrepConfig, mailbox: Optional[m.Mailbox] = None,
                 ops: Optional[CopyOps] = None) -> None:
        """`ops`: how copies are ordered against SGLang's device work (`sglang_kvrep.device`; default: the
        pool's device's, fenced behind SGLang's forward stream)."""
        self.view = view
        self.config = config
        self.mailbox = mailbox if mailbox is not None else m.Mailbox()
        if ops is None:
            forward = view.forward_stream() if hasattr(view, "forward_stream") else None
            load_back = view.load_back_stream() if hasattr(view, "load_back_stream") else None
            ops = make_ops(view.kv_buffers()[0][0].device, forward, (load_back,))
        self.ops = ops
        if ops.device.type == "cuda":  # the copy kernels compile now, not on the first copy's scheduler step
            t0 = time.perf_counter()
            k_bufs, v_bufs, layout = view.kv_buffers()
            try:
                with ops.stream():
                    warm_up(k_bufs, v_bufs, view.page_size, layout=layout)
                log.info("kvrep: copy kernels ready in %.2fs", time.perf_counter() - t0)
            except Exception:
                log.exception("kvrep: compiling the copy kernels failed; copies will fail and report it")
        self.page_size = view.page_size
        t0 = time.perf_counter()
        self._set_fingerprint(view.fingerprint_fields())
        log.info("kvrep: fingerprint %s of the weights and serving flags in %.2fs", self.fingerprint,
                 time.perf_counter() - t0)
        if ops.is_async:  # the sources' pinned chunk memory, now (not in a serving step: `HostSlots`)
            self.host_slots().reserve()
        capacity = view.pool_capacity_tokens()
        self.vocab_size = int(view.vocab_size()) if hasattr(view, "vocab_size") else 0
        self.replicas = ReplicaTable(view, config.replica_budget_tokens or capacity // 4, ops=self.ops)
        self._installing: dict[str, list[int]] = {}
        """Block hashes of the installs still on the copy stream, by transfer id."""
        self.capacity = capacity
        self._free_replica_tokens = self.replicas.free_tokens()  # last value told to the I/O side
        self.gathers: dict[str, _GatherJob] = {}
        self.sent_chunks: dict[str, int] = {}           # of running gathers, as the I/O side reports them
        self.cancelled: set[str] = set()                # running gathers the I/O side reported ended
        self._seen_rids: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        self._next_load_s = 0.0
        self._next_touch_s = 0.0
        self._reported_busy = False
        self._last_iter_s: Optional[float] = None
        self._was_busy = False
        self._iteration_s = 0.0
        """EWMA of the scheduler's iteration length while it had work (reported with the load)."""
        self._staging_arena: Optional[Any] = None
        """A GPU worker's pinned receive memory (made with the first `info`, on this thread; never freed)."""
        self._device_busy = False
        """As last told to the I/O side (`DeviceBusy`)."""
        self._errors = 0
        self.disabled = False
        self.data_endpoint = ""
        self.demoted: "collections.OrderedDict[tuple, tuple[str, array]]" = collections.OrderedDict()
        """Stale copies the coordinator demoted (a session's next turn went elsewhere with all of this prefix),
        oldest first: evicted before anything else when an allocation needs room."""
        self.demote_stats = {"evicted_tokens": 0, "taken_back": 0}
        """Reported with the load: tokens freed from demoted chains, chains taken back by a hit."""
        self._demoted_tokens = 0
        self.kv_hint_stats = {"reported": 0, "malformed": 0}
        """kvrep actions of requests' `kv_hints` envelopes reported to the coordinator, and refused here."""

    def _set_fingerprint(self, fields: dict[str, str]) -> None:
        self.fingerprint_fields = fields
        self.fingerprint = fingerprint.digest(fields)
        k_bufs, v_bufs, layout = self.view.kv_buffers()
        ps = self.page_size
        if layout == "HND":  # pool (num_pages, H, ps, D) (SGLANG_USE_HND_KVCACHE): pages travel as (2, H, ps, D)
            _, heads, _, dim = k_bufs[0].shape
            page_shape: tuple[int, ...] = (2, heads, ps, dim)
        else:  # pool rows (tokens, H, D): pages travel as (2, ps, H, D), MLA's as (ps, 1, D)
            heads, dim = k_bufs[0].shape[1:]
            page_shape = (2, ps, heads, dim) if v_bufs is not None else (ps, heads, dim)
        self.geometry = LocalGeometry(self.fingerprint, self.page_size, str(k_bufs[0].dtype), layout, page_shape,
                                      len(k_bufs), k_bufs[0].element_size())

    @property
    def info(self) -> m.WorkerInfo:
        """What the I/O side needs to know of this worker when it starts."""
        if self._staging_arena is None and self.ops.is_async and self.config.staging_bytes > 0:
            self._staging_arena = self.ops.host_buffer(self.config.staging_bytes)  # (this thread: pinned on a GPU)
        return m.WorkerInfo(fingerprint=self.fingerprint, fingerprint_fields=self.fingerprint_fields,
                            page_size=self.page_size, pool_capacity_tokens=self.capacity,
                            replica_budget_tokens=self.replicas.budget_tokens,
                            free_replica_tokens=self._free_replica_tokens, geometry=self.geometry,
                            vocab_size=self.vocab_size, staging_arena=self._staging_arena)

    # ======================================================================================== life cycle
    def start(self, io_thread: threading.Thread) -> None:
        """Start the I/O side's thread (built on this agent's mailbox) and wait until it says it is up."""
        self.view.add_idle_wakeup(self.mailbox.scheduler_bell_fd)
        events.ON_PUBLISH = self.mailbox.wake_io
        io_thread.start()
        first = self.mailbox.take_for_scheduler(timeout_s=START_TIMEOUT_S)
        if isinstance(first, m.IoStarted):
            self.data_endpoint = first.data_endpoint
        elif isinstance(first, m.IoDied):
            self.disabled = True
        log.info("kvrep agent %s: fingerprint %s, data %s, coordinator %s", self.config.worker_id,
                 self.fingerprint, self.data_endpoint, self.config.coordinator)

    def stop(self) -> None:
        self.mailbox.post_to_io(m.Stop())

    def to_io(self, msg: m.ToIo) -> None:
        self.mailbox.post_to_io(msg)

    def _report(self, fact) -> None:
        self.mailbox.post_to_io(m.ToCoordinator(fact))

    def _room_changed(self) -> None:
        free = self.replicas.free_tokens()
        if free != self._free_replica_tokens:
            self._free_replica_tokens = free
            self.mailbox.post_to_io(m.ReplicaRoom(free))

    # ====================================================================================== per iteration
    def on_iteration_safe(self) -> None:
        if self.disabled:
            if self.gathers or self.replicas.pending:
                self._wind_down()
            self._keep_polling()
            return
        try:
            self.on_iteration()
        except Exception:
            self._errors += 1
            log.exception("kvrep agent error (%d/%d)", self._errors, MAX_ERRORS)
            if self._errors >= MAX_ERRORS:
                log.error("kvrep agent disabled after repeated errors; serving as plain SGLang")
                self.disabled = True

    def _wind_down(self) -> None:
        """A disabled agent's copies still on the device: each gather's prefix is unlocked and each install's slots
        freed once its copy is done (not before: a copy in flight still reads those pages or writes those slots,
        and SGLang would hand them to new requests). Never raises; on an error it lets go of everything."""
        try:
            for tid, job in list(self.gathers.items()):
                if job.ending is None:
                    job.ending = "the worker's replication agent stopped"
                self._hand_over(tid, job)
            self.replicas.wind_down()
        except Exception:
            log.exception("kvrep: winding down the copies in flight failed; their locks and slots are left")
            self.gathers.clear()
            self.replicas.pending.clear()

    def on_iteration(self) -> None:
        self.mailbox.clear_bell()
        num_commands = 0
        while num_commands < MAX_COMMANDS:
            msg = self.mailbox.take_for_scheduler()
            if msg is None:
                break
            if not isinstance(msg, m.PROGRESS):
                num_commands += 1
            self._on_message(msg)
        if self.gathers:
            self._pump_gathers()
        if self.replicas.pending:
            self._poll_installs()
        # NOTE: the pages the previous iteration cached (a prefill just done) reach the coordinator now, while the
        # request decodes, not when its answer is done: a fan-out's copies can start before its branches arrive
        self.view.flush_kv_events()
        now = time.monotonic()
        busy = not self.view.is_idle()
        if busy and now >= self._next_touch_s:  # queued requests' prefixes stay recent (see the view's docstring)
            self._next_touch_s = now + TOUCH_WAITING_S
            self.view.touch_waiting_prefixes()
        if self.replicas.replicas:
            for rid in self.replicas.raise_wanted():
                log.info("kvrep: replica %s raised to ordinary cache: a waiting request wants it", rid)
        if busy and self._was_busy and self._last_iter_s is not None:  # an iteration with work from end to end
            took = now - self._last_iter_s
            self._iteration_s = took if self._iteration_s == 0.0 else 0.8 * self._iteration_s + 0.2 * took
        self._last_iter_s, self._was_busy = now, busy
        # NOTE: a worker that just went idle says so at once: its last periodic report (taken while its last
        # request still ran) would otherwise stand, repeated by the heartbeat, until --sleep-on-idle next wakes
        # the scheduler, and routers would keep steering around an idle worker holding the cache.
        if now >= self._next_load_s or (self._reported_busy and not busy):
            self._next_load_s = now + self.config.load_interval_s
            expired = self.replicas.expire_due()
            if expired:  # its evictions' PagesRemoved now, not at the next iteration's end
                self.view.flush_kv_events()
            for rid, evicted in expired:
                self._report(p.ReplicaExpired(worker_id=self.config.worker_id, seq=0, replication_id=rid,
                                              num_evicted_tokens=evicted))
            for rid in self.replicas.take_extended():
                self._report(p.ReplicaPromoted(worker_id=self.config.worker_id, seq=0, replication_id=rid,
                                               num_promoted_tokens=0))
            load = self.view.load()
            self._room_changed()
            self._report(p.LoadReported(worker_id=self.config.worker_id, seq=0,
                                        replica_tokens=self.replicas.evict_first_tokens(),
                                        iteration_s=round(finite_s(self._iteration_s), 4),
                                        demoted_chains=len(self.demoted),
                                        demoted_tokens=self._demoted_tokens,
                                        demoted_evicted_tokens=self.demote_stats["evicted_tokens"],
                                        demotions_taken_back=self.demote_stats["taken_back"], **load))
            self._reported_busy = load["num_running_reqs"] + load["num_waiting_reqs"] > 0
        self._keep_polling()

    def _keep_polling(self) -> None:
        """Copies on the device end without telling anyone: while some are in flight the scheduler's idle poller
        (`--sleep-on-idle`) must not sleep through them, or a finished chunk or install waits for the next request.
        The I/O side rings the scheduler every `DEVICE_POLL_S` meanwhile (told by `DeviceBusy` when that starts and
        ends). NOTE: not our own bell at every iteration: that made an idle scheduler spin, holding the GIL, and
        the I/O thread sending the chunks starved (a 4 GiB replica took 8-80 s instead of ~3 s on an H200)."""
        self.slot_starved = self.slot_starved and bool(self.gathers)  # (no job left: nothing waits for a slot)
        # (a CPU source starved of host slots too: a slot frees when libzmq lets go of a sent frame, which no message
        # tells the scheduler)
        busy = bool(self.slot_starved or (self.ops.is_async and (
            self.replicas.pending or any(j.pending or j.page_ids is None for j in self.gathers.values()))))
        if busy != self._device_busy:
            self._device_busy = busy
            self.to_io(m.DeviceBusy(busy))
        if busy and self.disabled:  # the I/O side may be gone (died, stopped): nothing else rings an idle scheduler
            self.mailbox.ring_scheduler()

    def _on_message(self, msg: m.ToScheduler) -> None:
        if isinstance(msg, m.ChunksSent):
            if msg.transfer_id in self.gathers:  # a job that ended needs no count (and must not leak one)
                self.sent_chunks[msg.transfer_id] = msg.num_sent
        elif isinstance(msg, m.SendCancelled):
            if msg.transfer_id in self.gathers:
                self.cancelled.add(msg.transfer_id)
        elif isinstance(msg, m.Replicate):
            self._replicate(msg.command)
        elif isinstance(msg, m.Install):
            self._install(msg.incoming, msg.block_hashes, msg.ordinary)
        elif isinstance(msg, m.Promote):
            self.replicas.promote(msg.replication_id)
        elif isinstance(msg, m.Demote):
            self.demote(msg.namespace, msg.token_ids)
        elif isinstance(msg, m.ReplicaGone):
            r = self.replicas.replicas.get(msg.replication_id)
            if r is not None and not r.promoted:
                log.info("kvrep: replica %s (%d tokens) evicted by SGLang %.1f s before its expiry",
                         msg.replication_id, r.inserted_len, r.expires_at_s - self.replicas.clock())
            if self.replicas.forget(msg.replication_id):  # its pages' removal went to the coordinator already
                self._report(p.ReplicaExpired(worker_id=self.config.worker_id, seq=0,
                                              replication_id=msg.replication_id, num_evicted_tokens=0))
                self._room_changed()
        elif isinstance(msg, m.Want):
            if self.replicas.want(msg.replication_id):
                log.info("kvrep: replica %s raised to ordinary cache: a request waits for it", msg.replication_id)
        elif isinstance(msg, m.Drop):
            evicted = self.replicas.drop(msg.replication_id)
            if evicted is not None:
                self._report(p.ReplicaExpired(worker_id=self.config.worker_id, seq=0,
                                              replication_id=msg.replication_id, num_evicted_tokens=evicted))
            self._free_replica_tokens = -1  # the I/O side counted the drop ahead (`IoSide.on_coord`): the true room
            self._room_changed()
        elif isinstance(msg, m.IoDied):
            log.error("kvrep agent disabled: its I/O thread died; serving as plain SGLang")
            self.disabled = True
        elif isinstance(msg, m.IoStarted):
            self.data_endpoint = msg.data_endpoint  # it was late for `start`

    # ------------------------------------------------------------------------------------- weight updates
    def on_weights_updated_safe(self, update: compat.WeightUpdate) -> None:
        """SGLang changed this worker's weights in place (scheduler thread, after the update): never raises."""
        if self.disabled:
            return
        try:
            self.on_weights_updated(update)
        except Exception:
            log.exception("kvrep: re-fingerprinting after a weight update failed; the agent stops (its old "
                          "fingerprint would name weights it no longer serves); serving as plain SGLang")
            self.disabled = True
            self.stop()

    def on_weights_updated(self, update: compat.WeightUpdate) -> None:
        """A new fingerprint for the new weights, announced as a new hello. Gathers still running stop here (a
        flush after the update may have freed the pages they read: what was gathered before went out; the
        transfer then fails on a stall, and nothing gathered after the update is ever sent)."""
        for tid, job in list(self.gathers.items()):
            try:
                self.view.unlock(job.lock)
            except Exception:  # the flush reset the tree and its locks with it
                pass
            self.gathers.pop(tid, None)
            self.sent_chunks.pop(tid, None)
        self.cancelled.clear()
        # installs still on the copy stream carry KV of the old weights: never inserted (their slots went with the
        # update's flush of the pool)
        for inc in self.replicas.abandon_pending():
            self._installing.pop(inc.header.transfer_id, None)
            self.to_io(m.InstallFailed(inc, "the worker's weights were updated during the install"))
        old = self.fingerprint
        if update.succeeded and update.kind == "disk" and update.model_path:
            fields = self.view.fingerprint_fields(model_path=update.model_path)
        else:
            fields = fingerprint.updated_weights_fields(
                self.fingerprint_fields, update.kind if update.succeeded else f"failed-{update.kind}",
                update.weight_version, uuid.uuid4().hex)
        self._set_fingerprint(fields)
        log.info("kvrep agent %s: weights updated (%s, version %s): fingerprint %s -> %s", self.config.worker_id,
                 update.kind, update.weight_version, old, self.fingerprint)
        self.to_io(m.Reannounce(self.info))

    # ------------------------------------------------------------------------------------------ demotion
    MAX_DEMOTED = 4096

    def demote(self, namespace: str, token_ids) -> None:
        """Marks the cached chain ending at `token_ids` evict-first (again: it moves to the back of the order).
        The list is bounded by entries and by tokens (the pool's capacity: chains must fit in it to be cached)."""
        toks = array("q", token_ids)
        key = (namespace, len(toks), hash(toks.tobytes()))
        self._forget(key)
        self.demoted[key] = (namespace, toks)
        self._demoted_tokens += len(toks)
        while self.demoted and (len(self.demoted) > self.MAX_DEMOTED or self._demoted_tokens > self.capacity):
            self._forget(next(iter(self.demoted)))

    def _forget(self, key) -> None:
        entry = self.demoted.pop(key, None)
        if entry is not None:
            self._demoted_tokens -= len(entry[1])

    def evict_demoted(self, num_tokens: int, satisfied: Optional[Callable[[], bool]] = None) -> int:
        """Frees up to about `num_tokens` (whole tree nodes) from demoted chains, oldest demotion first, or until
        `satisfied()` (SGLang's allocation predicate) holds. A chain that a running request holds or that the cache
        has extended since (both: a later hit) is taken back.

        Returns:
            tokens freed.
        """
        freed = 0
        for key in list(self.demoted):
            if freed >= num_tokens or (freed and satisfied is not None and satisfied()):
                break
            namespace, toks = self.demoted[key]
            got, outcome, left = self.view.evict_chain(toks, namespace, num_tokens - freed)
            freed += got
            if outcome == "partial":
                self._demoted_tokens -= len(toks) - left
                self.demoted[key] = (namespace, toks[:left])  # resume at what is left of it
            else:
                self._forget(key)
            if outcome in ("in_use", "extended"):
                self.demote_stats["taken_back"] += 1
        self.demote_stats["evicted_tokens"] += freed
        return freed

    def evict_demoted_safe(self, num_tokens: int, satisfied: Optional[Callable[[], bool]] = None) -> int:
        """`evict_demoted` for SGLang's allocation path: never raises; on an error demotion stops (the demoted
        list is dropped) and SGLang's own eviction proceeds as without the extension."""
        if self.disabled:
            return 0
        try:
            return self.evict_demoted(num_tokens, satisfied)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # NOTE: a Rust panic in the tree core arrives as pyo3's PanicException (a BaseException)
            log.exception("kvrep: evicting demoted chains failed; demotion is off from now on")
            self.demoted.clear()
            self._demoted_tokens = 0
            self.MAX_DEMOTED = 0
            return 0

    def _fail(self, replication_id: str, role: str, error: str) -> None:
        log.warning("replication %s failed (%s): %s", replication_id, role, error)
        self._report(p.ReplicationFailed(worker_id=self.config.worker_id, seq=0, replication_id=replication_id,
                                         role=role, error=error))

    def _install(self, inc: Incoming, block_hashes: list[int], ordinary: bool = False) -> None:
        try:
            res = self.replicas.install(inc, ordinary=ordinary)
        except Exception as exc:  # budget, OOM, bad buffer: nothing was written or kept
            self.to_io(m.InstallFailed(inc, f"install failed: {exc}"))
            return
        if res is None:  # on the copy stream: `_poll_installs` answers once it is in the tree
            self._installing[inc.header.transfer_id] = block_hashes
        else:
            self._installed(inc, block_hashes, res)
        self._room_changed()

    def _poll_installs(self) -> None:
        for inc, res in self.replicas.poll():
            block_hashes = self._installing.pop(inc.header.transfer_id, [])
            if isinstance(res, Exception):
                log.warning("kvrep: install of transfer %s failed: %r", inc.header.transfer_id, res)
                self.to_io(m.InstallFailed(inc, f"install failed: {res}"))
            else:
                self._installed(inc, block_hashes, res)
            self._room_changed()

    def _installed(self, inc: Incoming, block_hashes: list[int], res) -> None:
        h = inc.header
        r = self.replicas.replicas.get(h.replication_id)  # (a pull's, or wanted by a held request: ordinary cache)
        ordinary = ", ordinary cache" if r is not None and r.priority >= PULLED_PRIORITY else ""
        log.info("kvrep: replica %s installed: %d of %d tokens new, TTL %.0f s%s", h.replication_id, res.inserted_len,
                 len(h.token_ids), h.ttl_s, ordinary)
        self.to_io(m.Installed(inc, block_hashes, res.inserted_len, res.scatter_s, res.insert_s))

    def _report_kv_hints(self, hit: compat.RequestMatch) -> None:
        """kvrep's actions in the request's `kv_hints` envelope (`radix_sync.kv_hints`) go to the coordinator as
        hints on the request's prompt (a request sent straight to this worker, or through a router that sent them
        already: the hint id makes them idempotent). SGLang checked the envelope's shape; one of our actions it
        cannot check (a bad version or payload) is logged and dropped: the request is served regardless."""
        if not isinstance(hit.kv_hints, dict):  # SGLang gives each request of a batch its own envelope
            return
        try:
            hints = kv_hints.parse(hit.kv_hints)
        except kv_hints.KvHintsError as exc:
            self.kv_hint_stats["malformed"] += 1
            log.warning("kvrep: request %s: %s (not acted on)", hit.rid, exc)
            return
        if not hints:
            return
        ids = [int(t) for t in hit.token_ids[:p.MAX_PREFIX_TOKENS]]
        for hint in hints:
            self.kv_hint_stats["reported"] += 1
            self._report(p.HintReported(worker_id=self.config.worker_id, seq=0, namespace=hit.namespace,
                                        token_ids=ids, **hint))

    def on_request_match_safe(self, params: Any, result: Any) -> None:
        """SGLang matched a request's prompt (`match_prefix`'s arguments and result): report the hit once per
        request, and take back a demotion the request reuses exactly."""
        if self.disabled:
            return
        try:
            hit = compat.matched_request(params, result)
            if hit is None or hit.rid is None or hit.rid in self._seen_rids:
                return
            self._seen_rids[hit.rid] = None
            if len(self._seen_rids) > 8192:
                self._seen_rids.popitem(last=False)
            if hit.kv_hints is not None:
                self._report_kv_hints(hit)
            matched = hit.matched_len
            self._log_missed_replica(hit)
            if matched <= 0:
                return
            tokens = array("q", hit.token_ids[:matched])
            key = (hit.namespace, matched, hash(tokens.tobytes())) if self.demoted else None
            if key is not None and key in self.demoted:
                self._forget(key)
                self.demote_stats["taken_back"] += 1  # a request reuses exactly this demoted chain: a hit
            self.to_io(m.PrefixMatched(hit.namespace, tokens, matched, hit.key_len))
        except Exception:
            log.exception("kvrep: prefix-hit hook failed")

    def _log_missed_replica(self, hit: compat.RequestMatch) -> None:
        """Logs a request that matched less of its prompt than a live replica here holds of it (the replica was
        copied for such requests: why it did not serve is in the log around it)."""
        for r in self.replicas.replicas.values():
            n = len(r.token_ids)
            if not r.promoted and n > hit.matched_len and r.namespace == hit.namespace and len(hit.token_ids) >= n \
                    and hit.token_ids[n - 1] == r.token_ids[n - 1] and list(hit.token_ids[:n]) == r.token_ids:
                log.info("kvrep: request %s matched %d tokens, replica %s holds %d of its prompt", hit.rid,
                         hit.matched_len, r.replication_id, n)
                return
