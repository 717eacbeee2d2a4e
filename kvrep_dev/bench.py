"""`kvrep bench` (and the demo built on it): live benchmarks on a local CPU cluster, several routing set-ups
("arms") on the same workloads in the same run.

Arms:
- `shadow`: our router, the coordinator's predictive planner in shadow mode (it decides and records, copies
  nothing): today's cache-aware routing from an exact directory.
- `pull`: our router with `--pull` (copies a missing prefix on the request's critical path when that gives the
  lowest expected TTFT), the coordinator's planner off (`--policy none`, active mode): reactive copies only.
- `active`: our router with `--pull`, the planner in active mode (copies prefixes ahead of demand, routes to
  them): predictive + reactive.
- `smg-rr` / `smg-ca`: today's SGLang router, the Shepherd Model Gateway `smg` 1.13 from PyPI (`python -m
  smg.launch_router`), with `round_robin` / `cache_aware` and its own defaults (no tuning flag: only the workers'
  URLs, its host and ports, and the workers' API key), in front of the same workers (the coordinator in shadow
  mode, so no copies). The simulator's model of `smg-ca` is smg 1.13's rule (`cache_aware`,
  `radix_sync/policy/baselines/smg.py`).

Workloads are the simulator's own objects, scaled to the CPU (`kvrep_dev.loadgen`): `agent` (Claude Code
sessions from a trace directory, default the sample committed in `bench/traces/claude_code_sample`), `fanout`
(tree search: K branches over a long trunk, with a fan-out hint), `flash` (a flash crowd: one hot shared prefix
whose request rate ramps up over the first half of the run, then holds), `shared` (shared prefixes, Zipf popularity,
bursty arrivals) and `unique` (no shared prefix at all: every prompt distinct). Every arm gets its own text for
the same workload (same lengths, same sharing, same times), so nothing one arm cached helps the next.

`--simulate` also runs the simulator with `--profile`'s cost profile (default the testbed's, `cpu-wide`) on the
identical scaled workloads (same seed, the workers sharing this machine's cores: `EngineConfig.shared_cores`) and
prints simulated vs measured TTFT per arm (the simulator validation).

`--client sglang` (or `both`) also runs SGLang's own benchmark client through every arm (`kvrep_dev.sglclient`:
multi-turn generated-shared-prefix over the chat API, workload `sgl-gsp`), every worker's cache flushed before
each arm; its per-request TTFTs go into the same tables.

Every live table carries bootstrap intervals (`kvrep_dev.stats`): of each cell's TTFT mean and P99, and of the
ratios the claims rest on (`CLAIMS`: active/shadow, active/pull, active/smg-ca, and the ablation's steps pull/shadow,
demote/pull, active/demote where those arms ran) over every round's requests pooled.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import random
import statistics
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from kvrep_dev import sglclient, testbed
from kvrep_dev.cluster import (ROOT, Coordinator, Proc, Router, Worker, cpu_seconds, free_port, http_json, local_keys,
                               model_path, stop_all, stream_generate)
from kvrep_dev.report import bench_progress as _say

if TYPE_CHECKING:
    from radix_sync.sim.workload import Workload

ARMS = ("shadow", "pull", "demote", "active", "active-lru", "active-fixed", "active-nosent", "shadow-lowid",
        "shadow-norelay", "shadow-nodraw", "smg-rr", "smg-ca")
"""The ablation of ours, one part added per arm (routing alone; + copies on the request's path; + demotion of a moved
session's stale copies; + the predictive planner; its copies landing as ordinary cache, not evict-first; `active`
priced at the profile's prefill times, not the measured speed; `active` whose router prices only the directory's
holdings, not what its own requests sent and not started will compute, as before stop 53; routing alone with every
full tie to the lowest id, as before stop 49; routing alone whose routers do not relay their sends to one another,
as before stop 57: an `@N` arm's ablation; routing alone whose routers break ties by the load and turn they share even
behind several doors, as before stop 58: another), then today's router (smg 1.13) in two policies."""
DEFAULT_ARMS = ("shadow", "pull", "active", "smg-rr", "smg-ca")
"""`kvrep bench`'s arms unless `--arms` says (`demote` only when asked: one more arm is minutes a round)."""
SIM_POLICY = {"shadow": "kvrep_shadow", "pull": "kvrep_pull", "demote": "kvrep_pull_demote", "active": "kvrep",
              "active-lru": "kvrep_lru", "active-fixed": "kvrep", "active-nosent": "kvrep",
              "shadow-lowid": "kvrep_shadow", "shadow-norelay": "kvrep_shadow",
              "shadow-nodraw": "kvrep_shadow",
              "smg-rr": "round_robin",
              "smg-ca": "cache_aware",
              # runs saved before smg 1.13 replaced it (bench/results/): sglang-router 0.3.2's arms
              "sgl-rr": "round_robin", "sgl-ca": "cache_aware_v03"}
SMG_POLICY = {"smg-rr": "round_robin", "smg-ca": "cache_aware"}
"""The smg arms -> smg's `--policy`."""
WAITING_REPORTS = "uncached"
PREFILL_SPEED = "calibrated"
"""Saved as a run's `prefill_speed`: its routers learned the workers' prefill speed (`--speed-calibration`, the
default since stop 46), and the simulator's router does the same when it re-runs it (absent: the profile's times)."""
"""What the workers' load reports count of their waiting requests, saved with each run: since stop 40 the prompt
tokens their tree does not hold (`SchedulerView.waiting_new_tokens`); runs saved without it had whole prompts
(`--resimulate` simulates each as it ran, `EngineConfig.prompt_token_reports`)."""
BASELINE = "smg-ca"
"""The arm every other arm's ratios are against when it ran (else `shadow`)."""
COORDINATOR_ARM = {"pull": ("none", "active"), "demote": ("demote", "active"), "active": ("kvrep", "active"),
                   "active-lru": ("kvrep_lru", "active"), "active-fixed": ("kvrep_fixed", "active"),
                   "active-nosent": ("kvrep", "active")}
"""Arm -> the coordinator's (policy, mode) (any other arm: the planner in shadow mode)."""
DEMO_ARMS = ("shadow", "pull", "active", BASELINE)
"""`kvrep demo`'s arms: routing alone, reactive copies, predictive + reactive, today's router."""
PULL_ARMS = ("pull", "demote", "active", "active-lru", "active-nosent")
"""The arms served by the router started with `--pull` (the others by the one without)."""
FIXED_SPEED_ARMS = ("active-fixed",)
"""The arms served by a router started with `--pull --no-speed-calibration` (and whose planner, `kvrep_fixed`,
prices prefills at the profile's times): every other arm of ours learns the workers' speed."""
TIES = "turns"
"""Saved as a run's `ties`: its routers' full ties took turns over the workers (`--tie-turns`, the default since
stop 49; absent: every one to the lowest id, and `--resimulate` simulates the run's routers so)."""
NOSENT_ARMS = ("active-nosent",)
"""The arms served by a router started with `--pull --no-sent-pages` (a prefix its own requests sent to a worker and
not started is not priced as cached there; the simulated router the same): the ablation of that pricing."""
LOWEST_ID_ARMS = ("shadow-lowid",)
"""The arms served by a router started with `--no-tie-turns` (every full tie to the lowest id; the simulated router
the same): the tie rotation's ablation."""
NORELAY_ARMS = ("shadow-norelay",)
NODRAW_ARMS = ("shadow-nodraw",)
"""The arms served by routers started with `--no-tie-draws` (behind N doors, each breaks ties on the expected TTFT by
the shared load and turn, as alone; the simulated doors the same): the tie draw's ablation (`shadow-nodraw@4` against
`shadow@4`)."""
TIE_DRAWS = "drawn"
"""Saved as a run's `tie_draws`: its routers of ours drew their ties while others served (`--tie-draws`, the default
since stop 58), and `--resimulate` simulates their doors so (absent: by load and turn, as before)."""
"""The arms served by routers started with `--no-peer-sends` (behind N doors, each learns the others' sends only from
the workers' next load reports; the simulated doors the same): the send relay's ablation (`shadow-norelay@4` against
`shadow@4`)."""
PEER_SENDS = "relayed"
"""Saved as a run's `peer_sends`: its `ARM@N` routers of ours relayed their sends to one another through the coordinator
(`--peer-sends`, the default since stop 57), and `--resimulate` simulates their doors so, each learning the others'
events `RELAY_LAG_S` late (absent: never, as before)."""
RELAY_LAG_S = 0.003
"""The relay's lag as simulated: its mean measured live, 4 routers on loopback at 200 requests/s, 2.2-3.2 ms a round
(`scripts/relay_lag.py`, docs/bench.md)."""
SENT_PAGES = "priced"
"""Saved as a run's `sent_pages`: its routers priced what their own requests sent and not started will compute
(`--sent-pages`, the default since stop 53; absent: the directory alone, and `--resimulate` simulates them so)."""
MAX_FRONTS = 16
"""`ARM@N`: an arm served by N front doors at most."""


CHECKPOINT = "live-rows.json"
"""The live rows measured so far (rewritten after every cell; removed once `results.json` is written): what a run
that fails after its cells (in the simulation, the tables) keeps of them."""


def checkpoint(out_dir: Path, rows: list[dict]) -> None:
    tmp = out_dir / (CHECKPOINT + ".tmp")
    tmp.write_text(json.dumps(rows))
    tmp.replace(out_dir / CHECKPOINT)


def router_flags(arm: str) -> tuple[str, ...]:
    """The flags of our router serving `arm` (an arm of `ARMS`, no `@N`), past its profile."""
    if arm in FIXED_SPEED_ARMS:
        return "--pull", "--no-speed-calibration"
    if arm in LOWEST_ID_ARMS:
        return ("--no-tie-turns",)
    if arm in NOSENT_ARMS:
        return "--pull", "--no-sent-pages"
    if arm in NORELAY_ARMS:
        return ("--no-peer-sends",)
    if arm in NODRAW_ARMS:
        return ("--no-tie-draws",)
    return ("--pull",) if arm in PULL_ARMS else ()


def saved_arg(value):
    """An argument as a saved run keeps it: a path inside this checkout relative to its root (a results file
    names no directory of the machine that ran it), any other path as a string, the rest as is."""
    if isinstance(value, str) and os.path.isabs(value):
        value = Path(value)
    if not isinstance(value, Path):
        return value
    try:
        return str(value.resolve().relative_to(ROOT))
    except ValueError:
        return str(value)


