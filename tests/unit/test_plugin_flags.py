"""The plugin's flags: sensible defaults (the dataclass's, written once), what it arranges in SGLang's flags, the
config that reaches the scheduler process, and clear refusals (conflicting flags, another SGLang version)."""
import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from sglang_kvrep import compat, events, plugin
from sglang_kvrep.config import KvrepConfig, add_cli_args


def _parser() -> argparse.ArgumentParser:
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
    return parser


def parse(*argv: str) -> argparse.Namespace:
    ns = _parser().parse_args(list(argv))
    ns._radix_eviction_policy_explicitly_set = "--radix-eviction-policy" in argv
    return ns


def test_two_flags_are_enough():
    ns = parse("--enable-kv-replication", "--kvrep-coordinator", "tcp://127.0.0.2:5600", "--port", "31000")
    cfg = plugin.arrange_server_flags(ns)
    assert cfg == KvrepConfig(coordinator="tcp://127.0.0.2:5600", worker_id="127.0.0.1:31000",
                              http_url="http://127.0.0.1:31000", advertise_host="127.0.0.1", data_host="127.0.0.1")
    assert ns.radix_eviction_policy == "priority"
    assert json.loads(ns.kv_events_config) == {"publisher": "kvrep"}
    assert KvrepConfig.from_json(cfg.to_json()) == cfg


def test_user_kv_events_publisher_is_kept(monkeypatch):
    ns = parse("--enable-kv-replication", "--kv-events-config", '{"publisher": "zmq", "endpoint": "tcp://*:6000"}')
    cfg = plugin.arrange_server_flags(ns)
    assert json.loads(ns.kv_events_config) == {"publisher": "kvrep", "endpoint": "tcp://*:6000"}
    # the user's publisher travels in our config (on ServerArgs), not in the environment
    assert json.loads(cfg.inner_kv_events) == {"publisher": "zmq", "endpoint": "tcp://*:6000"}
    assert KvrepConfig.from_json(cfg.to_json()) == cfg
    # in the scheduler process our publisher finds it there and forwards every batch to it
    made = []
    monkeypatch.setattr(compat, "process_config", lambda: cfg.to_json())
    monkeypatch.setattr(compat, "create_event_publisher", lambda kind, rank, **kw: made.append((kind, rank, kw)))
    events.KvrepEventPublisher(attn_dp_rank=0, endpoint="tcp://*:5557", topic="")
    assert made == [("zmq", 0, {"endpoint": "tcp://*:6000", "topic": ""})]
    made.clear()
    monkeypatch.setattr(compat, "process_config", lambda: plugin.arrange_server_flags(parse(
        "--enable-kv-replication")).to_json())
    events.KvrepEventPublisher(attn_dp_rank=0, endpoint="tcp://*:5557")
    assert made == []  # no publisher of the user's: none to forward to


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


def test_flag_off_does_nothing(monkeypatch):
    monkeypatch.setattr("sglang_kvrep.compat.version.sglang_version", lambda: "9.9.9")  # not even checked
    ns = parse("--kvrep-coordinator", "tcp://1.2.3.4:1")
    assert plugin._before_from_cli_args(ns) is None
    assert ns.radix_eviction_policy == "lru" and ns.kv_events_config is None
    assert compat.attached_config(ns) is None
    server_args = argparse.Namespace()
    assert plugin._after_from_cli_args(server_args, ns) is server_args
    assert compat.attached_config(server_args) is None


def test_the_config_reaches_server_args_through_the_two_from_cli_args_hooks():
    """BEFORE arranges the flags and keeps the config on the launcher's namespace (found among the hook's
    arguments); AFTER puts it on the `ServerArgs` built from it, which the scheduler process reads."""
    ns = parse("--enable-kv-replication", "--kvrep-coordinator", "tcp://127.0.0.2:5600")
    assert plugin._before_from_cli_args(object, ns) is None
    assert ns.radix_eviction_policy == "priority"
    server_args = argparse.Namespace()
    assert plugin._after_from_cli_args(server_args, object, ns) is server_args
    cfg = KvrepConfig.from_json(compat.scheduler_config(argparse.Namespace(server_args=server_args)))
    assert cfg.coordinator == "tcp://127.0.0.2:5600" and cfg.worker_id == "127.0.0.1:30000"


def test_another_sglang_version_is_refused_when_enabled(monkeypatch):
    assert compat.sglang_version() == compat.SUPPORTED_SGLANG == "0.5.23"
    monkeypatch.setattr("sglang_kvrep.compat.version.sglang_version", lambda: "0.5.24")
    ns = parse("--enable-kv-replication")
    with pytest.raises(plugin.KvrepFlagConflict) as exc:
        plugin._before_from_cli_args(ns)
    assert str(exc.value).startswith("error: --enable-kv-replication: sglang-kvrep supports sglang 0.5.23 only, "
                                     "but sglang 0.5.24 is installed")
    assert compat.attached_config(ns) is None and ns.radix_eviction_policy == "lru"


def test_every_flag_default_is_the_dataclass_default():
    ns = parse("--enable-kv-replication")
    defaults = KvrepConfig()
    flagged = [f for f in dataclasses.fields(KvrepConfig) if f.name not in ("load_interval_s", "inner_kv_events")]
    for f in flagged:
        got = getattr(ns, "kvrep_" + f.name)
        if f.name == "data_host":
            assert got is None  # SGLang's --host
        else:
            assert got == getattr(defaults, f.name) and type(got) is type(getattr(defaults, f.name)), f.name
    assert not hasattr(ns, "kvrep_load_interval_s") and not hasattr(ns, "kvrep_inner_kv_events")
    ns = parse("--enable-kv-replication", "--kvrep-data-port", "7000", "--kvrep-send-rate-mbps", "12.5",
               "--kvrep-shadow", "--kvrep-data-host", "10.0.0.2", "--host", "10.0.0.1", "--kvrep-insecure")
    cfg = plugin.arrange_server_flags(ns)
    assert (cfg.data_port, cfg.send_rate_mbps, cfg.shadow, cfg.data_host) == (7000, 12.5, True, "10.0.0.2")
    assert (cfg.worker_id, cfg.http_url) == ("10.0.0.1:30000", "http://10.0.0.1:30000")
    assert plugin.arrange_server_flags(parse("--enable-kv-replication", "--host", "10.0.0.1",
                                             "--kvrep-insecure")).data_host == "10.0.0.1"
    helps = {a.dest: a.help for a in _parser()._actions}
    assert helps["kvrep_coordinator"] == "ZMQ endpoint of the coordinator."  # the field's docstring


def test_real_launcher_accepts_flags_and_refuses_conflicts():
    """Through `python -m sglang.launch_server` itself, with the plugin loaded from its entry point."""
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", "/nonexistent",
                          "--enable-kv-replication", "--radix-eviction-policy", "lru"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "--enable-kv-replication: --radix-eviction-policy lru cannot evict replicas first" in out.stderr
