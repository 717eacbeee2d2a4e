"""`scripts/copy_fates.py` on a hand-made out-dir: each copy counted once, by its fate, with its times."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import copy_fates  # noqa: E402

LOG = """[2026-12-06 07:02:33] kvrep: replica r1-a installed: 64 of 64 tokens new, TTL 101 s
[2026-12-06 07:02:33] kvrep: replica r2-b installed: 32 of 32 tokens new, TTL 30 s
[2026-12-06 07:02:35] kvrep: replica r2-b (32 tokens) evicted by SGLang 28.0 s before its expiry
[2026-12-06 07:02:40] kvrep: replica r9-z (16 tokens) evicted by SGLang 1.0 s before its expiry
"""


def test_copies_are_used_evicted_before_use_or_unused(tmp_path, capsys):
    copies = [dict(id="r1-a", origin="kvrep", target="127.0.0.1:2", num_tokens=64, promoted_tokens=64, finished_s=10.0),
              dict(id="r2-b", origin="kvrep", target="127.0.0.1:2", num_tokens=32, promoted_tokens=0, finished_s=10.0),
              dict(id="r3-c", origin="kvrep", target="127.0.0.1:2", num_tokens=32, promoted_tokens=0, finished_s=11.0),
              dict(id="r4-d", origin="pull", target="127.0.0.1:1", num_tokens=16, promoted_tokens=16, finished_s=12.0)]
    decisions = [dict(time_s=9.0, worker="http://127.0.0.1:2", cached_tokens=64),  # before landing: not counted
                 dict(time_s=10.5, worker="http://127.0.0.1:1", cached_tokens=64),  # another worker
                 dict(time_s=10.7, worker="http://127.0.0.1:2", cached_tokens=10),  # too little of it
                 dict(time_s=11.25, worker="http://127.0.0.1:2", cached_tokens=60),  # >= 90% of 64: r1-a asked for
                 dict(time_s=12.0, worker="http://127.0.0.1:1", cached_tokens=16)]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker-0.log").write_text(LOG)
    (tmp_path / "results.json").write_text(json.dumps({"rows": [
        {"arm": "active", "replications": copies, "router_decisions": decisions}]}))
    assert copy_fates.evictions(LOG.splitlines()) == {"r2-b": 2.0}  # r9-z: never installed here
    f = copy_fates.fates(json.loads((tmp_path / "results.json").read_text()), {"r2-b": 2.0})
    assert f[("active", "kvrep")] == {"used": 1, "evicted before use": 1, "unused": 1, "evicted after s": [2],
                                      "used, first asked after s": [1.2]}
    assert f[("active", "pull")]["used"] == 1 and f[("active", "pull")]["used, first asked after s"] == [0.0]
    assert copy_fates.main([str(tmp_path)]) == 0
    assert "evicted before use   1" in capsys.readouterr().out
