"""The libcuda stand-in (kvrep_dev/prepare.py): built only when no driver's libcuda.so.1 can be loaded at all, and
never put ahead of a real one on LD_LIBRARY_PATH."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kvrep_dev import prepare as prep

DRIVER_C = "int cuMemAlloc_v2(void *p, unsigned long n) { return 0; }\nint cuInit(unsigned int f) { return 0; }\n"


def fake_loader(driver_dirs=(), in_cache=False):
    """Stands in for the dynamic loader: a driver is found in one of `driver_dirs` when that folder is on the
    LD_LIBRARY_PATH it is given, or in the loader cache when `in_cache`. Records each path it was asked about."""
    asked = []

    def load(ld_library_path: str) -> bool:
        asked.append(ld_library_path)
        return in_cache or any(d in ld_library_path.split(os.pathsep) for d in driver_dirs)

    load.asked = asked
    return load


def test_a_loadable_driver_means_no_stand_in(tmp_path):
    load = fake_loader(in_cache=True)
    assert prep.has_nvidia_driver(load, ld_library_path="")
    assert prep.build_libcuda_stub(tmp_path / "libcuda", driver=lambda: prep.has_nvidia_driver(load, "")) is None
    assert not (tmp_path / "libcuda").exists()


def test_no_driver_means_a_stand_in(tmp_path):
    load = fake_loader()
    assert not prep.has_nvidia_driver(load, ld_library_path="/usr/local/lib")
    out = prep.build_libcuda_stub(tmp_path / "libcuda", driver=lambda: prep.has_nvidia_driver(load, ""))
    assert out == tmp_path / "libcuda"
    assert (out / "libcuda.so.1").is_file() and (out / prep.STUB_MARKER).exists()


def test_a_driver_only_on_ld_library_path_means_no_stand_in(tmp_path):
    load = fake_loader(driver_dirs=["/opt/nvidia/lib64"])
    path = os.pathsep.join(["/usr/local/lib", "/opt/nvidia/lib64"])
    assert prep.has_nvidia_driver(load, ld_library_path=path)
    assert load.asked == [path]
    assert prep.build_libcuda_stub(tmp_path / "libcuda", driver=lambda: prep.has_nvidia_driver(load, path)) is None
    assert not (tmp_path / "libcuda").exists()
    assert not prep.has_nvidia_driver(load, ld_library_path="/usr/local/lib")


def test_our_stand_ins_are_left_off_the_path_the_check_tries(tmp_path):
    stub = prep.build_libcuda_stub(tmp_path / "libcuda", driver=lambda: False)
    load = fake_loader(driver_dirs=["/opt/nvidia/lib64"])
    assert prep.has_nvidia_driver(load, ld_library_path=os.pathsep.join([str(stub), "/opt/nvidia/lib64"]))
    assert load.asked == ["/opt/nvidia/lib64"]


def test_the_stand_in_goes_last_on_the_path():
    assert prep.with_stand_in("", "/s") == "/s"
    assert prep.with_stand_in(os.pathsep.join(["/s", "/drv", "/x"]), "/s") == os.pathsep.join(["/drv", "/x", "/s"])
    assert prep.with_stand_in("/drv", None) == "/drv"


def _build(tmp_path: Path, name: str, source: str) -> Path:
    out = tmp_path / name
    out.mkdir()
    (tmp_path / f"{name}.c").write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out / "libcuda.so.1"),
                    str(tmp_path / f"{name}.c")], check=True)
    return out


def test_the_real_dlopen_check_follows_ld_library_path(tmp_path):
    """The default loader, for real: a library exporting a driver's symbol found only through LD_LIBRARY_PATH
    counts as a driver; our stand-in found first does not, and is left off the path so the driver behind it is
    found."""
    drv = _build(tmp_path, "drv", DRIVER_C)
    stub = prep.build_libcuda_stub(tmp_path / "stub", driver=lambda: False)
    assert prep._dlopen_libcuda(str(drv))
    assert not prep._dlopen_libcuda(str(stub))  # the stand-in, ahead of any loader-cache driver, lacks the symbol
    assert prep.has_nvidia_driver(ld_library_path=os.pathsep.join([str(stub), str(drv)]))
