"""DyNet's convolution and pooling ops (dynax/ops/conv.py): values and gradients under every
strategy against plain JAX written independently (loops over filter offsets and windows,
not the ops' own lax calls), batching, images of different sizes in one graph, errors at
construction, and a tiny char-CNN that learns.

The value/gradient check is test_ops' own (its cases framework: N instances per graph,
a squared-distance loss to random targets, ``jax.value_and_grad`` of the same math); the
cases here live in this file's own list, so test_ops' tests are not collected twice.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from test_ops import STRATEGIES, TOL, Case, inp, instance_data, make_params, normal
from test_ops import test_value_and_grad as _check_value_and_grad  # not collected here

# ---- plain-JAX references -----------------------------------------------------------------------


def _out_and_pad(n, k, s, same):
    """TensorFlow's rule: output size, and the padding before (the rest goes after)."""
    if not same:
        return -(-(n - k + 1) // s), 0
    out = -(-n // s)
    return out, max((out - 1) * s + k - n, 0) // 2


def _windows(x, kh, kw, stride, same, fill):
    """For each filter offset (a, b): the (H', W', C) slice of the padded image it meets."""
    (H, W, _), (sh, sw) = x.shape, stride
    oh, ph = _out_and_pad(H, kh, sh, same)
    ow, pw = _out_and_pad(W, kw, sw, same)
    xp = jnp.pad(x, ((ph, kh + (oh - 1) * sh), (pw, kw + (ow - 1) * sw), (0, 0)),
                 constant_values=fill)
    return {(a, b): xp[a:a + (oh - 1) * sh + 1:sh, b:b + (ow - 1) * sw + 1:sw]
            for a in range(kh) for b in range(kw)}


def ref_conv(x, f, b=None, stride=(1, 1), same=False):
    """Cross-correlation: out[i, j, o] = sum_abc xpad[i sh + a, j sw + b, c] f[a, b, c, o]."""
    out = sum(jnp.einsum("ijc,co->ijo", win, f[a, b_])
              for (a, b_), win in _windows(x, f.shape[0], f.shape[1], stride, same, 0.0).items())
    return out if b is None else out + b[None, None, :]


def ref_maxpool(x, ksize, stride=(1, 1), same=False):
    wins = list(_windows(x, ksize[0], ksize[1], stride, same, -jnp.inf).values())
    out = wins[0]
    for w in wins[1:]:
        out = jnp.maximum(out, w)
    return out


def ref_kmax(x, k, d):
    """The k largest along d in their order: a stable argsort, not top_k."""
    order = jnp.argsort(-x, axis=d, stable=True)
    keep = jnp.sort(jax.lax.slice_in_dim(order, 0, k, axis=d), axis=d)
    return jnp.take_along_axis(x, keep, axis=d)


def ref_filter1d(x, f):
    """out[k, j] = sum over rows i and offsets a of x[i, j + a] f[i, a, k], column by column."""
    f3 = f if f.ndim == 3 else f[:, :, None]
    m = f.shape[1]
    return jnp.stack([jnp.einsum("ia,iak->k", x[:, j:j + m], f3)
                      for j in range(x.shape[1] - m + 1)], axis=1)


def ref_fold_rows(x, n):
    return jnp.stack([x[i * n:(i + 1) * n].sum(0) for i in range(x.shape[0] // n)])


def ref_kmh_ngram(x, n):
    return jnp.stack([x[:, j:j + n].sum(1) for j in range(x.shape[1] - n + 1)], axis=1)


# ---- cases --------------------------------------------------------------------------------------
# Shared shapes and parameters (a signature includes them): one image shape (5, 6, 2) with the
# parameter "I" added (so the input's gradient is checked, as test_ops' ``ev``), one filter
# bank "F" (3, 3, 2, 4) and one bias "b" (4,).

IMG = (5, 6, 2)
P_IMG = {"I": (IMG, "glorot")}
P_F = {"F": ((3, 3, 2, 4), "glorot")}
P_B = {"b": ((4,), "glorot")}
P_K = {"K": ((3, 5), "glorot")}
P_C = {"C": ((1, 3, 3, 4), "glorot"), "b": ((4,), "glorot")}  # a char-CNN's filters (emb 3)
LENGTHS = (5, 8, 5)  # per instance: two of one size (a batch), one alone

CASES = []


def case(name, params, data, build, ref):
    CASES.append(pytest.param(Case(name, params, data, build, ref), id=name))


def img_data(r, k):
    return {"x": normal(r, *IMG), "dF": normal(r, 3, 3, 2, 4)}


def ei(P, x):
    """An image expression depending on the parameter I: its gradient is the input's."""
    return inp(x) + P["I"]


case("conv2d_valid", {**P_IMG, **P_F}, img_data,
     lambda P, d: dx.conv2d(ei(P, d["x"]), P["F"]),
     lambda V, d: ref_conv(d["x"] + V["I"], V["F"]))
case("conv2d_same_stride21_dynet_order", {**P_IMG, **P_F}, img_data,
     lambda P, d: dx.conv2d(ei(P, d["x"]), P["F"], [2, 1], False),
     lambda V, d: ref_conv(d["x"] + V["I"], V["F"], stride=(2, 1), same=True))
case("conv2d_bias_valid_stride21", {**P_IMG, **P_F, **P_B}, img_data,
     lambda P, d: dx.conv2d(ei(P, d["x"]), P["F"], P["b"], (2, 1)),
     lambda V, d: ref_conv(d["x"] + V["I"], V["F"], V["b"], (2, 1)))
case("conv2d_bias_same_stride22", {**P_IMG, **P_F, **P_B}, img_data,
     lambda P, d: dx.conv2d_bias(ei(P, d["x"]), P["F"], P["b"], (2, 2), is_valid=False),
     lambda V, d: ref_conv(d["x"] + V["I"], V["F"], V["b"], (2, 2), same=True))
case("conv2d_filter_expression", {**P_IMG, **P_F}, img_data,  # per-instance filters
     lambda P, d: dx.conv2d(ei(P, d["x"]), P["F"] * inp(d["dF"]), stride=(1, 2)),
     lambda V, d: ref_conv(d["x"] + V["I"], V["F"] * d["dF"], stride=(1, 2)))
case("maxpooling2d_valid_stride22", P_IMG, img_data,
     lambda P, d: dx.maxpooling2d(ei(P, d["x"]), (2, 2), (2, 2)),
     lambda V, d: ref_maxpool(d["x"] + V["I"], (2, 2), (2, 2)))
case("maxpooling2d_same_stride21", P_IMG, img_data,
     lambda P, d: dx.maxpooling2d(ei(P, d["x"]), [3, 2], [2, 1], is_valid=False),
     lambda V, d: ref_maxpool(d["x"] + V["I"], (3, 2), (2, 1), same=True))
case("conv_then_maxpool", {**P_IMG, **P_F, **P_B}, img_data,
     lambda P, d: dx.maxpooling2d(dx.rectify(dx.conv2d(ei(P, d["x"]), P["F"], P["b"],
                                                       is_valid=False)), (2, 3), (2, 3)),
     lambda V, d: ref_maxpool(jax.nn.relu(ref_conv(d["x"] + V["I"], V["F"], V["b"],
                                                   same=True)), (2, 3), (2, 3)))
for _k, _d in ((3, 1), (2, 0), (5, 1)):
    case(f"kmax_pooling_matrix_k{_k}_d{_d}", P_K, lambda r, k: {"X": normal(r, 3, 5)},
         lambda P, d, k=_k, dd=_d: dx.kmax_pooling(inp(d["X"]) + P["K"], k, dd),
         lambda V, d, k=_k, dd=_d: ref_kmax(d["X"] + V["K"], k, dd))
case("kmax_pooling_default_d1", P_K, lambda r, k: {"X": normal(r, 3, 5)},
     lambda P, d: dx.kmax_pooling(inp(d["X"]) + P["K"], 2),
     lambda V, d: ref_kmax(d["X"] + V["K"], 2, 1))
case("kmax_pooling_vector", P_K, lambda r, k: {"X": normal(r, 3, 5)},
     lambda P, d: dx.kmax_pooling(dx.sum_dim(inp(d["X"]) + P["K"], 0), 3, d=0),
     lambda V, d: ref_kmax(jnp.sum(d["X"] + V["K"], 0), 3, 0))
# DyNet's 1-d ops of a dynamic CNN over a sentence matrix (3, 5)
P_G = {"G": ((3, 2), "glorot"), "H": ((3, 2, 4), "glorot"), "K4": ((4, 5), "glorot")}
case("filter1d_narrow_one_filter", {**P_K, **P_G}, lambda r, k: {"X": normal(r, 3, 5)},
     lambda P, d: dx.filter1d_narrow(inp(d["X"]) + P["K"], P["G"]),
     lambda V, d: ref_filter1d(d["X"] + V["K"], V["G"]))
case("filter1d_narrow_filter_bank", {**P_K, **P_G}, lambda r, k: {"X": normal(r, 3, 5)},
     lambda P, d: dx.filter1d_narrow(inp(d["X"]) + P["K"], P["H"]),
     lambda V, d: ref_filter1d(d["X"] + V["K"], V["H"]))
case("fold_rows_2_then_kmh_ngram_3", {**P_G}, lambda r, k: {"X": normal(r, 4, 5)},
     lambda P, d: dx.kmh_ngram(dx.fold_rows(inp(d["X"]) * P["K4"]), 3),
     lambda V, d: ref_kmh_ngram(ref_fold_rows(d["X"] * V["K4"], 2), 3))
case("fold_rows_4_kmh_ngram_whole_sentence", {**P_G}, lambda r, k: {"X": normal(r, 4, 5)},
     lambda P, d: dx.kmh_ngram(dx.fold_rows(inp(d["X"]) * P["K4"], 4), 5),
     lambda V, d: ref_kmh_ngram(ref_fold_rows(d["X"] * V["K4"], 4), 5))
# sentences of different lengths as (1, T, emb) images: different signatures in one graph,
# reduced over time to vectors of one shape, which batch again
case("char_cnn_different_lengths", P_C,
     lambda r, k: {"x": normal(r, 1, LENGTHS[k], 3)},
     lambda P, d: dx.max_dim(dx.rectify(dx.conv2d(inp(d["x"]), P["C"], P["b"])), [0, 1]),
     lambda V, d: jnp.max(jax.nn.relu(ref_conv(d["x"], V["C"], V["b"])), axis=(0, 1)))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("c", CASES)
def test_value_and_grad(c, strategy):
    """Values of each instance and the gradients of every parameter (the image parameter's
    is the input's) against ``jax.value_and_grad`` of the plain-JAX math."""
    _check_value_and_grad(c, strategy)


def test_different_sizes_are_different_signatures():
    """Images of different sizes run in separate batches, each size's instances together,
    and each instance's value is its own."""
    P, V = make_params(CASES[-1].values[0])
    datas = instance_data(CASES[-1].values[0])
    cg = dx.renew_cg(autobatch="agenda")
    convs = [dx.conv2d(inp(d["x"]), P["C"], P["b"]) for d in datas]
    dx.forward(convs)
    assert [c.shape for c in convs] == [(1, T - 2, 4) for T in LENGTHS]
    assert cg.stats()["batches"] == len(set(LENGTHS))
    for c, d in zip(convs, datas):
        np.testing.assert_allclose(c.npvalue(), ref_conv(d["x"], V["C"], V["b"]), **TOL)


def test_agenda_batches_convolutions():
    """Several same-shape conv nodes (and the ops around them): "agenda" and "depth" launch
    fewer batches than "none", one per signature and depth here."""
    P, V = make_params(CASES[2].values[0])
    r = np.random.default_rng(1)
    xs = [normal(r, *IMG) for _ in range(5)]
    stats, values = {}, {}
    for strategy in STRATEGIES:
        cg = dx.renew_cg(autobatch=strategy)
        outs = [dx.conv2d(ei(P, x), P["F"], P["b"], (2, 1)) for x in xs]
        dx.forward(outs)
        stats[strategy], values[strategy] = cg.stats(), [o.npvalue() for o in outs]
    assert stats["none"]["nodes"] == stats["agenda"]["nodes"] == 10
    assert stats["none"]["batches"] == 10
    assert stats["agenda"]["batches"] == stats["depth"]["batches"] == 2
    for s in ("depth", "agenda"):
        for a, b in zip(values[s], values["none"]):
            np.testing.assert_allclose(a, b, **TOL)


# ---- errors at construction ---------------------------------------------------------------------


def test_failed_call_removes_its_array_constant():
    """An array argument becomes a constant of the graph; a refused call removes it again."""
    P, _ = make_params(Case("errors", P_F, None, None, None))
    cg = dx.renew_cg()
    n = cg.stats()["values"]
    with pytest.raises(dx.ShapeError):
        dx.conv2d(_ones(5, 6, 3), P["F"], (1, 1))
    with pytest.raises(dx.ShapeError):
        dx.maxpooling2d(_ones(5, 6), (2, 2))
    assert cg.stats()["values"] == n


def _ones(*shape):
    return np.ones(shape, np.float32)


def test_1d_ops_refuse_bad_shapes_and_arguments():
    """The DCNN ops name themselves and the shapes; nothing is left in the graph."""
    cg = dx.renew_cg()
    x, v = dx.input(_ones(3, 5)), dx.input(_ones(5))
    n = cg.stats()["values"]
    for call, match in [
            (lambda: dx.filter1d_narrow(x, _ones(2, 2)),
             r"filter1d_narrow: .*\(3, 5\) and \(2, 2\)"),
            (lambda: dx.filter1d_narrow(x, _ones(3, 6)), r"with m <= T, got shapes \(3, 5\)"),
            (lambda: dx.filter1d_narrow(v, _ones(5, 1)), "filter1d_narrow"),
            (lambda: dx.fold_rows(x, 2),
             r"fold_rows: .*rows divide by nrows=2, got shape \(3, 5\)"),
            (lambda: dx.fold_rows(x, 0), "nrows=0"),
            (lambda: dx.kmh_ngram(x, 6), r"kmh_ngram: .*at least n=6 columns .*\(3, 5\)"),
            (lambda: dx.kmh_ngram(x, 0), "n=0"),
            (lambda: dx.kmh_ngram(v, 2), r"got shape \(5,\)")]:
        with pytest.raises(dx.ShapeError, match=match):
            call()
    with pytest.raises(ValueError, match="kmh_ngram"):
        dx.kmh_ngram(x, 2.5)
    assert cg.stats()["values"] == n  # the array filters' constants were removed again


ERRORS = [
    ("channel_mismatch", dx.ShapeError, "conv2d", ("(5, 6, 3)", "(3, 3, 2, 4)"),
     lambda P: dx.conv2d(inp(_ones(5, 6, 3)), P["F"])),
    ("channel_mismatch_array_image", dx.ShapeError, "conv2d", ("(5, 6, 3)", "(3, 3, 2, 4)"),
     lambda P: dx.conv2d(_ones(5, 6, 3), P["F"], (1, 1))),
    ("filter_larger_than_image", dx.ShapeError, "conv2d", ("(2, 6, 2)", "(3, 3, 2, 4)"),
     lambda P: dx.conv2d(inp(_ones(2, 6, 2)), P["F"])),
    ("image_not_3d", dx.ShapeError, "conv2d", ("(5, 6)",),
     lambda P: dx.conv2d(inp(_ones(5, 6)), P["F"])),
    ("filters_not_4d", dx.ShapeError, "conv2d", ("(3, 3, 2)",),
     lambda P: dx.conv2d(inp(_ones(*IMG)), inp(_ones(3, 3, 2)))),
    ("bias_shape", dx.ShapeError, "conv2d_bias", ("(3,)", "(4,)"),
     lambda P: dx.conv2d_bias(inp(_ones(*IMG)), P["F"], inp(_ones(3)), (1, 1))),
    ("stride_zero", dx.InvalidArgumentError, "conv2d", ("stride", "(0, 1)"),
     lambda P: dx.conv2d(inp(_ones(*IMG)), P["F"], stride=(0, 1))),
    ("stride_three_ints", dx.InvalidArgumentError, "conv2d_bias", ("stride",),
     lambda P: dx.conv2d(inp(_ones(*IMG)), P["F"], P["b"], (1, 1, 1))),
    ("stride_float", dx.InvalidArgumentError, "maxpooling2d", ("stride",),
     lambda P: dx.maxpooling2d(inp(_ones(*IMG)), (2, 2), (1.5, 1))),
    ("is_valid_not_bool", dx.InvalidArgumentError, "conv2d", ("is_valid",),
     lambda P: dx.conv2d(inp(_ones(*IMG)), P["F"], (1, 1), "same")),
    ("stride_twice", dx.InvalidArgumentError, "conv2d", ("stride",),
     lambda P: dx.conv2d(inp(_ones(*IMG)), P["F"], (1, 1), (2, 2))),
    ("pool_window_larger", dx.ShapeError, "maxpooling2d", ("(6, 2)", "(5, 6, 2)"),
     lambda P: dx.maxpooling2d(inp(_ones(*IMG)), (6, 2))),
    ("pool_not_3d", dx.ShapeError, "maxpooling2d", ("(5, 6)",),
     lambda P: dx.maxpooling2d(inp(_ones(5, 6)), (2, 2))),
    ("kmax_k_too_large", dx.IndexOutOfRangeError, "kmax_pooling", ("k=6", "(3, 5)"),
     lambda P: dx.kmax_pooling(inp(_ones(3, 5)), 6)),
    ("kmax_k_zero", dx.IndexOutOfRangeError, "kmax_pooling", ("k=0",),
     lambda P: dx.kmax_pooling(P["K"], 0, d=0)),
    ("kmax_d_out_of_range", dx.IndexOutOfRangeError, "kmax_pooling", ("dimension 2",),
     lambda P: dx.kmax_pooling(inp(_ones(3, 5)), 1, d=2)),
    ("kmax_vector_default_d", dx.IndexOutOfRangeError, "kmax_pooling", ("d=0", "(5,)"),
     lambda P: dx.kmax_pooling(inp(_ones(5)), 2)),
    ("kmax_not_matrix", dx.ShapeError, "kmax_pooling", ("(5, 6, 2)",),
     lambda P: dx.kmax_pooling(inp(_ones(*IMG)), 2, 0)),
    ("kmax_k_not_int", dx.InvalidArgumentError, "kmax_pooling", ("k",),
     lambda P: dx.kmax_pooling(inp(_ones(3, 5)), 2.0)),
]


@pytest.mark.parametrize("name, cls, opname, parts, call", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(name, cls, opname, parts, call):
    """The right error class, naming the op, the shapes and the user's line; the failed call
    adds nothing to the graph, which stays usable."""
    P, V = make_params(Case("errors", {**P_F, **P_B, **P_K}, None, None, None))
    cg = dx.renew_cg()
    x = normal(np.random.default_rng(0), *IMG)
    before = dx.conv2d(inp(x), P["F"])
    n = cg.stats()["nodes"]
    with pytest.raises(cls) as err:
        call(P)
    msg = str(err.value)
    assert re.search(rf"\b{opname}\b", msg), msg
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    assert re.search(rf"{re.escape(__file__)}:\d+", msg), msg
    assert cg.stats()["nodes"] == n
    after = dx.conv2d(inp(x), P["F"], P["b"])
    np.testing.assert_allclose(before.npvalue(), ref_conv(x, V["F"]), **TOL)
    np.testing.assert_allclose(after.npvalue(), ref_conv(x, V["F"], V["b"]), **TOL)


# ---- a tiny char-CNN learns ---------------------------------------------------------------------

VOCAB, EMB, CH = 6, 3, 4


def _dataset():
    """Label 1 iff the sentence holds the char 0; sentences of lengths 4 to 7."""
    r = np.random.default_rng(5)
    data = []
    for i in range(8):
        s = list(r.integers(1, VOCAB, size=4 + i % 4))
        if i % 2:
            s[int(r.integers(len(s)))] = 0
        data.append((s, i % 2))
    return data


def _model():
    pc = dx.ParameterCollection(seed=3)
    return pc, {"E": pc.add_lookup_parameters((VOCAB, EMB)),
                "C": pc.add_parameters((1, 3, EMB, CH)), "cb": pc.add_parameters((CH,)),
                "W": pc.add_parameters((2, CH)), "wb": pc.add_parameters((2,))}


def _loss(M, data):
    losses = []
    for s, y in data:
        img = dx.reshape(dx.concatenate([M["E"][c] for c in s]), (1, len(s), EMB))
        h = dx.max_dim(dx.rectify(dx.conv2d(img, M["C"], M["cb"], (1, 1), False)), [0, 1])
        losses.append(dx.pickneglogsoftmax(M["W"] @ h + M["wb"], y))
    return dx.esum(losses) / len(data)


def _step(pc, M, trainer, strategy, data):
    dx.renew_cg(autobatch=strategy)
    loss = _loss(M, data)
    value = loss.scalar_value()
    loss.backward()
    trainer.update()
    return value


def test_char_cnn_learns():
    data = _dataset()
    pc, M = _model()
    trainer = dx.AdamTrainer(pc, alpha=0.05)
    losses = [_step(pc, M, trainer, "agenda", data) for _ in range(40)]
    assert losses[0] > 0.5  # the untrained model is far from right
    assert losses[-1] < 0.3 * losses[0], losses


def test_char_cnn_one_update_agenda_equals_none():
    """The same model and data: the loss, and the loss after one update, agree under "none"
    and "agenda"."""
    data = _dataset()
    results = {}
    for strategy in ("none", "agenda"):
        pc, M = _model()
        trainer = dx.SimpleSGDTrainer(pc, learning_rate=0.5)
        first = _step(pc, M, trainer, strategy, data)
        dx.renew_cg(autobatch=strategy)
        results[strategy] = (first, _loss(M, data).scalar_value())
    np.testing.assert_allclose(results["agenda"], results["none"], rtol=1e-5, atol=1e-6)
    assert results["none"][1] < results["none"][0]
