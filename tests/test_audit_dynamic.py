"""Audit: models whose structure is decided while they run.

Each test builds a model whose graph depends on values read mid-build (``.value()``,
``dx.forward``), on per-instance data (lengths, trees, repeated lookups) or on several
losses of one graph, and compares values and gradients with plain JAX on the same math
(decisions replayed from the values read), under every strategy: ``none``, ``depth``,
``agenda``, and the ``immediate_compute`` / ``check_validity`` modes.

The last section holds the bugs this audit found (fixed), and one known limitation,
marked ``xfail(strict=True)``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynax as dx
from reference import (STRATEGIES, assert_close, ref_binary_tree, ref_child_sum_tree,
                       ref_gru, ref_lstm)

MODES = [dict(autobatch="none"), dict(autobatch="depth"), dict(autobatch="agenda"),
         dict(autobatch="agenda", immediate_compute=True),
         dict(autobatch="depth", check_validity=True)]
MODE_IDS = ["none", "depth", "agenda", "immediate", "validity"]


# ---- value-driven structure ------------------------------------------------------------------

X6 = np.random.RandomState(0).randn(6, 4).astype(np.float32)


class _DxOps:
    tanh, logistic = staticmethod(dx.tanh), staticmethod(dx.logistic)
    inp = staticmethod(dx.input)
    dot = staticmethod(dx.dot_product)


class _JaxOps:
    tanh, logistic = staticmethod(jnp.tanh), staticmethod(jax.nn.sigmoid)
    inp = staticmethod(jnp.asarray)
    dot = staticmethod(jnp.dot)


def _branching(W, b, v, read, ops):
    """Per instance: a loop whose length and body depend on the values read as it goes."""
    losses = []
    for x in X6:
        h = ops.tanh(W @ ops.inp(x) + b)
        for _ in range(5):
            s = read(ops.dot(v, h))
            h = ops.tanh(W @ h + b) if s > 0.0 else ops.logistic(W @ h) * 2.0
            if abs(s) < 0.05:
                break
        losses.append(ops.dot(v, h) * ops.dot(v, h))
    return losses


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_value_driven_branching_then_one_backward(mode):
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((4, 4), name="W")
    b = pc.add_parameters((4,), name="b")
    v = pc.add_parameters((4,), name="v")
    reads = []

    def record(s):
        reads.append(float(s))
        return reads[-1]

    want = sum(_branching(W.value, b.value, v.value, record, _JaxOps))

    def replay(Wv, bv, vv):
        it = iter(reads)
        return sum(_branching(Wv, bv, vv, lambda s: next(it), _JaxOps))

    grads = jax.grad(replay, argnums=(0, 1, 2))(W.value, b.value, v.value)
    dx.renew_cg(**mode)
    got_reads = []

    def read(s):
        got_reads.append(s.value())
        return got_reads[-1]

    loss = dx.esum(_branching(W, b, dx.parameter(v), read, _DxOps))
    value = loss.value()
    loss.backward()
    assert_close(got_reads, reads)
    assert_close(value, want)
    for p, g in zip((W, b, v), grads):
        assert_close(p.grad, g, what=p.name)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_backward_twice_in_one_graph_accumulates_and_update_is_optax(mode):
    """loss1.backward(); more nodes built on loss1's nodes; loss2.backward(); loss1 again:
    gradients add up (API.md: backward accumulates); the update is Optax's on the sum."""
    pc = dx.ParameterCollection(seed=1)
    W = pc.add_parameters((4, 4), name="W")
    b = pc.add_parameters((4,), name="b")
    E = pc.add_lookup_parameters((5, 4), name="E")
    Wv, bv, Ev = W.value, b.value, E.value

    def hs_of(W, b, E):
        return [jnp.tanh(W @ X6[i] + b + E[i % 2]) for i in range(3)]

    def f1(W, b, E):
        return sum(jnp.sum(h * h) for h in hs_of(W, b, E))

    def f2(W, b, E):
        hs = hs_of(W, b, E)
        h2 = [jnp.tanh(W @ h + E[3] + E[3]) for h in hs]
        return jnp.sum(h2[0] * hs[1]) + jnp.sum(jnp.tanh(W @ X6[5]))

    g1 = jax.grad(f1, argnums=(0, 1, 2))(Wv, bv, Ev)
    g2 = jax.grad(f2, argnums=(0, 1, 2))(Wv, bv, Ev)
    dx.renew_cg(**mode)
    hs = [dx.tanh(W @ dx.input(X6[i]) + b + E[i % 2]) for i in range(3)]
    l1 = dx.esum([dx.sum_elems(h * h) for h in hs])
    assert_close(l1.value(), f1(Wv, bv, Ev))
    l1.backward()
    for p, g in zip((W, b, E), g1):
        assert_close(p.grad, g, what=p.name)
    h2 = [dx.tanh(W @ h + E[3] + E[3]) for h in hs]
    l2 = dx.sum_elems(h2[0] * hs[1]) + dx.sum_elems(dx.tanh(W @ dx.input(X6[5])))
    assert_close(l2.value(), f2(Wv, bv, Ev))
    l2.backward()
    l1.backward()
    total = [2 * a + c for a, c in zip(g1, g2)]
    for p, g in zip((W, b, E), total):
        assert_close(p.grad, g, what=p.name)
    trainer = dx.Trainer(pc, optax.adam(0.1))
    tx = optax.adam(0.1)
    params = {"W": Wv, "b": bv, "E": Ev}
    updates, _ = tx.update(dict(zip("WbE", total)), tx.init(params), params)
    want = optax.apply_updates(params, updates)
    trainer.update()
    for p, k in ((W, "W"), (b, "b"), (E, "E")):
        assert_close(p.value, want[k], what=k)
        assert not np.asarray(p.grad).any()  # the update zeroes the gradients


