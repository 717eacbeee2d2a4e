"""Structure-aware fuzzing (fixed seeds, >= 10,000 messages each): every ZMQ decoder (`radix_sync.protocol`), every
admin body decoder and every coordinator answer the router decodes (`radix_sync.api`) raises nothing but its
documented error on mutated messages, the router's link turns a misfit answer into a failed call, and the
coordinator's state, fed the mutants that decode plus admin calls, raises nothing but `AdminError` and keeps its
integrity. Mutants start from valid messages and change one to three fields: a value of another type, an extreme
or out-of-range number (2**31, 2**63, inf, NaN), a long string or list, a dropped or added field, another tag."""
import copy
import json
import random

import msgspec
import pytest

from radix_sync import api
from radix_sync import protocol as p
from radix_sync.coordinator.state import ClusterState, StateConfig
from radix_sync.hashing import page_hashes

N = 10_000
PS = 4
TOKENS = list(range(16))
HASHES = page_hashes(TOKENS, PS)
BLOCKS = [[h, par, TOKENS[i * PS:(i + 1) * PS]] for i, (h, par) in enumerate(zip(HASHES, [None] + HASHES[:-1]))]

SEEDS_TO_COORDINATOR = [
    p.Hello(worker_id="w0", http_url="http://w0", data_endpoint="tcp://127.0.0.1:1", fingerprint="f",
            fingerprint_fields={"a": "b"}, page_size=PS, pool_capacity_tokens=1000, replica_budget_tokens=250),
    p.PagesStored(worker_id="w0", seq=1, namespace="", blocks=[p.BlockFact(*b) for b in BLOCKS]),
    p.PagesRemoved(worker_id="w0", seq=1, block_hashes=HASHES[2:]),
    p.AllPagesCleared(worker_id="w0", seq=1),
    p.PrefixHit(worker_id="w0", seq=1, namespace="", block_hash=HASHES[-1], matched_len=16, key_len=20),
    p.LoadReported(worker_id="w0", seq=1, num_running_reqs=2, num_waiting_reqs=3, num_waiting_tokens=9,
                   available_tokens=10, evictable_tokens=0, replica_tokens=0, iteration_s=0.1),
    p.ReplicaStored(worker_id="w1", seq=1, replication_id="r1", namespace="", block_hashes=HASHES, inserted_len=16,
                    expires_in_s=30.0, num_bytes=64, receive_s=0.1, scatter_s=0.1, insert_s=0.1),
    p.ReplicaPromoted(worker_id="w1", seq=1, replication_id="r1", num_promoted_tokens=8),
    p.ReplicaExpired(worker_id="w1", seq=1, replication_id="r1", num_evicted_tokens=8),
    p.ReplicaExpected(worker_id="w1", seq=1, replication_id="r1"),
    p.ReplicationFailed(worker_id="w1", seq=1, replication_id="r1", role="target", error="x"),
    p.SourceSent(worker_id="w0", seq=1, replication_id="r1", num_tokens=16, num_bytes=64, gather_s=0.1, send_s=0.1),
]
SEEDS_TO_WORKER = [
    p.HelloAck(coordinator_id="c"), p.ResyncRequested(reason="gap"),
    p.ExpectReplica(replication_id="r1", source_id="w0", namespace="", page_size=PS, block_hashes=HASHES,
                    auth_token="t" * 32, expires_in_s=60.0),
    p.ReplicatePages(replication_id="r1", auth_token="t" * 32, token_ids=TOKENS, namespace="", target_id="w1",
                     target_endpoint="tcp://127.0.0.1:2", target_fingerprint="f", ttl_s=30.0),
    p.DropReplica(replication_id="r1"), p.WantReplica(replication_id="r1"),
    p.DemotePrefix(namespace="", token_ids=TOKENS), p.Error(error="e"),
]
SEEDS_DATA_PLANE = [
    p.TransferHeader(transfer_id="x", replication_id="r1", auth_token="t" * 32, source_id="w0", fingerprint="f",
                     namespace="", token_ids=TOKENS, page_size=PS, num_pages=4, dtype="torch.float32",
                     layout="NHD", buffer_shape=[2, 4, 2, 4, 2, 8], num_bytes=4096, pages_per_chunk=2,
                     num_chunks=2, checksum_kind="crc32", ttl_s=30.0),
    p.TransferChunk(transfer_id="x", index=0, first_page=0, num_pages=2, num_bytes=2048, checksum=2 ** 64 - 1),
    p.TransferEnd(transfer_id="x"), p.TransferAccepted(transfer_id="x", inserted_len=16),
    p.TransferRefused(transfer_id="x", error="no"),
]
SEEDS_API = [
    (api.LookupRequest, {"input_ids": TOKENS, "cache_salt": "t"}),
    (api.LookupRequest, {"page_hashes": HASHES, "page_size": PS}),
    (api.DemandItems, {"arrivals": [{"input_ids": TOKENS, "worker": "w0", "session_id": "s", "class": "c",
                                     "seq": 1}],
                       "finishes": [{"page_hashes": HASHES, "page_size": PS, "worker": "w0", "stop": "tool_use"}]}),
    (api.ArrivalReport, {"page_hashes": HASHES, "page_size": PS, "prompt_len": 17, "worker": "w0"}),
    (api.FinishReport, {"input_ids": TOKENS, "stop": "stop", "seq": 2.5}),
    (api.HintRequest, {"kind": "fanout", "input_ids": TOKENS, "k": 4, "ttl_s": 30.0, "delay_s": 0.5}),
    (api.ReplicateRequest, {"source": "w0", "target": "w1", "input_ids": TOKENS, "ttl_s": 10.0}),
    (api.DropReplicasRequest, {"worker": "w1"}),
    (api.ReplicationWaitRequest, {"id": "r1", "wait_s": 1.0, "want": True}),
    (api.DemoteRequest, {"worker": "w0", "input_ids": TOKENS, "cache_salt": ""}),
    (api.PolicyRequest, {"policy": "rules", "mode": "shadow", "reset_demand": True}),
    (api.SendBatch, {"router": "r1", "events": [{"kind": "sent", "rid": 3, "worker": "w0", "new_tokens": 900,
                                                 "cached_tokens": 64, "at": 1.7e9}, {"kind": "done", "rid": 3}]}),
]

