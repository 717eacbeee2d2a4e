"""`scripts/sim_tail.py` (the analysis behind docs/simulator.md's round 3): its kinds add up to the tail."""
import importlib.util
import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sim_tail.py"


def test_tail_kinds_add_up_to_the_tail():
    spec = importlib.util.spec_from_file_location("sim_tail", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.build_parser().parse_args(["--generator", "agent", "--rate", "20", "--duration-s", "60",
                                          "--workers", "4"])
    report = mod.tail_report(args, "kvrep")
    head, *kinds = report.splitlines()
    m = re.match(r"kvrep: (\d+) requests, TTFT mean [\d.]+ s, P99 [\d.]+ s; (\d+) requests >= 0.9 x P99:", head)
    assert m, head
    rows = [line for line in kinds if not line.strip().startswith("tail per worker")]
    counts = [int(re.match(r"\s+(first turn or no session|history cached|history partly lost)\s+(\d+)\s+TTFT",
                           line).group(2)) for line in rows]
    assert counts and sum(counts) == int(m.group(2)) <= int(m.group(1))
