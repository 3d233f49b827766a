"""``Expression.gradient()`` (DyNet's): d(loss)/d(expression) after ``loss.backward()``.

Checked against plain JAX, where the gradient with respect to an intermediate value is
``jax.grad`` with respect to a zero added to it, for every strategy: a recurrent chain (the
agenda runs its steps as one fused scan), a multi-output node (a builder's LSTM cell) and
the loss itself; then its lifetime (the next backward pass, of this graph or another, takes
the arenas back) and the clear errors.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx

STRATEGIES = ("none", "depth", "agenda")
TOL = dict(rtol=1e-5, atol=1e-6)
LENGTHS = (4, 2, 5)  # three sequences of different lengths


def _model():
    pc = dx.ParameterCollection(seed=3)
    return pc, pc.add_parameters((3, 3)), pc.add_parameters((3, 2)), pc.add_parameters(3)


def _data():
    r = np.random.default_rng(0)
    return [r.normal(size=(n, 2)).astype(np.float32) for n in LENGTHS]


def _chain_reference(W, U, b, seqs):
    """Every hidden state's d(loss)/d(h): the gradient with respect to a zero added to it."""
    def loss(deltas):
        total = 0.0
        for xs, ds in zip(seqs, deltas):
            h = jnp.zeros(3)
            for x, d in zip(xs, ds):
                h = jnp.tanh(W @ h + U @ x + b) + d
            total = total + jnp.sum(h * h) * 0.5 + jnp.sum(h)
        return total
    return jax.grad(loss)([jnp.zeros((len(xs), 3)) for xs in seqs])


@dx.function
def _cell(W, U, b, h, x):  # one node per step, so the agenda can fuse a chain into a scan
    return jnp.tanh(W @ h + U @ x + b)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_of_every_state_of_a_recurrent_chain(strategy):
    pc, W, U, b = _model()
    seqs = _data()
    cg = dx.renew_cg(autobatch=strategy)
    states, losses = [], []
    for xs in seqs:
        h = dx.zeros(3)
        hs = []
        for x in xs:
            h = _cell(W, U, b, h, dx.input(x))
            hs.append(h)
        states.append(hs)
        losses.append(dx.sum_elems(h * h) * 0.5 + dx.sum_elems(h))
    loss = dx.esum(losses)
    loss.backward()
    want = _chain_reference(W.value, U.value, b.value, seqs)
    for hs, ws in zip(states, want):
        for h, w in zip(hs, ws):
            np.testing.assert_allclose(h.gradient(), np.asarray(w), **TOL)
            assert h.gradient().shape == (3,)
    assert loss.gradient() == pytest.approx(1.0)
    if strategy == "agenda":  # the chain's steps ran fused, and were still read one by one
        st = cg.stats()
        assert st["launches"] < st["batches"] < st["nodes"]


def test_gradient_of_a_multi_output_cell_matches_the_unbatched_reference():
    got = {}
    for strategy in STRATEGIES:
        pc = dx.ParameterCollection(seed=1)
        lstm = dx.LSTMBuilder(1, 2, 3, pc)
        dx.renew_cg(autobatch=strategy)
        outs = []
        for xs in _data():
            s = lstm.initial_state().add_inputs([dx.input(x) for x in xs])
            outs.append(s)
        loss = dx.esum([dx.sum_elems(dx.square(st[-1].output())) for st in outs])
        loss.backward()
        got[strategy] = [[st.output().gradient() for st in seq] for seq in outs]
    for strategy in ("depth", "agenda"):
        for a, b in zip(got["none"], got[strategy]):
            for x, y in zip(a, b):
                np.testing.assert_allclose(y, x, **TOL)
    assert np.abs(got["none"][0][0]).sum() > 0  # an early state gets a real gradient


def test_gradient_reflects_the_last_backward_pass_of_the_graph():
    pc, W, U, b = _model()
    dx.renew_cg()
    h = dx.tanh(W @ dx.input(np.ones(3, np.float32)) + b)
    dx.sum_elems(h).backward()
    np.testing.assert_allclose(h.gradient(), np.ones(3))
    (dx.sum_elems(h * h) * 3.0).backward()  # a second loss of the same graph
    np.testing.assert_allclose(h.gradient(), 6.0 * h.npvalue(), **TOL)
    unrelated = dx.tanh(b)  # built after the backward pass
    with pytest.raises(dx.InvalidArgumentError, match="built after the last backward"):
        unrelated.gradient()
    dx.sum_elems(h).backward()  # the earlier arenas were cleared before this pass reused them
    np.testing.assert_allclose(h.gradient(), np.ones(3))


def test_gradient_errors():
    pc, W, U, b = _model()
    cg = dx.renew_cg()
    x = dx.input(np.ones(3, np.float32))
    h = dx.tanh(W @ x + b)
    with pytest.raises(dx.InvalidArgumentError, match="call backward\\(\\) first"):
        h.gradient()
    dx.sum_elems(h).backward()
    with pytest.raises(dx.InvalidArgumentError, match="depends on no parameter"):
        x.gradient()
    np.testing.assert_allclose(h.gradient(), np.ones(3))
    dx.renew_cg()
    dx.sum_elems(dx.tanh(b)).backward()
    with pytest.raises(dx.StaleExpressionError, match="replaced by dx.renew_cg"):
        h.gradient()
    assert cg is not dx.current_graph()
    h2 = dx.tanh(b)
    dx.sum_elems(h2).backward()
    dx.release_memory()  # ends the current graph, gradients and values with it
    with pytest.raises(dx.StaleExpressionError, match="dx.release_memory"):
        h2.gradient()


def test_another_graphs_backward_pass_takes_the_gradients_back():
    pc, W, U, b = _model()
    dx.renew_cg()
    h = dx.tanh(W @ dx.input(np.ones(3, np.float32)) + b)
    dx.sum_elems(h).backward()
    # a second live graph, in another thread (graphs are per thread, and so are engines):
    # this thread's gradients stay readable
    import threading
    t = threading.Thread(target=lambda: (dx.renew_cg(), dx.sum_elems(dx.tanh(b)).backward()))
    t.start()
    t.join()
    np.testing.assert_allclose(h.gradient(), np.ones(3))


def test_gradient_is_the_callers_copy_and_a_constant_backward_keeps_none():
    pc, W, U, b = _model()
    dx.renew_cg()
    h = dx.tanh(b)
    dx.sum_elems(h).backward()
    g = h.gradient()
    g *= 0.5  # writable, as npvalue()'s
    np.testing.assert_allclose(h.gradient(), np.ones(3))
    dx.input(np.float32(2.0)).backward()  # a constant: nothing to differentiate
    with pytest.raises(dx.InvalidArgumentError, match="or of a constant, keeps none"):
        h.gradient()
