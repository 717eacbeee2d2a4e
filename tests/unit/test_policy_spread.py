"""`radix_sync.policy.spread`: `Spread` answers bit for bit what the greedy simulation (`spread_s`) answers, for
the base and for every one-option replacement (the planner's decisions rest on it)."""
import random

from radix_sync.policy.spread import Spread, num_spread, spread_s


def test_spread_s_is_the_greedy_simulation():
    # w0 (1.0, 0.5) w1 (1.2, 0.5) w2 (3.0, 0.5), 4 requests: w0 1.0, w1 1.2, w0 1.5, w1 1.7
    assert spread_s([(1.0, 0.5), (1.2, 0.5), (3.0, 0.5)], 4) == (1.0 + 1.2 + 1.5 + 1.7) / 4
    assert spread_s([(2.0, 1.0), (1.5, 9.0)], 1) == 1.5
    assert [num_spread(c, 32) for c in (0.0, 0.5, 1.0, 1.0000000001, 2.2, 100.0)] == [1, 1, 1, 1, 3, 32]


def test_replacements_equal_the_simulation_exactly():
    rng = random.Random(7)
    for trial in range(300):
        n = rng.choice([1, 2, 3, 5, 8, 40])
        # few distinct values, so ties (between workers, and between a worker's values) are common
        grid = [0.0, 0.1, 0.25, 0.3, 1.0 / 3, 0.7, 2.0]
        opts = [(rng.choice(grid) + rng.choice([0.0, rng.random()]), rng.choice([0.0, 0.1, 0.2, rng.random()]))
                for _ in range(n)]
        k = rng.choice([1, 2, 3, 7, 32])
        sp = Spread(opts, k)
        assert sp.base_s == spread_s(opts, k)
        for w in range(n):
            for _ in range(3):
                new = (rng.choice([0.0, 0.05, opts[w][0], rng.random() * 3]), rng.choice([0.0, 0.1, rng.random()]))
                replaced = list(opts)
                replaced[w] = new
                assert sp.with_option(w, new) == spread_s(replaced, k), (trial, opts, k, w, new)
