"""Ports for local servers come from below the ephemeral range, free, and never twice from one process."""
import socket

from kvrep_dev.cluster import _PORT_RANGE, free_port


def test_ports_are_below_the_ephemeral_range_free_and_distinct():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(_PORT_RANGE[0] <= p < _PORT_RANGE[1] < 32768 for p in ports)
    # never where SGLang 0.5.23 picks a server's own store port (22000-29999) before that server binds ours
    assert _PORT_RANGE[1] <= 22000
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("", p))  # still free on every address: nothing of ours holds it


def test_a_port_held_on_another_address_is_not_handed_out(monkeypatch):
    import kvrep_dev.cluster as cluster

    held = socket.socket()
    held.bind(("127.0.0.2", 0))  # held on another address than 127.0.0.1 (a coordinator bound on the host's IP)
    port = held.getsockname()[1]
    try:
        tries = iter([port, port + 1])

        class Rng:
            def randrange(self, lo, hi):
                return next(tries)
        monkeypatch.setattr(cluster.random, "Random", Rng)
        assert free_port() == port + 1  # a worker given `port` with --host 0.0.0.0 could not bind it
    finally:
        held.close()