def round_order(arms: list[str], rnd: int, seed: int, mode: str = "fixed") -> list[str]:
    """The order the arms run in, in round `rnd`: as given (`fixed`); shuffled per round (`shuffled`, seeded by
    `seed` and the round: reproducible), so no arm always runs after the same one (a slow drift or what the
    previous arm left in the workers' caches then hits every arm alike); or `balanced`: a Williams design over the
    arms (their labels shuffled by `seed`), so that over every n rounds (2n for an odd number n of arms) each arm
    runs in each place of the round equally often and right after each other arm equally often (a random shuffle
    does not: 2 arms in 3 rounds came out in the same order every round, stop 50's A/A run)."""
    if mode == "fixed":
        return list(arms)
    if mode not in ("shuffled", "balanced"):
        raise ValueError(f"arm order must be fixed, shuffled or balanced, got {mode!r}")
    order = list(arms)
    if mode == "shuffled":
        random.Random(seed * 1_000_003 + rnd).shuffle(order)
        return order
    random.Random(seed * 1_000_003).shuffle(order)
    n = len(order)
    first = [0]  # 0, 1, n-1, 2, n-2, ...
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    row = [order[(j + rnd) % n] for j in first]
    return row[::-1] if n % 2 and (rnd // n) % 2 else row


def split_arm(arm: str) -> tuple[str, int]:
    """`ARM@N` -> (ARM, N): the arm served by N routers in front of the same workers (ours: N processes sharing the
    coordinator's directory; smg: N gateways, each with its own cache-aware tree), the client spreading requests
    over them in turn (a load balancer in front of a fleet's gateways). `ARM` alone: (ARM, 1).

    Raises:
        ValueError: an unknown arm or a count outside [1, MAX_FRONTS].
    """
    base, _, n = arm.partition("@")
    if base not in ARMS:
        raise ValueError(f"unknown arm {base!r}; known: {', '.join(ARMS)} (each optionally @N)")
    try:
        fronts = int(n) if n else 1
    except ValueError:
        raise ValueError(f"arm {arm!r}: the count after @ must be an integer") from None
    if not 1 <= fronts <= MAX_FRONTS:
        raise ValueError(f"arm {arm!r}: 1 to {MAX_FRONTS} front doors")
    return base, fronts
WORKLOADS = ("agent", "fanout", "flash", "shared", "unique")
CLIENTS = ("kvrep", "sglang", "both")
"""`--client`: our load generator (the default), SGLang's own `sglang.benchmark.serving`, or both."""
DEFAULT_TRACE = ROOT / "bench" / "traces" / "claude_code_sample"


def build_workload(name: str, args) -> "Workload":
    """Returns: the scaled workload `name` (a fresh object; the replay consumes it)."""
    from kvrep_dev.loadgen import Scale, scale_workload
    from radix_sync.sim.generators import FanoutWorkload, FlashCrowdWorkload, GeneratorConfig, SharedPrefixWorkload
    from radix_sync.sim.workload import ClaudeWorkload

    d = args.duration_s
    if name == "agent":
        # Claude Code sessions: ~100K-token contexts in 64-token pages -> 1/32 (a page = 2 tokens), cut at
        # --max-prompt; tool gaps (p50 9 s) x0.1, capped at 2 s.
        scale = Scale(token_factor=1 / 32, max_prompt_tokens=args.max_prompt, max_output_tokens=args.max_output,
                      think_factor=0.1, max_think_s=2.0)
        wl = ClaudeWorkload(Path(args.trace), rate=args.agent_rate, duration_s=d,
                            max_context_len=int(args.max_prompt * 32) + 64, seed=args.seed,
                            max_turns=args.max_turns)
        return scale_workload(wl, scale)
    scale = Scale(max_prompt_tokens=args.max_prompt, max_output_tokens=args.max_output)
    if name == "fanout":
        cfg = GeneratorConfig(page_len=16, fanout_k=args.fanout_k, fanout_prefix_min_len=args.fanout_trunk,
                              fanout_branch_len=32, fanout_output_len=args.max_output, fanout_delay_s=0.2)
        return scale_workload(FanoutWorkload(cfg, args.fanout_rate, d, args.seed, args.max_prompt + 256), scale)
    if name == "flash":
        # the simulator's flash crowd with one crowd over the whole run: its rate ramps from 0 to the peak over
        # the first half, then holds (mean rate --flash-rate); each request the hot prefix + ~32 unique tokens
        cfg = GeneratorConfig(page_len=16, flash_prefix_len=args.flash_prefix, flash_period_s=d,
                              flash_ramp_s=d / 2, flash_suffix_len=32, flash_output_len=args.max_output)
        wl = FlashCrowdWorkload(cfg, args.flash_rate, d, args.seed, args.max_prompt + 256)
        wl.name = name
        return scale_workload(wl, scale)
    if name in ("shared", "unique"):
        # `unique`: one short prefix and a long unique suffix, then that prefix made unique per request too
        if name == "shared":
            cfg = GeneratorConfig(page_len=16, shared_num_prefixes=8, shared_prefix_min_len=256,
                                  shared_suffix_len=64, shared_output_len=args.max_output)
        else:
            cfg = GeneratorConfig(page_len=16, shared_num_prefixes=1, shared_prefix_min_len=16,
                                  shared_suffix_len=600, shared_output_len=args.max_output)
        wl = SharedPrefixWorkload(cfg, args.shared_rate, d, args.seed, args.max_prompt + 256,
                                  "bursty" if name == "shared" else "poisson")
        if name == "unique":
            for r in wl.open_requests:
                r.pages = [p + (r.rid + 1) * 1_000_000 for p in r.pages]
        wl.name = name
        return scale_workload(wl, scale)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def smg_argv(policy: str, worker_urls: list[str], port: int, prometheus_port: int,
             api_key: Optional[str] = None) -> list[str]:
    """The command line of smg 1.13 with `--policy policy` on its defaults: only the worker URLs, host, port, a
    free Prometheus port (its default, 29000, may be taken), the log level and the workers' API key."""
    argv = [sys.executable, "-m", "smg.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--policy", policy, "--worker-urls", *worker_urls, "--log-level", "warn",
            "--prometheus-port", str(prometheus_port)]
    if api_key:  # the workers' --api-key: smg sends it to them, and wants it from its clients too (401 without)
        argv += ["--api-key", api_key]
    return argv


class SmgRouter(Proc):
    """smg 1.13 (`python -m smg.launch_router`, PyPI `smg`) in front of the same workers (`smg_argv`)."""

    def __init__(self, policy: str, worker_urls: list[str], log_dir: Path, api_key: Optional[str] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(f"smg-{policy}", smg_argv(policy, worker_urls, self.port, free_port(), api_key),
                         log_dir / f"smg-{policy}.log")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        self.wait_http(self.url + "/health", timeout_s)
        # its /health answers before it has registered the workers (404 "no worker available for model" until
        # then): wait until it serves a request (not measured)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status, _ = http_json(self.url + "/generate", {"text": "warm up", "sampling_params": {
                    "max_new_tokens": 1}}, timeout=30, headers=self.headers)
            except OSError:
                status = 0
            if status == 200:
                return
            if time.monotonic() > deadline or not self.alive():
                raise RuntimeError(f"{self.name} does not serve (last status {status}):\n{self.tail()}")
            time.sleep(0.5)


def cell_decisions(router, request_id_prefix: str) -> list[dict]:
    """Returns: the router's decisions for the requests sent with ids `<request_id_prefix><rid>` (this cell's;
    the router keeps its last decisions over its life, the earlier cells' among them)."""
    from radix_sync.router.service import MAX_DECISIONS_KEPT

    return [d for d in router.status(MAX_DECISIONS_KEPT).get("last_decisions") or ()
            if str(d.get("request_id", "")).startswith(request_id_prefix)]


def _wait_idle(coord: Coordinator, timeout_s: float = 60.0) -> None:
    """Until no replication is pending/running and every worker reports an empty queue."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reps = coord.get("/replications")[1]
        busy = [w for w in coord.get("/workers")[1]
                if (w.get("load") or {}).get("num_running_reqs") or (w.get("load") or {}).get("num_waiting_reqs")]
        if not busy and not any(r["state"] in ("pending", "running") for r in reps):
            return
        time.sleep(0.3)


def _wait_no_replicas(coord: Coordinator, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and coord.get("/status")[1]["replicas"]:
        time.sleep(0.1)


def _replication_stats(reps: list[dict]) -> dict:
    done = [r for r in reps if r["state"] == "done"]
    total = sum(r["bytes"] for r in done)
    useful = sum(r["bytes"] for r in done if r.get("promoted_tokens", 0) > 0)
    return {"count": len(done), "failed": sum(1 for r in reps if r["state"] == "failed"), "bytes": total,
            "useful_bytes_frac": (useful / total) if total else None}


def _progress(label: str, total: int) -> Callable:
    count = [0]
    tty = sys.stderr.isatty()

    def on_done(res) -> None:
        count[0] += 1
        if tty or count[0] == total or count[0] % 10 == 0:
            end = "\n" if (count[0] == total or not tty) else ""
            sys.stderr.write(f"\r[bench] {label:<16} {count[0]:>4}/{total} requests{end}")
            sys.stderr.flush()
    return on_done


def probe_speed(urls: list[str], words: list[str], profile_name: str, repeats: int = 2,
                headers: Optional[dict] = None) -> dict:
    """Measures this machine's speed now against the profile (a shared VM's speed drifts by ~10% between runs):
    on each idle worker, a cold 1,024-token prompt and a 32-token extension of it, streamed as the bench does.
    Returns: {"prefill": median measured/profile TTFT, "decode": median measured/profile step, "samples": [...]}."""
    import random

    from radix_sync.policy.cost import load_profile

    profile = load_profile(profile_name)
    rng = random.Random(7)

    def text(n: int) -> str:
        return "".join(" " + rng.choice(words) for _ in range(n))

    n_out = 8
    prefill, decode, samples = [], [], []
    for url in urls:
        for _ in range(repeats):
            prefix = text(1024)
            for prompt in (prefix, prefix + text(32)):
                ttft, e2e, n, c = stream_generate(url, prompt, n_out, headers=headers)
                prefill.append(ttft / profile.prefill_s(n - c, c))
                decode.append((e2e - ttft) / profile.decode_steps_s(n_out - 1, 1, n))
                samples.append({"prompt_tokens": n, "cached_tokens": c, "ttft_s": round(ttft, 4),
                                "e2e_s": round(e2e, 4)})
    return {"prefill": statistics.median(prefill), "decode": statistics.median(decode), "samples": samples}


def scale_profile(profile, prefill: float = 1.0, decode: float = 1.0):
    """Returns: `profile` with its prefill terms times `prefill` and its decode terms times `decode`."""
    return replace(profile, prefill_overhead_s=profile.prefill_overhead_s * prefill,
                   prefill_s_per_token=profile.prefill_s_per_token * prefill,
                   prefill_s_per_token_pair=profile.prefill_s_per_token_pair * prefill,
                   prefill_s_per_cached_pair=profile.prefill_s_per_cached_pair * prefill,
                   decode_step_s=profile.decode_step_s * decode,
                   decode_s_per_request=profile.decode_s_per_request * decode,
                   decode_s_per_ctx_token=profile.decode_s_per_ctx_token * decode)


SIM_MACHINE_FIT = "fit"
"""`--sim-machine`'s default: the simulator's engine runs on the prefill terms fitted to the run's own lone requests
(`measure_machine`), else (too few) on `testbed.MACHINE_PROFILE` at the run's drift."""
FIT_MIN_SAMPLES = 100
FIT_MIN_CELLS = 8
"""A run's own fit needs this many lone requests over this many cells of the (new, cached) log-2 grid (fewer: one
part of the grid would decide the terms the rest is simulated with)."""


