"""The simulator's prefix-node tracker: the part of the coordinator's directory a planner snapshot needs.

A node is the whole prompt of a finished request (a session may continue it) or the deepest cached prefix an
arriving request hit (a shared trunk). Nodes carry the session signals (last finish, stop reason), explicit
fan-out hints and recent hit times; stale nodes are pruned and reported to the predictor as abandoned.
"""

from __future__ import annotations

from typing import Optional

from radix_sync.policy.predictor import DemandPredictor


class TrackedNode:
    __slots__ = ("node_id", "pages", "num_pages", "class_key", "namespace", "last_finish_s", "last_stop",
                 "hit_times_s", "fanout_hint", "hint_at_s", "hint_left", "created_s")

    def __init__(self, node_id: int, pages: list, num_pages: int, class_key: str, namespace: int, now: float):
        self.node_id = node_id
        self.pages = pages
        self.num_pages = num_pages
        self.class_key = class_key
        self.namespace = namespace
        self.last_finish_s: Optional[float] = None
        self.last_stop: Optional[str] = None
        self.hit_times_s: list[float] = []
        self.fanout_hint = 0
        self.hint_at_s: Optional[float] = None
        self.hint_left = 0
        self.created_s = now


class NodeTracker:
    """Owns the tracked nodes; fed by the engine on request finish and arrival."""

    def __init__(self, predictor: DemandPredictor, popularity_window_s: float = 30.0,
                 abandon_after_s: float = 1800.0) -> None:
        self.nodes: dict[int, TrackedNode] = {}
        self.predictor = predictor
        self.window_s = popularity_window_s
        self.abandon_after_s = abandon_after_s
        self.new_len_ewma: dict[str, float] = {}

    def on_finish(self, pages: list, class_key: str, namespace: int, stop: Optional[str], now: float,
                  hint_fanout: int = 0, hint_delay_s: float = 0.0) -> None:
        """A request whose full-page prompt is `pages` finished."""
        if not pages:
            return
        nid = pages[-1]
        n = self.nodes.get(nid)
        if n is None:
            n = self.nodes[nid] = TrackedNode(nid, pages, len(pages), class_key, namespace, now)
        n.last_finish_s = now
        n.last_stop = stop
        if hint_fanout:
            n.fanout_hint = n.hint_left = hint_fanout
            n.hint_at_s = now + hint_delay_s

    def on_arrival(self, pages: list, match_pages: int, class_key: str, namespace: int, prompt_len: int,
                   page_len: int, now: float) -> Optional[TrackedNode]:
        """A request arrived whose prompt's first `match_pages` pages are cached somewhere.

        Returns:
            the node it continues or hits, if any.
        """
        if match_pages <= 0:
            return None
        nid = pages[match_pages - 1]
        n = self.nodes.get(nid)
        if n is None:
            if match_pages == len(pages):
                return None  # a repeat of a cached prompt, not a trunk
            n = self.nodes[nid] = TrackedNode(nid, pages, match_pages, class_key, namespace, now)
        if n.last_finish_s is not None:
            self.predictor.observe_followup(n.class_key, n.last_stop, now - n.last_finish_s)
            new_len = prompt_len - n.num_pages * page_len
            old = self.new_len_ewma.get(class_key)
            self.new_len_ewma[class_key] = new_len if old is None else 0.9 * old + 0.1 * new_len
            if n.hint_left <= 1:
                n.last_finish_s = None
        if n.hint_left > 0:
            n.hint_left -= 1
            if n.hint_left == 0:
                n.fanout_hint = 0
                n.hint_at_s = None
        n.hit_times_s.append(now)
        return n

    def prune(self, now: float) -> None:
        """Drops nodes with no live signal; long-silent session nodes count as abandoned."""
        dead = []
        cut = now - self.window_s
        for nid, n in self.nodes.items():
            h = n.hit_times_s
            if h and h[0] < cut:
                i = 0
                while i < len(h) and h[i] < cut:
                    i += 1
                del h[:i]
            if n.hint_at_s is not None and now > n.hint_at_s + 30.0:
                n.fanout_hint = n.hint_left = 0
                n.hint_at_s = None
            if n.last_finish_s is not None:
                if now - n.last_finish_s > self.abandon_after_s:
                    self.predictor.observe_abandoned(n.class_key, n.last_stop)
                    n.last_finish_s = None
                else:
                    continue
            if len(h) < 2 and not n.fanout_hint:
                dead.append(nid)
        for nid in dead:
            del self.nodes[nid]
