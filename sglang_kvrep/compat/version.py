"""The one SGLang version the plugin supports, and the check that refuses any other when replication is enabled.
Part of the one door to SGLang (`sglang_kvrep.compat`)."""
from __future__ import annotations

SUPPORTED_SGLANG = "0.5.23"
"""The plugin reaches into this version's internals (hook targets, tree-cache and allocator signatures)."""


def sglang_version() -> str:
    import sglang

    return getattr(sglang, "__version__", "unknown")


def check_sglang_version(found: str | None = None) -> None:
    """Raises:
        RuntimeError: the installed SGLang (`found`, default the installed one) is not the supported one; the
            message names both versions."""
    found = sglang_version() if found is None else found
    if found != SUPPORTED_SGLANG:
        raise RuntimeError(f"sglang-kvrep supports sglang {SUPPORTED_SGLANG} only, but sglang {found} is installed "
                           f"(pip install sglang=={SUPPORTED_SGLANG}, or run without --enable-kv-replication)")
