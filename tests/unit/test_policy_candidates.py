"""The one candidate rule the simulator and the live coordinator share (`radix_sync.policy.candidates`)."""
import pytest

from radix_sync.policy.candidates import all_busy, busy_mask, is_candidate
from radix_sync.policy.cost import CostModel, CostProfile
from radix_sync.policy.forecast import queue_wait_s
from radix_sync.policy.snapshot import WorkerView

COST = CostModel(CostProfile(name="t", kv_bytes_per_token=1, kv_capacity_tokens=10_000, max_context_len=10_000,
                             chunked_prefill_len=10_000, max_running_requests=64, prefill_overhead_s=0.0,
                             prefill_s_per_token=0.01, prefill_s_per_token_pair=0.0, decode_step_s=0.01,
                             decode_s_per_request=0.0, decode_s_per_ctx_token=0.0, nic_bandwidth_bytes_per_s=1000.0,
                             transfer_latency_s=0.0))


def test_busy_is_a_wait_at_least_the_least_loaded_workers_plus_the_minimum_gain():
    # waits 0, 0.5 (an iteration in progress), 0.06 (6 queued tokens), 1.0 s
    views = [WorkerView(0), WorkerView(1, busy_until_s=0.5), WorkerView(2, num_waiting=1, waiting_new_tokens=6),
             WorkerView(3, busy_until_s=1.0)]
    waits = [queue_wait_s(COST, v, 0.0) for v in views]
    assert waits[0] == 0.0 and waits[1] == 0.5 and waits[2] == pytest.approx(0.06) and waits[3] == 1.0
    assert busy_mask(COST, views, 0.0, 0.05) == 0b1110
    assert busy_mask(COST, views, 0.0, 0.5) == 0b1010
    assert busy_mask(COST, views, 0.0, 2.0) == 0
    assert busy_mask(COST, views, 0.5, 0.2) == 0b1000  # a later `now`: worker 1's iteration is over
    assert busy_mask(COST, [], 0.0, 0.05) == 0


def test_all_busy_needs_a_holder_and_every_holder_busy():
    assert all_busy(0b0110, 0b1110) and all_busy(0b1000, 0b1110)
    assert not all_busy(0b0011, 0b1110)
    assert not all_busy(0, 0b1111)


@pytest.mark.parametrize("hits, hinted, busy, expected", [
    (0, False, False, False), (1, False, False, False),  # one request says nothing about the next
    (2, False, False, True), (0, True, False, True), (1, False, True, True), (5, True, True, True)])
def test_a_candidate_has_repeated_demand_a_hint_or_only_busy_holders(hits, hinted, busy, expected):
    assert is_candidate(hits, hinted, busy) is expected