def machine_profile(priced, machine: dict):
    """Returns: the profile the simulator's engine runs on: `priced` (what the live router and planner price with)
    with the prefill terms of `machine["fit"]` (fitted to the run's own lone requests) when there is one, else of
    `machine["profile"]` (the testbed as measured once, `testbed.MACHINE_PROFILE`) scaled by `machine["drift"]`
    (this run's speed against it); its decode scaled by `machine["decode"]`."""
    from radix_sync.policy.cost import load_profile

    if machine.get("fit"):
        return scale_profile(replace(priced, **machine["fit"]["values"]), 1.0, machine.get("decode", 1.0))
    m = load_profile(machine["profile"])
    terms = ("prefill_overhead_s", "prefill_s_per_token", "prefill_s_per_token_pair", "prefill_s_per_cached_pair")
    return scale_profile(replace(priced, **{k: getattr(m, k) for k in terms}), machine.get("drift", 1.0),
                         machine.get("decode", 1.0))


def describe_machine(machine: dict) -> str:
    """One line: what the simulator's engine runs on."""
    decode = f"decode x{machine['decode']:.2f} ({machine['decode_from']})"
    if machine.get("fit"):
        f = machine["fit"]
        return (f"prefill terms fitted to {f['samples']} requests that ran alone ({f['cells']} cells, RMS "
                f"{f['rms']:.0%}; {machine['profile']} would be x{machine['drift']:.2f}), {decode}")
    return (f"{machine['profile']} at prefill x{machine['drift']:.2f} (the median over {machine['isolated_requests']}"
            f" requests that ran alone), {decode}")


def measure_machine(rows: list[dict], speed: Optional[dict], name: str = SIM_MACHINE_FIT,
                    overlap: bool = True) -> Optional[dict]:
    """The machine during a run, from its own requests: the prefill terms fitted to its isolated requests' TTFTs
    (`calibration.fit_prefill`; `name` = `SIM_MACHINE_FIT` and at least `FIT_MIN_SAMPLES` of them over
    `FIT_MIN_CELLS` cells: a machine whose cold prompts and cache hits got faster by different factors is simulated
    as it ran), and their drift against a profile (`name`, or `testbed.MACHINE_PROFILE` for a fit), the median
    measured/predicted; and the decode factor of its lone decodes (runs that recorded each request's end), else of
    the speed probe (1.0 without one). `overlap`: the workers ran SGLang's overlap scheduler (a decode step
    between a lone prefill and its first token, `calibration.prefill_part`). Returns:
    None when fewer than `calibration.MIN_SAMPLES` requests ran alone (the simulator then scales the priced
    profile by the probe, as before)."""
    from kvrep_dev import calibration
    from radix_sync.policy.cost import load_profile

    samples = calibration.isolated_requests(rows)
    if len(samples) < calibration.MIN_SAMPLES:
        return None
    refit = name == SIM_MACHINE_FIT
    name = testbed.MACHINE_PROFILE if refit else name
    prof = load_profile(name)
    steps = calibration.lone_decode_steps(rows)  # runs that recorded each request's end (since stop 31)
    if len(steps) >= calibration.MIN_SAMPLES:
        decode, decode_from = round(calibration.decode_drift(prof, steps), 4), f"{len(steps)} lone decodes"
    else:
        decode, decode_from = (round(speed["decode"], 4), "the probe") if speed else (1.0, "not measured")
    # the prefill part of each TTFT: less the first-token lag the simulated engine adds (at this run's decode speed)
    part = calibration.prefill_part(samples, scale_profile(prof, 1.0, decode), overlap)
    res = calibration.residuals(prof, part)
    fit = None
    if refit and len(part) >= FIT_MIN_SAMPLES and len({calibration.cell(n, c) for n, c, _ in part}) >= FIT_MIN_CELLS:
        fit = calibration.fit_prefill(part)
        fit["rms"] = round(fit["rms"], 4)
    return {"profile": name, "drift": round(calibration.drift(prof, part), 4), "decode": decode,
            "decode_from": decode_from, "isolated_requests": len(samples),
            "median_rel_error_before_drift": round(statistics.median(res), 4), "fit": fit}


def simulate(wl, arm: str, workers: int, seed: int, profile_name: str = testbed.PROFILE,
             max_total_tokens: Optional[int] = None, max_running: Optional[int] = None,
             speed: Optional[dict] = None, cores: Optional[int] = None, endpoint_wait: bool = True,
             machine: Optional[dict] = None, prompt_reports: bool = False, speed_calibration: bool = False,
             tie_turns: bool = True, frontend: bool = False, overlap_lag: bool = True,
             sent_pages: bool = True, front_doors: int = 1, door_sends_s: Optional[float] = None,
             tie_draws: bool = True) -> dict:
    """Runs the simulator on the scaled workload under the arm's sim policy (or the simulator policy named `arm`),
    as the live run had it: every session to its end, the workers sharing `cores` cores (default: this machine's)
    with SGLang's overlap scheduler, copies starting between scheduler iterations at both ends (as the live agents
    gather and install; the router and the planner price that wait, as live; `endpoint_wait=False`: the simulator's
    model before, pages moving during iterations), and when given the live workers' KV pool size and
    running-request limit (the profile's are the calibration's). The policies (router, planner) price with
    `profile_name`, as the live ones did; the engine runs on `machine` when given (`machine_profile`: the testbed's
    measured prefill costs at this run's speed), else on the priced profile scaled by the probe (`speed`).
    `prompt_reports`: the workers' load reports count waiting prompts whole, as the live agent's did before
    stop 40 (`EngineConfig.prompt_token_reports`; False: their uncached tokens, as the live agent's do now).
    `speed_calibration`: the simulated router learns the prefill speed from the requests that ran alone, as the
    live router's `--speed-calibration` (`radix_sync.policy.speed`; its planner shares the cost model).
    `tie_turns`: full ties take turns over the workers (False: the lowest id, as the live router's `--no-tie-turns`).
    `frontend`: each request's CPU in the processes beside the workers runs on the same cores
    (`EngineConfig.frontend_cpu_s`, as measured on the testbed for the arm's front door: `testbed.FRONTEND_CPU_S`);
    False: not modelled (the default: docs/bench.md, stop 50, says why). `overlap_lag`: the workers ran SGLang's
    overlap scheduler, which on a CPU hands out an iteration's outputs when the next one ends
    (`EngineConfig.overlap_lag`; the testbed's workers have run without it since stop 53: docs/testbed.md).
    `sent_pages`: the simulated router prices what its own requests sent and not started will compute (False: as
    the live router's `--no-sent-pages`). `front_doors`: the arm behind that many routers, the k-th request through
    door k mod N, as the live `ARM@N` (`PolicyBundle.doors`); `door_sends_s`: behind several, each of our routers
    learns the others' sends that late (`EngineConfig.door_sends_s`, the live send relay; None: never; smg's gateways
    relay nothing); `tie_draws`: behind several relayed doors, ours take the less loaded of two tied workers each draws
    (`ExpectedTtftRouter.tie_draws`; False: the live `--no-tie-draws`)."""
    from radix_sync.policy.cost import load_profile
    from radix_sync.policy.speed import SpeedCalibration
    from radix_sync.policy.planner import PlannerConfig
    from radix_sync.sim.engine import Engine, EngineConfig
    from radix_sync.sim.policies import build_policy

    profile = load_profile(profile_name)
    if max_total_tokens is not None:
        profile = replace(profile, kv_capacity_tokens=max_total_tokens)
    if max_running is not None:
        profile = replace(profile, max_running_requests=max_running)
    priced = profile
    if machine is not None:
        profile = machine_profile(priced, machine)
    elif speed is not None:
        profile = scale_profile(profile, speed["prefill"], speed["decode"])
    last = max([r.arrival_s for r in wl.open_requests] + [t for t, _ in wl.session_starts] + [0.0])
    policy = build_policy(SIM_POLICY.get(arm, arm), priced, wl.page_len, seed,
                          PlannerConfig(endpoint_wait=endpoint_wait), front_doors)
    for router in policy.doors or (policy.router,):
        if speed_calibration and hasattr(router, "speed"):
            router.speed = SpeedCalibration()
        if hasattr(router, "tie_turns"):
            router.tie_turns = tie_turns
        if hasattr(router, "count_sent"):
            router.count_sent = sent_pages
        if hasattr(router, "tie_draws"):
            router.tie_draws = tie_draws
    # NOTE: duration_s stops issuing requests, so it must not cut the sessions still going after the last start
    ecfg = EngineConfig(num_workers=workers, duration_s=last + 3600.0, shared_cores=cores or os.cpu_count() or 1,
                        overlap_lag=overlap_lag, record_requests=True, endpoint_wait=endpoint_wait,
                        prompt_token_reports=prompt_reports,
                        door_sends_s=door_sends_s if front_doors > 1 and arm not in SMG_POLICY else None,
                        frontend_cpu_s=(testbed.FRONTEND_CPU_S["smg" if arm in SMG_POLICY else "kvrep"]
                                        if frontend else 0.0))
    stats = Engine(profile, wl, policy, ecfg).run()
    return stats.to_dict()


def by_occurrence(reqs: list[dict]) -> dict[tuple[str, int], dict]:
    """A run's requests by (`key`, n): the n-th request with that key by send time (two requests may share a key,
    e.g. flash-crowd requests whose unique tails are shorter than a page). Requests without a key are left out. The
    same request in two replays of one workload (two arms, or live and simulated) has the same (key, n)."""
    seen: dict[str, int] = {}
    out = {}
    for q in sorted(reqs, key=lambda q: q.get("sent_s") or 0.0):
        if q.get("key"):
            n = seen[q["key"]] = seen.get(q["key"], -1) + 1
            out[(q["key"], n)] = q
    return out


def compare_requests(live: list[dict], sim: list[dict]) -> dict:
    """Matches a live replay's requests with the simulator's (`by_occurrence`). Returns: how many matched, the
    median of (simulated - measured) / measured TTFT over them, and the median of the same for the requests the
    live run served with and without a cache hit."""
    twins = by_occurrence(sim)
    pairs = [(r, twins[k]) for k, r in by_occurrence(live).items() if k in twins]
    errs, hit, miss = [], [], []
    for r, s in pairs:
        if not r.get("ttft_s"):
            continue
        e = s["ttft_s"] / r["ttft_s"] - 1
        errs.append(e)
        (hit if r.get("cached_tokens") else miss).append(e)
    med = lambda xs: statistics.median(xs) if xs else math.nan  # noqa: E731
    return {"matched": len(errs), "median_rel_error": med(errs), "median_rel_error_cached": med(hit),
            "median_rel_error_uncached": med(miss)}


def _ttfts(r: dict) -> list[float]:
    """The TTFTs of a row's answered requests."""
    return [q["ttft_s"] for q in r.get("requests", []) if q.get("ttft_s") is not None and not q.get("error")]


