"""Parts of a value, ``pick`` (``x[i]``, along a dimension), ``pick_range`` and
``select_rows``, read just their part of the value's arena rows (``kernels._reads_part``):
values and gradients against ``jax.value_and_grad`` in every batching path (gathered and
shared arguments, lone lanes, repeated lanes, vectors and matrices), and their kernels
never hold a whole copy of ``x`` per lane."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from dynax.executor import engine, kernels
from reference import STRATEGIES, every_repeat_runs_once, record_kernel_texts

N = 6  # elements of a vector, rows of a matrix
RNG = np.random.default_rng(1)
CONST = RNG.standard_normal((N, 2)).astype(np.float32)
# (source, index) per part: sources 0-2 are computed from W, E; 3 is a constant; one part
# taken twice (two lanes scatter-add into one place)
PICKS = [(0, 1), (0, 4), (1, 0), (2, 5), (0, 1), (3, 2), (1, 3)]
# part -> (a matrix source?, the part in dynax, in JAX)
PARTS = {
    "element": (False, lambda x, i: dx.pick(x, i), lambda x, i: x[i]),
    "row": (True, lambda x, i: dx.pick(x, i), lambda x, i: x[i]),
    "column": (True, lambda x, i: dx.pick(x, i % 2, 1), lambda x, i: x[:, i % 2]),
    "range": (False, lambda x, i: x[i:i + 2], lambda x, i: x[i:i + 2]),
    "row_range": (True, lambda x, i: dx.pick_range(x, i % 3, i % 3 + 3),
                  lambda x, i: x[i % 3:i % 3 + 3]),
    "column_range": (True, lambda x, i: dx.pick_range(x, 1, 2, 1), lambda x, i: x[:, 1:2]),
    "rows": (True, lambda x, i: dx.select_rows(x, [i, 0, i]),
             lambda x, i: x[jnp.array([i, 0, i])]),
}


def _model():
    pc = dx.ParameterCollection(seed=4)
    return pc, pc.add_parameters((N, 3), name="W"), pc.add_lookup_parameters((3, 3), name="E")


def _loss(be, W, E, picks, part):
    """sum over parts of tanh(part of x_s at i) * (k + 1), plus sum(x_0) (x_0 also read
    whole), with ``be`` dynax's or JAX's ops."""
    matrix, dx_part, jax_part = PARTS[part]
    take = dx_part if be is dx else jax_part
    const, tanh, total = ((dx.input, dx.tanh, dx.sum_elems) if be is dx else
                          (jnp.asarray, jnp.tanh, jnp.sum))

    def source(s):
        c = CONST if matrix else CONST[:, 0]
        if s == 3:
            return const(c)
        h = tanh(W @ E[s])
        if not matrix:
            return h
        if be is dx:
            return dx.reshape(dx.concatenate([h, h * 2.0]), (N, 2))
        return jnp.concatenate([h, h * 2.0]).reshape(N, 2)

    xs = {s: source(s) for s in sorted({s for s, _ in picks})}
    terms = [total(tanh(take(xs[s], i))) * float(k + 1) for k, (s, i) in enumerate(picks)]
    terms.append(total(xs[picks[0][0]]))
    return dx.esum(terms) if be is dx else sum(terms)


def _check(strategy, picks, part="element"):
    pc, W, E = _model()
    dx.renew_cg(autobatch=strategy)
    loss = _loss(dx, W, E, picks, part)
    value = loss.value()
    loss.backward()
    want, (gW, gE) = jax.value_and_grad(
        lambda p: _loss(jnp, p[0], p[1], picks, part))((jnp.asarray(W.value),
                                                        jnp.asarray(E.value)))
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(W.grad, gW, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(E.grad, gE, rtol=1e-4, atol=1e-6)


@pytest.fixture
def pick_modes(monkeypatch):
    """The modes of every part's kernel launched from here on (GATHER or UNIFORM)."""
    seen = []
    real = engine.forward_kernel

    def noting(sig, modes, *rest):
        if sig.op.part is not None:
            seen.append(modes)
        return real(sig, modes, *rest)
    monkeypatch.setattr(engine, "forward_kernel", noting)
    return seen


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("part", sorted(PARTS))
def test_parts_of_several_values_match_jax_grad(strategy, part, pick_modes):
    _check(strategy, PICKS, part)
    if strategy != "none":
        assert (kernels.GATHER,) in pick_modes


# part -> (the shape of a value of UNIFORM_MIN_SIZE elements, the part in dynax, in JAX)
SHARED_PARTS = {
    "element": ((4096,), lambda x, i: dx.pick(x, i), lambda x, i: x[i]),
    "row": ((64, 64), lambda x, i: dx.pick(x, i % 64), lambda x, i: x[i % 64]),
    "column": ((64, 64), lambda x, i: dx.pick(x, i % 64, 1), lambda x, i: x[:, i % 64]),
    "row_range": ((64, 64), lambda x, i: x[i % 60:i % 60 + 3],
                  lambda x, i: x[i % 60:i % 60 + 3]),
    "rows": ((64, 64), lambda x, i: dx.select_rows(x, [i % 64, 5]),
             lambda x, i: x[jnp.array([i % 64, 5])]),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("part", sorted(SHARED_PARTS))
def test_parts_of_one_large_shared_value_match_jax_grad(strategy, part, pick_modes):
    """Every lane takes a part of one value of ``UNIFORM_MIN_SIZE`` elements: the value is
    read as one row for all lanes (UNIFORM)."""
    assert engine.UNIFORM_MIN_SIZE == 4096
    shape, dx_part, jax_part = SHARED_PARTS[part]
    picks = (0, 3, 3, 4095, 2, 77)
    pc = dx.ParameterCollection(seed=0)
    P = pc.add_parameters(shape, init="normal")
    dx.renew_cg(autobatch=strategy)
    x = dx.tanh(P)
    loss = dx.esum([dx.sum_elems(dx.square(dx_part(x, i))) * float(k + 1)
                    for k, i in enumerate(picks)])
    value = loss.value()
    loss.backward()

    def f(p):
        x = jnp.tanh(p)
        return sum(jnp.sum(jnp.square(jax_part(x, i))) * (k + 1) for k, i in enumerate(picks))
    want, g = jax.value_and_grad(f)(jnp.asarray(P.value))
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(P.grad, g, rtol=1e-5, atol=1e-7)
    if strategy != "none":
        assert (kernels.UNIFORM,) in pick_modes


@pytest.mark.parametrize("part", sorted(PARTS))
def test_a_lone_part_matches_jax_grad(part):
    _check("agenda", [(2, 4)], part)


@pytest.mark.parametrize("part", ["element", "column", "row_range"])
def test_repeated_parts_run_once_and_match_jax_grad(part, monkeypatch):
    """The same parts built twice: their lanes repeat, and run once (``repeats.py``)."""
    every_repeat_runs_once(monkeypatch)
    _check("agenda", PICKS * 2, part)


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
