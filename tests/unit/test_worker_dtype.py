"""The dtype local CPU workers run with: float32 where the CPU has no native bf16 (bf16 matmuls take a slow path
there), the model's own elsewhere, an explicit choice always wins."""
from kvrep_dev import cluster


def cpuinfo(tmp_path, flags: str):
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    return str(f)


def test_native_bf16_from_the_cpu_flags(tmp_path):
    assert not cluster.cpu_has_native_bf16(cpuinfo(tmp_path, "avx2 avx512f"))
    assert cluster.cpu_has_native_bf16(cpuinfo(tmp_path, "avx2 avx512f avx512_bf16"))
    assert cluster.cpu_has_native_bf16(cpuinfo(tmp_path, "avx2 amx_bf16 amx_tile"))
    assert cluster.cpu_has_native_bf16(str(tmp_path / "missing"))  # unknown host: keep the model's dtype


def test_worker_dtype_args(monkeypatch):
    monkeypatch.delenv("KVREP_WORKER_DTYPE", raising=False)
    monkeypatch.setattr(cluster, "cpu_has_native_bf16", lambda: False)
    assert cluster.worker_dtype_args() == ["--dtype", "float32"]
    assert cluster.worker_dtype_args(("--dtype", "bfloat16")) == []  # the caller's own --dtype wins
    monkeypatch.setattr(cluster, "cpu_has_native_bf16", lambda: True)
    assert cluster.worker_dtype_args() == []
    monkeypatch.setenv("KVREP_WORKER_DTYPE", "float32")
    assert cluster.worker_dtype_args() == ["--dtype", "float32"]
    monkeypatch.setenv("KVREP_WORKER_DTYPE", "auto")
    monkeypatch.setattr(cluster, "cpu_has_native_bf16", lambda: False)
    assert cluster.worker_dtype_args() == []
