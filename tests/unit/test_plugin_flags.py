"""The plugin's flags: sensible defaults, what it arranges in SGLang's flags, and clear refusals."""
import argparse
import json
import subprocess
import sys

import pytest

from sglang_kvrep import plugin
from sglang_kvrep.config import KvrepConfig, add_cli_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--radix-eviction-policy", default="lru")
    parser.add_argument("--kv-events-config", default=None)
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--enable-priority-scheduling", action="store_true")
    parser.add_argument("--tp-size", type=int, default=1)
    add_cli_args(parser)
    add_cli_args(parser)  # idempotent
    ns = parser.parse_args(list(argv))
    ns._radix_eviction_policy_explicitly_set = "--radix-eviction-policy" in argv
    return ns


def test_two_flags_are_enough():
    ns = parse("--enable-kv-replication", "--kvrep-coordinator", "tcp://10.0.0.1:5600", "--port", "31000")
    cfg = plugin.arrange_server_flags(ns)
    assert cfg == KvrepConfig(coordinator="tcp://10.0.0.1:5600", worker_id="127.0.0.1:31000",
                              http_url="http://127.0.0.1:31000", data_host="127.0.0.1")
    assert ns.radix_eviction_policy == "priority"
    assert json.loads(ns.kv_events_config) == {"publisher": "kvrep"}
    assert KvrepConfig.from_json(cfg.to_json()) == cfg


def test_user_kv_events_publisher_is_kept(monkeypatch):
    monkeypatch.delenv(plugin.INNER_PUBLISHER_ENV, raising=False)
    ns = parse("--enable-kv-replication", "--kv-events-config", '{"publisher": "zmq", "endpoint": "tcp://*:6000"}')
    plugin.arrange_server_flags(ns)
    assert json.loads(ns.kv_events_config) == {"publisher": "kvrep", "endpoint": "tcp://*:6000"}
    import os
    assert json.loads(os.environ[plugin.INNER_PUBLISHER_ENV])["publisher"] == "zmq"


@pytest.mark.parametrize("argv,needle", [
    (("--radix-eviction-policy", "lru"), "--radix-eviction-policy lru"),
    (("--disable-radix-cache",), "--disable-radix-cache"),
    (("--enable-priority-scheduling",), "--enable-priority-scheduling"),
    (("--tp-size", "2"), "--tp-size"),
    (("--kv-events-config", '{"format": "dynamo"}'), "format"),
    (("--kv-events-config", "{nope"), "not JSON"),
])
def test_conflicting_flags_are_refused_clearly(argv, needle):
    ns = parse("--enable-kv-replication", *argv)
    with pytest.raises(plugin.KvrepFlagConflict) as exc:
        plugin.arrange_server_flags(ns)
    assert needle in str(exc.value) and "--enable-kv-replication" in str(exc.value)


def test_explicit_priority_policy_is_fine():
    ns = parse("--enable-kv-replication", "--radix-eviction-policy", "priority")
    plugin.arrange_server_flags(ns)
    assert ns.radix_eviction_policy == "priority"


@pytest.mark.parametrize("bad", [("--kvrep-coordinator", "localhost:5600"), ("--kvrep-chunk-bytes", "10"),
                                 ("--kvrep-send-rate-mbps", "-1")])
def test_bad_values(bad):
    with pytest.raises(ValueError):
        plugin.arrange_server_flags(parse("--enable-kv-replication", *bad))


def test_flag_off_does_nothing():
    ns = parse("--kvrep-coordinator", "tcp://1.2.3.4:1")
    assert plugin._before_from_cli_args(ns) is None
    assert ns.radix_eviction_policy == "lru" and ns.kv_events_config is None
    assert not hasattr(ns, "_kvrep_config_json")


def test_real_launcher_accepts_flags_and_refuses_conflicts():
    """Through `python -m sglang.launch_server` itself, with the plugin loaded from its entry point."""
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", "/nonexistent",
                          "--enable-kv-replication", "--radix-eviction-policy", "lru"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "--enable-kv-replication: --radix-eviction-policy lru cannot evict replicas first" in out.stderr
