"""The extension's configuration: the flags it adds to `sglang.launch_server` / `sglang serve`, parsed into a
frozen dataclass that travels to the scheduler process on SGLang's `ServerArgs` (see `sglang_kvrep.compat`).

The dataclass is the one place each setting is written: its default, type and docstring make the flag
(`--kvrep-<field>`, its default and its help); a few fields have no flag (`_NO_FLAG`).
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
from dataclasses import Field, asdict, dataclass, fields

from sglang_kvrep.address import advertised_host, host_in_url, is_wildcard


@dataclass(frozen=True)
class KvrepConfig:
    coordinator: str = "tcp://127.0.0.1:5600"
    """ZMQ endpoint of the coordinator."""
    worker_id: str = ""
    """Stable worker name; default `<advertised host>:<port>` of the HTTP server."""
    http_url: str = ""
    """URL clients reach this worker at; default `http://<advertised host>:<port>`."""
    advertise_host: str = ""
    """Address others reach this worker at (its default name, URL and data endpoint); default --host, or with a
    wildcard --host (0.0.0.0, ::) the address of the interface that routes to the coordinator."""
    data_host: str = "127.0.0.1"
    """Address the data-plane socket binds to."""
    data_port: int = 0
    """Data-plane TCP port; 0 picks a free port."""
    data_advertise_port: int = 0
    """Data-plane port peers connect to when it differs from the bound one (a forwarded port); 0: the bound one."""
    replica_budget_tokens: int = 0
    """Most tokens held as unpromoted replicas; 0 means a quarter of the KV pool."""
    transfer_timeout_s: float = 30.0
    """A transfer with no progress for this long is dropped (nothing is written)."""
    chunk_bytes: int = 4 << 20
    """Payload frame size on the wire (at most 16 MiB: larger frames fault inside libzmq's buffers)."""
    staging_bytes: int = 256 << 20
    """Receive buffers kept for reuse between transfers. On a GPU worker: pinned host memory the scheduler thread
    allocates once (the ZeroMQ transport receives into it first; a transfer that fits uploads in one asynchronous
    copy, a larger one lands in pageable memory and uploads in slices): size it to the largest replica."""
    send_rate_mbps: float = 0.0
    """Per-link cap on outgoing replication bytes, in MB/s; 0 means no cap."""
    transport: str = "zmq"
    """Data-plane implementation: "zmq" (ZeroMQ frames), "nixl" (NIXL/UCX writes into the target's registered
    staging buffer, ZeroMQ control; needs the `nixl` package) or "mooncake" (the same with Mooncake Transfer Engine;
    needs `mooncake-transfer-engine`) (`sglang_kvrep.dataplane.registry`)."""
    load_interval_s: float = 0.2
    """How often the scheduler thread reports its load."""
    shadow: bool = False
    """Publish facts but refuse to execute replication commands."""
    inner_kv_events: str = ""
    """The user's own `--kv-events-config` publisher (JSON), which ours forwards every batch to; "" for none."""
    keys: str = ""
    """Key directory (`kvrep keys`): CurveZMQ to the coordinator and on the data plane, peers only from its
    allow-list. Required when the coordinator or the data plane is not on loopback (or --kvrep-insecure)."""
    key_name: str = ""
    """This worker's key in --kvrep-keys (`worker-<i>`); the worker id defaults to the one the key names."""
    insecure: bool = False
    """Let the coordinator link or the data plane leave loopback without keys (unauthenticated, unencrypted)."""
    max_control_msg_bytes: int = 16 << 20
    """Largest frame accepted from the coordinator or in a data-plane reply; a larger one drops the link."""
    max_data_msg_bytes: int = 64 << 20
    """Largest frame the data port accepts (a chunk is at most --kvrep-chunk-bytes, or one page of every layer
    when that is larger); a larger one disconnects the peer before anything is buffered."""

    def __post_init__(self) -> None:
        if not self.coordinator.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kvrep-coordinator must be a ZMQ endpoint like tcp://host:port, got {self.coordinator!r}")
        for name in ("data_port", "data_advertise_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"--kvrep-{name.replace('_', '-')} out of range: {getattr(self, name)}")
        if self.advertise_host and is_wildcard(self.advertise_host):
            raise ValueError(f"--kvrep-advertise-host {self.advertise_host!r} is a wildcard, not an address others "
                             "can reach; give this host's address or leave it out")
        if self.replica_budget_tokens < 0:
            raise ValueError(f"--kvrep-replica-budget-tokens must be >= 0, got {self.replica_budget_tokens}")
        for name in ("transfer_timeout_s", "load_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 4096 <= self.chunk_bytes <= 16 << 20:
            raise ValueError(f"--kvrep-chunk-bytes must be in [4096, 16 MiB], got {self.chunk_bytes}")
        if self.staging_bytes < 0:
            raise ValueError(f"--kvrep-staging-bytes must be >= 0, got {self.staging_bytes}")
        if self.send_rate_mbps < 0:
            raise ValueError(f"--kvrep-send-rate-mbps must be >= 0, got {self.send_rate_mbps}")
        if not 1 << 16 <= self.max_control_msg_bytes <= 1 << 30:
            raise ValueError(f"--kvrep-max-control-msg-bytes must be in [64 KiB, 1 GiB], got "
                             f"{self.max_control_msg_bytes}")
        if not self.chunk_bytes <= self.max_data_msg_bytes <= 1 << 30:
            raise ValueError(f"--kvrep-max-data-msg-bytes must be in [--kvrep-chunk-bytes ({self.chunk_bytes}), "
                             f"1 GiB], got {self.max_data_msg_bytes}")
        self._check_keys()
        # NOTE: imported here, not at the top: the registry pulls in torch and zmq, which only the processes that
        # build a config need (the launcher and the scheduler, where sglang has loaded them anyway).
        from sglang_kvrep.dataplane.registry import check_transport_name

        try:
            check_transport_name(self.transport)
        except ValueError as exc:
            raise ValueError(f"--kvrep-transport: {exc}") from None

    def _check_keys(self) -> None:
        from radix_sync import keys as k

        if self.keys:
            if not self.key_name:
                raise ValueError("--kvrep-keys needs --kvrep-key-name (this worker's key, e.g. worker-0)")
            keydir = k.load_dir(self.keys)  # KeysError (a ValueError) names the bad file
            pair = keydir.pair(self.key_name)
            if keydir.coordinator is None:
                raise ValueError(f"--kvrep-keys {self.keys}: no coordinator.key (the coordinator's public key)")
            keydir.allow_list()
            if self.worker_id and pair.worker_id != self.worker_id:
                raise ValueError(f"--kvrep-worker-id {self.worker_id!r} differs from the id of key {self.key_name} "
                                 f"({pair.worker_id!r}); the coordinator would refuse it")
            return
        if self.insecure:
            return
        if not k.is_loopback_endpoint(self.coordinator):
            raise ValueError(k.insecure_error("--kvrep-coordinator", self.coordinator, "--kvrep-keys",
                                              "--kvrep-insecure"))
        if not k.is_loopback_host(self.data_host):
            raise ValueError(k.insecure_error("--kvrep-data-host", self.data_host, "--kvrep-keys",
                                              "--kvrep-insecure"))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "KvrepConfig":
        return cls(**json.loads(text))


_NO_FLAG = ("load_interval_s", "inner_kv_events")
"""Fields without a flag: a tuning constant, and one the plugin derives from SGLang's own `--kv-events-config`."""
_DEFAULT_FROM_HOST = ("data_host",)
"""Flags whose default is SGLang's `--host` rather than the field's default."""


def _flag_fields() -> list[Field]:
    return [f for f in fields(KvrepConfig) if f.name not in _NO_FLAG]


def _field_docs() -> dict[str, str]:
    """Each field's docstring (the string under it), used as its flag's help."""
    try:
        cls = ast.parse(inspect.getsource(KvrepConfig)).body[0]
    except (OSError, TypeError, IndexError):  # no source (a frozen install): flags without help
        return {}
    docs = {}
    for prev, node in zip(cls.body, cls.body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name) and isinstance(node, ast.Expr) \
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docs[prev.target.id] = " ".join(node.value.value.split()).replace("%", "%%")
    return docs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    if any("--enable-kv-replication" in a.option_strings for a in parser._actions):
        return  # idempotent: the hook may run twice in one process
    g = parser.add_argument_group("KV replication (sglang-kvrep)")
    g.add_argument("--enable-kv-replication", action="store_true",
                   help="Join a kvrep cluster: publish cache facts and execute KV replication commands.")
    docs = _field_docs()
    for f in _flag_fields():
        flag = "--kvrep-" + f.name.replace("_", "-")
        help_text = docs.get(f.name)
        if isinstance(f.default, bool):
            g.add_argument(flag, action="store_true", default=f.default, help=help_text)
        elif f.name in _DEFAULT_FROM_HOST:
            g.add_argument(flag, type=type(f.default), default=None, help=f"{help_text} (default: --host)")
        else:
            g.add_argument(flag, type=type(f.default), default=f.default, help=help_text)


def from_namespace(ns: argparse.Namespace, *, host: str, port: int, inner_kv_events: str = "") -> KvrepConfig:
    """The config from parsed flags; `host`/`port` are SGLang's `--host`/`--port`: the data plane binds `host`
    too, and the worker's name, URL and data endpoint use the advertised host (`sglang_kvrep.address`).

    Raises:
        ValueError: a bad value (see `KvrepConfig`).
    """
    values = {f.name: getattr(ns, "kvrep_" + f.name) for f in _flag_fields()}
    if values["advertise_host"] and is_wildcard(values["advertise_host"]):
        return KvrepConfig(**values)  # raises the clear error
    advertised = advertised_host(host, values["advertise_host"], values["coordinator"])
    values["advertise_host"] = advertised
    values["worker_id"] = values["worker_id"] or _key_worker_id(values) or f"{host_in_url(advertised)}:{port}"
    values["http_url"] = values["http_url"] or f"http://{host_in_url(advertised)}:{port}"
    values["data_host"] = values["data_host"] or host
    return KvrepConfig(**values, inner_kv_events=inner_kv_events)


def _key_worker_id(values: dict) -> str:
    """The worker id the worker's key names ("" without keys; a bad key directory is reported by the config)."""
    if not (values.get("keys") and values.get("key_name")):
        return ""
    from radix_sync.keys import load_dir

    try:
        pair = load_dir(values["keys"]).workers.get(values["key_name"])
    except ValueError:
        return ""
    return (pair.worker_id or "") if pair is not None else ""
