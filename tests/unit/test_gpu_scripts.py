"""The GPU check's parts, run on the CPU as far as they go (issue 18 item 7): the profile re-measurement on a tiny
model, the hazard script's refusal without CUDA, and the check's time box and output folder limits."""
import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_profile_remeasurement_runs_and_fits_every_term_on_a_tiny_model():
    gp = load("gpu_profile")
    model = gp.build(gp.TINY, torch.device("cpu"))
    out = gp.measure(model, torch.device("cpu"), [16, 32, 48], [(1, 8), (2, 8), (2, 16)], 1, gp.TINY["vocab_size"])
    assert [r["tokens"] for r in out["prefill"]] == [16, 32, 48] and len(out["decode"]) == 3
    assert all(r["s"] > 0 for r in out["prefill"] + out["decode"])
    assert set(out["fitted"]) == {"prefill_overhead_s", "prefill_s_per_token", "prefill_s_per_token_pair",
                                  "decode_step_s", "decode_s_per_request", "decode_s_per_ctx_token"}
    # the fit is exact on three points of a model with three terms
    assert gp.fit([[1, 1, 1], [1, 2, 4], [1, 3, 9]], [6, 17, 34]) == pytest.approx([1, 2, 3], abs=1e-9)


@pytest.mark.parametrize("script", ["gpu_ordering", "gpu_issue_cost"])
def test_the_cuda_only_scripts_say_they_need_cuda(script, capsys, monkeypatch):
    if torch.cuda.is_available():  # (on a GPU the check itself runs them)
        pytest.skip("a CUDA device is here: the GPU check runs the script instead")
    import sys

    monkeypatch.setattr(sys, "argv", [f"{script}.py"])
    assert load(script).main() == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_the_gpu_check_fits_its_time_box_and_the_devices_output_limits():
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    limits = [int(x) for x in re.findall(r"^step \S+ (\d+) ", text, re.M)]
    names = re.findall(r"^step (\S+) ", text, re.M)
    assert sum(limits) <= 8 * 60 and len(limits) == 6
    files = {"summary.txt", "profile.json"} | {f"{n}.txt" for n in names}
    assert len(files) <= 8  # what comes back from a device run: 8 files at most


def test_the_agent_path_script_replicates_through_the_real_agents_on_the_cpu(tmp_path, capsys):
    """The GPU's end-to-end check (two real agents, their I/O threads, ZeroMQ, a stand-in coordinator) runs as far
    as the CPU allows: pages bit-identical, the source's lock released, the target's slots exactly the replica's."""
    import json
    import sys

    argv, sys.argv = sys.argv, ["gpu_agent_path.py", "--device", "cpu", "--tokens", "256,1024", "--layers", "2",
                                "--page-sizes", "16,1", "--json", str(tmp_path / "out.json")]
    try:
        assert load("gpu_agent_path").main() == 0
    finally:
        sys.argv = argv
    cases = json.loads((tmp_path / "out.json").read_text())["cases"]
    assert [(c["tokens"], c["page_size"]) for c in cases] == [(256, 16), (1024, 16), (256, 1), (1024, 1)]
    for c in cases:
        assert c["identical"] and c["inserted_len"] == c["tokens"] and c["source_locks_left"] == 0
        assert c["target_pages_used"] == c["target_pages_expected"] and c["target_installs_left"] == 0
