#!/usr/bin/env bash
# The GPU checks of issue 18, for one H200 (or any CUDA GPU): at most ~8 minutes, every step time-boxed and
# independent of the others (one failing does not stop the next), all output in one folder ($OUT, default
# ./gpu-check-out: summary.txt + one file per step, 8 files at most). Needs python3 with torch, triton, xxhash and
# pytest (and transformers for the profile step, msgspec and pyzmq for the agent step: where the image lacks them,
# install wheels carried in first, docs/gpu.md); downloads nothing.
#
#   OUT=/some/dir bash scripts/gpu_check.sh
#   OUT=/some/dir STEPS="hazards agent" bash scripts/gpu_check.sh      # only those steps
#
# Steps:
#   env        the GPU, driver, torch and triton versions
#   kernels    kernel correctness against the CPU reference over every pool kind, layout, dtype and page size, the
#              16-byte kernel on real memory, on a side stream (the CUDA tests of tests/unit/test_kernels_*.py; the
#              others run Triton's interpreter, CI's job: on the GPU image's numpy 2.5 that interpreter fails)
#   hazards    the two stream hazards fenced and unfenced (scripts/gpu_ordering.py: fenced must be correct), and a
#              global-mode CUDA-graph capture while another thread drops (or allocates) pinned buffers
#   agent      one replication through the real agent end to end (scripts/gpu_agent_path.py): two agents on CUDA
#              pools, their I/O threads, ZeroMQ over loopback, a stand-in coordinator; 4K and 32K tokens of
#              Llama-3.1-8B geometry, forwards idle and 5 ms steps: bit-identical pages, locks and slots balanced,
#              the rate and the scheduler thread's step times
#   bench      scripts/bench_kernels.py --device cuda at Llama-3.1-8B geometry, 4K and 32K tokens, pages of 16 and 1,
#              against torch's own device copy in the same run
#              and what issuing one gather costs the calling thread (scripts/gpu_issue_cost.py: alone, beside a
#              thread running Python, launch descriptions kept or not, a profile)
#   sglang     two CUDA SGLang servers replicating a 32K-token prefix: only where sglang is installed (it is not on
#              this project's GPU image, and nothing can be fetched there): says so otherwise
#   profile    the llama3.1-8b-h200 profile's prefill and decode terms re-measured (scripts/gpu_profile.py)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/kernels:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

step() {  # step NAME SECONDS COMMAND...   (STEPS="kernels agent": only those)
    local name=$1 limit=$2 start rc
    shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
    echo "== $name (at most ${limit} s): $*" | tee -a "$SUMMARY"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
    rc=$?
    echo "   $name: exit $rc after $(( $(date +%s) - start )) s$([ $rc = 124 ] && echo ' (TIMED OUT)')" | tee -a "$SUMMARY"
    tail -n 3 "$OUT/$name.txt" | sed 's/^/   | /' | tee -a "$SUMMARY"
}

step env 20 bash -c 'nvidia-smi; '"$PY"' -c "import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, torch.cuda.get_device_name())"'
step kernels 90 "$PY" -m pytest -q -p no:cacheprovider --noconftest -o addopts="" -k cuda \
    tests/unit/test_kernels_reference.py tests/unit/test_kernels_triton.py
step hazards 45 "$PY" scripts/gpu_ordering.py
step agent 120 "$PY" scripts/gpu_agent_path.py --tokens 4096,32768 --page-sizes 16 --forward-ms 0,5
step bench 90 bash -c "$PY scripts/bench_kernels.py --device cuda --tokens 4096 --page-sizes 16,1 && \
    $PY scripts/bench_kernels.py --device cuda --tokens 32768 --page-sizes 16,1; $PY scripts/gpu_issue_cost.py"
if "$PY" -c "import sglang" 2>/dev/null; then
    echo "== sglang: installed here; a two-server replication check is not written (see docs/gpu.md)" | tee -a "$SUMMARY"
else
    echo "== sglang: not installed on this machine (and nothing can be fetched): two-server check skipped" | tee -a "$SUMMARY"
fi
step profile 110 "$PY" scripts/gpu_profile.py --json "$OUT/profile.json"
echo "done: $OUT" | tee -a "$SUMMARY"
