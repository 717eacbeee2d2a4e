"""Each default is written once: the `kvrep coordinator` / `kvrep router` / `kvrep sim` flags take theirs from the
configs."""
import argparse

from radix_sync import cli
from radix_sync.coordinator.server import CoordinatorConfig
from radix_sync.coordinator.state import StateConfig
from radix_sync.policy.pull import PullConfig
from radix_sync.policy.rules import RuleConfig
from radix_sync.router.config import RouterConfig
from radix_sync.router.policy import RouterCosts
from radix_sync.sim.cli import engine_config
from radix_sync.sim.config import EngineConfig
from radix_sync.sim.generators import GeneratorConfig


def _parse(add, *argv):
    parser = argparse.ArgumentParser()
    add(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(list(argv))


def test_coordinator_flags_default_to_the_config():
    a = _parse(cli._add_coordinator, "coordinator")
    c, s, r = CoordinatorConfig(), StateConfig(), RuleConfig()
    assert (a.bind, a.admin_host, a.admin_port, a.policy, a.profile, a.mode, a.tick_s) == (
        c.bind, c.admin_host, c.admin_port, c.policy, c.profile, c.mode, c.tick_s)
    assert (a.worker_timeout_s, a.replication_timeout_s) == (s.worker_timeout_s, s.replication_timeout_s)
    assert (a.admin_tokens, a.state_dir) == (c.admin_tokens, c.state_dir)
    assert (a.max_prompt_tokens, a.max_pages_per_worker, a.max_hint_ttl_s, a.hint_rate_per_s) == (
        s.max_prompt_tokens, s.max_pages_per_worker, s.max_hint_ttl_s, s.hint_rate_per_s)
    assert (a.keys, a.insecure, a.max_msg_bytes) == (c.keys, c.insecure, c.max_msg_bytes)
    assert RuleConfig(a.rule_min_prefix_len, a.rule_min_hits, a.rule_window_s, a.rule_max_queue, a.rule_ttl_s) == r


def test_router_flags_default_to_the_config():
    a = _parse(cli._add_router, "router")
    c, k = RouterConfig(worker_urls=("http://w:1",)), RouterCosts()
    assert (a.host, a.port, a.coordinator, a.tenants, a.page_size, a.profile, a.connect_timeout_s, a.read_timeout_s,
            a.max_connections_per_worker, a.shutdown_timeout_s, a.directory_feed) == (
        c.host, c.port, c.coordinator_url, c.tenants_path, c.page_size, c.profile, c.connect_timeout_s,
        c.read_timeout_s, c.max_connections_per_worker, c.shutdown_timeout_s, c.directory_feed)
    assert (a.state_dir, a.admin_tokens, a.tenant_secret, a.worker_api_key, a.coordinator_tokens, a.vocab_size,
            a.max_body_bytes, a.max_prompt_tokens, a.max_prompt_chars, a.max_batch_prompts, a.max_messages,
            a.tokenize_threads, a.hints_per_s, a.hints_burst) == (
        c.state_dir, c.admin_tokens_path, c.tenant_secret_path, c.worker_api_key_path, c.coordinator_tokens_path,
        c.vocab_size, c.max_body_bytes, c.max_prompt_tokens, c.max_prompt_chars, c.max_batch_prompts, c.max_messages,
        c.tokenize_threads, c.hints_per_s, c.hints_burst)
    assert (a.prefill_s_per_token, a.queue_s_per_request, a.kv_bytes_per_token, a.link_gbps * 1e9 / 8) == (
        k.prefill_s_per_token, k.queue_s_per_request, k.kv_bytes_per_token, k.link_bytes_per_s)
    assert (a.pull, PullConfig(a.pull_min_wait_s, a.pull_max_wait_s, a.pull_ttl_s)) == (c.pull, c.pull_policy)


def test_sim_flags_default_to_the_config():
    a = _parse(cli._add_sim, "sim", "--generator", "agent")
    assert engine_config(a, EngineConfig.duration_s) == EngineConfig()
    assert a.fanout_k == GeneratorConfig().fanout_k
