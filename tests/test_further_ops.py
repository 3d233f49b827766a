"""Ops beyond API.md, as DyNet has them.

* Random ops (``dx.random_normal``, ``random_bernoulli``, ``random_uniform``,
  ``random_gumbel``): seeded by the graph and the node (the same draws under every
  strategy), distributed as named, and differentiable through the reparameterisation
  ``mu + sigma * eps`` (checked against ``jax.grad`` with the same draws).
* The ops of ``dynax/ops/extra.py``: their argument checks (their values and gradients are
  cases of ``tests/test_ops.py``).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx

STRATEGIES = ("none", "depth", "agenda")
OPS = {
    "normal": lambda shape: dx.random_normal(shape, 0.5, 2.0),
    "bernoulli": lambda shape: dx.random_bernoulli(shape, 0.3, 4.0),
    "uniform": lambda shape: dx.random_uniform(shape, -1.0, 3.0),
    "gumbel": lambda shape: dx.random_gumbel(shape, 1.0, 2.0),
}


def _draws(strategy, seed=7):
    cg = dx.renew_cg(autobatch=strategy, seed=seed)
    es = {k: [make(3), make(3), make((2, 3))] for k, make in OPS.items()}
    dx.forward([e for v in es.values() for e in v])
    return cg, {k: [e.npvalue() for e in v] for k, v in es.items()}


def test_draws_are_seeded_by_graph_and_node_and_batching_changes_nothing():
    _, ref = _draws("none")
    for strategy in ("depth", "agenda"):
        cg, got = _draws(strategy)
        for k in OPS:
            for a, b in zip(ref[k], got[k], strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{k} {strategy}")
        if strategy == "agenda":  # 4 ops x 2 shapes
            assert cg.stats()["batches"] == 8 < cg.stats()["nodes"]
    for k in OPS:  # two nodes of one graph draw differently
        assert not np.array_equal(ref[k][0], ref[k][1]), k
    _, other = _draws("agenda", seed=8)
    assert not np.array_equal(other["normal"][0], ref["normal"][0])
    dx.renew_cg(train=False, seed=7)  # random in evaluation graphs too, as DyNet's
    np.testing.assert_array_equal(OPS["normal"](3).npvalue(), ref["normal"][0])


def test_distributions():
    n = 40_000
    dx.renew_cg(seed=1)
    normal = dx.random_normal(n, 0.5, 2.0).npvalue()
    bern = dx.random_bernoulli((n,), 0.3, 4.0).npvalue()
    unif = dx.random_uniform(n, -1.0, 3.0).npvalue()
    gumbel = dx.random_gumbel(n, 1.0, 2.0).npvalue()
    assert abs(normal.mean() - 0.5) < 0.05 and abs(normal.std() - 2.0) < 0.05
    assert set(np.unique(bern)) == {0.0, 4.0} and abs((bern > 0).mean() - 0.3) < 0.01
    assert unif.min() >= -1.0 and unif.max() < 3.0 and abs(unif.mean() - 1.0) < 0.03
    euler = 0.5772156649
    assert abs(gumbel.mean() - (1.0 + 2.0 * euler)) < 0.05
    assert abs(gumbel.std() - 2.0 * np.pi / np.sqrt(6)) < 0.06
    assert all(v.dtype == np.float32 for v in (normal, bern, unif, gumbel))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reparameterised_sample_gradients(strategy):
    """loss = sum over instances of ||mu + exp(log_sigma) * eps_i - target_i||^2."""
    pc = dx.ParameterCollection(seed=0)
    mu = pc.add_parameters((3,), init="normal")
    log_sigma = pc.add_parameters((3,), init="normal")
    targets = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    dx.renew_cg(autobatch=strategy, seed=3)
    eps = [dx.random_normal(3) for _ in targets]
    losses = [dx.squared_distance(mu + dx.cmult(dx.exp(log_sigma), e), dx.input(t))
              for e, t in zip(eps, targets)]
    loss = dx.esum(losses)
    loss.backward()
    e = np.stack([x.npvalue() for x in eps])

    def ref(m, s):
        return jnp.sum((m[None] + jnp.exp(s)[None] * e - targets) ** 2)

    want = ref(mu.value, log_sigma.value)
    gm, gs = jax.grad(ref, argnums=(0, 1))(mu.value, log_sigma.value)
    np.testing.assert_allclose(loss.scalar_value(), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(mu.grad), np.asarray(gm), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(log_sigma.grad), np.asarray(gs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call, match", [
    (lambda: dx.random_normal((3, 0)),
     r"random_normal: the shape must be an int or a sequence of ints >= 1, got \(3, 0\)"),
    (lambda: dx.random_normal("3"), r"random_normal: the shape"),
    (lambda: dx.random_normal(3, stddev=-1.0), r"random_normal: stddev .* of at least 0.0"),
    (lambda: dx.random_normal(3, mean=float("nan")), r"random_normal: mean must be a finite"),
    (lambda: dx.random_bernoulli(3, 1.5), r"random_bernoulli: p .* in \[0.0, 1.0\], got 1.5"),
    (lambda: dx.random_bernoulli(3, True), r"random_bernoulli: p"),
    (lambda: dx.random_uniform(3, 2.0, 1.0), r"random_uniform: right .* at least 2.0"),
    (lambda: dx.random_gumbel(3, beta=0.0), r"random_gumbel: beta .* above 0.0, got 0.0"),
])
def test_bad_arguments_are_clear_errors_that_add_nothing(call, match):
    cg = dx.renew_cg()
    with pytest.raises(dx.InvalidArgumentError, match=match):
        call()
    assert cg.stats()["nodes"] == 0


@pytest.mark.parametrize("call, error, match", [
    (lambda x: dx.max_dim(x, 2), dx.IndexOutOfRangeError,
     r"max_dim: dimension 2 is out of range for shape \(2, 3\)"),
    (lambda x: dx.sum_dim(x, [0, 0]), dx.InvalidArgumentError, r"sum_dim: d repeats"),
    (lambda x: dx.mean_dim(x, 0.5), dx.InvalidArgumentError, r"mean_dim: d must be an int"),
    (lambda x: dx.pick_range(x, 2, 2, 1), dx.IndexOutOfRangeError,
     r"pick_range: range \[2, 2\) is empty or outside \[0, 3\) along dimension 1"),
    (lambda x: dx.pick_range(x, 0, 4, 1), dx.IndexOutOfRangeError, r"pick_range: range"),
    (lambda x: dx.pick_range(x, 0, 1, 2), dx.IndexOutOfRangeError, r"pick_range: dimension 2"),
    (lambda x: dx.pick_range(x, 0.0, 1), dx.InvalidArgumentError, r"pick_range: start"),
    (lambda x: dx.elu(x, "a"), dx.InvalidArgumentError, r"elu: alpha must be a number"),
    (lambda x: dx.leaky_relu(x, None), dx.InvalidArgumentError,
     r"leaky_relu: negative_slope must be a number"),
    (lambda x: dx.l1_distance(x, np.ones(3, np.float32)), dx.ShapeError,
     r"l1_distance: all arguments must have the same shape, got \(2, 3\), \(3,\)"),
    (lambda x: dx.bmax(x, np.ones(3, np.float32)), dx.ShapeError, r"bmax: shapes"),
    (lambda x: dx.select_rows(x, [0, 2]), dx.IndexOutOfRangeError,
     r"select_rows: index 2 out of range \[0, 2\) for shape \(2, 3\)"),
    (lambda x: dx.select_cols(x, []), dx.InvalidArgumentError, r"select_cols: expected a "
                                                                r"non-empty list of ints"),
    (lambda x: dx.colwise_add(x, np.ones(3, np.float32)), dx.ShapeError,
     r"colwise_add: expected a matrix \(n, m\) and a vector \(n,\), got \(2, 3\) and \(3,\)"),
    (lambda x: dx.logsumexp([x, 1.0]), dx.ArgumentTypeError,
     r"logsumexp: list items must be Expressions, Parameters or arrays, got float 1.0"),
    (lambda x: dx.esum([x, "a"]), dx.ArgumentTypeError,
     r"esum: list items must be Expressions, Parameters or arrays, got str 'a'"),
    (lambda x: dx.logsumexp([]), dx.InvalidArgumentError, r"logsumexp: empty list"),
    (lambda x: dx.noise(x, -1.0), dx.InvalidArgumentError, r"noise: stddev must be"),
    (lambda x: x * np.ones(3, np.float32), dx.ShapeError,
     r"cmult: .*`\*` multiplies elementwise here .* is `W @ x`"),
    (lambda x: x * np.ones((3, 4), np.float32), dx.ShapeError,  # a matrix product, too
     r"cmult: .*got \(2, 3\), \(3, 4\); `\*` multiplies elementwise here .* is `W @ x`"),
    (lambda x: dx.inputVector(np.ones((2, 2))), dx.ShapeError, r"inputVector: expected a vector"),
    (lambda x: dx.inputTensor(np.ones(2), batched=True), dx.InvalidArgumentError,
     r"inputTensor: batched=True"),
    (lambda x: dx.scalarInput("a"), dx.DTypeError, r"scalarInput: expected a number"),
    (lambda x: dx.softmax(np.ones((2, 2, 2), np.float32)), dx.ShapeError,
     r"softmax: expected 1 or 2 dimensions, got shape \(2, 2, 2\)"),
    (lambda x: dx.round(x, "straight"), dx.InvalidArgumentError,
     r"round: gradient_mode must be one of \('zero_gradient', 'straight_through_gradient'\)"),
    (lambda x: dx.argmax(x), dx.ShapeError, r"argmax: expected a vector, got shape \(2, 3\)"),
    (lambda x: dx.moment_elems(x, 0), dx.InvalidArgumentError, r"moment_elems: the order r"),
    (lambda x: dx.std_dim(x, 2), dx.IndexOutOfRangeError, r"std_dim: dimension 2"),
    (lambda x: dx.cumsum(x, -1), dx.IndexOutOfRangeError, r"cumsum: dimension -1"),
    (lambda x: dx.layer_norm(np.ones(3, np.float32), np.ones(2, np.float32),
                             np.ones(3, np.float32)), dx.ShapeError,
     r"layer_norm: all arguments must have the same shape"),
    (lambda x: dx.weight_norm(x, np.ones(2, np.float32)), dx.ShapeError,
     r"weight_norm: expected a scalar gain \(shape \(\) or \(1,\)\), got shape \(2,\)"),
    (lambda x: dx.constant((2, -1), 1.0), dx.InvalidArgumentError,
     r"constant: the shape must be an int or a sequence of ints >= 0, got \(2, -1\)"),
    (lambda x: dx.zeroes(2.5), dx.InvalidArgumentError, r"zeroes: the shape must be"),
    (lambda x: dx.zeros(None), dx.InvalidArgumentError, r"zeros: the shape must be"),
    (lambda x: dx.ones([2, True]), dx.InvalidArgumentError, r"ones: the shape must be"),
    (lambda x: dx.sparsemax(x), dx.ShapeError, r"sparsemax: expected a vector"),
    (lambda x: dx.huber_distance(x, 1.0), dx.ArgumentTypeError,
     r"huber_distance: expected an Expression or Parameter"),
    (lambda x: dx.huber_distance(x, x, c=-1.0), dx.InvalidArgumentError, r"huber_distance: c"),
    (lambda x: dx.pairwise_rank_loss(x, np.ones(3, np.float32)), dx.ShapeError,
     r"pairwise_rank_loss: all arguments must have the same shape"),
    (lambda x: dx.poisson_loss(np.zeros((), np.float32), -1), dx.InvalidArgumentError,
     r"poisson_loss: x must be a non-negative int below 2\*\*31 - 1 \(an int32 count\), "
     r"got -1"),
    (lambda x: dx.poisson_loss(np.zeros((), np.float32), 2**31), dx.InvalidArgumentError,
     r"poisson_loss: x must be a non-negative int below 2\*\*31 - 1 .*got 2147483648"),
    (lambda x: dx.poisson_loss(x, 1), dx.ShapeError, r"poisson_loss: expected a scalar"),
    (lambda x: dx.inverse(x), dx.ShapeError,
     r"inverse: expected a square matrix, got shape \(2, 3\)"),
    (lambda x: dx.logdet(np.ones(3, np.float32)), dx.ShapeError,
     r"logdet: expected a square matrix"),
    (lambda x: dx.trace_of_product(x, np.ones((3, 2), np.float32)), dx.ShapeError,
     r"trace_of_product: expected two matrices of one shape, got \(2, 3\) and \(3, 2\)"),
    (lambda x: dx.contract3d_1d(x, np.ones(3, np.float32)), dx.ShapeError,
     r"contract3d_1d: expected a 3-d tensor \(i, j, k\) and a vector \(k,\)"),
    (lambda x: dx.contract3d_1d_bias(np.ones((2, 3, 4), np.float32), np.ones(4, np.float32),
                                     np.ones(3, np.float32)), dx.ShapeError,
     r"contract3d_1d_bias: the bias must have shape \(2, 3\), got \(3,\)"),
    (lambda x: dx.circ_conv(np.ones(3, np.float32), np.ones(2, np.float32)), dx.ShapeError,
     r"circ_conv: all arguments must have the same shape"),
    (lambda x: dx.circ_corr(x, x), dx.ShapeError, r"circ_corr: expected a vector"),
    (lambda x: dx.constant(3, "a"), dx.InvalidArgumentError, r"constant: value must be"),
    # DyNet's shapes and arguments (session 23)
    (lambda x: x + np.ones(2, np.float32), dx.ShapeError,
     r"add: shapes must be equal, or of one rank with each dimension equal or 1 on one side "
     r"\(broadcast\), or one a scalar; got \(2, 3\), \(2,\); a vector is not broadcast "
     r"against a matrix .* dx.colwise_add"),
    (lambda x: x - np.ones((3, 3), np.float32), dx.ShapeError,
     r"sub: shapes must be equal, .* got \(2, 3\), \(3, 3\) \[at "),  # and no hint
    (lambda x: dx.concatenate_cols([x, np.ones(3, np.float32)]), dx.ShapeError,
     r"concatenate_cols: the items must have the same number of rows, got shapes "
     r"\[\(2, 3\), \(3,\)\]"),
    (lambda x: dx.concatenate_cols([np.ones((2, 2, 2), np.float32)]), dx.ShapeError,
     r"concatenate_cols: expected scalars, vectors or matrices"),
    (lambda x: dx.concatenate_cols([]), dx.InvalidArgumentError, r"concatenate_cols"),
    (lambda x: dx.pick(x, 3, 1), dx.IndexOutOfRangeError,
     r"pick: index 3 out of range \[0, 3\) along dim 1 of shape \(2, 3\)"),
    (lambda x: dx.pick(x, np.int64(3), 1), dx.IndexOutOfRangeError,  # the general check
     r"pick: index 3 out of range \[0, 3\)"),
    (lambda x: dx.pick(x, 0, 2), dx.ShapeError, r"pick: dim 2 invalid for shape \(2, 3\)"),
    (lambda x: dx.pick(x, 0, 1.0), dx.InvalidArgumentError, r"pick: dim must be an int"),
    (lambda x: dx.log_softmax(x, [0]), dx.ShapeError,
     r"log_softmax: restrict needs a vector, got shape \(2, 3\)"),
    (lambda x: dx.log_softmax(np.ones((6, 1), np.float32), [0]), dx.ShapeError,  # a column
     r"restrict needs a vector, got shape \(6, 1\); DyNet treats a \(6, 1\) column as"),
    (lambda x: dx.log_softmax(np.ones(3, np.float32), [1, 3]), dx.IndexOutOfRangeError,
     r"log_softmax: restrict index 3 out of range \[0, 3\)"),
    (lambda x: dx.log_softmax(np.ones(3, np.float32), []), dx.InvalidArgumentError,
     r"log_softmax: restrict must be a non-empty list of ints"),
    (lambda x: x[-3], dx.IndexOutOfRangeError, r"pick: index -3 out of range \[0, 2\)"),
    (lambda x: x[::2], dx.InvalidArgumentError, r"slice: only a step of 1 is supported"),
    (lambda x: x[0.5:], dx.ArgumentTypeError, r"slice: bounds must be ints or None"),
    (lambda x: x[1:1], dx.IndexOutOfRangeError,
     r"slice: \[1:1\] of shape \(2, 3\) is empty \(its bounds clip to \[1, 1\)\)"),
    (lambda x: x[7:9], dx.IndexOutOfRangeError,  # Python's clipping made it [2, 2)
     r"slice: \[7:9\] of shape \(2, 3\) is empty \(its bounds clip to \[2, 2\)\)"),
    (lambda x: dx.transpose(x, [0, 0]), dx.ShapeError,
     r"transpose: dims \[0, 0\] are not a permutation of the 2 dimensions of shape \(2, 3\)"),
    (lambda x: dx.transpose(x, "ab"), dx.ArgumentTypeError, r"transpose: dims must be a list"),
    (lambda x: dx.sum_cols(np.ones(3, np.float32)), dx.ShapeError,
     r"sum_cols: expected a matrix, got shape \(3,\)"),
    (lambda x: dx.dropout_dim(x, 2, 0.5), dx.ShapeError,
     r"dropout_dim: dimension 2 is out of range for shape \(2, 3\)"),
    (lambda x: dx.dropout_dim(x, 0, 1.0), dx.InvalidArgumentError,
     r"dropout_dim: p must be a number in \[0, 1\), got 1.0"),
    (lambda x: dx.block_dropout(x, -0.1), dx.InvalidArgumentError, r"block_dropout: p must be"),
    (lambda x: dx.softmax(x, 2), dx.ShapeError, r"softmax: d=2 needs a matrix and d in"),
    (lambda x: dx.softmax(np.ones(3, np.float32), 1), dx.ShapeError, r"softmax: d=1 needs a"),
    (lambda x: dx.average_cols(np.ones(3, np.float32)), dx.ShapeError, r"average_cols: expec"),
    (lambda x: dx.scale_gradient(x, "a"), dx.InvalidArgumentError,
     r"scale_gradient: lambd must be a finite number"),
    (lambda x: dx.silu(x, float("inf")), dx.InvalidArgumentError, r"silu: beta must be"),
    (lambda x: dx.sparsemax_loss(x, [0]), dx.ShapeError, r"sparsemax_loss: expected a vector"),
    (lambda x: dx.affine_transform([np.ones(3, np.float32), np.ones((2, 2), np.float32),
                                    np.ones((2, 4), np.float32)]), dx.ShapeError,
     r"affine_transform: bias \(3,\) does not fit the products' shape \(2, 4\)"),
    (lambda x: dx.affine_transform([np.ones(2, np.float32), x, np.ones(4, np.float32)]),
     dx.ShapeError, r"affine_transform: term 0: W\(2, 3\) @ x\(4,\) is not a matrix-vector"),
    (lambda x: dx.affine_transform([np.ones(2, np.float32), x, np.ones(3, np.float32), x,
                                    np.ones((3, 2), np.float32)]), dx.ShapeError,
     r"affine_transform: term 1: W\(2, 3\) @ x\(3, 2\) has shape \(2, 2\), the terms "
     r"before \(2,\)"),
    # DyNet's {n} = {n, 1} and {1} = (): the errors say how to convert
    (lambda x: dx.concatenate([np.ones((3, 1), np.float32), np.ones(2, np.float32)]),
     dx.ShapeError, r"concatenate: shapes \[\(3, 1\), \(2,\)\] differ outside axis 0; "
                    r"DyNet treats a \(3, 1\) column as the vector \(3,\), dynax \(as NumPy\) "
                    r"does not: dx.reshape\(x, \(3,\)\) makes it one"),
    (lambda x: dx.pickneglogsoftmax(np.ones((3, 1), np.float32), 0), dx.ShapeError,
     r"pickneglogsoftmax: expected a vector, got shape \(3, 1\); DyNet treats a \(3, 1\)"),
    (lambda x: dx.squared_distance(np.ones((3, 1), np.float32), np.ones(3, np.float32)),
     dx.ShapeError, r"squared_distance: .*; DyNet treats a \(3, 1\) column as the vector"),
    (lambda x: dx.esum([np.ones((), np.float32), np.ones(1, np.float32)]), dx.ShapeError,
     r"esum: .* item 0 has shape \(\), item 1 has \(1,\); DyNet treats a scalar \(\) and "
     r"a 1-vector \(1,\) alike"),
    (lambda x: dx.sum_dim(x, [1], True), dx.InvalidArgumentError,
     r"sum_dim: b=True reduces DyNet's batch dimension, which dynax does not have"),
    (lambda x: dx.mean_dim(x, [1], False, 4), dx.InvalidArgumentError,
     r"mean_dim: n \(DyNet's sample count\) is not supported, got 4"),
    (lambda x: dx.std_dim(x, [1], 1), dx.InvalidArgumentError, r"std_dim: b=True"),
    (lambda x: dx.sparsemax_loss(np.ones(3, np.float32), [3]), dx.IndexOutOfRangeError,
     r"sparsemax_loss: target index 3 out of range \[0, 3\)"),
    (lambda x: dx.sparsemax_loss(np.ones(3, np.float32), []), dx.InvalidArgumentError,
     r"sparsemax_loss: target_support must be a non-empty list of ints"),
])
def test_further_ops_check_their_arguments(call, error, match):
    """The ops of dynax/ops/extra.py (values and gradients: tests/test_ops.py) fail at
    construction, naming themselves, and leave the graph as it was."""
    cg = dx.renew_cg()
    x = dx.input(np.zeros((2, 3), np.float32))
    before = cg.stats()["nodes"], len(cg.val_node)
    with pytest.raises(error, match=match):
        call(x)
    assert (cg.stats()["nodes"], len(cg.val_node)) == before


@pytest.mark.parametrize("shapes, match", [
    (((), (3,)), r"item 0 has shape \(\), item 1 has \(3,\)"),
    (((3,), (3,), ()), r"item 0 has shape \(3,\), item 2 has \(\)"),
    (((3,), (2,)), r"item 0 has shape \(3,\), item 1 has \(2,\)"),
])
def test_logsumexp_refuses_items_of_different_shapes(shapes, match):
    """A scalar among vectors was once concatenated with them and reduced to one scalar:
    refused, as DyNet does, naming the first item that differs; nothing is added."""
    cg = dx.renew_cg()
    xs = [dx.input(np.ones(s, np.float32)) for s in shapes]
    before = cg.stats()["nodes"], len(cg.val_node)
    with pytest.raises(dx.ShapeError, match="logsumexp: all items must have the same shape; "
                       + match):
        dx.logsumexp(xs)
    assert (cg.stats()["nodes"], len(cg.val_node)) == before


def test_random_ops_refuse_a_dx_function_body_and_huge_shapes():
    """Inside a @dx.function's body a random op would add a node to the graph while the body
    is traced: refused, naming the op and what to do, and nothing is added. A shape XLA
    cannot index is refused at construction (it used to fail the whole graph later)."""
    @dx.function
    def noisy(x):
        return x + dx.random_normal(3)

    @dx.function
    def tanh_inside(x):
        return dx.tanh(x)

    cg = dx.renew_cg()
    x = dx.input(np.ones(3, np.float32))
    before = cg.stats()["nodes"], len(cg.val_node)
    with pytest.raises(dx.ArgumentTypeError, match="random_normal: dynax ops build graph "
                                                   "nodes.*jax.random"):
        noisy(x)
    with pytest.raises(dx.ArgumentTypeError, match="tanh: dynax ops build graph nodes"):
        tanh_inside(x)
    with pytest.raises(dx.InvalidArgumentError, match=r"random_uniform: shape \(100000, "
                                                      r"100000\) has more than 2147483647"):
        dx.random_uniform((100000, 100000), 0.0, 1.0)
    assert (cg.stats()["nodes"], len(cg.val_node)) == before
    np.testing.assert_allclose((x * 2.0).npvalue(), 2.0)  # the graph still computes


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_noise_adds_seeded_gaussian_noise_and_passes_the_gradient(strategy):
    pc = dx.ParameterCollection(seed=0)
    A = pc.add_parameters((2000,), init="normal")
    w = np.random.default_rng(1).standard_normal(2000).astype(np.float32)
    dx.renew_cg(autobatch=strategy, seed=5)
    noisy = [dx.noise(A, 0.5), dx.noise(A * 2.0, 0.5)]
    loss = dx.dot_product(noisy[0] + noisy[1], dx.input(w))
    loss.backward()
    a = np.asarray(A.value)
    eps = [noisy[0].npvalue() - a, noisy[1].npvalue() - 2 * a]
    assert abs(eps[0].std() - 0.5) < 0.03 and abs(eps[0].mean()) < 0.03
    assert not np.allclose(eps[0], eps[1])  # each node its own draw
    np.testing.assert_allclose(A.grad, 3.0 * w, rtol=1e-6)  # d/dA of the identity plus noise
    first = noisy[0].npvalue()
    dx.renew_cg(autobatch="none", seed=5)  # the same seed and node: the same draw
    np.testing.assert_allclose(dx.noise(A, 0.5).npvalue(), first, rtol=1e-6)


def test_dynet_spellings():
    """The names a DyNet program uses: top-level builders, DyNet's input constructors,
    vec_value, ``**``, lookup(update=False), trainer clipping and status."""
    assert dx.LSTMBuilder is dx.nn.LSTMBuilder is dx.VanillaLSTMBuilder
    assert dx.BiRNNBuilder is dx.nn.BiRNNBuilder and dx.GRUBuilder is dx.nn.GRUBuilder
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((5, 3), name="E")
    W = pc.add_parameters((3,), name="W")
    dx.renew_cg()
    x = dx.inputVector([1.0, 2.0, 3.0])
    assert x.vec_value() == [1.0, 2.0, 3.0] and dx.scalarInput(2).value() == 2.0
    assert dx.inputTensor(np.ones((2, 2))).vec_value() == [1.0] * 4
    assert (x ** 2).vec_value() == [1.0, 4.0, 9.0] and (2.0 ** x).vec_value() == [2.0, 4.0, 8.0]
    loss = dx.sum_elems(dx.cmult(dx.lookup(E, 1, update=False), W)) + dx.sum_elems(E[2])
    loss.backward()
    grad = np.asarray(E.grad)
    assert not grad[1].any() and grad[2].all()  # row 1 was read with update=False
    trainer = dx.AdamTrainer(pc)
    assert trainer.get_clip_threshold() == 0.0
    trainer.set_clip_threshold(5)
    assert trainer.get_clip_threshold() == 5.0 and trainer.clip_threshold == 5.0
    trainer.set_clip_threshold(0)
    assert trainer.clip_threshold is None
    with pytest.raises(ValueError, match="threshold must be a finite number >= 0"):
        trainer.set_clip_threshold(-1)
    trainer.set_sparse_updates(True)
    assert trainer.sparse_updates
    with pytest.raises(dx.ArgumentTypeError, match="set_sparse_updates: expected a bool"):
        trainer.set_sparse_updates(1)
    with pytest.raises(dx.ArgumentTypeError, match="lookup: update must be True or False"):
        dx.lookup(E, 1, update=0)


def test_dynet_initializers():
    pc = dx.ParameterCollection(seed=0)
    const = pc.add_parameters((2, 3), init=dx.ConstInitializer(0.5))
    number = pc.add_parameters((4,), init=-0.25)  # a number: DyNet's constant init
    eye = pc.add_parameters((3, 3), init=dx.IdentityInitializer())
    normal = pc.add_parameters((100_000,), init=dx.NormalInitializer(1.0, 4.0))
    uniform = pc.add_parameters((10_000,), init=dx.UniformInitializer(0.3))
    glorot = pc.add_parameters((300, 200), init=dx.GlorotInitializer())
    table = pc.add_lookup_parameters((1000, 50), init=dx.GlorotInitializer(is_lookup=True))
    given = pc.add_parameters((2,), init=dx.NumpyInitializer([1.0, 2.0]))
    np.testing.assert_array_equal(const.npvalue(), np.full((2, 3), 0.5))
    np.testing.assert_array_equal(number.npvalue(), np.full(4, -0.25))
    np.testing.assert_array_equal(eye.npvalue(), np.eye(3))
    np.testing.assert_array_equal(given.npvalue(), [1.0, 2.0])
    v = normal.npvalue()
    assert abs(v.mean() - 1.0) < 0.03 and abs(v.std() - 2.0) < 0.03  # var 4: deviation 2
    v = uniform.npvalue()
    assert -0.3 <= v.min() < -0.29 and 0.29 < v.max() <= 0.3
    for p, s in ((glorot, np.sqrt(6 / 500)), (table, np.sqrt(3 / 50))):
        v = np.abs(p.npvalue())
        assert 0.98 * s < v.max() <= s, (p.name, v.max(), s)
    # Glorot by rank, as DyNet 2.1's param-init.cc: sqrt(3 d / sum(dims)), and for a 4-d
    # filter (rows, cols, in, out) fans times the receptive field; "glorot" is the same
    for shape, s in (((20_000,), np.sqrt(3 / 20_000)), ((20, 30, 40), np.sqrt(9 / 90)),
                     ((3, 3, 32, 64), np.sqrt(6 / (9 * 96)))):
        for init in ("glorot", dx.GlorotInitializer()):
            v = np.abs(pc.add_parameters(shape, init=init).npvalue())
            assert 0.98 * s < v.max() <= s, (shape, init, v.max(), s)
    with pytest.raises(dx.InvalidArgumentError, match="IdentityInitializer: needs a square"):
        pc.add_parameters((2, 3), init=dx.IdentityInitializer())
    with pytest.raises(dx.InvalidArgumentError,
                       match="NormalInitializer: var must be a finite number of at least 0.0"):
        dx.NormalInitializer(0.0, -1.0)
    with pytest.raises(dx.InvalidArgumentError, match="init callable returned shape"):
        pc.add_parameters((3,), init=dx.NumpyInitializer([1.0, 2.0]))


def test_random_inits_equal_direct_draws_and_compile_once_per_length_bucket():
    """Random inits are drawn as flat vectors of power-of-two lengths and cut to shape
    (``parameters.draw``): the values of a direct ``jax.random`` draw of the shape, and
    shapes whose sizes share a bucket compile JAX's random function once between them."""
    from dynax.nn.parameters import draw

    compiles = []

    def on_event(name, *args, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    key = jax.random.fold_in(jax.random.PRNGKey(7), 3)
    for shape in ((3,), (37, 5), (2, 3, 4), (1500, 17)):
        got = draw(key, shape, "uniform", -0.4, 0.4)
        assert got.shape == shape and got.dtype == np.float32
        assert -0.4 <= got.min() and got.max() < 0.4
        if not jax.config.jax_threefry_partitionable:  # JAX before 0.5: other values
            continue
        np.testing.assert_array_equal(got, jax.random.uniform(key, shape, jnp.float32, -0.4, 0.4))
        np.testing.assert_allclose(draw(key, shape, "normal"),
                                   jax.random.normal(key, shape, jnp.float32),
                                   rtol=1e-6, atol=1e-6)
    shapes = [(200, 700), (400, 500), (250_000,), (512, 512, 1)]  # sizes in (2^17, 2^18]
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        draws = [draw(jax.random.fold_in(key, i), s, "uniform", -1.0, 1.0)
                 for i, s in enumerate(shapes)]
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert len(compiles) <= 1, compiles  # one for the bucket, none if it ran before
    assert [d.shape for d in draws] == shapes
    with pytest.raises(ValueError, match="unknown distribution 'gamma'"):
        draw(key, (3,), "gamma")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sparsemax_entry_exactly_at_the_threshold_gets_no_gradient(strategy):
    """x = (1, 0, -1): sparsemax is (1, 0, 0) and the threshold is 0, exactly x[1]. The
    paper's Jacobian (diag(s) - s s^T / |s| over the support s = {y > 0}) gives row 1 zero;
    a max(x - tau, 0) would split the tie and give (0.5, -0.5, 0)."""
    pc = dx.ParameterCollection(seed=0)
    p = pc.add_parameters((3,), init=np.array([1.0, 0.0, -1.0], np.float32))
    dx.renew_cg(autobatch=strategy)
    y = dx.sparsemax(p)
    np.testing.assert_array_equal(y.npvalue(), [1.0, 0.0, 0.0])
    dx.pick(y, 1).backward()
    np.testing.assert_array_equal(np.asarray(p.grad), [0.0, 0.0, 0.0])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rounding_is_dynets_and_straight_through_values_are_exact(strategy):
    """round takes halves away from zero (C's round, as DyNet's); a straight-through op's
    value is exactly the function's (x + (y - x) missed a one-hot's 1 by a rounding)."""
    dx.renew_cg(autobatch=strategy)
    halves = dx.round(dx.input(np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, 2.4],
                                        np.float32)), "straight_through_gradient")
    np.testing.assert_array_equal(halves.npvalue(), [1, 2, 3, -1, -3, 0, 2])
    r = np.random.default_rng(0)
    xs = [r.normal(size=5).astype(np.float32) * 40 + 1e3 for _ in range(50)]
    hots = [dx.argmax(dx.input(x), "straight_through_gradient") for x in xs]
    dx.forward(hots)
    for x, h in zip(xs, hots):
        np.testing.assert_array_equal(h.npvalue(), np.eye(5, dtype=np.float32)[np.argmax(x)])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_dynet_style_gain_of_shape_1_is_a_scalar(strategy):
    pc = dx.ParameterCollection(seed=0)
    w = pc.add_parameters((2, 3))
    g = pc.add_parameters(1, init=2.0)
    dx.renew_cg(autobatch=strategy)
    y = dx.weight_norm(w, g)
    assert y.shape == (2, 3)
    wv = np.asarray(w.value)
    np.testing.assert_allclose(y.npvalue(), 2.0 * wv / np.linalg.norm(wv), rtol=1e-6)
    dx.sum_elems(y).backward()
    want = jax.grad(lambda gv: jnp.sum(wv * gv[0] / jnp.linalg.norm(wv)))(jnp.array([2.0]))
    np.testing.assert_allclose(np.asarray(g.grad), want, rtol=1e-5)
    loss = dx.poisson_loss(g, 3)
    assert loss.shape == ()
    assert loss.value() == pytest.approx(np.exp(2.0) - 3 * 2.0 + np.log(6.0), rel=1e-5)


