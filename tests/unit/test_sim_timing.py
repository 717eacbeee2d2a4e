"""The simulator's timing on one worker, computed by hand."""

import pytest

from radix_sync.policy.cost import CostProfile
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.engine import Engine
from radix_sync.sim.policies import build_policy
from radix_sync.sim.workload import SimRequest, Workload

# prefill: 10 ms per iteration + 1 ms per token (+ 1 us per token pair when set); decode: 20 ms per step.
PROFILE = CostProfile(name="t", kv_bytes_per_token=1, kv_capacity_tokens=100_000, max_context_len=100_000,
                      chunked_prefill_len=1000, max_running_requests=64, prefill_overhead_s=0.01,
                      prefill_s_per_token=0.001, prefill_s_per_token_pair=0.0, decode_step_s=0.02,
                      decode_s_per_request=0.0, decode_s_per_ctx_token=0.0, nic_bandwidth_bytes_per_s=1e9,
                      transfer_latency_s=0.0)


class Fixed(Workload):
    page_len = 10

    def __init__(self, specs):
        super().__init__()
        for t, prompt, out, pages in specs:
            self.open_requests.append(SimRequest(self.new_rid(), prompt, out, pages, arrival_s=t))


def run(specs, profile=PROFILE, policy="round_robin"):
    wl = Fixed(specs)
    eng = Engine(profile, wl, build_policy(policy, profile, wl.page_len, 0), EngineConfig(num_workers=1,
                                                                                          duration_s=100.0))
    eng.run()
    for w in eng.workers:
        w.cache.check_integrity()
        assert w.cache.reserved_tokens == 0
    return {r.rid: r for r in wl.open_requests}


def test_prefill_decode_and_a_prefix_hit():
    # A: prefill 0.01 + 100 x 0.001 = 0.11 s -> first token at 0.11; 2 decode steps -> finish 0.15, TPOT 0.02.
    # B (same prompt, at 1.0): 100 tokens cached but the last one is recomputed: 0.01 + 0.001 = 0.011 s.
    pages = list(range(1, 11))
    r = run([(0.0, 100, 3, pages), (1.0, 100, 3, pages)])
    assert r[0].first_token_s == pytest.approx(0.11)
    assert r[0].finish_s == pytest.approx(0.15)
    assert r[1].cached_len == 99
    assert r[1].first_token_s - 1.0 == pytest.approx(0.011)


def test_chunked_prefill():
    # 2500 tokens in chunks of 1000: 3 iterations x 10 ms + 2.5 s.
    r = run([(0.0, 2500, 1, list(range(1, 251)))])
    assert r[0].first_token_s == pytest.approx(2.53)


def test_a_chunked_prefill_leaves_a_radix_node_per_chunk():
    """SGLang inserts each chunk into its tree as it is done (`cache_unfinished_req`): a node per chunk, so
    whole-node eviction takes the last chunk's pages first, not the whole prompt."""
    wl = Fixed([(0.0, 2500, 1, list(range(1, 251)))])
    eng = Engine(PROFILE, wl, build_policy("round_robin", PROFILE, wl.page_len, 0), EngineConfig(num_workers=1,
                                                                                            duration_s=100.0))
    eng.run()
    tree = eng.workers[0].cache.tree
    assert [p for p, n in tree.nodes.items() if n.split_below] == [100, 200, 250]  # chunk ends, the prompt's end
    gone = []
    tree.evict(1, gone.append)
    assert gone == list(range(250, 200, -1))  # pages 201-250: the last chunk's node, whole


def test_attention_term():
    # one chunk of 100 tokens after nothing cached: pairs = 100 x 101 / 2 = 5050 -> +5.05 ms
    prof = CostProfile(**{**PROFILE.__dict__, "prefill_s_per_token_pair": 1e-6})
    r = run([(0.0, 100, 1, [])], profile=prof)
    assert r[0].first_token_s == pytest.approx(0.11 + 0.00505)


def test_arrival_cuts_a_decode_stretch_at_the_next_step():
    # A: prefill 0.02, then 10 decode steps (would end 0.22). B arrives at 0.05, mid-step (steps end at 0.04,
    # 0.06): B's prefill runs 0.06-0.08 (TTFT 0.03). B decodes 1 step with A (0.08-0.10); A then needs
    # 10 - 2 - 1 = 7 more steps: 0.10 + 0.14 = 0.24.
    r = run([(0.0, 10, 11, [1]), (0.05, 10, 2, [2])])
    assert r[0].first_token_s == pytest.approx(0.02)
    assert r[1].first_token_s == pytest.approx(0.08)
    assert r[1].finish_s == pytest.approx(0.10)
    assert r[0].finish_s == pytest.approx(0.24)


