"""Backward after incremental forward passes (``Engine._backward_plan``).

A value read after every step (a decoder or parser deciding from it, DyNet's ``.value()``
idiom) makes each forward pass compute a node or two. Backward then plans the finished
graph again instead of replaying those narrow batches: values and gradients must be those
of the same graph built without reads, of ``autobatch="none"`` and of ``jax.grad``, for
parameters, lookup rows and (``backward(full=True)``) inputs, also where lanes the loss does
not depend on share a batch with lanes it does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx

TOL = dict(rtol=1e-5, atol=1e-5)
H, V = 4, 10
SENTENCES = [([1, 2, 3, 4], 0), ([5, 6], 2), ([7, 8, 9], 1), ([2, 4, 6, 8, 0], 3),
             ([3, 1], 1), ([9, 8, 7, 6], 0), ([0, 5, 0], 2), ([4, 4, 1, 2, 3], 3)]


@dx.function
def step(x, h, W, U, b):
    return jnp.tanh(W @ x + U @ h + b)


class Model:
    def __init__(self):
        self.pc = pc = dx.ParameterCollection(seed=0)
        self.W = pc.add_parameters((H, H), name="W")
        self.U = pc.add_parameters((H, H), name="U")
        self.b = pc.add_parameters((H,), name="b")
        self.E = pc.add_lookup_parameters((V, H), name="E")

    def loss(self, read: bool, dead: bool = False, h0=None):
        """Summed cross-entropy of a label after each sentence; with ``read``, each step's
        state is read as it is built; with ``dead``, each step also scores a hypothesis the
        loss does not use, as a beam would: a step and a log-probability of the kinds the
        loss uses (so they share batches with its nodes), the latter underflowed, so that
        running its vjp would give NaN."""
        losses = []
        for words, label in SENTENCES:
            h = dx.zeros((H,)) if h0 is None else h0
            for w in words:
                if dead:
                    other = step(self.E[(w + 1) % V], h, self.W, self.U, self.b)
                    dx.log(dx.softmax(other * 1e4))
                h = step(self.E[w], h, self.W, self.U, self.b)
                if read:
                    h.npvalue()
            losses.append(-dx.pick(dx.log(dx.softmax(h)), label))
        return dx.esum(losses)

    def reference(self, W, U, b, E, h0):
        total = 0.0
        for words, label in SENTENCES:
            h = h0
            for w in words:
                h = jnp.tanh(W @ E[w] + U @ h + b)
            total = total - jax.nn.log_softmax(h)[label]
        return total


MODEL = Model()


def _run(strategy, read, dead=False, full=False):
    m = MODEL
    for p in m.pc.parameters():
        p.zero_grad()
    cg = dx.renew_cg(autobatch=strategy)
    h0 = dx.input(np.linspace(-0.5, 0.5, H).astype(np.float32))
    loss = m.loss(read, dead, h0)
    value = loss.scalar_value()
    loss.backward(full=full)
    grads = [np.asarray(p.grad) for p in m.pc.parameters()]
    return value, grads, (h0.gradient() if full else None), cg.stats()


def _reference():
    m = MODEL
    h0 = jnp.asarray(np.linspace(-0.5, 0.5, H).astype(np.float32))
    args = (m.W.value, m.U.value, m.b.value, m.E.value, h0)
    value, grads = jax.value_and_grad(m.reference, argnums=(0, 1, 2, 3, 4))(*args)
    return float(value), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
@pytest.mark.parametrize("dead", [False, True], ids=["", "dead_nodes"])
def test_backward_plans_again_after_reads_and_matches_the_references(strategy, dead):
    value, grads, h0_grad, stats = _run(strategy, read=True, dead=dead, full=True)
    _, plain_grads, _, plain = _run(strategy, read=False, dead=dead)
    want_value, want = _reference()
    # a forward pass per read: batches of a node or two; backward ran a plan of the graph
    assert stats["batches"] >= sum(len(w) for w, _ in SENTENCES)
    assert stats["backward_batches"] <= plain["batches"] < stats["batches"] / 2, stats
    assert value == pytest.approx(want_value, rel=1e-5)
    for got, ref, p in zip(grads, want[:4], MODEL.pc.parameters()):
        assert np.all(np.isfinite(got)), p.name
        np.testing.assert_allclose(got, ref, err_msg=p.name, **TOL)
    for got, ref in zip(grads, plain_grads):
        np.testing.assert_allclose(got, ref, **TOL)
    np.testing.assert_allclose(h0_grad, want[4], **TOL)  # an input's, from full=True


def test_the_unbatched_reference_replays_its_batches():
    """``none`` is node by node: with reads or without, backward runs its own batches."""
    value, grads, _, stats = _run("none", read=True)
    assert stats["backward_batches"] == stats["batches"]
    want_value, want = _reference()
    assert value == pytest.approx(want_value, rel=1e-5)
    for got, ref in zip(grads, want[:4]):
        np.testing.assert_allclose(got, ref, **TOL)


def test_backward_batches_count_only_what_ran():
    """Batches no loss depends on (a beam's pruned hypotheses) are skipped, and not counted."""
    cg = dx.renew_cg(autobatch="none")
    x = dx.input(np.ones(H, np.float32))
    for _ in range(5):
        dx.tanh(MODEL.W @ x)  # built, computed, never part of the loss
    loss = dx.sum_elems(MODEL.U @ x)
    loss.value()
    loss.backward()
    assert cg.stats()["batches"] == 12 and cg.stats()["backward_batches"] == 2


def test_one_forward_pass_keeps_the_forward_batches():
    """Without reads the forward's batches (and their saved residuals) serve backward; with
    them, the same graph gets a plan of its own."""
    _run("agenda", read=False)
    cg = dx.current_graph()
    assert cg.forward_passes == 1 and cg.engine._backward_plan(cg) is cg.batches
    _run("agenda", read=True)
    cg = dx.current_graph()
    plan = cg.engine._backward_plan(cg)
    assert plan is not cg.batches and all(b.gathered_outs for b in plan)


def test_a_table_row_update_after_a_planned_backward_is_exact():
    """Sparse SGD after a planned backward moves exactly the rows used, by -lr x their
    gradient (the rows come from the planned batches' nodes)."""
    m = MODEL
    before = np.asarray(m.E.value).copy()
    trainer = dx.SimpleSGDTrainer(m.pc, learning_rate=0.1)
    _, grads, _, stats = _run("agenda", read=True)
    assert stats["backward_batches"] < stats["batches"] / 2
    trainer.update()
    used = sorted({w for words, _ in SENTENCES for w in words})
    after = np.asarray(m.E.value)
    np.testing.assert_allclose(after[used], before[used] - 0.1 * grads[3][used], **TOL)
    unused = [r for r in range(V) if r not in used]
    np.testing.assert_array_equal(after[unused], before[unused])
