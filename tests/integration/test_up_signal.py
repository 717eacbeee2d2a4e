"""SIGTERM stops `kvrep up` at once at any point: sent while the workers are still starting, the command exits
without ever reaching "cluster ready" (before the fix it waited for every worker, then started the router, and only
then stopped), and leaves no process behind."""
import os
import signal
import subprocess
import sys
import time

import pytest

from kvrep_dev.cluster import ROOT
from tests.integration.test_up import alive, descendants

pytestmark = pytest.mark.server


def test_sigterm_during_start_up_stops_everything_before_the_cluster_is_ready(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "radix_sync.cli", "up", "--workers", "2", "--model", "tiny",
                             "--logs", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(ROOT), start_new_session=True)
    lines = []
    try:
        while True:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            if "waiting for worker-0" in line:
                break
        started = descendants(proc.pid)
        assert len(started) >= 3, started  # the coordinator and two SGLang workers, still starting
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)  # a liveness bound only: the assertion below is on what it did, not how fast
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(lines) + proc.stdout.read()
    assert proc.returncode == 0, text
    assert "cluster ready" not in text and "waiting for worker-1" not in text, text
    assert "stopped" in text, text
    time.sleep(1)
    assert [p for p in started if alive(p)] == []
