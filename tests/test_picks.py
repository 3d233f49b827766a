"""``pick`` (``x[i]``) reads the picked rows straight from the arena (``kernels._picks``):
values and gradients against ``jax.value_and_grad`` in every batching path (gathered and
shared arguments, lone lanes, repeated lanes, vectors and matrices), and its kernels never
hold a whole copy of ``x`` per lane."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from dynax.executor import engine, kernels
from dynax.ops.registry import live_signatures
from reference import STRATEGIES, record_kernel_texts

N = 6  # elements of a vector, rows of a matrix
RNG = np.random.default_rng(1)
CONST = RNG.standard_normal(N).astype(np.float32)
# (source, index) per pick: sources 0-2 are tanh(W @ E[s]); 3 a constant; an element picked
# twice (two lanes scatter-add into one element)
PICKS = [(0, 1), (0, 4), (1, 0), (2, 5), (0, 1), (3, 2), (1, 3)]


def _model():
    pc = dx.ParameterCollection(seed=4)
    return pc, pc.add_parameters((N, 3), name="W"), pc.add_lookup_parameters((3, 3), name="E")


def _dynax_loss(W, E, picks, rows: bool):
    """sum over picks of tanh(x_s[i]) * (k + 1), and sum(x_0) (x_0 read whole, too)."""
    def source(s):
        if s == 3:
            return dx.input(CONST)
        h = dx.tanh(W @ E[s])
        return dx.reshape(dx.concatenate([h, h * 2.0]), (N, 2)) if rows else h

    xs = {s: source(s) for s in {s for s, _ in picks}}
    terms = [dx.sum_elems(dx.tanh(dx.pick(xs[s], i))) * float(k + 1)
             for k, (s, i) in enumerate(picks)]
    return dx.esum(terms + [dx.sum_elems(xs[picks[0][0]])])


def _jax_loss(params, picks, rows: bool):
    W, E = params

    def source(s):
        if s == 3:
            return jnp.asarray(CONST)
        h = jnp.tanh(W @ E[s])
        return jnp.concatenate([h, h * 2.0]).reshape(N, 2) if rows else h

    xs = {s: source(s) for s in {s for s, _ in picks}}
    terms = [jnp.sum(jnp.tanh(xs[s][i])) * (k + 1) for k, (s, i) in enumerate(picks)]
    return sum(terms) + jnp.sum(xs[picks[0][0]])


def _check(strategy, picks, rows=False):
    pc, W, E = _model()
    dx.renew_cg(autobatch=strategy)
    loss = _dynax_loss(W, E, picks, rows)
    value = loss.value()
    loss.backward()
    want, (gW, gE) = jax.value_and_grad(_jax_loss)(
        (jnp.asarray(W.value), jnp.asarray(E.value)), picks, rows)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(W.grad, gW, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(E.grad, gE, rtol=1e-4, atol=1e-6)


@pytest.fixture
def pick_modes(monkeypatch):
    """The modes of every pick kernel launched from here on (GATHER or UNIFORM per lane)."""
    seen = []
    real = engine.forward_kernel

    def noting(sig, modes, *rest):
        if sig.op.name == "pick":
            seen.append(modes)
        return real(sig, modes, *rest)
    monkeypatch.setattr(engine, "forward_kernel", noting)
    return seen


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("rows", [False, True], ids=["elements", "rows"])
def test_picks_of_several_values_match_jax_grad(strategy, rows, pick_modes):
    _check(strategy, PICKS, rows)
    if strategy != "none":
        assert (kernels.GATHER,) in pick_modes


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_picks_of_one_large_shared_value_match_jax_grad(strategy, pick_modes):
    """Every lane picks from one value of ``UNIFORM_MIN_SIZE`` elements: it is read as one
    row for all lanes (UNIFORM)."""
    M, picks = engine.UNIFORM_MIN_SIZE, (0, 3, 3, 4095, 2, 77)
    pc = dx.ParameterCollection(seed=0)
    P = pc.add_parameters((M,), init="normal")
    dx.renew_cg(autobatch=strategy)
    x = dx.tanh(P)
    loss = dx.esum([dx.square(dx.pick(x, i)) * float(k + 1) for k, i in enumerate(picks)])
    value = loss.value()
    loss.backward()

    def f(p):
        x = jnp.tanh(p)
        return sum(jnp.square(x[i]) * (k + 1) for k, i in enumerate(picks))
    want, g = jax.value_and_grad(f)(jnp.asarray(P.value))
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(P.grad, g, rtol=1e-5, atol=1e-7)
    if strategy != "none":
        assert (kernels.UNIFORM,) in pick_modes


@pytest.mark.parametrize("rows", [False, True], ids=["elements", "rows"])
def test_a_lone_pick_matches_jax_grad(rows):
    _check("agenda", [(2, 4)], rows)


def test_repeated_picks_run_once_and_match_jax_grad(monkeypatch):
    """The same picks built twice: their lanes repeat, and run once (``repeats.py``)."""
    monkeypatch.setattr(engine, "REPEATS_MIN_WORK", 1)
    for sig in live_signatures():
        sig.repeats = None
    dx.renew_cg().engine.dry_passes = 0
    _check("agenda", PICKS * 2)


def test_a_pick_of_a_parameter_matches_jax_grad():
    """``pick(P, i)`` on a parameter itself takes the general path."""
    pc, W, _ = _model()
    dx.renew_cg()
    loss = dx.esum([dx.sum_elems(dx.tanh(dx.pick(W, i))) for i in (0, 2, 2, 5)])
    value = loss.value()
    loss.backward()

    def f(w):
        return sum(jnp.sum(jnp.tanh(w[i])) for i in (0, 2, 2, 5))
    want, g = jax.value_and_grad(f)(jnp.asarray(W.value))
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(W.grad, g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_pick_kernels_hold_no_copy_of_the_value_per_lane(strategy, monkeypatch):
    """Picks from two 4,096-element vectors: no kernel has a (lanes, 4096) array (the
    general path gathered each vector whole for each lane, and its cotangent as large)."""
    texts = record_kernel_texts(monkeypatch)
    M, picks = 4096, np.arange(0, 4096, 97)
    pc = dx.ParameterCollection(seed=0)
    Ps = [pc.add_parameters((M,), init="normal") for _ in range(2)]
    cg = dx.renew_cg(autobatch=strategy)
    xs = [dx.tanh(P) for P in Ps]
    loss = dx.esum([dx.pick(x, int(i)) for i in picks for x in xs])
    loss.backward()
    for P in Ps:
        want = np.zeros(M, np.float32)
        np.add.at(want, picks, 1 - np.tanh(P.value[picks]) ** 2)
        np.testing.assert_allclose(P.grad, want, rtol=1e-5, atol=1e-7)
    compiled = {n: t for n, t in texts()[0].items() if n.startswith("pick_")}
    assert any("_fwd_" in n for n in compiled) and any("_bwd_" in n for n in compiled)
    arena_rows = {str(a.shape[0]) for a in cg.engine.arenas.values() if a.shape[1:] == (M,)}
    for name, text in compiled.items():  # arrays of M-element rows: the arenas only
        assert set(re.findall(rf"f32\[(\d+),{M}\]", text)) == arena_rows, name
