"""Start and stop real processes of a local cluster: SGLang CPU workers with the plugin, the coordinator and the
router, and the cluster's secrets (`local_keys`).

Used by the integration tests, the demo and the measurement scripts. Every process is started in its own
session and stopped by its PID's process group, so nothing is left behind.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("KVREP_LOCAL_CACHE", ROOT / ".cache"))


_PORT_RANGE = (12000, 22000)
"""Ports handed to servers come from below Linux's ephemeral range (32768-60999): a server binds its port only
after ~25 s of start-up, and a port the OS chose (`bind(0)`) is also what any process's outgoing connection or
SGLang's own internal ports (`get_open_port`) get meanwhile. Seen in CI: a worker failed with "address already
in use" on the port it was given. And below 22000: SGLang 0.5.23 picks each server's torch.distributed store port
(`nccl_port`, bound on 0.0.0.0) from 22000-29999 itself (`get_free_port_below_ephemeral` in
`sglang/srt/utils/network.py`), at start-up, before the server binds its HTTP port: seen in the suite, a worker
given 22577 whose own store had taken it ("error while attempting to bind on address ('0.0.0.0', 22577)")."""
_given: set[int] = set()


def free_port() -> int:
    """A localhost TCP port free now, below the ephemeral range, never handed out before by this process."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every IPv4 address: a worker may bind the wildcard (`--host 0.0.0.0`)
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORT_RANGE} after 200 tries")


def prepared() -> dict:
    """Local models and the libcuda stand-in (built on first use)."""
    from kvrep_dev.prepare import prepare

    return prepare(CACHE)


def server_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    from kvrep_dev.prepare import with_stand_in

    info = prepared()
    env.update(SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if info["libcuda_dir"]:  # last on the path: never ahead of a real driver (kvrep_dev/prepare.py)
        env["LD_LIBRARY_PATH"] = with_stand_in(env.get("LD_LIBRARY_PATH", ""), info["libcuda_dir"])
    env.update(extra or {})
    return env


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this host's CPU computes bf16 natively (AVX512-BF16 or AMX-BF16). Without it (e.g. AVX2-only
    hosts) PyTorch's bf16 matmul falls back to a slow path: measured on an AVX2 AMD EPYC VM, 0.94 GFLOP/s
    against 66 GFLOP/s in float32, and a 2,400-token prefill of the `small` model in 15.4 s against 3.0-3.6 s."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return True  # unknown (not Linux): keep the model's own dtype


def worker_dtype_args(extra_args: tuple[str, ...] = ()) -> list[str]:
    """The `--dtype` a local CPU worker runs with: `KVREP_WORKER_DTYPE` if set (`auto` = the model's own), else
    float32 on a CPU without native bf16, else the model's own (bf16 for the local models). Nothing when the
    caller passes `--dtype` itself. Every worker of a local cluster gets the same, so their fingerprints match."""
    if "--dtype" in extra_args:
        return []
    choice = os.environ.get("KVREP_WORKER_DTYPE", "").strip()
    if not choice:
        choice = "auto" if cpu_has_native_bf16() else "float32"
    return [] if choice == "auto" else ["--dtype", choice]


def model_path(name: str) -> str:
    if os.path.isdir(name):
        return name
    return prepared()["models"][name]


def local_keys(folder: Path) -> Path:
    """Creates (once) the secrets of a local cluster in `folder` (0700; files 0600, as `kvrep keys` names them):
    `worker-api-key` (the workers' `--api-key`, which the router sends), `tenant-secret`, `router-tokens.json`
    and `admin-tokens.json` (the coordinator's, whose write token the router sends). Returns: `folder`."""
    from radix_sync import secret_files as keys

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    keys.ensure_secret(folder / "worker-api-key")
    keys.ensure_secret(folder / "tenant-secret")
    keys.ensure_tokens(folder / "router-tokens.json")
    keys.ensure_tokens(folder / "admin-tokens.json")
    return folder


