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
    trainer = dx.Trainer(pc, tx, sparse_updates=False)
    params = {"E": E.value, "W": W.value}
    state = tx.init(params)
    for rows in ([1, 2, 2], [3], [1, 7]):
        step(trainer, E, W, rows)
        g = jax.grad(lambda p: ref_loss(p["E"], p["W"], rows))(params)
        upd, state = tx.update(g, state, params)
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
    trainer = dx.AdamTrainer(pc, alpha=0.1)
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
