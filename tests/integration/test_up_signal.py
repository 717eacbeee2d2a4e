"""Ctrl-C (SIGINT) or SIGTERM stops `kvrep up`, `kvrep demo` and `kvrep bench` at once at any point: sent while
the workers are still starting, the command exits without ever reaching a ready cluster (before the fix `up`
waited for every worker, then started the router, and only then stopped); sent in the middle of a replay (through
our router or through smg), it exits without finishing the round. Either way no process it started is left.
The timeouts are liveness bounds only: what is asserted is what the command did, not how fast."""
import os
import signal
import subprocess
import sys
import time

import pytest

from kvrep_dev.cluster import ROOT
from tests.integration.test_up import alive, descendants

pytestmark = pytest.mark.server

EXIT_BOUND_S = 45
"""Liveness bound on the exit after the signal (the processes are stopped together, each given up to 20 s)."""


def start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "radix_sync.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=str(ROOT), start_new_session=True)


def read_until(proc: subprocess.Popen, lines: list[str], marker) -> None:
    while True:
        line = proc.stdout.readline()
        assert line, "".join(lines)
        lines.append(line)
        if marker(line):
            return


def wait_for_children(proc: subprocess.Popen, n: int) -> set[int]:
    """Until the command has started at least `n` processes (the coordinator and the SGLang workers)."""
    deadline = time.monotonic() + 120
    while True:
        started = descendants(proc.pid)
        if len(started) >= n or time.monotonic() > deadline:
            return started
        time.sleep(0.1)


def cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return ""


def stop_and_check(proc: subprocess.Popen, lines: list[str], sig: int, started: set[int]) -> str:
    started |= descendants(proc.pid)
    proc.send_signal(sig)
    try:
        proc.wait(EXIT_BOUND_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(lines) + proc.stdout.read()
    deadline = time.monotonic() + 10  # reaping by init after the parent exited
    while [p for p in started if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in started if alive(p)] == [], text
    return text


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_up_start_up_stops_everything_before_the_cluster_is_ready(tmp_path, sig):
    proc = start(["up", "--workers", "2", "--model", "tiny", "--logs", str(tmp_path)])
    lines: list[str] = []
    try:
        read_until(proc, lines, lambda line: "waiting for worker-0" in line)
        started = descendants(proc.pid)
        assert len(started) >= 3, started  # the coordinator and two SGLang workers, still starting
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    text = stop_and_check(proc, lines, sig, started)
    assert proc.returncode == 0, text  # a signal is how `kvrep up` ends
    assert "cluster ready" not in text and "waiting for worker-1" not in text, text
    assert "stopped" in text, text


BENCH = ["--model", "tiny", "--workers", "2", "--workloads", "fanout", "--duration-s", "20", "--fanout-rate", "2",
         "--fanout-k", "3", "--no-simulate"]


@pytest.mark.parametrize("command,sig", [("bench", signal.SIGTERM), ("demo", signal.SIGINT)])
def test_a_signal_during_bench_or_demo_start_up_stops_everything(tmp_path, command, sig):
    proc = start([command, *BENCH, "--arms", "shadow", "--out-dir", str(tmp_path)])
    lines: list[str] = []
    try:
        read_until(proc, lines, lambda line: "starting the coordinator" in line)
        started = wait_for_children(proc, 3)
        assert len(started) >= 3, started
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    text = stop_and_check(proc, lines, sig, started)
    assert proc.returncode == 128 + sig, text
    assert "cluster up" not in text and f"{signal.Signals(sig).name}: stopped" in text, text


@pytest.mark.parametrize("command,sig,arms", [("demo", signal.SIGTERM, "smg-ca,shadow")])
def test_a_signal_mid_replay_stops_everything(tmp_path, command, sig, arms):
    """Mid-replay through smg: smg's process goes too, and the round ends unfinished. (One case: each case starts a
    cluster, ~75 s of the suite; `bench` and SIGINT reach the same stop as `demo` and SIGTERM, tested at start-up
    above, and a replay through our router was the second case until stop 58.)"""
    proc = start([command, *BENCH, "--arms", arms, "--out-dir", str(tmp_path)])
    lines: list[str] = []
    first = arms.split(",")[0]
    try:
        read_until(proc, lines, lambda line: f"fanout/{first}" in line and "requests" in line)
        started = descendants(proc.pid)
        if first.startswith("smg-"):
            assert any("smg" in cmdline(p) for p in started), started
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    text = stop_and_check(proc, lines, sig, started)
    assert proc.returncode == 128 + sig, text
    assert f"{signal.Signals(sig).name}: stopped" in text, text
    # the round did not finish: no table, no second arm
    assert "TTFT in seconds at the client" not in text and f"fanout/{arms.split(',')[1]}" not in text, text