# ---- many instances stepped in lockstep, reading their scores (a parser, a decoder) --------

V, IN, H, A = 6, 3, 4, 3
STARTS, MAXS = [0, 1, 2, 3, 4, 5, 1], [1, 5, 3, 1, 6, 2, 4]


def _lockstep(ops, read_all, h0):
    """Each instance steps until it picks action 0 or reaches its own step limit; its next
    token depends on the action read. A hypothesis the loss never uses is scored too, with
    an infinite local derivative (sqrt at 0), in the same batches as the used ones."""
    n = len(STARTS)
    states = [ops.init(i, h0) for i in range(n)]
    toks, alive, steps, losses, trace = list(STARTS), list(range(n)), [0] * n, [], []
    while alive:
        scores = {}
        for i in alive:
            states[i] = ops.add(states[i], toks[i])
            scores[i] = ops.score(states[i])
            ops.dead(states[i], toks[i])
        nxt = []
        for i, s in zip(alive, read_all([scores[i] for i in alive])):
            a = int(np.argmax(s))
            trace.append(a)
            losses.append(ops.nll(scores[i], (a + 1) % A))
            steps[i] += 1
            toks[i] = (toks[i] + a) % V
            if a != 0 and steps[i] < MAXS[i]:
                nxt.append(i)
        alive = nxt
    return losses, trace


@pytest.mark.parametrize("mode", [MODES[i] for i in (0, 2, 3)],
                         ids=[MODE_IDS[i] for i in (0, 2, 3)])
def test_instances_in_lockstep_read_with_dx_forward_then_one_backward(mode):
    pc = dx.ParameterCollection(seed=8)
    lstm = dx.nn.LSTMBuilder(1, IN, H, pc)
    E = pc.add_lookup_parameters((V, IN), name="E")
    Wo = pc.add_parameters((A, H), name="Wo")
    bo = pc.add_parameters((A,), name="bo")
    (Wx, Wh, b), = lstm.get_parameters()
    h0 = np.random.RandomState(3).randn(H).astype(np.float32) * 0.1

    class DxOps:
        init = staticmethod(lambda i, h0: lstm.initial_state(
            [dx.zeros((H,)), dx.input(h0 * (i + 1))]))
        add = staticmethod(lambda s, t: s.add_input(E[t]))
        score = staticmethod(lambda s: dx.affine_transform([bo, Wo, s.output()]))
        nll = staticmethod(dx.pickneglogsoftmax)

        @staticmethod
        def dead(s, t):
            other = s.add_input(E[(t + 1) % V])
            dx.sqrt(dx.affine_transform([bo, Wo, other.output()]) * 0.0)

    def jax_ops(P):
        class JaxOps:
            init = staticmethod(lambda i, h0: (jnp.zeros(H), jnp.asarray(h0 * (i + 1))))
            add = staticmethod(lambda s, t: ref_lstm(P["E"][t], s, P["Wx"], P["Wh"], P["b"]))
            score = staticmethod(lambda s: P["Wo"] @ s[1] + P["bo"])
            dead = staticmethod(lambda s, t: None)
            nll = staticmethod(lambda sc, a: -jax.nn.log_softmax(sc)[a])
        return JaxOps

    names = {"E": E, "Wx": Wx, "Wh": Wh, "b": b, "Wo": Wo, "bo": bo}
    P = {k: p.value for k, p in names.items()}
    _, trace = _lockstep(jax_ops(P), lambda xs: [np.asarray(x) for x in xs], h0)

    def replay(P):
        it = iter(trace)
        return sum(_lockstep(jax_ops(P), lambda xs: [np.eye(A)[next(it)] for _ in xs], h0)[0])

    want, grads = jax.value_and_grad(replay)(P)
    dx.renew_cg(**mode)

    def read_all(xs):
        dx.forward(xs)
        return [x.npvalue() for x in xs]

    losses, got_trace = _lockstep(DxOps, read_all, h0)
    loss = dx.esum(losses)
    value = loss.value()
    loss.backward()
    assert got_trace == trace
    assert_close(value, want, rtol=1e-4, atol=1e-4)
    for k, p in names.items():
        assert_close(p.grad, grads[k], rtol=1e-4, atol=1e-4, what=k)


# ---- @dx.function: mixed shapes, shared and unshared parameters, recursion -----------------

@dx.function
def _cell(x, h, W, U):
    return jnp.tanh(W @ x + U @ h)


@dx.function
def _comb(a, b):
    return jnp.concatenate([a, b])[: a.shape[0]] * jnp.sum(b)


@dx.function
def _node(left, right, W, U):  # calls another dx.function on arrays inside its body
    return _cell(left, right, W, U) + 0.5 * _cell(right, left, W, U)


