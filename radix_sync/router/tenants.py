"""Tenants: API key -> tenant -> namespace (SGLang's `cache_salt`), loaded from a JSON or TOML file.

File format (JSON shown; TOML has the same shape, `[tenants.acme]` tables):

    {"tenants": {"acme":   {"namespace": "shared-a", "api_keys": ["sk-a1", "sk-a2"]},
                 "globex": {"api_keys": ["sk-g"]}}}

A tenant's namespace is `derive_namespace(secret, label)`: HMAC-SHA256 under the cluster's tenant secret
(`radix_sync.keys`, the `tenant-secret` file every router of a cluster reads) of its label (`namespace`, else
the tenant's name), hex-truncated. Tenants given one label share one namespace (and their cached prefixes);
nobody without the secret can compute or guess a namespace. Keys are unique across tenants. The router sets the
request's `cache_salt` to the namespace and drops any `cache_salt` / `extra_key` the client sent, so a client
cannot reach another tenant's KV. Without a file everyone is the default namespace "" (`TenantTable.open()`).
Called by `radix_sync.router.app` for every request.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional


class Unauthorized(Exception):
    """A missing or unknown API key (HTTP 401)."""


@dataclass(frozen=True)
class Tenant:
    name: str
    namespace: str
    """The `cache_salt` every request of this tenant carries."""


DEFAULT_TENANT = Tenant("default", "")
MAX_TENANT_NAME_LEN = 128
"""The coordinator takes a request class (the tenant's name) of at most 128 characters."""
NAMESPACE_HEX_CHARS = 32
"""A namespace is the first 128 bits of its HMAC, in hex."""


def derive_namespace(secret: bytes, label: str) -> str:
    """Returns: the namespace (`cache_salt`) of a tenant label under the cluster's tenant secret."""
    return hmac.new(secret, label.encode(), hashlib.sha256).hexdigest()[:NAMESPACE_HEX_CHARS]


class TenantTable:
    """API key -> `Tenant`; `required` is False only for the open table (no tenants file)."""

    def __init__(self, by_key: Mapping[str, Tenant], required: bool = True) -> None:
        self._by_key = dict(by_key)
        self._by_name = {t.name: t for t in self._by_key.values()}
        self.required = required

    @classmethod
    def open(cls) -> "TenantTable":
        """Returns: the table used without a tenants file: everyone is the default tenant."""
        return cls({}, required=False)

    @classmethod
    def load(cls, path: str | Path, secret: bytes) -> "TenantTable":
        """Loads a JSON (`.json`) or TOML (any other suffix) tenants file; namespaces derived under `secret`.

        Raises:
            ValueError: unreadable file, bad shape, or an API key given to two tenants.
        """
        path = Path(path)
        try:
            raw = path.read_bytes()
            data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
        except (OSError, ValueError) as exc:
            raise ValueError(f"tenants file {path}: {exc}") from None
        return cls.from_dict(data, secret, str(path))

    @classmethod
    def from_dict(cls, data: object, secret: bytes, where: str = "tenants") -> "TenantTable":
        tenants = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(tenants, dict) or not tenants:
            raise ValueError(f"{where}: expected a non-empty 'tenants' table")
        by_key: dict[str, Tenant] = {}
        for name, spec in tenants.items():
            if not isinstance(name, str) or not 0 < len(name) <= MAX_TENANT_NAME_LEN:
                raise ValueError(f"{where}: tenant name {name!r} must be 1-{MAX_TENANT_NAME_LEN} characters")
            keys = spec.get("api_keys") if isinstance(spec, dict) else None
            if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
                raise ValueError(f"{where}: tenant {name!r} needs a non-empty list of api_keys")
            namespace = spec.get("namespace", name)
            if not isinstance(namespace, str) or not namespace:
                raise ValueError(f"{where}: tenant {name!r} has a bad namespace {namespace!r}")
            for key in keys:
                if key in by_key:
                    raise ValueError(f"{where}: api key of tenant {name!r} is also given to {by_key[key].name!r}")
                by_key[key] = Tenant(name, derive_namespace(secret, namespace))
        return cls(by_key)

    def resolve(self, authorization: Optional[str], api_key_header: Optional[str] = None) -> Tenant:
        """The tenant of a request.

        Args:
            authorization: the `Authorization` header: `Bearer KEY` or the bare key (bench_serving sends the
                latter for `API_KEY`).
            api_key_header: the `x-api-key` header, used when there is no `Authorization`.
        Returns:
            the tenant (the default one when no tenants file is configured).
        Raises:
            Unauthorized: a tenants file is configured and the key is missing or unknown.
        """
        if not self.required:
            return DEFAULT_TENANT
        key = (authorization or "").strip()
        scheme, _, rest = key.partition(" ")
        if scheme.lower() == "bearer":
            key = rest.strip()
        key = key or (api_key_header or "").strip()
        if not key:
            raise Unauthorized("missing API key")
        tenant = self._by_key.get(key)
        if tenant is None:
            raise Unauthorized("unknown API key")
        return tenant

    def by_name(self, name: str) -> Optional[Tenant]:
        """Returns: the tenant called `name` (the default tenant for "default" in the open table), or None."""
        if not self.required:
            return DEFAULT_TENANT if name == DEFAULT_TENANT.name else None
        return self._by_name.get(name)

    def namespaces(self) -> list[str]:
        return sorted({t.namespace for t in self._by_key.values()})


def apply_namespace(body: dict, tenant: Tenant) -> dict:
    """Sets the tenant's namespace on a request body (in place) and drops any namespace the client chose.

    Returns:
        the body.
    """
    body.pop("extra_key", None)
    body.pop("cache_salt", None)
    if tenant.namespace:
        body["cache_salt"] = tenant.namespace
    return body
