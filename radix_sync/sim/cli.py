"""`kvrep sim`: run named policies over a trace or a generator and print/save the comparison.

`radix_sync.cli` wires `add_arguments` and `run` under `kvrep sim`; `python -m radix_sync.sim` does the same
stand-alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

from radix_sync.policy.cost import list_profiles, load_profile
from radix_sync.policy.planner import PlannerConfig
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.engine import Engine
from radix_sync.sim.generators import GENERATORS, GeneratorConfig
from radix_sync.sim.metrics import format_table
from radix_sync.sim.policies import POLICIES, build_policy
from radix_sync.sim.seeds import format_seed_table, summarize_seeds
from radix_sync.sim.workload import Workload, load_trace

DEFAULT_POLICIES = "round_robin,least_load,cache_aware,cost,pull,e2,kvrep,kvrep_shadow,oracle"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the simulator's flags to `parser`."""
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--out", help="write results JSON here")
    parser.add_argument("--plot", help="write a PNG of the TTFT CDFs here (needs matplotlib)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal)")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the flags that choose the workload, the cluster size, the profile and the policies (read by
    `build_workload`; also used by the analysis scripts)."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake JSONL, Azure CSV, or a directory of Claude Code session files")
    src.add_argument("--generator", choices=sorted(GENERATORS), help="synthetic workload")
    parser.add_argument("--workers", type=int, default=EngineConfig.num_workers,
                        help="number of workers (default %(default)s)")
    parser.add_argument("--profile", default="llama3.1-8b-h200",
                        help=f"cost profile name or JSON path (shipped: {', '.join(list_profiles())})")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help=f"comma-separated, from: {', '.join(POLICIES.names())}")
    parser.add_argument("--front-doors", type=int, default=1, metavar="N",
                        help="every policy behind N routers of its kind, the k-th request through door k mod N "
                             "(a fleet's gateways behind a load balancer; default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", default=None, metavar="S1,S2,...",
                        help="run every policy once per seed and report mean and 95%% CI per figure "
                             "(overrides --seed)")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests/s (arrival traces, generators) or sessions/s (session traces)")
    parser.add_argument("--duration-s", type=float, default=None, help="stop issuing requests after this time")
    parser.add_argument("--arrival", choices=("poisson", "bursty"), default=None,
                        help="arrival process of sessions / generated requests")
    parser.add_argument("--max-turns", type=int, default=None, help="cap requests per trace session")
    parser.add_argument("--fanout-k", type=int, default=GeneratorConfig.fanout_k,
                        help="branches per tree (fanout generator; default %(default)s)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the flags of the simulated cluster's mechanics (read by `engine_config`); each default is the
    `EngineConfig` field's."""
    parser.add_argument("--tick-s", type=float, default=EngineConfig.tick_s,
                        help="planner period, s (default %(default)s)")
    parser.add_argument("--door-sends-s", type=float, default=EngineConfig.door_sends_s, metavar="S",
                        help="with --front-doors N > 1: each door learns the other doors' sends S seconds after "
                             "(default: never, as live routers started with --no-peer-sends; they relay by "
                             "default since stop 57, measured 2-3 ms: 0.003)")
    parser.add_argument("--ledger-holdout", type=float, default=EngineConfig.ledger_holdout, metavar="F",
                        help="the coordinator's copy ledger: hold out this share of the planner's prefixes and "
                             "pause the planner while its copies are shown to cost (live default 0.2; "
                             "default here %(default)s: off)")
    parser.add_argument("--shared-cores", type=int, default=EngineConfig.shared_cores,
                        help="the workers share this many CPU cores (processor sharing; a local CPU cluster). "
                             "0: each worker has its own device")
    parser.add_argument("--overlap-lag", action="store_true", default=EngineConfig.overlap_lag,
                        help="SGLang's overlap scheduler on a synchronous device (CPU): outputs go out when the "
                             "next iteration ends")
    parser.add_argument("--eviction", choices=("lru", "tlru"), default=EngineConfig.eviction,
                        help="the workers' radix-cache eviction, as SGLang's --radix-eviction-policy (default "
                             "%(default)s)")
    parser.add_argument("--tlru-threshold", type=int, default=EngineConfig.tlru_threshold_tokens,
                        help="T-LRU: tokens a next prompt may leave uncached (SGLang's threshold)")
    parser.add_argument("--tlru-next-prompt", type=int, default=EngineConfig.tlru_next_prompt_tokens,
                        help="T-LRU: tokens a conversation's next prompt adds (SGLang's next_prompt_estimate)")
    parser.add_argument("--nic-gbytes-s", type=float, default=None, metavar="X",
                        help="override the profile's per-NIC bandwidth, GB/s (1e9 bytes/s)")
    parser.add_argument("--view-staleness-s", type=float, default=EngineConfig.view_staleness_s, metavar="S",
                        help="load reports this far apart, as live (default %(default)s s; 0: exact views)")
    parser.add_argument("--hint-jitter", type=float, default=EngineConfig.hint_jitter, metavar="SIGMA",
                        help="log-normal error of fan-out hints' lead time and branch count (default %(default)s; 0: "
                             "exact)")
    parser.add_argument("--endpoint-wait", action="store_true", default=EngineConfig.endpoint_wait,
                        help="a copy starts only after the iterations in progress at its source and target (as the "
                             "live agents gather and install between scheduler iterations); the routers and the "
                             "planner price that wait")
    parser.add_argument("--host-tier", type=float, default=EngineConfig.host_tier_ratio, metavar="RATIO",
                        help="every worker gets a host-memory KV tier, SGLang's hierarchical cache with "
                             "--hicache-ratio RATIO (its default when enabled: 2.0); 0: none (default)")
    parser.add_argument("--host-tier-unpriced", action="store_true",
                        help="the policies do not see the host tiers (the workers still use them): the ablation")
    parser.add_argument("--host-gbytes-s", type=float, default=EngineConfig.host_load_bytes_per_s / 1e9, metavar="X",
                        help="the host tier's load-back rate, GB/s (default %(default)s)")
    parser.add_argument("--planner", default="", metavar="KEY=VALUE,...",
                        help="override PlannerConfig fields of the kvrep policies (numbers and booleans), "
                             "e.g. min_gain_s=0.01,horizon_s=60")


def analysis_parser(description: str, default_policies: str) -> argparse.ArgumentParser:
    """A parser with the workload and engine flags, seed 1 by default (for the analysis scripts, `scripts/sim_*`)."""
    parser = argparse.ArgumentParser(description=description)
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    parser.set_defaults(seed=1, policies=default_policies)
    return parser


def planner_config(spec: str, endpoint_wait: bool = False) -> PlannerConfig:
    """Returns: `PlannerConfig` with the `KEY=VALUE,...` overrides of `spec` (ValueError on an unknown key, a
    field that is not a number or a boolean, or a value the config rejects); `endpoint_wait` (`--endpoint-wait`)
    sets the field of that name, so the routers and the planner price the wait the engine then makes."""
    fields = {f.name: f for f in dataclasses.fields(PlannerConfig)}
    default = PlannerConfig()
    kw: dict = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ValueError(f"--planner: {item!r} is not KEY=VALUE with KEY one of {', '.join(fields)}")
        kind = type(getattr(default, key))
        try:
            if kind is bool:
                if value.strip().lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                kw[key] = value.strip().lower() in ("true", "1")
            elif kind in (int, float):
                kw[key] = kind(value)
                if not math.isfinite(kw[key]):
                    raise ValueError(f"{value!r} is not finite")
            else:
                raise ValueError(f"{key} is a {kind.__name__}; only numbers and booleans can be set here")
        except ValueError as e:
            raise ValueError(f"--planner: bad value for {key}: {e}") from None
    if endpoint_wait:
        kw["endpoint_wait"] = True
    return PlannerConfig(**kw)


def engine_config(args: argparse.Namespace, duration_s: float) -> EngineConfig:
    """Returns: the engine configuration the flags of `add_engine_arguments` describe (ValueError if invalid)."""
    return EngineConfig(num_workers=args.workers, duration_s=duration_s, tick_s=args.tick_s,
                        shared_cores=args.shared_cores, overlap_lag=args.overlap_lag, eviction=args.eviction,
                        tlru_threshold_tokens=args.tlru_threshold, tlru_next_prompt_tokens=args.tlru_next_prompt,
                        view_staleness_s=args.view_staleness_s, hint_jitter=args.hint_jitter,
                        door_sends_s=args.door_sends_s, ledger_holdout=args.ledger_holdout,
                        endpoint_wait=args.endpoint_wait, host_tier_ratio=args.host_tier,
                        host_load_bytes_per_s=args.host_gbytes_s * 1e9, host_tier_priced=not args.host_tier_unpriced)


def build_workload(args: argparse.Namespace, max_context_len: int) -> Workload:
    """Returns: the workload the flags describe."""
    if args.trace:
        return load_trace(args.trace, args.rate, args.duration_s, max_context_len, args.seed,
                          args.arrival or "poisson", args.max_turns)
    if args.rate is None or args.duration_s is None:
        raise ValueError("--generator needs --rate and --duration-s")
    cfg = GeneratorConfig(fanout_k=args.fanout_k)
    cls = GENERATORS[args.generator]
    default_arrival = "bursty" if args.generator == "shared-prefix" else "poisson"
    return cls(cfg, args.rate, args.duration_s, args.seed, max_context_len, args.arrival or default_arrival)


def _progress_bar(name: str, end_s: float):
    def report(t: float) -> None:
        frac = min(1.0, t / end_s) if end_s > 0 else 1.0
        n = int(30 * frac)
        sys.stderr.write(f"\r{name:<14}[{'#' * n}{'.' * (30 - n)}] {t:8.1f}s")
        sys.stderr.flush()
    return report


def parse_seeds(spec: str) -> list[int]:
    """Returns: the seeds of `--seeds` (ValueError if empty, not integers, or repeated)."""
    try:
        seeds = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds: {spec!r} is not a comma-separated list of integers") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: {spec!r} must name at least one seed, each once")
    return seeds


