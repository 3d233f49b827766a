"""The backward pass run while a training loop's loss is read (``dynax/executor/early.py``).

Reads are made to wait (``engine._waiting``), as a training loop's loss read does, so the
engine runs ``backward()`` of the loss early and holds its gradients. Every test compares
with ``jax.grad`` of the same math, and with the engine's pass run live
(``BACKWARD_WHILE_WAITING`` off): held gradients are claimed by ``backward()`` of that loss
only, and anything else leaves no trace of them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynax as dx
from dynax.errors import StaleExpressionError
from dynax.executor import engine
from dynax.graph.computation_graph import _engine
from reference import STRATEGIES, rounded

TOL = dict(rtol=2e-5, atol=1e-6)
WORDS = [(1, 2, 2, 5), (3, 1), (4, 4, 0, 2, 6)]


@pytest.fixture
def reads_wait(monkeypatch):
    """Every read waits for the device; the early pass on (the default)."""
    monkeypatch.setattr(engine, "_waiting", lambda pending: True)
    monkeypatch.setattr(engine, "BACKWARD_WHILE_WAITING", True)


def _model(seed=0):
    pc = dx.ParameterCollection(seed=seed)
    W = pc.add_parameters((4, 3), name="W")
    b = pc.add_parameters((4,), name="b")
    E = pc.add_lookup_parameters((8, 3), name="E")
    return pc, W, b, E


def _loss(W, b, E, sentences):
    """Per word tanh(W e + b), summed over a recurrent chain per sentence."""
    losses = []
    for words in sentences:
        h = None
        for w in words:
            x = dx.tanh(W @ E[w] + b)
            h = x if h is None else dx.tanh(x + h)
        losses.append(dx.sum_elems(h))
    return dx.esum(losses)


def _ref_loss(params, sentences):
    W, b, E = params
    total = 0.0
    for words in sentences:
        h = None
        for w in words:
            x = jnp.tanh(W @ E[w] + b)
            h = x if h is None else jnp.tanh(x + h)
        total = total + jnp.sum(h)
    return total


def _values(*params):
    return tuple(jnp.asarray(p.value) for p in params)


def _train(strategy, early, sparse, steps=4):
    """A training loop (read, backward, update) with the early pass ``early``: per step
    the loss, whether a pass was held after the read, and the gradients; the parameters."""
    engine.BACKWARD_WHILE_WAITING = early
    _engine().search_ahead = False  # as in a new thread: the loop's pattern not seen yet
    pc, W, b, E = _model()
    trainer = dx.Trainer(pc, optax.adam(0.05), sparse_updates=sparse)
    out = []
    for step in range(steps):
        sentences = WORDS[step % len(WORDS):] + WORDS[:step % len(WORDS)]
        cg = dx.renew_cg(autobatch=strategy)
        loss = _loss(W, b, E, sentences)
        value = loss.value()
        held = cg.early is not None
        ref = jax.grad(_ref_loss)(_values(W, b, E), sentences)
        loss.backward()
        grads = [np.asarray(p.grad) for p in (W, b, E)]
        for got, want in zip(grads, ref):
            np.testing.assert_allclose(got, np.asarray(want), **TOL)
        out.append((value, held, grads, cg.stats()["backward_batches"]))
        trainer.update()
    return out, [np.asarray(p.value) for p in (W, b, E)]


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_training_loop_gets_the_gradients_of_the_live_pass(reads_wait, strategy, sparse):
    """From the second step on (once the loop has read its loss before a backward) each
    read holds a pass; the losses, gradients (also jax.grad's) and the trained parameters
    equal those of the live pass, dense or lazy Adam (the lookup table keeps a zeroed
    gradient buffer between lazy updates)."""
    try:
        early, p_early = _train(strategy, True, sparse)
        live, p_live = _train(strategy, False, sparse)
    finally:
        engine.BACKWARD_WHILE_WAITING = True
    assert [h for _, h, _, _ in early] == [False, True, True, True]
    assert not any(h for _, h, _, _ in live)
    for (v1, _, g1, n1), (v2, _, g2, n2) in zip(early, live):
        assert v1 == pytest.approx(v2, rel=1e-6) and n1 == n2
        for a, b in zip(g1, g2):
            np.testing.assert_allclose(a, b, **TOL)
    for a, b in zip(p_early, p_live):
        np.testing.assert_allclose(a, b, **TOL)


def _read_then(strategy="agenda", sentences=WORDS, lazy=False, hold=True):
    """A model after one training step (so the loop's pattern is known), then a new graph
    whose loss is read: the early pass held (``hold``; else the early pass must be off).
    ``lazy``: the step a lazy update, after which the lookup table keeps its gradient
    buffer, zeroed (the held pass starts from it)."""
    pc, W, b, E = _model()
    dx.renew_cg(autobatch=strategy)
    loss = _loss(W, b, E, sentences)
    loss.value()
    loss.backward()
    if lazy:
        dx.Trainer(pc, optax.sgd(0.1), sparse_updates=True).update()
        assert E._grad is not None and not E._has_grad
    else:
        pc.zero_grad()
    cg = dx.renew_cg(autobatch=strategy)
    loss = _loss(W, b, E, sentences)
    loss.value()
    assert (cg.early is not None) == hold
    return pc, (W, b, E), cg, loss


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_held_gradients_are_invisible_until_backward_claims_them(reads_wait, strategy, lazy):
    """Read but not differentiated: no parameter shows a gradient, the trainer updates
    nothing, and ``Expression.gradient()`` still says to call backward() first."""
    pc, params, cg, loss = _read_then(strategy, lazy=lazy)
    before = [np.asarray(p.value) for p in params]
    for p in params:
        assert not p._has_grad
        np.testing.assert_array_equal(np.asarray(p.grad), np.zeros(p.shape))
    with pytest.raises(dx.InvalidArgumentError, match="call backward"):
        loss.gradient()
    dx.Trainer(pc, optax.sgd(1.0)).update()
    for p, v in zip(params, before):
        np.testing.assert_array_equal(np.asarray(p.value), v)


def test_backward_claims_the_held_pass_and_launches_nothing(reads_wait, monkeypatch):
    """``backward()`` of the loss read takes the held gradients: no kernel runs then, and
    the loss's own gradient (the pass's arenas) reads 1."""
    pc, params, cg, loss = _read_then()
    ref = jax.grad(_ref_loss)(_values(*params), WORDS)
    ran = []
    monkeypatch.setattr(engine.Engine, "_backward_batch",
                        lambda self, *a, **k: ran.append(a))
    loss.backward()
    assert ran == [] and cg.early is None
    for p, want in zip(params, ref):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(want), **TOL)
    assert float(loss.gradient()) == 1.0


def _another_loss(early: bool):
    """The gradients and backward batch count of a second loss, after the first was read
    (its pass held if ``early``)."""
    engine.BACKWARD_WHILE_WAITING = early
    try:
        pc, (W, b, E), cg, loss = _read_then(hold=early)
    finally:
        engine.BACKWARD_WHILE_WAITING = True
    other = dx.sum_elems(dx.square(W @ E[3]))
    other.backward()
    assert cg.early is None
    return [np.asarray(p.grad) for p in (W, b, E)], cg.stats()["backward_batches"], (W, E)


def test_backward_of_another_loss_drops_the_held_pass(reads_wait):
    """Another loss of the same graph gets its own gradients (jax.grad's), nothing of the
    held pass, and the graph counts the backward batches of that loss's pass only."""
    grads, n, (W, E) = _another_loss(True)
    want = jax.grad(lambda W, E: jnp.sum(jnp.square(W @ E[3])), argnums=(0, 1))(
        jnp.asarray(W.value), jnp.asarray(E.value))
    np.testing.assert_allclose(grads[0], np.asarray(want[0]), **TOL)
    np.testing.assert_allclose(grads[2], np.asarray(want[1]), **TOL)
    np.testing.assert_array_equal(grads[1], np.zeros(4))
    assert n == _another_loss(False)[1]


def test_a_full_backward_drops_the_held_pass_and_keeps_every_gradient(reads_wait):
    """``backward(full=True)`` runs live: the gradient of an input (which the held pass
    did not keep) is jax.grad's."""
    pc, (W, b, E), cg, loss = _read_then()
    x = dx.input(np.array([0.5, -1.0, 2.0], np.float32))
    y = dx.sum_elems(dx.tanh(W @ x + b))
    y.value()  # another read, after the held pass: it holds no second one
    y.backward(full=True)
    want = jax.grad(lambda x: jnp.sum(jnp.tanh(jnp.asarray(W.value) @ x
                                               + jnp.asarray(b.value))))(
        jnp.array([0.5, -1.0, 2.0], jnp.float32))
    np.testing.assert_allclose(x.gradient(), np.asarray(want), **TOL)


def test_parameters_changed_before_backward_are_refused_as_without_it(reads_wait):
    """A trainer update between the read and backward(): refused, as it is live."""
    pc, (W, b, E), cg, loss = _read_then()
    W.set_value(np.ones((4, 3), np.float32))
    with pytest.raises(StaleExpressionError, match="parameter W changed"):
        loss.backward()


def test_nodes_computed_after_the_read_drop_the_held_pass(reads_wait):
    """Nodes built and computed after the read: backward of the loss runs live, and gives
    jax.grad's gradients."""
    pc, params, cg, loss = _read_then()
    W, b, E = params
    extra = dx.tanh(W @ E[7])
    extra.value()
    loss.backward()
    ref = jax.grad(_ref_loss)(_values(*params), WORDS)
    for p, want in zip(params, ref):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(want), **TOL)


@pytest.mark.parametrize("lazy", [False, True])
def test_an_unclaimed_pass_leaves_the_next_graph_and_the_stats_alone(reads_wait, lazy):
    """A read never differentiated (a validation loss), then a new graph trained: its
    gradients are jax.grad's, and the first graph's stats count no backward batch."""
    pc, params, cg, loss = _read_then(lazy=lazy)
    dx.renew_cg()
    assert cg.stats()["backward_batches"] == 0
    sentences = WORDS[1:]
    loss = _loss(*params, sentences)
    loss.value()
    loss.backward()
    ref = jax.grad(_ref_loss)(_values(*params), sentences)
    for p, want in zip(params, ref):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(want), **TOL)