PAIRED_MIN_MATCH = 0.9
"""Two arms' requests are paired when, in every round, at least this share of each arm's answered requests has a
counterpart with the same `key` (the workload replayed from one seed: the same prompts; closed-loop sessions issue
them at other times, so they are matched by key, not by order)."""


def _paired(a: dict, b: dict) -> Optional[list[tuple[float, float]]]:
    """The TTFTs of the requests two rows (two arms, one round) both answered, matched by `by_occurrence`; None when
    an answered request has no key or too few match."""
    def answered(r: dict) -> Optional[dict]:
        qs = [q for q in r.get("requests", []) if q.get("ttft_s") is not None and not q.get("error")]
        return by_occurrence(qs) if all(q.get("key") for q in qs) else None
    ka, kb = answered(a), answered(b)
    if not ka or not kb:
        return None
    both = [k for k in ka if k in kb]
    if len(both) < PAIRED_MIN_MATCH * max(len(ka), len(kb)):
        return None
    return [(ka[k]["ttft_s"], kb[k]["ttft_s"]) for k in both]


def ratio_interval(num: list[dict], den: list[dict], stat: str) -> dict:
    """The TTFT `stat` ratio of two arms' rows (the same rounds, in order) with its bootstrap interval over the
    rounds and the requests within them (`kvrep_dev.stats.rounds_ratio_ci`): paired by request, over the requests
    both answered, when every round pairs (`_paired`), else each arm's requests drawn independently. `paired`: the
    pairs, or 0."""
    from kvrep_dev import stats

    pairs = [_paired(a, b) for a, b in zip(num, den)]
    if pairs and all(p is not None for p in pairs):
        ci = stats.rounds_ratio_ci([[x for x, _ in p] for p in pairs], [[y for _, y in p] for p in pairs], stat, True)
        return {"value": ci["value"], "lo": ci["lo"], "hi": ci["hi"], "paired": ci["n"]}
    ci = stats.rounds_ratio_ci([_ttfts(a) for a in num], [_ttfts(b) for b in den], stat, False)
    return {"value": ci["value"], "lo": ci["lo"], "hi": ci["hi"], "paired": 0}


def _add_cis(rows: list[dict]) -> None:
    """Adds each row's bootstrap intervals of TTFT mean and P99 (`kvrep_dev.stats`) as `ci`."""
    from kvrep_dev import stats

    for r in rows:
        xs = _ttfts(r)
        r["ci"] = {k: stats.ci(xs, k) for k in ("mean", "p99")} if xs else {}


def format_table(rows: list[dict]) -> str:
    from kvrep_dev.stats import fmt

    many = any(r.get("repeat", 0) for r in rows)
    head = (f"{'workload':<8} {'arm':<7} {'#' if many else '':>2} {'reqs':>4} {'err':>3} {'TTFT mean':>9} "
            f"{'95% CI':<11} {'P50':>6} {'P95':>6} {'P99':>6} {'95% CI':<11} {'TPOT ms':>7} {'req/s':>6} "
            f"{'cached':>6} {'copies':>6} {'MB':>7} {'useful':>6}  P99 vs")
    lines = [head, "-" * len(head)]
    for r in rows:
        s, rep = r["live"], r["replication"]
        t = s["ttft_s"]
        useful = "" if rep["useful_bytes_frac"] is None else f"{rep['useful_bytes_frac']:.0%}"
        lines.append(
            f"{r['workload']:<8} {r['arm']:<7} {r.get('repeat', 0) + 1 if many else '':>2} {s['requests']:>4} "
            f"{s['errors']:>3} {t['mean']:>9.2f} {fmt(r.get('ci', {}).get('mean')):<11} {t['p50']:>6.2f} "
            f"{t['p95']:>6.2f} {t['p99']:>6.2f} {fmt(r.get('ci', {}).get('p99')):<11} "
            f"{s['tpot_s']['mean'] * 1e3:>7.1f} {s['throughput_rps']:>6.2f} "
            f"{s['cached_token_ratio']:>6.0%} {rep['count']:>6} {rep['bytes'] / 1e6:>7.1f} {useful:>6}  "
            f"{r.get('p99_vs', '')}")
    return "\n".join(lines)


def _ratios(rows: list[dict]) -> None:
    """Adds each arm's P99 / mean TTFT ratios against the baseline of the same workload and round (`BASELINE` if
    run, else shadow)."""
    by_wl: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_wl.setdefault((r["workload"], r.get("repeat", 0)), {})[r["arm"]] = r
    for arms in by_wl.values():
        base_name = BASELINE if BASELINE in arms else "shadow" if "shadow" in arms else None
        if base_name is None:
            continue
        base = arms[base_name]["live"]["ttft_s"]
        for name, r in arms.items():
            t = r["live"]["ttft_s"]
            r["ratio_vs"] = base_name
            r["p99_ratio"] = t["p99"] / base["p99"] if base["p99"] else math.nan
            r["mean_ratio"] = t["mean"] / base["mean"] if base["mean"] else math.nan
            r["p99_vs"] = "" if name == base_name else f"{r['p99_ratio']:.2f}x {base_name}"


def summarize_rounds(rows: list[dict]) -> list[dict]:
    """Per workload and arm over the rounds: median and range of TTFT P99 and mean, and of the paired ratios
    against the round's baseline (`_ratios` first); the bootstrap intervals of P99 and mean over the requests of
    every round pooled (`p99_ci`, `mean_ci`: `kvrep_dev.stats`, resampled within each round)."""
    from kvrep_dev import stats as bootstrap

    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["arm"]), []).append(r)

    def stats(xs: list[float]) -> dict:
        xs = sorted(x for x in xs if not math.isnan(x))
        return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1]} if xs else {}
    out = []
    for (wl, arm), rs in groups.items():
        out.append({"workload": wl, "arm": arm, "rounds": len(rs), "vs": rs[0].get("ratio_vs"),
                    "p99_s": stats([r["live"]["ttft_s"]["p99"] for r in rs]),
                    "mean_s": stats([r["live"]["ttft_s"]["mean"] for r in rs]),
                    "p99_ratio": stats([r["p99_ratio"] for r in rs if "p99_ratio" in r]),
                    "mean_ratio": stats([r["mean_ratio"] for r in rs if "mean_ratio" in r]),
                    "copies": stats([float(r["replication"]["count"]) for r in rs]),
                    **{f"{k}_ci": bootstrap.ci([_ttfts(r) for r in rs], k) if any(_ttfts(r) for r in rs) else {}
                       for k in ("p99", "mean")}})
    return out


def front_door_ratios(rows: list[dict], resamples: int = 2000, seed: int = 0) -> list[dict]:
    """Per workload, each `ARM@N` row set against `ARM` (one front door) on the same workload: the cached-token
    ratio (cached / prompt tokens, SGLang's `cached_tokens` at the client) of each, pooled over the rounds; their
    quotient with a bootstrap interval (requests resampled within each round and arm, `resamples` times, fixed
    seed); and the quotient paired within each round. Issue 20's "many routers, one directory" measure: N routers
    on one directory within 2% of one router."""
    import numpy as np

    cells: dict[tuple[str, str], dict[int, dict]] = {}
    for r in rows:
        cells.setdefault((r["workload"], r["arm"]), {})[r.get("repeat", 0)] = r

    def pairs(r: dict) -> np.ndarray:
        qs = [q for q in r.get("requests", []) if not q.get("error") and q.get("prompt_tokens")]
        return np.array([[q["prompt_tokens"], q.get("cached_tokens") or 0] for q in qs], dtype=float).reshape(-1, 2)

    def pooled(arrays: list[np.ndarray]) -> float:
        total = sum(float(a[:, 0].sum()) for a in arrays)
        return sum(float(a[:, 1].sum()) for a in arrays) / total if total else float("nan")

    def quotient(x: float, y: float) -> float:  # (no cached token in the one-door arm, as with no sharing: none)
        return x / y if y else float("nan")

    rng = np.random.default_rng(seed)
    out = []
    for (wl, arm), many in cells.items():
        if "@" not in arm or (wl, arm.split("@")[0]) not in cells:
            continue
        one = cells[(wl, arm.split("@")[0])]
        rounds = sorted(set(many) & set(one))
        if not rounds:
            continue
        a = [pairs(many[k]) for k in rounds]
        b = [pairs(one[k]) for k in rounds]
        boot = []
        for _ in range(resamples):
            ra = [x[rng.integers(0, len(x), len(x))] for x in a if len(x)]
            rb = [x[rng.integers(0, len(x), len(x))] for x in b if len(x)]
            boot.append(quotient(pooled(ra), pooled(rb)))
        lo, hi = np.nanquantile(boot, [0.025, 0.975]) if not np.isnan(boot).all() else (math.nan, math.nan)
        per_round = [quotient(pooled([x]), pooled([y])) for x, y in zip(a, b)]
        out.append({"workload": wl, "arm": arm, "vs": arm.split("@")[0], "rounds": len(rounds),
                    "cached": pooled(a), "cached_vs": pooled(b), "ratio": quotient(pooled(a), pooled(b)),
                    "ratio_ci": [float(lo), float(hi)], "per_round": per_round})
    return out


def format_front_doors(front: list[dict]) -> str:
    lines = ["front doors: cached-token ratio behind N front doors against one (pooled over the rounds; 95% CI: "
             "bootstrap over requests within each round), and paired per round",
             f"{'workload':<8} {'arms':<18} {'rounds':>6} {'cached N':>8} {'cached 1':>8} {'N / 1':>6} "
             f"{'95% CI':<13} per round"]
    for f in front:
        lines.append(f"{f['workload']:<8} {f['arm'] + ' / ' + f['vs']:<18} {f['rounds']:>6} {f['cached']:>8.1%} "
                     f"{f['cached_vs']:>8.1%} {f['ratio']:>6.3f} [{f['ratio_ci'][0]:.3f}-{f['ratio_ci'][1]:.3f}] "
                     + " ".join(f"{x:.3f}" for x in f["per_round"]))
    return "\n".join(lines)


CLAIMS = (("active", "shadow"), ("active", "pull"), ("active", BASELINE), ("pull", "shadow"), ("demote", "pull"),
          ("active", "demote"), ("active-lru", "active"), ("active-lru", "pull"), ("active", "active-fixed"),
          ("active", "active-nosent"), ("shadow", "shadow-lowid"), ("shadow@1", "shadow"),
          ("shadow@4", "shadow-norelay@4"), ("shadow@4", "shadow-nodraw@4"))
"""The ratios the claims rest on: predictive + reactive copies against routing alone, reactive copies alone and
today's router; then the ablation's steps, each part against the arm without it (copies on the path, demotion,
prediction), where both arms ran; and `shadow@1`/`shadow`, an A/A control (the same router, its own prompts): how far
two identical arms drift in the run."""