def bearer(tokens_file: Path, level: str = "read") -> dict:
    """Returns: the `Authorization` header with the `level` token of a tokens file (`router-tokens.json`...)."""
    return {"Authorization": f"Bearer {json.loads(Path(tokens_file).read_text())[level]}"}


def http_json(url: str, body: Optional[dict] = None, timeout: float = 60.0, method: Optional[str] = None,
              headers: Optional[dict] = None, token: str = ""):
    """(status, decoded JSON answer) of one call; `token`: sent as `Authorization: Bearer <token>`; `headers`:
    more headers."""
    data = json.dumps(body).encode() if body is not None else None
    sent = {"Content-Type": "application/json", **(headers or {})}
    if token:
        sent["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers=sent)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except json.JSONDecodeError:
            return exc.code, {"error": raw.decode(errors="replace")}


def stream_generate(url: str, text: str, max_new_tokens: int = 8, timeout: float = 120.0,
                    headers: Optional[dict] = None) -> tuple[float, float, int, int]:
    """Streams SGLang's `/generate` with a text prompt, as `kvrep bench` sends requests. Returns: (time to the first
    streamed token at the client, end-to-end time, prompt tokens, cached tokens)."""
    body = json.dumps({"text": text, "stream": True, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", data=body,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    t0 = time.perf_counter()
    first, last = None, None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            line = line.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                first = first if first is not None else time.perf_counter() - t0
                last = line[5:]
    if last is None:
        raise RuntimeError(f"/generate on {url} streamed nothing")
    meta = json.loads(last)["meta_info"]
    return first, time.perf_counter() - t0, int(meta["prompt_tokens"]), int(meta["cached_tokens"])


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: unwinds whatever is running (a start-up wait, a benchmark round) at once, so the
    `finally` blocks that stop every process run. A KeyboardInterrupt, so no `except Exception` swallows it, and
    asyncio re-raises it wherever it lands (a callback, a transport's write) instead of logging it as a failed
    callback or connection, as it does with any other BaseException."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_HOLD = {"depth": 0, "pending": None, "installed": False}
"""The signal deferral of `stop_on_signals`: while `depth` > 0 (a process is being started and registered), the
first SIGINT/SIGTERM is kept in `pending` and raised as `Stopped` when the hold ends. Python runs signal handlers
in the main thread whatever thread the kernel delivered to, so a flag checked by the handler holds them back where
a thread's signal mask cannot (another thread would take the signal)."""


@contextlib.contextmanager
def stop_on_signals():
    """Within the block, the first SIGINT/SIGTERM raises `Stopped` in the main thread (held back while a process
    is being started and registered, see `_held_signals`); later ones are ignored, so the clean-up that follows
    (stopping process groups) is not itself interrupted. Handlers restored after."""
    def handler(signum, _frame):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if _HOLD["depth"] > 0:
            _HOLD["pending"] = _HOLD["pending"] or signum
            return
        raise Stopped(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    _HOLD.update(depth=0, pending=None, installed=True)
    try:
        yield
    finally:
        _HOLD.update(depth=0, pending=None, installed=False)
        for sig, h in old.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def _held_signals():
    """Under `stop_on_signals`, a SIGINT/SIGTERM arriving inside the block is raised as `Stopped` only at its
    end: a process started inside is registered (`running()`) before anything unwinds."""
    _HOLD["depth"] += 1
    try:
        yield
    finally:
        _HOLD["depth"] -= 1
        pending = _HOLD["pending"]
        if _HOLD["depth"] == 0 and pending is not None and _HOLD["installed"]:
            _HOLD["pending"] = None
            raise Stopped(pending)


STOP_TIMEOUT_S = 20.0
"""How long a stopped process may take to exit after SIGTERM before its group gets SIGKILL."""


_RUNNING: list["Proc"] = []
"""Every `Proc` started in this process and not stopped yet (registered as it starts, with SIGINT/SIGTERM held
back, so a signal never falls between a process's start and its registration)."""


def running() -> list["Proc"]:
    """Returns: the processes started here and not stopped yet (what a command's own list may have missed: one a
    signal interrupted between its start and the caller's list, a list comprehension half built)."""
    return list(_RUNNING)


def stop_all(procs: list["Proc"], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stops every process together: SIGTERM to every process group first, then one wait of at most `timeout_s`
    for all of them (not `timeout_s` each, one after the other), then SIGKILL to whatever is left of each group
    (SGLang's scheduler and detokenizer included)."""
    for p in procs:
        if p.alive():
            p.kill(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        p.kill(signal.SIGKILL)  # stragglers in the group
    for p in procs:
        try:
            p.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        p._log.close()
        if p in _RUNNING:
            _RUNNING.remove(p)


def cpu_seconds(procs: list["Proc"]) -> dict[str, float]:
    """Returns: the CPU time (user + system, s) each running process of `procs` and its live descendants used so far,
    by the process's name (SGLang's scheduler and detokenizer counted in their server's)."""
    import psutil

    out: dict[str, float] = {}
    for proc in procs:
        try:
            tree = [psutil.Process(proc.pid)]
            tree += tree[0].children(recursive=True)
        except psutil.Error:
            continue
        total = 0.0
        for q in tree:
            try:
                t = q.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        out[proc.name] = total
    return out


class Proc:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: Optional[dict] = None,
                 cpu: Optional[int] = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.cpu = cpu
        """The core this process (and every process it starts) is pinned to; None: not pinned."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        # NOTE: a signal between the start and the registration would leave a started process nobody stops
        with _held_signals():
            self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                          env=env or os.environ.copy(), start_new_session=True, cwd=str(ROOT),
                                          preexec_fn=pin)
            _RUNNING.append(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (SGLang spawns a scheduler and a detokenizer)."""
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        stop_all([self], timeout_s)

    def wait_http(self, url: str, timeout_s: float = 120.0) -> None:
        """Until `url` answers 200 (any body); raises if this process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout_s}s:\n{self.tail()}")

    def tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""


def make_keys(out: Path, num_workers: int, num_routers: int = 1) -> Path:
    """A fresh key directory (`kvrep keys`) at `out`, unless one is there already. Returns: `out`."""
    from radix_sync.keys import create_dir

    if not (out / "coordinator.key_secret").exists():
        create_dir(out, num_workers, num_routers)
    return out


def key_worker_id(keys: Path, key_name: str) -> str:
    """The worker id `key_name`'s certificate names."""
    from radix_sync.keys import load_dir

    return load_dir(keys).pair(key_name).worker_id


class Worker(Proc):
    def __init__(self, name: str, model: str, log_dir: Path, *, port: Optional[int] = None,
                 coordinator: Optional[str] = None, page_size: int = 16, max_total_tokens: int = 16384,
                 extra_args: tuple[str, ...] = (), kvrep: bool = True, env: Optional[dict] = None,
                 api_key_file: Optional[Path] = None, cpu: Optional[int] = None,
                 keys: Optional[Path] = None, key_name: str = "") -> None:
        """`api_key_file`: SGLang's `--api-key` from this file (a `worker-api-key`): every call but `/health` and
        `/metrics` then needs it (`self.headers`), so only the router (which sends it) reaches the worker.
        `keys`/`key_name`: join with this worker's key (CurveZMQ planes); its worker id is the key's.
        `cpu`: the core it is pinned to."""
        self.port = port or free_port()
        self.api_key = Path(api_key_file).read_text().strip() if api_key_file else None
        self.headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker_id = key_worker_id(keys, key_name) if keys else f"127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path(model), "--device", "cpu",
                "--host", "127.0.0.1", "--port", str(self.port), "--attention-backend", "torch_native",
                "--max-total-tokens", str(max_total_tokens), "--page-size", str(page_size), "--sleep-on-idle",
                "--enable-metrics", "--skip-server-warmup", "--random-seed", "0",
                *worker_dtype_args(tuple(extra_args)), *extra_args]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        if kvrep:
            argv += ["--enable-kv-replication", "--kvrep-coordinator", coordinator or "tcp://127.0.0.1:5600"]
            if keys:
                argv += ["--kvrep-keys", str(keys), "--kvrep-key-name", key_name]
        super().__init__(name, argv, log_dir / f"{name}.log", server_env(env), cpu=cpu)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"worker {self.name} exited:\n{self.tail()}")
            try:
                status, _ = http_json(self.url + "/health", timeout=2)
                if status == 200:
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"worker {self.name} not healthy after {timeout_s}s:\n{self.tail()}")

    def generate(self, input_ids: list[int], max_new_tokens: int = 8, cache_salt: Optional[str] = None,
                 timeout: float = 120.0) -> dict:
        body = {"input_ids": input_ids,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        status, out = http_json(self.url + "/generate", body, timeout=timeout, headers=self.headers)
        if status != 200:
            raise RuntimeError(f"/generate on {self.name} failed: {status} {out}")
        return out


class Coordinator(Proc):
    """A `kvrep coordinator` process. Its admin tokens are `log_dir/admin-tokens.json` (created 0600 when absent,
    before the process starts, so the caller knows them at once); `get`/`post` send the write token."""

    def __init__(self, log_dir: Path, *, extra_args: tuple[str, ...] = (), name: str = "coordinator",
                 port: Optional[int] = None, admin_port: Optional[int] = None, keys: Optional[Path] = None) -> None:
        """`keys`: a key directory (`make_keys`): CurveZMQ on the workers' socket, only its workers admitted."""
        from radix_sync.secret_files import ensure_tokens

        self.zmq_port = port or free_port()
        self.admin_port = admin_port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.zmq_port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.tokens_path = Path(log_dir) / "admin-tokens.json"
        self.tokens, _ = ensure_tokens(self.tokens_path)
        self.keys = keys
        argv = [sys.executable, "-m", "radix_sync.cli", "coordinator", "--bind", self.endpoint,
                "--admin-port", str(self.admin_port), "--admin-tokens", str(self.tokens_path),
                "--state-dir", str(log_dir), *(("--keys", str(keys)) if keys else ()), *extra_args]
        super().__init__(name, argv, log_dir / f"{name}.log")

    def router_args(self) -> list[str]:
        """The `kvrep router` flags that point it at this coordinator, with its tokens."""
        return ["--coordinator", self.admin, "--coordinator-tokens", str(self.tokens_path)]

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"coordinator exited:\n{self.tail()}")
            try:
                if http_json(self.admin + "/health", timeout=2)[0] == 200:
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"coordinator not ready:\n{self.tail()}")

    def get(self, path: str, token: Optional[str] = None):
        """GET on the admin API with the write token (or `token`; "" sends none)."""
        return http_json(self.admin + path, token=self.tokens.write if token is None else token)

    def post(self, path: str, body: dict, token: Optional[str] = None):
        """POST on the admin API with the write token (or `token`; "" sends none)."""
        return http_json(self.admin + path, body, token=self.tokens.write if token is None else token)

    def workers(self) -> dict[str, dict]:
        return {w["id"]: w for w in self.get("/workers")[1]}

    def wait_workers(self, ids: list[str], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if set(ids) <= set(self.workers()):
                return
            time.sleep(0.2)
        raise TimeoutError(f"workers {ids} never said hello; known: {list(self.workers())}")

    def wait_replication(self, rep_id: str, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for rep in self.get("/replications")[1]:
                if rep["id"] == rep_id and rep["state"] in ("done", "failed"):
                    return rep
            time.sleep(0.1)
        raise TimeoutError(f"replication {rep_id} did not finish in {timeout_s}s")


class Router(Proc):
    """`kvrep router` with the credentials of a `local_keys` folder: its admin tokens (`self.admin(level)`), the
    tenant secret, the workers' API key and the coordinator's token."""

    def __init__(self, log_dir: Path, keys_dir: Path, *, coordinator: "Optional[str | Coordinator]" = None,
                 workers: tuple[str, ...] = (), tokenizer: str = "none", port: Optional[int] = None,
                 name: str = "router", extra_args: tuple[str, ...] = (),
                 coordinator_tokens: Optional[Path] = None) -> None:
        """`coordinator`: its admin URL, or a `Coordinator` of this harness (its URL and its own tokens file).
        `coordinator_tokens`: the coordinator's admin tokens file (default: the `Coordinator`'s, else
        `keys_dir/admin-tokens.json`)."""
        if coordinator is not None and not isinstance(coordinator, str):
            coordinator_tokens = coordinator_tokens or coordinator.tokens_path
            coordinator = coordinator.admin
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.keys_dir = Path(keys_dir)
        k = self.keys_dir
        argv = [sys.executable, "-m", "radix_sync.cli", "router", "--port", str(self.port), "--tokenizer", tokenizer,
                "--state-dir", str(k), "--admin-tokens", str(k / "router-tokens.json"),
                "--tenant-secret", str(k / "tenant-secret"), "--worker-api-key", str(k / "worker-api-key"),
                "--coordinator-tokens", str(coordinator_tokens or k / "admin-tokens.json")]
        if coordinator:
            argv += ["--coordinator", coordinator]
        for url in workers:
            argv += ["--worker", url]
        super().__init__(name, argv + list(extra_args), log_dir / f"{name}.log")

    def admin(self, level: str = "read") -> dict:
        """Returns: the `Authorization` header of the router's `level` ("read" or "write") admin token."""
        return bearer(self.keys_dir / "router-tokens.json", level)

    def status(self, num_decisions: int = 256) -> dict:
        status, out = http_json(f"{self.url}/kvrep/status?decisions={num_decisions}", headers=self.admin())
        if status != 200:
            raise RuntimeError(f"router /kvrep/status: {status} {out}")
        return out

    def namespace(self, label: str) -> str:
        """Returns: the `cache_salt` this router gives a tenant whose label (namespace or name) is `label`."""
        from radix_sync.secret_files import read_secret
        from radix_sync.router.tenants import derive_namespace

        return derive_namespace(read_secret(self.keys_dir / "tenant-secret"), label)
class StubAgent(Proc):
    """`kvrep_dev.stub_agent`: the real agent I/O side (coordinator link, data port) without SGLang, making
    `pages_per_s` pages; `stats()` reads what it last wrote (link counters, pages held, data endpoint)."""

    def __init__(self, name: str, coordinator: str, log_dir: Path, *, worker_id: str = "",
                 keys: Optional[Path] = None, key_name: str = "", pages_per_s: float = 200.0) -> None:
        self.stats_path = log_dir / f"{name}.stats.json"
        self.stats_path.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "kvrep_dev.stub_agent", "--coordinator", coordinator, "--stats",
                str(self.stats_path), "--pages-per-s", str(pages_per_s)]
        if worker_id:
            argv += ["--worker-id", worker_id]
        if keys:
            argv += ["--keys", str(keys), "--key-name", key_name]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        super().__init__(name, argv, log_dir / f"{name}.log", env)

    def stats(self) -> dict:
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return {}

    def wait_stats(self, pred, timeout_s: float = 120.0, what: str = "") -> dict:
        """Until `pred(stats)`; raises if the process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            stats = self.stats()
            if stats and pred(stats):
                return stats
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: {what or 'condition'} not reached; last {self.stats()}\n{self.tail()}")

    def stop_making(self) -> None:
        os.kill(self.pid, signal.SIGUSR1)
