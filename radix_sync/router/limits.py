"""Bounds on what a client may send through the router, checked before any worker sees the request.

- `check_request`: every token id in the body (each prompt of a batch, `stop_token_ids`, `logit_bias` keys) must
  be an int in [0, vocab_size): an SGLang 0.5.23 CPU worker given an id past its vocabulary dies (an
  `IndexError` in the embedding ends its scheduler). Prompts are capped in token ids and in characters (text is
  capped before it is tokenized), batches and chats in length. Refusals are `BadRequest` (400) or `TooLarge`
  (413), with the bad field named.
- `TokenBuckets`: the per-tenant rate limit on hints.

Pure: no clock (callers pass `now`), no I/O. Called by `radix_sync.router.app`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radix_sync.router.tokenize import BadRequest


class TooLarge(BadRequest):
    """A body over one of the router's size bounds (HTTP 413)."""


@dataclass(frozen=True)
class PromptBounds:
    vocab_size: int
    """Token ids must be < this."""
    max_prompt_tokens: int
    max_prompt_chars: int
    max_batch_prompts: int
    max_messages: int


def _check_ids(ids: list, where: str, b: PromptBounds) -> None:
    if len(ids) > b.max_prompt_tokens:
        raise TooLarge(f"{where}: {len(ids)} token ids, the limit is {b.max_prompt_tokens}")
    for t in ids:
        if type(t) is not int or not 0 <= t < b.vocab_size:  # noqa: E721 - bool is an int subclass: refused
            raise BadRequest(f"{where}: token id {t!r} is not an int in [0, {b.vocab_size})")


def _check_text(text: str, where: str, b: PromptBounds) -> None:
    if len(text) > b.max_prompt_chars:
        raise TooLarge(f"{where}: {len(text)} characters, the limit is {b.max_prompt_chars}")


def _check_prompts(value: object, where: str, b: PromptBounds) -> None:
    """A prompt field: text, a list of texts, token ids, or a list of token-id lists."""
    if value is None:
        return
    if isinstance(value, str):
        return _check_text(value, where, b)
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be text, token ids or a list of them")
    if value and isinstance(value[0], (list, str)):
        if len(value) > b.max_batch_prompts:
            raise TooLarge(f"{where}: {len(value)} prompts in one batch, the limit is {b.max_batch_prompts}")
        for i, item in enumerate(value):
            if isinstance(item, str):
                _check_text(item, f"{where}[{i}]", b)
            elif isinstance(item, list):
                _check_ids(item, f"{where}[{i}]", b)
            else:
                raise BadRequest(f"{where}[{i}] must be text or token ids")
        return
    _check_ids(value, where, b)


def _check_sampling(params: object, where: str, b: PromptBounds) -> None:
    if not isinstance(params, dict):
        return
    stop_ids = params.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise BadRequest(f"{where}.stop_token_ids must be a list of token ids")
        _check_ids(stop_ids, f"{where}.stop_token_ids", b)
    bias = params.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadRequest(f"{where}.logit_bias must be an object of token id -> bias")
        if len(bias) > b.max_prompt_tokens:
            raise TooLarge(f"{where}.logit_bias: {len(bias)} entries, the limit is {b.max_prompt_tokens}")
        for key in bias:
            try:
                t = int(key)
            except (TypeError, ValueError):
                raise BadRequest(f"{where}.logit_bias: key {key!r} is not a token id") from None
            if not 0 <= t < b.vocab_size:
                raise BadRequest(f"{where}.logit_bias: token id {t} is not in [0, {b.vocab_size})")


def check_request(endpoint: str, body: dict, b: PromptBounds) -> None:
    """Checks every prompt, token id and list of a request body against the bounds.

    Args:
        endpoint: `generate`, `completions` or `chat`.
        body: the parsed JSON body (not modified).
    Raises:
        TooLarge: a prompt, batch or chat over its bound (413).
        BadRequest: a token id outside [0, vocab_size), or a prompt field of the wrong type (400).
    """
    if endpoint == "generate":
        _check_prompts(body.get("input_ids"), "input_ids", b)
        _check_prompts(body.get("text"), "text", b)
        sampling = body.get("sampling_params")
        for i, params in enumerate(sampling if isinstance(sampling, list) else [sampling]):
            _check_sampling(params, "sampling_params" if not isinstance(sampling, list) else f"sampling_params[{i}]",
                            b)
        return
    _check_sampling(body, "body", b)  # OpenAI: stop_token_ids and logit_bias are top-level fields
    if endpoint == "completions":
        _check_prompts(body.get("prompt"), "prompt", b)
        return
    messages = body.get("messages")
    if isinstance(messages, list):
        if len(messages) > b.max_messages:
            raise TooLarge(f"messages: {len(messages)} messages, the limit is {b.max_messages}")
        total = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text") or "") for p in content
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
        if total > b.max_prompt_chars:
            raise TooLarge(f"messages: {total} characters of content, the limit is {b.max_prompt_chars}")


class TokenBuckets:
    """One token bucket per key (a tenant's name): `rate_per_s` refill, `burst` capacity.

    Keys are tenants of the router's table (a bounded set); `max_keys` caps the map all the same (the oldest key
    is dropped: its tenant starts again from a full bucket).
    """

    def __init__(self, rate_per_s: float, burst: int, max_keys: int = 100_000) -> None:
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self.max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}
        """key -> (tokens, when last refilled)."""

    def take(self, key: str, now: float) -> Optional[float]:
        """Takes one token from `key`'s bucket.

        Returns:
            None when allowed; else the seconds until a token is available (for `Retry-After`).
        """
        tokens, last = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate_per_s)
        if tokens < 1.0:
            if key in self._buckets:
                self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate_per_s
        if key not in self._buckets and len(self._buckets) >= self.max_keys:
            del self._buckets[next(iter(self._buckets))]
        self._buckets[key] = (tokens - 1.0, now)
        return None