def claim_ratios(rows: list[dict]) -> list[dict]:
    """Per workload, each of `CLAIMS` whose two arms ran: the TTFT P99 and mean ratio over the requests of every
    round pooled, with its bootstrap interval (`ratio_interval`: paired by request where both arms served the same
    requests), and the median and range of the ratio paired within each round."""
    cells: dict[tuple[str, str], dict[int, dict]] = {}
    for r in rows:
        cells.setdefault((r["workload"], r["arm"]), {})[r.get("repeat", 0)] = r
    out = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        for num, den in CLAIMS:
            a, b = cells.get((wl, num)), cells.get((wl, den))
            if not a or not b:
                continue
            rounds = sorted(set(a) & set(b))
            entry = {"workload": wl, "num": num, "den": den, "rounds": len(rounds),
                     "requests": [sum(len(_ttfts(a[k])) for k in rounds), sum(len(_ttfts(b[k])) for k in rounds)]}
            for k in ("p99", "mean"):
                paired = sorted(a[i]["live"]["ttft_s"][k] / b[i]["live"]["ttft_s"][k] for i in rounds
                                if b[i]["live"]["ttft_s"][k])
                entry[k] = {**ratio_interval([a[i] for i in rounds], [b[i] for i in rounds], k),
                            **({"median": statistics.median(paired), "min": paired[0], "max": paired[-1]}
                               if paired else {})}
            out.append(entry)
    return out


def format_claims(claims: list[dict]) -> str:
    from kvrep_dev.stats import LEVEL, RESAMPLES, fmt

    head = (f"{'workload':<8} {'ratio':<19} {'rounds':>6} {'requests':>9} {'paired':>6}  {'P99 ratio':>9} "
            f"{f'{LEVEL:.0%} CI':<13} {'per round':<18} {'mean ratio':>10} {f'{LEVEL:.0%} CI':<13} per round")
    lines = [f"TTFT ratios over every round's requests pooled; bootstrap CI ({RESAMPLES} resamples, fixed seed): "
             f"rounds drawn with replacement, then each drawn round's requests, paired where both arms served the same "
             f"requests (`paired`: how many, matched by key; ratio and CI over those; '-': each arm's own requests); "
             f"per round: median [range] of the ratio within a round", head, "-" * len(head)]
    for c in claims:
        def per_round(x: dict) -> str:
            return f"{x['median']:.2f} [{x['min']:.2f}-{x['max']:.2f}]" if "median" in x and c["rounds"] > 1 else ""
        lines.append(f"{c['workload']:<8} {c['num'] + '/' + c['den']:<19} {c['rounds']:>6} "
                     f"{'/'.join(map(str, c['requests'])):>9} {c['p99'].get('paired') or '-':>6}  "
                     f"{c['p99']['value']:>8.2f}x {fmt(c['p99']):<13} "
                     f"{per_round(c['p99']):<18} {c['mean']['value']:>9.2f}x {fmt(c['mean']):<13} "
                     f"{per_round(c['mean'])}")
    if any(c["rounds"] == 1 for c in claims):
        lines.append("one round: its intervals are over requests only; they do not count how far two runs of the same "
                     "arm differ (stop 44's A/A run: 0.80-1.58x on the mean per round; docs/bench.md), so take more "
                     "rounds (--repeats) before reading a ratio as a difference")
    return "\n".join(lines)


def format_summary(summary: list[dict]) -> str:
    def rng(st: dict, fmt: str) -> str:
        if not st:
            return ""
        return f"{st['median']:{fmt}} [{st['min']:{fmt}}-{st['max']:{fmt}}]"
    from kvrep_dev.stats import fmt

    def pooled(c: dict) -> str:
        return f"{c['value']:.2f} {fmt(c)}" if c else ""
    head = (f"{'workload':<8} {'arm':<7} {'rounds':>6}  {'TTFT P99 s, median [range]':<26} {'pooled [95% CI]':<19} "
            f"{'mean s':<20} {'pooled [95% CI]':<19} {'P99 ratio':<20} {'mean ratio':<20} vs")
    lines = [head, "-" * len(head)]
    for x in summary:
        lines.append(f"{x['workload']:<8} {x['arm']:<7} {x['rounds']:>6}  {rng(x['p99_s'], '.2f'):<26} "
                     f"{pooled(x.get('p99_ci', {})):<19} {rng(x['mean_s'], '.2f'):<20} "
                     f"{pooled(x.get('mean_ci', {})):<19} "
                     f"{rng(x['p99_ratio'], '.2f'):<20} "
                     f"{rng(x['mean_ratio'], '.2f'):<20} {x['vs'] or ''}")
    return "\n".join(lines)


def plot(rows: list[dict], samples: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, wl in zip(axes[0], names):
        for r in rows:
            if r["workload"] != wl:
                continue
            xs = sorted(samples[(wl, r["arm"])])
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=r["arm"])
        ax.set_title(f"{wl}: TTFT CDF (live)")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SIM_TOLERANCE = 0.20
"""Simulated vs measured P50 / P99 of an arm: within this fraction of the measured value."""
SIM_RATIO_TOLERANCE = 0.1
"""Simulated vs measured ratio the claims rest on (`SIM_RATIOS`): within this, absolute."""
SIM_RATIOS = (("active", "pull"), ("active", BASELINE))


def sim_ratio_checks(rows: list[dict]) -> list[dict]:
    """Per workload, each of `SIM_RATIOS` whose two arms ran and were simulated: the TTFT P99 and mean ratio,
    measured (over every round's requests pooled, with its bootstrap interval `lo`-`hi`, rounds resampled
    separately, paired by request where the arms pair: `ratio_interval`) and simulated, whether they are within
    `SIM_RATIO_TOLERANCE` (`ok`), and whether the simulated
    ratio lies inside the measured one's interval (`in_ci`: a live ratio whose interval is wider than the tolerance
    cannot be matched to it, only not contradicted)."""
    live: dict[tuple[str, str], dict[int, dict]] = {}
    sim: dict[tuple[str, str], dict] = {}
    for r in rows:
        live.setdefault((r["workload"], r["arm"]), {})[r.get("repeat", 0)] = r
        if "sim" in r:
            sim[(r["workload"], r["arm"])] = r["sim"]["ttft_s"]
    out = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        for num, den in SIM_RATIOS:
            if (wl, num) not in sim or (wl, den) not in sim:
                continue
            for k in ("p99", "mean"):
                a, b = live[(wl, num)], live[(wl, den)]
                rounds = sorted(set(a) & set(b))
                ci = ratio_interval([a[i] for i in rounds], [b[i] for i in rounds], k)
                measured = ci["value"]
                simulated = sim[(wl, num)][k] / sim[(wl, den)][k] if sim[(wl, den)][k] else math.nan
                out.append({"workload": wl, "ratio": f"{num}/{den}", "stat": k, "live": measured,
                            "lo": ci["lo"], "hi": ci["hi"], "sim": simulated,
                            "ok": abs(simulated - measured) <= SIM_RATIO_TOLERANCE,
                            "in_ci": bool(ci["lo"] <= simulated <= ci["hi"])})
    return out


def arm_pooled_lines(rows: list[dict]) -> list[str]:
    """Simulated vs measured TTFT P50 / P99 per arm, every round's requests pooled (the simulator replays the same
    requests each round, so its rounds are one run repeated), with the range of the rounds' own values: how far the
    same arm moves from round to round on this machine, which a simulator replaying the same requests cannot
    follow. Empty when no arm has more than one round."""
    from kvrep_dev.stats import point

    arms: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if "sim" in r:
            arms.setdefault((r["workload"], r["arm"]), []).append(r)
    if not any(len(v) > 1 for v in arms.values()):
        return []
    lines = ["per arm, every round pooled: live P50 / P99 [the rounds' range] vs simulated",
             f"{'workload':<8} {'arm':<7} {'rounds':>6} {'live P50':>8} {'range':<11} {'sim P50':>8} {'err':>6} "
             f"{'live P99':>8} {'range':<11} {'sim P99':>8} {'err':>6}"]
    within = inside = total = 0
    for (workload, arm), rs in arms.items():
        live = [_ttfts(r) for r in rs]
        sim = [[q["ttft_s"] for q in r["sim"].get("requests", [])] for r in rs]
        cells = []
        for stat in ("p50", "p99"):
            lv, sv = point(live, stat), point(sim, stat) if any(sim) else rs[0]["sim"]["ttft_s"][stat]
            per_round = [r["live"]["ttft_s"][stat] for r in rs]
            err = sv / lv - 1 if lv else math.nan
            within += abs(err) <= SIM_TOLERANCE
            inside += min(per_round) <= sv <= max(per_round)
            total += 1
            cells.append(f"{lv:>8.2f} {f'[{min(per_round):.2f}-{max(per_round):.2f}]':<11} {sv:>8.2f} {err:>+6.0%}")
        lines.append(f"{workload:<8} {arm:<7} {len(rs):>6} {' '.join(cells)}")
    lines.append(f"per arm, pooled: within {SIM_TOLERANCE:.0%} of the measured value {within} of {total}; inside "
                 f"the rounds' range {inside} of {total}")
    return lines


def validation_table(rows: list[dict], profile_name: str) -> str:
    """Simulated vs measured TTFT per row that has a `sim` record (adds `sim_error` to each), then the simulated
    vs measured ratios the claims rest on (`sim_ratio_checks`). Returns: the table, ending with how many P50/P99
    are within `SIM_TOLERANCE` and how many ratios within `SIM_RATIO_TOLERANCE`."""
    lines = [f"simulator ({profile_name} profile) vs live, TTFT P50 / P99 in seconds; cached-token ratio; the "
             "median per-request error (same requests, matched by key)",
             f"{'workload':<8} {'arm':<7} {'sim policy':<15} {'live P50':>8} {'sim P50':>8} {'err':>6} "
             f"{'live P99':>8} {'sim P99':>8} {'err':>6} {'cached live/sim':>15} {'per-req':>7}"]
    within = total = 0
    for r in rows:
        if "sim" not in r:
            continue
        live, sim = r["live"]["ttft_s"], r["sim"]["ttft_s"]
        e50 = sim["p50"] / live["p50"] - 1 if live["p50"] else math.nan
        e99 = sim["p99"] / live["p99"] - 1 if live["p99"] else math.nan
        per_req = compare_requests(r["requests"], r["sim"].get("requests", []))
        r["sim_error"] = {"p50": e50, "p99": e99, **per_req}
        within += (abs(e50) <= SIM_TOLERANCE) + (abs(e99) <= SIM_TOLERANCE)
        total += 2
        cached = f"{r['live']['cached_token_ratio']:.0%}/{r['sim']['prefix_hit_rate']:.0%}"
        lines.append(f"{r['workload']:<8} {r['arm']:<7} {SIM_POLICY[split_arm(r['arm'])[0]]:<15} {live['p50']:>8.2f} "
                     f"{sim['p50']:>8.2f} {e50:>+6.0%} {live['p99']:>8.2f} {sim['p99']:>8.2f} {e99:>+6.0%} "
                     f"{cached:>15} {per_req['median_rel_error']:>+7.0%}")
    lines.append(f"within {SIM_TOLERANCE:.0%} of the measured value: {within} of {total} (P50 and P99)")
    lines.extend(arm_pooled_lines(rows))
    checks = sim_ratio_checks(rows)
    if checks:
        lines.append("ratios the claims rest on, measured (every round pooled, 95% CI) vs simulated, TTFT P99 and "
                     "mean:")
        for c in checks:
            ci = f"[{c['lo']:.2f}-{c['hi']:.2f}]" if c.get("lo") is not None else ""
            lines.append(f"{c['workload']:<8} {c['ratio']:<15} {c['stat']:<4} live {c['live']:.2f}x {ci:<11} "
                         f"sim {c['sim']:.2f}x  diff {c['sim'] - c['live']:+.2f}  {'ok' if c['ok'] else 'MISS'}"
                         f"{'' if c.get('in_ci', True) else ', outside the CI'}")
        lines.append(f"within {SIM_RATIO_TOLERANCE} of the measured ratio: {sum(c['ok'] for c in checks)} of "
                     f"{len(checks)}; inside the measured ratio's 95% CI: {sum(c['in_ci'] for c in checks)} of "
                     f"{len(checks)}")
    return "\n".join(lines)


