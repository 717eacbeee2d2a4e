"""Workers without the plugin ("plain" SGLang) in the directory: the coordinator reads the KV events SGLang publishes
itself (`--kv-events-config '{"publisher": "zmq", ...}'`) and records their pages like a plugin worker's.

A fleet adopting kvrep runs some workers without the plugin for a while. SGLang 0.5.23 publishes every page it
stores or evicts on a ZMQ PUB socket: multipart `[topic, seq (8 bytes, big-endian), msgpack EventBatch]`, where
`EventBatch` is the array `[ts, events, attn_dp_rank]` and each event a map tagged by `type` (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared`; `sglang/srt/disaggregation/kv_events.py`). Its optional ROUTER replay socket
resends its buffered batches from a sequence number on (`[b"", start_seq]` in, `[b"", topic, seq, payload]...`
out, ended by seq -1). We decode that public format with our own bounded msgspec structs (no SGLang import here).

A plain worker:
- is registered from its `PlainWorkerSpec` (operator configuration, `kvrep coordinator --plain-worker`), with a
  fingerprint of its own (`plain:<id>`, equal to no other) and no replica budget: it is never a copy's source or
  target, never demoted, and `request_replication` refuses it by name;
- has its pages checked like every worker's (`PrefixDirectory.verify_blocks`: each page's SHA-256 chain against its
  tokens, SGLang's `default` event format), so a forged event can only claim pages whose tokens it names;
- is listed by `GET /workers` with `plain: true`, so routers route to it from the directory and never plan a pull
  to or from it;
- is kept registered while configured (a PUB socket says nothing when idle): its liveness is the routers' business
  (their connection failures and cool-downs), not the silence timeout's.
A gap in SGLang's sequence numbers (a dropped batch, a restart) is filled from the replay socket when there is one;
otherwise, or when the replay cannot fill it, the worker's pages are forgotten and learnt again from new events:
the directory may miss pages, it never claims pages the worker does not hold.

Runs one thread per plain worker (its own sockets); facts go through `ClusterState.handle` under the coordinator's
lock, as a plugin worker's do.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Callable, Optional, Union
from urllib.parse import urlsplit

import msgspec
import zmq
from msgspec import Meta

from radix_sync import protocol as p
from radix_sync.coordinator.workers import PLAIN_ROUTING_PREFIX
from radix_sync.host_tier import HOST_MEDIUM

log = logging.getLogger("kvrep.coordinator.plain")

MAX_EVENTS_PER_BATCH = 65_536
MAX_BLOCKS_PER_EVENT = p.MAX_PAGES_PER_MESSAGE
_END_SEQ = -1
REPLAY_TIMEOUT_S = 2.0
"""A replay answer not complete after this long is abandoned (the gap is then handled as one without replay)."""

_Hash = Annotated[int, Meta(ge=-2 ** 63, le=2 ** 63 - 1)]
_Str = Annotated[str, Meta(max_length=1024)]


class _Event(msgspec.Struct, tag_field="type", forbid_unknown_fields=False):
    pass


class BlockStored(_Event, tag="BlockStored"):
    block_hashes: Annotated[list[_Hash], Meta(max_length=MAX_BLOCKS_PER_EVENT)]
    parent_block_hash: Optional[_Hash] = None
    token_ids: Annotated[list[p.TokenId], Meta(max_length=MAX_BLOCKS_PER_EVENT * 64)] = []
    block_size: Annotated[int, Meta(ge=1, le=p.MAX_PAGE_SIZE)] = 1
    lora_id: Optional[int] = None
    medium: Optional[_Str] = None
    cache_salt: Optional[_Str] = None


class BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: Annotated[list[_Hash], Meta(max_length=MAX_BLOCKS_PER_EVENT)]
    medium: Optional[_Str] = None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    """SGLang's `KVEventBatch` as published: `[ts, events, attn_dp_rank]`."""

    ts: float
    events: Annotated[list[Union[BlockStored, BlockRemoved, AllBlocksCleared]], Meta(max_length=MAX_EVENTS_PER_BATCH)]
    attn_dp_rank: Optional[int] = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


class PlainEventError(ValueError):
    """A batch that cannot be applied (undecodable, or a page of another size than the worker's)."""


