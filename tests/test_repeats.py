"""Lanes that repeat another lane's computation run once (``executor/repeats.py``).

A Tree-LSTM-like model whose leaves repeat words: the leaf cells of repeated words repeat
(lookups of one row are known equal), and so do the cells above two repeated leaves. Every
strategy's values, parameter gradients and ``Expression.gradient()`` are checked against
``autobatch="none"`` and against ``jax.grad`` of the same math; then the cases where the
engine must not merge (full backward, lanes the loss does not read), random draws, an
evaluation graph, and the gate that stops looking where nothing repeats.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynax as dx
from dynax.errors import StaleExpressionError
from dynax.executor import engine
from dynax.executor.repeats import MAX_SKIP, RepeatGate
from reference import every_repeat_runs_once

STRATEGIES = ("none", "depth", "agenda")
TOL = dict(rtol=1e-5, atol=1e-6)
TREES = [[1, 2, 1, 3], [1, 2, 2], [3, 5, 1, 2], [1, 2], [1, 2, 5], [2, 1]]  # (1, 2) repeats


@pytest.fixture(autouse=True)
def repeats_always_run_once(monkeypatch):
    """Small cells: every batch with repeats runs on its distinct lanes."""
    every_repeat_runs_once(monkeypatch)


@dx.function
def _leaf(x, W, b):
    return jnp.tanh(W @ x + b)


@dx.function
def _pair(hl, hr, U, b):
    return jnp.tanh(U @ jnp.concatenate([hl, hr]) + b)


def _model():
    pc = dx.ParameterCollection(seed=1)
    return (pc, pc.add_lookup_parameters((8, 4)), pc.add_parameters((4, 4)),
            pc.add_parameters(4), pc.add_parameters((4, 8)), pc.add_parameters(4))


def _build(E, W, b, U, c, trees=TREES):
    """Per tree: leaves, then left-to-right pairs (a chain); the loss and the embeddings
    and leaf states built (for ``gradient()``)."""
    losses, embs, leaves = [], [], []
    for ws in trees:
        xs = [E[w] for w in ws]
        hs = [_leaf(x, W, b) for x in xs]
        embs += xs
        leaves += hs
        h = hs[0]
        for k in range(1, len(hs)):
            h = _pair(h, hs[k], U, c)
        losses.append(dx.sum_elems(h * h) + dx.pick(hs[-1], ws[0] % 4))
    return dx.esum(losses), embs, leaves


def _reference(E, W, b, U, c, trees=TREES):
    """jax.grad of the same math: w.r.t. the parameters, and w.r.t. a zero added to each
    embedding and leaf state (their gradients)."""
    n = sum(map(len, trees))

    def loss(params, d_emb, d_leaf):
        E, W, b, U, c = params
        total, k = 0.0, 0
        for ws in trees:
            hs = []
            for w in ws:
                hs.append(jnp.tanh(W @ (E[w] + d_emb[k]) + b) + d_leaf[k])
                k += 1
            h = hs[0]
            for hk in hs[1:]:
                h = jnp.tanh(U @ jnp.concatenate([h, hk]) + c)
            total = total + jnp.sum(h * h) + hs[-1][ws[0] % 4]
        return total

    params = tuple(p.value for p in (E, W, b, U, c))
    zeros = jnp.zeros((n, 4))
    return loss(params, zeros, zeros), jax.grad(loss, argnums=(0, 1, 2))(params, zeros, zeros)


def _distinct_batches(cg):
    return [b for b in cg.batches if b.distinct]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_values_and_gradients_match_none_and_jax_grad(strategy):
    pc, *params = _model()
    cg = dx.renew_cg(autobatch=strategy)
    loss, embs, leaves = _build(*params)
    value = loss.value()
    loss.backward()
    grads = [np.asarray(p.grad) for p in params]
    want_value, (want_params, want_emb, want_leaf) = _reference(*params)
    np.testing.assert_allclose(value, want_value, **TOL)
    for got, want in zip(grads, want_params):
        np.testing.assert_allclose(got, np.asarray(want), **TOL)
    if strategy == "none":  # one node a batch: nothing to repeat
        assert not _distinct_batches(cg) and cg.stats()["repeated_lanes"] == 0
    else:  # the leaves repeat (14 of 18: 4 words), and pairs of repeated leaves
        ops = {b.sig.op.name for b in _distinct_batches(cg)}
        assert {"_leaf", "_pair"} <= ops, ops
        assert cg.stats()["repeated_lanes"] > 14
        assert cg.merged is not None  # the backward pass merged repeated lanes
    # each expression's own gradient, also upstream of merged lanes (the pass runs again
    # lane by lane), while the parameters keep the first pass's gradients
    for e, want in zip(embs, want_emb):
        np.testing.assert_allclose(e.gradient(), np.asarray(want), **TOL)
    for h, want in zip(leaves, want_leaf):
        np.testing.assert_allclose(h.gradient(), np.asarray(want), **TOL)
    for p, before in zip(params, grads):
        np.testing.assert_array_equal(np.asarray(p.grad), before)


@pytest.mark.parametrize("strategy", ("depth", "agenda"))
def test_repeated_lanes_are_not_merged_in_a_full_backward(strategy):
    pc, *params = _model()
    cg = dx.renew_cg(autobatch=strategy)
    loss, embs, _ = _build(*params)
    loss.backward(full=True)
    assert _distinct_batches(cg) and cg.merged is None
    _, (want_params, want_emb, _) = _reference(*params)
    for p, want in zip(params, want_params):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(want), **TOL)
    for e, want in zip(embs, want_emb):
        np.testing.assert_allclose(e.gradient(), np.asarray(want), **TOL)


def test_gradient_upstream_of_merged_lanes_after_an_update_says_what_to_do():
    """Its own gradient needs the pass again with the parameters it ran with; a value
    downstream of every merge keeps its own all the same."""
    pc, *params = _model()
    trainer = dx.Trainer(pc, optax.sgd(0.1))
    dx.renew_cg()
    loss, embs, _ = _build(*params)
    loss.backward()
    trainer.update()
    with pytest.raises(StaleExpressionError, match=r"but parameter .* changed .*full=True"):
        embs[0].gradient()
    np.testing.assert_allclose(loss.gradient(), 1.0)  # downstream of every merge


@pytest.mark.parametrize("strategy", ("depth", "agenda"))
def test_lanes_the_loss_does_not_read_are_not_merged(strategy):
    """A repeated leaf built for a tree left out of the loss: its lane has no cotangent,
    and the batch runs lane by lane (a merge could give its sum to the left-out lane)."""
    pc, *params = _model()
    E, W, b, U, c = params
    cg = dx.renew_cg(autobatch=strategy)
    dead = _leaf(E[1], W, b)  # built first: it is the first lane of the repeated word 1
    loss, _, _ = _build(*params)
    loss.backward()
    with_dead = [b for b in _distinct_batches(cg) if cg.val_node[dead.v] in b.nodes]
    assert with_dead and cg.merged is not None
    assert not any(b in cg.merged[1] for b in with_dead)
    _, (want_params, _, _) = _reference(*params)
    for p, want in zip(params, want_params):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(want), **TOL)


@pytest.mark.parametrize("strategy", ("depth", "agenda"))
def test_an_evaluation_graph_runs_distinct_lanes_too(strategy):
    pc, *params = _model()
    dx.renew_cg(autobatch="none", train=False)
    want = [h.npvalue() for h in _build(*params)[2]]
    cg = dx.renew_cg(autobatch=strategy, train=False)
    loss, _, leaves = _build(*params)
    got = [h.npvalue() for h in leaves]
    assert _distinct_batches(cg)
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, **TOL)


@pytest.mark.parametrize("strategy", ("depth", "agenda"))
def test_random_draws_on_equal_arguments_do_not_repeat(strategy):
    """A draw's key is one of its ints (the node's id): equal arguments, distinct lanes."""
    pc, E, W, b, U, c = _model()
    cg = dx.renew_cg(autobatch=strategy, seed=5)
    hs = [dx.dropout(_leaf(E[1], W, b), 0.5) for _ in range(6)]
    got = [h.npvalue() for h in hs]
    assert not any(b.sig.op.name == "dropout" for b in _distinct_batches(cg))
    assert len({a.tobytes() for a in got}) > 1  # masks differ
    dx.renew_cg(autobatch="none", seed=5)
    want = [dx.dropout(_leaf(E[1], W, b), 0.5).npvalue() for _ in range(6)]
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, **TOL)


@pytest.mark.parametrize("strategy", ("depth", "agenda"))
def test_ints_tell_lanes_apart(strategy):
    """pick(h, i) of one state: lanes repeat where i does, and only there."""
    pc, E, W, b, U, c = _model()
    cg = dx.renew_cg(autobatch=strategy)
    h = _leaf(E[2], W, b)
    idx = [0, 3, 0, 1, 3, 0]
    picks = [dx.pick(h, i) for i in idx]
    loss = dx.esum([p * (k + 1.0) for k, p in enumerate(picks)])
    loss.backward()
    runs = [b for b in _distinct_batches(cg) if b.sig.op.name == "pick"]
    assert runs and all(b.packet[-b.B - 1] == 3 for b in runs)  # 3 distinct of 6
    hv = np.asarray(jnp.tanh(W.value @ E.value[2] + b.value))
    for i, p in zip(idx, picks):
        assert p.scalar_value() == pytest.approx(float(hv[i]), rel=1e-6)

    def ref(W):
        hv = jnp.tanh(W @ E.value[2] + b.value)
        return sum(hv[i] * (k + 1.0) for k, i in enumerate(idx))
    np.testing.assert_allclose(np.asarray(W.grad), np.asarray(jax.grad(ref)(W.value)), **TOL)


def test_the_gate_backs_off_where_nothing_repeats():
    gate = RepeatGate()
    looked = []
    for _ in range(300):
        look = gate.looks()
        looked.append(look)
        if look:
            gate.saw(False)
    gaps = np.diff(np.flatnonzero(looked)) - 1  # batches skipped after each look
    assert list(gaps[:6]) == [1, 3, 7, 15, 31, 63] and set(gaps[6:]) == {MAX_SKIP}
    gate.skip = 0
    gate.saw(True)
    assert gate.looks() and gate.looks()  # a batch with repeats: look at the next again


def test_lookups_are_looked_at_while_repeats_run_once(monkeypatch):
    """A tagger's lookups repeat in every graph and its cells hardly ever: once forward
    passes stop running batches on their distinct lanes, its lookups' gate backs off."""
    pc, E, W, b, U, c = _model()
    lookup_sig = None

    def graph(k):  # graphs of different shapes: a reused plan is replayed, looks at nothing
        nonlocal lookup_sig
        cg = dx.renew_cg()
        xs = [E[w] for ws in TREES[:k] for w in ws]
        dx.esum([dx.sum_elems(_leaf(x, W, b)) for x in xs]).value()
        lookup_sig = cg.node_sig[cg.val_node[xs[0].v]]
        return cg

    assert graph(6).stats()["repeated_lanes"] > 0  # the leaves
    assert lookup_sig.repeats.misses == 0
    monkeypatch.setattr(engine, "REPEATS_MIN_WORK", 1 << 40)  # nothing worth running once
    assert graph(5).stats()["repeated_lanes"] == 0
    assert lookup_sig.repeats.misses == 0  # the pass before ran repeats once
    graph(4)
    assert lookup_sig.repeats.misses == 1 and lookup_sig.repeats.skip == 1


