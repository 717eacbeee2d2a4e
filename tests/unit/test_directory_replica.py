"""The router's mirror of the coordinator's directory, fed from the change feed."""
import pytest

from radix_sync.directory import PrefixDirectory
from radix_sync.router.directory_replica import DirectoryReplica, FeedError


def sync(replica, d, limit=200_000):
    while True:
        out = d.feed_since(replica.epoch, replica.seq, limit)
        # through JSON on the wire: tuples become lists, worker keys stay strings
        out = {k: ([list(c) for c in v] if k == "changes" else v) for k, v in out.items()}
        replica.apply(out, now=0.0)
        if out["seq"] >= out["head"]:
            return


def test_the_mirror_matches_what_the_directory_matches():
    d = PrefixDirectory(max_changes=4)
    r = DirectoryReplica(max_silence_s=3.0)
    assert not r.usable(now=0.0)
    d.add_pages("w1", "", [(1, None, [0]), (2, 1, [1]), (3, 2, [2])])
    sync(r, d)  # first call: a snapshot
    assert r.num_snapshots == 1 and r.usable(now=1.0) and not r.usable(now=3.5)
    d.add_pages("w2", "", [(1, None, [0]), (2, 1, [1])])
    d.remove_pages("w1", [3])
    sync(r, d, limit=1)  # changes, one per call
    assert r.num_snapshots == 1 and r.num_changes == 3
    for prompt in ([1, 2, 3], [1, 2], [1], [2], [9]):
        assert r.match(prompt) == d.match(prompt)
    d.drop_worker("w2")
    for i in range(10):  # more changes than the feed keeps: the mirror resyncs from a snapshot
        d.add_pages("w3", "", [(100 + i, None, [i])])
    sync(r, d)
    assert r.num_snapshots == 2 and r.match([1, 2]) == {"w1": 2} == d.match([1, 2])
    assert r.match([105]) == {"w3": 1}


def test_a_malformed_answer_is_refused_and_forces_a_resync():
    d = PrefixDirectory()
    d.add_pages("w1", "", [(1, None, [0])])
    r = DirectoryReplica()
    sync(r, d)
    for bad in ({"seq": 1}, {"epoch": r.epoch, "seq": "x", "changes": []},
                {"epoch": r.epoch, "seq": 2, "changes": [[7, "w1", 5]]},
                {"epoch": r.epoch, "seq": 2, "changes": [[1, "w1", "5"]]},
                {"epoch": r.epoch, "seq": 2, "changes": [[1, ["w1"], 5]]},
                {"epoch": "another", "seq": 2, "changes": [[1, "w1", 5]]},
                {"epoch": r.epoch, "seq": 2, "snapshot": {"w1": ["nan"]}}):
        sync(r, d)
        with pytest.raises(FeedError):
            r.apply(bad, now=0.0)
        assert not r.usable(now=0.0) and r.epoch == "" and r.match([1]) == {}
    sync(r, d)
    assert r.usable(now=0.0) and r.match([1]) == {"w1": 1}


def test_the_mirror_keeps_its_pages_out_of_the_cycle_collectors_sight():
    import gc

    d = PrefixDirectory()
    for w in ("w1", "w2", "w3"):
        d.add_pages(w, "", [(i, None, [i]) for i in range(1, 200)])
    r = DirectoryReplica()
    sync(r, d)  # a snapshot
    d.add_pages("w4", "", [(i, None, [i]) for i in range(1, 100)])
    d.remove_pages("w2", list(range(50, 150)))
    sync(r, d)  # changes
    gc.collect()
    # NOTE: one set per page was tracked: the collector's full passes over a 200,000-page mirror took ~33 ms
    assert not any(gc.is_tracked(ws) for ws in r._holders.values())
    # each worker id is one string object, whether it came in a snapshot or a change
    assert len({id(w) for ws in r._holders.values() for w in ws}) == 4
    for prompt in ([1, 2], [60], [120], [180], [1, 60, 150]):
        assert r.match(prompt) == d.match(prompt)
    d.remove_pages("w1", list(range(1, 200)))
    d.remove_pages("w3", list(range(1, 200)))
    d.remove_pages("w4", list(range(1, 200)))
    d.remove_pages("w2", list(range(1, 200)))
    sync(r, d)
    assert r.status()["pages"] == 0 and r.match([1]) == {}
