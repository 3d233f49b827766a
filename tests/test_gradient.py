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


@dx.function
def _cell_unpacked(W, U, b, h, x):  # _cell's math as an op of its own: kernels of its own
    return jnp.tanh(W @ h + U @ x + b)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_of_every_state_of_a_recurrent_chain(strategy, packed, monkeypatch):
    """``unpacked``: every saved residual returned as a buffer of its own, the path of
    large residuals (``kernels._pack``), instead of one flat buffer per dtype."""
    cell = _cell
    if not packed:
        monkeypatch.setattr(dx.executor.kernels, "PACK_MAX_ELEMENTS", 1)
        cell = _cell_unpacked
    pc, W, U, b = _model()
    seqs = _data()
    cg = dx.renew_cg(autobatch=strategy)
    states, losses = [], []
    for xs in seqs:
        h = dx.zeros(3)
        hs = []
        for x in xs:
            h = cell(W, U, b, h, dx.input(x))
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


# ---- backward(full=True): the gradients of inputs too --------------------------------------

def _input_reference(W, U, b, seqs, extra):
    """d(loss)/d(every input) of the chain's loss plus a branch no parameter reaches."""
    def loss(xs_all, e):
        total = jnp.sum(jnp.tanh(e) ** 2)
        for xs in xs_all:
            h = jnp.zeros(3)
            for x in xs:
                h = jnp.tanh(W @ h + U @ x + b)
            total = total + jnp.sum(h * h) * 0.5 + jnp.sum(h)
        return total
    return jax.grad(loss, argnums=(0, 1))([jnp.asarray(xs) for xs in seqs], jnp.asarray(extra))


def _chain_with_inputs(W, U, b, seqs, extra, strategy, **graph):
    """The chain's graph, its inputs as expressions: (loss, per-sequence inputs, extra)."""
    dx.renew_cg(autobatch=strategy, **graph)
    inputs, losses = [], []
    for xs in seqs:
        h = dx.zeros(3)
        ins = [dx.input(x) for x in xs]
        for x in ins:
            h = _cell(W, U, b, h, x)  # x meets a parameter: saved residuals omit its vjp
        inputs.append(ins)
        losses.append(dx.sum_elems(h * h) * 0.5 + dx.sum_elems(h))
    e = dx.input(extra)
    losses.append(dx.sum_elems(dx.square(dx.tanh(e))))  # no parameter: no residuals at all
    return dx.esum(losses), inputs, e


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_backward_gives_every_input_its_gradient(strategy):
    """backward(full=True) equals jax.grad with respect to the inputs, and leaves the
    parameters' gradients exactly as a plain backward pass does."""
    pc, W, U, b = _model()
    seqs, extra = _data(), np.array([0.3, -1.2], np.float32)
    want_x, want_e = _input_reference(W.value, U.value, b.value, seqs, extra)
    loss, inputs, e = _chain_with_inputs(W, U, b, seqs, extra, strategy)
    loss.backward(full=True)
    for ins, ws in zip(inputs, want_x):
        for x, w in zip(ins, ws):
            np.testing.assert_allclose(x.gradient(), np.asarray(w), **TOL)
    np.testing.assert_allclose(e.gradient(), np.asarray(want_e), **TOL)
    assert np.abs(np.asarray(want_x[0][0])).sum() > 0  # an early input gets a real gradient
    full_grads = [np.array(p.grad) for p in (W, U, b)]
    for p in (W, U, b):
        p.zero_grad()
    loss, _, _ = _chain_with_inputs(W, U, b, seqs, extra, strategy)
    loss.backward()
    for p, got in zip((W, U, b), full_grads):
        np.testing.assert_allclose(got, p.grad, **TOL)


def test_full_backward_in_validity_mode_matches_the_lazy_graph():
    pc, W, U, b = _model()
    seqs, extra = _data(), np.array([0.3, -1.2], np.float32)
    got = {}
    for graph in ({}, {"check_validity": True}):
        loss, inputs, e = _chain_with_inputs(W, U, b, seqs, extra, "agenda", **graph)
        loss.backward(full=True)
        got[bool(graph)] = [x.gradient() for ins in inputs for x in ins] + [e.gradient()]
    for a, c in zip(got[False], got[True]):
        np.testing.assert_allclose(c, a, **TOL)


def test_full_backward_lifetime_and_errors():
    pc, W, U, b = _model()
    dx.renew_cg()
    x = dx.input(np.ones(3, np.float32))
    unread = dx.input(np.full(3, 2.0, np.float32))  # built before, not read by the loss
    loss = dx.sum_elems(dx.tanh(W @ x + b))
    loss.backward()
    with pytest.raises(dx.InvalidArgumentError, match=r"depends on no parameter.*"
                                                      r"backward\(full=True\)"):
        x.gradient()
    loss.backward(full=True)
    want = jax.grad(lambda v: jnp.sum(jnp.tanh(W.value @ v + b.value)))(jnp.ones(3))
    np.testing.assert_allclose(x.gradient(), np.asarray(want), **TOL)
    np.testing.assert_array_equal(unread.gradient(), np.zeros(3))
    loss.backward(full=True)  # the last pass's arenas were cleared first: not doubled
    np.testing.assert_allclose(x.gradient(), np.asarray(want), **TOL)
    loss.backward()  # a plain pass keeps no input's gradient again
    with pytest.raises(dx.InvalidArgumentError, match="depends on no parameter"):
        x.gradient()


@pytest.mark.parametrize("train", [True, False])
def test_full_backward_through_lookups_and_random_draws(train):
    """A lookup's table gradient (also after an evaluation forward, which saved no
    residuals) and a random draw, which has no argument: its gradient is the loss's
    with respect to the drawn values."""
    pc = dx.ParameterCollection(seed=2)
    E = pc.add_lookup_parameters((5, 3))
    dx.renew_cg(train=train, autobatch="agenda")
    noise = dx.random_normal(3)
    rows = [E[i] for i in (1, 4, 1)]
    loss = dx.esum([dx.sum_elems(dx.square(r + noise)) for r in rows])
    loss.backward(full=True)
    n, table = noise.npvalue(), np.asarray(E.value)
    want = np.zeros((5, 3), np.float32)
    for i in (1, 4, 1):
        want[i] += 2 * (table[i] + n)
    np.testing.assert_allclose(E.grad, want, **TOL)
    np.testing.assert_allclose(noise.gradient(), sum(2 * (table[i] + n) for i in (1, 4, 1)),
                               **TOL)
