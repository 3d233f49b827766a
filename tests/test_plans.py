"""The plan cache: a graph of a recently scheduled shape reuses its plan, and only then.

Reuse must never change a value or a gradient (compared with ``autobatch="none"`` and with
``jax.grad`` of the same math), and a graph that only looks alike (same node and value
counts, other edges or depths) must be scheduled afresh."""
from __future__ import annotations

import numpy as np
import pytest

import dynax as dx
from dynax.graph.computation_graph import _engine
from reference import Chains, assert_matches_none_and_jax, train_pass

TOL = dict(rtol=1e-5, atol=1e-5)


def _same_shape_batches(n, seed=0):
    """Batches of one shape (lengths 3, 5, 2) with other words and labels each time."""
    rng = np.random.default_rng(seed)
    return [[(list(rng.integers(0, 10, k)), int(rng.integers(0, 4))) for k in (3, 5, 2)]
            for _ in range(n)]


def _run(model, batch, strategy):
    value, grads, stats, _ = train_pass(model, batch, strategy)
    return value, grads, stats["plans_reused"]


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_recurring_shape_reuses_its_plan_with_equal_values_and_gradients(strategy):
    dx.release_memory()
    model = Chains()
    reused = []
    for batch in _same_shape_batches(4):
        value, grads, n = _run(model, batch, strategy)
        reused.append(n)
        ref_value, ref_grads, _ = _run(model, batch, "none")
        assert_matches_none_and_jax(model, batch, value, grads, ref_value, ref_grads)
    # first sight remembers the shape, the second stores the plan, later ones reuse it
    assert reused == [0, 0, 1, 1]


def test_none_never_caches():
    dx.release_memory()
    model = Chains()
    assert [_run(model, b, "none")[2] for b in _same_shape_batches(3)] == [0, 0, 0]


def _fan_or_chain(chain: bool, x):
    """Two tanh nodes on one input: in a chain (depths 1, 2) or side by side (1, 1); the
    graphs have equal node and value counts."""
    a = dx.input(x)
    b = dx.tanh(a)
    c = dx.tanh(b if chain else a)
    return b, c


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_look_alike_graph_is_scheduled_afresh(strategy):
    """A fan's plan runs both nodes in one batch; reused for a chain, the second node would
    read the first before it is computed."""
    dx.release_memory()
    x = np.array([0.3, -1.2, 2.0], np.float32)
    for _ in range(3):
        cg = dx.renew_cg(autobatch=strategy)
        b, c = _fan_or_chain(False, x)
        dx.forward([b, c])
    assert cg.stats()["plans_reused"] == 1
    cg = dx.renew_cg(autobatch=strategy)
    b, c = _fan_or_chain(True, x)
    dx.forward([b, c])
    assert cg.stats()["plans_reused"] == 0
    np.testing.assert_allclose(c.npvalue(), np.tanh(np.tanh(x)), **TOL)


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_incremental_forwards_keep_their_own_plans(strategy):
    """Forward passes over later node ranges of one graph (as the parser's steps do) are
    keyed by their range and by the depths of what came before."""
    dx.release_memory()
    x = np.array([0.5, -0.25], np.float32)
    for _ in range(3):
        cg = dx.renew_cg(autobatch=strategy)
        h = dx.input(x)
        expected = x
        for _ in range(3):  # three forwards of one node each, at depths 1, 2, 3
            h = dx.tanh(h)
            expected = np.tanh(expected)
            np.testing.assert_allclose(h.npvalue(), expected, **TOL)
    assert cg.stats()["plans_reused"] == 3


def test_release_memory_forgets_plans():
    model = Chains()
    batches = _same_shape_batches(3)
    dx.release_memory()
    assert [_run(model, b, "agenda")[2] for b in batches] == [0, 0, 1]
    dx.release_memory()
    assert not _engine().plans.plans
    assert _run(model, batches[0], "agenda")[2] == 0


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_a_cached_plan_is_the_plan_scheduling_would_give(strategy):
    from dynax.batcher.plans import PlanCache
    from dynax.batcher.strategies import schedule
    cache = PlanCache(size=2)
    shapes = [(3, 5, 2), (4, 4), (3, 5, 2), (1, 6, 2, 2), (4, 4), (3, 5, 2)]
    rng = np.random.default_rng(1)
    model = Chains()
    for lengths in shapes * 2:
        cg = dx.renew_cg(autobatch=strategy)
        model.loss([(list(rng.integers(0, 10, k)), int(rng.integers(0, 4))) for k in lengths])
        n = cg.stats()["nodes"]
        assert list(cache.stream(strategy, cg, 0, n)) == schedule(strategy, cg, 0, n)
    assert cache.hits > 0


def test_full_keys_back_off_while_they_miss_and_a_recurring_graph_hits_again():
    """Graphs of one node and value count that never recur (lengths permuting one
    multiset: each one's cheap key is the others'): without a back-off every forward built
    a full key that missed (~5 ms of a Tree-LSTM update). The cache backs off to a few
    lookups per ``MAX_SKIP`` forwards, every plan stays the one scheduling gives, and a
    graph that then recurs is reused again, each forward once the back-off has wound down."""
    import itertools
    from dynax.batcher.plans import MAX_SKIP, PlanCache
    from dynax.batcher.strategies import schedule
    cache = PlanCache(size=2)
    model = Chains()

    def forward(lengths):
        cg = dx.renew_cg(autobatch="agenda")
        model.loss([([1] * k, 0) for k in lengths])
        n = cg.stats()["nodes"]
        assert list(cache.stream("agenda", cg, 0, n)) == schedule("agenda", cg, 0, n)

    distinct = itertools.permutations((1, 2, 3, 4, 5, 6, 7))
    for lengths in itertools.islice(distinct, 300):
        forward(lengths)
    assert cache.hits == 0
    assert cache.lookups <= 40  # 299 without the back-off
    again = next(distinct)
    for _ in range(MAX_SKIP + 20):
        forward(again)
    hits = cache.hits
    for _ in range(10):
        forward(again)
    assert cache.hits == hits + 10