EXTREMES = [0, -1, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 40, 2 ** 63 - 1, -2 ** 63, 2 ** 64 - 1, 0.5, -0.0,
            float("inf"), float("-inf"), float("nan"), 1e300, True, None, "", "x" * 300, "x" * 5000, [], [1] * 5,
            {}, {"a": 1}, b"\x00\xff"]


def _random_value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if roll < 0.5 or depth > 2:
        # a copy: a mutation that later grows this value in place must not grow the shared EXTREMES entry
        return copy.deepcopy(rng.choice(EXTREMES))
    if roll < 0.7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if roll < 0.8:
        return {rng.choice(["type", "seq", "x", "worker_id"]): _random_value(rng, depth + 1)}
    return rng.randrange(-2 ** 70, 2 ** 70)


def _mutate(rng: random.Random, obj, keys_only_json: bool = False):
    """One to three mutations of a decoded message (a dict, lists inside)."""
    obj = json.loads(json.dumps(obj)) if keys_only_json else msgspec.msgpack.decode(msgspec.msgpack.encode(obj))
    for _ in range(rng.randrange(1, 4)):
        target = obj
        # walk down into a random container
        while isinstance(target, (dict, list)) and target and rng.random() < 0.5:
            key = rng.choice(list(target)) if isinstance(target, dict) else rng.randrange(len(target))
            if not isinstance(target[key], (dict, list)):
                break
            target = target[key]
        if isinstance(target, dict) and target:
            key = rng.choice(list(target))
            op = rng.random()
            if op < 0.7:
                target[key] = _random_value(rng)
            elif op < 0.85:
                del target[key]
            else:
                target[rng.choice(["extra", "type", "seq", key])] = _random_value(rng)
        elif isinstance(target, list) and target:
            i = rng.randrange(len(target))
            op = rng.random()
            if op < 0.6:
                target[i] = _random_value(rng)
            elif op < 0.8:
                del target[i]
            else:
                target.extend(target * rng.randrange(1, 4))
    return obj


def _mutants(seeds, n: int, seed: int):
    rng = random.Random(seed)
    for i in range(n):
        yield _mutate(rng, seeds[i % len(seeds)])


def _encode_msgpack(obj) -> bytes:
    try:
        return msgspec.msgpack.encode(obj)
    except (OverflowError, TypeError):  # an int beyond what MessagePack carries: send the raw bytes of a big int
        return b"\xcf" + b"\xff" * 8


@pytest.mark.parametrize("decode,seeds,seed", [(p.decode_for_coordinator, SEEDS_TO_COORDINATOR, 1),
                                               (p.decode_for_worker, SEEDS_TO_WORKER, 2),
                                               (p.decode_data_plane, SEEDS_DATA_PLANE, 3)],
                         ids=["to-coordinator", "to-worker", "data-plane"])
def test_each_zmq_decoder_raises_only_protocol_error(decode, seeds, seed):
    num_ok = 0
    for obj in _mutants([msgspec.to_builtins(s) for s in seeds], N, seed):
        try:
            decode(_encode_msgpack(obj))
            num_ok += 1
        except p.ProtocolError:
            pass
    assert 0 < num_ok < N  # the mutants exercise both outcomes


