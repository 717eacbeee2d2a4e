"""`kvrep keys` writes the shared key directory (every piece the four rooms read, 0600 in a 0700 directory, never
overwriting), `load_dir` reads it back (missing pieces None), the allow-list binds one key to one worker id, and no
process binds or advertises a non-loopback ZMQ address without keys unless told `--insecure`."""
import json
import os
import shutil
import stat

import pytest
import zmq
from zmq.auth import load_certificate

from radix_sync import cli
from radix_sync import keys as k
from radix_sync.coordinator.server import CoordinatorConfig
from sglang_kvrep import plugin
from sglang_kvrep.config import KvrepConfig
from tests.unit.test_plugin_flags import parse


@pytest.fixture
def keydir(tmp_path):
    out = tmp_path / "keys"
    assert cli.main(["keys", "--out", str(out), "--workers", "2", "--routers", "1"]) == 0
    return out


def test_kvrep_keys_writes_the_shared_layout(keydir):
    names = sorted(p.name for p in keydir.iterdir())
    assert names == ["admin-tokens.json", "allow", "coordinator.key", "coordinator.key_secret", "router-0.key",
                     "router-0.key_secret", "router-tokens.json", "tenant-secret", "worker-0.key",
                     "worker-0.key_secret", "worker-1.key", "worker-1.key_secret", "worker-api-key"]
    assert sorted(p.name for p in (keydir / "allow").iterdir()) == ["worker-0.key", "worker-1.key"]
    assert stat.S_IMODE(keydir.stat().st_mode) == 0o700 and stat.S_IMODE((keydir / "allow").stat().st_mode) == 0o700
    for path in keydir.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # pyzmq's own loader reads every certificate (the format is zmq.auth's)
    for name in ("coordinator", "worker-0", "worker-1", "router-0"):
        public, secret = load_certificate(keydir / f"{name}.key_secret")
        assert len(public) == len(secret) == 40
        assert load_certificate(keydir / f"{name}.key")[0] == public
    d = k.load_dir(keydir)
    assert d.coordinator.secret is not None and sorted(d.workers) == ["worker-0", "worker-1"]
    assert {wid: d.workers[f"{wid}"].worker_id for wid in d.workers} == {"worker-0": "worker-0", "worker-1": "worker-1"}
    assert d.allow == {d.workers["worker-0"].public: "worker-0", d.workers["worker-1"].public: "worker-1"}
    assert d.public_key_of("worker-1") == d.workers["worker-1"].public and d.public_key_of("router-0") is None
    assert list(d.routers) == ["router-0"] and d.routers["router-0"].public not in d.allow  # no plane serves routers
    for tokens in (d.admin_tokens, d.router_tokens):
        assert len(bytes.fromhex(tokens.read)) == len(bytes.fromhex(tokens.write)) == 32 and tokens.read != tokens.write
    assert json.loads((keydir / "admin-tokens.json").read_text()) == {"read": d.admin_tokens.read,
                                                                       "write": d.admin_tokens.write}
    assert len(d.tenant_secret) == 32 and len(bytes.fromhex(d.worker_api_key)) == 32
    assert len({d.admin_tokens.read, d.admin_tokens.write, d.router_tokens.read, d.router_tokens.write,
                d.tenant_secret.hex(), d.worker_api_key}) == 6


def test_kvrep_keys_never_overwrites(keydir, capsys):
    before = {p: p.read_bytes() for p in keydir.rglob("*") if p.is_file()}
    assert cli.main(["keys", "--out", str(keydir), "--workers", "1"]) == 2
    assert "refusing to overwrite existing keys" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in keydir.rglob("*") if p.is_file()} == before


def test_worker_ids_can_be_chosen_and_must_be_sane(tmp_path, capsys):
    d = k.create_dir(tmp_path / "a", 2, 0, worker_ids=["10.0.0.5:30000", "gpu-b"])
    assert sorted(d.allow.values()) == ["10.0.0.5:30000", "gpu-b"] and not d.routers
    assert cli.main(["keys", "--out", str(tmp_path / "b"), "--workers", "2", "--worker-ids", "x,x"]) == 2
    assert cli.main(["keys", "--out", str(tmp_path / "c"), "--workers", "1", "--worker-ids", 'a"\n b']) == 2
    assert "bad worker id" in capsys.readouterr().err
    assert cli.main(["keys", "--out", str(tmp_path / "d"), "--workers", "2"]) == 0
    assert "--kvrep-key-name worker-1   (worker id worker-1)" in capsys.readouterr().out


