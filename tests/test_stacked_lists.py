"""List ops read their items as one block of rows (``kernels._stacked_list``).

``concatenate``, ``esum``, ``average``, ``emax`` and ``logsumexp`` over items of one shape
run their ``OpDef.stacked`` form on the items gathered as ONE block (item-major), and their
backward scatter-adds the block's cotangent at once. Values and gradients are checked
against ``jax.value_and_grad`` of the same math under every strategy, with lists of many
lengths batched together (padded lanes), items that need no gradient (constants) among
those that do, a list holding one item twice, lanes that repeat, and a list of one lane;
then the compiled kernels are checked to hold one gather, not one per item.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from reference import STRATEGIES, every_repeat_runs_once, record_kernel_texts

D = 4
LENGTHS = (2, 3, 5, 5, 7, 16, 17, 40)  # equal lengths batch; esum & co. pad to a width
RNG = np.random.default_rng(0)
CONSTS = RNG.standard_normal((max(LENGTHS), D)).astype(np.float32)
WORDS = [RNG.integers(0, 10, n) for n in LENGTHS]


# per op: (dynax op over a list, the same in JAX, what an item is: a vector, a 2x2 matrix
# of it, or the sum of its elements)
OPS = {
    "concatenate": (dx.concatenate, jnp.concatenate, "vector"),
    "concatenate_cols": (lambda xs: dx.concatenate(xs, d=1),
                         lambda xs: jnp.concatenate(xs, axis=1), "matrix"),
    "concatenate_scalars": (dx.concatenate, jnp.stack, "scalar"),
    "esum": (dx.esum, lambda xs: sum(xs[1:], xs[0]), "vector"),
    "average": (dx.average, lambda xs: sum(xs[1:], xs[0]) / len(xs), "vector"),
    "emax": (dx.emax, lambda xs: jnp.max(jnp.stack(xs), axis=0), "vector"),
    "logsumexp": (dx.logsumexp, lambda xs: jax.nn.logsumexp(jnp.stack(xs), axis=0),
                  "vector"),
}


def _items(words, h_of, const_of):
    """A list's items: tanh(W @ E[w]) (gradients wanted) and, every third, a constant
    (none); the first item twice (exact ties for emax)."""
    items = [h_of(w) if k % 3 else const_of(k) for k, w in enumerate(words)]
    return [items[0]] + items


def _dynax_loss(op, W, E, words_lists):
    form = OPS[op][2]

    def h_of(w):
        h = dx.tanh(W @ E[int(w)])
        return dx.reshape(h, (2, 2)) if form == "matrix" else \
            dx.sum_elems(h) if form == "scalar" else h

    def const_of(k):
        c = CONSTS[k]
        return dx.input(c.reshape(2, 2) if form == "matrix" else c.sum() if form == "scalar"
                        else c)

    return dx.esum([dx.sum_elems(dx.tanh(OPS[op][0](_items(words, h_of, const_of))) * 0.5)
                    for words in words_lists])


def _jax_loss(op, params, words_lists):
    W, E = params
    form = OPS[op][2]

    def shaped(x):
        return x.reshape(2, 2) if form == "matrix" else jnp.sum(x) if form == "scalar" else x

    total = 0.0
    for words in words_lists:
        items = _items(words, lambda w: shaped(jnp.tanh(W @ E[w])),
                       lambda k: shaped(jnp.asarray(CONSTS[k])))
        total = total + jnp.sum(jnp.tanh(OPS[op][1](items)) * 0.5)
    return total


def _model():
    pc = dx.ParameterCollection(seed=3)
    return pc, pc.add_parameters((D, D), name="W"), pc.add_lookup_parameters((10, D), name="E")


def _check(op, strategy, words_lists):
    pc, W, E = _model()
    dx.renew_cg(autobatch=strategy)
    loss = _dynax_loss(op, W, E, words_lists)
    value = loss.value()
    loss.backward()
    want, (gW, gE) = jax.value_and_grad(_jax_loss, argnums=1)(
        op, (jnp.asarray(W.value), jnp.asarray(E.value)), words_lists)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(W.grad, gW, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(E.grad, gE, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("op", sorted(OPS))
def test_list_ops_match_jax_grad(op, strategy):
    _check(op, strategy, WORDS)


@pytest.mark.parametrize("op", ["concatenate", "emax", "esum"])
def test_a_single_list_matches_jax_grad(op):
    """One list alone: a batch of one lane (its block is the list's rows)."""
    _check(op, "agenda", WORDS[4:5])


@pytest.mark.parametrize("op", ["concatenate", "average", "logsumexp"])
def test_repeated_lists_run_once_and_match_jax_grad(op, monkeypatch):
    """The same lists built twice: their lanes repeat, and run once (``repeats.py``)."""
    every_repeat_runs_once(monkeypatch)
    _check(op, "agenda", WORDS[:4] * 2)


@pytest.fixture
def compiled_texts(monkeypatch):
    """The kernels made from here on: name -> compiled HLO text."""
    texts = record_kernel_texts(monkeypatch)
    return lambda: texts()[0]


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_a_long_list_compiles_to_one_gather_and_one_scatter(strategy, compiled_texts):
    """A 64-item concatenate: one gather in its forward kernel and one scatter, with no
    concatenate, in its backward (item by item: 64 gathers and 65 concatenates; XLA:CPU
    compiled ~5 ms and mapped ~3 memory pages an item)."""
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((70, D))
    dx.renew_cg(autobatch=strategy)
    loss = dx.sum_elems(dx.tanh(dx.concatenate([E[i] for i in range(64)])))
    loss.value()
    loss.backward()
    np.testing.assert_allclose(E.grad[:64], 1 - np.tanh(E.value[:64]) ** 2, rtol=1e-5,
                               atol=1e-6)
    texts = {n: t for n, t in compiled_texts().items() if n.startswith("concatenate_")}
    fwd = [t for n, t in texts.items() if "_fwd_" in n]
    bwd = [t for n, t in texts.items() if "_bwd_" in n]
    assert len(fwd) == 1 and len(bwd) == 1, sorted(texts)
    assert len(re.findall(r" gather\(", fwd[0])) == 1
    assert len(re.findall(r" scatter\(", bwd[0])) == 1
    assert not re.search(r" concatenate\(", fwd[0] + bwd[0])


def test_items_of_two_shapes_are_read_one_by_one():
    """A concatenate of items of different lengths has no stacked form: it runs as
    before, item by item, and matches ``jnp.concatenate``."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 3), name="W")
    x, y = np.arange(3, dtype=np.float32), np.ones(5, np.float32)
    dx.renew_cg()
    loss = dx.sum_elems(dx.tanh(dx.concatenate([W @ dx.input(x), dx.input(y)])))
    loss.backward()
    want = jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.concatenate([w @ x, y]))))(
        jnp.asarray(W.value))
    np.testing.assert_allclose(W.grad, want, rtol=1e-5)
