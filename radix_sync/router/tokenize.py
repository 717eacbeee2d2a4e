"""Token ids of a request's prompt, computed the way an SGLang 0.5.23 worker computes them.

- `/generate` with `input_ids`: as given; with `text`: `tokenizer(text)["input_ids"]` with the HF default
  `add_special_tokens=True` (`TokenizerManager._tokenize_texts`).
- `/v1/completions`: a string prompt is text, a list of ints is token ids (`serving_completions.py`).
- `/v1/chat/completions`: `None` content becomes "", a trailing assistant message becomes a user message (unless
  `continue_final_message`), the chat template is rendered to text with `add_generation_prompt=True` (and the
  request's `tools` and `chat_template_kwargs`), then encoded with `add_special_tokens=False` when the tokenizer
  adds special tokens to an empty string, else with the tokenizer's default (`serving_chat.py`,
  `_apply_jinja_template` / `_render_and_encode_chat_template`).

Batches (a list of texts or prompts) are routed by their first prompt. Multimodal content parts are reduced to
their text parts: the ids may then differ from the worker's, which only costs routing quality, never
correctness (the body is forwarded unchanged). The HF tokenizer is imported lazily (transformers pulls in torch
when it is installed); `radix_sync` itself never imports it at module load. Called by `radix_sync.router.app`.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional


class BadRequest(ValueError):
    """The body has no prompt the router can read (HTTP 400)."""


class PromptTokenizer:
    """Owns one HF tokenizer; `prompt_ids(endpoint, body)` returns the prompt's token ids."""

    def __init__(self, tokenizer: Any, vocab_size: Optional[int] = None) -> None:
        self.tok = tokenizer
        self.vocab_size = vocab_size or len(tokenizer)
        """Token ids the model takes: its config's `vocab_size` (the embedding's rows) when known, else the
        tokenizer's length."""
        try:
            self._auto_adds_specials = len(tokenizer.encode("")) > 0
        except Exception:  # noqa: BLE001 - SGLang assumes True when the probe fails
            self._auto_adds_specials = True

    @classmethod
    def from_pretrained(cls, path: str) -> "PromptTokenizer":
        """Loads the tokenizer (and chat template) of a model directory or hub id, as SGLang's `get_tokenizer`."""
        from transformers import AutoTokenizer  # lazy: heavy, and imports torch when present

        return cls(AutoTokenizer.from_pretrained(path, trust_remote_code=False), model_vocab_size(path))

    def encode_text(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def chat_ids(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        msgs = []
        for m in copy.deepcopy(messages):
            if not isinstance(m, dict):
                raise BadRequest("each message must be an object")
            if m.get("content") is None:
                m["content"] = ""
            elif isinstance(m["content"], list):
                m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict)
                                       and p.get("type") == "text")
            msgs.append(m)
        if msgs[-1].get("role") == "assistant" and isinstance(msgs[-1]["content"], str) \
                and not body.get("continue_final_message"):
            msgs[-1] = {"role": "user", "content": msgs[-1]["content"]}
        kwargs = dict(body.get("chat_template_kwargs") or {})
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        rendered = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                return_dict=False, **kwargs)
        encode_kwargs = {"add_special_tokens": False} if self._auto_adds_specials else {}
        return list(self.tok.encode(rendered, **encode_kwargs))

    def prompt_ids(self, endpoint: str, body: dict) -> list[int]:
        """Token ids of the (first) prompt of a request.

        Args:
            endpoint: `generate`, `completions` or `chat`.
            body: the parsed JSON body.
        Returns:
            the token ids.
        Raises:
            BadRequest: no readable prompt.
        """
        if endpoint == "chat":
            return self.chat_ids(body)
        if endpoint == "generate":
            ids, text = body.get("input_ids"), body.get("text")
        else:
            prompt = body.get("prompt")
            ids, text = (None, prompt) if _is_text(prompt) else (prompt, None)
        if ids is not None:
            first = _first_ids(ids)
            if first is None:
                raise BadRequest("input_ids must be a list of token ids (or a list of such lists)")
            return first
        if _is_text(text):
            return self.encode_text(text if isinstance(text, str) else text[0])
        raise BadRequest("the request has no prompt (text, input_ids, prompt or messages)")


def model_vocab_size(path: str) -> Optional[int]:
    """Returns: `vocab_size` of the model config in directory `path` (None: no such directory or field)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = cfg.get("vocab_size") if isinstance(cfg, dict) else None
    if size is None and isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        size = cfg["text_config"].get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


def needs_tokenizing(endpoint: str, body: dict) -> bool:
    """Returns: whether the prompt is text (tokenizing it takes time: done off the event loop) rather than ids."""
    if endpoint == "chat":
        return True
    if endpoint == "generate":
        return body.get("input_ids") is None
    return _is_text(body.get("prompt"))


def _is_text(x: object) -> bool:
    return isinstance(x, str) or (isinstance(x, list) and bool(x) and isinstance(x[0], str))


def _first_ids(ids: object) -> Optional[list[int]]:
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]
    if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return ids
    return None
