"""Without --enable-kv-replication the plugin does nothing: same outputs as SGLang without the plugin, and no
thread or socket of ours."""
import os
from pathlib import Path

import pytest

from kvrep_dev.cluster import Worker
from tests.integration.conftest import LOGS, WORKER_ARGS, prompt

pytestmark = pytest.mark.server


def thread_names(pid: int) -> set[str]:
    names = set()
    pids = [pid] + [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for proc in list(pids):
        try:
            pids += [int(c) for t in os.listdir(f"/proc/{proc}/task")
                     for c in Path(f"/proc/{proc}/task/{t}/children").read_text().split() if int(c) not in pids]
        except OSError:
            pass
    for proc in set(pids):
        try:
            for t in os.listdir(f"/proc/{proc}/task"):
                names.add(Path(f"/proc/{proc}/task/{t}/comm").read_text().strip())
        except OSError:
            pass
    return names


@pytest.fixture(scope="module")
def servers():
    # flag off, plugin installed and loaded;  and plain SGLang with the plugin not even loaded
    # a --kvrep-* flag is only accepted when the plugin is loaded: it proves the plugin is there, flag off
    off = Worker("P-flag-off", "tiny", LOGS, page_size=16, kvrep=False,
                 extra_args=WORKER_ARGS + ("--kvrep-coordinator", "tcp://127.0.0.1:9"))
    env_plain = {"SGLANG_PLUGINS": "no-such-plugin"}
    plain = Worker("P-plain", "tiny", LOGS, page_size=16, extra_args=WORKER_ARGS, kvrep=False, env=env_plain)
    try:
        off.wait_ready()
        plain.wait_ready()
        yield off, plain
    finally:
        off.stop()
        plain.stop()


def test_flag_off_outputs_equal_plain_sglang(servers):
    off, plain = servers
    for seed, length in ((60, 40), (61, 700), (62, 1200)):
        P = prompt(seed, length)
        for _ in range(2):  # second time through the radix cache
            a, b = off.generate(P, 24), plain.generate(P, 24)
            assert a["output_ids"] == b["output_ids"]
            assert a["meta_info"]["cached_tokens"] == b["meta_info"]["cached_tokens"]


def test_flag_off_starts_no_thread_and_no_agent(servers, cluster):
    off, plain = servers
    assert "kvrep-io" not in thread_names(off.pid)
    assert "kvrep-io" in thread_names(cluster.a.pid)  # the check can see our thread when it exists
    log = off.log_path.read_text(errors="replace")
    assert "kvrep agent" not in log
    assert "kvrep agent" in cluster.a.log_path.read_text(errors="replace")
    assert off.worker_id not in cluster.coord.workers()
