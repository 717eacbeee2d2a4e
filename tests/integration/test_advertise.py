"""A worker started with `--host 0.0.0.0` names itself by an address the others can reach (issue 17's "every
worker is named `127.0.0.1:<port>` and binds its data plane to loopback"): a real CPU SGLang worker with the
plugin, a real coordinator bound to this host's non-loopback address. Without `--kvrep-advertise-host` the worker
takes the address of the interface that routes to the coordinator; its id, URL and data endpoint use it, and its
data plane is reachable there."""
import socket
from urllib.parse import urlsplit

import pytest

from kvrep_dev.cluster import Coordinator, Worker, free_port
from sglang_kvrep.address import routable_host

from .conftest import LOGS, PAGE_SIZE, WORKER_ARGS

pytestmark = pytest.mark.server


def host_address() -> str:
    """This host's address on the interface of its default route (a TEST-NET-1 address is only routed, never
    sent to)."""
    return routable_host("tcp://192.0.2.1:9")


def test_a_wildcard_host_worker_advertises_the_address_that_reaches_the_coordinator():
    ip = host_address()
    if ip.startswith("127.") or ip == "::1":
        pytest.skip("this host has no non-loopback interface: nothing but loopback to advertise")
    LOGS.mkdir(parents=True, exist_ok=True)
    zport = free_port()
    coord = Coordinator(LOGS, name="coord-advertise", port=zport,
                        extra_args=("--bind", f"tcp://{ip}:{zport}", "--insecure", "--policy", "none"))
    worker = None
    try:
        coord.wait_ready()
        worker = Worker("advertise", "tiny", LOGS, coordinator=f"tcp://{ip}:{zport}", page_size=PAGE_SIZE,
                        extra_args=(*WORKER_ARGS, "--host", "0.0.0.0", "--kvrep-insecure"))
        worker.wait_ready()
        wid = f"{ip}:{worker.port}"
        coord.wait_workers([wid], timeout_s=60)
        info = coord.workers()[wid]
        assert info["url"] == f"http://{ip}:{worker.port}"
        data = urlsplit(info["data_endpoint"])
        assert data.scheme == "tcp" and data.hostname == ip, info["data_endpoint"]
        with socket.create_connection((ip, data.port), timeout=5):  # the data plane listens there
            pass
        assert not any(w.startswith("127.0.0.1:") for w in coord.workers())
    finally:
        if worker is not None:
            worker.stop()
        coord.stop()