def test_conv2d_takes_dynets_keyword_is_valid_after_a_stride():
    pc = dx.ParameterCollection(seed=0)
    f = pc.add_parameters((2, 2, 1, 3))
    dx.renew_cg()
    x = dx.input(np.ones((4, 4, 1), np.float32))
    assert dx.conv2d(x, f, [1, 1], is_valid=False).shape == (4, 4, 3)
    assert dx.conv2d(x, f, (2, 2), is_valid=True).shape == (2, 2, 3)
    assert dx.conv2d(x, f, [1, 1], False).shape == (4, 4, 3)
    with pytest.raises(dx.InvalidArgumentError, match="conv2d: is_valid is given twice"):
        dx.conv2d(x, f, [1, 1], False, is_valid=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_value_keeping_ops_are_exact_at_the_float_range_s_ends(strategy):
    """flip_gradient, scale_gradient and the straight-through modes give x itself past half
    the float range and at +-inf (2x - x overflowed and x + (x - x) was NaN before session
    76), with the gradients of -x, s * x and x (jax.grad's of that math)."""
    x = np.array([2e38, -3e38, 1.0, np.inf, -np.inf], np.float32)
    ops = ((dx.flip_gradient, lambda v: -v),
           (lambda e: dx.scale_gradient(e, 0.5), lambda v: 0.5 * v),
           (lambda e: dx.round(e, "straight_through_gradient"), lambda v: v),
           (lambda e: dx.ceil(e, "straight_through_gradient"), lambda v: v))
    finite = np.array([1, 1, 1, 0, 0], np.float32)  # the infinite entries' weights: 0
    for op, same_gradient in ops:
        pc = dx.ParameterCollection(seed=0)
        p = pc.add_parameters((5,), init=x)
        dx.renew_cg(autobatch=strategy)
        y = op(p)
        np.testing.assert_array_equal(y.npvalue(), x)
        dx.sum_elems(dx.cmult(y, dx.input(finite))).backward()
        want = jax.grad(lambda v: jnp.sum(same_gradient(v) * finite))(jnp.ones(5))
        np.testing.assert_array_equal(p.grad, want)
