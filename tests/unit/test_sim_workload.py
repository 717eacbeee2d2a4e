"""Trace formats are recognised by content from any path; loaders keep prefixes and cut long prompts."""

import gzip
import json
import subprocess
import sys

import pytest

from radix_sync.sim.workload import detect_format, load_trace


def test_mooncake_by_content(tmp_path):
    p = tmp_path / "anything.txt"
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [1, 4]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert detect_format(p) == "mooncake"
    wl = load_trace(str(p), rate=None, duration_s=None, max_context_len=10_000, seed=0)
    assert [(r.arrival_s, r.prompt_len, r.pages) for r in wl.open_requests] == [(0.0, 1100, [1, 2]), (2.0, 600, [1])]
    wl = load_trace(str(p), rate=0.5, duration_s=None, max_context_len=1000, seed=0)  # 2 req at 0.5/s: 4 s
    assert [r.arrival_s for r in wl.open_requests] == [0.0, 4.0]
    assert wl.open_requests[0].prompt_len == 995 and wl.open_requests[0].pages == [1]


def test_azure_by_content(tmp_path):
    p = tmp_path / "trace.data"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,130,10\n"
                 "2023-11-16 18:17:04.9799600,64,8\n")
    assert detect_format(p) == "azure"
    wl = load_trace(str(p), None, None, 10_000, 0)
    assert [(round(r.arrival_s, 6), r.prompt_len, len(r.pages)) for r in wl.open_requests] == [(0.0, 130, 2),
                                                                                              (1.0, 64, 1)]
    assert set(wl.open_requests[0].pages).isdisjoint(wl.open_requests[1].pages)


def test_claude_sessions_namespaced_and_subagents_inlined(tmp_path):
    d = {"id": "x", "block_size": 64, "requests": [
        {"t": 0, "type": "n", "in": 130, "out": 5, "hash_ids": [1, 2], "stop": "tool_use", "think_time": 0},
        {"t": 9, "type": "subagent", "requests": [
            {"t": 9, "type": "n", "in": 64, "out": 3, "hash_ids": [7], "stop": "end_turn", "think_time": 1.0}]},
        {"t": 20, "type": "n", "in": 200, "out": 5, "hash_ids": [1, 2, 3], "stop": "end_turn", "think_time": 4.0}]}
    with gzip.open(tmp_path / "s.json.gz", "wt") as f:
        json.dump(d, f)
    assert detect_format(tmp_path) == "claude"
    wl = load_trace(str(tmp_path), rate=1.0, duration_s=5.0, max_context_len=10_000, seed=3)
    assert wl.session_starts
    _, s = wl.session_starts[0]
    assert [(t.prompt_len, t.think_s, t.stop) for t in s.turns] == [(130, 0.0, "tool_use"), (64, 1.0, "end_turn"),
                                                                   (200, 4.0, "end_turn")]
    assert s.turns[2].pages[:2] == s.turns[0].pages and s.turns[0].pages[0] == (s.namespace << 32) | 1
    with pytest.raises(ValueError, match="sessions/s"):
        load_trace(str(tmp_path), None, None, 10_000, 0)


def test_unrecognised_file(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="unrecognised"):
        detect_format(p)


def test_policy_and_sim_import_neither_torch_nor_sglang():
    code = ("import sys, radix_sync.sim.cli, radix_sync.policy.planner, radix_sync.policy.routers; "
            "bad = [m for m in ('torch', 'sglang', 'matplotlib') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