def decode_batch(payload: bytes) -> EventBatch:
    try:
        return _decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PlainEventError(f"bad KV event batch: {exc}") from None


def batch_facts(batch: EventBatch, worker_id: str, page_size: int) -> list[p._Msg]:
    """The coordinator facts of one batch (sequence numbers 0: `PlainFeed` numbers them), in order.

    Pages of the host-memory tier (medium `CPU_PINNED`) go as facts of that medium (`radix_sync.host_tier`); of any
    other medium than these two they are skipped (as the plugin's agent does). Raises PlainEventError for a
    stored block whose size is not the worker's page size or whose token count does not match its hashes."""
    out: list[p._Msg] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            medium = ev.medium or "GPU"
            if medium not in ("GPU", HOST_MEDIUM) or not ev.block_hashes:
                continue
            if ev.block_size != page_size:
                raise PlainEventError(f"block size {ev.block_size}, the worker's page size is {page_size}")
            if len(ev.token_ids) != len(ev.block_hashes) * page_size:
                raise PlainEventError(f"{len(ev.token_ids)} token ids for {len(ev.block_hashes)} pages of "
                                      f"{page_size}")
            parent, blocks = ev.parent_block_hash, []
            for i, h in enumerate(ev.block_hashes):
                blocks.append(p.BlockFact(h, parent, ev.token_ids[i * page_size:(i + 1) * page_size]))
                parent = h
            out.append(p.PagesStored(worker_id=worker_id, seq=0, namespace=ev.cache_salt or "", blocks=blocks,
                                     medium=medium))
        elif isinstance(ev, BlockRemoved):
            if (ev.medium or "GPU") in ("GPU", HOST_MEDIUM) and ev.block_hashes:
                out.append(p.PagesRemoved(worker_id=worker_id, seq=0, block_hashes=list(ev.block_hashes),
                                          medium=ev.medium or "GPU"))
        elif isinstance(ev, AllBlocksCleared):
            out.append(p.AllPagesCleared(worker_id=worker_id, seq=0))
    return out


@dataclass(frozen=True)
class PlainWorkerSpec:
    """A worker without the plugin, as the operator names it."""

    worker_id: str
    url: str
    """Its HTTP base URL (where routers send requests)."""
    events: str
    """Its KV-event PUB endpoint (SGLang's `--kv-events-config` `endpoint`, as reachable from the coordinator)."""
    page_size: int
    replay: str = ""
    """Its replay ROUTER endpoint (`replay_endpoint`), "" for none."""
    topic: str = ""
    """Its `topic` ("" by default in SGLang)."""
    capacity_tokens: int = 1 << 20
    """Its KV pool, tokens (bounds the pages the directory keeps for it)."""

    def __post_init__(self) -> None:
        if not self.worker_id or len(self.worker_id) > 128:
            raise ValueError(f"plain worker id must be 1-128 characters, got {self.worker_id!r}")
        if urlsplit(self.url).scheme not in ("http", "https") or not urlsplit(self.url).netloc:
            raise ValueError(f"plain worker {self.worker_id}: url must be http(s)://host:port, got {self.url!r}")
        for name in ("events", "replay"):
            value = getattr(self, name)
            if (value or name == "events") and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"plain worker {self.worker_id}: {name} must be a tcp:// or ipc:// endpoint, "
                                 f"got {value!r}")
        if not 1 <= self.page_size <= p.MAX_PAGE_SIZE:
            raise ValueError(f"plain worker {self.worker_id}: page_size must be in [1, {p.MAX_PAGE_SIZE}]")
        if not 1 <= self.capacity_tokens <= 2 ** 40:
            raise ValueError(f"plain worker {self.worker_id}: capacity_tokens must be in [1, 2**40]")

    @classmethod
    def parse(cls, text: str) -> "PlainWorkerSpec":
        """From `id=W,url=http://h:p,events=tcp://h:5557,page_size=16[,replay=tcp://h:5558][,topic=T]
        [,capacity_tokens=N]` (the `--plain-worker` flag). Raises ValueError naming what is wrong."""
        fields: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in ("id", "url", "events", "page_size", "replay", "topic", "capacity_tokens"):
                raise ValueError(f"--plain-worker: bad part {part!r} (expected id=, url=, events=, page_size=, "
                                 f"and optionally replay=, topic=, capacity_tokens=)")
            if key in fields:
                raise ValueError(f"--plain-worker: {key}= given twice")
            fields[key] = value.strip()
        missing = [k for k in ("id", "url", "events", "page_size") if k not in fields]
        if missing:
            raise ValueError(f"--plain-worker {text!r}: missing {', '.join(k + '=' for k in missing)}")
        try:
            page_size = int(fields["page_size"])
            capacity = int(fields.get("capacity_tokens", 1 << 20))
        except ValueError:
            raise ValueError(f"--plain-worker {text!r}: page_size and capacity_tokens are integers") from None
        return cls(worker_id=fields["id"], url=fields["url"].rstrip("/"), events=fields["events"],
                   page_size=page_size, replay=fields.get("replay", ""), topic=fields.get("topic", ""),
                   capacity_tokens=capacity)

    def fingerprint(self) -> str:
        return f"plain:{self.worker_id}"

    def hello(self) -> p.Hello:
        """The hello the coordinator registers it with: no data endpoint, a fingerprint equal to no other worker's,
        no replica budget."""
        return p.Hello(worker_id=self.worker_id, http_url=self.url, data_endpoint="", fingerprint=self.fingerprint(),
                       fingerprint_fields={"plain": "no kvrep plugin"}, page_size=self.page_size,
                       pool_capacity_tokens=self.capacity_tokens, replica_budget_tokens=0)

    def routing_id(self) -> bytes:
        """A socket identity no ZMQ peer can have: identities starting with a zero byte are libzmq's own, and the
        ones it assigns are 5 bytes long."""
        return PLAIN_ROUTING_PREFIX + self.worker_id.encode()


