"""Soak: a local cluster (coordinator, two CPU SGLang workers with the plugin, the router) under load for
`--minutes`, with faults injected, checked for flat memory, no error and no leaked KV slot. Not in CI.

    flock /tmp/kvrep-server.lock .venv/bin/python scripts/soak.py --minutes 30 --out logs/soak/result.json

Load: clients send prompts that share a few long prefixes through the router, and every `--copy-every-s` the
soak asks the coordinator for a copy of a prefix one worker just computed to the other. Faults:
- worker B is killed with SIGKILL (its whole process group) and restarted, at 30% of the run;
- the coordinator is stopped and started again on the same ports, at 60% of the run;
- every `--corrupt-every`-th page payload sent to worker B is damaged in transit: B advertises a data port that
  is a proxy of this script's, which flips a byte in the middle of every N-th payload frame it forwards (the
  target must refuse that transfer by its checksum and leak nothing).

Every `--sample-s` the load pauses, the soak waits for both workers to be idle, and records the RSS of every
process (its whole process group) and each worker's KV accounting from its load report: free + evictable must
equal the pool's capacity when nothing runs (a slot held by nobody is a leak). At the end it asserts:
- memory is flat: for each process, after `--warmup-s`, the mean RSS of the last quarter of its samples is
  within `--rss-tolerance` (10%) of the mean of the first quarter (a restarted process starts a new series);
- no error: no failed client request outside the seconds a fault takes to heal (`--fault-grace-s`), no
  unexpected process exit, no traceback in any log;
- no leaked slot in any sample;
and writes everything to `--out` (JSON). Exit status 0 when every check holds.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import sys
import threading
import time
import urllib.error
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvrep_dev.cluster import ROOT, Coordinator, Proc, Worker, free_port, http_json, model_path  # noqa: E402


# ----------------------------------------------------------------------------------- corrupting TCP proxy
class CorruptingProxy:
    """Forwards TCP connections from `port` to `target_port` on loopback. In the peer-to-target direction it
    reads ZMTP 3 framing (64-byte greeting, then frames: flags, 1- or 8-byte size, body) and flips one byte in
    the middle of every `every`-th payload: the second frame of a two-frame message (a page chunk) or, when the
    stream is encrypted (CurveZMQ's MESSAGE commands), a command frame of 1 KiB or more."""

    def __init__(self, target_port: int, every: int) -> None:
        self.target_port, self.every = target_port, every
        self.port = free_port()
        self.num_payloads = 0
        self.num_corrupted = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop = True
        self._server.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()  # the target is down (being restarted): the peer reconnects later
                continue
            upstream.settimeout(None)
            threading.Thread(target=self._pipe_raw, args=(upstream, client), daemon=True).start()
            threading.Thread(target=self._pipe_zmtp, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _pipe_raw(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def _pipe_zmtp(self, src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray()

        def take(n: int) -> bytes:
            while len(buf) < n:
                data = src.recv(1 << 16)
                if not data:
                    raise EOFError
                buf.extend(data)
            out = bytes(buf[:n])
            del buf[:n]
            return out

        try:
            left = 64  # the greeting, forwarded as it comes: each side sends its rest after the other's start
            while left:
                data = src.recv(left)
                if not data:
                    raise EOFError
                dst.sendall(data)
                left -= len(data)
            index = 0  # frame index within the current message
            while True:
                flags = take(1)[0]
                size_bytes = take(8 if flags & 0x02 else 1)
                size = int.from_bytes(size_bytes, "big")
                body = bytearray(take(size))
                command, more = bool(flags & 0x04), bool(flags & 0x01)
                payload = (not command and index == 1 and not more) or (command and size >= 1024)
                if payload and size:
                    with self._lock:
                        self.num_payloads += 1
                        hit = self.num_payloads % self.every == 0
                        self.num_corrupted += hit
                    if hit:
                        body[size // 2] ^= 0xFF
                dst.sendall(bytes([flags]) + size_bytes + bytes(body))
                index = 0 if (command or not more) else index + 1
        except (EOFError, OSError):
            pass
        finally:
            for s in (src, dst):
                s.close()


# -------------------------------------------------------------------------------------------- the cluster
class SoakCluster:
    def __init__(self, args, logs: Path) -> None:
        self.args, self.logs = args, logs
        self.coord_ports = (free_port(), free_port())
        self.coord = self._start_coordinator()
        self.a = self._start_worker("worker-a")
        self.b_data_port = free_port()
        self.proxy = CorruptingProxy(self.b_data_port, args.corrupt_every)
        self.b = self._start_worker("worker-b", data_port=self.b_data_port, advertise_port=self.proxy.port)
        for w in (self.a, self.b):
            w.wait_ready()
        self.coord.wait_workers([self.a.worker_id, self.b.worker_id], timeout_s=60)
        self.router_url = self._start_router()

    def _start_coordinator(self) -> Coordinator:
        c = Coordinator(self.logs, port=self.coord_ports[0], admin_port=self.coord_ports[1],
                        extra_args=("--policy", self.args.policy, "--worker-timeout-s", "5"))
        c.wait_ready()
        return c

    def _start_worker(self, name: str, data_port: int = 0, advertise_port: int = 0) -> Worker:
        extra = ["--max-running-requests", "4"]
        if data_port:
            extra += ["--kvrep-data-port", str(data_port), "--kvrep-data-advertise-port", str(advertise_port)]
        return Worker(name, self.args.model, self.logs, coordinator=self.coord.endpoint,
                      max_total_tokens=self.args.max_total_tokens, extra_args=tuple(extra))

    def _start_router(self) -> str:
        port = free_port()
        # the coordinator's admin token (a restarted coordinator reuses its tokens file); the router's own files
        # in the soak's logs
        argv = [sys.executable, "-m", "radix_sync.cli", "router", "--port", str(port), *self.coord.router_args(),
                "--state-dir", str(self.logs / "router-state"), "--tokenizer", model_path(self.args.model),
                "--page-size", "16"]
        self.router = Proc("router", argv, self.logs / "router.log")
        url = f"http://127.0.0.1:{port}"
        self.router.wait_http(url + "/health", timeout_s=120)
        return url

    def procs(self) -> dict[str, Proc]:
        return {"coordinator": self.coord, "worker-a": self.a, "worker-b": self.b, "router": self.router}

    def kill_and_restart_b(self) -> None:
        port = self.b.port
        self.b.kill(signal.SIGKILL)
        self.b.popen.wait(30)
        self.b._log.close()
        self.b = Worker("worker-b", self.args.model, self.logs, port=port, coordinator=self.coord.endpoint,
                        max_total_tokens=self.args.max_total_tokens,
                        extra_args=("--max-running-requests", "4", "--kvrep-data-port", str(self.b_data_port),
                                    "--kvrep-data-advertise-port", str(self.proxy.port)))
        self.b.wait_ready()
        self.coord.wait_workers([self.b.worker_id], timeout_s=60)

    def restart_coordinator(self) -> None:
        self.coord.stop()
        time.sleep(1.0)
        self.coord = self._start_coordinator()
        self.coord.wait_workers([self.a.worker_id, self.b.worker_id], timeout_s=60)

    def stop(self) -> None:
        for proc in (self.router, self.b, self.a, self.coord):
            proc.stop()
        self.proxy.close()


def group_rss_bytes(proc: Proc) -> int:
    """RSS of a process and all its descendants (SGLang's scheduler and detokenizer)."""
    try:
        root = psutil.Process(proc.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


# ---------------------------------------------------------------------------------------------------- load
class Load:
    """Client threads sending prompts (a few shared prefixes + a random tail) to the router, pausable."""

    def __init__(self, router_url: str, seed: int, num_clients: int) -> None:
        rng = random.Random(seed)
        self.prefixes = [[rng.randrange(10, 4000) for _ in range(rng.choice((256, 384, 512)))] for _ in range(6)]
        self.url = router_url
        self.running = threading.Event()
        self.running.set()
        self.stopped = False
        self.in_flight = 0
        self.results: list[tuple[float, bool, str]] = []  # (time, ok, error)
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(seed + i,), daemon=True)
                        for i in range(num_clients)]
        for t in self.threads:
            t.start()

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stopped:
            self.running.wait()
            if self.stopped:
                return
            ids = rng.choice(self.prefixes) + [rng.randrange(10, 4000) for _ in range(rng.randrange(8, 64))]
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
            with self._lock:
                self.in_flight += 1
            try:
                status, out = http_json(self.url + "/generate", body, timeout=120)
                ok, err = status == 200, "" if status == 200 else f"{status} {str(out)[:200]}"
            except (urllib.error.URLError, OSError, ValueError) as exc:
                ok, err = False, repr(exc)[:200]
            with self._lock:
                self.in_flight -= 1
                self.results.append((time.monotonic(), ok, err))

    def pause(self, timeout_s: float = 120.0) -> None:
        self.running.clear()
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.1)

    def resume(self) -> None:
        self.running.set()

    def stop(self) -> None:
        self.stopped = True
        self.running.set()


# ------------------------------------------------------------------------------------------------ checks
def judge_memory(rss: dict[str, list[tuple[float, float]]], series_start: dict[str, float], warmup_s: float,
                 tolerance: float) -> dict[str, dict]:
    """Per RSS series: flat or not (`flat`), judged on the samples taken `warmup_s` or more after that series'
    process started (a restarted process warms up again: its first samples are not judged either)."""
    memory = {}
    for name, points in rss.items():
        judged = [v for at, v in points if at >= series_start.get(name, 0.0) + warmup_s]
        if len(judged) >= 4:
            ok, first, last = flat(judged, tolerance)
            memory[name] = {"flat": ok, "first_quarter_mb": round(first / 2**20, 1),
                            "last_quarter_mb": round(last / 2**20, 1), "num_samples": len(judged),
                            "slope_mb_per_min": round(slope_per_min(
                                [(at, v) for at, v in points if at >= series_start.get(name, 0.0) + warmup_s])
                                / 2**20, 3)}
        else:
            memory[name] = {"flat": None, "num_samples": len(judged)}
    return memory


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Returns: the least-squares slope of (seconds, value) points, per minute (0 for fewer than 2 points)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    return 0.0 if den == 0 else 60.0 * sum((t - mx) * (v - my) for t, v in points) / den


def flat(series: list[float], tolerance: float) -> tuple[bool, float, float]:
    """(last-quarter mean within `tolerance` of the first-quarter mean, first mean, last mean)."""
    q = max(1, len(series) // 4)
    first, last = sum(series[:q]) / q, sum(series[-q:]) / q
    return abs(last - first) <= tolerance * first, first, last


def kv_accounting(cluster: SoakCluster, timeout_s: float = 30.0) -> dict[str, dict]:
    """Each worker's free + evictable tokens against its pool capacity, once it reports itself idle."""
    deadline = time.monotonic() + timeout_s
    out: dict[str, dict] = {}
    while time.monotonic() < deadline:
        time.sleep(1.5)  # a fresh load report from an idle scheduler
        try:
            workers = cluster.coord.workers()
        except (urllib.error.URLError, OSError):
            continue
        out = {}
        for w in (cluster.a, cluster.b):
            rec = workers.get(w.worker_id) or {}
            load = rec.get("load") or {}
            out[w.name] = {"capacity": rec.get("pool_capacity_tokens"), "free": load.get("available_tokens"),
                           "evictable": load.get("evictable_tokens"), "replica": load.get("replica_tokens"),
                           "busy": (load.get("num_running_reqs") or 0) + (load.get("num_waiting_reqs") or 0)}
        if out and all(v["busy"] == 0 and v["free"] is not None for v in out.values()):
            break
    for v in out.values():
        v["leaked"] = None if v["free"] is None else v["capacity"] - (v["free"] + v["evictable"])
    return out


def log_errors(logs: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(errors, SGLang's own start-up noise) per log file. Errors: every traceback in the coordinator's and the
    router's logs; in a worker's, every traceback but SGLang's start-up noise, and every agent error. Noise: the
    tracebacks SGLang 0.5.23 prints at a start when its `/freeze_gc` call races the HTTP server (not ours)."""
    errors, noise = {}, {}
    for f in sorted(logs.glob("*.log")):
        text = f.read_text(errors="replace")
        n = text.count("kvrep agent error") + text.count("kvrep I/O thread died") + text.count("agent disabled")
        # one report per exception chain: chained tracebacks are parts of one
        reports = [r for r in text.split("Traceback (most recent call last)")[1:]]
        chains, current = [], ""
        for r in reports:
            current += r
            if "During handling of the above exception" not in r and "direct cause of the" not in r:
                chains.append(current)
                current = ""
        if current:
            chains.append(current)
        freeze = [c for c in chains if f.name.startswith("worker") and "/freeze_gc" in c
                  and not any(k in c for k in ("sglang_kvrep", "radix_sync", "kvrep_kernels"))]
        n += len(chains) - len(freeze)
        if freeze:
            noise[f.name] = len(freeze)
        if n:
            errors[f.name] = n
    return errors, noise


# ---------------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--warmup-s", type=float, default=60.0, help="samples before this are not judged for memory")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--policy", default="rules")
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--copy-every-s", type=float, default=2.0)
    ap.add_argument("--corrupt-every", type=int, default=5, help="damage every N-th payload frame sent to B")
    ap.add_argument("--fault-grace-s", type=float, default=20.0)
    ap.add_argument("--rss-tolerance", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", default="logs/soak")
    ap.add_argument("--out", default="logs/soak/result.json")
    args = ap.parse_args()

    logs = ROOT / args.logs
    logs.mkdir(parents=True, exist_ok=True)
    for f in logs.glob("*.log"):
        f.unlink()
    t_start = time.monotonic()
    cluster = SoakCluster(args, logs)
    started_s = time.monotonic() - t_start
    print(f"[soak] cluster up in {started_s:.0f}s; running {args.minutes} min", flush=True)
    load = Load(cluster.router_url, args.seed, args.clients)
    duration = args.minutes * 60.0
    t0 = time.monotonic()
    faults_due = [(0.3 * duration, "worker-b kill -9 + restart"), (0.6 * duration, "coordinator restart")]
    faults, samples, copies = [], [], {"asked": 0, "done": 0, "failed": 0, "refused": 0}
    pending: list[str] = []
    rss: dict[str, list[tuple[float, int]]] = {}
    series = {name: name for name in ("coordinator", "worker-a", "worker-b", "router")}
    """Process name -> its current RSS series (a restarted process starts a new one)."""
    series_start = {name: 0.0 for name in series}
    """Series -> when its process started, s into the run (its warm-up counts from there)."""
    next_sample, next_copy = t0 + args.sample_s, t0 + args.copy_every_s
    rng = random.Random(args.seed)
    try:
        while (now := time.monotonic()) < t0 + duration:
            if faults_due and now - t0 >= faults_due[0][0]:
                _, what = faults_due.pop(0)
                f_start = time.monotonic()
                if what.startswith("worker-b"):
                    cluster.kill_and_restart_b()
                    series["worker-b"] = "worker-b#2"
                    series_start["worker-b#2"] = round(f_start - t0, 1)
                else:
                    cluster.restart_coordinator()
                    series["coordinator"] = "coordinator#2"
                    series_start["coordinator#2"] = round(f_start - t0, 1)
                pending.clear()  # the old coordinator's replications are gone with it
                faults.append({"fault": what, "at_s": round(f_start - t0, 1),
                               "healed_after_s": round(time.monotonic() - f_start, 1)})
                print(f"[soak] fault: {what} (healed in {faults[-1]['healed_after_s']}s)", flush=True)
            if now >= next_copy:
                next_copy = now + args.copy_every_s
                src, dst = (cluster.a, cluster.b) if rng.random() < 0.5 else (cluster.b, cluster.a)
                try:
                    status, rep = cluster.coord.post("/replicate", {"source": src.worker_id, "target": dst.worker_id,
                                                                    "input_ids": rng.choice(load.prefixes)})
                    if status == 200:
                        copies["asked"] += 1
                        pending.append(rep["id"])
                    else:
                        copies["refused"] += 1  # e.g. the prefix is not held by that source (yet)
                except (urllib.error.URLError, OSError):
                    copies["refused"] += 1
                try:
                    reps = {r["id"]: r for r in cluster.coord.get("/replications")[1]}
                    for rid in list(pending):
                        state = (reps.get(rid) or {}).get("state")
                        if state in ("done", "failed"):
                            copies[state] += 1
                            pending.remove(rid)
                except (urllib.error.URLError, OSError):
                    pass
            if now >= next_sample:
                load.pause()
                kv = kv_accounting(cluster)
                at = round(time.monotonic() - t0, 1)
                procs = cluster.procs()
                row = {"at_s": at, "kv": kv, "rss_mb": {}, "alive": {n: p.alive() for n, p in procs.items()}}
                for name, proc in procs.items():
                    key = series[name]
                    value = group_rss_bytes(proc)
                    rss.setdefault(key, []).append((at, value))
                    row["rss_mb"][key] = round(value / 2**20, 1)
                samples.append(row)
                print(f"[soak] t={at:.0f}s rss_mb={row['rss_mb']} "
                      f"leaked={ {k: v['leaked'] for k, v in kv.items()} } copies={copies}", flush=True)
                load.resume()
                next_sample = time.monotonic() + args.sample_s
            time.sleep(0.05)
    finally:
        load.stop()
        load.pause(30)
        final_errors, sglang_noise = log_errors(logs)
        alive_at_end = {n: p.alive() for n, p in cluster.procs().items()}
        corrupted, payloads = cluster.proxy.num_corrupted, cluster.proxy.num_payloads
        cluster.stop()

    windows = [(f["at_s"], f["at_s"] + f["healed_after_s"] + args.fault_grace_s) for f in faults]
    failures = [(round(t - t0, 1), e) for t, ok, e in load.results if not ok]
    unexplained = [(t, e) for t, e in failures if not any(a <= t <= b for a, b in windows)]
    memory = judge_memory(rss, series_start, args.warmup_s, args.rss_tolerance)
    leaks = [(s["at_s"], n, v["leaked"]) for s in samples for n, v in s["kv"].items() if v["leaked"] not in (0,)]
    checks = {
        "memory_flat": all(m["flat"] is not False for m in memory.values())
        and any(m["flat"] for m in memory.values()),
        "no_request_error_outside_faults": not unexplained,
        "no_traceback_in_logs": not final_errors,
        "all_alive_at_end": all(alive_at_end.values()),
        "no_leaked_kv_slot": bool(samples) and not leaks,
        "corrupted_transfers_injected": corrupted > 0,
    }
    result = {
        "ok": all(checks.values()), "checks": checks, "minutes": args.minutes, "cluster_start_s": round(started_s, 1),
        "requests": {"total": len(load.results), "failed": len(failures), "failed_outside_faults": len(unexplained),
                     "first_failures": failures[:10]},
        "copies": copies, "corrupted_payloads": corrupted, "payload_frames_to_b": payloads, "faults": faults,
        "memory": memory, "leaks": leaks, "log_errors": final_errors, "sglang_startup_tracebacks": sglang_noise,
        "alive_at_end": alive_at_end,
        "samples": samples, "args": vars(args),
    }
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("ok", "checks", "requests", "copies", "corrupted_payloads", "faults",
                                             "memory")}, indent=1))
    print(f"[soak] result in {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