def cli_profile(args: argparse.Namespace):
    """Returns: the cost profile the flags name, with `--nic-gbytes-s` applied (ValueError if invalid)."""
    profile = load_profile(args.profile)
    nic = getattr(args, "nic_gbytes_s", None)
    if nic is not None:
        if not (math.isfinite(nic) and nic > 0):
            raise ValueError(f"--nic-gbytes-s={nic!r} must be > 0")
        profile = dataclasses.replace(profile, nic_bandwidth_bytes_per_s=nic * 1e9)
    return profile


def run(args: argparse.Namespace) -> int:
    """Runs every requested policy on the same workload (once per seed with `--seeds`). Returns: the exit status."""
    if getattr(args, "seeds", None):
        return _run_seeds(args)
    try:
        profile = cli_profile(args)
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        for n in names:
            if n not in POLICIES.names():
                raise ValueError(f"unknown policy {n!r}; known: {', '.join(POLICIES.names())}")
        if args.front_doors < 1:
            raise ValueError(f"--front-doors {args.front_doors} must be >= 1")
        probe = build_workload(args, profile.max_context_len)
        last = max([r.arrival_s for r in probe.open_requests] + [t for t, _ in probe.session_starts] + [0.0])
        duration = args.duration_s if args.duration_s is not None else last + 1.0
        ecfg = engine_config(args, duration)
        pcfg = planner_config(args.planner, args.endpoint_wait)
    except (ValueError, OSError) as e:
        print(f"kvrep sim: {e}", file=sys.stderr)
        return 2
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    results = []
    samples = {}
    for name in names:
        wl = probe if not results else build_workload(args, profile.max_context_len)
        policy = build_policy(name, profile, wl.page_len, args.seed, pcfg, args.front_doors)
        t0 = time.perf_counter()
        eng = Engine(profile, wl, policy, ecfg, _progress_bar(name, duration) if show else None)
        stats = eng.run()
        wall = time.perf_counter() - t0
        if show:
            sys.stderr.write("\n")
        rec = stats.to_dict()
        rec["wall_s"] = wall
        if eng.demotion_gate is not None:
            rec["demotion_gate"] = eng.demotion_gate.status()
        if eng.calibration is not None:
            rec["copy_use"] = eng.calibration.status()
        samples[name] = stats.ttft_s
        results.append(rec)
    print(format_table(results))
    for rec in results:
        if "demotion_gate" in rec:
            g = rec["demotion_gate"]
            print(f"demotion gate of {rec['policy']}: {'open' if g['open'] else 'closed'} at the end, moved sessions "
                  f"came back {g['returned']} of {g['returned'] + g['moved_on']} controls (rate {g['return_rate']}); "
                  f"{g['sent']} of {g['decided']} demotions sent")
        f = rec["ttft_floor_s"]
        print(f"TTFT floor of {rec['policy']} (TtftFloor: no policy can go below it on these requests): mean "
              f"{f['mean']:.3f} s, P99 {f['p99']:.3f} s")
        if rec.get("host_hit_rate"):
            print(f"host tier of {rec['policy']}: {100 * rec['host_hit_rate']:.1f}% of prompt tokens loaded back")
        if "copy_use" in rec:
            kinds = rec["copy_use"]["kinds"]
            print(f"copy use of {rec['policy']} (used / predicted -> factor): " + (", ".join(
                f"{k} {v['used']} / {v['predicted']}" + (f" (requests {v['requests_seen']} / {v['requests_predicted']})"
                                                         if "requests_seen" in v else "") + f" -> {v['factor']}"
                for k, v in sorted(kinds.items())) or "none"))
    args.results = results
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k not in ("func", "results")}
        with open(args.out, "w") as f:
            json.dump({"args": meta, "profile": profile.name, "results": results}, f, indent=2)
    if args.plot:
        from radix_sync.sim.plot import plot_ttft_cdf
        plot_ttft_cdf(results, args.plot, samples)
    return 0


def _run_seeds(args: argparse.Namespace) -> int:
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as e:
        print(f"kvrep sim: {e}", file=sys.stderr)
        return 2
    runs: dict[int, list[dict]] = {}
    for seed in seeds:
        one = argparse.Namespace(**{**vars(args), "seed": seed, "seeds": None, "out": None, "plot": None})
        print(f"seed {seed}:")
        status = run(one)
        if status:
            return status
        runs[seed] = one.results
    summary = summarize_seeds(runs)
    print(format_seed_table(summary, len(seeds)))
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k not in ("func", "results")}
        with open(args.out, "w") as f:
            json.dump({"args": meta, "profile": cli_profile(args).name, "seeds": seeds,
                       "runs": {str(s): r for s, r in runs.items()}, "summary": summary}, f, indent=2)
    return 0
