"""SGLang's `kv_hints` envelope, read for the actions kvrep implements.

SGLang 0.5.23 accepts a versioned envelope on `/generate`, the OpenAI endpoints and its engine API (the request's
`kv_hints` field; `sglang/srt/managers/kv_hints.py`, `KvHintsEnvelope`): `protocol_version`, `message_id` and
`actions`, each action `{action_id, action_type, action_version, payload}`. SGLang itself carries it to the
scheduler's `Req` and implements no action; each consumer ignores the action types it does not implement and
validates the payloads of those it does. vLLM 0.33 takes the same envelope. kvrep implements three action types,
version "1", each about the prompt of the request that carries it:

| `action_type` | `payload` | what it tells the coordinator |
|---|---|---|
| `kvrep.fanout` | `{"k": int >= 1, "delay_s": float in [0, 60] = 0.5}` | `k` requests extending this prompt follow its answer after about `delay_s` (tree search, best-of-K, a map step) |
| `kvrep.keepalive` | `{"ttl_s": float in (0, 604800]}` (capped by the coordinator's `max_hint_ttl_s`) | the session is in a tool call; its next turn, extending this prompt, is expected within `ttl_s` |
| `kvrep.session_end` | `{}` | no turn extends this prompt again: its copies are evicted first, its open demand forgotten |

They are the `/kvrep/hints` kinds `fanout`, `keepalive` and `end`; `/kvrep/hints` stays. A client that already
sends the envelope needs no other endpoint: our router acts on it (`radix_sync.router.app`) and forwards the body
unchanged, so SGLang receives it as it would without us.

Validation is SGLang's shape rule plus ours: a body whose envelope SGLang would refuse, or that carries one of our
action types with another version or a payload out of bounds, is a 400 naming what is wrong (never a dropped
hint with the request served as if nothing was asked, never a lost request). Bounded: `MAX_ACTIONS` actions, ids
of at most `MAX_ID_CHARS` characters.
"""
from __future__ import annotations

from typing import Annotated, Any, Optional

import msgspec
from msgspec import Meta

from radix_sync.api import MAX_TTL_S

MAX_ACTIONS = 16
"""Actions in one envelope at most."""
MAX_ID_CHARS = 256
"""Characters of `protocol_version`, `message_id`, `action_id`, `action_type`, `action_version` at most."""
VERSION = "1"
"""The version of kvrep's action types."""

_Id = Annotated[str, Meta(max_length=MAX_ID_CHARS)]


class KvHintAction(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """One action, as SGLang's `KvHintAction` has it (unknown keys ignored)."""

    action_id: _Id
    action_type: _Id
    action_version: _Id
    payload: dict[str, Any] = {}


class KvHintsEnvelope(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The envelope, as SGLang's `KvHintsEnvelope` has it (`protocol_version` and `message_id` required)."""

    protocol_version: _Id
    message_id: _Id
    actions: Annotated[list[KvHintAction], Meta(max_length=MAX_ACTIONS)] = []


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class FanoutPayload(_Strict):
    k: Annotated[int, Meta(ge=1, le=1_000_000)]
    delay_s: Annotated[float, Meta(ge=0, le=60)] = 0.5


class KeepalivePayload(_Strict):
    ttl_s: Annotated[float, Meta(gt=0, le=MAX_TTL_S)]


class SessionEndPayload(_Strict):
    pass


PAYLOADS: dict[str, tuple[str, type]] = {
    "kvrep.fanout": ("fanout", FanoutPayload),
    "kvrep.keepalive": ("keepalive", KeepalivePayload),
    "kvrep.session_end": ("end", SessionEndPayload),
}
"""Our action types -> (the `/kvrep/hints` kind, the payload's type)."""


class KvHintsError(ValueError):
    """A malformed envelope, or one of our actions malformed: the caller answers 400 with this message."""


def _one(value: Any, where: str) -> KvHintsEnvelope:
    try:
        return msgspec.convert(value, KvHintsEnvelope)
    except (msgspec.ValidationError, TypeError) as exc:
        raise KvHintsError(f"malformed kv_hints{where}: {exc}") from None


def parse(value: Any, num_prompts: int = 1) -> list[dict]:
    """Reads a request's `kv_hints` field.

    Args:
        value: the field as JSON decoded it: one envelope (an object), a list of them (one per prompt of a batch,
            null entries allowed, as SGLang takes them), or null.
        num_prompts: prompts in the request (a list must have this many entries).
    Returns:
        the hints to send for the request's first prompt, each a `/kvrep/hints` body without its prompt
        (`{"kind": ..., <payload fields>, "hint_id": "<message_id>/<action_id>"}`), in the envelope's order; [] for null, or when the envelope has none
        of our action types. A batch's other prompts' envelopes are validated, not acted on (the router routes
        a batch by its first prompt).
    Raises:
        KvHintsError: what is malformed (SGLang's own rule, ours for our action types, the bounds).
    """
    if value is None:
        return []
    if isinstance(value, list):
        if len(value) != num_prompts:
            raise KvHintsError(f"kv_hints has {len(value)} envelopes for {num_prompts} prompt(s)")
        envelopes: list[Optional[KvHintsEnvelope]] = [None if v is None else _one(v, f"[{i}]")
                                                      for i, v in enumerate(value)]
    elif isinstance(value, dict):
        envelopes = [_one(value, "")]
    else:
        raise KvHintsError(f"kv_hints must be an object or a list of objects, not {type(value).__name__}")
    out: list[dict] = []
    for i, env in enumerate(envelopes):
        if env is None:
            continue
        for action in env.actions:
            ours = PAYLOADS.get(action.action_type)
            if ours is None:
                continue  # another consumer's action: not ours to judge
            if action.action_version != VERSION:
                raise KvHintsError(f"kv_hints action {action.action_id!r}: {action.action_type} version "
                                   f"{action.action_version!r} is not supported (supported: {VERSION!r})")
            kind, payload_type = ours
            try:
                payload = msgspec.convert(action.payload, payload_type)
            except (msgspec.ValidationError, TypeError) as exc:
                raise KvHintsError(f"kv_hints action {action.action_id!r} ({action.action_type}): payload: {exc}") \
                    from None
            if i == 0:
                out.append({"kind": kind, **msgspec.structs.asdict(payload),
                            "hint_id": f"{env.message_id}/{action.action_id}"})
    return out


def envelope(*actions: tuple[str, dict], message_id: str = "m-1") -> dict:
    """Builds an envelope for a client (tests, `kvrep_dev`, the docs' example): `actions` as (type, payload)."""
    return {"protocol_version": "1", "message_id": message_id,
            "actions": [{"action_id": f"a-{i}", "action_type": t, "action_version": VERSION, "payload": p}
                        for i, (t, p) in enumerate(actions)]}


__all__ = ["KvHintsError", "PAYLOADS", "VERSION", "envelope", "parse"]
