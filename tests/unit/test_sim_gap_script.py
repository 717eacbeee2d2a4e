"""`scripts/sim_gap.py` (the analysis behind docs/simulator.md's round 5): its parts add up."""
import argparse
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
    args = argparse.Namespace(trace=None, generator="agent", rate=30.0, duration_s=60.0, seed=1, workers=4,
                              profile="llama3.1-8b-h200", fanout_k=8, arrival=None, max_turns=None)
    kv, page_len = mod.run_policy(args, "kvrep")
    oracle, _ = mod.run_policy(args, "oracle")
    assert kv and page_len == 64
    assert all(d.route in ("plain", "inflight", "pull") for d in kv.values())
    assert all(d.copy_wait_s == 0.0 for d in oracle.values() if d.route == "plain")
    lines = mod.policy_report("kvrep", kv)
    n = int(re.match(r"kvrep: (\d+) requests", lines[0]).group(1))
    routed = sum(int(m.group(1)) for m in (re.match(r"\s+routed \w+\s+(\d+)", x) for x in lines) if m)
    turns = sum(int(m.group(1)) for m in (re.match(r"\s+(?:first turns|follow-ups)\s+(\d+)", x) for x in lines) if m)
    assert n == routed == turns == len(kv)
    pair = mod.pair_report("kvrep", kv, "oracle", oracle, page_len, 3)
    common = [k for k in kv if k in oracle]
    total = sum(kv[k].ttft_s - oracle[k].ttft_s for k in common)
    parts = [float(re.search(r"excess\s+(-?[\d.]+) s", x).group(1)) for x in pair[1:3]]
    assert abs(sum(parts) - total) < 0.1
    assert len(pair) == 3 + min(3, len(common))
