"""The package layout rules: dependencies point one way, and the HF `kernels` package is never shadowed."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT / "tests"),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_radix_sync_imports_neither_torch_nor_sglang():
    mods = ["radix_sync.protocol", "radix_sync.hashing", "radix_sync.directory", "radix_sync.coordinator.server",
            "radix_sync.coordinator.state", "radix_sync.coordinator.rules", "radix_sync.cli",
            "radix_sync.router.server", "radix_sync.router.policy", "radix_sync.router.tokenize",
            "radix_sync.router.tenants", "radix_sync.router.coordinator_link", "radix_sync.router.metrics"]
    out = run("import sys; " + "; ".join(f"import {m}" for m in mods) +
              "; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang', 'triton')))")
    assert out == "[]"


def test_kernels_folder_is_not_a_package_and_hf_kernels_still_imports():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    out = run("import kernels, kvrep_kernels, os; print(os.path.dirname(kernels.__file__))")
    assert "site-packages" in out, out


def test_kvrep_kernels_does_not_import_sglang():
    assert run("import sys, kvrep_kernels; print('sglang' in sys.modules)") == "False"
