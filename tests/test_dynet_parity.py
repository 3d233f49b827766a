"""DyNet's names that a port reaches for (session 23, from porting a BiLSTM-CRF, a VAE and
a REINFORCE policy): ``dropout_dim`` and ``block_dropout`` (seeded masks, checked against
the same masks applied in NumPy, for every strategy), the parameters' array accessors and
in-place edits, and the older names ``Model`` and ``pickrange``. The ops' values and
gradients under every strategy are ``tests/test_ops.py`` cases; their argument errors are
in ``tests/test_further_ops.py``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx

STRATEGIES = ("none", "depth", "agenda")
TOL = dict(rtol=1e-6, atol=1e-6)


def _masked_graph(strategy, drop):
    """Four (4, 5) matrices through ``drop``: (outputs, parameter, targets)."""
    pc = dx.ParameterCollection(seed=0)
    M = pc.add_parameters((4, 5), init="uniform")
    r = np.random.default_rng(1)
    dx.renew_cg(autobatch=strategy, seed=7)
    xs = [r.normal(size=(4, 5)).astype(np.float32) for _ in range(4)]
    outs = [drop(dx.input(x) + M) for x in xs]
    ws = [r.normal(size=(4, 5)).astype(np.float32) for _ in range(4)]
    loss = dx.esum([dx.sum_elems(dx.cmult(o, dx.input(w))) for o, w in zip(outs, ws)])
    return outs, xs, M, ws, loss


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("d, p", [(0, 0.5), (1, 0.4)])
def test_dropout_dim_drops_whole_slices(strategy, d, p):
    """The mask has size 1 along ``d``: with d=0 whole columns go, with d=1 whole rows; the
    kept entries are scaled by 1/(1-p) and the gradient goes through the same mask."""
    outs, xs, M, ws, loss = _masked_graph(strategy, lambda e: dx.dropout_dim(e, d, p))
    masks = []
    for o, x in zip(outs, xs):
        v, full = o.npvalue(), x + np.asarray(M.value)
        kept = np.abs(v) > 0
        assert (kept.all(axis=d) | ~kept.any(axis=d)).all()  # all or nothing per slice
        np.testing.assert_allclose(v[kept], full[kept] / (1 - p), rtol=1e-5)
        masks.append(kept)
    masks = np.array(masks)
    assert 0 < masks.sum() < masks.size
    loss.backward()
    want = sum(w * m / (1 - p) for w, m in zip(ws, masks))
    np.testing.assert_allclose(M.grad, want, rtol=1e-5, atol=1e-6)
    if strategy == "agenda":  # seeded by graph and node: every strategy draws the same
        values = [o.npvalue() for o in outs]
        none_outs = _masked_graph("none", lambda e: dx.dropout_dim(e, d, p))[0]
        for a, b in zip(values, none_outs):
            np.testing.assert_array_equal(a, b.npvalue())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_block_dropout_keeps_all_or_nothing(strategy):
    p = 0.5
    pc = dx.ParameterCollection(seed=0)
    A = pc.add_parameters(3, init="ones")
    dx.renew_cg(autobatch=strategy, seed=3)
    outs = [dx.block_dropout(A * float(k + 1), p) for k in range(16)]
    kept = []
    for k, o in enumerate(outs):
        v = o.npvalue()
        assert np.array_equal(v, np.zeros(3)) or np.allclose(v, (k + 1) / (1 - p) * np.ones(3))
        kept.append(bool(v.any()))
    assert 0 < sum(kept) < 16  # fails with probability 2 * 2**-16
    dx.esum([dx.sum_elems(o) for o in outs]).backward()
    want = sum((k + 1) / (1 - p) for k in range(16) if kept[k])
    np.testing.assert_allclose(A.grad, np.full(3, want), rtol=1e-5)


def test_the_dropout_variants_are_the_identity_without_training():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    dx.renew_cg(train=False)
    for e in (dx.dropout_dim(dx.input(x), 1, 0.5), dx.block_dropout(dx.input(x), 0.9)):
        np.testing.assert_array_equal(e.npvalue(), x)
    dx.renew_cg()
    np.testing.assert_array_equal(dx.dropout_dim(dx.input(x), 0, 0.0).npvalue(), x)


def test_parameter_arrays_and_in_place_edits():
    pc = dx.Model(seed=0)  # DyNet's older name for a ParameterCollection
    assert isinstance(pc, dx.ParameterCollection)
    W = pc.add_parameters((2, 3), name="W")
    E = pc.add_lookup_parameters((4, 3), name="E")
    b = pc.add_parameters(3, name="b")
    assert pc.parameters_list() == [W, b] and pc.lookup_parameters_list() == [E]
    np.testing.assert_array_equal(W.as_array(), np.asarray(W.value))
    before = W.as_array()
    W.scale(2.0)
    np.testing.assert_allclose(W.as_array(), 2.0 * before, **TOL)
    W.clip_inplace(-0.1, 0.1)
    np.testing.assert_allclose(W.as_array(), np.clip(2.0 * before, -0.1, 0.1), **TOL)
    with pytest.raises(dx.InvalidArgumentError, match="clip_inplace of W: left 1.0 > right"):
        W.clip_inplace(1.0, 0.0)
    with pytest.raises(dx.InvalidArgumentError, match="scale: expected a finite number"):
        W.scale(float("nan"))

    E.init_row(2, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(E.row_as_array(2), [1.0, 2.0, 3.0])
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    E.init_from_array(table)
    np.testing.assert_array_equal(E.rows_as_array([3, 0]), table[[3, 0]])
    with pytest.raises(dx.IndexOutOfRangeError, match=r"init_row of E: row 4 out of range"):
        E.init_row(4, [0.0, 0.0, 0.0])
    with pytest.raises(dx.InvalidArgumentError, match=r"init_row of E: a row has shape \(3,\)"):
        E.init_row(0, [1.0, 2.0])
    with pytest.raises(dx.IndexOutOfRangeError, match="row_as_array of E: row -1"):
        E.row_as_array(-1)
    with pytest.raises(dx.ArgumentTypeError, match="rows_as_array of E: a row must be an int"):
        E.rows_as_array([0, 1.0])

    dx.renew_cg()
    (dx.sum_elems(dx.cmult(E[1], dx.input(np.array([1.0, 2.0, 3.0], np.float32))))
     + dx.sum_elems(W @ b)).backward()
    np.testing.assert_array_equal(E.row_grad_as_array(1), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(E.row_grad_as_array(0), np.zeros(3))
    np.testing.assert_allclose(b.grad_as_array(), np.asarray(W.value).sum(axis=0), **TOL)


def test_init_rows_writes_only_its_rows_in_place():
    """init_row / init_rows (renormalising the rows an update touched, as TransE does) write
    on the device: the other rows stay, a repeated row takes its last value, an array the
    user holds stays valid, and a graph computed with the old table refuses its backward."""
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((9, 3), name="E")
    table, before = np.array(E.value), np.array(E.value)
    held = E.value  # the user's array: the next write must not donate it
    E.init_row(4, [1.0, 2.0, 3.0])
    table[4] = [1.0, 2.0, 3.0]
    np.testing.assert_array_equal(E.as_array(), table)
    np.testing.assert_array_equal(np.asarray(held), before)  # valid, and unchanged
    rows = [0, 7, 0, 2, 5]  # 4 distinct rows of 5, padded to a bucket size inside
    values = np.arange(15, dtype=np.float32).reshape(5, 3)
    E.init_rows(rows, values)
    table[[7, 0, 2, 5]] = values[1:]  # row 0 takes its second (last) value
    np.testing.assert_array_equal(E.as_array(), table)
    E.init_rows(np.array([3]), values[:1])  # a NumPy index array; one row
    table[3] = values[0]
    np.testing.assert_array_equal(E.as_array(), table)
    E.init_rows([], np.zeros((0, 3)))  # nothing to write
    np.testing.assert_array_equal(E.as_array(), table)
    F = pc.add_lookup_parameters((40, 3), name="F")  # 17 rows: padded with 3 copies
    big = np.array(F.value)
    rows17 = list(range(3, 37, 2))
    big[rows17] = np.arange(51, dtype=np.float32).reshape(17, 3)
    F.init_rows(rows17, big[rows17])
    np.testing.assert_array_equal(F.as_array(), big)

    dx.renew_cg()
    loss = dx.sum_elems(E[7])
    loss.value()
    E.init_rows([1], [[0.0, 0.0, 0.0]])
    with pytest.raises(dx.StaleExpressionError, match="parameter E changed"):
        loss.backward()

    with pytest.raises(dx.IndexOutOfRangeError, match=r"init_rows of E: row 9 out of range"):
        E.init_rows([1, 9], np.zeros((2, 3)))
    with pytest.raises(dx.InvalidArgumentError,
                       match=r"init_rows of E: expected 2 row\(s\) of shape \(3,\), got "
                             r"values of shape \(2, 2\)"):
        E.init_rows([1, 2], np.zeros((2, 2)))
    for rows in (3, np.array(3), [[1], [2]]):
        with pytest.raises(dx.ArgumentTypeError, match="init_rows of E: rows must be a list"):
            E.init_rows(rows, np.zeros((1, 3)))
    np.testing.assert_array_equal(E.as_array()[[2, 3]], table[[2, 3]])  # failures wrote nothing


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_a_parameter_is_indexed_as_its_expression(strategy):
    """W[i] and W[a:b] on a Parameter (it joins expressions by itself: W @ x, W * 2) pick
    as on W.expr(); gradients reach W's rows; a bad index adds nothing to the graph."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((4, 3), name="W")
    cg = dx.renew_cg(autobatch=strategy)
    loss = dx.sum_elems(dx.cmult(W[1], W[3])) + dx.sum_elems(W[0:2])
    V = np.asarray(W.value)
    assert loss.value() == pytest.approx(float((V[1] * V[3]).sum() + V[:2].sum()), rel=1e-5)
    loss.backward()
    want = jax.grad(lambda w: jnp.sum(w[1] * w[3]) + jnp.sum(w[:2]))(W.value)
    np.testing.assert_allclose(np.asarray(W.grad), np.asarray(want), **TOL)
    nodes = cg.stats()["nodes"]
    with pytest.raises(dx.IndexOutOfRangeError, match=r"pick: index 4 out of range \[0, 4\)"):
        W[4]
    with pytest.raises(TypeError, match="Parameter W is not iterable"):
        list(W)  # no node per row behind the user's back
    assert cg.stats()["nodes"] == nodes


