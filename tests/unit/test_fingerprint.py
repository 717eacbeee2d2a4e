"""The worker's compatibility fingerprint names what its KV depends on: the weights' bytes (a fine-tune with the
base's file names and sizes differs), the KV-changing serving flags as SGLang parses them (fp8 vs none, a RoPE
override vs none, LoRA adapters and their content, the parallel layout), and a weight update. Real safetensors
files on disk; real `ServerArgs` from SGLang's own parser; the file hashes come from a cache keyed by path, size
and mtime."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from sglang_kvrep import compat, fingerprint
from sglang_kvrep.compat.serving import parse_server_args


def write_model(folder, seed: int, *, rope=None):
    """A two-file model: same names, shapes and dtypes for every seed; the bytes differ."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(2):
        save_file({"w": torch.randn(64, 32, generator=g)}, str(folder / f"model-0000{i}-of-00002.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "rope_theta": 10000.0}
    if rope is not None:
        cfg["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREP_CACHE", str(tmp_path / "cache"))
    return fingerprint.HashCache()


@pytest.fixture(scope="module")
def sglang_args():
    """`ServerArgs` parsed by SGLang (one import for the module: it takes seconds)."""
    return lambda *argv: parse_server_args(["--model-path", "unused", "--device", "cpu", *argv])


def fields_of(model, server_args, cache):
    return fingerprint.model_fields(str(model), compat.kv_serving_flags(server_args),
                                    compat.lora_adapters(server_args), cache=cache)


def diff(a: dict, b: dict) -> set:
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def test_a_fine_tune_differs_from_its_base(tmp_path, cache, sglang_args):
    base, tuned = write_model(tmp_path / "base", 0), write_model(tmp_path / "tuned", 1)
    names = lambda d: sorted((f.name, f.stat().st_size) for f in d.iterdir())  # noqa: E731
    assert names(base) == names(tuned)  # what the old fingerprint looked at
    args = sglang_args()
    a, b = fields_of(base, args, cache), fields_of(tuned, args, cache)
    assert diff(a, b) == {"weights"}
    assert fingerprint.digest(a) != fingerprint.digest(b)
    # one model at two paths (two hosts) is one model
    copy = write_model(tmp_path / "elsewhere" / "base", 0)
    assert fields_of(copy, args, cache) == a


def test_kv_changing_flags_as_sglang_parses_them_change_the_fingerprint(tmp_path, cache, sglang_args):
    model = write_model(tmp_path / "m", 0)
    plain = fields_of(model, sglang_args(), cache)
    cases = {
        ("--quantization", "fp8"): {"quantization"},
        ("--kv-cache-dtype", "fp8_e4m3"): {"kv_cache_dtype"},
        ("--json-model-override-args", '{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}'):
            {"json_model_override_args"},
        ("--tp-size", "2"): {"tp_size"},
        ("--dp-size", "2", "--enable-dp-attention"): {"dp_size", "enable_dp_attention"},
        ("--context-length", "8192"): {"context_length"},
        ("--revision", "abc123"): {"revision"},
    }
    for argv, changed in cases.items():
        other = fields_of(model, sglang_args(*argv), cache)
        assert diff(plain, other) == changed, argv
        assert fingerprint.digest(other) != fingerprint.digest(plain)
    # the same override written differently is the same setting
    a = fields_of(model, sglang_args("--json-model-override-args", '{"a": 1, "b": {"c": 2}}'), cache)
    b = fields_of(model, sglang_args("--json-model-override-args", '{"b": {"c": 2},  "a": 1}'), cache)
    assert a == b


def test_rope_scaling_in_the_model_config_or_in_effect_changes_it(tmp_path, cache, sglang_args):
    args = sglang_args()
    plain = fields_of(write_model(tmp_path / "a", 0), args, cache)
    scaled = fields_of(write_model(tmp_path / "b", 0, rope={"rope_type": "yarn", "factor": 4.0}), args, cache)
    assert diff(plain, scaled) == {"weights"}  # config.json is part of the content
    flags = compat.kv_serving_flags(args)
    none = fingerprint.model_fields(str(tmp_path / "a"), flags, rope=None, cache=cache)
    linear = fingerprint.model_fields(str(tmp_path / "a"), flags, rope={"rope_scaling": {"factor": 2.0}},
                                      cache=cache)
    assert diff(none, linear) == {"rope"}


def test_lora_adapters_count_by_content(tmp_path, cache, sglang_args):
    model = write_model(tmp_path / "m", 0)
    a1, a2 = write_model(tmp_path / "lora1", 5), write_model(tmp_path / "lora2", 6)
    none = fields_of(model, sglang_args(), cache)
    with1 = fields_of(model, sglang_args("--enable-lora", "--lora-paths", f"sql={a1}"), cache)
    with2 = fields_of(model, sglang_args("--enable-lora", "--lora-paths", f"sql={a2}"), cache)  # same name
    assert diff(none, with1) == {"enable_lora", "lora_adapters"}
    assert diff(with1, with2) == {"lora_adapters"}
    as_json = fields_of(model, sglang_args("--enable-lora", "--lora-paths",
                                           json.dumps({"lora_name": "sql", "lora_path": str(a1)})), cache)
    assert as_json == with1


def test_file_hashes_are_cached_by_path_size_and_mtime(tmp_path, cache, sglang_args):
    model = write_model(tmp_path / "m", 0)
    args = sglang_args()
    first = fields_of(model, args, cache)
    assert cache.num_hashed == 3  # two weight files and config.json; not the tokenizer's
    cache.save()
    again = fingerprint.HashCache()  # a new process: from the file
    assert fields_of(model, args, again) == first and again.num_hashed == 0
    # new bytes under the same name and size: the mtime tells, and the content is hashed again
    shard = model / "model-00001-of-00002.safetensors"
    size = shard.stat().st_size
    save_file({"w": torch.full((64, 32), 3.0)}, str(shard))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert shard.stat().st_size == size
    changed = fields_of(model, args, again)
    assert again.num_hashed == 1 and changed["weights"] != first["weights"]


def test_a_broken_cache_file_is_ignored_and_rewritten(tmp_path, cache, sglang_args):
    model = write_model(tmp_path / "m", 0)
    fingerprint.cache_path().parent.mkdir(parents=True)
    fingerprint.cache_path().write_text("{not json")
    fields = fingerprint.model_fields(str(model), compat.kv_serving_flags(sglang_args()))  # the user's cache
    assert json.loads(fingerprint.cache_path().read_text())["version"] == 1
    assert fingerprint.HashCache().num_hashed == 0 and fields["weights"]
    # a folder without weights is no model: refused, not fingerprinted as "nothing"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no weight file"):
        fingerprint.folder_digest(tmp_path / "empty", cache)


def test_a_weight_update_gives_a_new_identity():
    fields = {"weights": "abc", "tp_size": "1"}
    v2a = fingerprint.updated_weights_fields(fields, "tensor", "v2", nonce="n1")
    v2b = fingerprint.updated_weights_fields(fields, "tensor", "v2", nonce="n2")
    assert v2a == v2b and v2a["weights"] != "abc"  # two workers given the same versioned update still match
    assert fingerprint.updated_weights_fields(v2a, "tensor", "v3", "n")["weights"] != v2a["weights"]
    # without a version the update's content is unknown: this worker matches nobody
    u1 = fingerprint.updated_weights_fields(fields, "tensor", None, nonce="n1")
    u2 = fingerprint.updated_weights_fields(fields, "tensor", None, nonce="n2")
    assert u1["weights"] != u2["weights"]


def test_the_weight_update_seams_exist_in_this_sglang():
    """Every hook target is SGLang's method, taking (self, recv_req), on a manager that knows its scheduler."""
    import inspect

    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    for kind, target in compat.WEIGHT_UPDATE_HOOKS.items():
        fn = getattr(SchedulerWeightUpdaterManager, target.rsplit(".", 1)[1])
        assert list(inspect.signature(fn).parameters) == ["self", "recv_req"], kind
    assert "scheduler" in inspect.signature(SchedulerWeightUpdaterManager).parameters


def write_hub_snapshot(hub_cache, repo_id: str, commit: str, seed: int, refs=()):
    """A model in the Hugging Face cache layout (`models--org--name/snapshots/<commit>/`, `refs/<name>`)."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    write_model(repo / "snapshots" / commit, seed)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return repo / "snapshots" / commit


def test_a_hub_id_is_hashed_from_its_local_snapshot_at_the_served_revision(tmp_path, cache, sglang_args,
                                                                          monkeypatch):
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    main_snap = write_hub_snapshot(hub, "org/model", "a" * 40, 0, refs=("main",))
    write_hub_snapshot(hub, "org/model", "b" * 40, 1, refs=("v2",))
    served = fields_of("org/model", sglang_args(), cache)
    # the same bytes as a local folder: the same weights, wherever they came from
    assert served["weights"] == fields_of(main_snap, sglang_args(), cache)["weights"]
    assert not served["weights"].startswith("unresolved:")
    # another revision with other bytes (a fine-tune pushed to the same repo) is another model
    v2 = fields_of("org/model", sglang_args("--revision", "v2"), cache)
    assert v2["weights"] != served["weights"]
    assert fields_of("org/model", sglang_args("--revision", "b" * 40), cache)["weights"] == v2["weights"]
    # not downloaded here: named, never guessed
    assert fields_of("org/other", sglang_args(), cache)["weights"] == "unresolved:org/other"[:32]
