"""Plans of large graphs are computed on NumPy arrays (``strategies._agenda_arrays``,
``_by_depth_arrays``); they must equal the plain-Python plans node for node, be valid plans
(every pending node once, producers first, one signature per batch), and train to the same
values and gradients as ``autobatch="none"`` and ``jax.grad``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from dynax.batcher import strategies

TOL = dict(rtol=1e-5, atol=1e-5)


@dx.function
def _cell(x, h, W, U):
    """Two outputs, one of them unused by some consumers."""
    y = jnp.tanh(W @ x + U @ h)
    return y, y * h


class Forest:
    """Per instance: a random tree over its words (binary merges by a two-output cell),
    with a chain of tanh nodes on some leaves, a constant on others; one loss each."""

    def __init__(self):
        self.pc = pc = dx.ParameterCollection(seed=0)
        self.E = pc.add_lookup_parameters((12, 4), name="E")
        self.W = pc.add_parameters((4, 4), name="W")
        self.U = pc.add_parameters((4, 4), name="U")
        self.V = pc.add_parameters((3, 4), name="V")

    def loss(self, instances):
        losses = []
        for words, merges, label in instances:
            nodes = [self.leaf(w) for w in words]
            for i, j in merges:
                y, z = _cell(nodes[i], nodes[j], self.W, self.U)
                nodes[i] = y + z if (i + j) % 2 else y
                del nodes[j]
            losses.append(dx.pickneglogsoftmax(self.V @ nodes[0], label))
        return dx.esum(losses)

    def leaf(self, w):
        x = self.E[w]
        for _ in range(w % 3):
            x = dx.tanh(self.W @ x)
        return x + dx.input(np.full(4, 0.1 * w, np.float32)) if w % 4 == 0 else x

    def reference(self, E, W, U, V, instances):
        total = 0.0
        for words, merges, label in instances:
            nodes = []
            for w in words:
                x = E[w]
                for _ in range(w % 3):
                    x = jnp.tanh(W @ x)
                nodes.append(x + 0.1 * w if w % 4 == 0 else x)
            for i, j in merges:
                y = jnp.tanh(W @ nodes[i] + U @ nodes[j])
                nodes[i] = y + y * nodes[j] if (i + j) % 2 else y
                del nodes[j]
            total = total - jax.nn.log_softmax(V @ nodes[0])[label]
        return total


def _instances(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = [int(w) for w in rng.integers(0, 12, rng.integers(1, 9))]
        merges, k = [], len(words)
        while k > 1:  # merge a random neighbouring pair: a random binary tree
            i = int(rng.integers(0, k - 1))
            merges.append((i, i + 1))
            k -= 1
        out.append((words, merges, int(rng.integers(0, 3))))
    return out


def _check_valid(cg, lo, hi, plan):
    seen = set()
    for batch in plan:
        assert len({cg.node_sig[n].sid for n in batch}) == 1
        for n in batch:
            for v in cg.node_vals[n]:
                p = cg.val_node[v]
                assert p < lo or p in seen, f"node {n} runs before its producer {p}"
        seen.update(batch)
    assert sorted(seen) == list(range(lo, hi))


def _arrays_from(monkeypatch, n: int) -> None:
    """Schedule graphs of ``n`` pending nodes or more on arrays, by depth and by agenda."""
    monkeypatch.setattr(strategies, "ARRAYS_MIN_NODES", n)
    monkeypatch.setattr(strategies, "AGENDA_ARRAYS_MIN_NODES", n)


def _plans(cg, lo, hi, monkeypatch):
    out = {}
    for arrays in (False, True):
        _arrays_from(monkeypatch, 0 if arrays else 10**9)
        monkeypatch.setattr(strategies, "ARRAYS_MIN_BATCH", 0)
        out[arrays] = (strategies.by_agenda(cg, lo, hi), strategies.by_depth(cg, lo, hi))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_array_plans_equal_python_plans_and_are_valid(seed, monkeypatch):
    cg = dx.renew_cg()
    Forest().loss(_instances(40, seed))
    hi = len(cg.node_sig)
    assert hi > 1000
    plans = _plans(cg, 0, hi, monkeypatch)
    assert plans[True] == plans[False]
    for plan in plans[True]:
        _check_valid(cg, 0, hi, plan)
    assert len(plans[True][0]) < len(plans[True][1])  # the agenda batches across depths


def test_array_plans_of_an_incremental_forward(monkeypatch):
    cg = dx.renew_cg()
    model = Forest()
    first = model.loss(_instances(10, 3))
    first.forward()  # nodes [0, lo) are computed; the next plan covers only the new ones
    lo = cg.computed
    second = model.loss(_instances(10, 4))
    dx.esum([first, second])
    hi = len(cg.node_sig)
    plans = _plans(cg, lo, hi, monkeypatch)
    assert plans[True] == plans[False]
    for plan in plans[True]:
        _check_valid(cg, lo, hi, plan)


@pytest.mark.parametrize("strategy", ["agenda", "depth"])
def test_array_plans_train_like_none_and_jax_grad(strategy, monkeypatch):
    _arrays_from(monkeypatch, 0)
    monkeypatch.setattr(strategies, "ARRAYS_MIN_BATCH", 0)
    model = Forest()
    batch = _instances(12, 5)
    results = {}
    for s in (strategy, "none"):
        for p in model.pc.parameters():
            p.zero_grad()
        dx.renew_cg(autobatch=s)
        loss = model.loss(batch)
        value = loss.scalar_value()
        loss.backward()
        results[s] = value, {p.name: np.asarray(p.grad) for p in model.pc.parameters()}
    ref, ref_grads = jax.value_and_grad(model.reference, argnums=(0, 1, 2, 3))(
        model.E.value, model.W.value, model.U.value, model.V.value, batch)
    for value, grads in results.values():
        np.testing.assert_allclose(value, ref, **TOL)
        for name, g in zip("EWUV", ref_grads):
            np.testing.assert_allclose(grads[name], g, **TOL)


@pytest.mark.parametrize("after", [0, 1, 3, 10])
def test_arrays_hand_over_to_the_python_loop_midway(after, monkeypatch):
    """Where batches turn out small, the array agenda goes on in the Python loop from its
    current state (batches already yielded stay): the plan is the same either way."""
    cg = dx.renew_cg()
    model = Forest()
    model.loss(_instances(5, 7)).forward()  # computed nodes below lo: ids offset
    lo = cg.computed
    model.loss(_instances(40, 6))
    hi = len(cg.node_sig)
    monkeypatch.setattr(strategies, "AGENDA_ARRAYS_MIN_NODES", 10**9)
    expected = strategies.by_agenda(cg, lo, hi)  # all in Python loops
    assert len(expected) > 12 and lo > 0
    monkeypatch.setattr(strategies, "ARRAYS_MIN_BATCH", 0)
    state = strategies._agenda_arrays_setup(cg, lo, hi)
    # ``most`` = nodes // ARRAYS_MIN_BATCH batches are made on arrays, the rest in Python
    m = hi - lo
    monkeypatch.setattr(strategies, "ARRAYS_MIN_BATCH", m // after if after else m + 1)
    assert list(strategies._agenda_arrays(cg, lo, state)) == expected


def test_long_thin_graphs_stay_on_the_python_loops(monkeypatch):
    """A chain has one node per batch: on arrays that would cost ~30 us per node."""
    cg = dx.renew_cg()
    x = dx.input(np.ones(3, np.float32))
    for _ in range(strategies.AGENDA_ARRAYS_MIN_NODES + 10):
        x = dx.tanh(x)
    hi = len(cg.node_sig)
    assert strategies._agenda_arrays_setup(cg, 0, hi) is None
    plan = strategies.by_agenda(cg, 0, hi)
    assert plan == [[n] for n in range(hi)]


def test_an_empty_range_has_an_empty_plan(monkeypatch):
    """A forward with only constants pending schedules no node, on either path."""
    _arrays_from(monkeypatch, 0)
    cg = dx.renew_cg()
    dx.tanh(dx.input(np.ones(2, np.float32)))
    n = len(cg.node_sig)
    assert strategies.by_agenda(cg, n, n) == [] and strategies.by_depth(cg, n, n) == []
