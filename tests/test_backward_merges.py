"""Backward batches merged across forward passes (``executor/merges.py``).

A parser-like loop: an encoder computed in the first pass, then steps in lockstep, each a
forward pass over every parser's scores, read to decide the next features; each decision's
score is picked as a loss term (computed in the next pass), and the loss sums them after
the last step. The steps' pick batches merge into one backward batch, and so, behind them,
do their score batches. Values and gradients must be those of
``autobatch="none"`` and of ``jax.grad`` over the same decisions, for parameters, lookup
rows and (``backward(full=True)``) inputs, also where some scores are read but left out
of the loss; and batches whose nodes are read before the next one runs must not merge.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from dynax.executor.merges import merged_groups

TOL = dict(rtol=1e-5, atol=1e-5)
H, V, STEPS = 4, 12, 6
SENTENCES = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [2, 4, 6, 8, 11, 0], [3, 1], [9, 8, 7, 6],
             [5, 5, 0], [11, 10, 9, 8], [4, 7], [0, 1, 2], [6, 3, 9, 1, 11], [7, 2]]


@dx.function
def encode(x, W):
    return jnp.tanh(W @ x)


@dx.function
def score(a, b, U, c):
    """Three action scores from two encodings."""
    return U @ jnp.tanh(a * b + c)


class Model:
    def __init__(self):
        self.pc = pc = dx.ParameterCollection(seed=0)
        self.E = pc.add_lookup_parameters((V, H), name="E")
        self.W = pc.add_parameters((H, H), name="W")
        self.U = pc.add_parameters((3, H), name="U")
        self.c = pc.add_parameters((H,), name="c")

    def loss(self, x0, dead: bool = False, chain: bool = False):
        """Summed scores picked by each step's decision; the decisions (feature positions)
        are returned too, for the reference. With ``dead``, every other sentence's scores
        decide but stay out of the loss; with ``chain``, each step's scores feed the next
        step's first encoding (so the score batches depend on each other)."""
        encs = [[encode(self.E[w] + x0, self.W) for w in s] for s in SENTENCES]
        pos = [0] * len(SENTENCES)
        carry = [None] * len(SENTENCES)
        terms, decisions = [], []
        for _ in range(STEPS):
            step = []
            for i, s in enumerate(SENTENCES):
                a = encs[i][pos[i]]
                if chain and carry[i] is not None:
                    a = dx.tanh(dx.sum_elems(carry[i]) * a)
                step.append(score(a, encs[i][(pos[i] + 1) % len(s)], self.U, self.c))
            dx.forward(step)
            for i, e in enumerate(step):
                k = int(np.argmax(e.npvalue()))
                decisions.append((i, pos[i], k))
                if not (dead and i % 2):
                    terms.append(dx.pick(e, k))
                carry[i] = e
                pos[i] = (pos[i] + k + 1) % len(SENTENCES[i])
        return dx.esum(terms), decisions

    def reference(self, E, W, U, c, x0, decisions, dead: bool = False, chain: bool = False):
        encs = [[jnp.tanh(W @ (E[w] + x0)) for w in s] for s in SENTENCES]
        total, carry = 0.0, [None] * len(SENTENCES)
        for i, p, k in decisions:
            s = SENTENCES[i]
            a = encs[i][p]
            if chain and carry[i] is not None:
                a = jnp.tanh(jnp.sum(carry[i]) * a)
            out = U @ jnp.tanh(a * encs[i][(p + 1) % len(s)] + c)
            carry[i] = out
            if not (dead and i % 2):
                total = total + out[k]
        return total


MODEL = Model()
X0 = np.linspace(-0.3, 0.3, H).astype(np.float32)


def _run(strategy, dead=False, chain=False, full=False):
    m = MODEL
    for p in m.pc.parameters():
        p.zero_grad()
    cg = dx.renew_cg(autobatch=strategy)
    x0 = dx.input(X0)
    loss, decisions = m.loss(x0, dead, chain)
    value = loss.scalar_value()
    loss.backward(full=full)
    grads = [np.asarray(p.grad) for p in m.pc.parameters()]
    return value, grads, (x0.gradient() if full else None), decisions, cg


