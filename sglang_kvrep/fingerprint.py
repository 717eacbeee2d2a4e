"""The compatibility fingerprint of a worker: what two workers must share for one's KV pages to be valid on the
other. It names the weights by their content (a SHA-256 of every weight and model-config file, computed once and
cached by path, size and mtime) and adds every serving setting that changes the KV a prompt produces
(quantization, KV dtype, RoPE scaling and overrides, LoRA adapters and their content, the parallel layout, the
page size and the KV pool's geometry and layout).

Nothing here imports SGLang: `sglang_kvrep.compat` reads SGLang's settings into a plain dict
(`compat.kv_serving_flags`, `SchedulerView.fingerprint_fields`) and calls `model_fields`; the scheduler side of
the agent calls `digest` and, after a weight update, `updated_weights_fields`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Iterable, Mapping, Optional

log = logging.getLogger("kvrep.fingerprint")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
"""Files that hold weights (any of them, in any sub-folder of the model folder)."""
CONFIG_NAMES = ("config.json", "params.json", "adapter_config.json")
"""Model and adapter configs: geometry, RoPE, quantization settings (tokenizer files do not change KV)."""
MAX_FILES = 100_000
"""A model folder with more files than this is refused (a wrong path, e.g. a home directory)."""
_READ_BYTES = 8 << 20
_CACHE_LOCK = threading.Lock()


def cache_path() -> Path:
    """`$KVREP_CACHE/fingerprints.json`, default `~/.cache/sglang-kvrep/fingerprints.json`."""
    root = os.environ.get("KVREP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sglang-kvrep")
    return Path(root) / "fingerprints.json"


class HashCache:
    """SHA-256 of files, cached by (absolute path, size, mtime in ns) in a JSON file; a changed file is hashed
    again. An unreadable or malformed cache file is ignored (everything is hashed again) and rewritten."""

    def __init__(self, path: Optional[Path] = None) -> None:
        self.path = path if path is not None else cache_path()
        self.entries: dict[str, dict] = self._load()
        self.num_hashed = 0
        """Files hashed (not found in the cache) by this object."""

    def _load(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("kvrep: ignoring the fingerprint cache %s: %s", self.path, exc)
            return {}
        files = data.get("files") if isinstance(data, dict) and data.get("version") == 1 else None
        if not isinstance(files, dict):
            return {}
        return {k: v for k, v in files.items() if isinstance(v, dict) and isinstance(v.get("sha256"), str)}

    def sha256(self, path: Path) -> str:
        """The file's SHA-256 (hex), from the cache when its size and mtime are unchanged."""
        path = path.resolve()
        st = path.stat()
        key = str(path)
        hit = self.entries.get(key)
        if hit is not None and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
            return hit["sha256"]
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        self.num_hashed += 1
        self.entries[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        return digest

    def save(self) -> None:
        """Merge into the file on disk (other workers on this host write it too) and replace it atomically. A
        failure is logged: the cache only saves time."""
        with _CACHE_LOCK:
            try:
                merged = {**HashCache(self.path).entries, **self.entries}
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
                tmp.write_text(json.dumps({"version": 1, "files": merged}, sort_keys=True))
                os.replace(tmp, self.path)
            except OSError as exc:
                log.warning("kvrep: could not write the fingerprint cache %s: %s", self.path, exc)


def _content_files(folder: Path) -> list[Path]:
    out = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # .cache, .git: not the model
        for name in names:
            if name.endswith(WEIGHT_SUFFIXES) or name in CONFIG_NAMES or (name.endswith(".json") and "quant" in name):
                out.append(Path(root) / name)
                if len(out) > MAX_FILES:
                    raise ValueError(f"{folder} holds over {MAX_FILES} weight files: not a model folder")
    return sorted(out)


def folder_digest(folder: Path, cache: HashCache) -> str:
    """SHA-256 over (relative path, SHA-256 of the content) of every weight and config file under `folder`.

    Raises:
        ValueError: `folder` holds no weight file.
    """
    files = _content_files(folder)
    if not any(f.name.endswith(WEIGHT_SUFFIXES) for f in files):
        raise ValueError(f"no weight file under {folder}")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(folder).as_posix()}\0{cache.sha256(f)}\n".encode())
    return h.hexdigest()


