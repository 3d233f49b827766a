"""Persistence round trips and failure modes; dropout semantics under batching."""
import numpy as np
import pytest

import dynax as dx


def build(seed):
    pc = dx.ParameterCollection(seed=seed)
    pc.add_parameters((3, 4), name="W")
    pc.add_lookup_parameters((5, 2), name="E")
    enc = pc.add_subcollection("enc")
    enc.add_parameters((4,), name="b")
    return pc


def values(pc):
    return {p.name: np.array(p.value) for p in pc.parameters()}


def test_save_populate_round_trip_is_bit_exact(tmp_path):
    a, b = build(0), build(1)
    path = tmp_path / "model.npz"
    a.save(path)
    b.populate(path)
    for (na, va), (nb, vb) in zip(values(a).items(), values(b).items()):
        assert na == nb
        np.testing.assert_array_equal(va, vb)


def test_populate_mismatch_changes_nothing(tmp_path):
    a = build(0)
    path = tmp_path / "model.npz"
    a.save(path)
    other = dx.ParameterCollection(seed=2)
    other.add_parameters((3, 4), name="W")
    other.add_lookup_parameters((6, 2), name="E")  # shape differs
    before = values(other)
    with pytest.raises(ValueError, match="E.*shape"):
        other.populate(path)
    for k, v in values(other).items():
        np.testing.assert_array_equal(v, before[k])
    missing = dx.ParameterCollection(seed=3)
    missing.add_parameters((3, 4), name="W")
    missing.add_parameters((2,), name="extra")
    before = values(missing)
    with pytest.raises(ValueError, match="extra"):
        missing.populate(path)
    for k, v in values(missing).items():
        np.testing.assert_array_equal(v, before[k])


def test_truncated_or_corrupt_file_raises_clear_error(tmp_path):
    a = build(0)
    path = tmp_path / "model.npz"
    a.save(path)
    data = path.read_bytes()
    b = build(1)
    before = values(b)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        b.populate(path)
    path.write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        b.populate(path)
    for k, v in values(b).items():
        np.testing.assert_array_equal(v, before[k])


def _dropout_values(seed, strategy="agenda", p=0.5, n=4, train=True):
    dx.renew_cg(autobatch=strategy, seed=seed, train=train)
    x = dx.input(np.ones(64, np.float32))
    outs = [dx.dropout(x, p) for _ in range(n)]
    dx.forward(outs)
    return [o.npvalue() for o in outs]


def test_dropout_same_seed_same_mask_and_strategy_independent():
    a = _dropout_values(11)
    b = _dropout_values(11)
    c = _dropout_values(11, strategy="none")
    for x, y, z in zip(a, b, c):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)  # batching does not change the masks
    d = _dropout_values(12)
    assert any(not np.array_equal(x, y) for x, y in zip(a, d))


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_dropout_masks_are_strategy_independent_under_any_default_prng(impl):
    """The process's default PRNG (``jax_default_prng_impl``) does not change the masks: an
    rbg key's draws differ under vmap, and batched lanes drew other masks than ``none``."""
    import jax
    before = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", impl)
    try:
        masks = {}
        for strategy in ("none", "depth", "agenda"):
            dx.renew_cg(autobatch=strategy, seed=7)
            xs = [dx.dropout(dx.input(np.full(6, i + 1.0, np.float32)), 0.5) for i in range(3)]
            masks[strategy] = np.stack([x.npvalue() != 0 for x in xs])
    finally:
        jax.config.update("jax_default_prng_impl", before)
    np.testing.assert_array_equal(masks["none"], masks["depth"])
    np.testing.assert_array_equal(masks["none"], masks["agenda"])
    dx.renew_cg(seed=7)  # the same masks as under the default PRNG
    xs = [dx.dropout(dx.input(np.full(6, i + 1.0, np.float32)), 0.5) for i in range(3)]
    np.testing.assert_array_equal(masks["none"], np.stack([x.npvalue() != 0 for x in xs]))


def test_dropout_masks_differ_across_nodes_and_scale():
    vals = _dropout_values(5)
    assert not np.array_equal(vals[0], vals[1])
    for v in vals:
        assert set(np.unique(v)) <= {0.0, 2.0}


def test_dropout_identity_when_not_training_or_p_zero():
    for v in _dropout_values(5, train=False) + _dropout_values(5, p=0.0):
        np.testing.assert_array_equal(v, np.ones(64, np.float32))


def test_dropout_expectation():
    vals = np.concatenate(_dropout_values(3, p=0.3, n=64))
    assert abs(vals.mean() - 1.0) < 0.03  # 4096 draws: std of the mean ~0.01
