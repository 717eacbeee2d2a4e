"""`kvrep up` starts a working cluster (coordinator, workers, router) and leaves nothing behind on SIGTERM."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrep_dev.cluster import ROOT, bearer, http_json

pytestmark = pytest.mark.server


def descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                for child in Path(f"/proc/{p}/task/{task}/children").read_text().split():
                    if int(child) not in out:
                        out.add(int(child))
                        todo.append(int(child))
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_kvrep_up_serves_through_the_router_and_stops_cleanly(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "radix_sync.cli", "up", "--workers", "2", "--model", "tiny",
                             "--logs", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(ROOT), start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        text = "".join(lines)
        assert "cluster ready" in text, text
        router = re.search(r"router\s+(http://\S+)", text).group(1)
        status, out = http_json(router + "/generate", {"text": "def main():\n    return",
                                                       "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert status == 200 and out["meta_info"]["completion_tokens"] == 4, out
        assert http_json(router + "/kvrep/status")[0] == 401  # admin routes need the router's tokens
        status, st = http_json(router + "/kvrep/status", headers=bearer(tmp_path / "keys" / "router-tokens.json"))
        assert status == 200 and len(st["workers"]) == 2, st
        # the workers run with SGLang's --api-key: a client straight to a worker is refused
        worker = re.search(r"worker\s+(http://\S+)", text).group(1)
        assert http_json(worker + "/generate", {"input_ids": [5, 6, 7]})[0] == 401
        # the request that killed a worker is refused by the router; the cluster keeps serving
        status, out = http_json(router + "/generate", {"input_ids": [5, 6, 7, 5000]})
        assert status == 400, out
        status, out = http_json(router + "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 2}})
        assert status == 200, out
        started = descendants(proc.pid)
        assert len(started) >= 4  # coordinator, 2 workers (+ their scheduler/detokenizer), router
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, "".join(lines) + proc.stdout.read()
    time.sleep(1)
    assert [p for p in started if alive(p)] == []
    assert {"coordinator.log", "worker-0.log", "worker-1.log", "router.log"} <= {f.name for f in tmp_path.iterdir()}
