"""Tenants: API key -> namespace (an HMAC of the tenant's label under the cluster's secret), 401 for missing or
unknown keys, and the namespace a client sends is ignored."""
import hashlib
import hmac
import json

import pytest

from radix_sync.router.tenants import (DEFAULT_TENANT, Tenant, TenantTable, Unauthorized, apply_namespace,
                                       derive_namespace)

SECRET = bytes(range(32))
SPEC = {"tenants": {"acme": {"namespace": "ns-acme", "api_keys": ["sk-a1", "sk-a2"]},
                    "globex": {"api_keys": ["sk-g"]}}}


def ns(label, secret=SECRET):
    return hmac.new(secret, label.encode(), hashlib.sha256).hexdigest()[:32]


def test_keys_map_to_their_tenant_namespace():
    t = TenantTable.from_dict(SPEC, SECRET)
    assert t.resolve("Bearer sk-a1") == Tenant("acme", ns("ns-acme"))
    assert t.resolve("sk-a2") == Tenant("acme", ns("ns-acme"))  # bench_serving's bare API_KEY form
    assert t.resolve(None, "sk-g") == Tenant("globex", ns("globex"))  # x-api-key; the label defaults to the name
    assert t.namespaces() == sorted([ns("globex"), ns("ns-acme")])
    assert t.by_name("acme") == Tenant("acme", ns("ns-acme")) and t.by_name("default") is None


def test_namespaces_are_unguessable_without_the_secret_and_shared_with_it():
    """Two routers reading one secret file agree; another secret (or none: the label itself) gives other names,
    so a client that knows a tenant's name cannot compute its `cache_salt`."""
    a, b = TenantTable.from_dict(SPEC, SECRET), TenantTable.from_dict(SPEC, bytes(SECRET))
    other = TenantTable.from_dict(SPEC, b"\x01" * 32)
    assert a.resolve("sk-a1").namespace == b.resolve("sk-a1").namespace == derive_namespace(SECRET, "ns-acme")
    assert other.resolve("sk-a1").namespace != a.resolve("sk-a1").namespace
    assert "acme" not in a.resolve("sk-a1").namespace and len(a.resolve("sk-a1").namespace) == 32
    shared = {"tenants": {"x": {"namespace": "common", "api_keys": ["k1"]},
                          "y": {"namespace": "common", "api_keys": ["k2"]}}}
    t = TenantTable.from_dict(shared, SECRET)
    assert t.resolve("k1").namespace == t.resolve("k2").namespace  # one label: one namespace, shared prefixes


@pytest.mark.parametrize("auth,xkey,msg", [(None, None, "missing"), ("Bearer ", None, "missing"),
                                           ("Bearer sk-nope", None, "unknown"), (None, "sk-nope", "unknown")])
def test_missing_or_unknown_key_is_unauthorized(auth, xkey, msg):
    with pytest.raises(Unauthorized, match=msg):
        TenantTable.from_dict(SPEC, SECRET).resolve(auth, xkey)


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
    assert TenantTable.load(tmp_path / "t.json", SECRET).resolve("sk-g").namespace == ns("globex")
    assert TenantTable.load(tmp_path / "t.toml", SECRET).resolve("Bearer sk-a1").namespace == ns("ns-acme")


@pytest.mark.parametrize("spec,msg", [
    ({}, "non-empty 'tenants'"),
    ({"tenants": {"a": {"api_keys": []}}}, "non-empty list"),
    ({"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}}, "also given to 'a'"),
    ({"tenants": {"a": {"api_keys": ["k"], "namespace": ""}}}, "bad namespace"),
    ({"tenants": {"a" * 129: {"api_keys": ["k"]}}}, "1-128 characters"),
])
def test_bad_files_are_refused_clearly(spec, msg):
    with pytest.raises(ValueError, match=msg):
        TenantTable.from_dict(spec, SECRET)


def test_unreadable_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        TenantTable.load(tmp_path / "bad.json", SECRET)