def test_requests_arriving_during_an_iteration_are_batched_in_the_next():
    # A (10 tokens) prefills 0-0.02. B (10) and C (20) arrive at 0.01 and share the next prefill iteration:
    # 0.01 + 0.03 = 0.04 s, so both get their first token at 0.06.
    r = run([(0.0, 10, 1, [1]), (0.01, 10, 1, [5]), (0.01, 20, 1, [3, 4])])
    assert r[0].first_token_s == pytest.approx(0.02)
    assert r[1].first_token_s == pytest.approx(0.06)
    assert r[2].first_token_s == pytest.approx(0.06)


def test_decode_step_in_progress_closed_form_matches_the_scan():
    from radix_sync.policy.cost import load_profile
    from radix_sync.sim.worker import SimWorker
    w = SimWorker.__new__(SimWorker)
    w.p = load_profile("llama3.1-8b-h200")
    w._macro_k, w._macro_b, w._macro_ctx, w.iter_start_s = 300, 64, 2_000_000, 1.0
    w.shared = False
    for now in (1.0, 1.0001, 1.05, 1.5, 2.0, w.iter_start_s + w.p.decode_steps_s(300, 64, 2_000_000)):
        scan = next(k for k in range(1, 301) if 1.0 + w.p.decode_steps_s(k, 64, 2_000_000) >= now)
        assert w._steps_done_by(now) == scan, now
    # processor sharing: 0.1 s of work done by 1.5, half speed since -> work done at `now` = 0.1 + (now - 1.5) / 2
    w.shared, w.ps_done, w.ps_t, w.ps_speed = True, 0.1, 1.5, 0.5
    for now in (1.5, 1.6, 2.0, 3.0):
        scan = next(k for k in range(1, 301) if w.p.decode_steps_s(k, 64, 2_000_000) >= 0.1 + (now - 1.5) / 2)
        assert w._steps_done_by(now) == scan, now


def test_cached_prefix_term_and_workers_sharing_cores():
    # A cached-prefix term (torch_native-like): B extends A's 100 tokens by 10: 0.01 + 11 x 0.001 plus
    # 99 x 100 / 2 cached pairs x 1 us (99 cached: the last prompt token of A is recomputed).
    prof = CostProfile(**{**PROFILE.__dict__, "prefill_s_per_cached_pair": 1e-6})
    pages = list(range(1, 11))
    r = run([(0.0, 100, 1, pages), (1.0, 110, 1, pages + [99])], profile=prof)
    assert r[1].cached_len == 100
    assert r[1].first_token_s - 1.0 == pytest.approx(0.01 + 0.010 + 100 * 101 / 2 * 1e-6)

    # Three workers on two cores, processor sharing: three 0.11 s prefills at once each run at 2/3 speed.
    wl = Fixed([(0.0, 100, 1, [1]), (0.0, 100, 1, [2]), (0.0, 100, 1, [3])])
    eng = Engine(PROFILE, wl, build_policy("round_robin", PROFILE, wl.page_len, 0),
                 EngineConfig(num_workers=3, duration_s=10.0, shared_cores=2))
    eng.run()
    assert sorted(x.first_token_s for x in wl.open_requests) == pytest.approx([0.165, 0.165, 0.165])

    # Two at 0 run at full speed until the third starts at 0.05 (0.06 s of work left each), then at 2/3 speed:
    # done at 0.05 + 0.06 / (2/3) = 0.14; the third did 0.09 x 2/3 = 0.06 s of its 0.11 s by then, and finishes
    # the remaining 0.05 s alone at full speed: 0.19.
    wl = Fixed([(0.0, 100, 1, [1]), (0.0, 100, 1, [2]), (0.05, 100, 1, [3])])
    eng = Engine(PROFILE, wl, build_policy("round_robin", PROFILE, wl.page_len, 0),
                 EngineConfig(num_workers=3, duration_s=10.0, shared_cores=2))
    eng.run()
    assert [x.first_token_s for x in wl.open_requests] == pytest.approx([0.14, 0.14, 0.19])

    # Decode is shared too. A and B prefill alone (0.11 s) and start 2 decode steps (0.04 s) at 0.11; C arrives at
    # 0.12: three busy, 2/3 speed. A and B have 0.03 s of decode left -> 0.045 s -> finish at 0.165; C did 0.03 s of
    # its 0.11 s prefill by then and runs the remaining 0.08 s alone: first token at 0.245.
    wl = Fixed([(0.0, 100, 3, [1]), (0.0, 100, 3, [2]), (0.12, 100, 1, [3])])
    eng = Engine(PROFILE, wl, build_policy("round_robin", PROFILE, wl.page_len, 0),
                 EngineConfig(num_workers=3, duration_s=10.0, shared_cores=2))
    eng.run()
    a, b, c = wl.open_requests
    assert (a.finish_s, b.finish_s, c.first_token_s) == pytest.approx((0.165, 0.165, 0.245))


@pytest.mark.parametrize("policy,stale", [("kvrep_ungated", True), ("kvrep", False), ("kvrep_keep", False),
                                          ("cache_aware", False)])
