"""`TtftFloor`, the simulator's provable lower bound on a request's TTFT (issue 16 item 3): hand-computed on requests
of known shape, tight where nothing else runs, and beaten by no policy on any generator."""

import dataclasses

import pytest

from radix_sync.policy.cost import load_profile
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.engine import Engine
from radix_sync.sim.generators import GENERATORS, GeneratorConfig
from radix_sync.sim.policies import POLICIES, build_policy
from radix_sync.sim.workload import SimRequest, Workload

H200 = load_profile("llama3.1-8b-h200")
# 10 ms overhead a chunk, 1 ms a token, 1 us a (new token, earlier position) pair, chunks of 100 tokens
TOY = dataclasses.replace(H200, prefill_overhead_s=0.01, prefill_s_per_token=0.001, prefill_s_per_token_pair=1e-6,
                          prefill_s_per_cached_pair=0.0, chunked_prefill_len=100)


class Requests(Workload):
    def __init__(self, specs: list[tuple[list[int], int, float]]) -> None:
        super().__init__()
        self.page_len = 10
        self.open_requests = [SimRequest(self.new_rid(), length, 1, pages, arrival_s=t) for pages, length, t in specs]


def run(specs, policy="round_robin", workers=1, profile=TOY):
    wl = Requests(specs)
    eng = Engine(profile, wl, build_policy(policy, profile, wl.page_len, 1),
                 EngineConfig(num_workers=workers, duration_s=60.0, view_staleness_s=0.0))
    stats = eng.run()
    by_rid = {r.rid: r for r in wl.open_requests}
    return stats, by_rid


def test_floor_of_a_cold_prompt_is_its_chunked_prefill_and_an_idle_worker_reaches_it():
    a = list(range(1, 26))  # 25 pages, 250 tokens
    stats, reqs = run([(a, 250, 0.0)])
    # 3 chunks: 3 x 10 ms + 250 x 1 ms + (250 x 251 / 2) x 1 us = 0.03 + 0.25 + 0.031375
    assert stats.ttft_floor_s == [pytest.approx(0.311375)]
    assert reqs[0].first_token_s - reqs[0].arrival_s == pytest.approx(0.311375)


def test_floor_of_a_follow_up_counts_only_what_came_before_it_and_keeps_the_last_token():
    a = list(range(1, 26))
    # B (t=5) extends A by 5 pages; C (t=9) is A again exactly: all its pages seen, its last token still computed
    stats, reqs = run([(a, 250, 0.0), (a + [91, 92, 93, 94, 95], 300, 5.0), (a, 250, 9.0)])
    floors = dict(zip((r.rid for r in sorted(reqs.values(), key=lambda r: r.first_token_s)), stats.ttft_floor_s))
    # B: s = 250, n = 50: one chunk, 10 ms + 50 ms + (50 x 250 + 50 x 51 / 2) x 1 us
    assert floors[1] == pytest.approx(0.01 + 0.05 + (50 * 250 + 1275) * 1e-6)
    # C: s = 249, n = 1: 10 ms + 1 ms + (249 + 1) x 1 us
    assert floors[2] == pytest.approx(0.01 + 0.001 + 250e-6)
    for rid, floor in floors.items():
        assert reqs[rid].first_token_s - reqs[rid].arrival_s >= floor - 1e-12


def test_requests_arriving_together_do_not_lower_each_others_floor():
    a = list(range(1, 26))
    stats, _ = run([(a, 250, 0.0), (a, 250, 0.0), (a, 250, 0.0)], workers=3)
    assert stats.ttft_floor_s == [pytest.approx(0.311375)] * 3


GEN_RATES = {"agent": 40.0, "fanout": 30.0, "flash-crowd": 40.0, "resume-burst": 40.0, "multi-candidate": 20.0,
             "no-sharing": 40.0, "shared-prefix": 60.0}


@pytest.mark.parametrize("generator", sorted(GEN_RATES))
def test_no_policy_beats_the_floor_on_any_generator(generator):
    cfg = GeneratorConfig(fanout_k=8)
    ecfg = EngineConfig(num_workers=4, duration_s=10.0)
    below = []
    for name in sorted(POLICIES.names()):
        if name == "oracle":  # (the deprecated alias of free_copies)
            continue
        arrival = "bursty" if generator == "shared-prefix" else "poisson"
        wl = GENERATORS[generator](cfg, GEN_RATES[generator], 10.0, 1, H200.max_context_len, arrival)
        stats = Engine(H200, wl, build_policy(name, H200, wl.page_len, 1), ecfg).run()
        assert len(stats.ttft_s) == len(stats.ttft_floor_s) > 0
        below += [(name, t, f) for t, f in zip(stats.ttft_s, stats.ttft_floor_s) if t < f - 1e-9]
        rec = stats.to_dict()
        for q in ("mean", "p50", "p99"):
            assert rec["ttft_s"][q] >= rec["ttft_floor_s"][q] - 1e-9, (name, q)
    assert below == []