def _reference(decisions, dead=False, chain=False):
    m = MODEL
    args = (m.E.value, m.W.value, m.U.value, m.c.value, jnp.asarray(X0))
    value, grads = jax.value_and_grad(
        lambda *a: m.reference(*a, decisions, dead, chain), argnums=(0, 1, 2, 3, 4))(*args)
    return float(value), [np.asarray(g) for g in grads]


def _score_batches(cg, batches) -> int:
    return sum(1 for b in batches if b.sig.op.name == "score")


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
@pytest.mark.parametrize("dead", [False, True], ids=["", "dead_lanes"])
def test_the_steps_score_batches_merge_and_match_the_references(strategy, dead):
    value, grads, x0_grad, decisions, cg = _run(strategy, dead=dead, full=True)
    # one score batch per step forward, and one of the picks of each step's decisions (in
    # the pass after it); backward runs all picks as one batch, then all scores as one, the
    # other batches as they ran (these steps are too wide for a plan of the whole graph)
    assert _score_batches(cg, cg.batches) == STEPS
    plan = cg.engine._backward_plan(cg)
    assert [b.sig.op.name for b in plan if b.gathered_outs] == ["score", "pick"]
    assert _score_batches(cg, plan) == 1
    assert cg.stats()["backward_batches"] <= cg.stats()["batches"] - (STEPS - 1)
    want_value, want = _reference(decisions, dead)
    assert value == pytest.approx(want_value, rel=1e-5)
    for got, ref, p in zip(grads, [want[0], want[1], want[2], want[3]],
                           MODEL.pc.parameters()):
        np.testing.assert_allclose(got, ref, err_msg=p.name, **TOL)
    np.testing.assert_allclose(x0_grad, want[4], **TOL)  # an input's, from full=True
    # and those of the unbatched reference, over the same decisions
    none_value, none_grads, _, none_decisions, _ = _run("none", dead=dead)
    assert none_decisions == decisions
    assert none_value == pytest.approx(value, rel=1e-5)
    for got, ref in zip(grads, none_grads):
        np.testing.assert_allclose(got, ref, **TOL)


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_batches_read_before_the_next_one_do_not_merge(strategy):
    """Each step's scores feed the next step: no two score batches are independent."""
    value, grads, _, decisions, cg = _run(strategy, chain=True)
    assert not any(cg.batches[m[0]].sig.op.name == "score"
                   for m in merged_groups(cg, cg.batches))
    assert _score_batches(cg, cg.engine._backward_plan(cg)) == STEPS
    want_value, want = _reference(decisions, chain=True)
    assert value == pytest.approx(want_value, rel=1e-5)
    for got, ref, p in zip(grads, want, MODEL.pc.parameters()):
        np.testing.assert_allclose(got, ref, err_msg=p.name, **TOL)


def test_one_forward_pass_keeps_its_batches():
    """Built without reads, the same kind of graph runs its forward's batches backward."""
    m = MODEL
    cg = dx.renew_cg()
    x0 = dx.input(X0)
    encs = [encode(m.E[w] + x0, m.W) for w in SENTENCES[0]]
    loss = dx.esum([dx.pick(score(a, b, m.U, m.c), 0) for a, b in zip(encs, encs[1:])])
    loss.value()
    assert cg.forward_passes == 1 and cg.engine._backward_plan(cg) is cg.batches


def test_a_large_group_runs_in_chunks_of_one_size(monkeypatch):
    """A group larger than ``MERGE_CHUNK`` runs as chunks of that many lanes, the last one
    padded: one kernel whatever the group's size."""
    from dynax.executor import engine
    monkeypatch.setattr(engine, "MERGE_CHUNK", 16)
    value, grads, x0_grad, decisions, cg = _run("agenda", full=True)
    scores = [b for b in cg.engine._backward_plan(cg) if b.sig.op.name == "score"]
    n = len(SENTENCES) * STEPS
    assert [len(b.nodes) for b in scores] == [16] * (n // 16) + [n % 16]
    assert {b.B for b in scores} == {16}
    want_value, want = _reference(decisions)
    assert value == pytest.approx(want_value, rel=1e-5)
    for got, ref, p in zip(grads, want, MODEL.pc.parameters()):
        np.testing.assert_allclose(got, ref, err_msg=p.name, **TOL)
    np.testing.assert_allclose(x0_grad, want[4], **TOL)
