"""Trainers over Optax: dense updates equal Optax's; sparse lookup updates are exact for SGD
and Adagrad and touch only the rows used; lazy Adam does what it documents."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynax as dx


def build(seed=0):
    pc = dx.ParameterCollection(seed=seed)
    E = pc.add_lookup_parameters((10, 4), name="E")
    W = pc.add_parameters((3, 4), name="W")
    return pc, E, W


def loss_of(E, W, rows, label=1):
    return dx.esum([dx.pickneglogsoftmax(W @ dx.tanh(E[r]), label) for r in rows])


def ref_loss(e, w, rows, label=1):
    return sum(-jax.nn.log_softmax(w @ jnp.tanh(e[r]))[label] for r in rows)


def step(trainer, E, W, rows):
    dx.renew_cg()
    loss_of(E, W, rows).backward()
    trainer.update()


@pytest.mark.parametrize("make_tx", [lambda: optax.sgd(0.5), lambda: optax.adagrad(0.3),
                                     lambda: optax.adam(0.1)])
def test_dense_mode_equals_optax(make_tx):
    pc, E, W = build()
    tx = make_tx()
    assert_follows_optax(dx.Trainer(pc, tx, sparse_updates=False), tx, E, W,
                         ([1, 2, 2], [3], [1, 7]))


def assert_follows_optax(trainer, tx, E, W, batches):
    """The trainer's updates over ``batches`` equal ``tx`` applied to jax.grad's gradients."""
    params = {"E": E.value, "W": W.value}
    state = tx.init(params)
    for rows in batches:
        step(trainer, E, W, rows)
        g = jax.grad(lambda p: ref_loss(p["E"], p["W"], rows))(params)
        upd, state = tx.update(g, state, params)
        params = optax.apply_updates(params, upd)
        np.testing.assert_allclose(E.value, params["E"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(W.value, params["W"], rtol=1e-5, atol=1e-6)


def test_dense_mode_keeps_a_tables_gradient_buffer_and_zeroes_its_used_rows():
    """In dense mode a table read by rows keeps its gradient buffer across updates and only
    the rows it used are zeroed (no fresh zero table per update); each update still takes
    that update's gradient alone, also around an update that read the table as a whole."""
    pc, E, W = build()
    tx = optax.adam(0.1)
    trainer = dx.Trainer(pc, tx)
    params = {"E": E.value, "W": W.value}
    state = tx.init(params)
    v = np.array([1.0, -0.5, 0.25, 2.0], np.float32)
    for rows, whole in (([1, 2, 2], False), ([3], False), ([1, 7], True), ([2, 9], False)):
        dx.renew_cg()
        loss = loss_of(E, W, rows)
        if whole:
            loss = loss + dx.sum_elems(dx.tanh(dx.parameter(E) @ dx.input(v)))
        loss.backward()
        trainer.update()
        assert not np.asarray(E.grad).any() and E.touched == set()
        assert (E._grad is not None) == (not whole)  # kept unless used as a whole

        def ref(p, rows=rows, whole=whole):
            out = ref_loss(p["E"], p["W"], rows)
            return out + jnp.sum(jnp.tanh(p["E"] @ v)) if whole else out

        upd, state = tx.update(jax.grad(ref)(params), state, params)
        params = optax.apply_updates(params, upd)
        np.testing.assert_allclose(E.value, params["E"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(W.value, params["W"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls,kw", [(dx.SimpleSGDTrainer, dict(learning_rate=0.5)),
                                    (dx.AdagradTrainer, dict(learning_rate=0.3))])
def test_sparse_equals_dense_for_sgd_and_adagrad(cls, kw):
    pc_s, E_s, W_s = build()
    pc_d, E_d, W_d = build()
    sparse, dense = cls(pc_s, **kw), cls(pc_d, sparse_updates=False, **kw)
    untouched = [0, 4, 5, 6, 8, 9]
    E0 = np.array(E_s.value)
    for rows in ([1, 2, 2], [3], [1, 7], [2]):
        step(sparse, E_s, W_s, rows)
        step(dense, E_d, W_d, rows)
        np.testing.assert_allclose(E_s.value, E_d.value, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(W_s.value, W_d.value, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(E_s.value)[untouched], E0[untouched])


def test_lazy_adam_moves_only_touched_rows_and_matches_adam_on_them():
    pc, E, W = build()
    trainer = dx.AdamTrainer(pc, alpha=0.1, sparse_updates=True)
    E0 = np.array(E.value)
    step(trainer, E, W, [1, 2])
    E1 = np.array(E.value)
    assert not np.allclose(E1[[1, 2]], E0[[1, 2]])
    np.testing.assert_array_equal(E1[[0, 3, 4]], E0[[0, 3, 4]])
    # first step on touched rows equals dense Adam's first step (moments start at zero)
    pc2, E2, W2 = build()
    dense = dx.AdamTrainer(pc2, alpha=0.1, sparse_updates=False)
    step(dense, E2, W2, [1, 2])
    np.testing.assert_allclose(E1[[1, 2]], np.asarray(E2.value)[[1, 2]], rtol=1e-6)
    # a later step on row 3 only leaves rows 1, 2 where they are (dense Adam would move them)
    step(trainer, E, W, [3])
    np.testing.assert_array_equal(np.asarray(E.value)[[1, 2]], E1[[1, 2]])


def test_update_without_gradient_is_a_noop():
    pc, E, W = build()
    trainer = dx.AdamTrainer(pc)
    before = np.array(W.value)
    trainer.update()
    np.testing.assert_array_equal(W.value, before)
    assert trainer.updates == 0


def test_gradients_are_zeroed_by_update_and_accumulate_before():
    pc, E, W = build()
    trainer = dx.SimpleSGDTrainer(pc, learning_rate=0.0)
    dx.renew_cg()
    loss_of(E, W, [1]).backward()
    g1 = np.array(W.grad)
    dx.renew_cg()
    loss_of(E, W, [1]).backward()
    np.testing.assert_allclose(W.grad, 2 * g1, rtol=1e-6)  # accumulates across graphs
    trainer.update()
    np.testing.assert_array_equal(W.grad, np.zeros_like(g1))
    np.testing.assert_array_equal(E.grad, np.zeros(E.shape, np.float32))


def test_clip_threshold_bounds_global_norm():
    pc, E, W = build()
    trainer = dx.SimpleSGDTrainer(pc, learning_rate=1.0, clip_threshold=1e-3)
    before = {p.name: np.array(p.value) for p in pc.parameters()}
    step(trainer, E, W, [1, 2, 3])
    moved = np.sqrt(sum(np.sum((np.asarray(p.value) - before[p.name]) ** 2)
                        for p in pc.parameters()))
    assert moved == pytest.approx(1e-3, rel=1e-3)
    assert trainer.last_grad_norm > 1e-3


def test_learning_rate_schedule_is_applied_per_update():
    """Any optax schedule works: SGD with lr 1.0 then 0.0 moves W once, then not at all."""
    pc, E, W = build()
    schedule = optax.piecewise_constant_schedule(1.0, {1: 0.0})
    trainer = dx.SimpleSGDTrainer(pc, learning_rate=schedule)
    w0 = np.array(W.value)
    step(trainer, E, W, [1])
    w1 = np.array(W.value)
    assert not np.allclose(w1, w0)
    step(trainer, E, W, [1])
    np.testing.assert_array_equal(np.asarray(W.value), w1)


@pytest.mark.parametrize("sparse", [True, False])
def test_learning_rate_scale_equals_optax_with_the_scaled_rate(sparse):
    """Adam with its updates scaled by 0.25, then 0.5 (set between updates) is Optax's Adam
    with its rate set to 0.1 * that scale (exact: Adam's update is proportional to its rate).
    The table's rows are compared on the rows of the first step, where lazy Adam is Adam."""
    pc, E, W = build()
    trainer = dx.Trainer(pc, optax.adam(0.1), sparse_updates=sparse)
    assert trainer.learning_rate_scale == 1.0
    ref = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    params = {"E": jnp.array(E.value), "W": jnp.array(W.value)}  # copies: tables are donated
    state = ref.init(params)
    for scale, rows in ((0.25, [1, 2, 2]), (0.5, [1, 2])):
        trainer.learning_rate_scale = scale
        step(trainer, E, W, rows)
        state.hyperparams["learning_rate"] = 0.1 * scale
        g = jax.grad(lambda p: ref_loss(p["E"], p["W"], rows))(params)
        upd, state = ref.update(g, state, params)
        params = optax.apply_updates(params, upd)
        np.testing.assert_allclose(W.value, params["W"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(E.value)[[1, 2]], np.asarray(params["E"])[[1, 2]],
                                   rtol=1e-5, atol=1e-6)


def test_learning_rate_of_convenience_trainers_is_settable_as_in_dynet():
    pc, E, W = build()
    trainer = dx.SimpleSGDTrainer(pc, learning_rate=0.5)
    assert trainer.learning_rate == 0.5
    trainer.learning_rate = 0.125  # plain SGD: W moves by exactly 0.125 * grad
    assert trainer.learning_rate_scale == pytest.approx(0.25)
    w0 = np.array(W.value)
    dx.renew_cg()
    loss_of(E, W, [3]).backward()
    g = np.array(W.grad)
    trainer.update()
    np.testing.assert_allclose(W.value, w0 - 0.125 * g, rtol=1e-6, atol=1e-7)
    assert dx.AdamTrainer(pc, alpha=0.02).learning_rate == pytest.approx(0.02)


def test_changing_the_learning_rate_compiles_nothing():
    pc, E, W = build()
    trainer = dx.AdamTrainer(pc, alpha=0.1)
    step(trainer, E, W, [1, 2])
    before = trainer._dense_step._cache_size(), trainer._sparse_step._cache_size()
    for lr in (0.05, 0.01, 0.0):
        trainer.learning_rate = lr
        step(trainer, E, W, [3, 4])
    assert (trainer._dense_step._cache_size(), trainer._sparse_step._cache_size()) == before
    w = np.array(W.value)  # rate 0: nothing moves
    step(trainer, E, W, [1])
    np.testing.assert_array_equal(W.value, w)


def test_bad_learning_rates_are_refused_and_change_nothing():
    pc, E, W = build()
    trainer = dx.AdamTrainer(pc, alpha=0.1)
    for bad in (-1.0, float("nan"), float("inf"), "0.1", None, True):
        with pytest.raises(ValueError, match="learning_rate"):
            trainer.learning_rate = bad
        with pytest.raises(ValueError, match="learning_rate_scale"):
            trainer.learning_rate_scale = bad
    assert trainer.learning_rate_scale == 1.0
    with pytest.raises(AttributeError, match="learning_rate_scale"):
        dx.Trainer(pc, optax.adam(0.1)).learning_rate
    with pytest.raises(ValueError, match="schedule|learning_rate_scale"):
        dx.SimpleSGDTrainer(pc, learning_rate=optax.constant_schedule(0.1)).learning_rate = 0.5
    with pytest.raises(ValueError, match="learning_rate_scale"):
        dx.SimpleSGDTrainer(pc, learning_rate=0.0).learning_rate = 0.5


def optax_reference(tx, params, steps, loss):
    """``params`` after ``tx`` applied to ``jax.grad(loss)`` once per item of ``steps``."""
    state = tx.init(params)
    for rows in steps:
        g = jax.grad(loss)(params, rows)
        upd, state = tx.update(g, state, params)
        params = optax.apply_updates(params, upd)
    return params


def loss_with_tables(E, F, W, rows_e, rows_f):
    terms = [dx.sum_elems(dx.tanh(W))]
    terms += [dx.sum_elems(dx.tanh(E[r])) for r in rows_e]
    terms += [dx.sum_elems(dx.tanh(F[r]) * 2.0) for r in rows_f]
    return dx.esum(terms)


def ref_with_tables(p, rows):
    rows_e, rows_f = rows
    return (jnp.sum(jnp.tanh(p["W"])) + sum(jnp.sum(jnp.tanh(p["E"][r])) for r in rows_e)
            + sum(jnp.sum(jnp.tanh(p["F"][r]) * 2.0) for r in rows_f))


@pytest.mark.parametrize("make_tx", [
    lambda: optax.sgd(optax.exponential_decay(1.0, transition_steps=1, decay_rate=0.5)),
    lambda: optax.adagrad(optax.piecewise_constant_schedule(0.5, {2: 0.1}))])
def test_sparse_updates_stay_exact_under_a_schedule_when_a_table_is_not_used(make_tx):
    """A table left out of an update still advances its step count, so a schedule gives its
    later row updates the rate Optax gives them (SGD and Adagrad: sparse is exact)."""
    steps = [([0], [1]), ([], [2]), ([], []), ([1], [1])]  # E unused twice, F once
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((4, 3), name="E")
    F = pc.add_lookup_parameters((5, 2), name="F")
    W = pc.add_parameters((2,), name="W")
    start = {"E": E.value, "F": F.value, "W": W.value}
    trainer = dx.Trainer(pc, make_tx(), sparse_updates=True)
    for rows_e, rows_f in steps:
        dx.renew_cg()
        loss_with_tables(E, F, W, rows_e, rows_f).backward()
        trainer.update()
    want = optax_reference(make_tx(), start, steps, ref_with_tables)
    for p in (E, F, W):
        np.testing.assert_allclose(p.value, want[p.name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make", [
    lambda pc: dx.Trainer(pc, optax.adam(0.1)), lambda pc: dx.AdamTrainer(pc, alpha=0.1),
    lambda pc: dx.Trainer(pc, optax.adamw(0.1, weight_decay=0.1)),
    lambda pc: dx.MomentumSGDTrainer(pc, learning_rate=0.1)])
def test_default_updates_of_tables_equal_optax_for_optimizers_with_state(make):
    """API.md: tables are updated sparsely where that is exact; for Adam and the like it is
    the user's choice, so by default a table follows Optax exactly (rows left out of an
    update still move)."""
    steps = [([0, 2], [1]), ([1], []), ([3], [4])]
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((4, 3), name="E")
    F = pc.add_lookup_parameters((5, 2), name="F")
    W = pc.add_parameters((2,), name="W")
    start = {"E": E.value, "F": F.value, "W": W.value}
    trainer = make(pc)
    assert trainer.sparse_updates is False
    for rows_e, rows_f in steps:
        dx.renew_cg()
        loss_with_tables(E, F, W, rows_e, rows_f).backward()
        trainer.update()
    tx = trainer.tx
    want = optax_reference(tx, start, steps, ref_with_tables)
    for p in (E, F, W):
        np.testing.assert_allclose(p.value, want[p.name], rtol=1e-5, atol=1e-6)


def test_exact_convenience_trainers_update_tables_sparsely_by_default():
    pc, E, W = build()
    assert dx.SimpleSGDTrainer(pc).sparse_updates and dx.AdagradTrainer(pc).sparse_updates
    assert not dx.RMSPropTrainer(pc).sparse_updates


@pytest.mark.parametrize("sparse", [False, True])
def test_adding_a_parameter_keeps_the_state_of_the_others(sparse):
    """A parameter (or table) added after training began gets fresh optimizer state; the
    others keep their moments and the step count goes on (DyNet does the same), so the
    existing parameters follow Optax's trajectory exactly."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3,), name="W")
    E = pc.add_lookup_parameters((4, 3), name="E")
    start = {"W": W.value, "E": E.value}
    trainer = dx.Trainer(pc, optax.adam(0.1), sparse_updates=sparse)
    steps = [[0, 1], [0, 1], [0, 1]]
    late = []
    for k, rows in enumerate(steps):
        if k == 2:  # e.g. a builder made once training runs
            late = [pc.add_parameters((2,), name="late"),
                    pc.add_lookup_parameters((3, 2), name="late_table")]
            late_start = [np.array(p.value) for p in late]
        dx.renew_cg()
        terms = [dx.sum_elems(dx.tanh(W) * 3.0)] + [dx.sum_elems(dx.tanh(E[r])) for r in rows]
        terms += [dx.sum_elems(late[0]), dx.sum_elems(late[1][0])] if late else []
        dx.esum(terms).backward()
        trainer.update()

    def ref(p, rows):
        return jnp.sum(jnp.tanh(p["W"]) * 3.0) + sum(jnp.sum(jnp.tanh(p["E"][r])) for r in rows)

    want = optax_reference(optax.adam(0.1), start, steps, ref)
    np.testing.assert_allclose(W.value, want["W"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(E.value, want["E"], rtol=1e-6, atol=1e-7)
    # the late ones took one Adam step, gradient 1, at the shared step count 3
    m, v = 0.1, 0.001  # first moments from zero: (1 - b1) g, (1 - b2) g^2
    step_size = 0.1 * (m / (1 - 0.9 ** 3)) / (np.sqrt(v / (1 - 0.999 ** 3)) + 1e-8)
    np.testing.assert_allclose(late[0].value, late_start[0] - step_size, rtol=1e-5)
    table = np.asarray(late[1].value)
    np.testing.assert_allclose(table[0], late_start[1][0] - step_size, rtol=1e-5)
    np.testing.assert_array_equal(table[1:], late_start[1][1:])  # gradient 0: no move


def test_sparse_mode_refuses_an_optimizer_without_row_wise_state():
    """Adafactor keeps factored second moments of a large table (one per row, one per
    column): gathering rows cannot update them, so sparse mode says so and changes
    nothing; dense mode equals Optax."""
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((200, 130), name="E")
    before = np.array(E.value)
    trainer = dx.Trainer(pc, optax.adafactor(0.1), sparse_updates=True)
    dx.renew_cg()
    dx.sum_elems(dx.tanh(E[3])).backward()
    with pytest.raises(ValueError, match=r"sparse_updates.*\(130,\).*'E'.*\(200, 130\)"):
        trainer.update()
    np.testing.assert_array_equal(E.value, before)
    assert float(jnp.abs(E.grad).sum()) > 0  # the gradient is still there
    trainer.sparse_updates = False  # the user's fix: the same trainer, dense
    trainer.update()
    assert trainer.updates == 1
    tx = optax.adafactor(0.1)
    g = jax.grad(lambda e: jnp.sum(jnp.tanh(e[3])))(jnp.asarray(before))
    upd, _ = tx.update(g, tx.init(jnp.asarray(before)), jnp.asarray(before))
    np.testing.assert_allclose(E.value, before + np.asarray(upd), rtol=1e-5, atol=1e-7)


def _adam_switching_modes(modes, steps):
    """Adam on ``loss_with_tables`` over ``steps``, ``sparse_updates`` set to ``modes[k]``
    before step k. Returns the trainer, its parameters, and Optax's result from the same
    start."""
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((4, 3), name="E")
    F = pc.add_lookup_parameters((5, 2), name="F")
    W = pc.add_parameters((2,), name="W")
    start = {"E": E.value, "F": F.value, "W": W.value}
    trainer = dx.Trainer(pc, optax.adam(0.1), sparse_updates=modes[0])
    for sparse, (rows_e, rows_f) in zip(modes, steps):
        trainer.sparse_updates = sparse
        dx.renew_cg()
        loss_with_tables(E, F, W, rows_e, rows_f).backward()
        trainer.update()
    return trainer, (E, F, W), optax_reference(optax.adam(0.1), start, steps, ref_with_tables)


def test_switching_the_update_mode_between_updates():
    """``sparse_updates`` changed between updates: the state is rebuilt for the new layout
    (no crash), and the dense parameter keeps its Adam state, so it follows Optax."""
    steps = [([0, 2], [1]), ([1], []), ([3], [4]), ([0], [0])]
    trainer, (_, _, W), want = _adam_switching_modes([True, False, True, False], steps)
    np.testing.assert_allclose(W.value, want["W"], rtol=1e-6, atol=1e-7)
    assert trainer.updates == len(steps)


@pytest.mark.parametrize("first_sparse", [True, False])
def test_switching_the_update_mode_keeps_the_tables_moments(first_sparse):
    """Tables move between their own (sparse) state and the dense group's when the mode
    changes, and keep their moments: with every row used at every step lazy Adam is Adam,
    so tables and the dense parameter all follow Optax (a switch used to restart a table's
    moments: 2e-3 to 4e-2 off)."""
    modes = [first_sparse, not first_sparse] * 2
    _, params, want = _adam_switching_modes(modes, [(list(range(4)), list(range(5)))] * 4)
    for p in params:
        np.testing.assert_allclose(p.value, want[p.name], rtol=1e-6, atol=1e-7, err_msg=p.name)


def test_a_dense_parameter_added_to_tables_only_training_gets_the_step_count():
    """Sparse training of a collection of tables only, then a dense parameter: its first
    Adam step uses the step count the tables reached (the empty dense group's own count
    never moved)."""
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((4, 3), name="E")
    trainer = dx.Trainer(pc, optax.adam(0.1), sparse_updates=True)
    for k in range(3):
        if k == 2:
            late = pc.add_parameters((2,), name="late")
            late_start = np.array(late.value)
        dx.renew_cg()
        terms = [dx.sum_elems(dx.tanh(E[0]))] + ([dx.sum_elems(late)] if k == 2 else [])
        dx.esum(terms).backward()
        trainer.update()
    m, v = 0.1, 0.001  # one step from zero moments, gradient 1, at step count 3
    step_size = 0.1 * (m / (1 - 0.9 ** 3)) / (np.sqrt(v / (1 - 0.999 ** 3)) + 1e-8)
    np.testing.assert_allclose(late.value, late_start - step_size, rtol=1e-5)


@pytest.mark.parametrize("sparse", [True, False])
def test_adagrad_trainer_follows_dynets_formula(sparse):
    """``h += g^2; p -= lr g / sqrt(h + eps)`` from ``h = 0``: the first step moves each
    element by ``lr`` times the sign of its gradient, whatever the gradient's size."""
    pc, E, W = build()
    trainer = dx.AdagradTrainer(pc, learning_rate=0.1, sparse_updates=sparse)
    e0, w0 = np.array(E.value), np.array(W.value)
    h_w, h_e = np.zeros_like(w0), np.zeros_like(e0)
    for rows in ([1, 2], [2]):
        dx.renew_cg()
        loss_of(E, W, rows).backward()
        g_w, g_e = np.array(W.grad), np.array(E.grad)
        trainer.update()
        h_w += g_w ** 2
        h_e += g_e ** 2
        w0 = w0 - 0.1 * g_w / np.sqrt(h_w + 1e-20)
        e0 = e0 - 0.1 * np.where(h_e > 0, g_e / np.sqrt(h_e + 1e-20), 0.0)
        np.testing.assert_allclose(W.value, w0, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(E.value, e0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda"])
def test_sparse_rows_padding_does_not_enter_a_norm(strategy):
    """Sparse mode pads a table's used rows to a bucket (bounded compiles); the padding
    must be invisible to the transform: clipping sees the used row's norm only (one row
    with gradient [3, 4], norm 5, clipped to norm 1, as Optax clips that table)."""
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((5, 2), init=np.zeros((5, 2), np.float32), name="E")
    trainer = dx.Trainer(pc, optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)),
                         sparse_updates=True)
    dx.renew_cg(autobatch=strategy)
    dx.dot_product(E[3], dx.input(np.array([3.0, 4.0], np.float32))).backward()
    trainer.update()
    want = np.zeros((5, 2), np.float32)
    want[3] = [-0.6, -0.8]
    np.testing.assert_allclose(E.value, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make_tx", [
    lambda: optax.named_chain(("clip", optax.clip_by_global_norm(100.0)),
                              ("adam", optax.adam(0.1))),
    lambda: optax.multi_transform(
        {"a": optax.adam(0.1), "s": optax.sgd(0.1)},
        lambda p: {k: "s" if k.startswith("b") else "a" for k in p})])
def test_adding_a_parameter_keeps_each_parameters_state_under_labelled_transforms(make_tx):
    """Optax states keyed by labels or chain names (dict keys that are not parameter
    names): a parameter added later must not take another parameter's moments. Reference:
    Optax over every parameter from the start, the late one unused until then (its Adam
    moments stay zero, as fresh ones are)."""
    x1, x2 = np.array([1.0, 2.0], np.float32), np.array([-5.0, 7.0], np.float32)
    pc = dx.ParameterCollection(seed=0)
    P = {n: pc.add_parameters((2,), name=n) for n in ("W", "V", "b")}
    start = {n: p.value for n, p in P.items()}
    trainer = dx.Trainer(pc, make_tx())

    def loss(P, late):
        total = (dx.dot_product(P["W"], dx.input(x1)) * dx.dot_product(P["V"], dx.input(x2))
                 + dx.sum_elems(dx.tanh(P["b"])))
        return total + dx.sum_elems(P["U"]) * 2.0 if late else total

    for k in range(4):
        if k == 2:
            P["U"] = pc.add_parameters((2,), name="U")
            start["U"] = P["U"].value
        dx.renew_cg()
        loss(P, k >= 2).backward()
        trainer.update()

    def ref(p, late):
        total = jnp.dot(p["W"], x1) * jnp.dot(p["V"], x2) + jnp.sum(jnp.tanh(p["b"]))
        return total + jnp.sum(p["U"]) * 2.0 * late

    want = optax_reference(make_tx(), start, [0.0, 0.0, 1.0, 1.0], ref)
    for n, p in P.items():
        np.testing.assert_allclose(p.value, want[n], rtol=1e-5, atol=1e-6, err_msg=n)


@pytest.mark.parametrize("make_tx,match", [
    (lambda: optax.adamw(0.1, mask={"W": True, "E": False}), "dict keyed by"),
    (lambda: optax.multi_transform({"a": optax.adam(0.1), "s": optax.sgd(0.1)},
                                   {"W": "a", "E": "s"}), "dict keyed by"),
    (lambda: optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), "accumulates")])
def test_sparse_mode_refuses_what_it_cannot_split_by_rows(make_tx, match):
    """A mask or labels over every parameter's name does not fit the groups of sparse mode,
    and gradients accumulated over steps would be lost for rows the applying step does not
    use: both are refused with what to do, and nothing changes; dense mode runs them."""
    pc, E, W = build()
    before = (np.array(E.value), np.array(W.value))
    trainer = dx.Trainer(pc, make_tx(), sparse_updates=True)
    dx.renew_cg()
    loss_of(E, W, [1, 2]).backward()
    with pytest.raises(ValueError, match=match) as err:
        trainer.update()
    assert "sparse_updates=False" in str(err.value)
    np.testing.assert_array_equal(E.value, before[0])
    np.testing.assert_array_equal(W.value, before[1])
    trainer.sparse_updates = False
    trainer.update()  # (MultiSteps moves nothing before its second step)
    assert trainer.updates == 1


def test_restart_forgets_the_optimizer_state_as_in_dynet():
    """After ``restart()`` the next update is a fresh Adam's first step (moments and step
    count start over); ``restart(learning_rate)`` also sets the rate."""
    pc, E, W = build()
    trainer = dx.AdamTrainer(pc, alpha=0.1)
    for _ in range(3):
        step(trainer, E, W, [1, 2])
    after_three = {"E": E.value, "W": W.value}
    trainer.restart(learning_rate=0.05)
    assert trainer.learning_rate == pytest.approx(0.05) and trainer.updates == 0
    step(trainer, E, W, [1, 2])
    want = optax_reference(optax.adam(0.05), after_three, [[1, 2]],
                           lambda p, rows: ref_loss(p["E"], p["W"], rows))
    np.testing.assert_allclose(E.value, want["E"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(W.value, want["W"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", ["adam", None, 0.1, optax.adam])
def test_a_trainer_refuses_what_is_not_an_optax_transform(bad):
    """At construction, naming what was given (the first update used to fail with an
    AttributeError); an uncalled factory such as ``optax.adam`` gets a hint."""
    pc, E, W = build()
    with pytest.raises(TypeError, match="tx must be an Optax gradient transformation"):
        dx.Trainer(pc, bad)
    if bad is optax.adam:
        with pytest.raises(TypeError, match=r"call it: optax.adam\(1e-3\)"):
            dx.Trainer(pc, bad)


@pytest.mark.parametrize("sparse", [False, True])
def test_frozen_parameters_are_left_alone_as_in_dynet(sparse):
    """``p.set_updated(False)``: the trainer leaves p's value as it is, drops its gradient, and
    the others follow Optax's trajectory with p held constant (clipping ignores p); after
    ``set_updated(True)`` p moves again, from fresh moments."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3,), name="W")
    E = pc.add_lookup_parameters((4, 3), name="E")
    V = pc.add_parameters((3,), name="V")
    trainer = dx.Trainer(pc, optax.adam(0.1), sparse_updates=sparse, clip_threshold=0.5)
    with pytest.raises(dx.InvalidArgumentError, match="set_updated of V: expected a bool"):
        V.set_updated(0)
    V.set_updated(False)
    E.set_updated(False)
    assert not V.is_updated() and W.is_updated()
    start = {"W": W.value, "E": np.array(E.value), "V": np.array(V.value)}

    def build():
        dx.renew_cg()
        return dx.esum([dx.sum_elems(dx.tanh(W) * 3.0), dx.sum_elems(dx.cmult(V, W)),
                        dx.sum_elems(dx.tanh(E[1]))])

    for _ in range(3):
        build().backward()
        trainer.update()
        assert not np.asarray(V.grad).any() and not np.asarray(E.grad).any()
    np.testing.assert_array_equal(V.value, start["V"])
    np.testing.assert_array_equal(E.value, start["E"])

    def ref(p, rows):
        return jnp.sum(jnp.tanh(p["W"]) * 3.0) + jnp.sum(start["V"] * p["W"])

    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.1))
    want = optax_reference(tx, {"W": start["W"]}, [None] * 3, ref)
    np.testing.assert_allclose(W.value, want["W"], rtol=1e-5, atol=1e-6)
    V.set_updated(True)
    build().backward()
    trainer.update()
    assert not np.allclose(V.value, start["V"])
    np.testing.assert_array_equal(E.value, start["E"])


def test_const_parameter_and_const_lookup_pass_no_gradient():
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3,), name="W")
    E = pc.add_lookup_parameters((4, 3), name="E")
    dx.renew_cg()
    loss = dx.sum_elems(dx.cmult(dx.const_parameter(W), E[2])) \
        + dx.sum_elems(dx.cmult(W, dx.const_lookup(E, 1)))
    loss.backward()
    e, w = np.asarray(E.value), np.asarray(W.value)
    np.testing.assert_allclose(loss.scalar_value(), float(w @ e[2] + w @ e[1]), rtol=1e-6)
    np.testing.assert_allclose(W.grad, e[1], rtol=1e-6)  # through the plain W only
    want = np.zeros((4, 3), np.float32)
    want[2] = w  # row 2 read plainly; row 1 through const_lookup
    np.testing.assert_allclose(E.grad, want, rtol=1e-6)


@pytest.mark.parametrize("make,make_tx", [
    (lambda pc: dx.AmsgradTrainer(pc, learning_rate=0.05),
     lambda: dx.nn.trainers.dynet_amsgrad(0.05)),  # dense and sparse; the formula: below
    (lambda pc: dx.AdadeltaTrainer(pc, rho=0.9), lambda: optax.adadelta(1.0, rho=0.9)),
    (lambda pc: dx.CyclicalSGDTrainer(pc, 0.1, 0.5, step_size=2),
     lambda: optax.sgd(dx.nn.trainers.cyclical_learning_rate(0.1, 0.5, 2)))])
def test_further_dynet_trainers_equal_their_optax_transform(make, make_tx):
    pc, E, W = build()
    assert_follows_optax(make(pc), make_tx(), E, W, ([1, 2, 2], [3], [1, 7], [2]))


def assert_follows_formula(trainer, E, W, rule):
    """Three updates of ``trainer`` against ``rule(w, g) -> w``, the update written by hand
    in float64 (``rule`` keeps its own state)."""
    w = np.array(W.value, np.float64)
    for rows in ([1, 2], [2], [4]):
        dx.renew_cg()
        loss_of(E, W, rows).backward()
        g = np.array(W.grad, np.float64)
        trainer.update()
        w = rule(w, g)
        np.testing.assert_allclose(W.value, w, rtol=1e-5, atol=1e-7)


def test_adadelta_trainer_follows_dynets_formula():
    """Zeiler's update, by hand: ``Eg = rho Eg + (1 - rho) g^2; d = sqrt(Ed + eps) /
    sqrt(Eg + eps) g; Ed = rho Ed + (1 - rho) d^2; p -= d``."""
    pc, E, W = build()
    trainer = dx.AdadeltaTrainer(pc, eps=1e-6, rho=0.95)
    eg, ed = np.zeros(W.shape), np.zeros(W.shape)

    def rule(w, g):
        nonlocal eg, ed
        eg = 0.95 * eg + 0.05 * g * g
        d = np.sqrt(ed + 1e-6) / np.sqrt(eg + 1e-6) * g
        ed = 0.95 * ed + 0.05 * d * d
        return w - d

    assert_follows_formula(trainer, E, W, rule)
    assert trainer.learning_rate == 1.0


def test_amsgrad_trainer_follows_dynets_formula():
    """DyNet's AMSGrad, by hand: Adam's moments, the running maximum of the raw second
    moment, and the bias corrections folded into the rate. The gradients shrink after the
    first update, so the maximum is what sets the later steps."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters(3, init=np.zeros(3, np.float32), name="W")
    trainer = dx.AmsgradTrainer(pc, learning_rate=0.1, beta_1=0.8, beta_2=0.9, eps=1e-8)
    w, m, v, vmax = np.zeros(3), np.zeros(3), np.zeros(3), np.zeros(3)
    target = np.array([1.0, -2.0, 0.5])
    for t, scale in enumerate((5.0, 1.0, 0.5, 0.2, 0.1), start=1):
        dx.renew_cg()
        dx.sum_elems(dx.cmult(W, dx.input((-scale * target).astype(np.float32)))).backward()
        g = -scale * target
        trainer.update()
        m = 0.8 * m + 0.2 * g
        v = 0.9 * v + 0.1 * g * g
        vmax = np.maximum(vmax, v)
        w = w - 0.1 * np.sqrt(1 - 0.9 ** t) / (1 - 0.8 ** t) * m / (np.sqrt(vmax) + 1e-8)
        np.testing.assert_allclose(W.value, w, rtol=1e-5, atol=1e-7)
    assert (vmax > v).all()  # the maximum mattered


def test_rmsprop_trainer_follows_dynets_formula_and_argument_order():
    """``v = rho v + (1 - rho) g^2; p -= lr g / sqrt(v + eps)``, by hand; positional
    arguments in DyNet's order (learning_rate, eps, rho)."""
    pc, E, W = build()
    v = np.zeros(W.shape)

    def rule(w, g):
        nonlocal v
        v = 0.8 * v + 0.2 * g * g
        return w - 0.01 * g / np.sqrt(v + 1e-6)

    assert_follows_formula(dx.RMSPropTrainer(pc, 0.01, 1e-6, 0.8), E, W, rule)


def test_cyclical_sgd_trainer_rate_rises_and_falls_and_steps_by_it():
    pc, E, W = build()
    trainer = dx.CyclicalSGDTrainer(pc, learning_rate_min=0.01, learning_rate_max=0.1,
                                    step_size=2)
    rates = []
    for rows in ([1], [2], [3], [4], [5], [6]):
        lr = trainer.learning_rate
        rates.append(lr)
        w = np.array(W.value)
        dx.renew_cg()
        loss_of(E, W, rows).backward()
        g = np.array(W.grad)
        trainer.update()
        np.testing.assert_allclose(W.value, w - lr * g, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(rates, [0.01, 0.055, 0.1, 0.055, 0.01, 0.055], rtol=1e-5)
    decaying = dx.CyclicalSGDTrainer(pc, 0.0, 1.0, step_size=1, gamma=0.5)
    decaying.updates = 1  # the first peak, its amplitude halved once
    assert decaying.learning_rate == pytest.approx(0.5)
    with pytest.raises(ValueError, match="rate is a schedule; set learning_rate_scale"):
        trainer.learning_rate = 0.5
    for bad in (dict(step_size=0), dict(step_size=2.5), dict(learning_rate_min=0.2),
                dict(gamma=-1.0)):
        with pytest.raises(ValueError, match="CyclicalSGDTrainer"):
            dx.CyclicalSGDTrainer(pc, **bad)


def test_eg_trainer_follows_dynets_formula():
    """DyNet's EG update, by hand in NumPy: ``h = mom h - lr g``, then each parameter is
    ``w exp(h)`` normalised over all its entries; clipping and ``learning_rate`` scale the
    gradient (the rate enters through the momentum, not linearly in the step)."""
    pc = dx.ParameterCollection(seed=0)
    P = pc.add_parameters((2, 3), init=np.full((2, 3), 1 / 6, np.float32), name="P")
    T = pc.add_lookup_parameters((3, 2), init=np.full((3, 2), 1 / 6, np.float32), name="T")
    trainer = dx.EGTrainer(pc, learning_rate=0.5, mom=0.8)
    w = {"P": np.full((2, 3), 1 / 6), "T": np.full((3, 2), 1 / 6)}
    h = {k: np.zeros_like(v) for k, v in w.items()}
    targets = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]], np.float32)
    for step in range(4):
        if step == 2:
            trainer.learning_rate = 0.25  # DyNet users decay it so
        dx.renew_cg()
        loss = dx.sum_elems(dx.cmult(P, dx.input(-targets))) + dx.sum_elems(
            dx.square(T[step % 3]))
        loss.backward()
        grads = {"P": np.array(P.grad, np.float64), "T": np.array(T.grad, np.float64)}
        lr = trainer.learning_rate
        trainer.update()
        for k in w:
            h[k] = 0.8 * h[k] - lr * grads[k]
            z = np.log(w[k]) + h[k]
            w[k] = np.exp(z - np.log(np.exp(z).sum()))
        np.testing.assert_allclose(P.value, w["P"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(T.value, w["T"], rtol=1e-5, atol=1e-7)
        assert float(np.sum(P.value)) == pytest.approx(1.0, abs=1e-6)
    assert np.argmax(np.asarray(P.value)) == 5  # the mass moved to the largest target
    with pytest.raises(ValueError, match="EGTrainer: sparse_updates is not offered"):
        dx.EGTrainer(pc, sparse_updates=True)
    with pytest.raises(ValueError, match="EGTrainer: sparse_updates is not offered"):
        trainer.set_sparse_updates(True)
    assert not trainer.sparse_updates


@pytest.mark.parametrize("make", [lambda pc, sparse: dx.SimpleSGDTrainer(
    pc, learning_rate=0.5, sparse_updates=sparse), lambda pc, sparse: dx.AdamTrainer(
    pc, alpha=0.1, sparse_updates=sparse)], ids=["sgd", "adam"])
def test_a_table_used_as_a_whole_is_updated_densely_in_sparse_mode(make):
    """A table read as a whole (not row by row) may have a gradient on any row: sparse mode
    then updates all of it, as dense mode does, also when lookups follow before the update."""
    v = np.array([1.0, -0.5, 0.25, 2.0], np.float32)
    runs = []
    for sparse in (True, False):
        pc, E, W = build()
        trainer = make(pc, sparse)
        E0 = np.array(E.value)
        dx.renew_cg()
        (dx.sum_elems(dx.tanh(dx.parameter(E) @ dx.input(v))) + loss_of(E, W, [1])).backward()
        assert E.touched is None
        dx.renew_cg()
        loss_of(E, W, [2]).backward()  # rows read afterwards: still the whole table
        assert E.touched is None
        trainer.update()
        assert E.touched == set() and not np.asarray(E.grad).any()
        assert not np.isclose(np.asarray(E.value), E0).all(axis=1).any()  # every row moved
        runs.append((np.array(E.value), np.array(W.value)))
    (E_sparse, W_sparse), (E_dense, W_dense) = runs
    np.testing.assert_allclose(E_sparse, E_dense, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(W_sparse, W_dense, rtol=1e-6, atol=1e-7)


def test_status_prints_and_returns_the_updates_and_the_last_gradient_norm(capsys):
    pc, E, W = build()
    trainer = dx.AdamTrainer(pc, alpha=0.1)
    assert trainer.status() == "AdamTrainer: 0 updates"
    assert capsys.readouterr().out == "AdamTrainer: 0 updates\n"
    trainer.set_clip_threshold(100.0)
    step(trainer, E, W, [1, 2])
    norm = trainer.last_grad_norm
    assert norm > 0
    want = f"AdamTrainer: 1 updates, last grad norm {norm:.4g}"
    assert trainer.status() == want
    assert capsys.readouterr().out == want + "\n"


def test_dense_mode_passes_the_optimizers_own_error_through_and_changes_nothing():
    """A mask that misses a parameter: dense mode is plain Optax, so Optax's error reaches
    the user as it is (sparse mode explains its groups instead), and nothing changes."""
    pc, E, W = build()
    tx = optax.adamw(0.1, mask={"W": True})  # no entry for E
    with pytest.raises(ValueError) as direct:
        tx.init({"E": E.value, "W": W.value})
    trainer = dx.Trainer(pc, tx, sparse_updates=False)
    before = np.array(E.value), np.array(W.value)
    dx.renew_cg()
    loss_of(E, W, [1, 2]).backward()
    grads = np.array(E.grad), np.array(W.grad)
    with pytest.raises(ValueError) as err:
        trainer.update()
    assert str(err.value) == str(direct.value) and "sparse_updates" not in str(err.value)
    assert trainer.updates == 0
    for p, v, g in zip((E, W), before, grads):
        np.testing.assert_array_equal(p.value, v)
        np.testing.assert_array_equal(p.grad, g)  # the gradients wait for a working update


def test_exponentiated_gradient_without_the_parameters_is_a_clear_error():
    """Optax's ``update(updates, state, params=None)``: called without the parameters
    (directly or inside ``optax.chain``), the transform says what it needs."""
    tx = dx.nn.trainers.exponentiated_gradient(0.1)
    params = {"w": jnp.full((3,), 1 / 3)}
    grads = {"w": jnp.array([1.0, 0.0, -1.0])}
    chained = optax.chain(tx)
    for update in (lambda: tx.update(grads, tx.init(params)),
                   lambda: chained.update(grads, chained.init(params))):
        with pytest.raises(ValueError, match="exponentiated_gradient needs the parameters' "
                                             "values"):
            update()
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)["w"]
    assert float(jnp.sum(new)) == pytest.approx(1.0) and new[2] > new[1] > new[0]


RATE_ARGS = [(dx.SimpleSGDTrainer, "learning_rate"), (dx.MomentumSGDTrainer, "learning_rate"),
             (dx.AdagradTrainer, "learning_rate"), (dx.AdamTrainer, "alpha"),
             (dx.RMSPropTrainer, "learning_rate"), (dx.AmsgradTrainer, "learning_rate")]


@pytest.mark.parametrize("cls, arg", RATE_ARGS, ids=[c.__name__ for c, _ in RATE_ARGS])
@pytest.mark.parametrize("bad", [-1.0, "x", float("nan")], ids=["negative", "str", "nan"])
def test_a_learning_rate_that_is_not_a_number_at_least_0_is_refused(cls, arg, bad):
    """As the ``learning_rate`` setter refuses it: a negative rate climbs the gradient, and
    a string failed at the first update with a message naming neither."""
    pc, E, W = build()
    with pytest.raises(ValueError, match=f"{cls.__name__}: {arg} must be a finite number "
                                         r">= 0, got"):
        cls(pc, **{arg: bad})


def test_a_schedule_is_still_taken_as_a_learning_rate():
    pc, E, W = build()
    schedule = optax.linear_schedule(0.5, 0.1, 4)
    trainer = dx.SimpleSGDTrainer(pc, learning_rate=schedule)
    assert trainer.learning_rate == pytest.approx(0.5)
    w0 = np.array(W.value)
    step(trainer, E, W, [1])
    assert trainer.learning_rate == pytest.approx(0.4)
    assert not np.allclose(W.value, w0)


@pytest.mark.parametrize("bad", [-1, "a", float("nan"), True], ids=["negative", "str", "nan",
                                                                     "bool"])
def test_a_clip_threshold_given_to_the_constructor_is_checked_as_the_setter_does(bad):
    """A negative threshold made every update climb the gradient; now refused, as by
    ``set_clip_threshold``."""
    pc, E, W = build()
    with pytest.raises(ValueError, match=r"SimpleSGDTrainer: clip_threshold must be a finite "
                                         r"number >= 0"):
        dx.SimpleSGDTrainer(pc, clip_threshold=bad)
    with pytest.raises(ValueError, match=r"set_clip_threshold: threshold must be a finite"):
        dx.SimpleSGDTrainer(pc).set_clip_threshold(bad)


def test_a_clip_threshold_of_0_is_off_in_the_constructor_as_in_the_setter():
    """0 means no clipping, as ``set_clip_threshold(0)`` and ``get_clip_threshold()`` say
    (it scaled every update to zero): the update equals an unclipped trainer's."""
    runs = []
    for kwargs in ({"clip_threshold": 0}, {}):
        pc, E, W = build()
        trainer = dx.SimpleSGDTrainer(pc, learning_rate=0.5, **kwargs)
        assert trainer.get_clip_threshold() == 0.0
        step(trainer, E, W, [1, 2])
        runs.append(np.array(W.value))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.allclose(runs[0], build()[2].value)


def test_a_trainer_needs_a_parameter_collection():
    pc, E, W = build()
    with pytest.raises(dx.ArgumentTypeError, match="SimpleSGDTrainer: pc must be a "
                                                   "ParameterCollection, got list"):
        dx.SimpleSGDTrainer([W], 0.1)


def test_a_jax_scalar_is_taken_as_a_learning_rate():
    runs = []
    for rate in (jnp.float32(0.5), 0.5):
        pc, E, W = build()
        trainer = dx.SimpleSGDTrainer(pc, learning_rate=rate)
        assert trainer.learning_rate == pytest.approx(0.5)
        step(trainer, E, W, [1])
        runs.append(np.array(W.value))
    np.testing.assert_array_equal(runs[0], runs[1])


def test_the_setters_take_a_jax_scalar_as_the_constructor_does():
    """``learning_rate``, ``learning_rate_scale`` and ``set_clip_threshold`` take a 0-d JAX
    number as the constructor does; a 0-d bool or a vector is still refused."""
    pc, E, W = build()
    trainer = dx.SimpleSGDTrainer(pc, learning_rate=0.5)
    trainer.learning_rate = jnp.float32(0.25)
    assert trainer.learning_rate == pytest.approx(0.25)
    trainer.learning_rate_scale = jnp.int32(1)
    assert trainer.learning_rate == pytest.approx(0.5)
    trainer.set_clip_threshold(jnp.float32(2.0))
    assert trainer.get_clip_threshold() == pytest.approx(2.0)
    class Shapeless:  # a 0-d shape but no dtype: not a number, though float() takes it
        shape = ()

        def __float__(self):
            return 1.0

    for bad in (jnp.bool_(True), jnp.ones(2), jnp.float32(-1.0), jnp.float32(np.inf),
                Shapeless()):
        with pytest.raises(ValueError, match="SimpleSGDTrainer.learning_rate must be a finite"):
            trainer.learning_rate = bad
        with pytest.raises(ValueError, match="set_clip_threshold: threshold must be a finite"):
            trainer.set_clip_threshold(bad)
    assert trainer.learning_rate == pytest.approx(0.5)


def test_update_passes_optax_extra_args_and_says_when_they_are_missing():
    """``trainer.update(value=loss)`` reaches a transform that needs it (reduce_on_plateau:
    the rate falls once the loss stops improving), equal to Optax's own loop; an Expression
    is passed as its value. Without it the error says what to pass and changes nothing."""
    def make_tx():
        return optax.chain(optax.sgd(0.5),
                           optax.contrib.reduce_on_plateau(patience=1, cooldown=0, factor=0.5))

    pc, E, W = build()
    trainer = dx.Trainer(pc, make_tx())
    dx.renew_cg()
    loss_of(E, W, [1, 2]).backward()
    before = E.value.copy(), W.value.copy()
    with pytest.raises(dx.ArgumentTypeError, match=r"update\(value=loss\)"):
        trainer.update()
    np.testing.assert_array_equal(E.value, before[0])
    np.testing.assert_array_equal(W.value, before[1])
    trainer.update(value=1.0)  # the gradient kept through the failure is applied now
    assert trainer.updates == 1

    tx = make_tx()
    start = {"E": before[0], "W": before[1]}
    state = tx.init(start)
    g = jax.grad(lambda p: ref_loss(p["E"], p["W"], [1, 2]))(start)
    upd, state = tx.update(g, state, start, value=1.0)
    params = optax.apply_updates(start, upd)
    np.testing.assert_allclose(E.value, params["E"], rtol=1e-5, atol=1e-6)
    # the same loss again and again: no improvement, so the plateau halves the rate
    for k in range(4):
        dx.renew_cg()
        loss_of(E, W, [3]).backward()
        trainer.update(value=dx.scalarInput(5.0) if k % 2 else 5.0)
        g = jax.grad(lambda p: ref_loss(p["E"], p["W"], [3]))(params)
        upd, state = tx.update(g, state, params, value=5.0)
        params = optax.apply_updates(params, upd)
        np.testing.assert_allclose(E.value, params["E"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(W.value, params["W"], rtol=1e-5, atol=1e-6)
    assert float(state[1].scale) < 1.0  # the plateau was reached: the test saw it act


def test_trainer_refuses_a_sparse_updates_flag_that_is_not_a_bool():
    pc, E, W = build()
    with pytest.raises(dx.ArgumentTypeError, match="sparse_updates must be a bool"):
        dx.AdamTrainer(pc, sparse_updates="False")
    assert dx.AdamTrainer(pc, sparse_updates=np.bool_(True)).sparse_updates is True
