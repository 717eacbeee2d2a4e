"""The H200 profiles' measured terms are what `scripts/profile_from_public.py` derives from its quoted sources (a
hand edit of a profile, or of a quoted number, fails here until the script is re-run)."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("profile_from_public", ROOT / "scripts" / "profile_from_public.py")
pfp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pfp)


@pytest.mark.parametrize("name", ["llama3.1-8b-h200", "llama3.1-70b-h200-tp4"])
def test_committed_profile_is_the_derivation(name):
    committed = json.loads((ROOT / "radix_sync" / "profiles" / f"{name}.json").read_text())
    built = pfp.build(name)
    assert committed["values"] == built["values"]
    assert committed["derivation"] == built["derivation"]
    assert any(pfp.TRT_URL in s for s in committed["sources"])


def test_derivation_by_hand_for_the_8b_prefill_term():
    values, _ = pfp.derive("llama3.1-8b-h200", {"prefill_s_per_token_pair": 0.0, "decode_s_per_request": 0.0,
                                                "decode_s_per_ctx_token": 0.0})
    # 467-in/16-out at unlimited QPS: 39007 total - 1291 output tok/s = 37716 input tok/s
    assert values["prefill_s_per_token"] == pytest.approx(1 / 37716, rel=1e-5)
    # QPS-2 rows, no pair term: overheads 21 - 467/37716 s, 18 - 467/37716 s, 17 - 202/37716 s (ms), averaged
    assert values["prefill_overhead_s"] == pytest.approx(((0.021 + 0.018 + 0.017) - (467 + 467 + 202) / 37716) / 3,
                                                         abs=1e-6)
    assert values["decode_step_s"] == pytest.approx((0.006 + 0.005 + 0.006) / 3, abs=1e-6)  # mean ITL, no terms
    assert values["nic_bandwidth_bytes_per_s"] == 190e9 / 8