@pytest.mark.parametrize("strategy", ("depth", "agenda"))
def test_a_training_loop_matches_none(strategy):
    """The user's loop: read the loss (its backward pass may run while the read waits,
    ``early.py``), backward, update; graphs of new shapes and a recurring one (from a
    fresh plan cache: its shape noted, its plan stored, then reused, its repeated lanes
    still run once). Parameters after the loop as with ``autobatch="none"``."""
    data = [TREES, TREES[:4], TREES, TREES[1:], TREES, TREES]

    def train(autobatch):
        dx.release_memory()  # a fresh plan cache (earlier tests' misses make it back off)
        pc, *params = _model()
        trainer = dx.Trainer(pc, optax.sgd(0.05))
        losses, reused = [], []
        for trees in data:
            cg = dx.renew_cg(autobatch=autobatch)
            loss = _build(*params, trees=trees)[0]
            losses.append(loss.value())
            loss.backward()
            trainer.update()
            st = cg.stats()
            reused.append((st["plans_reused"], st["repeated_lanes"] > 0))
        return losses, [np.asarray(p.value) for p in params], reused

    want_losses, want_params, _ = train("none")
    losses, got_params, reused = train(strategy)
    assert reused[-2:] == [(1, True), (1, True)]  # the last graphs reuse their plan
    # a loss sums per-tree terms of either sign of up to a few units, so one near 0.3 carries
    # their rounding: on one machine it was 5.8e-6 off, with every parameter within 1e-6 of
    # its largest value (benchmarks/RESULTS.md, session 55)
    np.testing.assert_allclose(losses, want_losses, rtol=TOL["rtol"], atol=1e-5)
    for got, want in zip(got_params, want_params):
        np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("strategy", ("depth", "agenda"))