def test_a_worker_host_with_only_its_own_pieces(keydir, tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    for name in ("coordinator.key", "worker-1.key_secret"):
        shutil.copy(keydir / name, host / name)
    shutil.copytree(keydir / "allow", host / "allow")
    d = k.load_dir(host)
    assert d.coordinator.secret is None and list(d.workers) == ["worker-1"]
    assert d.pair("worker-1").worker_id == "worker-1"
    assert (d.admin_tokens, d.router_tokens, d.tenant_secret, d.worker_api_key) == (None, None, None, None)
    with pytest.raises(k.KeysError, match="no secret key coordinator.key_secret"):
        d.pair("coordinator")
    with pytest.raises(k.KeysError, match="no secret key worker-0.key_secret"):
        d.pair("worker-0")
    with pytest.raises(k.KeysError, match="no such key directory"):
        k.load_dir(tmp_path / "nowhere")


def test_allow_list_binds_one_key_to_one_worker(keydir):
    allow = keydir / "allow"
    # a second key claiming worker-0 (an attacker who may write one certificate): both refused, loudly
    pub, _ = zmq.curve_keypair()
    k._write_public_cert(allow / "evil.key", pub, {"worker_id": "worker-0"})
    with pytest.raises(k.KeysError, match="both name worker 'worker-0'"):
        k.load_dir(keydir)
    os.remove(allow / "evil.key")
    k._write_public_cert(allow / "anon.key", pub, {})
    with pytest.raises(k.KeysError, match="must name its worker"):
        k.load_dir(keydir)


def test_loopback_rule():
    for ep in ("tcp://127.0.0.1:5600", "tcp://localhost:5600", "tcp://[::1]:5600", "ipc:///tmp/x", "inproc://a",
               "tcp://127.0.0.2:1"):
        assert k.is_loopback_endpoint(ep), ep
    for ep in ("tcp://0.0.0.0:5600", "tcp://*:5600", "tcp://10.0.0.1:5600", "tcp://[::]:5600", "tcp://eth0:5600",
               "tcp://no-such-host.invalid:5600"):
        assert not k.is_loopback_endpoint(ep), ep


def test_coordinator_refuses_a_public_bind_without_keys(keydir, caplog):
    with pytest.raises(ValueError, match=r"--bind tcp://0.0.0.0:5600 is not a loopback address.*kvrep keys.*--keys"
                                         r" DIR, or pass --insecure"):
        CoordinatorConfig(bind="tcp://0.0.0.0:5600")
    CoordinatorConfig(bind="tcp://0.0.0.0:5600", insecure=True)
    CoordinatorConfig(bind="tcp://0.0.0.0:5600", keys=str(keydir))
    with pytest.raises(ValueError, match="max_msg_bytes"):
        CoordinatorConfig(max_msg_bytes=1 << 31)


def test_worker_refuses_to_leave_loopback_without_keys(keydir):
    with pytest.raises(ValueError, match=r"--kvrep-coordinator tcp://10.1.2.3:5600 is not a loopback.*--kvrep-keys"):
        KvrepConfig(coordinator="tcp://10.1.2.3:5600")
    with pytest.raises(ValueError, match=r"--kvrep-data-host 0.0.0.0 is not a loopback.*--kvrep-insecure"):
        KvrepConfig(data_host="0.0.0.0")
    KvrepConfig(coordinator="tcp://10.1.2.3:5600", data_host="10.1.2.4", insecure=True)
    KvrepConfig(coordinator="tcp://10.1.2.3:5600", data_host="10.1.2.4", keys=str(keydir), key_name="worker-0")
    with pytest.raises(ValueError, match="needs --kvrep-key-name"):
        KvrepConfig(keys=str(keydir))
    with pytest.raises(ValueError, match="no secret key worker-7.key_secret"):
        KvrepConfig(keys=str(keydir), key_name="worker-7")
    with pytest.raises(ValueError, match="differs from the id of key worker-0"):
        KvrepConfig(keys=str(keydir), key_name="worker-0", worker_id="worker-1")
    with pytest.raises(ValueError, match=r"--kvrep-max-data-msg-bytes must be in \[--kvrep-chunk-bytes"):
        KvrepConfig(chunk_bytes=8 << 20, max_data_msg_bytes=4 << 20)


def test_a_worker_with_a_key_takes_its_id_from_it(keydir):
    cfg = plugin.arrange_server_flags(parse("--enable-kv-replication", "--kvrep-coordinator", "tcp://10.0.0.1:5600",
                                            "--host", "10.0.0.7", "--kvrep-keys", str(keydir),
                                            "--kvrep-key-name", "worker-1"))
    assert (cfg.worker_id, cfg.data_host, cfg.http_url) == ("worker-1", "10.0.0.7", "http://10.0.0.7:30000")
    with pytest.raises(ValueError, match="is not a loopback address"):
        plugin.arrange_server_flags(parse("--enable-kv-replication", "--kvrep-coordinator", "tcp://10.0.0.1:5600"))