def hub_snapshot(repo_id: str, revision: Optional[str] = None) -> Optional[Path]:
    """The local Hugging Face cache folder of a hub model, as SGLang downloaded it, read from the cache only (no
    network: `snapshot_download(..., local_files_only=True)`, which follows `HF_HOME` / `HF_HUB_CACHE` and
    resolves a branch or tag through the cache's refs).

    Returns:
        the snapshot folder, or None when the model is not in the local cache (or huggingface_hub is missing).
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError, OSError) as exc:
        log.info("%s (revision %s) is not in the local Hugging Face cache: %s", repo_id, revision, exc)
        return None
    return Path(folder)


def _source_digest(source: str, cache: HashCache, revision: Optional[str] = None) -> str:
    """The content digest of a model or adapter folder, or of a hub id's snapshot in the local Hugging Face
    cache (`hub_snapshot`, at `revision`); a source that is neither (not downloaded here) is named as given,
    prefixed `unresolved:` (workers then match only on the same name)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return folder_digest(path, cache)
    snapshot = hub_snapshot(source, revision) if source and not path.is_absolute() else None
    if snapshot is not None:
        try:
            return folder_digest(snapshot, cache)
        except ValueError as exc:  # a snapshot without weight files (a partial download)
            log.warning("%s: %s", source, exc)
    return "unresolved:" + source


def _canonical_json(value) -> str:
    """JSON text with sorted keys; a string that holds JSON (SGLang's `--json-model-override-args`) is parsed."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True, default=str)


def model_fields(model_path: str, flags: Mapping[str, object], lora_adapters: Iterable[tuple[str, str]] = (),
                 *, rope: object = None, cache: Optional[HashCache] = None) -> dict[str, str]:
    """The fingerprint fields that name the model: its content, its KV-changing serving flags, its adapters.

    Args:
        model_path: the served model (a folder, or a hub id SGLang downloaded: its snapshot in the local Hugging
            Face cache at `flags["revision"]` is hashed).
        flags: the serving settings that change KV, by name (`compat.kv_serving_flags`); values are written as
            canonical JSON (so `{"a":1,"b":2}` and `{"b": 2, "a": 1}` agree).
        lora_adapters: (name, path) of every LoRA adapter the worker may serve.
        rope: the RoPE settings in effect (the model config's `rope_scaling` and `rope_theta` after overrides).
        cache: the file-hash cache (default: the user's cache file, saved before returning).
    """
    own = cache is None
    cache = HashCache() if own else cache
    revision = flags.get("revision")
    fields = {"weights": _source_digest(model_path, cache, str(revision) if revision else None)[:32]}
    for name, value in sorted(flags.items()):
        fields[name] = _canonical_json(value)
    adapters = sorted((str(n), _source_digest(str(p), cache)[:32]) for n, p in lora_adapters)
    fields["lora_adapters"] = json.dumps(adapters)
    fields["rope"] = _canonical_json(rope)
    if own:
        cache.save()
    return fields


def updated_weights_fields(fields: Mapping[str, str], kind: str, weight_version: Optional[str],
                           nonce: str) -> dict[str, str]:
    """The fields after an in-place update whose content the worker cannot hash (from tensors, a distributed
    group, IPC): the weights become the previous content chained with the update's declared `weight_version`;
    without one, with `nonce` (random), so that this worker matches no other one until a restart or a versioned
    update: a replica is never shared between weights that may differ."""
    tag = f"{kind}:{weight_version}" if weight_version else f"{kind}:unversioned:{nonce}"
    chained = hashlib.sha256(f"{fields.get('weights', '')}\0{tag}".encode()).hexdigest()[:32]
    return {**fields, "weights": chained}


def digest(fields: Mapping[str, str]) -> str:
    """The fingerprint: a short hash of every field (names and values)."""
    return hashlib.sha256(json.dumps(sorted(fields.items())).encode()).hexdigest()[:24]
