"""`scripts/sim_gap.py` (the analysis behind docs/simulator.md's round 5): its parts add up."""
import importlib.util
import re
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sim_gap.py"


def load():
    spec = importlib.util.spec_from_file_location("sim_gap", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_routes_and_paired_excess_add_up():
    mod = load()
    args = mod.build_parser().parse_args(["--generator", "agent", "--rate", "30", "--duration-s", "60",
                                          "--workers", "4"])
    kv, page_len = mod.run_policy(args, "kvrep")
    oracle, _ = mod.run_policy(args, "free_copies")
    assert kv and page_len == 64
    assert all(d.route in ("plain", "inflight", "pull") for d in kv.values())
    assert all(d.copy_wait_s == 0.0 for d in oracle.values() if d.route == "plain")
    lines = mod.policy_report("kvrep", kv)
    n = int(re.match(r"kvrep: (\d+) requests", lines[0]).group(1))
    routed = sum(int(m.group(1)) for m in (re.match(r"\s+routed \w+\s+(\d+)", x) for x in lines) if m)
    turns = sum(int(m.group(1)) for m in (re.match(r"\s+(?:first turns|follow-ups)\s+(\d+)", x) for x in lines) if m)
    assert n == routed == turns == len(kv)
    pair = mod.pair_report("kvrep", kv, "free_copies", oracle, page_len, 3)
    common = [k for k in kv if k in oracle]
    total = sum(kv[k].ttft_s - oracle[k].ttft_s for k in common)
    parts = [float(re.search(r"excess\s+(-?[\d.]+) s", x).group(1)) for x in pair[1:3]]
    assert abs(sum(parts) - total) < 0.1
    assert len(pair) == 3 + min(3, len(common))


def test_engine_flags_reach_the_engine():
    # the script takes `kvrep sim`'s engine flags (T-LRU here) and runs with them, not with the defaults
    mod = load()
    args = mod.build_parser().parse_args(["--generator", "agent", "--rate", "30", "--duration-s", "20", "--workers",
                                          "4", "--eviction", "tlru", "--tlru-threshold", "4096"])
    assert args.seed == 1 and args.policies == "kvrep,free_copies"
    cfg = mod.engine_config(args, args.duration_s)
    assert cfg.eviction == "tlru" and cfg.tlru_threshold_tokens == 4096 and cfg.num_workers == 4
