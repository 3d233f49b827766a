"""The operation-batching paper's running example (Neubig et al. 2017, Fig. 1):
RNN regression over sequences of different lengths, loss = sum_i ||U h_n + c - y||^2."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from reference import STRATEGIES, assert_close, grads_of, zero_grads

D_IN, D_H, D_OUT = 3, 5, 2
LENGTHS = [2, 5, 3, 7, 4, 1]


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, D_IN)).astype(np.float32) for n in LENGTHS]
    ys = [rng.normal(size=(D_OUT,)).astype(np.float32) for _ in LENGTHS]
    return xs, ys


def build_loss(pc_params, xs, ys):
    W, b, U, c = pc_params
    losses = []
    for seq, y in zip(xs, ys):
        h = dx.zeros((D_H,))
        for x in seq:
            h = dx.tanh(W @ dx.concatenate([h, dx.input(x)]) + b)
        losses.append(dx.squared_distance(U @ h + c, dx.input(y)))
    return dx.esum(losses)


def reference_loss(values, xs, ys):
    W, b, U, c = values
    total = 0.0
    for seq, y in zip(xs, ys):
        h = jnp.zeros(D_H)
        for x in seq:
            h = jnp.tanh(W @ jnp.concatenate([h, x]) + b)
        total = total + jnp.sum((U @ h + c - y) ** 2)
    return total


@pytest.fixture(scope="module")
def model():
    pc = dx.ParameterCollection(seed=3)
    params = (pc.add_parameters((D_H, D_H + D_IN), name="W"), pc.add_parameters((D_H,), name="b"),
              pc.add_parameters((D_OUT, D_H), name="U"), pc.add_parameters((D_OUT,), name="c"))
    return pc, params


def run(strategy, pc, params, xs, ys):
    zero_grads(pc)
    cg = dx.renew_cg(autobatch=strategy)
    loss = build_loss(params, xs, ys)
    value = loss.value()
    loss.backward()
    return value, grads_of(pc), cg.stats()


def test_values_and_gradients_match_pure_jax(model):
    pc, params = model
    xs, ys = make_data()
    values = [p.value for p in params]
    ref_val = float(reference_loss(values, xs, ys))
    ref_grads = jax.grad(reference_loss)(values, xs, ys)
    for strategy in STRATEGIES:
        val, grads, _ = run(strategy, pc, params, xs, ys)
        assert_close(val, ref_val, what=strategy)
        for p, g in zip(params, ref_grads):
            assert_close(grads[p.name], g, what=f"{strategy} d/d{p.name}")


def test_agenda_batches_less_than_depth_less_than_none(model):
    pc, params = model
    xs, ys = make_data(1)
    batches = {s: run(s, pc, params, xs, ys)[2]["batches"] for s in STRATEGIES}
    assert batches["agenda"] < batches["depth"] < batches["none"], batches
    # agenda runs the losses of all lengths together: one batch per op of the loss head
    # (matmul, add, squared_distance) + the esum, on top of the per-step batches.
    steps = max(LENGTHS)
    assert batches["agenda"] <= 4 * steps + 4, batches


def test_agenda_groups_loss_nodes_of_all_lengths(model):
    pc, params = model
    xs, ys = make_data(2)
    dx.renew_cg(autobatch="agenda")
    loss = build_loss(params, xs, ys)
    loss.forward()
    cg = loss.g
    loss_batches = [b.nodes for b in cg.batches if b.sig.op.name == "squared_distance"]
    assert len(loss_batches) == 1 and len(loss_batches[0]) == len(LENGTHS)


@pytest.mark.parametrize("n", [1, 2, 17, 300])
def test_long_list_reductions_match_numpy_and_stay_small(n):
    """esum and average over long lists reduce in chunks of at most 16 arguments; emax
    takes up to 1,024 in one node (ties split as jnp.max splits them)."""
    rng = np.random.default_rng(n)
    data = rng.normal(size=(n, 3)).astype(np.float32)
    pc = dx.ParameterCollection(seed=0)
    a = pc.add_parameters((3,), name="a")
    for strategy in STRATEGIES:
        zero_grads(pc)
        cg = dx.renew_cg(autobatch=strategy)
        xs = [dx.input(d) * a for d in data]
        s, m, mx = dx.esum(xs), dx.average(xs), dx.emax(xs)
        av = np.asarray(a.value)
        assert_close(s.npvalue(), (data * av).sum(0), what=strategy)
        assert_close(m.npvalue(), (data * av).mean(0), what=strategy)
        assert_close(mx.npvalue(), (data * av).max(0), what=strategy)
        dx.sum_elems(s + m).backward()
        assert_close(a.grad, data.sum(0) * (1 + 1 / n), rtol=1e-4, what=strategy)
        sizes = [len(cg.node_vals[i]) for i in range(len(cg.node_sig))
                 if cg.node_sig[i].op.name != "emax"]
        assert max(sizes) <= 16
        emax_nodes = [i for i in range(len(cg.node_sig)) if cg.node_sig[i].op.name == "emax"]
        assert len(emax_nodes) == (n > 1)  # one node (a single item is itself)


_LIST_OPS = {  # name -> (dynax op, the same math in JAX over the stacked items)
    "esum": (dx.esum, lambda xs: jnp.sum(xs, 0)),
    "average": (dx.average, lambda xs: jnp.mean(xs, 0)),
    "logsumexp": (dx.logsumexp, lambda xs: jax.nn.logsumexp(xs, axis=0)),
}


@pytest.mark.parametrize("name", sorted(_LIST_OPS))
def test_long_list_chunks_are_all_one_width(name):
    """Past 16 items every node of a chunked list reduction takes 16 arguments: a short
    last chunk and the final node are padded like the full chunks, so each level runs as
    one batch and lists of other lengths compile no new kernel. Values and the gradient
    as the same math under jax.grad, and as the node-by-node reference."""
    op, ref = _LIST_OPS[name]
    pc = dx.ParameterCollection(seed=0)
    a = pc.add_parameters((3,), name="a")
    compiles = []
    for n in (40, 37, 20, 300):  # 300: three levels, 19 chunks, then 2 (padded to 16)
        data = np.random.default_rng(n).normal(size=(n, 3)).astype(np.float32)
        want = jax.grad(lambda av: jnp.sum(ref(data * av[None])))(a.value)
        results = {}
        for strategy in ("none", "agenda"):
            zero_grads(pc)
            cg = dx.renew_cg(autobatch=strategy)
            out = op([dx.input(d) * a for d in data])
            dx.sum_elems(out).backward()
            results[strategy] = (out.npvalue(), np.asarray(a.grad))
            assert_close(results[strategy][0], ref(data * np.asarray(a.value)[None]),
                         what=strategy)
            assert_close(results[strategy][1], want, rtol=1e-4, what=strategy)
            if strategy == "agenda":
                compiles.append(cg.stats()["compiles"])
                lists = [i for i in range(len(cg.node_sig))
                         if cg.node_sig[i].op.name in ("esum", "average", "logsumexp")]
                assert {len(cg.node_vals[i]) for i in lists} == {16}, n
                batches = [b for b in cg.batches if b.sig.op.name in ("esum", name)]
                levels = 1 + int(n > 16) + int(n > 256)
                assert len(batches) == levels, (n, [len(b.nodes) for b in batches])
        assert_close(results["agenda"][0], results["none"][0])
        assert_close(results["agenda"][1], results["none"][1])
    assert compiles[1] == compiles[2] == 0, compiles  # 37 and 20 items: 40's kernels
