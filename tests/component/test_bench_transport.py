"""`scripts/bench_transport.py` run small: two processes on loopback, raw TCP, the ZeroMQ transport, the NIXL
transport (UCX over TCP) and the Mooncake transport (its TCP transport) each move real transfers through the agent's own
transport objects, and the script prints one row per size with a rate for each. No speed is asserted (noisy
2-core hosts): what must hold is that every transfer landed (the source saw no `TransferFailed`, the target reported
none) and that the table is complete."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_transport_moves_zmq_nixl_and_mooncake_transfers_between_processes():
    # UCX over TCP: the path between two hosts without RDMA (between two processes of one host UCX would pick
    # shared memory; the unit tests' agents share a process)
    ucx_tls = "tcp"
    argv = [sys.executable, str(ROOT / "scripts" / "bench_transport.py"), "--sizes", "4M,8M", "--repeats", "1",
            "--chunk-bytes", "2M"]  # a page is 2 MiB (16 tokens x 128 KiB)
    if ucx_tls:
        argv += ["--ucx-tls", ucx_tls]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if " NIXL " not in line]  # NIXL logs to stdout too
    assert lines[0].startswith("command: ")
    assert "zmq GB/s" in lines[1] and "nixl GB/s" in lines[1] and "mooncake GB/s" in lines[1], lines[1]
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["4M", "8M"]
    for r in rows:
        assert len(r) == 1 + 1 + 3 * 3 and all(float(x) > 0 for x in r[1:]), r
    assert "target: TransferFailed" not in proc.stderr
    assert not re.search(r"Traceback", proc.stderr)