TREES = [((0, 1), 2), (3, (0, (1, 2))), 1, ((0, 0), (3, 3))]


def _cells_model(P, cell, node, comb, inp, xs3, xs5):
    out = []
    h3, h5 = inp(np.zeros(3, np.float32)), inp(np.zeros(5, np.float32))
    for i in range(4):
        h3 = cell(inp(xs3[i]), h3, P["W3"], P["U3"])
        h5 = cell(inp(xs5[i]), h5, P["W5"], P["U5"])
        h3b = cell(inp(xs3[i]), h3, P["W3b"], P["U3"])  # same shapes, another weight
        out += [h3, h5, h3b, comb(h3, h5), comb(h5, h3b)]

    def enc(t):
        if isinstance(t, int):
            return inp(xs3[t])
        return node(enc(t[0]), enc(t[1]), P["W3"], P["U3"] if isinstance(t[0], int)
                    else P["W3b"])
    return out + [enc(t) for t in TREES]


@pytest.mark.parametrize("mode", [MODES[i] for i in (0, 2, 3)],
                         ids=[MODE_IDS[i] for i in (0, 2, 3)])
def test_functions_with_mixed_shapes_shared_weights_and_recursion(mode):
    rs = np.random.RandomState(0)
    xs3, xs5 = rs.randn(4, 3).astype(np.float32), rs.randn(4, 5).astype(np.float32)
    pc = dx.ParameterCollection(seed=3)
    for name, n in (("W3", 3), ("U3", 3), ("W5", 5), ("U5", 5), ("W3b", 3)):
        pc.add_parameters((n, n), name=name)

    def jloss(P):
        outs = _cells_model(P, lambda x, h, W, U: jnp.tanh(W @ x + U @ h),
                            lambda l, r, W, U: (jnp.tanh(W @ l + U @ r)
                                                + 0.5 * jnp.tanh(W @ r + U @ l)),
                            _comb.fn, jnp.asarray, xs3, xs5)
        return sum(jnp.sum(o * o) * (k % 3 + 1) for k, o in enumerate(outs))

    want, grads = jax.value_and_grad(jloss)({p.name: p.value for p in pc.parameters()})
    cg = dx.renew_cg(**mode)
    outs = _cells_model({p.name: p for p in pc.parameters()}, _cell, _node, _comb, dx.input,
                        xs3, xs5)
    loss = dx.esum([dx.sum_elems(o * o) * float(k % 3 + 1) for k, o in enumerate(outs)])
    assert_close(loss.value(), want)
    loss.backward()
    for p in pc.parameters():
        assert_close(p.grad, grads[p.name], what=p.name)
    if mode == dict(autobatch="agenda"):
        assert cg.stats()["batches"] < cg.stats()["nodes"] / 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_function_outputs_used_by_loss_and_by_decision_nodes(strategy):
    """A two-output cell; the loss uses some outputs of some calls, a node built only for a
    decision reads the others; the loss may also be one output of a call directly."""
    @dx.function
    def two(x, W):
        y = W @ x
        return jnp.sum(jnp.tanh(y)), y * y

    pc = dx.ParameterCollection(seed=10)
    W = pc.add_parameters((3, 3), name="W")
    xs = np.random.RandomState(4).randn(5, 3).astype(np.float32)

    def ref(Wv):
        outs = [(jnp.sum(jnp.tanh(Wv @ x)), (Wv @ x) ** 2) for x in xs]
        return (outs[0][0] + 2 * outs[1][0] + outs[2][0] + jnp.sum(outs[1][1])
                + jnp.sum(outs[4][1] * outs[4][1]))

    want, grad = jax.value_and_grad(ref)(W.value)
    dx.renew_cg(autobatch=strategy)
    outs = [two(dx.input(x), W) for x in xs]
    decision = dx.sum_elems(outs[3][1]) + dx.sum_elems(outs[2][1])
    decision.value()
    loss = dx.esum([outs[0][0], outs[1][0] * 2.0, outs[2][0], dx.sum_elems(outs[1][1]),
                    dx.sum_elems(dx.square(outs[4][1]))])
    assert_close(loss.value(), want)
    loss.backward()
    assert_close(W.grad, grad)
    W.zero_grad()
    outs[0][0].backward()
    assert_close(W.grad, jax.grad(lambda Wv: jnp.sum(jnp.tanh(Wv @ xs[0])))(W.value))


# ---- gradients with respect to inputs and large shared values -------------------------------

