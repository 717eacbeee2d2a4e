"""Builds what a GPU-less host needs to run real SGLang servers, without any download.

- `models/tiny`, `models/small` and `models/wide`: Llama-architecture models with seeded random weights and a
  byte-level BPE tokenizer trained on the Python standard library's sources (see ../shared/docs/sglang-on-cpu.md).
  `wide` is the CPU testbed's model with a GPU's economics: a narrow attention (2 query heads, 1 KV head) and a
  wide MLP, so that a prefill's cost is mostly in the linear layers, which a cache hit skips. On the CPU,
  SGLang's `torch_native` attention recomputes attention over a cached prefix (each extend's query is padded to
  the whole sequence), so with `small` a hit on a 2,000-token prefix saves only ~63% of the cold prefill; on a GPU
  it saves nearly all of it. `scripts/hit_savings.py` measures it (docs/testbed.md).
- `libcuda/libcuda.so.1`: a stand-in that lets the CUDA-only `sgl_kernel` wheel import on a host without an
  NVIDIA driver (only built where no driver's `libcuda.so.1` can be loaded at all: a dlopen check, which follows
  LD_LIBRARY_PATH and the loader cache). Every function returns CUDA_ERROR_NO_DEVICE. Put last on LD_LIBRARY_PATH,
  never ahead of a real one (`with_stand_in`).

Usage: `python -m kvrep_dev.prepare <cache dir>`; idempotent (a marker file per artefact).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable

MODELS = {
    # name: (hidden, layers, heads, kv_heads, intermediate, head_dim)
    "tiny": (128, 2, 4, 2, 352, 32),
    "small": (512, 8, 8, 4, 1408, 64),
    "wide": (1024, 4, 2, 1, 4096, 64),
}
VOCAB_SIZE = 4096
MAX_POSITIONS = 32768
_STUB_C = r"""
typedef int CUresult;
CUresult cuPointerGetAttribute(void *d, int a, unsigned long long p) { return 100; }
CUresult cuInit(unsigned int f) { return 100; }
CUresult cuDriverGetVersion(int *v) { if (v) *v = 0; return 100; }
CUresult cuDeviceGetCount(int *c) { if (c) *c = 0; return 100; }
CUresult cuGetProcAddress(const char *s, void **p, int v, unsigned long long f) { if (p) *p = 0; return 100; }
CUresult cuGetProcAddress_v2(const char *s, void **p, int v, unsigned long long f, void *st) { if (p) *p = 0; return 100; }
"""


STUB_MARKER = ".kvrep-libcuda-stand-in"  # next to our stand-in: such a folder is never taken for a driver
# A symbol every real libcuda.so.1 exports and the stand-in does not, so that a stand-in found first on the loader's
# path is never taken for a driver.
_DRIVER_SYMBOL = "cuMemAlloc_v2"
_PROBE = (
    "import ctypes, sys\n"
    "try:\n"
    "    lib = ctypes.CDLL('libcuda.so.1')\n"
    "except OSError:\n"
    "    sys.exit(1)\n"
    f"sys.exit(0 if hasattr(lib, '{_DRIVER_SYMBOL}') else 1)\n"
)


def _without_stand_ins(ld_library_path: str) -> str:
    """LD_LIBRARY_PATH less the folders holding one of our stand-ins (any clone's)."""
    keep = [d for d in ld_library_path.split(os.pathsep) if d and not os.path.exists(os.path.join(d, STUB_MARKER))]
    return os.pathsep.join(keep)


def _dlopen_libcuda(ld_library_path: str) -> bool:
    """Whether `libcuda.so.1` loads (dlopen: LD_LIBRARY_PATH, then the loader cache and the default folders) and is
    a driver. In a child process: the loader reads LD_LIBRARY_PATH only at process start, and this one's stays
    free of a loaded libcuda."""
    env = dict(os.environ, LD_LIBRARY_PATH=ld_library_path)
    try:
        return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def has_nvidia_driver(load: Callable[[str], bool] = _dlopen_libcuda, ld_library_path: str | None = None) -> bool:
    """Whether a driver's `libcuda.so.1` can be loaded at all, our stand-ins left off the path. `load` takes the
    LD_LIBRARY_PATH to try and says whether a driver loads with it (injectable for tests)."""
    if ld_library_path is None:
        ld_library_path = os.environ.get("LD_LIBRARY_PATH", "")
    return load(_without_stand_ins(ld_library_path))


def build_libcuda_stub(out_dir: Path, driver: Callable[[], bool] = has_nvidia_driver) -> Path | None:
    """Returns the folder to put on LD_LIBRARY_PATH (after any other entry: `with_stand_in`), or None where a
    driver can be loaded."""
    if driver():
        return None
    target = out_dir / "libcuda.so.1"
    if not target.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "stub.c"
            src.write_text(_STUB_C)
            subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o", str(target), str(src)],
                           check=True)
    (out_dir / STUB_MARKER).touch()
    return out_dir


def with_stand_in(ld_library_path: str, stub_dir: str | None) -> str:
    """LD_LIBRARY_PATH with the stand-in's folder last, so that it never hides a libcuda found on the path."""
    dirs = [d for d in ld_library_path.split(os.pathsep) if d and d != stub_dir]
    if stub_dir:
        dirs.append(stub_dir)
    return os.pathsep.join(dirs)


def _train_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(glob.glob(str(stdlib / "*.py")))[:120]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", chat_template=chat_template)
    fast.save_pretrained(out_dir)
    return fast


def build_model(name: str, out_dir: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, inter, head_dim = MODELS[name]
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=MAX_POSITIONS, rope_theta=10000.0, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = out_dir.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp / f.name)
    (tmp / "kvrep_model.json").write_text(json.dumps({"name": name, "seed": 1234, "note": "random weights"}))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def prepare(cache_dir: Path) -> dict:
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = {"libcuda_dir": None, "models": {}}
    stub = build_libcuda_stub(cache_dir / "libcuda")
    out["libcuda_dir"] = str(stub) if stub else None
    models_dir = cache_dir / "models"
    tok_dir = models_dir / "_tokenizer"
    for name in MODELS:
        model_dir = models_dir / name
        if not (model_dir / "kvrep_model.json").exists():
            if not (tok_dir / "tokenizer.json").exists():
                tok_dir.mkdir(parents=True, exist_ok=True)
                _train_tokenizer(tok_dir)
            print(f"[prepare] building local model {name} in {model_dir}", flush=True)
            build_model(name, model_dir, tok_dir)
        out["models"][name] = str(model_dir)
    return out


if __name__ == "__main__":
    cache = Path(sys.argv[1] if len(sys.argv) > 1 else ".cache").resolve()
    print(json.dumps(prepare(cache)))
