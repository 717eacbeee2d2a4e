"""JSON for the admin API and the router's proxy path: orjson (an sglang dependency) when present, which parses
and writes long lists of ints (token ids, page hashes, directory snapshots) several times faster; the standard
library otherwise. `dumps` returns bytes and accepts int dict keys, like `json.dumps` does."""
from __future__ import annotations

import json
from typing import Any

try:
    import orjson

    loads = orjson.loads

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
except ImportError:  # pragma: no cover
    loads = json.loads

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()