def test_a_collection_zeroes_its_own_gradients():
    """pc.zero_grad() / DyNet's reset_gradient() forget the gradients of a (sub)collection's
    parameters, lookup rows included, and leave the others' alone."""
    pc = dx.ParameterCollection(seed=0)
    gen, disc = pc.add_subcollection("gen"), pc.add_subcollection("disc")
    G, D = gen.add_parameters((3, 3), name="G"), disc.add_parameters((1, 3), name="D")
    E = disc.add_lookup_parameters((4, 3), name="E")
    dx.renew_cg()
    dx.sum_elems(D @ dx.tanh(G @ E[2])).backward()
    assert all(np.abs(np.asarray(p.grad)).sum() > 0 for p in (G, D, E))
    disc.reset_gradient()
    assert np.abs(np.asarray(D.grad)).sum() == 0 and np.abs(np.asarray(E.grad)).sum() == 0
    assert E.touched == set()
    assert np.abs(np.asarray(G.grad)).sum() > 0
    pc.zero_grad()
    assert np.abs(np.asarray(G.grad)).sum() == 0


def test_parameter_expr_without_update_passes_no_gradient():
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters(3, name="W")
    dx.renew_cg()
    (dx.sum_elems(W.expr(False) * 2.0) + dx.sum_elems(W.expr())).backward()
    np.testing.assert_allclose(W.grad, np.ones(3))  # through the updated expression only
    with pytest.raises(dx.ArgumentTypeError, match="expr of W: update must be True or False"):
        W.expr(0)


