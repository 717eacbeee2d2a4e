"""Ports for local servers come from below the ephemeral range, free, and never twice from one process."""
import socket

from kvrep_dev.cluster import _PORT_RANGE, free_port


def test_ports_are_below_the_ephemeral_range_free_and_distinct():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(_PORT_RANGE[0] <= p < _PORT_RANGE[1] < 32768 for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free: nothing of ours holds it
