"""The coordinator's workers: who said hello on which socket, what they last reported, where their facts stand.

`WorkerRegistry` owns the worker records and the socket identity -> worker index. It knows nothing of what
workers hold (that is the directory's) nor of replications; `ClusterState` (`state.py`) ties them together and
calls it under the coordinator's lock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from radix_sync import api
from radix_sync import protocol as p
from radix_sync.integrity import IntegrityError

PLAIN_ROUTING_PREFIX = b"\x00plain:"
"""The socket identity prefix of plain workers (`plain.PlainWorkerSpec.routing_id`; no ZMQ peer can take it)."""


@dataclass
class WorkerRecord:
    hello: p.Hello
    routing_id: bytes
    last_seen_s: float
    last_seq: int = 0
    load: Optional[p.LoadReported] = None
    load_s: float = 0.0
    """When the worker took `load` (the coordinator's clock: received less the report's `age_s`), s."""

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    @property
    def plain(self) -> bool:
        """A worker without the plugin, followed through SGLang's own KV events (`plain.py`): never a copy's end."""
        return self.routing_id.startswith(PLAIN_ROUTING_PREFIX)

    def to_info(self) -> api.WorkerInfo:
        """The record as `GET /workers` lists it."""
        h, load = self.hello, self.load
        return api.WorkerInfo(
            id=h.worker_id, url=h.http_url, data_endpoint=h.data_endpoint, fingerprint=h.fingerprint,
            fingerprint_fields=h.fingerprint_fields, page_size=h.page_size,
            pool_capacity_tokens=h.pool_capacity_tokens, replica_budget_tokens=h.replica_budget_tokens,
            load=None if load is None else api.WorkerLoad(
                num_running_reqs=load.num_running_reqs, num_waiting_reqs=load.num_waiting_reqs,
                num_waiting_tokens=load.num_waiting_tokens, available_tokens=load.available_tokens,
                evictable_tokens=load.evictable_tokens, replica_tokens=load.replica_tokens,
                demoted_chains=load.demoted_chains, demoted_evicted_tokens=load.demoted_evicted_tokens,
                demotions_taken_back=load.demotions_taken_back),
            plain=self.plain)

    def to_json(self) -> dict:
        return api.to_builtins(self.to_info())


class WorkerRegistry:
    """Worker id -> record, and socket identity -> worker id; the two always name the same workers."""

    def __init__(self) -> None:
        self.records: dict[str, WorkerRecord] = {}
        self._by_routing: dict[bytes, str] = {}

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self.records

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def get(self, worker_id: str) -> Optional[WorkerRecord]:
        return self.records.get(worker_id)

    def add(self, hello: p.Hello, routing_id: bytes, now_s: float) -> Optional[WorkerRecord]:
        """Registers a worker from its hello (a re-hello replaces the old record and socket identity).

        Returns:
            the record it replaced, if any.
        """
        old = self.records.get(hello.worker_id)
        if old is not None:
            self._by_routing.pop(old.routing_id, None)
        self.records[hello.worker_id] = WorkerRecord(hello, routing_id, now_s, last_seq=hello.seq)
        self._by_routing[routing_id] = hello.worker_id
        return old

    def remove(self, worker_id: str) -> None:
        record = self.records.pop(worker_id)
        self._by_routing.pop(record.routing_id, None)

    def sender(self, routing_id: bytes, msg: object) -> Optional[WorkerRecord]:
        """The record of the worker that sent `msg` on `routing_id`; None for an unknown socket, or a message
        naming another worker than the one that said hello on it."""
        worker_id = self._by_routing.get(routing_id)
        if worker_id is None or getattr(msg, "worker_id", None) != worker_id:
            return None
        return self.records[worker_id]

    def silent(self, now_s: float, timeout_s: float) -> list[str]:
        """Workers not heard from for more than `timeout_s`."""
        return [wid for wid, rec in self.records.items() if now_s - rec.last_seen_s > timeout_s]

    def page_size(self, worker_id: str = "") -> int:
        """The page size of `worker_id`, else the smallest any worker uses (1 with no worker)."""
        record = self.records.get(worker_id)
        if record is not None:
            return record.hello.page_size
        return min((w.hello.page_size for w in self.records.values()), default=1)

    def vocab_size(self) -> int:
        """The fleet's vocabulary size: the smallest any worker reported (0 when none did)."""
        return min((w.hello.vocab_size for w in self.records.values() if w.hello.vocab_size > 0), default=0)

    def page_sizes(self) -> set[int]:
        return {w.hello.page_size for w in self.records.values()}

    def check_integrity(self) -> None:
        """Raises IntegrityError unless both indexes name the same workers, each under its own id."""
        for routing_id, wid in self._by_routing.items():
            record = self.records.get(wid)
            if record is None or record.routing_id != routing_id:
                raise IntegrityError(f"socket {routing_id!r} is indexed to worker {wid!r}, which is not on it")
        if len(self._by_routing) != len(self.records):
            raise IntegrityError(f"{len(self.records)} workers but {len(self._by_routing)} sockets")
        for wid, record in self.records.items():
            if record.worker_id != wid:
                raise IntegrityError(f"worker {wid!r} holds the record of {record.worker_id!r}")
            if record.hello.page_size < 1:
                raise IntegrityError(f"worker {wid!r} has page size {record.hello.page_size}")


_ITEMSIZE = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4, "torch.uint8": 1}


def kv_bytes_per_token(fields: dict[str, str]) -> Optional[int]:
    """KV bytes per token from a worker's fingerprint fields (MHA: 2 x layers x heads x dim x itemsize)."""
    try:
        dims = [int(x) for x in fields["kv_geometry"].strip("()").split(",") if x.strip()]
        per_row = 1
        for d in dims:
            per_row *= d
        factor = 1 if fields.get("mla") == "True" else 2
        return factor * int(fields["num_layers"]) * per_row * _ITEMSIZE[fields["kv_store_dtype"]]
    except (KeyError, ValueError):
        return None
