"""Tenants: API key -> namespace, 401 for missing or unknown keys, and the namespace a client sends is ignored."""
import json

import pytest

from radix_sync.router.tenants import DEFAULT_TENANT, Tenant, TenantTable, Unauthorized, apply_namespace

SPEC = {"tenants": {"acme": {"namespace": "ns-acme", "api_keys": ["sk-a1", "sk-a2"]},
                    "globex": {"api_keys": ["sk-g"]}}}


def test_keys_map_to_their_tenant_namespace():
    t = TenantTable.from_dict(SPEC)
    assert t.resolve("Bearer sk-a1") == Tenant("acme", "ns-acme")
    assert t.resolve("sk-a2") == Tenant("acme", "ns-acme")  # bench_serving's bare API_KEY form
    assert t.resolve(None, "sk-g") == Tenant("globex", "globex")  # x-api-key; namespace defaults to the name
    assert t.namespaces() == ["globex", "ns-acme"]


@pytest.mark.parametrize("auth,xkey,msg", [(None, None, "missing"), ("Bearer ", None, "missing"),
                                           ("Bearer sk-nope", None, "unknown"), (None, "sk-nope", "unknown")])
def test_missing_or_unknown_key_is_unauthorized(auth, xkey, msg):
    with pytest.raises(Unauthorized, match=msg):
        TenantTable.from_dict(SPEC).resolve(auth, xkey)


def test_without_a_tenants_file_everyone_is_the_default_namespace():
    t = TenantTable.open()
    assert t.resolve(None) == t.resolve("Bearer anything") == DEFAULT_TENANT
    assert DEFAULT_TENANT.namespace == ""


def test_client_namespace_is_overwritten_or_dropped():
    body = {"text": "hi", "cache_salt": "victim", "extra_key": "victim"}
    assert apply_namespace(dict(body), Tenant("acme", "ns-acme")) == {"text": "hi", "cache_salt": "ns-acme"}
    assert apply_namespace(dict(body), DEFAULT_TENANT) == {"text": "hi"}


def test_files_json_and_toml(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(SPEC))
    (tmp_path / "t.toml").write_text('[tenants.acme]\nnamespace = "ns-acme"\napi_keys = ["sk-a1"]\n')
    assert TenantTable.load(tmp_path / "t.json").resolve("sk-g").namespace == "globex"
    assert TenantTable.load(tmp_path / "t.toml").resolve("Bearer sk-a1").namespace == "ns-acme"


@pytest.mark.parametrize("spec,msg", [
    ({}, "non-empty 'tenants'"),
    ({"tenants": {"a": {"api_keys": []}}}, "non-empty list"),
    ({"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}}, "also given to 'a'"),
    ({"tenants": {"a": {"api_keys": ["k"], "namespace": ""}}}, "bad namespace"),
])
def test_bad_files_are_refused_clearly(spec, msg):
    with pytest.raises(ValueError, match=msg):
        TenantTable.from_dict(spec)


def test_unreadable_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        TenantTable.load(tmp_path / "bad.json")
