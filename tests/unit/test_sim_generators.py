"""The generators of issue 16: flash-crowd, resume-burst, multi-candidate, the no-sharing control (shape, rate,
determinism)."""

import pytest

from radix_sync.sim.generators import GENERATORS, GeneratorConfig

CTX = 131072


def make(name, rate=20.0, duration_s=120.0, seed=1, **cfg):
    return GENERATORS[name](GeneratorConfig(**cfg), rate, duration_s, seed, CTX)


def pages_ok(r, page=64):
    assert len(r.pages) == r.prompt_len // page and r.prompt_len + r.output_len <= CTX


def test_flash_crowd_ramps_a_new_hot_prefix_each_period():
    wl = make("flash-crowd", rate=20.0, duration_s=120.0, flash_period_s=60.0, flash_ramp_s=20.0)
    reqs = sorted(wl.open_requests, key=lambda r: r.arrival_s)
    assert len(reqs) == pytest.approx(20.0 * 120, rel=0.1)
    for r in reqs:
        pages_ok(r)
    crowd = [r for r in reqs if r.arrival_s < 60.0]
    hot = crowd[0].pages[: 8192 // 64]
    assert all(r.pages[: len(hot)] == hot for r in crowd)  # one hot prefix per crowd
    assert reqs[-1].pages[0] != hot[0]  # the next crowd has another
    # the ramp: the first 10 s carry ~1/4 of the rate of the held phase (mean 0.25 vs 1 of the peak)
    first = sum(r.arrival_s < 10.0 for r in crowd)
    held = sum(30.0 <= r.arrival_s < 40.0 for r in crowd)
    assert first < 0.5 * held


def test_resume_burst_turns_resume_together_after_tool_calls():
    wl = make("resume-burst", rate=8.0, duration_s=90.0, resume_period_s=30.0, resume_window_s=2.0, resume_turns=3)
    reqs = wl.open_requests
    for r in reqs:
        pages_ok(r)
    # first turns spread over the first half of a period; resumed turns within 2 s after a boundary
    assert all(r.arrival_s % 30.0 <= 2.0 for r in reqs if r.stop == "end_turn")
    assert not any(r.arrival_s % 30.0 > 15.0 for r in reqs)
    by_first = {}
    for r in sorted(reqs, key=lambda r: r.arrival_s):
        by_first.setdefault(r.pages[0], []).append(r)
    for turns in by_first.values():  # each session's turns extend its history
        assert [t.stop for t in turns][:-1] == ["tool_use"] * (len(turns) - 1)
        for a, b in zip(turns, turns[1:]):
            assert b.pages[: len(a.pages)] == a.pages and b.prompt_len > a.prompt_len
    # batches of 8 x 30 / 3 = 80 sessions; once three batches overlap (from 60 s) the rate is 8/s
    assert sum(r.arrival_s >= 60.0 for r in reqs) == 80 * 3


def test_multi_candidate_sends_k_copies_of_one_long_prompt_together():
    wl = make("multi-candidate", rate=16.0, duration_s=60.0, multi_k=8)
    jobs = {}
    for r in wl.open_requests:
        pages_ok(r)
        jobs.setdefault(r.arrival_s, []).append(r)
    assert all(len(j) == 8 and all(r.pages == j[0].pages for r in j) for j in jobs.values())
    assert len({j[0].pages[0] for j in jobs.values()}) == len(jobs)  # every job its own prompt
    assert len(wl.open_requests) == pytest.approx(16.0 * 60, rel=0.3)


def test_no_sharing_never_repeats_a_page_and_nothing_copies_or_hits():
    wl = make("no-sharing", rate=20.0, duration_s=60.0)
    seen = set()
    for r in wl.open_requests:
        pages_ok(r)
        assert not seen & set(r.pages)
        seen |= set(r.pages)
    assert len(wl.open_requests) == pytest.approx(20.0 * 60, rel=0.2)
    from radix_sync.policy.cost import load_profile
    from radix_sync.sim.engine import Engine, EngineConfig
    from radix_sync.sim.policies import build_policy

    prof = load_profile("llama3.1-8b-h200")
    wl = make("no-sharing", rate=20.0, duration_s=30.0)
    r = Engine(prof, wl, build_policy("kvrep", prof, wl.page_len, 1), EngineConfig(num_workers=4,
                                                                                   duration_s=30.0)).run().to_dict()
    assert r["num_requests"] == r["num_arrived"] > 0
    assert r["prefix_hit_rate"] == 0.0 and r["replication"]["count"] == 0


@pytest.mark.parametrize("name", ["flash-crowd", "resume-burst", "multi-candidate", "no-sharing"])
def test_generators_are_deterministic_and_run_in_the_engine(name):
    a = [(r.arrival_s, r.prompt_len, r.pages) for r in make(name, duration_s=30.0).open_requests]
    assert a == [(r.arrival_s, r.prompt_len, r.pages) for r in make(name, duration_s=30.0).open_requests]
    assert a != [(r.arrival_s, r.prompt_len, r.pages) for r in make(name, duration_s=30.0, seed=2).open_requests]
    from radix_sync.policy.cost import load_profile
    from radix_sync.sim.engine import Engine, EngineConfig
    from radix_sync.sim.policies import build_policy

    prof = load_profile("llama3.1-8b-h200")
    wl = make(name, rate=5.0, duration_s=30.0)
    stats = Engine(prof, wl, build_policy("kvrep", prof, wl.page_len, 1), EngineConfig(num_workers=4,
                                                                                       duration_s=30.0)).run()
    assert stats.to_dict()["num_requests"] == stats.num_arrived > 0
