"""The layering rules of docs/architecture.md, checked on the source (every import, lazy and TYPE_CHECKING ones
included) and, for the torch-free role, by importing the base packages with torch and sglang made unimportable.

Rules (`FORBIDDEN`: the last column of the architecture table):
- `radix_sync` (coordinator, router, simulator, policies: the base install) never imports `sglang_kvrep`,
  `kvrep_dev`, `kvrep_kernels`, torch, triton or sglang;
- the processes' packages stay apart: the coordinator, the router and the simulator are each imported only by
  themselves and the command line (`radix_sync.cli`, imported by nothing); the policies (`radix_sync.policy`,
  shared by all three) only by those and the command line; so the shared modules (`radix_sync.protocol`, `.api`,
  `.keys`, ...) import none of them, and what two processes share lives in a shared module or in the policies;
- `sglang_kvrep` takes only the shared modules of `radix_sync` (never the policies, a process's package or the
  command line), never `kvrep_dev`, and sglang only in `sglang_kvrep.compat`;
- `kvrep_kernels` imports none of this project's other packages, nor sglang;
- no import circle among the modules of the runtime packages (`radix_sync`, `sglang_kvrep`, `kvrep_kernels`);
- no runtime module over 500 lines.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = {"radix_sync": ROOT / "radix_sync", "sglang_kvrep": ROOT / "sglang_kvrep",
           "kvrep_kernels": ROOT / "kernels" / "kvrep_kernels"}
MAX_LINES = 500

PROCESSES = ("radix_sync.coordinator", "radix_sync.router", "radix_sync.sim")
NOT_SHARED = ("radix_sync.policy", *PROCESSES, "radix_sync.cli")
"""What in `radix_sync` is not a shared module."""

# (importer prefix, forbidden imported prefix, *importers the rule exempts)
FORBIDDEN = (
    ("radix_sync", "sglang_kvrep"), ("radix_sync", "kvrep_dev"), ("radix_sync", "kvrep_kernels"),
    ("radix_sync", "torch"), ("radix_sync", "triton"), ("radix_sync", "sglang"),
    *(("radix_sync", p, p, "radix_sync.cli") for p in PROCESSES),
    ("radix_sync", "radix_sync.policy", *NOT_SHARED),
    ("radix_sync", "radix_sync.cli", "radix_sync.cli"),
    *(("sglang_kvrep", p) for p in NOT_SHARED),
    ("sglang_kvrep", "kvrep_dev"), ("sglang_kvrep", "sglang", "sglang_kvrep.compat"),
    ("kvrep_kernels", "radix_sync"), ("kvrep_kernels", "sglang_kvrep"), ("kvrep_kernels", "kvrep_dev"),
    ("kvrep_kernels", "sglang"),
)


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


def discover(roots: dict[str, Path]) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for pkg, base in roots.items():
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [pkg, *rel.parts]
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join(parts)] = Module(".".join(parts), path, is_pkg)
    return mods


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports_of(mod: Module) -> list[tuple[str, int]]:
    """Every module name the file imports (absolute), with its line; `from a import b` yields a.b and a."""
    tree = ast.parse(mod.path.read_text(), str(mod.path))
    package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((base, node.lineno))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*"]
    return out


def violations(roots: dict[str, Path], forbidden=FORBIDDEN, max_lines: int = MAX_LINES) -> list[str]:
    mods = discover(roots)
    found: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod in mods.values():
        for name, line in imports_of(mod):
            for importer, banned, *exempt in forbidden:
                if _under(mod.name, importer) and _under(name, banned) and not any(_under(mod.name, e) for e in exempt):
                    outside = f" outside {', '.join(exempt)}" if exempt else ""
                    found.append(f"{mod.path.relative_to(ROOT) if mod.path.is_relative_to(ROOT) else mod.path}:"
                                 f"{line}: {mod.name} imports {name} ({importer} must not import {banned}{outside})")
                    break
            # an edge to the most specific known module (a submodule, else its package)
            target = name
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != mod.name and not _under(mod.name, target):
                graph[mod.name].add(target)
        n = len(mod.path.read_text().splitlines())
        if n > max_lines:
            found.append(f"{mod.name}: {n} lines (> {max_lines})")
    found += [f"import circle: {' -> '.join(c)}" for c in _cycles(graph)]
    return sorted(set(found))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return comps


def test_runtime_packages_follow_the_layering():
    assert violations(RUNTIME) == []


def test_base_role_imports_without_torch_or_sglang():
    """Every module of `radix_sync` imports in a process where torch, triton and sglang cannot be imported."""
    names = sorted(m for m in discover({"radix_sync": RUNTIME["radix_sync"]}) if not m.endswith("__main__"))
    code = textwrap.dedent(f"""
        import importlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'triton', 'sglang', 'sglang_kvrep', 'kvrep_dev', 'kvrep_kernels'):
                    raise ImportError('blocked for the base role: ' + name)
                return None
        sys.meta_path.insert(0, Block())
        for name in {names!r}:
            importlib.import_module(name)
        bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang')]
        assert not bad, bad
        print('ok', len({names!r}))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("ok")


