"""Shared test set-up: the project root on sys.path for `kvrep_kernels` (it lives in kernels/)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "kernels"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
