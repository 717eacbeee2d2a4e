"""Which address a worker names itself by: with `--host 0.0.0.0` (or `::`) it advertises `--kvrep-advertise-host`
or the address of this machine's interface that routes to the coordinator, never a wildcard and never loopback
towards a remote coordinator; its data plane binds what the server binds. The I/O side advertises that address in
its Hello, and a peer reaches the data plane there (real sockets)."""
import socket

import psutil
import pytest
import zmq

from radix_sync import protocol as p
from sglang_kvrep.address import advertised_endpoint, advertised_host, routable_host
from sglang_kvrep.config import KvrepConfig, from_namespace
from sglang_kvrep.dataplane.wire import send_transfer
from tests.unit.test_plugin_flags import parse
from tests.unit.test_transport import FakeCoordinator, StubAgent, header, payload_of


def local_ipv4() -> list[str]:
    """This machine's non-loopback IPv4 addresses (read from the interfaces, not by the code under test)."""
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


def test_the_route_to_the_coordinator_names_the_interface():
    assert routable_host("tcp://127.0.0.1:5600") == "127.0.0.1"
    assert routable_host("ipc:///tmp/kvrep-coord") == "127.0.0.1"  # same machine
    assert routable_host("tcp://no-such-host.invalid:5600") == "127.0.0.1"  # nothing reaches it anyway
    assert routable_host("tcp://[::1]:5600") == "::1"
    for addr in local_ipv4():  # a coordinator on this machine's own address is reached from that address
        assert routable_host(f"tcp://{addr}:5600") == addr


def test_a_wildcard_host_advertises_a_reachable_address():
    addrs = local_ipv4()
    coord = f"tcp://{addrs[0]}:5600" if addrs else "tcp://127.0.0.1:5600"
    ns = parse("--enable-kv-replication", "--kvrep-insecure", "--host", "0.0.0.0", "--port", "31000", "--kvrep-coordinator", coord)
    cfg = from_namespace(ns, host="0.0.0.0", port=31000)
    expected = addrs[0] if addrs else "127.0.0.1"
    assert (cfg.advertise_host, cfg.worker_id, cfg.http_url) == (expected, f"{expected}:31000",
                                                                  f"http://{expected}:31000")
    assert cfg.data_host == "0.0.0.0"  # the data plane binds what the server binds
    # the flag wins; a concrete --host is its own address; IPv6 literals go in brackets
    ns = parse("--enable-kv-replication", "--kvrep-insecure", "--kvrep-advertise-host", "10.1.2.3")
    cfg = from_namespace(ns, host="0.0.0.0", port=31000)
    assert (cfg.worker_id, cfg.http_url, cfg.data_host) == ("10.1.2.3:31000", "http://10.1.2.3:31000", "0.0.0.0")
    assert advertised_host("10.0.0.7", "", "tcp://10.0.0.1:5600") == "10.0.0.7"
    cfg = from_namespace(parse("--enable-kv-replication", "--kvrep-insecure", "--kvrep-advertise-host", "fd00::7"), host="::", port=5)
    assert (cfg.worker_id, cfg.http_url) == ("[fd00::7]:5", "http://[fd00::7]:5")
    with pytest.raises(ValueError, match="wildcard"):
        from_namespace(parse("--enable-kv-replication", "--kvrep-insecure", "--kvrep-advertise-host", "0.0.0.0"), host="::", port=5)
    with pytest.raises(ValueError, match="data-advertise-port out of range"):
        KvrepConfig(data_advertise_port=70000)


def test_the_advertised_data_endpoint():
    assert advertised_endpoint("tcp://0.0.0.0:4100", "10.1.2.3") == "tcp://10.1.2.3:4100"
    assert advertised_endpoint("tcp://0.0.0.0:4100", "fd00::7", 4200) == "tcp://[fd00::7]:4200"
    assert advertised_endpoint("tcp://127.0.0.1:4100", "") == "tcp://127.0.0.1:4100"


def test_a_worker_bound_to_the_wildcard_advertises_an_endpoint_peers_reach():
    ctx = zmq.Context()
    coord = FakeCoordinator(ctx)
    w = StubAgent("w", coord.endpoint, data_host="0.0.0.0", advertise_host="127.0.0.1", insecure=True)
    try:
        [hello] = coord.wait_for(p.Hello)
        bound = w.loop.transport.endpoint
        assert bound.startswith("tcp://0.0.0.0:")
        assert hello.data_endpoint == w.data_endpoint == "tcp://127.0.0.1:" + bound.rsplit(":", 1)[1]
        h = header()
        reply = send_transfer(hello.data_endpoint, h, payload_of(h).numpy().tobytes(), timeout_s=10)
        assert isinstance(reply, p.TransferRefused) and "not authorized" in reply.error  # reached, and checked
    finally:
        w.close()
        coord.sock.close()
        ctx.destroy(linger=0)