def test_reductions_take_dynets_batch_flag_false():
    dx.renew_cg()
    M = dx.input(np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(dx.sum_dim(M, [1], False).npvalue(), [3.0, 12.0])
    np.testing.assert_array_equal(dx.mean_dim(M, [1], False, 0).npvalue(), [1.0, 4.0])
    np.testing.assert_allclose(dx.std_dim(M, [0], False).npvalue(), np.full(3, 1.5))
    np.testing.assert_allclose(dx.moment_dim(M, [0], 2, False).npvalue(), [4.5, 8.5, 14.5])


def test_loading_into_an_empty_collection_says_to_build_the_model_first(tmp_path):
    pc = dx.ParameterCollection(seed=0)
    dx.LSTMBuilder(1, 2, 3, pc)
    dx.save(tmp_path / "m.npz", [pc])
    with pytest.raises(ValueError, match=r"has no parameter of that name \(it has \[\]\); "
                                         r"dynax does not construct the saved objects"):
        dx.load(tmp_path / "m.npz", dx.ParameterCollection())
    assert dx.load(tmp_path / "m.npz", pc) is pc  # into the built model: fine


def test_older_names():
    assert dx.pickrange is dx.pick_range
    assert dx.Model is dx.ParameterCollection
    cg = dx.renew_cg()
    assert dx.cg() is cg  # DyNet's dy.cg()
    assert dx.TreeLSTMBuilder is dx.nn.TreeLSTMBuilder  # at the top level, as the others
    assert dx.ChildSumTreeLSTMBuilder is dx.nn.ChildSumTreeLSTMBuilder