def test_a_session_served_elsewhere_leaves_its_old_copy_evict_first(policy, stale):
    """`kvrep_ungated` demotes at once; `kvrep` asks its demotion gate, closed before any outcome (a control, not
    sent: tests/unit/test_demotion_gate.py); the others never demote."""
    wl = Fixed([])
    eng = Engine(PROFILE, wl, build_policy(policy, PROFILE, wl.page_len, 0), EngineConfig(num_workers=3,
                                                                                          duration_s=1.0))
    old, new, deeper = (w.cache for w in eng.workers)
    old.insert([1, 2, 3], 3, 0.0)            # where the session ran
    new.insert([1, 2, 3], 3, 1.0)            # copied here (a pull or a replica)
    deeper.insert([1, 2, 3, 4, 5], 5, 0.5)   # holds more of the next prompt: the better copy, kept as it is
    req = SimRequest(wl.new_rid(), 60, 1, [1, 2, 3, 4, 5, 6])
    req.followup = True  # the tracker saw it continue a finished turn
    eng.on_admit(eng.workers[1], req, 3, 2.0)
    assert old.tree.nodes[3].stale is stale and old.tree.nodes[1].stale is stale
    if policy == "kvrep":
        assert eng.demotion_gate.stats["controls"] == 1 and eng.demotion_gate.status()["pending"] == 1
    assert not any(n.stale for n in new.tree.nodes.values())
    assert not any(n.stale for n in deeper.tree.nodes.values())


def test_overlap_scheduler_on_a_synchronous_device_streams_outputs_one_iteration_late():
    def go(specs):
        wl = Fixed(specs)
        Engine(PROFILE, wl, build_policy("round_robin", PROFILE, wl.page_len, 0),
               EngineConfig(num_workers=1, duration_s=10.0, overlap_lag=True)).run()
        return wl.open_requests

    # A's prefill ends at 0.11; its first token goes out when the next iteration (one decode step, 0.02 s) ends:
    # 0.13. Its last step ends at 0.15 and nothing follows, so its finish goes out at once.
    (a,) = go([(0.0, 100, 3, [1])])
    assert (a.first_token_s, a.finish_s) == pytest.approx((0.13, 0.15))
    # B waits behind A's prefill (0 -> 0.11) and prefills 0.11 -> 0.22; A's first token is streamed only then,
    # together with B's (the worker goes idle): both at 0.22. Without the lag: 0.11 and 0.22.
    a, b = go([(0.0, 100, 1, [1]), (0.05, 100, 1, [2])])
    assert (a.first_token_s, b.first_token_s) == pytest.approx((0.22, 0.22))
    assert (a.finish_s, b.finish_s) == pytest.approx((0.22, 0.22))


def _first_token_with_frontend(cores, frontend_cpu_s):
    wl = Fixed([(0.0, 100, 3, list(range(1, 11)))])
    cfg = EngineConfig(num_workers=1, duration_s=100.0, shared_cores=cores, frontend_cpu_s=frontend_cpu_s)
    eng = Engine(PROFILE, wl, build_policy("round_robin", PROFILE, wl.page_len, 0), cfg)
    eng.run()
    assert len(eng.frontend) == 0
    return wl.open_requests[0].first_token_s


def test_front_end_cpu_shares_the_cores_with_the_workers():
    # one core: the request's 20 ms front-end job and its 0.11 s prefill share it (0.5 each) until the job ends at
    # 0.04 s (0.02 of the prefill done), then the prefill runs alone: first token at 0.04 + 0.09 = 0.13 s
    assert _first_token_with_frontend(1, 0.02) == pytest.approx(0.13)
    # two cores: the job runs on the core the worker does not use; not modelled: the same
    assert _first_token_with_frontend(2, 0.02) == pytest.approx(0.11)
    assert _first_token_with_frontend(1, 0.0) == pytest.approx(0.11)


def test_front_end_jobs_progress_together_and_end_in_order():
    from radix_sync.sim.cores import FrontEndJobs

    jobs = FrontEndJobs(0.01)
    jobs.start(0.0)
    jobs.start(0.0)
    assert jobs.respeed(0.0, 0.5) == pytest.approx(0.02)  # both at half speed: 0.01 s of work in 0.02 s
    jobs.advance(0.01)
    jobs.start(0.01)  # the third starts when the first two have 0.005 s done
    v = jobs.version
    assert jobs.respeed(0.01, 1.0 / 3) == pytest.approx(0.01 + 0.005 * 3) and jobs.version == v + 1
    jobs.finish(0.025)
    assert len(jobs) == 1
    assert jobs.respeed(0.025, 1.0) == pytest.approx(0.025 + 0.005)
    jobs.finish(0.03)
    assert len(jobs) == 0 and jobs.respeed(0.03, 1.0) is None
    with pytest.raises(ValueError):
        EngineConfig(frontend_cpu_s=-1.0)