SEEDS_API.append((api.ReplicationWaitRequest, {"id": "r1", "wait_s": 2.5}))
API_TYPES = list(dict.fromkeys(t for t, _ in SEEDS_API))


def _json_of(mutant) -> bytes:
    try:
        return json.dumps(mutant, default=lambda o: o.hex() if isinstance(o, bytes) else str(o)).encode()
    except ValueError:  # a NaN/inf json refuses only with allow_nan=False; a circular list cannot occur
        return b'{"input_ids": [1e999]}'


@pytest.mark.parametrize("type_", API_TYPES, ids=[t.__name__ for t in API_TYPES])
def test_each_admin_body_decoder_raises_only_admin_error(type_):
    """>= 10,000 mutants of each body type's seeds (one type per case)."""
    rng = random.Random(4 + API_TYPES.index(type_))
    bodies = [body for t, body in SEEDS_API if t is type_]
    num_ok = 0
    for i in range(N):
        raw = _json_of(_mutate(rng, bodies[i % len(bodies)]))
        try:
            out = api.decode(raw, type_)
            if type_ is api.DemandItems:
                for item in [] if out.arrivals is api.UNSET else out.arrivals:
                    try:
                        api.item_of(item, api.ArrivalReport)
                    except api.AdminError:
                        pass
            num_ok += 1
        except api.AdminError as exc:
            assert exc.status == 400
    assert 0 < num_ok < N  # the mutants exercise both outcomes


_WORKER = {"id": "w1", "url": "http://w1", "data_endpoint": "tcp://w1:1", "fingerprint": "f",
           "fingerprint_fields": {"model": "m"}, "page_size": 16, "pool_capacity_tokens": 100,
           "replica_budget_tokens": 25,
           "load": {"num_running_reqs": 1, "num_waiting_reqs": 2, "num_waiting_tokens": 3, "available_tokens": 4,
                    "evictable_tokens": 5, "replica_tokens": 6, "demoted_chains": 0, "demoted_evicted_tokens": 0,
                    "demotions_taken_back": 0}}
_REPLICATION = {"id": "r1", "source": "w1", "target": "w2", "namespace": "t", "num_tokens": 32, "ttl_s": 5.0,
                "origin": "pull", "state": "running", "error": None, "bytes": 4096, "inserted_len": 0,
                "promoted_tokens": 0, "created_s": 1.0, "started_s": 1.5, "finished_s": None, "total_s": None,
                "timings_s": {"send_s": 0.1}}
SEEDS_ANSWERS = [
    (list[api.WorkerInfo], [_WORKER, {**_WORKER, "id": "w2", "load": None}]),
    (list[api.ReplicationInfo], [_REPLICATION, {**_REPLICATION, "id": "r2", "state": "failed", "error": "x"}]),
    (api.ReplicationInfo, _REPLICATION),
    (api.LookupAnswer, {"matched": {"w1": 32, "w2": 0}}),
    (api.DirectoryFeed, {"epoch": "e", "seq": 3, "head": 9, "changes": [[1, "w1", 2 ** 63 - 1], [-1, "w2", 5]]}),
    (api.DirectoryFeed, {"epoch": "e", "seq": 3, "head": 3, "snapshot": {"w1": [1, 2, 3]}}),
    (api.HintRecorded, {"recorded": 1, "kind": "fanout", "prefix_len": 16, "ttl_s": 30.0}),
    (api.DemandRecorded, {"recorded": 3, "finishes_recorded": 1, "dropped": 1, "errors": ["arrivals[2]: x"]}),
    (api.ErrorAnswer, {"error": "refused: shadow mode"}),
    (api.SendsFeed, {"epoch": "e", "seq": 4, "head": 9, "routers": 3, "reset": False,
                     "events": [{"kind": "sent", "rid": 1, "worker": "w1", "new_tokens": 5, "router": "r2"},
                                {"kind": "gone", "router": "r3"}]}),
    (api.SendsAccepted, {"accepted": 2, "routers": 2}),
]
ANSWER_TYPES = list(dict.fromkeys(t for t, _ in SEEDS_ANSWERS))


@pytest.mark.parametrize("type_", ANSWER_TYPES, ids=[str(t).replace("radix_sync.api.", "") if hasattr(t, "__args__") else t.__name__
                              for t in ANSWER_TYPES])
