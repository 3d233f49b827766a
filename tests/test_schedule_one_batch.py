"""A pending set of one signature with no edges among it (a step of a model that computes
step by step) is planned as one batch without running a strategy (``strategies._one_batch``;
for depth, also one depth); the plan must be what the agenda and depth strategies give, and
anything else must still go to them. Values and gradients of a stepwise model: as ``none``
and ``jax.grad``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from dynax.batcher import strategies


@dx.function
def _score(x, W):
    return jnp.tanh(W @ x)


def _setup():
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 3), name="W")
    xs = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    return pc, W, xs


def _pending_scores(cg, W, inputs):
    lo = len(cg.node_sig)
    for x in inputs:
        _score(x, W)
    return lo, len(cg.node_sig)


def test_one_layer_is_one_batch_as_the_strategies_plan_it():
    _, W, xs = _setup()
    cg = dx.renew_cg()
    inputs = [dx.input(x) for x in xs]
    dx.forward(inputs)
    lo, hi = _pending_scores(cg, W, inputs)
    expected = [list(range(lo, hi))]
    for strategy in ("agenda", "depth"):
        assert strategies._one_batch(strategy, cg, lo, hi)
        assert strategies.schedule(strategy, cg, lo, hi) == expected
    assert strategies.by_agenda(cg, lo, hi) == expected
    assert strategies.by_depth(cg, lo, hi) == expected
    assert strategies.schedule("none", cg, lo, hi) == [[n] for n in range(lo, hi)]


def test_inputs_of_several_depths():
    """Independent nodes of one signature on inputs of different depths: one batch for the
    agenda; depth keeps them apart (its plan, not the shortcut)."""
    _, W, xs = _setup()
    cg = dx.renew_cg()
    inputs = [dx.input(x) for x in xs]
    inputs[1] = dx.tanh(dx.tanh(inputs[1]))
    dx.forward(inputs)
    lo, hi = _pending_scores(cg, W, inputs)
    assert strategies._one_batch("agenda", cg, lo, hi)
    assert strategies.schedule("agenda", cg, lo, hi) == strategies.by_agenda(cg, lo, hi) \
        == [list(range(lo, hi))]
    assert not strategies._one_batch("depth", cg, lo, hi)
    assert strategies.schedule("depth", cg, lo, hi) == strategies.by_depth(cg, lo, hi)
    assert len(strategies.by_depth(cg, lo, hi)) == 2


def test_a_chain_or_two_signatures_go_to_the_strategies():
    _, W, xs = _setup()
    cg = dx.renew_cg()
    x = dx.input(xs[0])
    dx.forward([x])
    lo = len(cg.node_sig)
    _score(_score(x, W), W)  # one signature, an edge: two batches
    for strategy in ("agenda", "depth"):
        assert not strategies._one_batch(strategy, cg, lo, len(cg.node_sig))
        assert strategies.schedule(strategy, cg, lo, len(cg.node_sig)) == [[lo], [lo + 1]]
    lo = len(cg.node_sig)
    _score(x, W)
    dx.tanh(x)  # no edge, two signatures
    for strategy in ("agenda", "depth"):
        assert not strategies._one_batch(strategy, cg, lo, len(cg.node_sig))
        assert len(strategies.schedule(strategy, cg, lo, len(cg.node_sig))) == 2


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda"])
def test_stepwise_model_values_and_gradients(strategy):
    """Each step scores every item from the last step's outputs (one forward per step)."""
    pc, W, xs = _setup()

    def reference(Wv):
        hs = [jnp.asarray(x) for x in xs]
        for _ in range(3):
            hs = [jnp.tanh(Wv @ h) for h in hs]
        return sum(jnp.sum(h) for h in hs)

    for p in pc.parameters():
        p.zero_grad()
    cg = dx.renew_cg(autobatch=strategy)
    hs = [dx.input(x) for x in xs]
    for _ in range(3):
        hs = [_score(h, W) for h in hs]
        dx.forward(hs)
    loss = dx.esum([dx.sum_elems(h) for h in hs])
    np.testing.assert_allclose(loss.value(), float(reference(W.value)), rtol=1e-5)
    loss.backward()
    np.testing.assert_allclose(W.grad, jax.grad(reference)(W.value), rtol=1e-5, atol=1e-6)
    if strategy != "none":
        assert [len(b.nodes) for b in cg.batches if b.sig.op is _score.op] == [5, 5, 5]
