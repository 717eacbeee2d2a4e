"""The CPU testbed with a GPU's economics: what `kvrep up`, `kvrep demo` and `kvrep bench` run by default.

Two ways a CPU cluster is unlike a GPU one, and what this module sets against each (docs/testbed.md has the
numbers and the commands that measured them):
- **What a cache hit saves.** SGLang's `torch_native` CPU attention pads each extend's query to the whole sequence,
  so attention over a cached prefix is recomputed and only the linear layers shrink to the new tokens. The local
  `wide` model (hidden 1024, 4 layers, 2 query heads x 64, 1 KV head, MLP 4096: `kvrep_dev/prepare.py`) puts most
  of a prefill's cost in the linear layers: a hit on a 2,000-token prefix saves ~90% of the cold prefill here
  (`small`: ~40-63%), as on a GPU, where extending a cached prefix is nearly free.
- **What a copy costs relative to a prefill.** Loopback ZeroMQ moves KV far faster, relative to the CPU's prefill,
  than a 24 GB/s NIC does relative to an H200's. The data plane's per-link cap (`--kvrep-send-rate-mbps`) is set
  so that a copy's time per token over the testbed's prefill time per token equals the same ratio for
  Llama-3.1-8B on an H200 over 24 GB/s: 131,072 B/token / 23.75 GB/s = 5.5 us vs a 26.3 us prefill per token
  (`radix_sync/profiles/llama3.1-8b-h200.json`), ratio 0.21.
- **Spare compute.** One worker per core, each pinned to its core (two on a 2-core machine), `OMP_NUM_THREADS=1`;
  the router, coordinator and client are light and float.
- **When a first token goes out.** SGLang's overlap scheduler launches batch N+1 before it hands out batch N's
  tokens (`Scheduler.event_loop_overlap`, sglang 0.5.23 `srt/managers/scheduler.py`). On a GPU the launch returns at
  once and N's first tokens go out while N+1 computes; on a CPU the launch is the compute, so every prefill whose
  worker has more work queued waits for the next batch's forward too: a lone 2,000-token prompt followed 0.1 s later
  by another took 2.74 s to its first token instead of 1.35 s (`scripts/overlap_probe.py`,
  docs/results/overlap-probe.json). The testbed's workers run with `--disable-overlap-schedule` (`WORKER_ARGS`):
  each batch's tokens go out when its forward ends, as on a GPU.
"""
from __future__ import annotations

import os

from radix_sync.policy.cost import load_profile

MODEL = "wide"
PROFILE = "cpu-wide"
"""Measured on the testbed by `scripts/calibrate_cpu.py --model wide --out radix_sync/profiles/cpu-wide.json`; its
link bandwidth is the cap below (the data plane enforces it with a token bucket)."""
MACHINE_PROFILE = "cpu-wide-bench"
"""What the simulator runs on as the testbed machine (`kvrep bench --simulate`, `--resimulate`): `PROFILE`'s terms
with prefill terms fitted on the requests of saved bench runs that ran alone (`scripts/calibrate_cpu.py
--from-bench`); the live router and planner price with `PROFILE`, and so do the simulated ones."""
GPU_PROFILE = "llama3.1-8b-h200"
WORKER_ARGS = ("--disable-overlap-schedule",)
"""SGLang flags of every testbed worker (see the module's docstring; `--overlap-schedule` leaves SGLang's default)."""
FRONTEND_CPU_S = {"kvrep": 0.0165, "smg": 0.0092}
"""CPU seconds a request costs the testbed's processes other than the workers' schedulers, above what they use idle
(what `EngineConfig.frontend_cpu_s` runs on the shared cores beside the workers in `kvrep bench --simulate` and
`--resimulate`), through our router ("kvrep": router 4.7 ms, coordinator 2.3, the two SGLang HTTP/tokenizer
processes 6.4 together, the detokenizers 1.6, the client 1.5) and through smg 1.13 ("smg": smg 1.0, coordinator
0.2, SGLang 5.3, detokenizer 1.3, client 1.3). Measured 2026-12-07 with `scripts/front_door_cpu.py --requests 150
--rate 4 --idle-s 20` on a `kvrep up --workers 2 --model wide` cluster, each front door in turn (150 streamed
~1,900-token prompts, 8 output tokens)."""


def copy_to_prefill_ratio(profile_name: str = GPU_PROFILE) -> float:
    """Seconds to copy one token's KV over one link / seconds to prefill one token, for a profile."""
    v = load_profile(profile_name)
    return (v.kv_bytes_per_token / v.nic_bandwidth_bytes_per_s) / v.prefill_s_per_token


def send_rate_mbps(cpu_profile: str = PROFILE, gpu_profile: str = GPU_PROFILE) -> float:
    """The per-link cap (MB/s) that gives the CPU profile's model the GPU profile's copy/prefill ratio."""
    cpu = load_profile(cpu_profile)
    copy_s_per_token = copy_to_prefill_ratio(gpu_profile) * cpu.prefill_s_per_token
    return round(cpu.kv_bytes_per_token / copy_s_per_token / 1e6, 2)


def cores() -> list[int]:
    """The cores this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def default_workers() -> int:
    """One worker per core (at least two, so there is somewhere to copy to)."""
    return max(2, len(cores()))


def core_for(i: int) -> int:
    """The core worker `i` is pinned to."""
    cs = cores()
    return cs[i % len(cs)]
