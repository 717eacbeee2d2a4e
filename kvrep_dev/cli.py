"""The developer subcommands of `kvrep`: `demo`, `bench`, `copy-demo`, `up`. Registered with the `kvrep` command
line through the `kvrep.commands` entry-point group (see pyproject.toml), so the torch-free `radix_sync` package
never imports this one."""
from __future__ import annotations


def _add_demo_and_bench(sub) -> None:
    from kvrep_dev import bench

    p = sub.add_parser("demo", help="CPU workers (one per core): agent sessions and a tree-search fan-out through our "
                                    "router (shadow: routing alone, pull, active replication) and smg 1.13 "
                                    "cache_aware; table with bootstrap CIs + TTFT CDF PNG")
    bench.add_arguments(p, demo=True)
    p.set_defaults(func=_run_bench)

    p = sub.add_parser("bench", help="live benchmark: our router (shadow, pull, active) and smg 1.13 (round_robin, "
                                     "cache_aware) on the same workloads and cluster; simulator validation")
    bench.add_arguments(p)
    p.set_defaults(func=_run_bench)

    p = sub.add_parser("copy-demo", help="two CPU workers: replicate a prefix A->B, time it, compare TTFT on B")
    p.add_argument("--model", default="small", help="tiny | small | a model directory")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--logs", default="logs/copy-demo", help="folder for per-process logs")
    p.set_defaults(func=_run_copy_demo)


def _stoppable(run, args, *, on_signal: int | None = None) -> int:
    """Runs a command so that Ctrl-C or SIGTERM stops it at once at any point (start-up included): the signal
    unwinds the command, whose `finally` stops every process it started. Exit status 128 + signal number, or
    `on_signal` where a signal is the normal way to end the command (`kvrep up`)."""
    from kvrep_dev.cluster import Stopped, running, stop_all, stop_on_signals

    try:
        with stop_on_signals():
            return run(args)
    except Stopped as stopped:
        print(f"[kvrep] {stopped}: stopped", flush=True)
        return 128 + stopped.signum if on_signal is None else on_signal
    finally:
        # what the command's own clean-up missed (a process the signal caught between its start and the
        # command's list); SIGINT/SIGTERM are ignored from the first one on, so this is not interrupted
        left = running()
        if left:
            stop_all(left)


def _run_bench(args) -> int:
    from kvrep_dev.bench import run_bench

    return _stoppable(run_bench, args)


def _run_copy_demo(args) -> int:
    from kvrep_dev.demo import run_demo

    return _stoppable(run_demo, args)


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="start a local cluster: coordinator, N SGLang workers, the router")
    from kvrep_dev import testbed
    from kvrep_dev.bench import add_testbed_arguments

    p.add_argument("--workers", type=int, default=testbed.default_workers(), help="default: one per core, pinned")
    p.add_argument("--model", default=testbed.MODEL, help="tiny | small | wide (the testbed's) | a model directory")
    p.add_argument("--router-port", type=int, default=0, help="0: any free port")
    p.add_argument("--pull", action="store_true",
                   help="the router copies a missing prefix on the request's path when that is fastest")
    p.add_argument("--admin-port", type=int, default=0, help="coordinator admin port (0: any free port)")
    p.add_argument("--policy", default="kvrep", choices=["kvrep", "rules", "none"])
    p.add_argument("--mode", default="active", choices=["active", "shadow"])
    p.add_argument("--tenants", default=None, help="JSON or TOML file: api keys -> tenant -> namespace")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--profile", default=testbed.PROFILE,
                   help="cost profile of the planner and the router (cpu-wide: measured on the testbed here)")
    add_testbed_arguments(p)
    p.add_argument("--logs", default="logs/up", help="folder for per-process logs")
    p.set_defaults(func=_run_up)


def _run_up(args) -> int:
    from kvrep_dev.up import run_up

    return _stoppable(run_up, args, on_signal=0)


def add_commands(sub) -> None:
    """Adds the commands when the worker side is installed (they start SGLang servers); absent otherwise."""
    from importlib.util import find_spec

    if find_spec("sglang") is None:
        return
    _add_demo_and_bench(sub)
    _add_up(sub)