def resimulate(path: Path, cores: Optional[int] = None, endpoint_wait: bool = True,
               machine_name: str = SIM_MACHINE_FIT, prompt_reports: Optional[bool] = None,
               frontend: bool = False) -> int:
    """Re-runs the simulator on a saved `kvrep bench` run (results.json: its arguments, the live requests and the
    machine speed measured then) and prints the validation table: a model change is checked against live
    measurements without running the cluster again. `cores`: simulate the workers sharing that many cores instead
    of this machine's (what-if: the bounds on a bigger host; the validation table then compares unlike set-ups).
    `machine_name`: `SIM_MACHINE_FIT` (the run's own fit, `measure_machine`), or the profile whose prefill terms
    the engine runs on, at the run's drift; "probe": the priced profile scaled by the run's speed probe (the model
    before). `prompt_reports`: see `simulate`; None: as the run's agents reported (`WAITING_REPORTS` when the run
    saved it, else whole prompts). `frontend`: see `simulate`."""
    data = load_results(path)
    if prompt_reports is None:
        prompt_reports = data.get("waiting_reports") != WAITING_REPORTS
    calibrated = data.get("prefill_speed") == PREFILL_SPEED
    turns = data.get("ties") == TIES
    overlap = bool(data.get("args", {}).get("overlap_schedule", True))  # (runs before stop 53: SGLang's default)
    sent = data.get("sent_pages") == SENT_PAGES
    relay_s = RELAY_LAG_S if data.get("peer_sends") == PEER_SENDS else None
    draws = data.get("tie_draws") == TIE_DRAWS
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    for k, v in data.get("args", {}).items():
        if k == "trace" and not Path(v).exists() and Path(v).name == DEFAULT_TRACE.name:
            v = str(DEFAULT_TRACE)  # a run saved from another checkout: the same committed sample here
        if hasattr(args, k):
            setattr(args, k, v)
    profile = args.profile
    built: dict = {}
    rows = [r for r in data["rows"] if r.get("requests")]
    machine = None if machine_name == "probe" else measure_machine(rows, data.get("speed"), machine_name, overlap)
    for r in rows:
        if r.get("client") == "sglang":  # not simulated live either
            continue
        if r["workload"] not in built:
            built[r["workload"]] = build_workload(r["workload"], args)
        arm = split_arm(r["arm"])[0]  # (`shadow@1`, the A/A arm, as `shadow`)
        r["sim"] = simulate(copy.deepcopy(built[r["workload"]]), arm, args.workers, args.seed, profile,
                            args.max_total_tokens, args.max_running, data.get("speed"), cores, endpoint_wait,
                            machine, prompt_reports, calibrated and arm not in FIXED_SPEED_ARMS,
                            turns and arm not in LOWEST_ID_ARMS, frontend, overlap,
                            arm not in NOSENT_ARMS and sent, r.get("fronts", 1),
                            None if arm in NORELAY_ARMS else relay_s, draws and arm not in NODRAW_ARMS)
    probe = (f"prefill x{data['speed']['prefill']:.2f}, decode x{data['speed']['decode']:.2f}" if data.get("speed")
             else "not measured, x1")
    print(f"re-simulated {path} ({len(rows)} rows; {cores or os.cpu_count()} cores shared; the engine on "
          + (f"{describe_machine(machine)}; policies priced with {profile}"
             f"{', speed calibrated' if calibrated else ''}; waiting prompts "
             f"reported {'whole' if prompt_reports else 'uncached'}"
             f"{'; front-end CPU on the shared cores' if frontend else ''})"
             if machine else f"{profile} scaled by the speed probe then: {probe})"))
    print(validation_table(rows, profile))
    print()
    print("the same workloads simulated under references (free_copies: every worker holds every prefix, free; "
          "not a bound); ratios vs cache_aware (smg 1.13)")
    print(f"{'workload':<8} {'policy':<12} {'mean':>6} {'P50':>6} {'P99':>6} {'mean x':>7} {'P99 x':>6} {'copies':>6}")
    for w, wl in built.items():
        base = None
        for name in ("cache_aware", "kvrep", "free_copies"):
            res = simulate(copy.deepcopy(wl), name, args.workers, args.seed, profile, args.max_total_tokens,
                           args.max_running, data.get("speed"), cores, endpoint_wait, machine, prompt_reports,
                           calibrated)
            t = res["ttft_s"]
            base = base or t
            print(f"{w:<8} {name:<12} {t['mean']:>6.2f} {t['p50']:>6.2f} {t['p99']:>6.2f} "
                  f"{t['mean'] / base['mean']:>6.2f}x {t['p99'] / base['p99']:>5.2f}x "
                  f"{res['replication']['count']:>6}")
    return 0


def load_results(path: Path) -> dict:
    """A saved `kvrep bench` run (results.json, or .json.gz as in bench/results/)."""
    import gzip

    path = Path(path)
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


def print_claims(path: Path) -> int:
    """Prints the claim ratios of a saved run, recomputed from its requests (`claim_ratios`): a change of the
    statistics is applied to runs already made, without running them again."""
    data = load_results(path)
    rows = data["rows"]
    _ratios(rows)
    claims = claim_ratios(rows)
    print(f"{path}: {data.get('command', '')}")
    print(format_claims(claims) if claims else "no claim: the run has no pair of arms a claim compares")
    return 0


