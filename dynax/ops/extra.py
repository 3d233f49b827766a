"""DyNet's further operations, beyond API.md: more elementwise functions, reductions along
dimensions, slices and selections, distances, noise, and gradient control.

Each is one single-instance JAX function and its batching contract (``OpDef``), as in
``core``: per-instance tensors are batched, dimensions and constants such as ``alpha`` are
static (part of the signature), and bad input fails at construction naming the op.
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import jax.scipy.special
import numpy as np

from ..errors import IndexOutOfRangeError, InvalidArgumentError, ShapeError
from .core import (MAX_LIST, _all_same, _apply, _binary, _binop, _both, _checked_shape,
                   _dropout_rate, _indices_in_range, _int, _int_list, _list_op,
                   _number_as_data, _of_stacked, _padded, _real, _reduced, _shape, _single, _tensor_node,
                   _unary, _vector, _zero_like, atomic, cmult, draw_key, input, kept_and_scaled,
                   lookup, parameter, seed_and_node_bounds, training_draw, zeros)
from .registry import CHEAP, HEAVY, INDEX_LIMIT, OpDef

# ---- elementwise --------------------------------------------------------------------------------

SELU = _unary("selu", jax.nn.selu)
SOFTSIGN = _unary("softsign", jax.nn.soft_sign)
LOG_SIGMOID = _unary("log_sigmoid", jax.nn.log_sigmoid)
CUBE = _unary("cube", lambda x: x * x * x)
ERF = _unary("erf", jax.scipy.special.erf)
ELU = OpDef("elu", lambda x, alpha: jax.nn.elu(x, alpha), CHEAP)
LEAKY_RELU = OpDef("leaky_relu", lambda x, slope: jax.nn.leaky_relu(x, slope), CHEAP)
NOBACKPROP = OpDef("nobackprop", jax.lax.stop_gradient, CHEAP, stops_gradient=True)


@jax.custom_jvp
def _value_with_slope(y, x, s):
    """``y`` as the value and ``s`` times x's derivative as its derivative: the pairs of
    ``flip_gradient``, ``scale_gradient`` and the straight-through modes. Exact for every
    ``y``: ``2y - y`` overflows past half the float range, and ``y + (x - x)`` is NaN at
    an infinite ``x`` (session 76's audit)."""
    return y


@_value_with_slope.defjvp
def _value_with_slope_jvp(primals, tangents):
    y, _, s = primals
    return y, s * tangents[1]


# the value of x, the gradient of -x (Ganin & Lempitsky's gradient reversal)
FLIP_GRADIENT = _unary("flip_gradient", lambda x: _value_with_slope(x, x, -1.0))
BMAX = _binary("bmax", jnp.maximum)
BMIN = _binary("bmin", jnp.minimum)
POW = _binary("pow", jnp.power)


def selu(x):
    """Scaled exponential linear unit (Klambauer et al. 2017)."""
    return _apply(SELU, x)


def softsign(x):
    """``x / (1 + |x|)``."""
    return _apply(SOFTSIGN, x)


def log_sigmoid(x):
    """``log(logistic(x))``, computed stably."""
    return _apply(LOG_SIGMOID, x)


def cube(x):
    """``x ** 3``, elementwise."""
    return _apply(CUBE, x)


def erf(x):
    """The error function, elementwise."""
    return _apply(ERF, x)


def elu(x, alpha: float = 1.0):
    """Exponential linear unit: ``x`` if positive, else ``alpha * (exp(x) - 1)``."""
    return _single(ELU, x, "s", (_number("elu", "alpha", alpha),))


def leaky_relu(x, negative_slope: float = 0.01):
    """``x`` if positive, else ``negative_slope * x`` (PyTorch's default slope; a GAT's
    attention scores use 0.2)."""
    return _single(LEAKY_RELU, x, "s", (_number("leaky_relu", "negative_slope",
                                                 negative_slope),))


def nobackprop(x):
    """The value of ``x``; no gradient flows back through it (``jax.lax.stop_gradient``)."""
    return _apply(NOBACKPROP, x)


def flip_gradient(x):
    """The value of ``x``; the gradient flowing back through it is negated."""
    return _apply(FLIP_GRADIENT, x)


# the value is exactly x (s * x + (1 - s) * x would round); the gradient is s
SCALE_GRADIENT = OpDef("scale_gradient", lambda x, s: _value_with_slope(x, x, s), CHEAP)


@atomic  # a failed node leaves no constant behind
def scale_gradient(x, lambd: float = 1.0):
    """The value of ``x``; the gradient flowing back through it is multiplied by ``lambd``
    (DyNet's ``scale_gradient``; ``flip_gradient`` is ``lambd=-1``). ``lambd`` is data (a
    0-d constant of the graph, as a number operand of ``*``): a schedule that changes it
    every update (a gradient-reversal coefficient) compiles nothing new."""
    return _apply(SCALE_GRADIENT, x, _number_as_data(_real("scale_gradient", "lambd", lambd)))


SILU = OpDef("silu", lambda x, beta: x * jax.nn.sigmoid(beta * x), CHEAP)


def silu(x, beta: float = 1.0):
    """Sigmoid-weighted linear unit (swish), elementwise: ``x * sigmoid(beta * x)``."""
    return _single(SILU, x, "s", (_real("silu", "beta", beta),))


def const_parameter(p):
    """A parameter's value as an expression no gradient flows back from (DyNet's)."""
    return nobackprop(parameter(p))


def const_lookup(table, i):
    """Row ``i`` of a lookup table, with no gradient flowing back into the table (DyNet's)."""
    return nobackprop(lookup(table, i))


def bmax(a, b):
    """Elementwise maximum of two expressions (equal shapes, or one a scalar or number);
    an exact tie splits the gradient equally, as ``jnp.maximum``."""
    return _binop(BMAX, a, b)


def bmin(a, b):
    """Elementwise minimum of two expressions (see ``bmax``)."""
    return _binop(BMIN, a, b)


def pow(x, y):  # noqa: A001  (DyNet's name)
    """``x ** y``, elementwise (``y`` an expression of x's shape, a scalar, or a number)."""
    return _binop(POW, x, y)


def _number(opname, what, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InvalidArgumentError(f"{opname}: {what} must be a number, got {v!r}")
    return float(v)


# ---- reductions along dimensions, and a slice ---------------------------------------------------

def _dims(opname, d):
    """``d`` (an int or a list of ints) as a sorted tuple of distinct ints."""
    ds = [d] if isinstance(d, numbers.Integral) else d
    if not isinstance(ds, (list, tuple)) or not ds or any(
            isinstance(k, bool) or not isinstance(k, numbers.Integral) for k in ds):
        raise InvalidArgumentError(f"{opname}: d must be an int or a list of ints, got {d!r}")
    if len(set(ds)) != len(ds):
        raise InvalidArgumentError(f"{opname}: d repeats a dimension: {d!r}")
    return tuple(sorted(int(k) for k in ds))


def _check_dims(opname):
    def check(avals, statics):
        shape, dims = _shape(avals[0]), statics[0]
        for k in dims:
            if not 0 <= k < len(shape):
                raise IndexOutOfRangeError(f"{opname}: dimension {k} is out of range for "
                                           f"shape {shape}")
    return check


def _reduction(name, fn):
    return OpDef(name, lambda x, dims: fn(x, axis=dims), CHEAP, check=_check_dims(name))


SUM_DIM = _reduction("sum_dim", jnp.sum)
MEAN_DIM = _reduction("mean_dim", jnp.mean)
MAX_DIM = _reduction("max_dim", jnp.max)
MIN_DIM = _reduction("min_dim", jnp.min)
LOGSUMEXP_DIM = _reduction("logsumexp_dim", jax.nn.logsumexp)
MEAN_ELEMS = _unary("mean_elems", jnp.mean)
L2_NORM = _unary("l2_norm", lambda x: jnp.sqrt(jnp.sum(x * x)))


def _no_batch(opname, b, n=0) -> None:
    """DyNet's batch flag ``b`` and sample count ``n`` of its reductions: dynax has no
    batch dimension (the autobatcher batches), so ``b`` must be False and ``n`` 0."""
    if not (isinstance(b, (bool, np.bool_)) and not b):
        raise InvalidArgumentError(f"{opname}: b=True reduces DyNet's batch dimension, which "
                                   "dynax does not have (write one instance at a time)")
    if n != 0:
        raise InvalidArgumentError(f"{opname}: n (DyNet's sample count) is not supported, "
                                   f"got {n!r}")


def sum_dim(x, d, b: bool = False):
    """Sum over dimension ``d`` (an int, or a list of them); those dimensions are removed.
    ``b`` is DyNet's batch flag: False, as there is no batch dimension."""
    _no_batch("sum_dim", b)
    return _single(SUM_DIM, x, "s", (_dims("sum_dim", d),))


def _over_columns(opname, reduce, x):
    """``reduce`` over the columns of a matrix ``x``: a vector, one entry per row."""
    if len(_shape(x)) != 2:
        raise ShapeError(f"{opname}: expected a matrix, got shape {_shape(x)}")
    return reduce(x, 1)


def average_cols(x):
    """The mean of a matrix's columns, a vector of its rows' means (DyNet's
    ``average_cols``)."""
    return _over_columns("average_cols", mean_dim, x)


def sum_cols(x):
    """The sum of a matrix's columns, a vector of its rows' sums (DyNet's ``sum_cols``)."""
    return _over_columns("sum_cols", sum_dim, x)


def mean_dim(x, d, b: bool = False, n: int = 0):
    """Mean over dimension ``d`` (an int, or a list of them); ``b`` and ``n`` as DyNet's,
    False and 0 only (``_no_batch``)."""
    _no_batch("mean_dim", b, n)
    return _single(MEAN_DIM, x, "s", (_dims("mean_dim", d),))


def max_dim(x, d: int = 0):
    """Maximum over dimension ``d``; exact ties split the gradient, as ``jnp.max``."""
    return _single(MAX_DIM, x, "s", (_dims("max_dim", d),))


def min_dim(x, d: int = 0):
    """Minimum over dimension ``d`` (see ``max_dim``)."""
    return _single(MIN_DIM, x, "s", (_dims("min_dim", d),))


def logsumexp_dim(x, d: int = 0):
    """``log(sum(exp(x)))`` over dimension ``d``, computed stably."""
    return _single(LOGSUMEXP_DIM, x, "s", (_dims("logsumexp_dim", d),))


def mean_elems(x):
    """Mean of all elements (a scalar)."""
    return _apply(MEAN_ELEMS, x)


def l2_norm(x):
    """Euclidean norm of all elements (a scalar)."""
    return _apply(L2_NORM, x)


def _check_range(avals, statics):
    shape, (start, end, d) = _shape(avals[0]), statics
    if not 0 <= d < len(shape):
        raise IndexOutOfRangeError(f"pick_range: dimension {d} is out of range for shape "
                                   f"{shape}")
    if not 0 <= start < end <= shape[d]:
        raise IndexOutOfRangeError(f"pick_range: range [{start}, {end}) is empty or outside "
                                   f"[0, {shape[d]}) along dimension {d} of shape {shape}")


PICK_RANGE = OpDef("pick_range",
                   lambda x, s, e, d: jax.lax.slice_in_dim(x, s, e, axis=d), CHEAP,
                   check=_check_range,
                   part=lambda rows, ints, st: ((rows,) + (slice(None),) * st[2]
                                                + (slice(st[0], st[1]),)))


def pick_range(x, start: int, end: int, d: int = 0):
    """Elements ``start`` to ``end - 1`` along dimension ``d`` (DyNet's ``pick_range``)."""
    return _single(PICK_RANGE, x, "sss", (_int("pick_range", "start", start),
                                          _int("pick_range", "end", end),
                                          _int("pick_range", "d", d)))


pickrange = pick_range  # DyNet's older name


def _check_indices(opname, axis):
    def check(avals, statics):
        shape, idx = _shape(avals[0]), statics[0]
        if len(shape) != 2:
            raise ShapeError(f"{opname}: expected a matrix, got shape {shape}")
        bad = [i for i in idx if not 0 <= i < shape[axis]]
        if bad:
            raise IndexOutOfRangeError(f"{opname}: index {bad[0]} out of range [0, "
                                       f"{shape[axis]}) for shape {shape}")
    return check


SELECT_ROWS = OpDef("select_rows", lambda x, rows: x[jnp.asarray(rows)], CHEAP,
                    check=_check_indices("select_rows", 0),
                    part=lambda rows, ints, st: (rows[:, None], np.asarray(st[0])[None, :]))
SELECT_COLS = OpDef("select_cols", lambda x, cols: x[:, jnp.asarray(cols)], CHEAP,
                    check=_check_indices("select_cols", 1))


def _index_list(opname, idx):
    idx = [idx] if isinstance(idx, numbers.Integral) else idx
    if not isinstance(idx, (list, tuple)) or not idx or any(
            isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in idx):
        raise InvalidArgumentError(f"{opname}: expected a non-empty list of ints, got {idx!r}")
    return tuple(int(i) for i in idx)


def select_rows(x, rows):
    """The rows ``rows`` (a list of ints, static: part of the signature) of a matrix."""
    return _single(SELECT_ROWS, x, "s", (_index_list("select_rows", rows),))


def select_cols(x, cols):
    """The columns ``cols`` (a list of ints, static) of a matrix."""
    return _single(SELECT_COLS, x, "s", (_index_list("select_cols", cols),))


def _check_colwise(avals, statics):
    x, bias = (_shape(a) for a in avals)
    if len(x) != 2 or bias != x[:1]:
        raise ShapeError(f"colwise_add: expected a matrix (n, m) and a vector (n,), got {x} "
                         f"and {bias}")


COLWISE_ADD = OpDef("colwise_add", lambda x, bias: x + bias[:, None], CHEAP,
                    check=_check_colwise)


def colwise_add(x, bias):
    """``bias`` (n,) added to every column of ``x`` (n, m), as DyNet's ``colwise_add``."""
    return _apply(COLWISE_ADD, x, bias)


def _logsumexp_stacked(xs, n):
    """``log(sum(exp))`` over the first ``n`` items, elementwise; the padding is masked
    out."""
    real = (jnp.arange(xs.shape[0]) < n).reshape((-1,) + (1,) * (xs.ndim - 1))
    return jax.nn.logsumexp(xs, axis=0, where=jnp.broadcast_to(real, xs.shape))


LOGSUMEXP = OpDef("logsumexp", _of_stacked(_logsumexp_stacked, True), CHEAP,
                  check=lambda av, st: _all_same("logsumexp")(av[:-1], st),
                  index_bounds=lambda avals: (INDEX_LIMIT,),  # the count of real items
                  stacked=_logsumexp_stacked)


@_list_op
def logsumexp(xs):
    """Elementwise ``log(sum(exp(x)))`` over a list of expressions of one shape (DyNet's
    ``logsumexp``), computed stably; one node per list of up to 16 items."""
    return _reduced(xs, _logsumexp_node, MAX_LIST, "logsumexp")


def _logsumexp_node(xs, width=None):  # the count of real items masks the padding
    return _padded(LOGSUMEXP, xs, _zero_like(xs), "i", (len(xs),), width)


def _noise_fn(x, seed, node, stddev):
    return x + stddev * jax.random.normal(draw_key(seed, node), x.shape, x.dtype)


NOISE = OpDef("noise", _noise_fn, CHEAP, index_bounds=seed_and_node_bounds)


def noise(x, stddev: float):
    """``x`` plus Gaussian noise of standard deviation ``stddev`` (DyNet's ``noise``): drawn
    as ``dx.dropout``'s masks (seeded by the graph and the node), and, as dropout, the
    identity when ``stddev == 0`` or in a graph built with ``train=False``."""
    return training_draw(NOISE, x, _real("noise", "stddev", stddev, 0.0))


def _dropout_dim_fn(x, seed, node, p, d):
    shape = x.shape[:d] + (1,) + x.shape[d + 1:]  # one draw for each slice along d
    return kept_and_scaled(x, jax.random.bernoulli(draw_key(seed, node), 1.0 - p, shape), p)


def _check_dropout_dim(avals, statics):
    shape, d = _shape(avals[0]), statics[-1]
    if not 0 <= d < len(shape):
        raise ShapeError(f"dropout_dim: dimension {d} is out of range for shape {shape}")


DROPOUT_DIM = OpDef("dropout_dim", _dropout_dim_fn, CHEAP, index_bounds=seed_and_node_bounds,
                    check=_check_dropout_dim)


def dropout_dim(x, d: int, p: float):
    """Dropout with one mask entry for each slice along dimension ``d`` (DyNet's
    ``dropout_dim``): the mask has size 1 along ``d``, so ``dropout_dim(M, 0, p)`` zeroes
    whole columns of a matrix and ``dropout_dim(M, 1, p)`` whole rows; the rest is scaled
    by 1/(1-p). Seeded, and the identity under ``train=False``, as ``dx.dropout``."""
    return training_draw(DROPOUT_DIM, x, _dropout_rate("dropout_dim", p),
                         _int("dropout_dim", "d", d))


def _block_dropout_fn(x, seed, node, p):
    return kept_and_scaled(x, jax.random.bernoulli(draw_key(seed, node), 1.0 - p), p)


BLOCK_DROPOUT = OpDef("block_dropout", _block_dropout_fn, CHEAP,
                      index_bounds=seed_and_node_bounds)


def block_dropout(x, p: float):
    """All of ``x`` zeroed with probability ``p``, else scaled by 1/(1-p) (DyNet's
    ``block_dropout``). Seeded, and the identity under ``train=False``, as ``dx.dropout``."""
    return training_draw(BLOCK_DROPOUT, x, _dropout_rate("block_dropout", p))


SQUARED_NORM = _unary("squared_norm", lambda x: jnp.sum(x * x))


def squared_norm(x):
    """Sum of the squares of all elements (a scalar)."""
    return _apply(SQUARED_NORM, x)


# ---- distances ----------------------------------------------------------------------------------

L1_DISTANCE = OpDef("l1_distance", lambda a, b: jnp.sum(jnp.abs(a - b)), CHEAP,
                    check=_all_same("l1_distance"))


def l1_distance(a, b):
    """``sum(|a - b|)`` over all elements of two expressions of one shape (a scalar)."""
    return _apply(L1_DISTANCE, a, b)


# ---- more elementwise functions -----------------------------------------------------------------

def _elementwise(name, fn, doc):
    op = _unary(name, fn)

    def apply(x):
        return _apply(op, x)
    apply.__name__ = apply.__qualname__ = name
    apply.__doc__ = doc
    return apply


sin = _elementwise("sin", jnp.sin, "Elementwise sine.")
cos = _elementwise("cos", jnp.cos, "Elementwise cosine.")
tan = _elementwise("tan", jnp.tan, "Elementwise tangent.")
asin = _elementwise("asin", jnp.arcsin, "Elementwise inverse sine.")
acos = _elementwise("acos", jnp.arccos, "Elementwise inverse cosine.")
atan = _elementwise("atan", jnp.arctan, "Elementwise inverse tangent.")
sinh = _elementwise("sinh", jnp.sinh, "Elementwise hyperbolic sine.")
cosh = _elementwise("cosh", jnp.cosh, "Elementwise hyperbolic cosine.")
asinh = _elementwise("asinh", jnp.arcsinh, "Elementwise inverse hyperbolic sine.")
acosh = _elementwise("acosh", jnp.arccosh, "Elementwise inverse hyperbolic cosine.")
atanh = _elementwise("atanh", jnp.arctanh, "Elementwise inverse hyperbolic tangent.")
lgamma = _elementwise("lgamma", jax.scipy.special.gammaln,
                      "Elementwise log of the absolute value of the gamma function.")

# ---- piecewise-constant functions, with DyNet's two gradient modes -----------------------------

GRADIENT_MODES = ("zero_gradient", "straight_through_gradient")


def _gradient_mode(opname, mode):
    if mode not in GRADIENT_MODES:
        raise InvalidArgumentError(f"{opname}: gradient_mode must be one of {GRADIENT_MODES}, "
                                   f"got {mode!r}")
    return mode == "straight_through_gradient"


def _piecewise_constant(name, fn, check=None):
    # the value of fn(x); the gradient of zero or, straight through, of the identity
    def apply(x, straight):
        y = jax.lax.stop_gradient(fn(x))
        return _value_with_slope(y, x, 1.0) if straight else y
    return OpDef(name, apply, CHEAP, check=check)


def _round_half_away(x):
    # C's round(), as DyNet's (Eigen's): halves away from zero; jnp.round takes them to even
    t = jnp.trunc(x)
    return jnp.where(jnp.abs(x - t) == 0.5, t + jnp.sign(x), jnp.round(x))


ROUND = _piecewise_constant("round", _round_half_away)
FLOOR = _piecewise_constant("floor", jnp.floor)
CEIL = _piecewise_constant("ceil", jnp.ceil)


def _one_hot_argmax(x):
    return jax.nn.one_hot(jnp.argmax(x), x.shape[0], dtype=x.dtype)


ARGMAX = _piecewise_constant("argmax", _one_hot_argmax, check=_vector("argmax"))


def round(x, gradient_mode: str = "zero_gradient"):  # noqa: A001  (DyNet's name)
    """Elementwise rounding to the nearest integer, halves away from zero (C's and DyNet's
    ``round``; NumPy's rounds them to even). ``gradient_mode``:
    ``"zero_gradient"`` (no gradient flows back) or ``"straight_through_gradient"`` (the
    gradient passes through as if this were the identity), as in DyNet."""
    return _single(ROUND, x, "s", (_gradient_mode("round", gradient_mode),))


def floor(x, gradient_mode: str = "zero_gradient"):
    """Elementwise floor; ``gradient_mode`` as in ``round``."""
    return _single(FLOOR, x, "s", (_gradient_mode("floor", gradient_mode),))


def ceil(x, gradient_mode: str = "zero_gradient"):
    """Elementwise ceiling; ``gradient_mode`` as in ``round``."""
    return _single(CEIL, x, "s", (_gradient_mode("ceil", gradient_mode),))


def argmax(x, gradient_mode: str = "zero_gradient"):
    """The one-hot vector of a vector's largest entry (the first on ties); ``gradient_mode``
    as in ``round`` (straight through: the gradient of the identity, as DyNet's)."""
    return _single(ARGMAX, x, "s", (_gradient_mode("argmax", gradient_mode),))


# ---- statistics and running sums ----------------------------------------------------------------

STD_ELEMS = _unary("std_elems", jnp.std)
MOMENT_ELEMS = OpDef("moment_elems", lambda x, r: jnp.mean(x ** r), CHEAP)
STD_DIM = OpDef("std_dim", lambda x, dims: jnp.std(x, axis=dims), CHEAP,
                check=_check_dims("std_dim"))
MOMENT_DIM = OpDef("moment_dim", lambda x, dims, r: jnp.mean(x ** r, axis=dims), CHEAP,
                   check=_check_dims("moment_dim"))
CUMSUM = OpDef("cumsum", lambda x, dims: jnp.cumsum(x, axis=dims[0]), CHEAP,
               check=_check_dims("cumsum"))


def _order(opname, r):
    if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1:
        raise InvalidArgumentError(f"{opname}: the order r must be an int >= 1, got {r!r}")
    return int(r)


def std_elems(x):
    """Standard deviation of all elements (a scalar): the population's, dividing by the
    count, as DyNet's."""
    return _apply(STD_ELEMS, x)


def moment_elems(x, r: int):
    """The ``r``-th raw moment of all elements, ``mean(x ** r)`` (a scalar)."""
    return _single(MOMENT_ELEMS, x, "s", (_order("moment_elems", r),))


def std_dim(x, d, b: bool = False, n: int = 0):
    """Standard deviation (the population's) over dimension ``d`` (an int or a list);
    ``b`` and ``n`` as DyNet's, False and 0 only (``_no_batch``)."""
    _no_batch("std_dim", b, n)
    return _single(STD_DIM, x, "s", (_dims("std_dim", d),))


def moment_dim(x, d, r: int, b: bool = False, n: int = 0):
    """The ``r``-th raw moment, ``mean(x ** r)``, over dimension ``d`` (an int or a list);
    ``b`` and ``n`` as DyNet's, False and 0 only (``_no_batch``)."""
    _no_batch("moment_dim", b, n)
    return _single(MOMENT_DIM, x, "ss", (_dims("moment_dim", d), _order("moment_dim", r)))


def cumsum(x, d: int = 0):
    """Running sums along dimension ``d`` (the shape is unchanged)."""
    return _single(CUMSUM, x, "s", ((_int("cumsum", "d", d),),))


# ---- normalisation ------------------------------------------------------------------------------

def _layer_norm(x, g, b):
    # DyNet's: the gain times (x - mean) / (std + 1e-8), plus the bias
    centered = x - jnp.mean(x)
    return g * centered / (jnp.sqrt(jnp.mean(centered * centered)) + 1e-8) + b


LAYER_NORM = OpDef("layer_norm", _layer_norm, CHEAP,
                   check=_both(_vector("layer_norm"), _all_same("layer_norm")))


def layer_norm(x, g, b):
    """Layer normalisation of a vector (Ba et al. 2016), as DyNet's: ``g * (x - mean(x)) /
    (std(x) + 1e-8) + b``, with the population's std; ``g`` and ``b`` of x's shape."""
    return _apply(LAYER_NORM, x, g, b)


def _check_scalar(opname, what="", k=0):
    # a scalar: shape () or, as DyNet's dimension-1 parameters, (1,)
    def check(avals, statics):
        if _shape(avals[k]) not in ((), (1,)):
            raise ShapeError(f"{opname}: expected a scalar{what} (shape () or (1,)), got "
                             f"shape {_shape(avals[k])}")
    return check


WEIGHT_NORM = OpDef("weight_norm",
                    lambda w, g: w * (jnp.reshape(g, ()) / jnp.sqrt(jnp.sum(w * w))), CHEAP,
                    check=_check_scalar("weight_norm", " gain", 1))


def weight_norm(w, g):
    """Weight normalisation (Salimans & Kingma 2016): ``w / ||w|| * g`` for a tensor ``w``
    (usually a parameter) and a scalar gain ``g`` (shape () or (1,)); ``||w||`` over all
    elements."""
    return _apply(WEIGHT_NORM, w, g)


def _sparsemax_threshold(x):
    # Martins & Astudillo (2016): sparsemax(x) = max(x - tau, 0), the Euclidean projection
    # of x onto the simplex
    z = jnp.sort(x)[::-1]
    k = jnp.arange(1, x.shape[0] + 1, dtype=x.dtype)
    sums = jnp.cumsum(z)
    support = jnp.sum(1.0 + k * z > sums)  # the first `support` sorted entries stay positive
    return (sums[support - 1] - 1.0) / support.astype(x.dtype)


def _sparsemax(x):
    tau = _sparsemax_threshold(x)
    # not jnp.maximum: an entry exactly at tau is outside the support, gradient included
    # (the paper's Jacobian), where maximum would split the gradient of the tie
    return jnp.where(x > tau, x - tau, 0.0)


SPARSEMAX = OpDef("sparsemax", _sparsemax, CHEAP, check=_vector("sparsemax"))


def sparsemax(x):
    """Sparsemax of a vector (Martins & Astudillo 2016): the point of the probability
    simplex nearest to ``x``; unlike softmax it can be exactly zero."""
    return _apply(SPARSEMAX, x)


def _sparsemax_loss(x, q):
    # the paper's loss for a target distribution q: its gradient is sparsemax(x) - q (the
    # first term's derivative is sparsemax(x), tau's own derivative cancelling)
    tau = _sparsemax_threshold(x)
    loss = 0.5 * jnp.sum(jnp.where(x > tau, x * x - tau * tau, 0.0)) + 0.5 * jnp.sum(q * q) \
        - jnp.dot(q, x)
    # >= 0 in exact arithmetic; clamped as DyNet's value is, its gradient left as it is
    return loss + jax.lax.stop_gradient(jnp.maximum(loss, 0.0) - loss)


SPARSEMAX_LOSS = OpDef("sparsemax_loss", _sparsemax_loss, CHEAP,
                       check=_all_same("sparsemax_loss"))


def sparsemax_loss(x, target_support):
    """The sparsemax loss of a vector of scores ``x`` (Martins & Astudillo 2016, DyNet's)
    for the target distribution uniform over ``target_support`` (a list of indices); its
    gradient is ``sparsemax(x) - q``. The target travels as a per-instance vector, so
    instances with different supports still batch together."""
    shape = _shape(x)
    if len(shape) != 1:
        raise ShapeError(f"sparsemax_loss: expected a vector, got shape {shape}")
    support = sorted(set(_int_list("sparsemax_loss", "target_support", target_support)))
    _indices_in_range("sparsemax_loss", "target", support, shape[0])
    q = np.zeros(shape, np.float32)
    q[support] = 1.0 / len(support)
    return _tensor_node(SPARSEMAX_LOSS, (x, q), ())


# ---- losses -------------------------------------------------------------------------------------

def _huber(a, b, c):
    r = jnp.abs(a - b)
    return jnp.sum(jnp.where(r < c, r * r, c * (2.0 * r - c)))


HUBER = OpDef("huber_distance", _huber, CHEAP, check=_all_same("huber_distance"))


def huber_distance(x, y, c: float = 1.345):
    """Huber distance of two expressions of one shape, as DyNet's: the sum over elements of
    ``r**2`` where ``r = |x - y| < c`` and ``c * (2r - c)`` elsewhere (twice the textbook
    Huber loss, so that it equals ``squared_distance`` for small residuals)."""
    return _tensor_node(HUBER, (x, y), (_real("huber_distance", "c", c, 0.0),))


PAIRWISE_RANK = OpDef("pairwise_rank_loss", lambda x, y, m: jnp.maximum(0.0, m - x + y),
                      CHEAP, check=_all_same("pairwise_rank_loss"))


def pairwise_rank_loss(x, y, m: float = 1.0):
    """``max(0, m - x + y)`` elementwise: the margin loss of a score ``x`` that should beat
    ``y`` by at least ``m`` (DyNet's)."""
    return _tensor_node(PAIRWISE_RANK, (x, y),
                                (_number("pairwise_rank_loss", "m", m),))


def _poisson(log_lambda, x):
    ll = jnp.reshape(log_lambda, ())
    return jnp.exp(ll) - x * ll + jax.scipy.special.gammaln(x + 1.0)


POISSON = OpDef("poisson_loss", _poisson, CHEAP, check=_check_scalar("poisson_loss"))


def poisson_loss(log_lambda, x: int):
    """``-log Poisson(x; exp(log_lambda))`` for a scalar expression ``log_lambda`` (shape ()
    or (1,); the loss is a scalar) and a count
    ``x`` (a non-negative int, per instance as an index is), as DyNet's."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= x < INDEX_LIMIT:
        raise InvalidArgumentError(f"poisson_loss: x must be a non-negative int below "
                                   f"2**31 - 1 (an int32 count), got {x!r}")
    return _single(POISSON, log_lambda, "i", (int(x),))


# ---- linear algebra -----------------------------------------------------------------------------

def _check_square(opname):
    def check(avals, statics):
        s = _shape(avals[0])
        if len(s) != 2 or s[0] != s[1]:
            raise ShapeError(f"{opname}: expected a square matrix, got shape {s}")
    return check


INVERSE = OpDef("inverse", jnp.linalg.inv, HEAVY, check=_check_square("inverse"))
LOGDET = OpDef("logdet", lambda x: jnp.linalg.slogdet(x)[1], HEAVY,
               check=_check_square("logdet"))


def _check_trace(avals, statics):
    a, b = (_shape(v) for v in avals)
    if len(a) != 2 or a != b:
        raise ShapeError(f"trace_of_product: expected two matrices of one shape, got {a} and "
                         f"{b}")


TRACE_OF_PRODUCT = OpDef("trace_of_product", lambda x, y: jnp.sum(x * y), CHEAP,
                         check=_check_trace)


def inverse(x):
    """The inverse of a square matrix."""
    return _apply(INVERSE, x)


def logdet(x):
    """``log |det(x)|`` of a square matrix (its log-determinant when positive definite)."""
    return _apply(LOGDET, x)


def trace_of_product(x, y):
    """``trace(x @ y.T)`` of two matrices of one shape, i.e. ``sum(x * y)``."""
    return _apply(TRACE_OF_PRODUCT, x, y)


def _check_contract(avals, statics):
    x, y = _shape(avals[0]), _shape(avals[1])
    if len(x) != 3 or y != x[2:]:
        raise ShapeError(f"contract3d_1d: expected a 3-d tensor (i, j, k) and a vector (k,), "
                         f"got {x} and {y}")
    if len(avals) == 3 and _shape(avals[2]) != x[:2]:
        raise ShapeError(f"contract3d_1d_bias: the bias must have shape {x[:2]}, got "
                         f"{_shape(avals[2])}")


CONTRACT3D_1D = OpDef("contract3d_1d", lambda x, y: x @ y, HEAVY, check=_check_contract)
CONTRACT3D_1D_BIAS = OpDef("contract3d_1d_bias", lambda x, y, b: x @ y + b, HEAVY,
                           check=_check_contract)


def contract3d_1d(x, y):
    """``sum_k x[i, j, k] * y[k]``: a 3-d tensor (i, j, k) contracted with a vector (k,) to
    an (i, j) matrix (DyNet's)."""
    return _apply(CONTRACT3D_1D, x, y)


def contract3d_1d_bias(x, y, b):
    """``contract3d_1d(x, y) + b`` for a bias ``b`` of shape (i, j)."""
    return _apply(CONTRACT3D_1D_BIAS, x, y, b)


def _circulant(v, sign):
    # rows k of [v[(k + sign * i) mod n]]_i: the matrix whose product with u is the sum
    n = v.shape[0]
    return v[(jnp.arange(n)[:, None] + sign * jnp.arange(n)[None, :]) % n]


CIRC_CONV = OpDef("circ_conv", lambda u, v: _circulant(v, -1) @ u, CHEAP,
                  check=_both(_vector("circ_conv", 2), _all_same("circ_conv")))
CIRC_CORR = OpDef("circ_corr", lambda u, v: _circulant(v, 1) @ u, CHEAP,
                  check=_both(_vector("circ_corr", 2), _all_same("circ_corr")))


def circ_conv(u, v):
    """Circular convolution of two vectors of one length n: ``w[k] = sum_i u[i] *
    v[(k - i) mod n]``."""
    return _apply(CIRC_CONV, u, v)


def circ_corr(u, v):
    """Circular correlation of two vectors of one length n (holographic embeddings, Nickel
    et al. 2016): ``w[k] = sum_i u[i] * v[(i + k) mod n]``."""
    return _apply(CIRC_CORR, u, v)


# ---- DyNet's other spellings --------------------------------------------------------------------

def cwise_multiply(a, b):
    """DyNet's name for ``cmult``: the elementwise product."""
    return cmult(a, b)


def zeroes(shape):
    """DyNet's other spelling of ``zeros``."""
    return zeros(_checked_shape("zeroes", shape))


def constant(shape, value: float):
    """A constant of ``shape`` with every element ``value`` (DyNet's ``constant``)."""
    return input(np.full(_checked_shape("constant", shape), _number("constant", "value", value),
                         np.float32))


__all__ = ["acos", "acosh", "argmax", "asin", "asinh", "atan", "atanh", "average_cols",
           "block_dropout", "bmax", "bmin", "ceil", "circ_conv", "circ_corr", "colwise_add",
           "const_lookup", "const_parameter", "constant", "contract3d_1d", "contract3d_1d_bias",
           "cos", "cosh", "cube", "cumsum", "cwise_multiply", "dropout_dim", "elu", "erf",
           "flip_gradient", "floor", "huber_distance", "inverse", "l1_distance", "l2_norm",
           "layer_norm", "leaky_relu", "lgamma", "log_sigmoid", "logdet", "logsumexp",
           "logsumexp_dim", "max_dim", "mean_dim", "mean_elems", "min_dim", "moment_dim",
           "moment_elems", "nobackprop", "noise", "pairwise_rank_loss", "pick_range", "pickrange",
           "poisson_loss", "pow", "round", "scale_gradient", "select_cols", "select_rows", "selu",
           "silu", "sin", "sinh", "softsign", "sparsemax", "sparsemax_loss", "squared_norm",
           "std_dim", "std_elems", "sum_cols", "sum_dim", "tan", "trace_of_product", "weight_norm",
           "zeroes"]