# --- the checker itself catches what it must (a deliberately wrong tree) ---------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return {"radix_sync": tmp_path / "radix_sync", "sglang_kvrep": tmp_path / "sglang_kvrep",
            "kvrep_kernels": tmp_path / "kvrep_kernels"}


@pytest.mark.parametrize("importer,text,needle", [
    ("radix_sync/router/x.py", "import torch\n", "radix_sync must not import torch"),
    ("radix_sync/router/x.py", "def f():\n    from sglang_kvrep import agent\n", "must not import sglang_kvrep"),
    ("radix_sync/coordinator/x.py", "from radix_sync.sim.engine import run\n", "must not import radix_sync.sim"),
    ("radix_sync/coordinator/x.py", "from ..sim import engine\n", "must not import radix_sync.sim"),
    ("sglang_kvrep/x.py", "from kvrep_dev.cluster import Worker\n", "must not import kvrep_dev"),
    ("radix_sync/x.py", "import sglang.srt.server_args\n", "must not import sglang"),
    ("radix_sync/router/x.py", "from radix_sync.coordinator import admin\n", "must not import radix_sync.coordinator"),
    ("radix_sync/policy/x.py", "from radix_sync.sim.engine import run\n", "must not import radix_sync.sim"),
    ("radix_sync/protocol.py", "from radix_sync.policy import cost\n", "must not import radix_sync.policy"),
    ("sglang_kvrep/x.py", "from radix_sync.policy.cost import CostModel\n", "must not import radix_sync.policy"),
    ("sglang_kvrep/agent/x.py", "import sglang.srt\n", "must not import sglang outside sglang_kvrep.compat"),
    ("kvrep_kernels/x.py", "from radix_sync import hashing\n", "kvrep_kernels must not import radix_sync"),
])
def test_checker_refuses_a_forbidden_import(tmp_path, importer, text, needle):
    roots = _tree(tmp_path, {"radix_sync/__init__.py": "", "radix_sync/router/__init__.py": "",
                             "radix_sync/coordinator/__init__.py": "", "radix_sync/sim/__init__.py": "",
                             "radix_sync/sim/engine.py": "def run(): pass\n", "sglang_kvrep/__init__.py": "",
                             importer: text})
    found = violations(roots)
    assert any(needle in v for v in found), found


def test_checker_finds_a_circle_and_a_long_module(tmp_path):
    roots = _tree(tmp_path, {"radix_sync/__init__.py": "", "radix_sync/a.py": "from radix_sync import b\n",
                             "radix_sync/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                "    from radix_sync.a import A\n",
                             "radix_sync/long.py": "x = 1\n" * 501, "sglang_kvrep/__init__.py": ""})
    found = violations(roots)
    assert "import circle: radix_sync.a -> radix_sync.b" in found
    assert "radix_sync.long: 501 lines (> 500)" in found
    clean = _tree(tmp_path / "ok", {"radix_sync/__init__.py": "", "radix_sync/a.py": "from radix_sync import b\n",
                                    "radix_sync/b.py": "import json\n", "sglang_kvrep/__init__.py": "",
                                    "radix_sync/cli.py": "from radix_sync.sim import engine\n",
                                    "radix_sync/sim/engine.py": "from radix_sync.policy import cost\n",
                                    "sglang_kvrep/compat/x.py": "import sglang.srt\n",
                                    "sglang_kvrep/y.py": "from radix_sync import protocol\n"})
    assert violations(clean) == []


def test_kernels_folder_is_not_a_package_and_hf_kernels_still_imports():
    """kernels/ is a source folder: the page-copy package inside it must never shadow the HF `kernels` package."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    res = subprocess.run([sys.executable, "-c", "import kernels, kvrep_kernels, os; print(os.path.dirname(kernels.__file__))"],
                         capture_output=True, text=True, cwd=str(ROOT / "tests"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "site-packages" in res.stdout, res.stdout


def test_install_roles_in_pyproject():
    """The base distribution (coordinator, router, simulator) needs neither torch nor sglang; `[worker]` adds the one
    supported SGLang; `[dev]` adds the worker side and the test/bench tools."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = [d.split(";")[0].replace(" ", "") for d in meta["dependencies"]]
    assert not [d for d in base if d.lower().startswith(("torch", "sglang", "triton", "msgpack"))], base
    extras = meta["optional-dependencies"]
    assert extras["worker"] == ["sglang==0.5.23"]
    assert any(d.startswith("sglang-kvrep[") and "worker" in d for d in extras["dev"]), extras["dev"]
    assert "sglang==0.5.23" in (ROOT / "requirements-pins.txt").read_text().split()
    # `--kvrep-transport nixl|mooncake`: extras of the worker, pinned as the tests run them
    for name, prefix in (("nixl", "nixl"), ("mooncake", "mooncake-")):
        engine = [d for d in extras[name] if d.startswith(prefix)]
        assert engine and all(d in (ROOT / "requirements-pins.txt").read_text().split() for d in engine), engine
        assert any(d.startswith("sglang-kvrep[") and name in d for d in extras["dev"]), extras["dev"]
    assert meta["entry-points"]["kvrep.commands"] == {"dev": "kvrep_dev.cli:add_commands"}
