"""The router's /metrics exposition, parsed back with `prometheus_client.parser`: names, types, exact values."""
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from radix_sync.router.metrics import DECISION_BUCKETS_S, PEER_LAG_BUCKETS_S, PULL_WAIT_BUCKETS_S, RouterMetrics


def parse(metrics):
    """Returns: {family name: (type, {(sample name, sorted labels): value})}, without the `_created` series."""
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples
                   if not s.name.endswith("_created")}
        if not fam.name.endswith("_created"):
            out[fam.name] = (fam.type, samples)
    return out


FAMILIES = {"kvrep_router_requests": "counter", "kvrep_router_upstream_failures": "counter",
            "kvrep_router_failovers": "counter", "kvrep_router_fallback_decisions": "counter",
            "kvrep_router_unauthorized": "counter", "kvrep_router_no_worker": "counter", "kvrep_router_refused": "counter",
            "kvrep_router_kv_hints": "counter", "kvrep_router_prefill_speed_scale": "gauge",
            "kvrep_router_arrivals_dropped": "counter", "kvrep_router_decision_seconds": "histogram",
            "kvrep_router_pulls_started": "counter", "kvrep_router_pulls_done": "counter",
            "kvrep_router_pulls_fallen_back": "counter", "kvrep_router_pull_wait_seconds": "histogram",
            "kvrep_router_peer_send_lag_seconds": "histogram"}


def test_a_fresh_router_exposes_every_series_at_zero():
    fams = parse(RouterMetrics())
    assert {name: t for name, (t, _) in fams.items()} == FAMILIES
    assert all(name.startswith("kvrep_") for name in fams)
    assert fams["kvrep_router_requests"][1] == {} and fams["kvrep_router_upstream_failures"][1] == {}
    assert fams["kvrep_router_refused"][1] == {}
    for name in ("failovers", "fallback_decisions", "unauthorized", "no_worker", "arrivals_dropped", "pulls_started",
                 "pulls_done"):
        assert fams[f"kvrep_router_{name}"][1] == {(f"kvrep_router_{name}_total", ()): 0.0}
    hist = fams["kvrep_router_decision_seconds"][1]
    assert hist[("kvrep_router_decision_seconds_count", ())] == 0.0
    assert len([k for k in hist if k[0].endswith("_bucket")]) == len(DECISION_BUCKETS_S) + 1
    assert fams["kvrep_router_pulls_fallen_back"][1] == {}
    lag = fams["kvrep_router_peer_send_lag_seconds"][1]
    assert lag[("kvrep_router_peer_send_lag_seconds_count", ())] == 0.0
    assert len([k for k in lag if k[0].endswith("_bucket")]) == len(PEER_LAG_BUCKETS_S) + 1
    # the learned prefill speed starts at the profile's (1: not learned yet)
    assert fams["kvrep_router_prefill_speed_scale"][1] == {("kvrep_router_prefill_speed_scale", ()): 1.0}
    hist = fams["kvrep_router_pull_wait_seconds"][1]
    assert len([k for k in hist if k[0].endswith("_bucket")]) == len(PULL_WAIT_BUCKETS_S) + 1


def test_pull_series_count_by_reason():
    m = RouterMetrics()
    m.pulls_started.inc(3)
    m.pulls_done.inc()
    m.pulls_fallen_back.labels("refused").inc()
    m.pulls_fallen_back.labels("deadline").inc()
    m.pull_wait_seconds.observe(0.3)
    fams = parse(m)
    assert fams["kvrep_router_pulls_started"][1] == {("kvrep_router_pulls_started_total", ()): 3.0}
    assert fams["kvrep_router_pulls_fallen_back"][1] == {
        ("kvrep_router_pulls_fallen_back_total", (("reason", "refused"),)): 1.0,
        ("kvrep_router_pulls_fallen_back_total", (("reason", "deadline"),)): 1.0}
    buckets = {dict(k[1])["le"]: v for k, v in fams["kvrep_router_pull_wait_seconds"][1].items()
               if k[0].endswith("_bucket")}
    assert (buckets["0.25"], buckets["0.5"]) == (0.0, 1.0)


def test_counts_labels_and_histogram_buckets_are_exact():
    dropped = [0]
    m = RouterMetrics(lambda: dropped[0])
    m.requests.labels("http://a", "generate", "directory").inc()
    m.requests.labels("http://a", "generate", "directory").inc()
    m.requests.labels("http://b", "chat", "fallback").inc()
    m.upstream_failures.labels("http://b", "ClientConnectorError").inc()
    m.failovers.inc()
    m.fallback_decisions.inc(3)
    m.unauthorized.inc()
    m.no_worker.inc()
    m.refused.labels("too_large").inc(2)
    for s in (0.00005, 0.0003, 0.0003, 2.0):
        m.decision_seconds.observe(s)
    dropped[0] = 7  # read when scraped
    fams = parse(m)
    assert fams["kvrep_router_requests"][1] == {
        ("kvrep_router_requests_total", (("endpoint", "generate"), ("mode", "directory"), ("worker", "http://a"))): 2.0,
        ("kvrep_router_requests_total", (("endpoint", "chat"), ("mode", "fallback"), ("worker", "http://b"))): 1.0}
    assert fams["kvrep_router_upstream_failures"][1] == {
        ("kvrep_router_upstream_failures_total", (("reason", "ClientConnectorError"), ("worker", "http://b"))): 1.0}
    assert fams["kvrep_router_fallback_decisions"][1] == {("kvrep_router_fallback_decisions_total", ()): 3.0}
    assert fams["kvrep_router_arrivals_dropped"][1] == {("kvrep_router_arrivals_dropped_total", ()): 7.0}
    assert fams["kvrep_router_refused"][1] == {("kvrep_router_refused_total", (("reason", "too_large"),)): 2.0}
    for name in ("failovers", "unauthorized", "no_worker"):
        assert fams[f"kvrep_router_{name}"][1] == {(f"kvrep_router_{name}_total", ()): 1.0}
    hist = fams["kvrep_router_decision_seconds"][1]
    buckets = {dict(k[1])["le"]: v for k, v in hist.items() if k[0].endswith("_bucket")}
    assert (buckets["0.0001"], buckets["0.00025"], buckets["0.0005"], buckets["1.0"], buckets["+Inf"]) == \
        (1.0, 1.0, 3.0, 3.0, 4.0)  # cumulative; 2.0 s only in +Inf
    assert hist[("kvrep_router_decision_seconds_count", ())] == 4.0
    assert abs(hist[("kvrep_router_decision_seconds_sum", ())] - 2.00065) < 1e-12


def test_each_router_has_its_own_registry():
    a, b = RouterMetrics(), RouterMetrics()  # a shared registry would refuse the second (duplicate names)
    a.failovers.inc()
    assert parse(a)["kvrep_router_failovers"][1] == {("kvrep_router_failovers_total", ()): 1.0}
    assert parse(b)["kvrep_router_failovers"][1] == {("kvrep_router_failovers_total", ()): 0.0}
    assert REGISTRY.get_sample_value("kvrep_router_failovers_total") is None  # nothing in the global one