@pytest.mark.parametrize("mode", [MODES[2], MODES[4]], ids=["agenda", "validity"])
def test_input_gradients_of_a_large_shared_value_with_a_dead_lane(mode):
    """A computed 64x64 matrix read by every instance (passed once to the batch), one
    instance left out of the loss with an infinite local derivative."""
    N = 64
    rs = np.random.RandomState(0)
    A0 = (rs.randn(N, N) / 8).astype(np.float32)
    xs = rs.randn(5, N).astype(np.float32)
    pc = dx.ParameterCollection(seed=4)
    W = pc.add_parameters((N, N), name="W")

    def ref(Wv, A, xs):
        M = jnp.tanh(Wv) * A
        return sum(jnp.sum(jnp.tanh(M @ x)) for x in xs[:4]) + jnp.sum(M * M)

    want, (gW, gA, gx) = jax.value_and_grad(ref, argnums=(0, 1, 2))(W.value, A0, xs)
    M_val = jnp.tanh(W.value) * A0
    gM = jax.grad(lambda M: sum(jnp.sum(jnp.tanh(M @ x)) for x in xs[:4])
                  + jnp.sum(M * M))(M_val)
    dx.renew_cg(**mode)
    A, X = dx.input(A0), [dx.input(x) for x in xs]
    M = dx.cmult(dx.tanh(dx.parameter(W)), A)
    ys = [M @ x for x in X]
    dead = dx.sqrt(ys[4] * 0.0)
    loss = dx.esum([dx.sum_elems(dx.tanh(y)) for y in ys[:4]]) + dx.sum_elems(dx.cmult(M, M))
    assert np.all(dead.npvalue() == 0.0)
    tol = dict(rtol=1e-4, atol=1e-4)
    assert_close(loss.value(), want, **tol)
    loss.backward(full=True)
    assert_close(W.grad, gW, **tol)
    assert_close(A.gradient(), gA, **tol)
    assert_close(M.gradient(), gM, **tol)
    for x, g in zip(X, gx):
        assert_close(x.gradient(), g, **tol)  # the dead instance's input: zero


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_value_twice_in_one_node_and_large_values_shared_by_lanes(strategy):
    N = 64
    cs = np.random.RandomState(8).randn(5, N, N).astype(np.float32)
    pc = dx.ParameterCollection(seed=19)
    W = pc.add_parameters((N, N), name="W")

    @dx.function
    def f(a, b, c):
        return jnp.tanh(a) * b + c

    def ref(M):
        return (sum(jnp.sum(M * M * cs[k]) for k in range(3))
                + sum(jnp.sum((jnp.tanh(M) * M + M) * cs[k]) for k in range(3, 5)))

    M_val = jnp.tanh(W.value)
    want, gW = jax.value_and_grad(lambda Wv: ref(jnp.tanh(Wv)))(W.value)
    gM = jax.grad(ref)(M_val)
    dx.renew_cg(autobatch=strategy)
    M = dx.tanh(dx.parameter(W))
    terms = [dx.sum_elems(dx.cmult(dx.cmult(M, M), dx.input(cs[k]))) for k in range(3)]
    terms += [dx.sum_elems(dx.cmult(f(M, M, M), dx.input(cs[k]))) for k in range(3, 5)]
    loss = dx.esum(terms)
    tol = dict(rtol=1e-4, atol=1e-4)
    assert_close(loss.value(), want, **tol)
    loss.backward(full=True)
    assert_close(W.grad, gW, **tol)
    assert_close(M.gradient(), gM, **tol)


# ---- parameters in several places, repeated lookups, sparse updates --------------------------

PARAM_CASES = {
    "esum": (lambda w, v, W, x: dx.esum([w, w, x, w]), lambda w, v, W, x: w + w + x + w),
    "emax": (lambda w, v, W, x: dx.emax([w, w, v]),
             lambda w, v, W, x: jnp.max(jnp.stack([w, w, v]), 0)),
    "average": (lambda w, v, W, x: dx.average([w, v, w]), lambda w, v, W, x: (w + v + w) / 3),
    "concatenate": (lambda w, v, W, x: dx.concatenate([w, x, w, v]),
                    lambda w, v, W, x: jnp.concatenate([w, x, w, v])),
    "cmult": (lambda w, v, W, x: dx.cmult(w, w) + w * w + w / v - w,
              lambda w, v, W, x: w * w + w * w + w / v - w),
    "matmul": (lambda w, v, W, x: (W @ W) @ x + dx.transpose(W) @ w,
               lambda w, v, W, x: (W @ W) @ x + W.T @ w),
    "affine": (lambda w, v, W, x: dx.affine_transform([w, W, w, W, x, W, v]),
               lambda w, v, W, x: w + W @ w + W @ x + W @ v),
}


@pytest.mark.parametrize("strategy", ["none", "agenda"])
@pytest.mark.parametrize("case", list(PARAM_CASES))
def test_a_parameter_in_several_arguments_of_one_node(strategy, case):
    fd, fj = PARAM_CASES[case]
    rs = np.random.RandomState(1)
    pc = dx.ParameterCollection(seed=6)
    w = pc.add_parameters((3,), name="w")
    v = pc.add_parameters((3,), name="v")
    W = pc.add_parameters((3, 3), name="W")
    x0 = rs.randn(3).astype(np.float32)
    c = rs.randn(*np.shape(fj(w.value, v.value, W.value, x0))).astype(np.float32)
    want, grads = jax.value_and_grad(lambda P: jnp.sum(fj(P["w"], P["v"], P["W"], x0) * c))(
        {"w": w.value, "v": v.value, "W": W.value})
    dx.renew_cg(autobatch=strategy)
    loss = dx.sum_elems(dx.cmult(fd(w, v, W, dx.input(x0)), dx.input(c)))
    assert_close(loss.value(), want)
    loss.backward()
    for p in (w, v, W):
        assert_close(p.grad, grads[p.name], what=p.name)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "momentum"])
