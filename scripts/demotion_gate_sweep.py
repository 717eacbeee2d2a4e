"""The demotion gate's settings in the simulator: `kvrep` (or another demoting policy) per seed with the gate off
(`none`, as `kvrep_ungated`) and at each (max return rate, one control in N) given, printing P99, mean and the
gate's end state (return rate, demotions sent of decided). The numbers behind `DemotionGateConfig`'s defaults
(docs/bench.md, "The demotion gate").

    python scripts/demotion_gate_sweep.py --gates none,0.25/4,0.35/4,0.5/4,0.4/16,0.5/16 --seeds 1,2,3 \\
        -- --generator agent --rate 100 --duration-s 300

Everything after `--` is `kvrep sim`'s workload and engine arguments.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radix_sync.policy.demotion import DemotionGateConfig  # noqa: E402
from radix_sync.sim import cli  # noqa: E402
from radix_sync.sim.engine import Engine  # noqa: E402
from radix_sync.sim.policies import build_policy  # noqa: E402


def gate_of(spec: str):
    """`none`, or `RATE/EVERY` (max return rate, one control in EVERY while open)."""
    if spec == "none":
        return None
    rate, every = spec.split("/")
    return DemotionGateConfig(max_return_rate=float(rate), control_every=int(every))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, sim_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gates", default="none,0.4/16")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--policy", default="kvrep")
    args = ap.parse_args(ours)
    sim_parser = argparse.ArgumentParser()
    cli.add_arguments(sim_parser)
    for spec in args.gates.split(","):
        gate = gate_of(spec)
        cells = []
        for seed in [int(x) for x in args.seeds.split(",")]:
            sa = sim_parser.parse_args([*sim_args, "--seed", str(seed), "--policies", args.policy])
            profile = cli.cli_profile(sa)
            wl = cli.build_workload(sa, profile.max_context_len)
            policy = replace(build_policy(args.policy, profile, wl.page_len, seed,
                                          cli.planner_config(sa.planner, sa.endpoint_wait)), demotion_gate=gate)
            eng = Engine(profile, wl, policy, cli.engine_config(sa, sa.duration_s), None)
            ttft = eng.run().to_dict()["ttft_s"]
            g = eng.demotion_gate.status() if eng.demotion_gate is not None else None
            cells.append(f"seed {seed}: P99 {ttft['p99']:.3f} mean {ttft['mean']:.3f}"
                         + (f" rate {g['return_rate']} sent {g['sent']}/{g['decided']}" if g else ""))
        print(f"{args.policy} gate {spec}: " + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