def run_bench(args) -> int:
    if getattr(args, "claims", None):
        return print_claims(Path(args.claims))
    if getattr(args, "resimulate", None):
        return resimulate(Path(args.resimulate), cores=args.sim_cores, endpoint_wait=args.sim_endpoint_wait,
                          machine_name=args.sim_machine, prompt_reports=args.sim_prompt_reports,
                          frontend=args.sim_frontend_cpu)
    from transformers import AutoTokenizer

    from kvrep_dev.loadgen import Renderer, ReplayConfig, replay, summarize, workload_size

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    client = getattr(args, "client", CLIENTS[0])
    if client not in CLIENTS:
        print(f"kvrep bench: unknown client {client!r}; known: {', '.join(CLIENTS)}", file=sys.stderr)
        return 2
    if client == "sglang":
        workloads = []
    for a in arms:
        try:
            split_arm(a)
        except ValueError as exc:
            print(f"kvrep bench: {exc}", file=sys.stderr)
            return 2
    bases = {split_arm(a)[0] for a in arms}
    if args.repeats < 1:
        print(f"kvrep bench: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    if any(a in SMG_POLICY for a in bases):
        try:
            import smg  # noqa: F401
        except ImportError:
            print("kvrep bench: the smg-* arms need `smg` (pip install smg==1.13.0)", file=sys.stderr)
            return 2
    try:
        built = {w: build_workload(w, args) for w in workloads}
    except (ValueError, OSError) as exc:
        print(f"kvrep bench: {exc}", file=sys.stderr)
        return 2
    for w, wl in built.items():
        _say(f"workload {w}: {workload_size(wl)} (page = {wl.page_len} tokens)")
    gsp = gsp_config(args) if client in ("sglang", "both") else None
    if gsp is not None:
        built[sglclient.WORKLOAD] = None  # SGLang's own client's workload: it generates its requests itself
        _say(f"workload {sglclient.WORKLOAD} (sglang.benchmark.serving): {gsp}, {gsp.requests} requests")
    out_dir = ROOT / args.out_dir if not Path(args.out_dir).is_absolute() else Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = out_dir / "logs"
    procs: list[Proc] = []
    rows: list[dict] = []
    samples: dict = {}
    speed: Optional[dict] = None
    to_simulate: list = []  # (row, workload, arm) simulated after the rounds
    t_start = time.monotonic()
    try:
        _say(f"starting the coordinator and {args.workers} CPU SGLang workers (model '{args.model}')")
        keys = local_keys(logs / "keys")
        # NOTE: no copy-ledger holdout: the arms are the comparison here (`active` is the planner at full strength)
        coord = Coordinator(logs, extra_args=("--policy", "kvrep", "--mode", "shadow", "--profile", args.profile,
                                              "--ledger-holdout", "0"))
        procs.append(coord)
        coord.wait_ready()
        workers = []
        for i in range(args.workers):
            tb = testbed_worker_kwargs(args, i)
            w = Worker(f"worker-{i}", args.model, logs, coordinator=coord.endpoint,
                       max_total_tokens=args.max_total_tokens, api_key_file=keys / "worker-api-key", cpu=tb["cpu"],
                       extra_args=("--max-running-requests", str(args.max_running), *tb["extra_args"]))
            procs.append(w)
            workers.append(w)
        for w in workers:
            w.wait_ready()
        coord.wait_workers([w.worker_id for w in workers], timeout_s=60)
        router = Router(logs, keys, coordinator=coord.admin, tokenizer=model_path(args.model),
                        extra_args=("--profile", args.profile),
                        coordinator_tokens=getattr(coord, "tokens_path", None))  # the coordinator's own, if it has
        procs.append(router)
        router_url = router.url
        routers: dict[str, Router] = {}
        pull_router = None
        per_cell = bool(getattr(args, "router_per_cell", False))  # (then only each cell's own routers serve)
        if not per_cell and any(a in PULL_ARMS for a in bases):  # the same router with --pull, for the arms that copy
            pull_router = Router(logs, keys, coordinator=coord, tokenizer=model_path(args.model), name="router-pull",
                                 extra_args=("--profile", args.profile, "--pull"))
            procs.append(pull_router)
            routers = {a: pull_router for a in PULL_ARMS}
        for group, name in ((FIXED_SPEED_ARMS, "router-fixed"), (LOWEST_ID_ARMS, "router-lowid"),
                            (NOSENT_ARMS, "router-nosent"), (NORELAY_ARMS, "router-norelay"),
                            (NODRAW_ARMS, "router-nodraw")):
            if not per_cell and any(a in group for a in bases):  # an ablation's router: the same one less one part
                other = Router(logs, keys, coordinator=coord, tokenizer=model_path(args.model), name=name,
                               extra_args=("--profile", args.profile, *router_flags(group[0])))
                procs.append(other)
                routers.update({a: other for a in group})
                other.wait_http(other.url + "/health", 120)
        router_urls = {a: r.url for a, r in routers.items()}
        router.wait_http(router_url + "/health", 120)
        if pull_router is not None:
            pull_router.wait_http(router_urls["pull"] + "/health", 120)
        if per_cell:  # up once (its keys written, the same every cell's router reads), then out of the way
            router.stop()
            procs.remove(router)
        _say(f"cluster up in {time.monotonic() - t_start:.0f} s; warming up every worker")
        for w in workers:  # first-call code paths (both short and long prompts) before anything is measured
            w.generate(list(range(100, 1100)), 4)
            w.generate(list(range(2000, 2064)), 4)
        tok = AutoTokenizer.from_pretrained(model_path(args.model))
        if args.simulate and workloads:  # (SGLang's own client's rows are not simulated)
            speed = probe_speed([w.url for w in workers], Renderer(tok).words, args.profile,
                                headers=workers[0].headers)
            _say(f"this machine now vs the {args.profile} profile: prefill x{speed['prefill']:.2f}, "
                 f"decode x{speed['decode']:.2f} (the simulator uses these)")
        # NOTE: repeats interleave the arms (every arm once per round), so slow drift on a shared machine hits every
        # arm alike; each round replays the same workload with fresh text (no cache carried over).
        for rnd in range(args.repeats):
            for wname, wl in built.items():
                for position, arm in enumerate(round_order(arms, rnd, args.seed, args.arm_order)):
                    label = f"{wname}/{arm}" + (f" #{rnd + 1}" if args.repeats > 1 else "")
                    smg = None
                    base, fronts = split_arm(arm)
                    extra: list[Proc] = []  # the arm's other front doors (`ARM@N`), stopped after it
                    policy, mode = COORDINATOR_ARM.get(base, ("kvrep", "shadow"))
                    status, answer = coord.post("/policy", {"policy": policy, "mode": mode, "reset_demand": True})
                    if status != 200:
                        raise RuntimeError(f"coordinator refused /policy: {answer}")
                    # the previous arm's replicas go too: they would hold replica budget (a session copy may live
                    # minutes) that this arm's copies need
                    coord.post("/replicas/drop", {})
                    _wait_no_replicas(coord)
                    cell_router = None  # (--router-per-cell) this cell's own router process
                    if per_cell and base not in SMG_POLICY:
                        cell_router = Router(logs, keys, coordinator=coord, tokenizer=model_path(args.model),
                                             name=f"router-{arm.replace('@', '-')}-r{rnd}",
                                             extra_args=("--profile", args.profile, *router_flags(base)))
                        procs.append(cell_router)
                        cell_router.wait_http(cell_router.url + "/health", 120)
                    ours = cell_router.url if cell_router is not None else router_urls.get(base, router_url)
                    url, hints = ours, ours + "/kvrep/hints"
                    if base in SMG_POLICY:
                        smg = SmgRouter(SMG_POLICY[base], [w.url for w in workers], logs, workers[0].api_key)
                        procs.append(smg)
                        smg.wait_ready()
                        url, hints = smg.url, None
                    for j in range(1, fronts):
                        if base in SMG_POLICY:
                            front = SmgRouter(SMG_POLICY[base], [w.url for w in workers], logs, workers[0].api_key)
                        else:
                            front = Router(logs, keys, coordinator=coord, tokenizer=model_path(args.model),
                                           name=f"router-{arm}-{j}",
                                           extra_args=("--profile", args.profile, *router_flags(base)))
                        procs.append(front)
                        extra.append(front)
                    for front in extra:
                        if base in SMG_POLICY:
                            front.wait_ready()
                        else:
                            front.wait_http(front.url + "/health", 120)
                    before = {r["id"] for r in coord.get("/replications")[1]}
                    if wl is None:  # SGLang's own client: its text does not change per arm, so the caches go
                        flush_workers(workers)
                        t0 = time.monotonic()
                        reqs = sglclient.run(url, model_path(args.model), out_dir / f"sglang-{arm}-{rnd}.jsonl",
                                             args.seed + rnd, gsp, smg.api_key if smg is not None else None,
                                             logs / f"sglang-{arm}-{rnd}.log")
                        _wait_idle(coord)
                        reps = [r for r in coord.get("/replications")[1] if r["id"] not in before]
                        row = {"workload": wname, "arm": arm, "repeat": rnd, "client": "sglang",
                               "live": summarize(sglclient.results(reqs)), "replication": _replication_stats(reps),
                               "wall_s": time.monotonic() - t0, "replications": reps, "requests": reqs}
                        samples.setdefault((wname, arm), []).extend(q["ttft_s"] for q in reqs if q["error"] is None)
                        rows.append(row)
                        t = row["live"]["ttft_s"]
                        _say(f"{label}: TTFT mean {t['mean']:.2f} s, P99 {t['p99']:.2f} s, "
                             f"{row['replication']['count']} copies, {row['live']['errors']} errors "
                             f"({row['wall_s']:.0f} s)")
                        if smg is not None:
                            smg.stop()
                            procs.remove(smg)
                        for front in extra + ([cell_router] if cell_router is not None else []):
                            front.stop()
                            procs.remove(front)
                        continue
                    if args.flush_caches:  # every arm starts on empty caches, as the simulator's does
                        flush_workers(workers)
                    demoted_before = coord.get("/status")[1]["demotions"]
                    renderer = Renderer(tok, salt=zlib.crc32(
                        f"{args.seed}/{wname}/{arm}{f'/{rnd}' if rnd else ''}".encode()))
                    todo = copy.deepcopy(wl)
                    cfg = ReplayConfig(url=url, hints_url=hints, api_key=smg.api_key if smg is not None else None,
                                       more_urls=tuple(f.url for f in extra),
                                       hints_api_key=router.admin("write")["Authorization"].split(" ", 1)[1],
                                       on_done=_progress(label, workload_size(wl)["requests"]),
                                       request_id_prefix=f"{len(rows)}-")
                    t0 = time.monotonic()
                    cpu0, own0 = cpu_seconds(procs), os.times()
                    results = asyncio.run(replay(todo, renderer, cfg))
                    _wait_idle(coord)
                    cpu1, own1 = cpu_seconds(procs), os.times()
                    reps = [r for r in coord.get("/replications")[1] if r["id"] not in before]
                    row = {"workload": wname, "arm": arm, "repeat": rnd, "live": summarize(results),
                           "replication": _replication_stats(reps), "wall_s": time.monotonic() - t0,
                           "replications": reps,
                           "requests": [{"rid": r.rid, "kind": r.kind, "sent_s": round(r.sent_s, 3),
                                         "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                                         "ttft_s": None if math.isnan(r.ttft_s) else round(r.ttft_s, 3),
                                         "e2e_s": None if math.isnan(r.e2e_s) else round(r.e2e_s, 3),
                                         "output_tokens": r.output_tokens, "key": r.key, "error": r.error,
                                         "request_id": r.request_id}
                                        for r in results]}
                    # the CPU time every process used over the cell (s; a server's with its scheduler's), the client's
                    # (this process: the load generator) among them: what the testbed's workers share their cores with
                    door = (cell_router or smg or routers.get(base) or router).name  # the arm's front door
                    row["cpu_s"] = {**{("front_door" if k == door else k): round(cpu1[k] - cpu0[k], 3)
                                       for k in cpu1 if k in cpu0},
                                    "client": round(own1.user + own1.system - own0.user - own0.system, 3)}
                    if fronts > 1:
                        row["fronts"] = fronts
                    if base not in SMG_POLICY:
                        row["router_decisions"] = cell_decisions(cell_router or routers.get(base, router),
                                                                 cfg.request_id_prefix)
                        st = coord.get("/status")[1]
                        # what the planner learned of the sessions, and (shadow) the copies it would have made
                        row["sessions"] = st.get("sessions")
                        row["shadow_decisions"] = st.get("shadow_decisions")
                        row["hints"], row["coordinator_loop"] = st.get("hints"), st.get("loop")
                        # demotions of a moved session's old copies this arm (sent in active mode, counted in shadow)
                        row["demotions"] = {k: st["demotions"][k] - demoted_before[k] for k in ("sent", "shadow")}
                        # what the workers did with them so far (cumulative since the cluster started)
                        row["worker_demotions"] = {
                            wid: {k: (w.get("load") or {}).get(k) for k in
                                  ("demoted_chains", "demoted_evicted_tokens", "demotions_taken_back")}
                            for wid, w in coord.workers().items()}
                    if cfg.num_hints_refused:
                        _say(f"{label}: the router refused {cfg.num_hints_refused} hints")
                    errors = [r.error for r in results if r.error]
                    if errors:
                        _say(f"{label}: {len(errors)} errors, first: {errors[0]}")
                    samples.setdefault((wname, arm), []).extend(r.ttft_s for r in results if r.error is None)
                    if args.simulate and rnd == 0:  # deterministic: once is enough
                        to_simulate.append((row, wl, base, fronts))  # (`shadow@1`, an A/A arm: as `shadow`)
                    row["position"] = position  # its place in the round (`--arm-order`)
                    rows.append(row)
                    checkpoint(out_dir, rows)
                    t = row["live"]["ttft_s"]
                    _say(f"{label}: TTFT mean {t['mean']:.2f} s, P99 {t['p99']:.2f} s, "
                         f"{row['replication']['count']} copies ({row['wall_s']:.0f} s)")
                    if smg is not None:
                        smg.stop()
                        procs.remove(smg)
                    if cell_router is not None:
                        extra.append(cell_router)
                    if extra:
                        stop_all(extra)
                        for front in extra:
                            procs.remove(front)
        coord.post("/policy", {"policy": "kvrep", "mode": "shadow"})
    finally:
        stop_all(procs)
    machine = None
    if to_simulate:  # after the cluster stopped: the machine is measured on every round's requests
        machine = measure_machine(rows, speed, overlap=bool(getattr(args, "overlap_schedule", True)))
        _say("the simulator's machine: "
             + (describe_machine(machine) if machine else "the probe (too few requests ran alone)"))
        for row, wl, arm, fronts in to_simulate:
            row["sim"] = simulate(copy.deepcopy(wl), arm, args.workers, args.seed, args.profile,
                                  args.max_total_tokens, args.max_running, speed,
                                  endpoint_wait=getattr(args, "sim_endpoint_wait", True), machine=machine,
                                  prompt_reports=bool(getattr(args, "sim_prompt_reports", False)),
                                  speed_calibration=arm not in FIXED_SPEED_ARMS,
                                  tie_turns=arm not in LOWEST_ID_ARMS,
                                  overlap_lag=bool(getattr(args, "overlap_schedule", True)),
                                  sent_pages=arm not in NOSENT_ARMS, front_doors=fronts,
                                  door_sends_s=None if arm in NORELAY_ARMS else RELAY_LAG_S,
                                  tie_draws=arm not in NODRAW_ARMS)
    _ratios(rows)
    _add_cis(rows)
    claims = claim_ratios(rows)
    print()
    print(f"kvrep bench: {args.workers} CPU workers, model {args.model}, seed {args.seed}, "
          f"TTFT in seconds at the client ({time.monotonic() - t_start:.0f} s in all)")
    print(format_table(rows))
    from kvrep_dev.stats import LEVEL, RESAMPLES
    print(f"95% CI: bootstrap over the cell's requests ({RESAMPLES} resamples, fixed seed), level {LEVEL:.0%}")
    summary = summarize_rounds(rows) if args.repeats > 1 else None
    if summary:
        print()
        print(f"over {args.repeats} rounds (arms interleaved; ratios paired within a round):")
        print(format_summary(summary))
    if claims:
        print()
        print(format_claims(claims))
    front = front_door_ratios(rows)
    if front:
        print()
        print(format_front_doors(front))
    if args.simulate and workloads:
        print()
        print(validation_table(rows, args.profile))
    meta = {k: saved_arg(v) for k, v in vars(args).items() if k != "func"}
    with open(out_dir / "results.json", "w") as f:
        json.dump({"args": meta, "command": " ".join(sys.argv), "rows": rows, "summary": summary, "claims": claims,
                   "front_doors": front, "speed": speed, "machine": machine, "waiting_reports": WAITING_REPORTS,
                   "prefill_speed": PREFILL_SPEED, "ties": TIES, "sent_pages": SENT_PAGES, "peer_sends": PEER_SENDS,
                   "tie_draws": TIE_DRAWS,
                   "flushed": bool(args.flush_caches)},
                  f, indent=2,
                  default=str)
    (out_dir / CHECKPOINT).unlink(missing_ok=True)
    try:
        plot(rows, samples, out_dir / "ttft_cdf.png")
        print(f"\nresults: {out_dir / 'results.json'}   TTFT CDFs: {out_dir / 'ttft_cdf.png'}   logs: {logs}")
    except ImportError:
        print(f"\nresults: {out_dir / 'results.json'} (no matplotlib: no plot)   logs: {logs}")
    return 0 if all(r["live"]["errors"] == 0 for r in rows) else 1


def flush_workers(workers: list[Worker], wait_s: float = 30.0) -> None:
    """Empties every worker's prefix cache (SGLang's `/flush_cache`, with the workers' key). SGLang refuses (HTTP
    400) while a request is queued or running: asked again every 0.5 s for up to `wait_s`."""
    import urllib.error
    import urllib.request

    for w in workers:
        deadline = time.monotonic() + wait_s
        while True:
            req = urllib.request.Request(w.url + "/flush_cache", data=b"", method="POST", headers=w.headers)
            try:
                with urllib.request.urlopen(req, timeout=60):
                    break
            except urllib.error.HTTPError as e:
                if e.code != 400 or time.monotonic() >= deadline:
                    raise RuntimeError(f"{w.url}/flush_cache: HTTP {e.code}: {e.read()[:200]!r}") from None
            time.sleep(0.5)


def gsp_config(args) -> sglclient.GspConfig:
    """`--sgl-*` -> the SGLang client's generated-shared-prefix workload."""
    return sglclient.GspConfig(groups=args.sgl_groups, conversations=args.sgl_conversations, turns=args.sgl_turns,
                               system_len=args.sgl_system_len, question_len=args.sgl_question_len,
                               output_len=args.max_output, rate=args.sgl_rate)


def add_testbed_arguments(p) -> None:
    """The testbed's link cap and pinning (kvrep_dev/testbed.py), shared by `demo`, `bench` and `up`."""
    p.add_argument("--send-rate-mbps", type=float, default=None,
                   help="per-link cap on the data plane, MB/s (default: the one that gives --profile's model an "
                        "H200's copy/prefill time ratio, 0.21; 0: no cap)")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="pin worker i to core i (mod the cores this process may use)")
    p.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=False,
                   help="SGLang's overlap scheduler on the CPU workers (default off: on a CPU it holds a finished "
                        "prefill's first token until the next batch's forward ends, which a GPU does not; "
                        "kvrep_dev/testbed.py)")


