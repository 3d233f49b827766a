"""Replayed preparation: a reused plan's rows and packets, prepared as the last time it ran.

Replaying must never change a value or a gradient (compared with ``autobatch="none"`` and
with ``jax.grad`` of the same math), the per-instance ints (words, labels, dropout's seed)
must be read again every time, and a graph whose state differs from the recorded one (rows
handed out before, gradient flags, ``train``) must be prepared afresh."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from dynax.executor import engine
from reference import check_against_none_and_jax, train_pass

TOL = dict(rtol=1e-5, atol=1e-5)


class Chains:
    """Per instance: from a given start vector, a chain of ``tanh(W @ h + E[w])`` over its
    words (dropout on each step with ``p``), then a loss."""

    def __init__(self, p: float = 0.0):
        self.pc = pc = dx.ParameterCollection(seed=0)
        self.W = pc.add_parameters((4, 4), name="W")
        self.E = pc.add_lookup_parameters((10, 4), name="E")
        self.p = p

    def loss(self, batch):
        losses = []
        for start, words, label in batch:
            h = dx.inputVector(start)  # a constant each instance reads: its row matters
            for w in words:
                h = dx.tanh(self.W @ h + self.E[w])
                if self.p:
                    h = dx.dropout(h, self.p)
            losses.append(dx.pickneglogsoftmax(h, label))
        return dx.esum(losses)

    def reference(self, W, E, batch):
        total = 0.0
        for start, words, label in batch:
            h = jnp.asarray(start)
            for w in words:
                h = jnp.tanh(W @ h + E[w])
            total = total - jax.nn.log_softmax(h)[label]
        return total


def _batches(n, seed=0, lengths=(3, 5, 2)):
    """Batches of one shape with other start vectors, words and labels each time."""
    rng = np.random.default_rng(seed)
    return [[(rng.normal(size=4).astype(np.float32), list(rng.integers(0, 10, k)),
              int(rng.integers(0, 4))) for k in lengths] for _ in range(n)]


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_a_recurring_shape_replays_its_preparation_with_equal_values_and_gradients(strategy):
    dx.release_memory()
    model = Chains()
    replayed = []
    for batch in _batches(5):
        value, grads, stats, _ = train_pass(model, batch, strategy)
        replayed.append((stats["plans_reused"], stats["plans_replayed"]))
        check_against_none_and_jax(model, batch, value, grads)
    # first sight remembers the shape, the second stores the plan, the third reuses it and
    # records its preparation, later ones replay that
    assert replayed == [(0, 0), (0, 0), (1, 0), (1, 1), (1, 1)]


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_replays_read_each_graphs_ints_dropout_seeds_included(strategy):
    dx.release_memory()
    model = Chains(p=0.5)
    for k, batch in enumerate(_batches(5)):
        value, grads, stats, _ = train_pass(model, batch, strategy, seed=100 + k)
        ref_value, ref_grads, _, _ = train_pass(model, batch, "none", seed=100 + k)
        np.testing.assert_allclose(value, ref_value, **TOL)
        for name in grads:
            np.testing.assert_allclose(grads[name], ref_grads[name], **TOL)
    assert stats["plans_replayed"] == 1


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_a_graph_with_other_rows_before_its_nodes_is_prepared_afresh(strategy):
    """Same nodes and value count, but an unread constant of another shape first: the
    instances' start vectors then have other rows (a replay would read the old ones)."""
    dx.release_memory()
    model = Chains()
    batches = _batches(7, seed=3)
    first = np.arange(4, dtype=np.float32)
    other = np.arange(5, dtype=np.float32)
    seen = []
    for k, batch in enumerate(batches):
        x = first if k < 4 else other
        value, grads, stats, extra = train_pass(model, batch, strategy, before=lambda: dx.input(x))
        seen.append((stats["plans_reused"], stats["plans_replayed"]))
        np.testing.assert_array_equal(extra.npvalue(), x)  # before the references' graphs
        check_against_none_and_jax(model, batch, value, grads)
    # the 5th graph reuses the plan, but not the preparation recorded for the 3rd; it
    # records its own, which the 6th and 7th replay
    assert seen == [(0, 0), (0, 0), (1, 0), (1, 1), (1, 0), (1, 1), (1, 1)]