def test_repeated_lookups_over_two_graphs_per_update_match_optax(strategy, optimizer):
    """Row 3 read four times in one batch, row 1 in both graphs; the gradient of two graphs
    accumulates before each update (sparse for SGD, dense for the others)."""
    idx1, idx2 = [3, 3, 3, 1, 3, 0], [1, 1, 7]
    pc = dx.ParameterCollection(seed=2)
    E = pc.add_lookup_parameters((8, 3), name="E")
    w = pc.add_parameters((3,), name="w")
    if optimizer == "sgd":
        trainer, tx = dx.SimpleSGDTrainer(pc, learning_rate=0.1), optax.sgd(0.1)
    elif optimizer == "adam":
        trainer, tx = dx.Trainer(pc, optax.adam(0.1)), optax.adam(0.1)
    else:
        trainer, tx = (dx.Trainer(pc, optax.sgd(0.1, momentum=0.9)),
                       optax.sgd(0.1, momentum=0.9))
    params = {"E": E.value, "w": w.value}
    state = tx.init(params)

    def jloss(P, idx):
        return sum(jnp.tanh(jnp.dot(P["w"], P["E"][i])) * (k + 1) for k, i in enumerate(idx))

    tol = dict(rtol=1e-4, atol=1e-5)
    for _ in range(2):
        total = None
        for idx in (idx1, idx2):
            dx.renew_cg(autobatch=strategy)
            wp = dx.parameter(w)
            loss = dx.esum([dx.tanh(dx.dot_product(wp, E[i])) * float(k + 1)
                            for k, i in enumerate(idx)])
            loss.backward()
            g = jax.grad(jloss)(params, idx)
            total = g if total is None else jax.tree_util.tree_map(jnp.add, total, g)
        assert_close(E.grad, total["E"], **tol)
        assert_close(w.grad, total["w"], **tol)
        trainer.update()
        updates, state = tx.update(total, state, params)
        params = optax.apply_updates(params, updates)
        assert_close(E.value, params["E"], **tol)
        assert_close(w.value, params["w"], **tol)


