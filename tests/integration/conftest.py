"""Real CPU SGLang servers with the plugin, and a real coordinator process, shared across the integration tests.

Session-wide: one coordinator and workers A and B (tiny local model, page size 16), whose data plane is NIXL
(`--kvrep-transport nixl`: replications between them are NIXL WRITEs). Tests that need another server (another page
size, a plain SGLang, a source to kill) start it in their own module and stop it after; those run the default
ZeroMQ transport, so their copies to and from A and B cross a mixed fleet (a NIXL target takes ZMQ transfers, a
NIXL source falls back to ZMQ for a ZMQ-only target).
"""
import contextlib
import random
import time
from pathlib import Path

import pytest

from kvrep_dev.cluster import Coordinator, Worker
from tests.util import wait_until  # noqa: F401 (re-exported to the tests)

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "logs" / "tests"
PAGE_SIZE = 16
WORKER_ARGS = ("--max-running-requests", "2")
SESSION_TRANSPORT = ("--kvrep-transport", "nixl")
RULES = ("--policy", "rules", "--rule-min-prefix-len", "256", "--rule-min-hits", "3", "--rule-window-s", "60",
         "--rule-max-queue", "0", "--rule-ttl-s", "120", "--worker-timeout-s", "5",
         "--ledger-holdout", "0")  # the automatic copies these tests wait for are all made (none held out)




ROUTER_KEYS = LOGS / "router-keys"
"""The routers' credentials in these tests (`kvrep_dev.cluster.local_keys`; `Router(LOGS, router_keys(), ...)`)."""


def router_keys() -> Path:
    from kvrep_dev.cluster import local_keys

    return local_keys(ROUTER_KEYS)


def router_admin(level: str = "read") -> dict:
    """Returns: the `Authorization` header of the test routers' `level` admin token."""
    from kvrep_dev.cluster import bearer

    return bearer(router_keys() / "router-tokens.json", level)


def router_status(router_url: str, timeout: float = 60.0) -> dict:
    """Returns: a test router's `/kvrep/status` (with its read token)."""
    from kvrep_dev.cluster import http_json

    status, out = http_json(router_url + "/kvrep/status", timeout=timeout, headers=router_admin())
    assert status == 200, out
    return out


def wait_router_synced(coord: Coordinator, router_url: str, timeout_s: float = 30.0) -> None:
    """Until a router's mirror of the directory has every change `coord` has made (its decisions then see them)."""
    def synced():
        feed = coord.get("/status")[1]["feed"]
        mirror = router_status(router_url)["coordinator"]["directory_replica"]
        return mirror["usable"] and mirror["epoch"] == feed["epoch"] and mirror["seq"] >= feed["seq"]
    wait_until(synced, timeout_s, what="router's directory mirror in sync with the coordinator")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(length)]


class Cluster:
    def __init__(self, coord: Coordinator, a: Worker, b: Worker, procs: list) -> None:
        self.coord, self.a, self.b = coord, a, b
        self.procs = procs
        """Everything to stop at the end of the session (a test may add a restarted coordinator)."""

    def load(self, worker: Worker) -> dict:
        return self.coord.workers()[worker.worker_id]["load"]

    def free_plus_evictable(self, worker: Worker) -> int:
        time.sleep(1.5)  # let an idle scheduler report a fresh load
        load = self.load(worker)
        return load["available_tokens"] + load["evictable_tokens"]

    def replicate(self, src: Worker, dst: Worker, input_ids, **extra) -> dict:
        status, rep = self.coord.post("/replicate", {"source": src.worker_id, "target": dst.worker_id,
                                                     "input_ids": input_ids, **extra})
        assert status == 200, rep
        done = self.coord.wait_replication(rep["id"])
        assert self.coord.get("/status")[1]["integrity"] == "ok"
        return done

    def lookup(self, input_ids, cache_salt="") -> dict:
        status, body = self.coord.post("/directory/lookup", {"input_ids": input_ids, "cache_salt": cache_salt})
        assert status == 200, body
        return body["matched"]


@contextlib.contextmanager
def joined_worker(cluster: Cluster, name: str, **kwargs):
    """Another tiny-model worker joined to the session's coordinator (for one module's tests); stopped after."""
    kwargs.setdefault("extra_args", WORKER_ARGS)
    w = Worker(name, "tiny", LOGS, coordinator=cluster.coord.endpoint, page_size=PAGE_SIZE, **kwargs)
    try:
        w.wait_ready()
        cluster.coord.wait_workers([w.worker_id])
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="session")
def cluster():
    LOGS.mkdir(parents=True, exist_ok=True)
    coord = Coordinator(LOGS, extra_args=RULES)
    procs = [coord]
    try:
        coord.wait_ready()
        a = Worker("A", "tiny", LOGS, coordinator=coord.endpoint, page_size=PAGE_SIZE,
                   extra_args=WORKER_ARGS + SESSION_TRANSPORT)
        procs.append(a)
        b = Worker("B", "tiny", LOGS, coordinator=coord.endpoint, page_size=PAGE_SIZE,
                   extra_args=WORKER_ARGS + SESSION_TRANSPORT + ("--kvrep-transfer-timeout-s", "4"))
        procs.append(b)
        a.wait_ready()
        b.wait_ready()
        coord.wait_workers([a.worker_id, b.worker_id])
        yield Cluster(coord, a, b, procs)
    finally:
        for proc in reversed(procs):
            proc.stop()
