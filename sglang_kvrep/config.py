"""The extension's configuration: the flags it adds to `sglang.launch_server` / `sglang serve`, parsed into a
frozen dataclass that travels to the scheduler process on `server_args._kvrep_config`."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KvrepConfig:
    coordinator: str = "tcp://127.0.0.1:5600"
    """ZMQ endpoint of the coordinator."""
    worker_id: str = ""
    """Stable worker name; default `<host>:<port>` of the HTTP server."""
    http_url: str = ""
    """URL clients reach this worker at; default `http://<host>:<port>`."""
    data_host: str = "127.0.0.1"
    """Address the data-plane socket binds to and advertises."""
    data_port: int = 0
    """Data-plane TCP port; 0 picks a free port."""
    replica_budget_tokens: int = 0
    """Most tokens held as unpromoted replicas; 0 means a quarter of the KV pool."""
    transfer_timeout_s: float = 30.0
    """A transfer with no progress for this long is dropped (nothing is written)."""
    chunk_bytes: int = 4 << 20
    """Payload frame size on the wire (at most 16 MiB: larger frames fault inside libzmq's buffers)."""
    staging_bytes: int = 256 << 20
    """Receive buffers kept for reuse between transfers."""
    send_rate_mbps: float = 0.0
    """Per-link cap on outgoing replication bytes, in MB/s; 0 means no cap."""
    transport: str = "zmq"
    """Name of the data-plane implementation (`sglang_kvrep.transport` registry)."""
    load_interval_s: float = 0.2
    """How often the scheduler thread reports its load."""
    shadow: bool = False
    """Publish facts but refuse to execute replication commands."""

    def __post_init__(self) -> None:
        if not self.coordinator.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kvrep-coordinator must be a ZMQ endpoint like tcp://host:port, got {self.coordinator!r}")
        if not 0 <= self.data_port < 65536:
            raise ValueError(f"--kvrep-data-port out of range: {self.data_port}")
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
        # NOTE: imported here, not at the top: the registry pulls in torch and zmq, which only the processes that
        # build a config need (the launcher and the scheduler, where sglang has loaded them anyway).
        from sglang_kvrep.transport import check_transport_name

        try:
            check_transport_name(self.transport)
        except ValueError as exc:
            raise ValueError(f"--kvrep-transport: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "KvrepConfig":
        return cls(**json.loads(text))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    if any("--enable-kv-replication" in a.option_strings for a in parser._actions):
        return  # idempotent: the hook may run twice in one process
    g = parser.add_argument_group("KV replication (sglang-kvrep)")
    g.add_argument("--enable-kv-replication", action="store_true",
                   help="Join a kvrep cluster: publish cache facts and execute KV replication commands.")
    g.add_argument("--kvrep-coordinator", default=KvrepConfig.coordinator, help="coordinator ZMQ endpoint")
    g.add_argument("--kvrep-worker-id", default="", help="worker name (default host:port)")
    g.add_argument("--kvrep-http-url", default="", help="advertised HTTP URL (default http://host:port)")
    g.add_argument("--kvrep-data-host", default=None, help="data-plane bind/advertise address (default --host)")
    g.add_argument("--kvrep-data-port", type=int, default=0, help="data-plane port (0: any free port)")
    g.add_argument("--kvrep-replica-budget-tokens", type=int, default=0,
                   help="max tokens held as replicas (0: a quarter of the KV pool)")
    g.add_argument("--kvrep-transfer-timeout-s", type=float, default=KvrepConfig.transfer_timeout_s)
    g.add_argument("--kvrep-chunk-bytes", type=int, default=KvrepConfig.chunk_bytes)
    g.add_argument("--kvrep-staging-bytes", type=int, default=KvrepConfig.staging_bytes,
                   help="receive buffers kept for reuse")
    g.add_argument("--kvrep-send-rate-mbps", type=float, default=0.0, help="cap on outgoing replication MB/s")
    g.add_argument("--kvrep-transport", default=KvrepConfig.transport,
                   help="data-plane transport between workers (default zmq)")
    g.add_argument("--kvrep-shadow", action="store_true", help="publish facts, never copy pages")


def from_namespace(ns: argparse.Namespace) -> KvrepConfig:
    host = getattr(ns, "host", "127.0.0.1") or "127.0.0.1"
    port = getattr(ns, "port", 30000)
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return KvrepConfig(
        coordinator=ns.kvrep_coordinator,
        worker_id=ns.kvrep_worker_id or f"{host}:{port}",
        http_url=ns.kvrep_http_url or f"http://{host}:{port}",
        data_host=ns.kvrep_data_host or host,
        data_port=ns.kvrep_data_port,
        replica_budget_tokens=ns.kvrep_replica_budget_tokens,
        transfer_timeout_s=ns.kvrep_transfer_timeout_s,
        chunk_bytes=ns.kvrep_chunk_bytes,
        staging_bytes=ns.kvrep_staging_bytes,
        send_rate_mbps=ns.kvrep_send_rate_mbps,
        transport=ns.kvrep_transport,
        shadow=ns.kvrep_shadow,
    )