def test_a_backward_that_fails_early_raises_in_backward(reads_wait):
    """The loss depends on a function JAX cannot differentiate: the held pass fails
    quietly, and ``backward()`` raises what it raises live."""
    pc, (W, b, E), _, _ = _read_then()
    pc.zero_grad()
    cg = dx.renew_cg()
    loss = dx.sum_elems(rounded(W @ E[1]) * (W @ E[2]))
    loss.value()
    assert cg.early is None
    with pytest.raises(ValueError, match="JAX cannot differentiate"):
        loss.backward()
    assert not W._has_grad


def test_after_release_memory_a_read_runs_no_backward_ahead(reads_wait):
    """A training loop arms the pass run ahead; ``dx.release_memory()`` disarms it, so a
    train-mode graph read after it (an evaluation) allocates no gradient arena. The next
    training step, read then differentiated, arms it again, and its gradients are
    jax.grad's."""
    pc, params, cg, loss = _read_then()
    loss.backward()  # claimed: the loop's pattern, seen
    pc.zero_grad()
    assert _engine().search_ahead
    dx.release_memory()
    cg = dx.renew_cg()
    _loss(*params, WORDS).value()
    assert cg.early is None and cg.loss_live is None and not _engine().spare_grads
    for step in range(2):  # the first backward arms it, the second step's read runs it
        pc.zero_grad()
        cg = dx.renew_cg()
        loss = _loss(*params, WORDS)
        loss.value()
        assert (cg.early is not None) == (step == 1)
        loss.backward()
    ref = jax.grad(_ref_loss)(_values(*params), WORDS)
    for p, want in zip(params, ref):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(want), **TOL)
