"""The CPU testbed's link cap gives the testbed's model the H200 profile's copy/prefill time ratio."""
import argparse

import pytest

from kvrep_dev import testbed
from kvrep_dev.bench import add_testbed_arguments
from kvrep_dev.bench import testbed_worker_kwargs as worker_kwargs
from radix_sync.policy.cost import load_profile


def test_h200_copy_to_prefill_ratio_by_hand():
    # 131,072 B/token over 23.75 GB/s = 5.5188 us; prefill 26.266 us/token
    assert testbed.copy_to_prefill_ratio("llama3.1-8b-h200") == pytest.approx(131072 / 23.75e9 / 2.6266e-05)
    assert 0.20 < testbed.copy_to_prefill_ratio("llama3.1-8b-h200") < 0.22


def test_send_rate_cap_reproduces_the_gpu_ratio_on_the_testbed_profile():
    cpu = load_profile(testbed.PROFILE)
    rate = testbed.send_rate_mbps()
    copy_s_per_token = cpu.kv_bytes_per_token / (rate * 1e6)
    assert copy_s_per_token / cpu.prefill_s_per_token == pytest.approx(testbed.copy_to_prefill_ratio(), rel=1e-3)
    # and the testbed profile's link is that cap (what the data plane's token bucket enforces)
    assert cpu.nic_bandwidth_bytes_per_s == pytest.approx(rate * 1e6, rel=1e-3)


def test_worker_kwargs_pin_and_cap():
    p = argparse.ArgumentParser()
    add_testbed_arguments(p)
    p.add_argument("--profile", default=testbed.PROFILE)
    args = p.parse_args([])
    cores = testbed.cores()
    kw = [worker_kwargs(args, i) for i in range(len(cores) + 1)]
    assert [k["cpu"] for k in kw] == cores + cores[:1]
    assert kw[0]["extra_args"] == ("--kvrep-send-rate-mbps", f"{testbed.send_rate_mbps():g}",
                                   "--disable-overlap-schedule")
    off = worker_kwargs(p.parse_args(["--no-pin", "--send-rate-mbps", "0", "--overlap-schedule"]), 0)
    assert off == {"cpu": None, "extra_args": ()}


def test_testbed_workers_hand_out_a_prefills_first_token_when_its_forward_ends():
    """On a CPU, SGLang's overlap scheduler computes the next batch before it hands out the last one's tokens
    (docs/results/overlap-probe.json: 2.74 s vs 1.35 s to a first token); the testbed turns it off."""
    p = argparse.ArgumentParser()
    add_testbed_arguments(p)
    p.add_argument("--profile", default=testbed.PROFILE)
    assert "--disable-overlap-schedule" in worker_kwargs(p.parse_args([]), 0)["extra_args"]
    assert "--disable-overlap-schedule" in worker_kwargs(p.parse_args(["--send-rate-mbps", "0"]), 0)["extra_args"]