def test_a_graph_built_with_train_false_is_prepared_afresh():
    """Without training, batches save no residuals for backward (other gradient flags)."""
    dx.release_memory()
    model = Chains()
    batches = _batches(6, seed=4)
    for batch in batches[:4]:
        train_pass(model, batch, "agenda")
    for batch in batches[4:]:
        cg = dx.renew_cg(train=False)
        loss = model.loss(batch)
        value = loss.scalar_value()
        np.testing.assert_allclose(value, model.reference(model.W.value, model.E.value, batch),
                                   **TOL)
    # the first eval graph prepares afresh (and records); the second replays that
    assert cg.stats()["plans_reused"] == 1 and cg.stats()["plans_replayed"] == 1
    assert all(b.gflags is None for b in cg.batches)


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_incremental_forwards_replay_with_the_values_they_read_from_before(strategy):
    """Each step is its own forward pass reading the step before (as a decoder reading
    each step's value): the later passes' plans read values of earlier passes."""
    dx.release_memory()
    model = Chains()
    rng = np.random.default_rng(5)
    for _ in range(5):
        cg = dx.renew_cg(autobatch=strategy)
        start = rng.normal(size=4).astype(np.float32)
        words = list(rng.integers(0, 10, 3))
        h, expected = dx.inputVector(start), start
        for w in words:
            h = dx.tanh(model.W @ h + model.E[w])
            expected = np.tanh(np.asarray(model.W.value) @ expected
                               + np.asarray(model.E.value)[w])
            np.testing.assert_allclose(h.npvalue(), expected, **TOL)
    assert cg.stats()["plans_replayed"] == 3


def test_turned_off_replays_nothing_and_agrees(monkeypatch):
    dx.release_memory()
    batches = _batches(4, seed=6)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(engine, "REPLAY_PREPARED", on)
        dx.release_memory()
        model = Chains()
        out = [train_pass(model, batch, "agenda") for batch in batches]
        results[on] = out
        assert out[-1][2]["plans_replayed"] == (1 if on else 0)
    for (v1, g1, _, _), (v2, g2, _, _) in zip(results[True], results[False]):
        assert v1 == v2
        for name in g1:
            np.testing.assert_array_equal(g1[name], g2[name])


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_a_pass_reading_values_that_earlier_passes_put_in_other_rows_is_prepared_afresh(
        strategy):
    """Two LSTM steps (two outputs each, in one arena) computed in one pass put the first
    one's h in another row (5) than when it is computed alone (3), with as many rows handed
    out in all; the pass after, ``tanh`` of that h, has the same plan either way and must
    read the row of this graph."""
    dx.release_memory()
    pc = dx.ParameterCollection(seed=0)
    lstm = dx.nn.LSTMBuilder(1, 3, 4, pc)
    rng = np.random.default_rng(7)
    seen = []
    for together in (True, True, True, False, False):
        cg = dx.renew_cg(autobatch=strategy)
        s0 = lstm.initial_state()
        xs = [rng.normal(size=3).astype(np.float32) for _ in range(2)]
        first = s0.add_input(dx.inputVector(xs[0]))
        if not together:
            first.output().forward()
        rest = [s0.add_input(dx.inputVector(x)) for x in xs[1:]]
        dx.forward([s.output() for s in rest])
        h = first.output()
        t = dx.tanh(h)
        np.testing.assert_allclose(t.npvalue(), np.tanh(h.npvalue()), **TOL)
        seen.append(cg.stats()["plans_replayed"])
    # together: the tanh pass records on the third graph; apart, it is prepared afresh
    # (and recorded again), then replayed
    assert seen == [0, 0, 0, 0, 1]