# (routing id, fact, now) -> replies; the coordinator's `ClusterState.handle` under its lock
Apply = Callable[[bytes, p._Msg, float], list]


class PlainFeed:
    """Follows one plain worker's KV events on its own thread and applies them as facts.

    Args:
        spec: the worker.
        apply: applies one fact (`Coordinator._apply_plain`: `ClusterState.handle` under the lock).
        max_msg_bytes: the largest event frame accepted (ZMQ_MAXMSGSIZE: a larger one drops the connection).
    """

    def __init__(self, spec: PlainWorkerSpec, apply: Apply, max_msg_bytes: int = 16 << 20) -> None:
        self.spec = spec
        self._apply = apply
        self._max_msg_bytes = max_msg_bytes
        self._seq = 0
        """Our sequence number of the facts applied (the coordinator checks it as a plugin worker's)."""
        self.next_event_seq: Optional[int] = None
        """SGLang's sequence number expected next (None before the first batch)."""
        self.num_batches = 0
        self.num_errors = 0
        """Batches refused (undecodable, wrong page size, malformed frames)."""
        self.num_gaps = 0
        self.num_replayed = 0
        """Batches applied from the replay socket."""
        self.num_forgets = 0
        """Gaps the replay could not fill (or a restart, or a refused batch): the worker's pages were forgotten."""
        self._replay_high = -1
        """The highest sequence number applied from the replay socket."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ctx = zmq.Context.instance()

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._fact(self.spec.hello())
        self._thread = threading.Thread(target=self._run, name=f"kvrep-plain-{self.spec.worker_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def stats(self) -> dict:
        return {"worker": self.spec.worker_id, "events": self.spec.events, "batches": self.num_batches,
                "errors": self.num_errors, "gaps": self.num_gaps, "replayed": self.num_replayed,
                "forgets": self.num_forgets, "next_event_seq": self.next_event_seq}

    # ------------------------------------------------------------------------------------------------- applying
    def _fact(self, msg: p._Msg) -> None:
        if not isinstance(msg, p.Hello):
            self._seq += 1
            msg.seq = self._seq
        else:
            self._seq = 0
        for _, reply in self._apply(self.spec.routing_id(), msg, time.monotonic()) or []:
            if isinstance(reply, p.ResyncRequested):  # (cannot happen while we number facts ourselves)
                log.warning("plain worker %s: resync asked (%s); registering again", self.spec.worker_id,
                            reply.reason)
                self._fact(self.spec.hello())
            elif isinstance(reply, p.Error):
                log.info("plain worker %s: %s refused: %s", self.spec.worker_id, reply.in_reply_to, reply.error)

    def forget(self) -> None:
        self.num_forgets += 1
        self._fact(p.AllPagesCleared(worker_id=self.spec.worker_id, seq=0))

    def keepalive(self) -> None:
        """Counts as heard from (a no-op fact: an empty removal), so the silence timeout never drops it."""
        self._fact(p.PagesRemoved(worker_id=self.spec.worker_id, seq=0, block_hashes=[]))

    def on_batch(self, seq: int, payload: bytes, replayed: bool = False) -> bool:
        """Applies SGLang's batch `seq` if it is the next one. Returns False when it leaves a gap (not applied)."""
        nxt = self.next_event_seq
        if nxt is not None and seq < nxt:
            if replayed or seq <= self._replay_high:
                return True  # seen already (a replayed batch the live feed also brought)
            # the live feed went back: the worker restarted (SGLang numbers from 0 again, its cache empty)
            log.warning("plain worker %s: event numbers restarted at %d (expected %d)", self.spec.worker_id, seq, nxt)
            self.forget()
            nxt = None
        if nxt is not None and seq > nxt:
            return False
        self.next_event_seq = seq + 1
        self.num_batches += 1
        if replayed:
            self.num_replayed += 1
            self._replay_high = max(self._replay_high, seq)
        else:
            self._replay_high = -1  # the live feed has caught up: a lower number from now on is a restart
        try:
            facts = batch_facts(decode_batch(payload), self.spec.worker_id, self.spec.page_size)
        except PlainEventError as exc:
            self.num_errors += 1
            log.warning("plain worker %s: batch %d refused: %s", self.spec.worker_id, seq, exc)
            # what it stored is unknown now: forget rather than keep a directory that may miss removals
            self.forget()
            return True
        for fact in facts:
            self._fact(fact)
        return True

    # ------------------------------------------------------------------------------------------------- sockets
    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_msg_bytes)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
        sub.connect(self.spec.events)
        try:
            if self.spec.replay:
                self._replay(0)  # what it stored before we joined, as far as its buffer reaches
            last_alive = 0.0
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_alive >= 1.0:
                    self.keepalive()
                    last_alive = now
                if not sub.poll(200):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.num_errors += 1
                    log.warning("plain worker %s: malformed event message (%d frames)", self.spec.worker_id,
                                len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if self.on_batch(seq, frames[2]):
                    continue
                self.num_gaps += 1
                log.warning("plain worker %s: events %d..%d missed", self.spec.worker_id, self.next_event_seq,
                            seq - 1)
                if self.spec.replay:
                    self._replay(self.next_event_seq or 0)
                if not self.on_batch(seq, frames[2]):  # the replay did not fill the gap: start over from here
                    self.forget()
                    self.next_event_seq = seq
                    self.on_batch(seq, frames[2])
        except Exception:  # NOTE: a bug here must not take the coordinator down; the worker's pages are forgotten
            log.exception("plain worker %s: event feed stopped", self.spec.worker_id)
            try:
                self.forget()
            except Exception:
                pass
        finally:
            sub.close(0)

    def _replay(self, start_seq: int) -> None:
        """Applies the batches SGLang's replay socket still buffers from `start_seq` on (bounded by
        REPLAY_TIMEOUT_S; on a timeout what came is kept)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_msg_bytes)
        try:
            sock.connect(self.spec.replay)
            sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while not self._stop.is_set():
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    log.warning("plain worker %s: replay from %d timed out", self.spec.worker_id, start_seq)
                    return
                frames = sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.num_errors += 1
                    return
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END_SEQ:
                    return
                if self.next_event_seq is None or self.next_event_seq < seq:
                    # the buffer starts after what we miss (or this is the start): take it from here
                    if self.next_event_seq is not None:
                        self.forget()
                    self.next_event_seq = seq
                self.on_batch(seq, frames[3], replayed=True)
        finally:
            sock.close(0)
