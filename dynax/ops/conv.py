"""DyNet's convolution and pooling operations: ``conv2d`` (with or without a bias),
``maxpooling2d`` and ``kmax_pooling``; and the 1-d family of Kalchbrenner et al. (2014)'s
dynamic CNN over a sentence matrix ``(d, T)`` (rows the embedding, columns the words):
``filter1d_narrow``, ``fold_rows`` and ``kmh_ngram``.

dynax has no batch dimension: each call is one instance, one image ``(H, W, C)`` (DyNet's
"rows x cols x channels"), and the autobatcher stacks the instances of one signature. The
convolution is written for a batch of one (``x[None]``), so under ``vmap`` XLA folds the
stacked instances into the convolution's own batch dimension: one convolution per batch.
Strides, window sizes and the padding mode are static (part of the signature); bad input
fails at construction naming the op and the shapes.
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from ..errors import IndexOutOfRangeError, InvalidArgumentError, ShapeError
from .core import _int, _shape, _tensor_node
from .registry import CHEAP, HEAVY, OpDef

_DIMS = ("NHWC", "HWIO", "NHWC")  # x (H, W, Ci), filters (fh, fw, Ci, Co), out (H', W', Co)


def _padding(is_valid: bool) -> str:
    return "VALID" if is_valid else "SAME"


def _conv_fn(x, f, stride, is_valid):
    """One image ``x`` (H, W, Ci) cross-correlated with filters ``f`` (fh, fw, Ci, Co)."""
    out = jax.lax.conv_general_dilated(x[None], f, window_strides=stride,
                                       padding=_padding(is_valid), dimension_numbers=_DIMS)
    return out[0]


def _conv_bias_fn(x, f, b, stride, is_valid):
    return _conv_fn(x, f, stride, is_valid) + b[None, None, :]


def _check_conv(opname, with_bias):
    def check(avals, statics):
        x, f = _shape(avals[0]), _shape(avals[1])
        is_valid = statics[-1]
        if len(x) != 3:
            raise ShapeError(f"{opname}: expected an image (rows, cols, channels), got shape {x}")
        if len(f) != 4:
            raise ShapeError(f"{opname}: expected filters (rows, cols, in_channels, "
                             f"out_channels), got shape {f}")
        if f[2] != x[2]:
            raise ShapeError(f"{opname}: the image {x} has {x[2]} channels but the filters "
                             f"{f} expect {f[2]}")
        if is_valid and (f[0] > x[0] or f[1] > x[1]):
            raise ShapeError(f"{opname}: filters {f} are larger than the image {x} "
                             "(VALID padding, is_valid=True: no output)")
        if with_bias:
            b = _shape(avals[2])
            if b != (f[3],):
                raise ShapeError(f"{opname}: expected a bias of shape ({f[3]},) for filters "
                                 f"{f}, got shape {b}")
    return check


CONV2D = OpDef("conv2d", _conv_fn, HEAVY, check=_check_conv("conv2d", False))
CONV2D_BIAS = OpDef("conv2d_bias", _conv_bias_fn, HEAVY,
                    check=_check_conv("conv2d_bias", True))


def _pair(opname, what, v):
    """``v`` (a pair of positive ints, as a tuple or a list) as a tuple of ints."""
    if not isinstance(v, (tuple, list)) or len(v) != 2 or any(
            isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1 for s in v):
        raise InvalidArgumentError(f"{opname}: {what} must be a pair of positive ints, "
                                   f"got {v!r}")
    return (int(v[0]), int(v[1]))


def _flag(opname, what, v):
    if not isinstance(v, bool):
        raise InvalidArgumentError(f"{opname}: {what} must be True or False, got {v!r}")
    return v


def conv2d(x, f, b=None, stride=None, is_valid=None):
    """2-d convolution of one image (DyNet's ``conv2d``; with a bias, ``conv2d_bias``).

    ``x`` is an image of shape (H, W, Ci) (rows, columns, channels), ``f`` the filters
    (fh, fw, Ci, Co), ``b`` an optional bias (Co,) (an Expression, a Parameter or an array)
    added at every output position. The result has shape (H', W', Co). As in DyNet and
    TensorFlow it is a cross-correlation (the filters are not flipped). ``stride`` is a pair
    (rows, cols) of positive ints, default (1, 1); ``is_valid=True`` (the default) is VALID
    padding (none: H' = ceil((H - fh + 1) / stride)), False is SAME padding (zeros around
    the image, spread as TensorFlow does: H' = ceil(H / stride)).

    Both DyNet orders work: ``conv2d(x, f, stride, is_valid)`` (a tuple or list as the
    third argument is the stride) and ``conv2d(x, f, b, stride, is_valid)``. A HEAVY op:
    the instances of one signature run as one convolution.
    """
    if isinstance(b, (tuple, list)):  # DyNet's conv2d(x, f, stride, is_valid)
        if stride is not None and not isinstance(stride, bool):
            raise InvalidArgumentError(f"conv2d: the stride is given twice ({b!r} and "
                                       f"{stride!r}); call conv2d(x, f, stride, is_valid) "
                                       "or conv2d(x, f, b, stride, is_valid)")
        if stride is not None and is_valid is not None:
            raise InvalidArgumentError(f"conv2d: is_valid is given twice ({stride!r} and "
                                       f"{is_valid!r})")
        b, stride, is_valid = None, b, (stride if stride is not None else is_valid)
    name = "conv2d" if b is None else "conv2d_bias"
    stride = _pair(name, "stride", (1, 1) if stride is None else stride)
    is_valid = _flag(name, "is_valid", True if is_valid is None else is_valid)
    if b is None:
        return _tensor_node(CONV2D, (x, f), (stride, is_valid))
    return _tensor_node(CONV2D_BIAS, (x, f, b), (stride, is_valid))


def conv2d_bias(x, f, b, stride=(1, 1), is_valid: bool = True):
    """2-d convolution plus a bias (DyNet's ``conv2d_bias``): ``conv2d(x, f, stride,
    is_valid)`` with ``b`` (Co,) added to every output position. See ``conv2d``."""
    if b is None:
        raise InvalidArgumentError("conv2d_bias: the bias b is required (use conv2d without "
                                   "one)")
    stride = _pair("conv2d_bias", "stride", stride)
    return _tensor_node(CONV2D_BIAS, (x, f, b),
                        (stride, _flag("conv2d_bias", "is_valid", is_valid)))


# ---- pooling ------------------------------------------------------------------------------------

def _maxpool_fn(x, ksize, stride, is_valid):
    # -inf as the initial value: JAX's max-pooling primitive (padding never wins a max)
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, ksize + (1,), stride + (1,),
                                 _padding(is_valid))


def _check_maxpool(avals, statics):
    x, (ksize, _, is_valid) = _shape(avals[0]), statics
    if len(x) != 3:
        raise ShapeError(f"maxpooling2d: expected an image (rows, cols, channels), got shape "
                         f"{x}")
    if is_valid and (ksize[0] > x[0] or ksize[1] > x[1]):
        raise ShapeError(f"maxpooling2d: window {ksize} is larger than the image {x} "
                         "(VALID padding, is_valid=True: no output)")


MAXPOOLING2D = OpDef("maxpooling2d", _maxpool_fn, CHEAP, check=_check_maxpool)


def maxpooling2d(x, ksize, stride=(1, 1), is_valid: bool = True):
    """2-d max pooling of one image (DyNet's ``maxpooling2d``), per channel.

    ``x`` is an image (H, W, C); ``ksize`` the window (kh, kw) and ``stride`` its step
    (rows, cols), pairs of positive ints. ``is_valid=True`` is VALID padding (windows inside
    the image only: H' = ceil((H - kh + 1) / stride)), False is SAME (H' = ceil(H / stride);
    positions outside the image never win the max). The result has shape (H', W', C). The
    gradient flows to the maximum of each window.
    """
    ksize = _pair("maxpooling2d", "ksize", ksize)
    stride = _pair("maxpooling2d", "stride", stride)
    return _tensor_node(MAXPOOLING2D, (x,),
                        (ksize, stride, _flag("maxpooling2d", "is_valid", is_valid)))


def _kmax_fn(x, k, d):
    moved = jnp.moveaxis(x, d, -1)
    _, idx = jax.lax.top_k(moved, k)  # the k largest, largest first
    kept = jnp.take_along_axis(moved, jnp.sort(idx, axis=-1), axis=-1)  # in their order
    return jnp.moveaxis(kept, -1, d)


def _check_kmax(avals, statics):
    x, (k, d) = _shape(avals[0]), statics
    if len(x) not in (1, 2):
        raise ShapeError(f"kmax_pooling: expected a vector or a matrix, got shape {x}")
    if not 0 <= d < len(x):
        hint = " (a vector has dimension 0 only: pass d=0)" if len(x) == 1 else ""
        raise IndexOutOfRangeError(f"kmax_pooling: dimension {d} is out of range for shape "
                                   f"{x}{hint}")
    if not 1 <= k <= x[d]:
        raise IndexOutOfRangeError(f"kmax_pooling: k={k} is outside [1, {x[d]}] along "
                                   f"dimension {d} of shape {x}")


KMAX_POOLING = OpDef("kmax_pooling", _kmax_fn, CHEAP, check=_check_kmax)


def kmax_pooling(x, k: int, d: int = 1):
    """The ``k`` largest values along dimension ``d``, kept in the order they appear
    (DyNet's ``kmax_pooling``; Kalchbrenner et al. 2014).

    For a matrix (n, m): ``d=1`` keeps the k largest entries of each row, giving (n, k);
    ``d=0`` those of each column, giving (k, m). For a vector (n,), ``d=0`` gives (k,).
    ``k`` must lie in [1, size along d]. The gradient flows to the kept entries; among exact
    ties the earlier entries are kept.
    """
    return _tensor_node(KMAX_POOLING, (x,), (_int("kmax_pooling", "k", k),
                                             _int("kmax_pooling", "d", d)))


# ---- DyNet's 1-d ops over a sentence matrix (d, T) -------------------------------------------

def _filter1d_fn(x, f):
    m = f.shape[1]
    fs = f.reshape(f.shape[0], m, -1)  # (d, m, filters)
    cols = x.shape[1] - m + 1
    windows = jnp.stack([x[:, k:k + cols] for k in range(m)], axis=1)  # (d, m, cols)
    return jnp.einsum("dkt,dkf->ft", windows, fs)


def _check_filter1d(avals, statics):
    x, f = _shape(avals[0]), _shape(avals[1])
    if len(x) != 2 or len(f) not in (2, 3) or f[0] != x[0] or f[1] > x[1]:
        raise ShapeError(f"filter1d_narrow: expected x (d, T) and a filter (d, m) or (d, m, "
                         f"filters) with m <= T, got shapes {x} and {f}")


FILTER1D_NARROW = OpDef("filter1d_narrow", _filter1d_fn, HEAVY, check=_check_filter1d)


def filter1d_narrow(x, f):
    """DyNet's narrow 1-d convolution of a sentence matrix ``x`` (d, T) with a filter ``f``
    (d, m), or a bank of them (d, m, filters): ``out[k, j] = sum_{i, a} x[i, j + a] f[i, a,
    k]`` (no flip, as DyNet's), shape (filters, T - m + 1), filters 1 for a (d, m) filter."""
    return _tensor_node(FILTER1D_NARROW, (x, f), ())


def _fold_rows_fn(x, nrows):
    return x.reshape(x.shape[0] // nrows, nrows, x.shape[1]).sum(axis=1)


def _check_fold_rows(avals, statics):
    x, (nrows,) = _shape(avals[0]), statics
    if len(x) != 2 or nrows < 1 or x[0] % nrows:
        raise ShapeError(f"fold_rows: expected a matrix whose rows divide by nrows={nrows}, "
                         f"got shape {x}")


FOLD_ROWS = OpDef("fold_rows", _fold_rows_fn, CHEAP, check=_check_fold_rows)


def fold_rows(x, nrows: int = 2):
    """Sums of each ``nrows`` consecutive rows of a matrix (DyNet's ``fold_rows``, the
    folding of a dynamic CNN): (d, T) -> (d / nrows, T)."""
    return _tensor_node(FOLD_ROWS, (x,), (_int("fold_rows", "nrows", nrows),))


def _kmh_ngram_fn(x, n):
    cols = x.shape[1] - n + 1
    return sum(x[:, k:k + cols] for k in range(n))


def _check_kmh_ngram(avals, statics):
    x, (n,) = _shape(avals[0]), statics
    if len(x) != 2 or not 1 <= n <= x[1]:
        raise ShapeError(f"kmh_ngram: expected a matrix with at least n={n} columns (n >= 1), "
                         f"got shape {x}")


KMH_NGRAM = OpDef("kmh_ngram", _kmh_ngram_fn, CHEAP, check=_check_kmh_ngram)


def kmh_ngram(x, n: int):
    """Sums of each ``n`` consecutive columns of a matrix (DyNet's ``kmh_ngram``: n-gram
    features of a sentence matrix): (d, T) -> (d, T - n + 1)."""
    return _tensor_node(KMH_NGRAM, (x,), (_int("kmh_ngram", "n", n),))


__all__ = ["conv2d", "conv2d_bias", "filter1d_narrow", "fold_rows", "kmax_pooling", "kmh_ngram",
           "maxpooling2d"]
