"""The prefix-node tracker: the part of the coordinator's directory a planner snapshot needs.

Fed by the simulator's engine (`radix_sync.sim.engine`) and by the live planner
(`radix_sync.coordinator.live_planner`), from request finishes and arrivals; both choose candidates among its
nodes with `radix_sync.policy.candidates`.

A node is the whole prompt of a finished request (a session may continue it) or the deepest cached prefix an
arriving request hit (a shared trunk). Nodes carry the session signals (last finish, stop reason), explicit
fan-out hints and recent hit times; stale nodes are pruned. A session node counts as abandoned (and is reported
to the predictor) as soon as the predictor says so (`DemandPredictor.is_abandoned`, from the learned gap
survival), at the latest after `abandon_after_s`; a follow-up arriving later takes the abandonment back.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from radix_sync.policy.predictor import DemandPredictor


class TrackedNode:
    __slots__ = ("node_id", "pages", "num_pages", "class_key", "namespace", "last_finish_s", "last_stop",
                 "hit_times_s", "fanout_hint", "hint_at_s", "hint_left", "created_s", "owner", "owner_eta_s",
                 "idle_demoted_s")

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
        self.owner = -1
        """Worker prefilling the node's prompt (a hinted request in flight), -1 when none."""
        self.owner_eta_s = 0.0
        """Expected end of that prefill, s."""
        self.idle_demoted_s: Optional[float] = None
        """The finish time whose silence got this node's history demoted (it is demoted once per finish)."""


class NodeTracker:
    """Owns the tracked nodes; fed by the engine on request finish and arrival."""

    def __init__(self, predictor: DemandPredictor, popularity_window_s: float = 30.0,
                 abandon_after_s: float = 1800.0) -> None:
        self.nodes: dict[int, TrackedNode] = {}
        self.predictor = predictor
        self.window_s = popularity_window_s
        self.abandon_after_s = abandon_after_s
        self.new_len_ewma: dict[str, float] = {}
        self.abandoned: OrderedDict[int, tuple[str, Optional[str], float]] = OrderedDict()
        """Nodes counted as abandoned -> (class, stop, finish time), oldest first, kept `abandon_after_s`."""

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

    def on_hint(self, pages: list, class_key: str, namespace: int, fanout: int, hint_at_s: float, owner: int,
                owner_eta_s: float, now: float) -> Optional[TrackedNode]:
        """A request carrying a fan-out hint was routed: `fanout` requests extending its prompt `pages` are
        expected at about `hint_at_s`; its prompt will be computed on `owner` by about `owner_eta_s`.

        Returns:
            the node, or None for a prompt without a full page.
        """
        if not pages:
            return None
        nid = pages[-1]
        n = self.nodes.get(nid)
        if n is None:
            n = self.nodes[nid] = TrackedNode(nid, pages, len(pages), class_key, namespace, now)
        n.fanout_hint = n.hint_left = fanout
        n.hint_at_s = hint_at_s
        n.owner, n.owner_eta_s = owner, owner_eta_s
        return n

    def on_end(self, node_id: int) -> bool:
        """The client said no turn extends this node again (`kvrep.session_end`): an open session there is
        closed and counts as ended for its gap model (as an abandonment, known at once); its fan-out hint, if
        any, is dropped.

        Returns:
            whether a session was open there.
        """
        n = self.nodes.get(node_id)
        if n is None:
            return False
        n.fanout_hint = n.hint_left = 0
        n.hint_at_s = None
        if n.last_finish_s is None:
            return False
        self.predictor.observe_abandoned(n.class_key, n.last_stop)
        n.last_finish_s = None
        return True

    def on_arrival(self, pages: list, match_pages: int, class_key: str, namespace: int, prompt_len: int,
                   page_len: int, now: float) -> Optional[TrackedNode]:
        """A request arrived whose prompt's first `match_pages` pages are cached somewhere.

        Returns:
            the node it continues or hits, if any.
        """
        if match_pages <= 0:
            return None
        nid = pages[match_pages - 1]
        late = self.abandoned.pop(nid, None) if self.abandoned else None
        if late is not None:
            self.predictor.observe_late_followup(late[0], late[1], now - late[2])
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
            # NOTE: a hinted arrival is explained by its hint; counting it as popularity too would predict the
            # whole fan-out again once the hint is used up.
            n.hint_left -= 1
            if n.hint_left == 0:
                n.fanout_hint = 0
                n.hint_at_s = None
                n.owner = -1
            return n
        n.hit_times_s.append(now)
        return n

    def prune(self, now: float, demote_p: float = 0.0, demote_horizon_s: float = 1e9) -> list[TrackedNode]:
        """Drops nodes with no live signal; long-silent session nodes count as abandoned.

        Returns:
            the session nodes whose probability of a follow-up (`GapModel.p_alive`) fell below `demote_p` since
            their last finish (each once per finish; abandoned ones included), for their history to be demoted.
        """
        dead = []
        idle: list[TrackedNode] = []
        cut = now - self.window_s
        models: dict = {}  # (class, stop) -> [gap model, abandon-after (s), open, expected alive]
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
                elapsed = now - n.last_finish_s
                m = models.get((n.class_key, n.last_stop))
                if m is None:
                    g = self.predictor.gap_model(n.class_key, n.last_stop)
                    m = models[(n.class_key, n.last_stop)] = [
                        g, min(self.abandon_after_s, self.predictor.abandon_after_s(n.class_key, n.last_stop)), 0, 0.0]
                if elapsed > m[1]:
                    if demote_p > 0 and n.idle_demoted_s != n.last_finish_s:
                        n.idle_demoted_s = n.last_finish_s
                        idle.append(n)
                    self.predictor.observe_abandoned(n.class_key, n.last_stop)
                    self.abandoned[nid] = (n.class_key, n.last_stop, n.last_finish_s)
                    n.last_finish_s = None
                else:
                    m[2] += 1
                    alive = m[0].p_alive(elapsed)
                    m[3] += alive
                    if demote_p > 0 and n.idle_demoted_s != n.last_finish_s and (
                            alive < demote_p or m[0].p_within(elapsed, demote_horizon_s) < demote_p):
                        n.idle_demoted_s = n.last_finish_s
                        idle.append(n)
                    continue
            if len(h) < 2 and not n.fanout_hint:
                dead.append(nid)
        for nid in dead:
            del self.nodes[nid]
        for g, _, num_open, alive in models.values():
            g.observe_open(num_open, alive)
        ab = self.abandoned
        while ab and now - next(iter(ab.values()))[2] > self.abandon_after_s:
            ab.popitem(last=False)
        return idle
