"""The router's bounds (`radix_sync.router.limits`): every token id of a body checked against the vocabulary,
prompts, batches and chats capped, and the per-tenant token bucket of hints, with injected time."""
import pytest

from radix_sync.router.auth import READ, WRITE, admin_level, bearer
from radix_sync.secret_files import AdminTokens
from radix_sync.router.limits import PromptBounds, TokenBuckets, TooLarge, check_request
from radix_sync.router.tokenize import BadRequest

B = PromptBounds(vocab_size=100, max_prompt_tokens=10, max_prompt_chars=50, max_batch_prompts=3, max_messages=4)


@pytest.mark.parametrize("endpoint,body", [
    ("generate", {"input_ids": [1, 2, 99]}), ("generate", {"input_ids": [[1], [2, 3]]}),
    ("generate", {"text": "hello"}), ("generate", {"text": ["a", "b", "c"]}),
    ("generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [5], "logit_bias": {"7": 1.0}}}),
    ("generate", {"input_ids": [1], "sampling_params": [{"stop_token_ids": [5]}]}),
    ("completions", {"prompt": [0, 99]}), ("completions", {"prompt": "x" * 50}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}] * 4}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 50}]}]}),
])
def test_bodies_within_bounds_pass(endpoint, body):
    check_request(endpoint, body, B)


@pytest.mark.parametrize("endpoint,body,match", [
    ("generate", {"input_ids": [1, 100]}, r"100 is not an int in \[0, 100\)"),
    ("generate", {"input_ids": [[1], [2, -3]]}, r"input_ids\[1\]: token id -3"),
    ("generate", {"input_ids": [1, False]}, "False"),
    ("generate", {"input_ids": [1, "2"]}, "'2'"),
    ("generate", {"input_ids": 5}, "must be text, token ids"),
    ("generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [100]}}, "stop_token_ids"),
    ("generate", {"input_ids": [1], "sampling_params": {"logit_bias": {"abc": 1}}}, "'abc' is not a token id"),
    ("generate", {"input_ids": [1], "sampling_params": [{}, {"logit_bias": {"-1": 1}}]}, r"sampling_params\[1\]"),
    ("completions", {"prompt": [[1], [1000]]}, r"prompt\[1\]"),
    ("completions", {"prompt": "hi", "stop_token_ids": [100]}, "body.stop_token_ids"),
])
def test_ids_outside_the_vocabulary_or_of_the_wrong_type_are_400(endpoint, body, match):
    with pytest.raises(BadRequest, match=match) as exc:
        check_request(endpoint, body, B)
    assert not isinstance(exc.value, TooLarge)


@pytest.mark.parametrize("endpoint,body,match", [
    ("generate", {"input_ids": list(range(11))}, "11 token ids, the limit is 10"),
    ("generate", {"text": "x" * 51}, "51 characters"),
    ("generate", {"text": ["a"] * 4}, "4 prompts in one batch"),
    ("completions", {"prompt": [[1]] * 4}, "4 prompts"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}] * 5}, "5 messages"),
    ("chat", {"messages": [{"role": "user", "content": "y" * 30}, {"role": "user", "content": "z" * 21}]},
     "51 characters"),
])
def test_over_the_caps_is_413(endpoint, body, match):
    with pytest.raises(TooLarge, match=match):
        check_request(endpoint, body, B)


def test_token_buckets_refill_per_tenant():
    b = TokenBuckets(rate_per_s=2.0, burst=3)
    assert [b.take("acme", 0.0) for _ in range(3)] == [None, None, None]
    assert b.take("acme", 0.0) == pytest.approx(0.5)  # one token refills in 1 / 2 s
    assert b.take("globex", 0.0) is None  # another tenant's bucket
    assert b.take("acme", 0.5) is None and b.take("acme", 0.5) is not None
    assert [b.take("acme", 100.0) for _ in range(4)].count(None) == 3  # refills to the burst, not beyond


def test_token_buckets_keep_a_bounded_map():
    b = TokenBuckets(rate_per_s=1.0, burst=1, max_keys=2)
    for key in ("a", "b", "c"):
        assert b.take(key, 0.0) is None
    assert len(b._buckets) == 2 and "a" not in b._buckets


def test_admin_levels_compare_tokens_exactly():
    t = AdminTokens("r" * 64, "w" * 64)
    assert admin_level(t, "Bearer " + "w" * 64) == WRITE and admin_level(t, "bearer " + "r" * 64) == READ
    for header in (None, "", "Bearer", "r" * 64, "Basic " + "r" * 64, "Bearer " + "r" * 63, "Bearer " + "x" * 64):
        assert admin_level(t, header) is None
    assert bearer("Bearer  tok ") == "tok"