def test_each_coordinator_answer_the_router_decodes_raises_only_admin_error(type_):
    """The router's side (`radix_sync.router.coordinator_link`): >= 10,000 mutants of each answer it decodes."""
    rng = random.Random(40 + ANSWER_TYPES.index(type_))
    bodies = [body for t, body in SEEDS_ANSWERS if t == type_]
    num_ok = 0
    for i in range(N):
        try:
            api.decode(_json_of(_mutate(rng, bodies[i % len(bodies)])), type_)
            num_ok += 1
        except api.AdminError:
            pass
    assert 0 < num_ok < N


def test_the_routers_link_fed_mutated_answers_never_raises_and_counts_a_misfit_as_a_failed_call():
    """A real HTTP server answers the router's link with mutants of the coordinator's answers (fixed seed): each
    call returns the decoded answer or None, never raises; a misfit makes the link unreachable (a failed call,
    backing off); a good answer after it makes it reachable again."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from radix_sync.router.coordinator_link import CoordinatorLink, LinkConfig
    from tests.util import serve_app

    rng = random.Random(50)
    current = {}

    async def answer(request):
        return web.Response(body=current[request.path], content_type="application/json")

    async def main():
        app = web.Application()
        app.router.add_get("/workers", answer)
        app.router.add_post("/directory/lookup", answer)
        outcomes = {"ok": 0, "failed": 0}
        async with serve_app(app) as url, aiohttp.ClientSession() as session:
            for i in range(600):
                link = CoordinatorLink(LinkConfig(url=url, timeout_s=5.0), session)
                good = i % 10 == 0
                current["/directory/lookup"] = _json_of(
                    SEEDS_ANSWERS[3][1] if good else _mutate(rng, SEEDS_ANSWERS[3][1]))
                out = await link.lookup([1] * 32, "")
                if out is None:
                    assert not good and not link.reachable and not link.may_call()
                    outcomes["failed"] += 1
                else:
                    assert link.reachable and isinstance(out, dict)
                    outcomes["ok"] += 1
        return outcomes

    outcomes = asyncio.run(main())
    assert outcomes["failed"] > 0 and outcomes["ok"] >= 60


def test_the_state_fed_mutated_facts_and_admin_calls_raises_only_admin_error_and_keeps_its_integrity():
    rng = random.Random(5)
    st = ClusterState(StateConfig(worker_timeout_s=1e6, replication_timeout_s=1e6, max_pages_per_worker=64,
                                  max_prompt_tokens=64, hint_burst=50))
    routing = {f"w{i}": f"R{i}".encode() for i in range(3)}
    for wid, rid in routing.items():
        st.handle(rid, msgspec.structs.replace(SEEDS_TO_COORDINATOR[0], worker_id=wid), 0.0)
    seeds = [msgspec.to_builtins(s) for s in SEEDS_TO_COORDINATOR]
    num_applied = num_refused = 0
    for i in range(N):
        now = i * 0.01
        obj = _mutate(rng, seeds[i % len(seeds)]) if rng.random() < 0.7 else seeds[i % len(seeds)]
        try:
            msg = p.decode_for_coordinator(_encode_msgpack(obj))
        except p.ProtocolError:
            continue
        wid = getattr(msg, "worker_id", "w0")
        rid = routing.get(wid, b"R0")
        if not isinstance(msg, p.Hello) and wid in st.workers:
            msg.seq = st.workers[wid].last_seq + 1  # in order, so the fact is applied, not answered with a resync
        replies = st.handle(rid, msg, now)
        num_applied += 1
        num_refused += any(isinstance(r, p.Error) for _, r in replies)
        try:
            roll = rng.random()
            if roll < 0.1:
                src, dst = rng.sample(sorted(st.workers) or ["w0", "w1"], 2) if len(st.workers) > 1 else ("w0", "w1")
                st.request_replication(src, dst, rng.choice([TOKENS, TOKENS[:7], [2 ** 31] * 4, list(range(99))]),
                                       "", rng.choice([1.0, 0.0, 1e9]), now)
            elif roll < 0.2:
                st.record_demand([rng.choice([{"input_ids": TOKENS}, {"input_ids": [-1]}, {"session_id": "u" * 300},
                                              msgspec.Raw(b'{"input_ids": [1, 2')])], [], now)
            elif roll < 0.25:
                st.record_hint({"kind": "fanout", "input_ids": TOKENS, "ttl_s": 1e5, "cache_salt": "t"}, now)
            elif roll < 0.3:
                st.lookup(rng.choice([TOKENS, list(range(65)), [2 ** 31]]), "")
            elif roll < 0.35:
                st.tick(now)
        except api.AdminError:
            pass
        if i % 250 == 0:
            st.check_integrity()
            for wid in st.workers:
                assert st.directory.num_pages(wid) <= 64
    st.check_integrity()
    assert num_applied > N // 4 and num_refused > 0
    assert all(h.ttl_s <= st.config.max_hint_ttl_s for h in st.hints)