@pytest.mark.parametrize("strategy", ["agenda"])
def test_parameters_unused_in_some_graphs_move_as_optax_moves_them(strategy):
    """Dense Adam and momentum move a parameter the graph did not use (zero gradient), as
    Optax does; a graph that uses no parameter leaves everything as it was (API.md)."""
    x0 = np.array([0.3, -0.2, 0.9], np.float32)
    pc = dx.ParameterCollection(seed=20)
    W = pc.add_parameters((3, 3), name="W")
    E = pc.add_lookup_parameters((4, 3), name="E")
    u = pc.add_parameters((3,), name="u")
    tx = optax.adam(optax.linear_schedule(0.1, 0.0, 10))
    trainer = dx.Trainer(pc, tx)
    P = {"W": W.value, "E": E.value, "u": u.value}
    state = tx.init(P)
    terms_dx = {"W": lambda: dx.sum_elems(dx.tanh(W @ dx.input(x0))),
                "E": lambda: dx.sum_elems(E[1] * E[2]),
                "u": lambda: dx.sum_elems(dx.parameter(u) * dx.parameter(u))}
    terms_jax = {"W": lambda P: jnp.sum(jnp.tanh(P["W"] @ x0)),
                 "E": lambda P: jnp.sum(P["E"][1] * P["E"][2]),
                 "u": lambda P: jnp.sum(P["u"] * P["u"])}
    for used in (("W", "E", "u"), ("E",), (), ("W",)):
        dx.renew_cg(autobatch=strategy)
        if used:
            dx.esum([terms_dx[k]() for k in used]).backward()
            g = jax.grad(lambda P: sum(terms_jax[k](P) for k in used))(P)
            updates, state = tx.update(g, state, P)
            P = optax.apply_updates(P, updates)
        trainer.update()
        for k, p in (("W", W), ("E", E), ("u", u)):
            assert_close(p.value, P[k], what=f"{used}: {k}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_update_mid_graph_then_new_nodes_and_a_stale_loss(strategy):
    x0 = np.array([0.3, -0.7, 1.1], np.float32)
    pc = dx.ParameterCollection(seed=12)
    W = pc.add_parameters((3, 3), name="W")
    E = pc.add_lookup_parameters((4, 3), name="E")
    trainer = dx.SimpleSGDTrainer(pc, 0.1)
    dx.renew_cg(autobatch=strategy)
    h = dx.tanh(W @ dx.input(x0) + E[1])
    l1 = dx.sum_elems(h * h)
    l1.backward()
    W1, E1 = W.value, E.value
    trainer.update()
    h2 = dx.tanh(W @ dx.input(x0) + E[1] + E[1])  # same graph, the updated parameters
    l2 = dx.sum_elems(h2)
    want, (gW, gE) = jax.value_and_grad(
        lambda W_, E_: jnp.sum(jnp.tanh(W_ @ x0 + E_[1] + E_[1])), argnums=(0, 1))(
        W.value, E.value)
    assert_close(l2.value(), want)
    l2.backward()
    assert_close(W.grad, gW)
    assert_close(E.grad, gE)
    with pytest.raises(dx.StaleExpressionError):  # its old nodes ran with the old values
        (l1 + l2).backward()
    assert_close(h.npvalue(), np.tanh(np.asarray(W1) @ x0 + np.asarray(E1)[1]))


# ---- builders over ragged batches ------------------------------------------------------------

def _run_layer(kind, params, xs, hdim):
    Wx, Wh, b = params
    c = h = jnp.zeros(hdim)
    out = []
    for x in xs:
        if kind == "lstm":
            c, h = ref_lstm(x, (c, h), Wx, Wh, b)
        else:
            h, = ref_gru(x, (h,), Wx, Wh, b)
        out.append(h)
    return out


@pytest.mark.parametrize("strategy,kind,bi", [
    ("agenda", "lstm", True), ("none", "gru", False)])
def test_builders_over_sequences_of_length_one_and_of_very_different_lengths(strategy, kind,
                                                                            bi):
    rs = np.random.RandomState(2)
    lens = [1, 7, 2, 1, 4]
    seqs = [rs.randn(n, IN).astype(np.float32) for n in lens]
    weights = [rs.randn(n, H).astype(np.float32) for n in lens]
    pc = dx.ParameterCollection(seed=7)
    cls = dx.nn.LSTMBuilder if kind == "lstm" else dx.nn.GRUBuilder
    if bi:
        builder = dx.nn.BiRNNBuilder(2, IN, H, pc, cls)
        layers = [[d.get_parameters()[0] for d in pair] for pair in builder.builder_layers]

        def outputs(P, xs):
            for fwd, bwd in layers:
                f = _run_layer(kind, [P[p.name] for p in fwd], xs, H // 2)
                b = _run_layer(kind, [P[p.name] for p in bwd], xs[::-1], H // 2)[::-1]
                xs = [jnp.concatenate([u, w]) for u, w in zip(f, b)]
            return xs
    else:
        builder = cls(2, IN, H, pc)
        layers = builder.get_parameters()

        def outputs(P, xs):
            for layer in layers:
                xs = _run_layer(kind, [P[p.name] for p in layer], xs, H)
            return xs

    def ref(P):
        return sum(jnp.sum(jnp.stack(outputs(P, list(jnp.asarray(s)))) * w)
                   for s, w in zip(seqs, weights))

    want, grads = jax.value_and_grad(ref)({p.name: p.value for p in pc.parameters()})
    dx.renew_cg(autobatch=strategy)
    terms = []
    for s, w in zip(seqs, weights):
        xs = [dx.input(x) for x in s]
        hs = builder.transduce(xs) if bi else builder.initial_state().transduce(xs)
        terms += [dx.dot_product(h, dx.input(r)) for h, r in zip(hs, w)]
    loss = dx.esum(terms)
    tol = dict(rtol=1e-4, atol=1e-4)
    assert_close(loss.value(), want, **tol)
    loss.backward()
    for p in pc.parameters():
        assert_close(p.grad, grads[p.name], **tol, what=p.name)


X10 = np.random.RandomState(6).randn(10, IN).astype(np.float32)
BINARY_TREES = [3, (0, 1), ((0, 1), (2, (3, (4, (5, (6, 7)))))), (9, (8, 8))]
CHILD_TREES = [(0, []), (1, [(2, []), (3, []), (4, [(5, [])]), (6, []), (7, [])]),
               (None, [(8, [(9, [])])])]


def _jax_binary(P, t):  # the builder's parameters by short name, in its order
    return ref_binary_tree([P[k] for k in ("W", "b_leaf", "U_l", "U_r", "b")], t, X10)


def _jax_child_sum(P, t):  # an input index of None is a node without input: zeros
    xs = {None: jnp.zeros(IN), **dict(enumerate(X10))}
    return ref_child_sum_tree([P[k] for k in ("W", "U", "b", "W_f", "U_f", "b_f")], t, xs)


@pytest.mark.parametrize("strategy", ["agenda"])
def test_tree_builders_over_trees_of_very_different_shapes(strategy):
    pc = dx.ParameterCollection(seed=17)
    tb = dx.nn.TreeLSTMBuilder(IN, H, pc)
    cb = dx.nn.ChildSumTreeLSTMBuilder(IN, H, pc)
    wts = np.random.RandomState(7).randn(len(BINARY_TREES) + len(CHILD_TREES),
                                         H).astype(np.float32)

    def short(p):
        return p.name.split("/")[-1]

    def ref(Pt, Pc):
        outs = ([_jax_binary(Pt, t)[0] for t in BINARY_TREES]
                + [sum(_jax_child_sum(Pc, t)) for t in CHILD_TREES])
        return sum(jnp.dot(o, w) for o, w in zip(outs, wts))

    tparams = tb.param_collection().parameters()
    cparams = cb.param_collection().parameters()
    want, (gt, gc) = jax.value_and_grad(ref, argnums=(0, 1))(
        {short(p): p.value for p in tparams}, {short(p): p.value for p in cparams})

    def binary(t):
        if isinstance(t, int):
            return tb.leaf(dx.input(X10[t]))
        return tb.compose(binary(t[0]), binary(t[1]))

    def child_sum(t):
        xi, children = t
        return cb.node(None if xi is None else dx.input(X10[xi]),
                       [child_sum(k) for k in children])

    dx.renew_cg(autobatch=strategy)
    outs = [binary(t)[0] for t in BINARY_TREES]
    outs += [(lambda hc: hc[0] + hc[1])(child_sum(t)) for t in CHILD_TREES]
    loss = dx.esum([dx.dot_product(o, dx.input(w)) for o, w in zip(outs, wts)])
    tol = dict(rtol=1e-4, atol=1e-4)
    assert_close(loss.value(), want, **tol)
    loss.backward()
    for p in tparams:
        assert_close(p.grad, gt[short(p)], **tol, what=p.name)
    for p in cparams:
        assert_close(p.grad, gc[short(p)], **tol, what=p.name)


# ---- list operations: empty lists, extreme fan-in -------------------------------------------

@pytest.mark.parametrize("name", ["esum", "average", "emax", "concatenate",
                                  "concatenate_cols", "logsumexp", "affine_transform"])
def test_empty_lists_are_a_clear_error_that_adds_nothing(name):
    cg = dx.renew_cg()
    x = dx.tanh(dx.input(np.ones(3, np.float32)))
    before = (len(cg.node_sig), len(cg.val_node))
    with pytest.raises(ValueError, match=name):
        getattr(dx, name)([])
    assert (len(cg.node_sig), len(cg.val_node)) == before
    assert_close(x.npvalue(), np.tanh(np.ones(3)))


@pytest.mark.parametrize("strategy,K", [("agenda", 2000)])
def test_extreme_fan_in(strategy, K):
    rs = np.random.RandomState(0)
    pc = dx.ParameterCollection(seed=5)
    w = pc.add_parameters((4,), name="w")
    E = pc.add_lookup_parameters((50, 4), name="E")
    idx, scal = rs.randint(0, 50, size=K), rs.randn(K).astype(np.float32)
    half = min(K // 2, 40)  # emax and concatenate: wide nodes compile slowly

    def ref(P):  # the same sums, vectorised (an unrolled jit of K terms is huge)
        rows = P["E"][idx]
        terms = jnp.tanh(rows @ P["w"]) * scal
        return (jnp.sum(terms) + jnp.sum(jnp.max(rows[:half] * P["w"][None, :], 0))
                + jnp.mean(terms) + 0.001 * jnp.sum(rows[:half] ** 2)
                + K * jnp.tanh(P["w"][0]))

    want, grads = jax.value_and_grad(ref)({"w": w.value, "E": E.value})
    dx.renew_cg(autobatch=strategy)
    wp = dx.parameter(w)
    terms = [dx.tanh(dx.dot_product(wp, E[int(i)])) * float(s) for i, s in zip(idx, scal)]
    same = dx.tanh(dx.pick(wp, 0))
    loss = (dx.esum(terms) + dx.sum_elems(dx.emax([dx.cmult(E[int(i)], wp)
                                                  for i in idx[:half]]))
            + dx.average(terms)
            + dx.sum_elems(dx.square(dx.concatenate([E[int(i)] for i in idx[:half]]))) * 0.001
            + dx.esum([same] * K))  # one node read K times
    tol = dict(rtol=1e-4, atol=1e-4)
    assert_close(loss.value(), want, **tol)
    loss.backward()
    assert_close(w.grad, grads["w"], **tol)
    assert_close(E.grad, grads["E"], **tol)


# ---- bugs found by this audit (fixed), and a limitation -------------------------------------

@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_static_int_and_float_arguments_are_different_signatures(strategy):
    """Statics that Python finds equal (3, 3.0, True; (3,), (3.0,)) are different
    signatures and kernels, as jax.jit's static arguments are (they were keyed by value
    only, so f(x, 3) reused f(x, 3.0)'s kernel); NumPy's scalars count as Python's."""
    @dx.function
    def half(x, c):
        return x + (c // 2 if isinstance(c, int) else c / 2)

    jitted = jax.jit(half.fn, static_argnums=1)
    x0 = np.zeros(3, np.float32)
    cg = dx.renew_cg(autobatch=strategy)
    x = dx.input(x0)
    a, b, c, d = half(x, 3.0), half(x, 3), half(x, True), half(x, np.float32(3.0))
    dx.forward([a, b, c, d])
    assert_close(a.npvalue(), jitted(x0, 3.0))  # 1.5
    assert_close(b.npvalue(), jitted(x0, 3))  # 1.0 in JAX
    assert_close(c.npvalue(), jitted(x0, True))  # 0.0
    assert_close(d.npvalue(), jitted(x0, 3.0))
    if strategy == "agenda":  # NumPy's float counts as Python's: one batch (a static_type)
        assert sorted(len(bt.nodes) for bt in cg.batches if bt.sig.op is half.op) == [1, 1, 2]

    @dx.function
    def first(x, cs):
        return x + (1.0 if isinstance(cs[0], int) else 2.0)

    d, e = first(x, (3,)), first(x, (3.0,))
    dx.forward([d, e])
    assert_close(d.npvalue(), x0 + 1.0)
    assert_close(e.npvalue(), x0 + 2.0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_failed_list_op_whose_generator_read_values_leaves_the_graph_usable(strategy):
    """A failed composite construction (``ops.core.atomic``) whose generator read a value
    keeps what that read computed: rollback used to remove those nodes but not their
    rows and batches, so nodes built afterwards read zeros."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 3), name="W")
    x0 = np.array([0.5, -1.0, 2.0], np.float32)
    dx.renew_cg(autobatch=strategy)

    def loss_of(label):
        scores = W @ dx.input(x0)
        scores.value()  # a decision read while the list is being built
        return dx.pickneglogsoftmax(scores, label)

    with pytest.raises(dx.IndexOutOfRangeError):  # label 7 of 3 scores
        dx.esum(loss_of(label) for label in [0, 7])
    y = dx.tanh(W @ dx.input(x0))  # API.md: nothing in the graph changed by a failed call
    assert_close(y.npvalue(), np.tanh(np.asarray(W.value) @ x0))


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_a_failed_transduce_whose_generator_read_a_value_leaves_the_graph_usable(strategy):
    """The same through a builder: the generator reads a value, then yields an input of the
    wrong size. The constants built after the read (the bad input) go with the failed
    call; one left pending broke the next forward pass (IndexError)."""
    pc = dx.ParameterCollection(seed=0)
    lstm = dx.nn.LSTMBuilder(1, 3, 4, pc)
    dx.renew_cg(autobatch=strategy)

    def inputs():
        x = dx.input(np.ones(3, np.float32))
        x.value()
        yield x
        yield dx.input(np.ones(5, np.float32))

    with pytest.raises(dx.ShapeError):
        lstm.initial_state().transduce(inputs())
    y = dx.tanh(dx.input(np.full(3, 0.5, np.float32)))
    assert_close(y.npvalue(), np.tanh(np.full(3, 0.5, np.float32)))


_ZERO_COTANGENT_LIMIT = (
    "known limitation (dynax/README.md, 'Backward runs the loss's ancestors only'): an "
    "unused output of a live multi-output node gets a dense zero cotangent in its node's "
    "vjp; where that output's local derivative is infinite (log of an underflowed softmax) "
    "0 * inf = NaN reaches the parameters, while jax.grad (a symbolic zero) is finite")
# the README's own example of a decision: log(softmax) of scores that underflows
W_UNDERFLOW = np.diag([60.0, -60.0, 1.0]).astype(np.float32)
H_UNDERFLOW = np.array([1.0, -2.0, 3.0], np.float32)


@pytest.mark.xfail(strict=True, reason=_ZERO_COTANGENT_LIMIT)
@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_an_unused_output_with_infinite_derivative_gives_finite_gradients(strategy):
    @dx.function
    def step(h, W):  # a decoder step: the next state and the next token's log-probabilities
        h2 = jnp.tanh(W @ h)
        return h2, jnp.log(jax.nn.softmax(W @ h2))

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 3), name="W", init=W_UNDERFLOW)
    want = jax.grad(lambda Wv: jnp.sum(step.fn(jnp.asarray(H_UNDERFLOW), Wv)[0]))(W.value)
    assert np.isfinite(want).all()
    dx.renew_cg(autobatch=strategy)
    h2, logp = step(dx.input(H_UNDERFLOW), W)
    assert np.isneginf(logp.npvalue()).any()  # read for a decision; the softmax underflowed
    dx.sum_elems(h2).backward()
    assert_close(W.grad, want)


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_a_value_read_through_nobackprop_gives_finite_gradients(strategy):
    """What only ``nobackprop`` reads is not differentiated (``_loss_ancestors``): its
    zero cotangent used to meet log's infinite derivative and give NaN."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 3), name="W", init=W_UNDERFLOW)

    def ref(Wv):
        s = Wv @ H_UNDERFLOW
        logp = jnp.log(jax.nn.softmax(s))
        return jnp.sum(jnp.tanh(s)) + jnp.sum(jax.lax.stop_gradient(logp))

    want = jax.grad(ref)(W.value)
    assert np.isfinite(want).all()
    dx.renew_cg(autobatch=strategy)
    s = W @ dx.input(H_UNDERFLOW)
    logp = dx.log(dx.softmax(s))
    assert np.isneginf(logp.npvalue()).any()
    loss = dx.sum_elems(dx.tanh(s)) + dx.sum_elems(dx.nobackprop(logp))
    loss.backward()
    assert_close(W.grad, want)


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_a_lookup_without_update_does_not_move_its_row_in_sparse_mode(strategy):
    """``lookup(E, i, update=False)`` and ``const_lookup`` do not mark row ``i`` as used,
    so a lazy (sparse) Adam update leaves it where it is, as DyNet does."""
    pc = dx.ParameterCollection(seed=11)
    E = pc.add_lookup_parameters((6, 3), name="E")
    w = pc.add_parameters((3,), name="w")
    trainer = dx.Trainer(pc, optax.adam(0.1), sparse_updates=True)
    dx.renew_cg(autobatch=strategy)
    dx.dot_product(dx.parameter(w), E[5] + E[2]).backward()  # row 5 gets Adam moments
    trainer.update()
    before = np.asarray(E.value).copy()
    dx.renew_cg(autobatch=strategy)
    loss = dx.dot_product(dx.parameter(w), dx.lookup(E, 5, update=False) + E[2]
                          + dx.const_lookup(E, 4))
    loss.backward()
    assert not np.asarray(E.grad)[[4, 5]].any()
    trainer.update()
    moved = np.abs(np.asarray(E.value) - before).sum(axis=1)
    assert moved[2] > 0
    assert moved[5] == 0 and moved[4] == 0
