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

from ..errors import IndexOutOfRangeError, InvalidArgumentError, ShapeError
from .core import (_all_same, _apply, _as_expression, _binary, _binop, _real, _shape, _single,
                   _unary, atomic, concatenate, concatenate_cols, draw_key, lookup, parameter,
                   seed_and_node_bounds, training_draw)
from .registry import CHEAP, OpDef

# ---- elementwise --------------------------------------------------------------------------------

SELU = _unary("selu", jax.nn.selu)
SOFTSIGN = _unary("softsign", jax.nn.soft_sign)
LOG_SIGMOID = _unary("log_sigmoid", jax.nn.log_sigmoid)
CUBE = _unary("cube", lambda x: x * x * x)
ERF = _unary("erf", jax.scipy.special.erf)
ELU = OpDef("elu", lambda x, alpha: jax.nn.elu(x, alpha), CHEAP)
NOBACKPROP = _unary("nobackprop", jax.lax.stop_gradient)
# the value of x, the gradient of -x (Ganin & Lempitsky's gradient reversal)
FLIP_GRADIENT = _unary("flip_gradient", lambda x: 2.0 * jax.lax.stop_gradient(x) - x)
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


def nobackprop(x):
    """The value of ``x``; no gradient flows back through it (``jax.lax.stop_gradient``)."""
    return _apply(NOBACKPROP, x)


def flip_gradient(x):
    """The value of ``x``; the gradient flowing back through it is negated."""
    return _apply(FLIP_GRADIENT, x)


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


def sum_dim(x, d):
    """Sum over dimension ``d`` (an int, or a list of them); those dimensions are removed."""
    return _single(SUM_DIM, x, "s", (_dims("sum_dim", d),))


def mean_dim(x, d):
    """Mean over dimension ``d`` (an int, or a list of them)."""
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
                   check=_check_range)


def pick_range(x, start: int, end: int, d: int = 0):
    """Elements ``start`` to ``end - 1`` along dimension ``d`` (DyNet's ``pick_range``)."""
    for what, v in (("start", start), ("end", end), ("d", d)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise InvalidArgumentError(f"pick_range: {what} must be an int, got {v!r}")
    return _single(PICK_RANGE, x, "sss", (int(start), int(end), int(d)))


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
                    check=_check_indices("select_rows", 0))
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


@atomic
def logsumexp(xs):
    """Elementwise ``log(sum(exp(x)))`` over a list of scalars or of vectors of one shape
    (DyNet's ``logsumexp``), computed stably."""
    xs = list(xs)
    if not xs:
        raise InvalidArgumentError("logsumexp: expected a non-empty list of expressions")
    xs = [_as_expression(x, "logsumexp") for x in xs]
    ndim = len(xs[0].shape)
    if ndim == 0:
        return logsumexp_dim(concatenate(xs))
    if ndim == 1:
        return logsumexp_dim(concatenate_cols(xs), 1)
    raise ShapeError(f"logsumexp: expected scalars or vectors, got shape {xs[0].shape}")


def _noise_fn(x, seed, node, stddev):
    return x + stddev * jax.random.normal(draw_key(seed, node), x.shape, x.dtype)


NOISE = OpDef("noise", _noise_fn, CHEAP, index_bounds=seed_and_node_bounds)


def noise(x, stddev: float):
    """``x`` plus Gaussian noise of standard deviation ``stddev`` (DyNet's ``noise``): drawn
    as ``dx.dropout``'s masks (seeded by the graph and the node), and, as dropout, the
    identity when ``stddev == 0`` or in a graph built with ``train=False``."""
    return training_draw(NOISE, x, _real("noise", "stddev", stddev, 0.0))


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


__all__ = ["bmax", "bmin", "colwise_add", "const_lookup", "const_parameter", "cube", "elu", "erf",
           "flip_gradient", "l1_distance", "l2_norm", "log_sigmoid", "logsumexp",
           "logsumexp_dim", "max_dim", "mean_dim", "mean_elems", "min_dim", "nobackprop",
           "noise", "pick_range", "pow", "select_cols", "select_rows", "selu", "softsign",
           "squared_norm", "sum_dim"]