def testbed_worker_kwargs(args, i: int) -> dict:
    """`Worker(...)` keyword arguments for worker `i` under the testbed's flags: its core, its link cap and the
    testbed's SGLang flags (`testbed.WORKER_ARGS`, unless `--overlap-schedule`)."""
    rate = testbed.send_rate_mbps(args.profile) if args.send_rate_mbps is None else args.send_rate_mbps
    extra = ("--kvrep-send-rate-mbps", f"{rate:g}") if rate > 0 else ()
    if not getattr(args, "overlap_schedule", False):
        extra += testbed.WORKER_ARGS
    return {"cpu": testbed.core_for(i) if args.pin else None, "extra_args": extra}


def add_arguments(p, *, demo: bool = False) -> None:
    p.add_argument("--workers", type=int, default=testbed.default_workers(),
                   help="CPU SGLang workers (default: one per core, each pinned to its core)")
    p.add_argument("--model", default=testbed.MODEL,
                   help="local model name (tiny|small|wide) or a model directory (default: the testbed's 'wide', "
                        "where a cache hit saves ~90%% of a cold prefill, as on a GPU: docs/testbed.md)")
    add_testbed_arguments(p)
    p.add_argument("--workloads", default="agent,fanout" if demo else ",".join(WORKLOADS),
                   help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--arms", default=",".join(DEMO_ARMS) if demo else ",".join(DEFAULT_ARMS),
                   help=f"comma-separated, from {', '.join(ARMS)}; ARM@N: the arm behind N front doors (ours: N "
                        f"routers on the coordinator's one directory; smg: N gateways), requests spread in turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flush-caches", action=argparse.BooleanOptionalAction, default=True,
                   help="empty every worker's prefix cache before each arm (SGLang's /flush_cache), so that every arm "
                        "starts from the same state, as in the simulator (--no-flush-caches: each arm starts on the "
                        "caches the arm before left, as before stop 50; SGLang's own client always flushes)")
    p.add_argument("--arm-order", choices=("fixed", "shuffled", "balanced"), default="fixed",
                   help="the arms' order in each round: as given; shuffled per round (seeded): no arm always "
                        "runs after the same one; or balanced (a Williams design, seeded): over every n rounds (2n "
                        "for an odd n of arms) each arm runs in each place and right after each other arm equally "
                        "often")
    p.add_argument("--router-per-cell", action=argparse.BooleanOptionalAction, default=True,
                   help="serve each of our arms' cells from a router process of its own, started before the cell and "
                        "stopped after it, as smg's gateway is (--no-router-per-cell: one long-lived router per "
                        "router configuration, shared by the arms that use it, as before stop 51)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every arm (interleaved); > 1 adds medians and ranges over the rounds")
    p.add_argument("--duration-s", type=float, default=30.0, help="arrivals (or session starts) within this time")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Claude Code session files for `agent`")
    p.add_argument("--agent-rate", type=float, default=0.3, help="agent sessions started per second")
    p.add_argument("--max-turns", type=int, default=6, help="requests per agent session at most")
    p.add_argument("--fanout-rate", type=float, default=1.2, help="fan-out requests/s (trees/s x (K+1))")
    p.add_argument("--fanout-k", type=int, default=6)
    p.add_argument("--fanout-trunk", type=int, default=1024, help="shortest trunk, tokens (up to twice as long)")
    p.add_argument("--flash-rate", type=float, default=2.0,
                   help="flash-crowd requests/s, mean over the run (the peak, held over the second half, is 4/3 of it)")
    p.add_argument("--flash-prefix", type=int, default=2048, help="flash crowd: the hot prefix, tokens")
    p.add_argument("--shared-rate", type=float, default=1.0, help="shared/unique requests per second")
    d = sglclient.GspConfig()
    p.add_argument("--client", choices=CLIENTS, default=CLIENTS[0],
                   help="load generator: ours (kvrep), SGLang's `python -m sglang.benchmark.serving` (multi-turn "
                        "generated-shared-prefix over the chat API, workload sgl-gsp), or both")
    p.add_argument("--sgl-groups", type=int, default=d.groups, help="sglang client: shared system prompts")
    p.add_argument("--sgl-conversations", type=int, default=d.conversations,
                   help="sglang client: conversations per system prompt")
    p.add_argument("--sgl-turns", type=int, default=d.turns, help="sglang client: turns per conversation")
    p.add_argument("--sgl-system-len", type=int, default=d.system_len, help="sglang client: system prompt, tokens")
    p.add_argument("--sgl-question-len", type=int, default=d.question_len, help="sglang client: question, tokens")
    p.add_argument("--sgl-rate", type=float, default=d.rate, help="sglang client: requests/s")
    p.add_argument("--max-prompt", type=int, default=3072, help="live prompts cut at this many tokens")
    p.add_argument("--max-output", type=int, default=8, help="output tokens per request at most")
    p.add_argument("--max-total-tokens", type=int, default=32768, help="KV pool per worker, tokens")
    p.add_argument("--max-running", type=int, default=8, help="--max-running-requests per worker")
    p.add_argument("--simulate", action=argparse.BooleanOptionalAction, default=not demo,
                   help="also run the simulator on the same workloads (its router and planner pricing with "
                        "--profile, its machine the testbed as measured on the run's own lone requests)")
    p.add_argument("--profile", default=testbed.PROFILE,
                   help="cost profile of the coordinator's planner and the router's TTFT rule (default: cpu-wide, "
                        "measured on the testbed)")
    p.add_argument("--out-dir", default="logs/demo" if demo else "logs/bench")
    if not demo:
        p.add_argument("--resimulate", metavar="RESULTS_JSON",
                       help="no cluster: re-run the simulator on a saved run's workloads (results.json, or .json.gz "
                            "as in bench/results/) and compare with its live measurements")
        p.add_argument("--claims", metavar="RESULTS_JSON",
                       help="no cluster: print the claim ratios of a saved run (results.json or .json.gz), "
                            "recomputed from its requests")
        p.add_argument("--sim-machine", default=SIM_MACHINE_FIT,
                       help="with --resimulate: what the simulator's engine runs on: 'fit' (default): prefill terms "
                            "fitted to the run's own requests that ran alone (too few: cpu-wide-bench at the run's "
                            "speed); a profile (name or JSON path): its prefill terms at the run's measured speed; "
                            "'probe': the --profile the run priced with, scaled by its speed probe")
        p.add_argument("--sim-prompt-reports", action=argparse.BooleanOptionalAction, default=None,
                       help="the simulated workers report waiting prompts whole, as the live agents did before "
                            "stop 40 (--no-sim-prompt-reports: their uncached tokens, as they do now; default: as "
                            "the run's agents did, saved with it)")
        p.add_argument("--sim-cores", type=int, default=None,
                       help="with --resimulate: the workers share this many cores (default: this machine's)")
        p.add_argument("--sim-frontend-cpu", action="store_true",
                       help="with --resimulate: each request's CPU in the router, coordinator, SGLang's HTTP and "
                            "detokenizer processes and the client runs on the workers' cores (measured: "
                            "kvrep_dev.testbed.FRONTEND_CPU_S; default: not modelled)")
        p.add_argument("--sim-endpoint-wait", action=argparse.BooleanOptionalAction, default=True,
                       help="the simulator's copies start between scheduler iterations at both ends, as the live "
                            "agents' (--no-sim-endpoint-wait: pages move during iterations, the model before)")