def test_values_known_equal_in_an_earlier_forward_pass(strategy):
    """A graph computed in two forward passes (a value read in between): the second
    pass's cells repeat by the lookups of the first."""
    pc, *params = _model()
    E, W, b, U, c = params
    cg = dx.renew_cg(autobatch=strategy)
    xs = [E[w] for ws in TREES for w in ws]
    dx.esum([dx.sum_elems(x) for x in xs]).value()  # first pass: the lookups
    hs = [_leaf(x, W, b) for x in xs]
    loss = dx.esum([dx.sum_elems(h * h) for h in hs])
    loss.backward()
    assert cg.stats()["repeated_lanes"] >= 14  # 18 leaves of 4 words

    def ref(W, b):
        return sum(jnp.sum(jnp.tanh(W @ E.value[w] + b) ** 2) for ws in TREES for w in ws)
    want = jax.grad(ref, argnums=(0, 1))(W.value, b.value)
    np.testing.assert_allclose(loss.value(), ref(W.value, b.value), **TOL)
    for p, w in zip((W, b), want):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(w), **TOL)


@pytest.mark.parametrize("strategy", ("depth", "agenda"))
def test_a_reused_plan_runs_repeats_once_while_passes_find_them_then_replays(
        strategy, monkeypatch):
    """A replayed preparation runs every lane (its packets are the recorded ones), so a
    reused plan is prepared afresh, its repeated lanes run once, while the last pass ran
    some so; once a pass finds none worth it, the plan is recorded, then replayed."""
    dx.release_memory()  # a fresh plan cache
    pc, *params = _model()
    seen = []
    for k in range(7):
        if k == 4:  # from here no repeat saves enough to run once
            monkeypatch.setattr(engine, "REPEATS_MIN_WORK", 1 << 40)
        pc.zero_grad()
        cg = dx.renew_cg(autobatch=strategy)
        loss = _build(*params)[0]
        loss.backward()
        st = cg.stats()
        seen.append((st["plans_reused"], st["plans_replayed"], st["repeated_lanes"] > 0))
        want_value, (want_grads, _, _) = _reference(*params)
        np.testing.assert_allclose(loss.value(), want_value, **TOL)
        for p, want in zip(params, want_grads):
            np.testing.assert_allclose(np.asarray(p.grad), np.asarray(want), **TOL)
    # shape noted, plan stored, then reused with repeats run once; after the first pass
    # without, the plan's preparation is recorded, then replayed
    assert seen == [(0, 0, True), (0, 0, True), (1, 0, True), (1, 0, True),
                    (1, 0, False), (1, 0, False), (1, 1, False)]


def test_a_none_pass_leaves_the_repeats_record_as_it_was():
    """``none`` runs one node a batch, so nothing can repeat: its passes must not count
    as passes without repeats (that made a reference run turn off the next autobatched
    graphs' repeats, their lookups no longer looked at)."""
    pc, *params = _model()
    cg = dx.renew_cg(autobatch="none")
    cg.engine.dry_passes = 0
    _build(*params)[0].value()
    assert cg.engine.dry_passes == 0
    cg = dx.renew_cg(autobatch="agenda")
    _build(*params)[0].value()
    assert cg.stats()["repeated_lanes"] > 0 and cg.engine.dry_passes == 0
