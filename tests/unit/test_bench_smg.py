"""The live baseline arms: smg 1.13 with its own defaults, and the simulator's model of each arm."""
import dataclasses

from smg.launch_router import parse_router_args
from smg.router_args import RouterArgs

from kvrep_dev.bench import ARMS, BASELINE, SIM_POLICY, SMG_POLICY, smg_argv

RUN_ONLY = {"host", "port", "worker_urls", "policy", "log_level", "prometheus_port", "api_key"}
"""What the bench may set: where smg listens and logs, which workers, which policy, the workers' key."""


def test_the_smg_arms_run_smg_on_its_defaults():
    defaults = RouterArgs()
    for arm, policy in SMG_POLICY.items():
        argv = smg_argv(policy, ["http://127.0.0.1:1", "http://127.0.0.1:2"], 3, 4, "k")
        assert argv[1:3] == ["-m", "smg.launch_router"]
        parsed = parse_router_args(argv[3:])  # smg's own parser
        changed = {f.name for f in dataclasses.fields(RouterArgs)
                   if getattr(parsed, f.name) != getattr(defaults, f.name)}
        assert changed <= RUN_ONLY, changed - RUN_ONLY
        assert parsed.policy == policy and parsed.worker_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        assert parsed.api_key == "k" and parsed.port == 3
        if policy == "cache_aware":  # its tuning untouched
            for name in ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "eviction_interval_secs",
                         "max_tree_size"):
                assert getattr(parsed, name) == getattr(defaults, name), name
    assert "--api-key" not in smg_argv("round_robin", [], 3, 4)


def test_the_smg_cache_aware_arm_is_simulated_with_smg_1_13s_rule():
    assert BASELINE == "smg-ca" and BASELINE in ARMS
    assert SMG_POLICY == {"smg-rr": "round_robin", "smg-ca": "cache_aware"}
    assert SIM_POLICY["smg-ca"] == "cache_aware" and SIM_POLICY["smg-rr"] == "round_robin"
    # runs saved with sglang-router 0.3.2 (bench/results/) keep their own model
    assert SIM_POLICY["sgl-ca"] == "cache_aware_v03"
    assert all(a in SIM_POLICY for a in ARMS)
