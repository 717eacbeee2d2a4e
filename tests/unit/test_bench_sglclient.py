"""`kvrep bench --client sglang`: the command line given to SGLang's own client (parsed by its own parser) and the
reading of its output file (`tests/fixtures/sglang_bench_output.jsonl`: the last line a real run wrote, shadow arm,
tiny model, 2 groups x 2 conversations x 2 turns, cut to its per-request fields and summary TTFTs; the server info,
which names this machine's paths, and the generated texts left out)."""
import argparse
import json
import math
from pathlib import Path

import pytest
import sglang.benchmark.serving as serving

from kvrep_dev import bench, loadgen, sglclient, stats

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sglang_bench_output.jsonl"


def parsed_by_sglang(monkeypatch, argv: list[str]) -> argparse.Namespace:
    """The namespace SGLang's own CLI entry point builds from `argv` (its benchmark not run)."""
    got = {}
    monkeypatch.setattr(serving, "run_benchmark", lambda a: got.setdefault("args", a))
    monkeypatch.setattr("sys.argv", ["serving", *argv])
    serving.cli_main()
    return got["args"]


def test_the_command_line_is_multi_turn_generated_shared_prefix_over_the_chat_api(monkeypatch, tmp_path):
    cfg = sglclient.GspConfig(groups=3, conversations=4, turns=5, system_len=1000, question_len=50, output_len=7,
                              rate=1.5)
    argv = sglclient.argv("http://127.0.0.1:9", "/m/tiny", tmp_path / "o.jsonl", 11, cfg)
    assert argv[1:3] == ["-m", "sglang.benchmark.serving"]
    a = parsed_by_sglang(monkeypatch, argv[3:])
    assert a.backend == "sglang-oai-chat" and a.dataset_name == "generated-shared-prefix"
    assert a.base_url == "http://127.0.0.1:9" and a.model == a.tokenizer == "/m/tiny"
    assert (a.gsp_num_groups, a.gsp_prompts_per_group, a.gsp_num_turns) == (3, 4, 5)
    assert (a.gsp_system_prompt_len, a.gsp_question_len, a.gsp_output_len) == (1000, 50, 7)
    assert a.request_rate == 1.5 and a.seed == 11 and a.num_prompts == 12 and a.warmup_requests == 0
    assert a.output_details and a.output_file == str(tmp_path / "o.jsonl")
    assert cfg.requests == 60


def test_the_bench_flags_reach_the_client_and_the_kvrep_client_stays_the_default():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args([])
    assert args.client == "kvrep"
    assert bench.gsp_config(args) == sglclient.GspConfig(output_len=args.max_output)
    args = p.parse_args(["--client", "both", "--sgl-groups", "4", "--sgl-turns", "3", "--sgl-rate", "2.5"])
    g = bench.gsp_config(args)
    assert args.client == "both" and (g.groups, g.turns, g.rate) == (4, 3, 2.5)
    with pytest.raises(SystemExit):
        p.parse_args(["--client", "vllm"])


def test_a_real_output_file_is_read_per_request():
    reqs = sglclient.read_output(FIXTURE)
    assert len(reqs) == 8 and all(q["error"] is None and q["ttft_s"] > 0 for q in reqs)
    assert all(q["prompt_tokens"] > 0 for q in reqs) and [q["rid"] for q in reqs] == list(range(8))
    live = loadgen.summarize(sglclient.results(reqs))
    assert live["requests"] == 8 and live["errors"] == 0
    xs = [q["ttft_s"] for q in reqs]
    own = json.loads(FIXTURE.read_text())  # the client's own summary of the same requests
    assert live["ttft_s"]["mean"] == pytest.approx(own["mean_ttft_ms"] / 1e3, rel=1e-3)
    assert live["ttft_s"]["p50"] == pytest.approx(own["median_ttft_ms"] / 1e3, rel=1e-3)
    c = stats.ci(xs, "p99")  # the same bootstrap intervals as our own client's cells
    assert c["n"] == 8 and c["lo"] <= c["value"] <= c["hi"] and c["value"] == pytest.approx(max(xs), rel=0.05)


def test_failed_requests_are_errors_and_the_last_run_in_the_file_counts(tmp_path):
    f = tmp_path / "out.jsonl"
    f.write_text('{"ttfts": [9.0], "errors": [""], "input_lens": [5], "output_lens": [1]}\n'
                 '{"ttfts": [0.5, 0.0, 0.25], "errors": ["", "HTTP 401", ""], "input_lens": [10, 11, 12], '
                 '"output_lens": [8, 0, 8]}\n')
    reqs = sglclient.read_output(f)
    assert [q["ttft_s"] for q in reqs] == [0.5, None, 0.25]
    assert [q["error"] for q in reqs] == [None, "HTTP 401", None]
    live = loadgen.summarize(sglclient.results(reqs))
    assert live["errors"] == 1 and live["ttft_s"]["mean"] == pytest.approx(0.375)
    assert math.isnan(live["throughput_rps"])  # the client reports no send times per request
    f.write_text("")
    with pytest.raises(ValueError):
        sglclient.read_output(f)
