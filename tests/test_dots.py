"""Weight gradients with materialised transposes (``executor/dots.py``): where the barrier goes,
and that backward passes using it equal ``autobatch="none"`` and plain ``jax.grad``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from dynax.executor import dots

from reference import STRATEGIES


def _weight_vjp(rows, lanes=16, cols=8):
    """The vjp of a vmapped ``W @ x`` (a batched kernel's shape) and its cotangent."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    W = jax.random.normal(k1, (rows, cols))
    x = jax.random.normal(k2, (lanes, cols))
    _, vjp = jax.vjp(lambda W, x: jax.vmap(lambda xi: W @ xi)(x), W, x)
    return vjp, jnp.ones((lanes, rows))


def _barriers(fn, *args) -> int:
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return sum(e.primitive is jax.lax.optimization_barrier_p for e in eqns)


@pytest.mark.parametrize("rows, placed", [(512, 1), (1024, 1), (450, 0), (8192, 0)])
def test_barrier_only_where_it_pays(rows, placed):
    """The weight gradient's transposed cotangent is materialised for 512-row multiples up
    to 4096 (LSTM gates), nowhere else; the input gradient is never touched."""
    vjp, ct = _weight_vjp(rows)
    assert _barriers(dots.materialised_transposes(vjp), ct) == placed
    assert _barriers(vjp, ct) == 0
    want = vjp(ct)
    got = jax.jit(dots.materialised_transposes(vjp))(ct)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-4)


def _ref_lstm_loss(vals, seqs, weights):
    Wx, Wh, b = vals
    total = 0.0
    for xs, ws in zip(seqs, weights):
        c = h = jnp.zeros(Wh.shape[1])
        for x, w in zip(xs, ws):
            i, f, o, g = jnp.split(Wx @ x + Wh @ h + b, 4)
            c = jax.nn.sigmoid(i) * jnp.tanh(g) + jax.nn.sigmoid(f) * c
            h = jax.nn.sigmoid(o) * jnp.tanh(c)
            total = total + jnp.dot(h, w)
    return total


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the layout is applied on CPU only")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lstm_with_512_gate_rows_matches_jax_grad(strategy, monkeypatch):
    """An LSTM of 128 units (gate matrices of 512 rows, where the barrier is placed) trains
    on exactly jax.grad's gradients under every strategy. Each strategy gets its own input
    size, so its backward kernels are traced here and the barrier is seen being placed."""
    placed = []
    pays = dots._pays
    monkeypatch.setattr(dots, "_pays", lambda v: placed.append(pays(v)) or placed[-1])
    n_in = {"none": 11, "depth": 13, "agenda": 17}[strategy]
    pc = dx.ParameterCollection(seed=1)
    lstm = dx.nn.LSTMBuilder(1, n_in, 128, pc)
    rng = np.random.default_rng(4)
    seqs = [[rng.standard_normal(n_in, np.float32) for _ in range(n)] for n in (3, 5, 4)]
    weights = [[rng.standard_normal(128, np.float32) for _ in xs] for xs in seqs]
    dx.renew_cg(autobatch=strategy)
    terms = []
    for xs, ws in zip(seqs, weights):
        hs = lstm.initial_state().transduce([dx.input(x) for x in xs])
        terms += [dx.dot_product(h, dx.input(w)) for h, w in zip(hs, ws)]
    loss = dx.esum(terms)
    loss.backward()
    vals = [p.value for p in pc.parameters()]
    want = jax.grad(_ref_lstm_loss)(vals, seqs, weights)
    np.testing.assert_allclose(loss.value(), _ref_lstm_loss(vals, seqs, weights), rtol=1e-5)
    for p, g in zip(pc.parameters(), want, strict=True):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(g), rtol=1e-4, atol=1e-4,
                                   err_msg=p.name)
    assert any(placed), "no weight gradient was given the materialised form"
