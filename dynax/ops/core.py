"""Every built-in operation: one single-instance JAX function + its batching contract each.

Public functions coerce their arguments (Expression -> 'v', Parameter -> 'p', Python number
-> static 's', NumPy/JAX array -> a constant input) and append ONE node to the current graph.
Shapes are checked at construction, where the user's line is; a failed call changes nothing.
"""
from __future__ import annotations

import functools
import numbers
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import (ArgumentTypeError, DTypeError, IndexOutOfRangeError, InvalidArgumentError,
                      ShapeError, warn_float64_stored_as_float32)
from ..graph.computation_graph import _local, current_graph
from ..graph.appenders import append_node
from ..graph.expression import Expression
from .registry import CHEAP, HEAVY, INDEX_LIMIT, OpDef, akey_of, in_traced_body

FLOAT = np.dtype(np.float32)


# ---- argument coercion ------------------------------------------------------------------------

def _kind(x, opname):
    """(kind, item) for one argument."""
    t = type(x)
    if t is Expression:
        return "v", x
    if t is float or t is int:  # before the ABC checks below, which can be slow
        return "s", float(x)
    if isinstance(x, Parameter):
        return "p", x
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return "s", float(x)
    if isinstance(x, jax.core.Tracer):
        raise _traced_error(opname)
    if isinstance(x, (np.ndarray, jax.Array)):
        return "v", input(x)
    raise ArgumentTypeError(f"{opname}: unsupported argument of type {type(x).__name__}; "
                            "expected an Expression, a Parameter, a number or an array")


def _traced_error(opname) -> ArgumentTypeError:
    return ArgumentTypeError(
        f"{opname}: dynax ops build graph nodes, so they cannot run on traced JAX values "
        "(inside a @dx.function's body, or under jax.jit / jax.grad); use jax.numpy there, "
        "and draw random values with jax.random from a key passed in as an argument")


def atomic(fn):
    """Make a composite construction all-or-nothing: if it raises, every node and constant
    it added (array operands turned into inputs, list padding, chunk nodes) is removed."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        g = current_graph()
        mark = g.mark()
        g.constructing += 1
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            g.rollback(mark)
            raise
        finally:
            g.constructing -= 1
        if g.immediate_compute and not g.constructing:  # its nodes, once all are built
            g.forward_to()
        return out
    return wrapper


def _apply(op: OpDef, *args):
    """Append one node of ``op`` over ``args`` (kinds inferred); its Expression(s)."""
    kinds = ""
    for a in args:  # fast path: only Expressions and Parameters
        t = type(a)
        if t is Expression:
            kinds += "v"
        elif t in _PARAMETER_TYPES:
            kinds += "p"
        else:
            return _apply_general(op, args)
    return _node(op, kinds, args)


@atomic
def _apply_general(op, args):
    kinds, items = [], []
    for a in args:
        k, it = _kind(a, op.name)
        kinds.append(k)
        items.append(it)
    return _node(op, "".join(kinds), items)


def _node(op: OpDef, kinds: str, items):
    g = _local.cg
    if g is None:  # no graph yet, or the last one ended by dx.release_memory()
        g = current_graph()
    return append_node(g, op, kinds, items)


def _one(x, opname):
    """(kind char, item) for the single tensor argument of an op taking static/int extras."""
    k, item = _kind(x, opname)
    if k == "s":
        raise ArgumentTypeError(f"{opname}: expected an Expression or Parameter, got {x!r}")
    return k, item


def _single(op, x, rest_kinds: str, rest):
    """One node of ``op`` over tensor ``x`` and the int/static ``rest``."""
    t = type(x)
    if t is Expression:
        return _node(op, "v" + rest_kinds, [x, *rest])
    if t in _PARAMETER_TYPES:
        return _node(op, "p" + rest_kinds, [x, *rest])
    return _single_general(op, x, rest_kinds, rest)


@atomic
def _single_general(op, x, rest_kinds, rest):
    k, x = _one(x, op.name)  # an array becomes a constant: removed again if the node fails
    return _node(op, k + rest_kinds, [x, *rest])


@atomic  # an array argument turned into a constant is removed again if the node fails
def _tensor_node(op, tensors, statics):
    """One node of ``op`` over tensor arguments (Expressions, Parameters or arrays, never
    numbers) followed by static ones."""
    kinds, items = "", []
    for t in tensors:
        k, item = _one(t, op.name)
        kinds += k
        items.append(item)
    return _node(op, kinds + "s" * len(statics), items + list(statics))


def _shape(a):
    return () if not hasattr(a, "shape") else tuple(a.shape)


# ---- shape checks (shared by op families) ------------------------------------------------------

def dynet_dims_hint(shapes) -> str:
    """A hint for shapes that DyNet's dimensions equate and NumPy's (dynax's) do not: a
    column ``(n, 1)`` and a vector ``(n,)`` (e.g. an attention context ``H @ softmax(s)``),
    or a scalar ``()`` and a 1-vector ``(1,)``. Empty when there is none."""
    shapes = [tuple(sh) for sh in shapes]
    for sh in shapes:
        if len(sh) == 2 and sh[1] == 1 and ((sh[0],) in shapes or len(shapes) == 1):
            return (f"; DyNet treats a ({sh[0]}, 1) column as the vector ({sh[0]},), dynax "
                    f"(as NumPy) does not: dx.reshape(x, ({sh[0]},)) makes it one")
    if () in shapes and (1,) in shapes:
        return ("; DyNet treats a scalar () and a 1-vector (1,) alike, dynax (as NumPy) does "
                "not: dx.reshape(x, ()) or dx.pick(x, 0) makes the 1-vector a scalar")
    return ""


def _same_or_scalar(name):
    def check(avals, statics):
        shapes = [_shape(a) for a in avals]
        full = [s for s in shapes if s != ()]
        if any(s != full[0] for s in full):
            raise ShapeError(f"{name}: shapes must be equal (or one a scalar), got "
                             f"{', '.join(map(str, shapes))}{dynet_dims_hint(shapes)}")
    return check


def _broadcastable(name):
    """Shapes of ``+ - * /``: equal, one a scalar, or of one rank with each dimension equal
    or 1 on one side (broadcast, as NumPy and DyNet both do). A vector against a matrix is
    refused: DyNet would align the vector with the columns, NumPy with the rows."""
    def check(avals, statics):
        shapes = [_shape(a) for a in avals]
        full = [s for s in shapes if s != ()]
        if len(full) < 2 or full[0] == full[1]:
            return
        a, b = full
        if len(a) == len(b) and all(m == n or m == 1 or n == 1 for m, n in zip(a, b)):
            return
        hint = ""
        if len(a) != len(b):
            hint = ("; a vector is not broadcast against a matrix (DyNet aligns it with the "
                    "columns, NumPy with the rows): reshape it to (n, 1) or (1, n), or use "
                    "dx.colwise_add")
        if name == "cmult" and len(a) == 2 and len(b) in (1, 2) and a[1] == b[0]:
            hint = ("; `*` multiplies elementwise here (as in NumPy), so DyNet's matrix "
                    "product `W * x` is `W @ x`")
        raise ShapeError(f"{name}: shapes must be equal, or of one rank with each dimension "
                         f"equal or 1 on one side (broadcast), or one a scalar; got "
                         f"{', '.join(map(str, shapes))}{hint}")
    return check


def _all_same(name):
    def check(avals, statics):
        shapes = [_shape(a) for a in avals if not isinstance(a, (int, float, str))]
        if any(s != shapes[0] for s in shapes):
            raise ShapeError(f"{name}: all arguments must have the same shape, got "
                             f"{', '.join(map(str, shapes))}{dynet_dims_hint(shapes)}")
    return check


def _vector(name, n=1):
    def check(avals, statics):
        for a in avals[:n]:
            if len(_shape(a)) != 1:
                raise ShapeError(f"{name}: expected a vector, got shape {_shape(a)}"
                                 f"{dynet_dims_hint([_shape(a)])}")
    return check


def _ndim(name, ndims):
    def check(avals, statics):
        if len(_shape(avals[0])) not in ndims:
            raise ShapeError(f"{name}: expected {' or '.join(map(str, ndims))} dimensions, "
                             f"got shape {_shape(avals[0])}")
    return check


def _both(*checks):
    def check(avals, statics):
        for c in checks:
            c(avals, statics)
    return check


def _first_dim_bound(avals):
    return (avals[0].shape[0],)


# ---- constants -------------------------------------------------------------------------------

def input(value) -> Expression:  # noqa: A001  (DyNet's name)
    """A constant (no gradient) from a number or an array; stored as float32.

    Non-finite entries are allowed; non-numeric, complex and object dtypes are not.
    """
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:  # ragged lists, Expressions inside a list, ...
        if isinstance(value, jax.core.Tracer):  # checked here: off the hot path
            raise _traced_error("input") from None
        raise DTypeError(f"input: cannot make an array of {type(value).__name__} ({e})"
                         ) from None
    if arr.dtype == object or arr.dtype.kind in "mM" or not (
            jnp.issubdtype(arr.dtype, jnp.floating) or np.issubdtype(arr.dtype, np.integer)
            or arr.dtype == np.bool_):  # (NumPy counts a timedelta as an integer)
        if isinstance(value, (Parameter, Expression)):
            what = "an Expression" if type(value) is Expression else f"a {type(value).__name__}"
            raise ArgumentTypeError(
                f"input: got {what} of shape {value.shape}, which is already a graph value: "
                "use it in expressions directly (dx.parameter(p) gives a parameter's "
                "expression)")
        raise DTypeError(f"input: unsupported dtype {arr.dtype} (shape {arr.shape}); "
                         "give real numbers (float, int or bool)")
    if arr.size == 0:  # as a slice or a parameter: softmax([]) would compute []
        raise ShapeError(f"input: shape {arr.shape} has no element; an expression has at "
                         "least one element")
    if arr.dtype == np.float64:
        warn_float64_stored_as_float32("input", arr.dtype)
    arr = np.array(arr, dtype=FLOAT)  # a copy: later changes to the caller's array don't leak
    g = current_graph()
    return Expression(g, g.add_constant(arr, akey_of(arr.shape, FLOAT)))


def inputTensor(value, batched: bool = False) -> Expression:  # noqa: N802  (DyNet's name)
    """DyNet's name for ``dx.input``. dynax has no batch dimension (the autobatcher batches
    instances), so ``batched=True`` is refused: build one instance at a time."""
    if batched:
        raise InvalidArgumentError("inputTensor: batched=True has no meaning in dynax; give "
                                   "one instance's array and let the autobatcher batch")
    return input(value)


@atomic  # a refused array's constant is removed again
def inputVector(values) -> Expression:  # noqa: N802  (DyNet's name)
    """DyNet's name for ``dx.input`` of a vector (a list of numbers)."""
    e = input(values)
    if len(e.shape) != 1:
        raise ShapeError(f"inputVector: expected a vector, got shape {e.shape}")
    return e


def scalarInput(value) -> Expression:  # noqa: N802  (DyNet's name)
    """DyNet's name for ``dx.input`` of a number (a 0-d constant)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DTypeError(f"scalarInput: expected a number, got {value!r}")
    return input(float(value))


def _checked_shape(opname, shape, least: int | None = 0) -> tuple:
    """``shape`` (an int or a sequence of ints, each >= ``least`` unless it is None) as a
    tuple."""
    dims = (shape,) if isinstance(shape, numbers.Integral) else shape
    if isinstance(dims, np.ndarray) and dims.ndim == 1:  # e.g. a shape computed with NumPy
        dims = dims.tolist()
    if not isinstance(dims, (tuple, list)) or any(
            isinstance(d, bool) or not isinstance(d, numbers.Integral)
            or (least is not None and d < least) for d in dims):
        at_least = "" if least is None else f" >= {least}"
        raise InvalidArgumentError(f"{opname}: the shape must be an int or a sequence of ints"
                                   f"{at_least}, got {shape!r}")
    return tuple(int(d) for d in dims)


def zeros(shape) -> Expression:
    """A constant of zeros."""
    return input(np.zeros(_checked_shape("zeros", shape), FLOAT))


def ones(shape) -> Expression:
    """A constant of ones."""
    return input(np.ones(_checked_shape("ones", shape), FLOAT))


# ---- elementwise ------------------------------------------------------------------------------

def _unary(name, fn):
    return OpDef(name, fn, CHEAP)


TANH = _unary("tanh", jnp.tanh)
LOGISTIC = _unary("logistic", jax.nn.sigmoid)
RECTIFY = _unary("rectify", jax.nn.relu)
EXP = _unary("exp", jnp.exp)
LOG = _unary("log", jnp.log)
NEGATE = _unary("negate", jnp.negative)
SQUARE = _unary("square", jnp.square)
SQRT = _unary("sqrt", jnp.sqrt)
ABS = _unary("abs", jnp.abs)
IDENTITY = _unary("parameter", lambda x: x)


def tanh(x):
    """Elementwise hyperbolic tangent."""
    return _apply(TANH, x)


def logistic(x):
    """Elementwise sigmoid 1 / (1 + exp(-x))."""
    return _apply(LOGISTIC, x)


def rectify(x):
    """Elementwise ReLU max(x, 0)."""
    return _apply(RECTIFY, x)


def exp(x):
    """Elementwise exponential."""
    return _apply(EXP, x)


def log(x):
    """Elementwise natural logarithm."""
    return _apply(LOG, x)


def negate(x):
    """Elementwise -x."""
    return _apply(NEGATE, x)


def square(x):
    """Elementwise x**2."""
    return _apply(SQUARE, x)


def sqrt(x):
    """Elementwise square root."""
    return _apply(SQRT, x)


def abs(x):  # noqa: A001
    """Elementwise absolute value."""
    return _apply(ABS, x)


def parameter(p):
    """A parameter's value as an expression of the current graph (DyNet's ``parameter``)."""
    return _apply(IDENTITY, p)


@atomic  # a bad index leaves no parameter node behind
def parameter_item(p, i):
    """``p[i]`` / ``p[a:b]`` of a (non-lookup) parameter: as on its expression."""
    return parameter(p)[i]


def _binary(name, fn):
    return OpDef(name, fn, CHEAP, check=_broadcastable(name))


ADD = _binary("add", jnp.add)
SUB = _binary("sub", jnp.subtract)
MUL = _binary("cmult", jnp.multiply)
DIV = _binary("cdiv", jnp.divide)


def _binop(op, a, b):
    if type(a) is Expression and type(b) is Expression:  # the common case, first
        return _node(op, "vv", (a, b))
    number_a, number_b = _is_number(a), _is_number(b)
    if number_a and number_b:
        raise ArgumentTypeError(
            f"{op.name}: at least one argument must be an Expression or Parameter")
    if number_a or number_b:
        return _number_operand(op, a, b)
    return _apply(op, a, b)


def _is_number(x) -> bool:
    t = type(x)
    return t is float or t is int or (isinstance(x, numbers.Real) and t is not bool
                                      and not isinstance(x, (np.ndarray, jax.Array)))


def _number_as_data(x, dtype=FLOAT) -> Expression:
    """The number ``x`` as a 0-d constant of ``dtype`` in the current graph (data, not part
    of a node's signature), so that nodes differing only in the number share a signature
    (one batch, one compilation). Callers are ``@atomic``: a failed node leaves no
    constant behind."""
    g = current_graph()
    return Expression(g, g.scalar_constant(float(x), dtype))


@atomic  # a failed node leaves no constant behind
def _number_operand(op, a, b):
    """``op`` with a number operand given as data (``_number_as_data``), of the other
    operand's dtype: weakly typed, as JAX's Python scalars (``e * 2.0`` of a bfloat16 ``e``
    is bfloat16)."""
    other = b if _is_number(a) else a
    dtype = other.dtype if type(other) is Expression else FLOAT
    if _is_number(a):
        a = _number_as_data(a, dtype)
    if _is_number(b):
        b = _number_as_data(b, dtype)
    return _apply(op, a, b)


def add(a, b):
    """a + b (elementwise; either side may be a Python number)."""
    return _binop(ADD, a, b)


def sub(a, b):
    """a - b (elementwise; either side may be a Python number)."""
    return _binop(SUB, a, b)


def mul(a, b):
    """a * b elementwise (either side may be a Python number)."""
    return _binop(MUL, a, b)


def div(a, b):
    """a / b elementwise (either side may be a Python number)."""
    return _binop(DIV, a, b)


def cmult(a, b):
    """Elementwise product (shapes as for ``*``: equal, broadcast, or one a scalar)."""
    return _binop(MUL, a, b)


def cdiv(a, b):
    """Elementwise quotient (shapes as for ``/``: equal, broadcast, or one a scalar)."""
    return _binop(DIV, a, b)


# ---- dropout, and the seeded draws it shares with noise and the random ops --------------------
# A draw's node carries the graph's seed and its own node id as per-instance ints: its key
# depends on neither the strategy nor the batch, so every strategy draws the same.

def draw_key(seed, node):
    """The PRNG key of a node's draw. Threefry whatever the process's default
    (``jax_default_prng_impl``): an ``rbg`` key's draws differ under ``vmap``, so a batch's
    lanes but the first drew other masks than the same nodes run one by one."""
    return jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), node)


def seed_and_node_bounds(avals):
    """Index bounds of the two ints (seed, node id) of a draw's node."""
    return INDEX_LIMIT, INDEX_LIMIT


@atomic  # a failed node leaves no constant behind
def training_draw(op, x, rate: float, *statics):
    """A node of ``op`` over ``x``, ``(x, seed, node id, rate, *statics)``; ``x`` itself
    when ``rate == 0`` or in a graph built with ``train=False``. The rate is data (a 0-d
    constant, as a number operand of ``*``): a rate on a schedule compiles nothing new."""
    g = current_graph()
    if rate == 0.0 or not g.train:
        return _as_expression(x, op.name)
    k, x = _one(x, op.name)
    return _node(op, k + "iiv" + "s" * len(statics),
                 [x, g.seed, len(g.node_sig), _number_as_data(rate), *statics])


def kept_and_scaled(x, keep, p):
    """Inverted dropout's output: the kept entries scaled by 1/(1-p), the rest zero
    (``keep`` broadcasts against ``x``)."""
    return jnp.where(keep, x / (1.0 - p), 0.0).astype(x.dtype)


def _dropout_fn(x, seed, node, p):
    return kept_and_scaled(x, jax.random.bernoulli(draw_key(seed, node), 1.0 - p, x.shape), p)


DROPOUT = OpDef("dropout", _dropout_fn, CHEAP, index_bounds=seed_and_node_bounds)


def _dropout_rate(opname, p) -> float:
    """``p`` checked as a dropout probability."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p < 1.0:
        raise InvalidArgumentError(f"{opname}: p must be a number in [0, 1), got {p!r}")
    return float(p)


def dropout(x, p: float):
    """Inverted dropout: zero each entry with probability ``p``, scale the rest by 1/(1-p).

    The identity when ``p == 0`` or when the graph was built with ``train=False``. Each node
    draws its mask from a key derived from the graph's seed and its node id, so a fixed seed
    reproduces the masks and batching does not change them. ``p`` is data, not part of the
    node's signature: an annealed rate compiles nothing new.
    """
    return training_draw(DROPOUT, x, _dropout_rate("dropout", p))


# ---- random values (DyNet's random_normal, random_bernoulli, random_uniform, random_gumbel) -----

def _random_op(name, draw):
    """An op of no value arguments: ``(seed, node id, shape, a, b)``, a seeded draw as
    dropout's masks, so batching changes nothing."""
    def fn(seed, node, shape, a, b):
        return draw(draw_key(seed, node), shape, a, b).astype(FLOAT)
    return OpDef(name, fn, CHEAP, index_bounds=seed_and_node_bounds)


RANDOM_NORMAL = _random_op(
    "random_normal", lambda key, shape, mean, std: mean + std * jax.random.normal(key, shape))
RANDOM_BERNOULLI = _random_op(
    "random_bernoulli", lambda key, shape, p, scale: scale * jax.random.bernoulli(key, p, shape))
RANDOM_UNIFORM = _random_op(
    "random_uniform", lambda key, shape, lo, hi: jax.random.uniform(key, shape, minval=lo,
                                                                     maxval=hi))
RANDOM_GUMBEL = _random_op(
    "random_gumbel", lambda key, shape, mu, beta: mu + beta * jax.random.gumbel(key, shape))


MAX_RANDOM_ELEMENTS = 2 ** 31 - 1  # XLA indexes an array's elements with int32


def _random(op, shape, a, b):
    """A node of the random ``op``; ``shape`` a positive int or a sequence of them."""
    if in_traced_body():
        raise _traced_error(op.name)
    dims = _checked_shape(op.name, shape, 1)
    if np.prod(dims, dtype=np.float64) > MAX_RANDOM_ELEMENTS:  # would fail at run time, and
        # take the graph's other values with it
        raise InvalidArgumentError(f"{op.name}: shape {dims} has more than "
                                   f"{MAX_RANDOM_ELEMENTS} elements")
    g = current_graph()
    return _node(op, "iisss", [g.seed, len(g.node_sig), dims, a, b])


def _flag_arg(who, what, v) -> bool:
    """A True/False argument (DyNet's ``update``, ``bias``); anything else, a NumPy bool
    included, is an ``ArgumentTypeError``."""
    if not isinstance(v, bool):
        raise ArgumentTypeError(f"{who}: {what} must be True or False, got {v!r}")
    return v


def _indices_in_range(opname, label: str, idx, n: int) -> None:
    """Each of ``idx`` (a restrict set, a target support) lies in ``[0, n)``; the first
    that does not is named."""
    bad = [i for i in idx if not 0 <= i < n]
    if bad:
        raise IndexOutOfRangeError(f"{opname}: {label} index {bad[0]} out of range [0, {n})")


def _int_list(opname, what, xs) -> tuple:
    """``xs`` as a tuple of ints, checked to be a non-empty list or tuple of them."""
    if not isinstance(xs, (list, tuple)) or not xs or any(
            isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in xs):
        raise InvalidArgumentError(f"{opname}: {what} must be a non-empty list of ints, got "
                                   f"{xs!r}")
    return tuple(int(i) for i in xs)


def _int(opname, what, v) -> int:
    """``v`` as an int (a bool is not one), else a clear error."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InvalidArgumentError(f"{opname}: {what} must be an int, got {v!r}")
    return int(v)


def _real(opname, what, x, low=-np.inf, high=np.inf, low_open=False):
    """``x`` as a float in [low, high] (or (low, high] with ``low_open``), else a clear error."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not np.isfinite(x) \
            or x < low or x > high or (low_open and x == low):
        bound = ""
        if np.isfinite(high):
            bound = f" in [{low}, {high}]"
        elif np.isfinite(low):
            bound = f" above {low}" if low_open else f" of at least {low}"
        raise InvalidArgumentError(f"{opname}: {what} must be a finite number{bound}, got {x!r}")
    return float(x)


def random_normal(shape, mean: float = 0.0, stddev: float = 1.0) -> Expression:
    """Samples of N(mean, stddev^2) of ``shape`` (DyNet's ``random_normal``).

    Random in every graph (``train=False`` included), drawn from the graph's seed and the
    node's id: a fixed ``dx.renew_cg(seed=...)`` reproduces them, under every strategy.
    ``mean`` and ``stddev`` are static (part of the signature), so each new value compiles a
    new kernel; to learn or anneal them, scale and shift a standard sample instead:
    ``mu + dx.cmult(sigma, dx.random_normal(d))``. Inside a ``@dx.function`` body, draw
    with ``jax.random`` from a key passed in.
    """
    return _random(RANDOM_NORMAL, shape, _real("random_normal", "mean", mean),
                   _real("random_normal", "stddev", stddev, 0.0, np.inf))


def random_bernoulli(shape, p: float, scale: float = 1.0) -> Expression:
    """``scale`` with probability ``p``, else 0, per entry (DyNet's ``random_bernoulli``);
    seeded as ``random_normal``."""
    return _random(RANDOM_BERNOULLI, shape, _real("random_bernoulli", "p", p, 0.0, 1.0),
                   _real("random_bernoulli", "scale", scale))


def random_uniform(shape, left: float, right: float) -> Expression:
    """Samples of U[left, right) (DyNet's ``random_uniform``); seeded as ``random_normal``."""
    left = _real("random_uniform", "left", left)
    right = _real("random_uniform", "right", right, left, np.inf)
    return _random(RANDOM_UNIFORM, shape, left, right)


def random_gumbel(shape, mu: float = 0.0, beta: float = 1.0) -> Expression:
    """Samples of Gumbel(mu, beta) (DyNet's ``random_gumbel``; Gumbel-max sampling adds one
    to log-probabilities); seeded as ``random_normal``."""
    return _random(RANDOM_GUMBEL, shape, _real("random_gumbel", "mu", mu),
                   _real("random_gumbel", "beta", beta, 0.0, np.inf, low_open=True))


# ---- linear algebra -----------------------------------------------------------------------------

def _check_matmul(avals, statics):
    a, b = (_shape(x) for x in avals)
    if len(a) not in (1, 2) or len(b) not in (1, 2) or a[-1] != b[0]:
        raise ShapeError(f"matmul: cannot multiply shapes {a} @ {b}")


MATMUL = OpDef("matmul", jnp.matmul, HEAVY, check=_check_matmul)


def matmul(a, b):
    """Matrix-vector or matrix-matrix product ``a @ b``."""
    if not isinstance(a, Expression) and not isinstance(b, Expression):
        _kind(a, "matmul")
    return _apply(MATMUL, a, b)


DOT = OpDef("dot_product", jnp.dot, CHEAP,
            check=_both(_vector("dot_product", 2), _all_same("dot_product")))


def dot_product(a, b):
    """Inner product of two vectors of the same length (a scalar)."""
    return _apply(DOT, a, b)


def _affine(*args):
    out = args[0]  # only a bias: itself, as DyNet's affine_transform({b})
    if len(args) > 1:
        W, x = args[1:3]
        if x.ndim == 2 and out.shape != (W.shape[0], x.shape[1]):
            out = out.reshape(-1, 1)  # a column bias, added to every column (as DyNet's)
    for W, x in zip(args[1::2], args[2::2]):
        out = out + W @ x
    return out


def _check_affine(avals, statics):
    b = _shape(avals[0])
    out = None
    for i in range(1, len(avals), 2):
        W, x = _shape(avals[i]), _shape(avals[i + 1])
        if len(W) != 2 or len(x) not in (1, 2) or W[1] != x[0]:
            raise ShapeError(f"affine_transform: term {i // 2}: W{W} @ x{x} is not a "
                             "matrix-vector or matrix-matrix product")
        if out is not None and (W[0],) + x[1:] != out:
            raise ShapeError(f"affine_transform: term {i // 2}: W{W} @ x{x} has shape "
                             f"{(W[0],) + x[1:]}, the terms before {out}")
        out = (W[0],) + x[1:]
    if out is not None and b != out and not (len(out) == 2 and b in ((out[0],), (out[0], 1))):
        raise ShapeError(f"affine_transform: bias {b} does not fit the products' shape {out} "
                         f"(a matrix product takes a bias of its shape, or a column ({out[0]},) "
                         f"or ({out[0]}, 1) added to every column)")


AFFINE = OpDef("affine_transform", _affine, HEAVY, check=_check_affine)


@atomic
def affine_transform(args):
    """``b + W1 @ x1 + W2 @ x2 + ...`` from the list ``[b, W1, x1, W2, x2, ...]``
    (``[b]`` alone: ``b``, as DyNet's)."""
    if not isinstance(args, (list, tuple)):
        raise ArgumentTypeError(f"affine_transform: expected a list [b, W1, x1, ...], got "
                                f"{type(args).__name__}")
    args = list(args)
    if len(args) % 2 != 1:
        raise InvalidArgumentError(f"affine_transform: expected [b, W1, x1, ...] (odd length), "
                                   f"got {len(args)} items")
    return _apply(AFFINE, *args)


def _transpose_fn(a):
    return a.reshape(1, -1) if a.ndim == 1 else a.T


TRANSPOSE = OpDef("transpose", _transpose_fn, CHEAP, check=_ndim("transpose", (0, 1, 2)))


def _check_permutation(avals, statics):
    shape, dims = _shape(avals[0]), statics[0]
    if sorted(dims) != list(range(len(shape))):
        raise ShapeError(f"transpose: dims {list(dims)} are not a permutation of the "
                         f"{len(shape)} dimensions of shape {shape}")


PERMUTE = OpDef("transpose", lambda a, dims: jnp.transpose(a, dims), CHEAP,
                check=_check_permutation)


def transpose(a, dims=None):
    """Matrix transpose (a vector becomes a 1 x n row, a scalar stays itself); with
    ``dims`` (DyNet's), the dimensions in that order, as ``numpy.transpose``."""
    if dims is None:
        return _apply(TRANSPOSE, a)
    if not isinstance(dims, (list, tuple)) or any(
            isinstance(d, bool) or not isinstance(d, numbers.Integral) for d in dims):
        raise ArgumentTypeError(f"transpose: dims must be a list of ints, got {dims!r}")
    return _single(PERMUTE, a, "s", (tuple(int(d) for d in dims),))


# ---- structure ----------------------------------------------------------------------------------

def _check_concat(avals, statics):
    d = statics[-1]
    given = [_shape(a) for a in avals[:-1]]
    shapes = [s or (1,) for s in given]  # a scalar is a 1-vector, as in DyNet
    nd = len(shapes[0])
    if not 0 <= d < nd:
        cols = " (DyNet's d=1 of vectors: dx.concatenate_cols)" if nd == 1 and d == 1 else ""
        raise ShapeError(f"concatenate: axis d={d} invalid for shapes {given}{cols}")
    for s in shapes:
        if len(s) != nd or s[:d] + s[d + 1:] != shapes[0][:d] + shapes[0][d + 1:]:
            columns = [sh for sh in given if len(sh) == 2 and sh[1] == 1]
            hint = dynet_dims_hint(columns[:1]) if columns and any(
                len(sh) == 1 for sh in given) else ""  # a column among vectors
            raise ShapeError(f"concatenate: shapes {given} differ outside axis {d}{hint}")


def _concat_stacked(X, d):
    """``concatenate`` along ``d`` of the items stacked in ``X`` (all of one shape)."""
    if X.ndim == 1:  # scalars, each a 1-vector
        return X
    s = X.shape[1:]
    return jnp.moveaxis(X, 0, d).reshape(s[:d] + (X.shape[0] * s[d],) + s[d + 1:])


CONCAT = OpDef("concatenate",
               lambda *a: jnp.concatenate([jnp.atleast_1d(x) for x in a[:-1]], axis=a[-1]),
               CHEAP, check=_check_concat, stacked=_concat_stacked)


def concatenate(xs, d: int = 0):
    """Concatenate a list of expressions along axis ``d``. Scalars count as 1-vectors, as
    in DyNet: ``concatenate([dot_product(q, k) for k in keys])`` is the vector of scores."""
    if type(xs) is list and len(xs) > 1 and type(d) is int and d >= 0 \
            and all(type(x) is Expression for x in xs):  # fast path: one node, nothing to undo
        return _node(CONCAT, "v" * len(xs) + "s", xs + [d])
    return _concatenate(xs, d)


@atomic
def _concatenate(xs, d):
    items = _list_args(xs, "concatenate")
    if isinstance(d, bool) or not isinstance(d, numbers.Integral):
        raise ArgumentTypeError(f"concatenate: axis d must be an int, got {d!r}")
    if d < 0:  # counted from the end, as in NumPy
        d += len(_shape(items[0]))
    if len(items) == 1:
        nd = len(_shape(items[0]))
        if not 0 <= d < max(nd, 1):
            raise ShapeError(f"concatenate: axis d={d} invalid for shapes "
                             f"[{_shape(items[0])}]")
        if nd == 0:
            return reshape(items[0], (1,))
        return _as_expression(items[0], "concatenate")
    kinds = "".join("v" if type(x) is Expression else "p" for x in items)
    return _node(CONCAT, kinds + "s", items + [int(d)])


def _as_columns(x):  # DyNet's dimensions: a scalar is {1}, a vector {n} = {n, 1}
    return x.reshape(x.shape[0] if x.ndim else 1, -1)


def _check_concat_cols(avals, statics):
    shapes = [_shape(a) for a in avals]
    if any(len(s) > 2 for s in shapes):
        raise ShapeError(f"concatenate_cols: expected scalars, vectors or matrices, got "
                         f"shapes {shapes}")
    rows = [s[0] if s else 1 for s in shapes]
    if any(r != rows[0] for r in rows):
        raise ShapeError(f"concatenate_cols: the items must have the same number of rows, "
                         f"got shapes {shapes}")


CONCAT_COLS = OpDef("concatenate_cols",
                    lambda *xs: jnp.concatenate([_as_columns(x) for x in xs], axis=1),
                    CHEAP, check=_check_concat_cols)


@atomic
def concatenate_cols(xs):
    """The items side by side as the columns of a matrix (DyNet's): vectors (n,) are
    columns, matrices (n, c) contribute their c columns, scalars make a (1, k) row."""
    items = _list_args(xs, "concatenate_cols")
    kinds = "".join("v" if type(x) is Expression else "p" for x in items)
    return _node(CONCAT_COLS, kinds, items)


PICK = OpDef("pick", lambda x, i: x[i], CHEAP, index_bounds=_first_dim_bound,
             check=_ndim("pick", (1, 2)), part=lambda rows, ints, statics: (rows, *ints))


def _pick_dim_bound(avals):
    return (_shape(avals[0])[avals[2]],)


def _check_pick_dim(avals, statics):
    shape, d = _shape(avals[0]), statics[0]
    if not 0 <= d < len(shape):
        raise ShapeError(f"pick: dim {d} invalid for shape {shape}")


PICK_DIM = OpDef("pick", lambda x, i, d: jax.lax.dynamic_index_in_dim(x, i, d, keepdims=False),
                 CHEAP, index_bounds=_pick_dim_bound, check=_check_pick_dim,
                 part=lambda rows, ints, statics: (rows,) + (slice(None),) * statics[0] + ints)


def pick(x, i, dim: int = 0):
    """Element ``i`` of a vector (row ``i`` of a matrix); with ``dim`` (DyNet's), index
    ``i`` along that dimension: ``pick(M, j, 1)`` is column ``j``."""
    if dim == 0 and type(dim) is int:
        return _single(PICK, x, "i", (i,))
    dim, shape = _int("pick", "dim", dim), _shape(x)
    if type(i) is int and 0 <= dim < len(shape) and not 0 <= i < shape[dim]:  # say which dim
        raise IndexOutOfRangeError(f"pick: index {i} out of range [0, {shape[dim]}) along "
                                   f"dim {dim} of shape {shape}")
    return _single(PICK_DIM, x, "is", (i, dim))


def slice_first_dim(x, s: slice):
    """``x[a:b]`` (``Expression.__getitem__``): ``pick_range`` along the first dimension,
    with Python's (NumPy's) meaning of omitted, negative and out-of-range bounds: they
    clip to the dimension, where ``pick_range`` refuses them. An empty slice is refused
    (there are no empty expressions)."""
    from .extra import pick_range
    shape = _shape(x)
    if not shape:
        raise ShapeError("slice: a scalar has no dimension to slice")
    if s.step not in (None, 1):
        raise InvalidArgumentError(f"slice: only a step of 1 is supported, got {s.step!r}")
    for b in (s.start, s.stop):
        if b is not None and (isinstance(b, bool) or not isinstance(b, numbers.Integral)):
            raise ArgumentTypeError(f"slice: bounds must be ints or None, got {b!r}")
    start, stop, _ = s.indices(shape[0])
    if stop <= start:
        text = ":".join("" if b is None else str(b) for b in (s.start, s.stop))
        raise IndexOutOfRangeError(f"slice: [{text}] of shape {shape} is empty (its bounds "
                                   f"clip to [{start}, {stop})); an expression has at least "
                                   "one element")
    return pick_range(x, start, stop)


def _check_reshape(avals, statics):
    src, dst = _shape(avals[0]), statics[0]
    if int(np.prod(src)) != int(np.prod(dst)):
        raise ShapeError(f"reshape: cannot reshape {src} ({int(np.prod(src))} elements) "
                         f"to {dst} ({int(np.prod(dst))} elements)")


RESHAPE = OpDef("reshape", lambda x, shape: jnp.reshape(x, shape), CHEAP, check=_check_reshape)


def reshape(x, shape):
    """The same elements in a new shape; one dimension may be -1 (inferred, as in NumPy)."""
    shape = _checked_shape("reshape", shape, None)  # -1: the one dimension to infer
    if any(s < 0 for s in shape):
        shape = _infer_dim(_shape(x), shape)
    return _single(RESHAPE, x, "s", (shape,))


def _infer_dim(src, shape):
    """``shape`` with its one -1 replaced by what makes it hold ``src``'s elements."""
    known = int(np.prod([s for s in shape if s >= 0]))
    size = int(np.prod(src))
    if shape.count(-1) != 1 or any(s < -1 for s in shape) or known == 0 or size % known:
        raise ShapeError(f"reshape: cannot reshape {src} ({size} elements) to {shape}")
    return tuple(size // known if s == -1 else s for s in shape)


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


def _stack(xs):
    return jnp.stack(xs)


def _of_stacked(stacked, counted: bool):
    """A list op's function over its items (then the count of real items, if ``counted``)
    from its form over the items stacked (``OpDef.stacked``)."""
    if counted:
        return lambda *a: stacked(_stack(a[:-1]), a[-1])
    return lambda *xs: stacked(_stack(xs))


def _sum_stacked(xs):
    return jnp.sum(xs, axis=0)


def _average_stacked(xs, n):  # n: the count of the original list (the rest is padding)
    return jnp.sum(xs, axis=0) / n


ESUM = OpDef("esum", _of_stacked(_sum_stacked, False), CHEAP, check=_all_same("esum"),
             stacked=_sum_stacked)
AVERAGE = OpDef("average", _of_stacked(_average_stacked, True), CHEAP,
                check=lambda av, st: _all_same("average")(av[:-1], st),
                index_bounds=lambda avals: (INDEX_LIMIT,), stacked=_average_stacked)


def _emax_stacked(xs, n):
    """Max over the first ``n`` items; the padding is masked out, so ties split the
    gradient among the real items only, as ``jnp.max`` does."""
    real = (jnp.arange(xs.shape[0]) < n).reshape((-1,) + (1,) * (xs.ndim - 1))
    return _max_of_real(xs, jnp.broadcast_to(real, xs.shape))


@jax.custom_jvp
def _max_of_real(xs, real):
    return jnp.max(jnp.where(real, xs, -jnp.inf), axis=0)


@_max_of_real.defjvp
def _max_of_real_jvp(primals, tangents):
    # ties split among the real items only: the padding (-inf) would tie too when every
    # real item is -inf (a fully masked max), and take a share of the gradient
    xs, real = primals
    m = _max_of_real(xs, real)
    tied = real & (xs == jnp.expand_dims(m, 0))
    return m, jnp.sum(jnp.where(tied, tangents[0], 0.0), axis=0) / jnp.sum(tied, axis=0)


EMAX = OpDef("emax", _of_stacked(_emax_stacked, True), CHEAP,
             check=lambda av, st: _all_same("emax")(av[:-1], st),
             index_bounds=lambda avals: (INDEX_LIMIT,),  # the count of real items
             stacked=_emax_stacked)


def _list_args(xs, opname):
    items = (Expression, Parameter, np.ndarray, jax.Array)  # Parameter: bound at import's end
    if isinstance(xs, items) or not hasattr(xs, "__iter__"):
        raise ArgumentTypeError(f"{opname}: expected a list of expressions, got "
                                f"{type(xs).__name__}")
    xs = list(xs)
    if not xs:
        raise InvalidArgumentError(f"{opname}: empty list")
    out = []
    for x in xs:
        # numbers (and anything else) are refused here, with a message for lists: _kind's
        # own would offer numbers, which a list op does not take
        k, item = _kind(x, opname) if isinstance(x, items) else ("s", x)
        if k == "s":
            raise ArgumentTypeError(f"{opname}: list items must be Expressions, Parameters or "
                                    f"arrays, got {type(x).__name__} {x!r}")
        out.append(item)
    return out


def _padded(op, xs, pad, extra_kinds="", extra=(), width=None):
    """One node over ``xs`` padded to a power-of-two length (or to ``width``), so lists of
    varying length share a few signatures (bounded compilation)."""
    n = len(xs)
    full = xs + [pad] * ((width or _bucket(n)) - n)
    kinds = "".join("p" if not isinstance(x, Expression) else "v" for x in full)
    return _node(op, kinds + extra_kinds, full + list(extra))


MAX_LIST = 16  # longer lists reduce in chunks: one small kernel per chunk size, batched
# emax takes up to this many items in one node: chunks of a max split the gradient of exact
# ties per chunk (two tied chunks get half each, however many tied items each holds), where
# jnp.max splits it equally among all tied items
EMAX_MAX_LIST = 1024


def _chunked(xs, node, limit=MAX_LIST, wide=True):
    """Reduce a long list in chunks of ``limit``, ``node(chunk, width)`` making one node of
    each, until one node's worth is left; returns that remaining list.

    ``wide``: a short last chunk is padded to ``limit`` items too (``width``), so that the
    chunk nodes share one signature and run as one batch, and every level of every long
    list compiles the same kernels; padded to its power of two, the last chunk was a batch,
    and a kernel, of its own. For short limits (16) only: emax's 1,024 would gather that
    many rows of padding."""
    width = limit if wide else None
    while len(xs) > limit:
        chunks = [xs[i:i + limit] for i in range(0, len(xs), limit)]
        xs = [node(c, width) if len(c) > 1 else c[0] for c in chunks]
    return xs


def _as_expression(x, opname):
    """``x`` (an Expression, a Parameter or an array) as an Expression of the current graph."""
    if type(x) is Expression:
        x.g.check_alive()
        if x.g is not current_graph():
            raise ArgumentTypeError(f"{opname}: the expression belongs to another graph")
        return x
    k, item = _one(x, opname)
    return item if k == "v" else _apply(IDENTITY, item)


def shared_zeros(shape, dtype=FLOAT) -> Expression:
    """The current graph's one zero constant of ``shape`` and ``dtype``, made at its first
    use (list padding, RNN initial states): one node and one row however many ask for it."""
    g = current_graph()
    return Expression(g, g.zero_constant(akey_of(shape, dtype)))


def _zero_like(xs):
    """A list's padding item: of its first item's dtype (a float32 zero among bfloat16
    items made the result float32 at the lengths that were padded)."""
    x = xs[0]
    return shared_zeros(x.shape, x.dtype if type(x) is Expression else FLOAT)


def _name_the_item(opname, items):
    """Called while a list op handles a ShapeError: raise one naming the op and the first
    item whose shape differs from item 0's (the error of the node underneath names a chunk
    node, its padding included), else re-raise. Only on failure: the hot path checks
    nothing extra."""
    first = tuple(items[0].shape)
    bad = next((i for i, x in enumerate(items) if tuple(x.shape) != first), None)
    if bad is None:
        raise  # the error being handled
    other = tuple(items[bad].shape)
    raise ShapeError(f"{opname}: all items must have the same shape; item 0 has shape "
                     f"{first}, item {bad} has {other}{dynet_dims_hint([first, other])}"
                     ) from None


def _list_op(fn):
    """A list operation ``fn(xs)`` over the user's list checked and converted by
    ``_list_args``: all or nothing (``atomic``), and a shape error names the op and the
    offending item (``_name_the_item``)."""
    name = fn.__name__

    @atomic
    @functools.wraps(fn)
    def op(xs):
        items = _list_args(xs, name)
        try:
            return fn(items)
        except ShapeError:
            _name_the_item(name, items)
    return op


def _reduced(xs, node, limit, opname, wide=True):
    """``xs`` reduced by ``node`` in chunks of at most ``limit``, then by one last node
    (a single item is itself); with ``wide``, that node is as wide as the chunks' where
    there were any (``_chunked``)."""
    width = limit if wide and len(xs) > limit else None
    xs = _chunked(xs, node, limit, wide)
    return _as_expression(xs[0], opname) if len(xs) == 1 else node(xs, width)


@_list_op
def esum(xs):
    """Sum of a list of expressions of one shape."""
    return _reduced(xs, _esum_node, MAX_LIST, "esum")


def _esum_node(xs, width=None):
    return _padded(ESUM, xs, _zero_like(xs), width=width)


@_list_op
def average(xs):
    """Mean of a list of expressions of one shape."""
    sums = _chunked(xs, _esum_node)
    return _padded(AVERAGE, sums, _zero_like(sums), "i", (len(xs),),
                   MAX_LIST if len(xs) > MAX_LIST else None)


@_list_op
def emax(xs):
    """Elementwise maximum of a list of expressions of one shape. Exact ties split the
    gradient equally among the tied items, as ``jnp.max`` does (up to EMAX_MAX_LIST items;
    beyond, per chunk of that many)."""
    return _reduced(xs, _emax_node, EMAX_MAX_LIST, "emax", wide=False)


def _emax_node(xs, width=None):  # the count of real items masks the padding
    return _padded(EMAX, xs, _zero_like(xs), "i", (len(xs),), width)


SUM_ELEMS = OpDef("sum_elems", jnp.sum, CHEAP)


def sum_elems(x):
    """Sum of all elements (a scalar)."""
    return _apply(SUM_ELEMS, x)


# ---- distributions and losses -----------------------------------------------------------------

SOFTMAX = OpDef("softmax", lambda x: jax.nn.softmax(x, axis=0), CHEAP,
                check=_ndim("softmax", (1, 2)))
LOG_SOFTMAX = OpDef("log_softmax", lambda x: jax.nn.log_softmax(x, axis=0), CHEAP,
                    check=_ndim("log_softmax", (1, 2)))


def _check_softmax_dim(avals, statics):
    shape, d = _shape(avals[0]), statics[0]
    if len(shape) != 2 or d != 1:
        raise ShapeError(f"softmax: d={d} needs a matrix and d in (0, 1), got shape {shape}")


SOFTMAX_ROWS = OpDef("softmax", lambda x, d: jax.nn.softmax(x, axis=d), CHEAP,
                     check=_check_softmax_dim)


def softmax(x, d: int = 0):
    """Softmax of a vector; of a matrix, of each column (as DyNet's: attention scores as a
    ``(T, 1)`` column normalise over T), or with ``d=1`` (DyNet's ``d``) of each row."""
    if d == 0 and type(d) is int:
        return _apply(SOFTMAX, x)
    return _single(SOFTMAX_ROWS, x, "s", (_int("softmax", "d", d),))


def _restricted_log_softmax(x, keep):
    keep = keep > 0
    z = jax.nn.logsumexp(jnp.where(keep, x, -jnp.inf))
    return jnp.where(keep, x - z, -jnp.inf)


# the kept entries travel as a per-instance 0/1 vector, not as part of the signature: a
# parser's or decoder's valid sets differ at every step, and as static data each new set
# compiled a kernel of its own (~60-90 ms) and kept the steps of different sets apart
RESTRICTED_LOG_SOFTMAX = OpDef("log_softmax", _restricted_log_softmax, CHEAP,
                               check=_all_same("log_softmax"),
                               neg_inf_ok=True)  # the masked entries


def log_softmax(x, restrict=None):
    """Log-softmax of a vector, or of each column of a matrix. With ``restrict`` (DyNet's:
    a list of indices of a vector), normalised over those entries only; the others are
    -inf. Restricted log-softmaxes of one size batch together whatever their index sets."""
    if restrict is None:
        return _apply(LOG_SOFTMAX, x)
    restrict = sorted(set(_int_list("log_softmax", "restrict", restrict)))
    shape = _shape(x)
    if len(shape) != 1:
        raise ShapeError(f"log_softmax: restrict needs a vector, got shape {shape}"
                         f"{dynet_dims_hint([shape])}")
    _indices_in_range("log_softmax", "restrict", restrict, shape[0])
    keep = np.zeros(shape, np.float32)
    keep[restrict] = 1.0
    return _tensor_node(RESTRICTED_LOG_SOFTMAX, (x, keep), ())


PNLS = OpDef("pickneglogsoftmax", lambda x, i: -jax.nn.log_softmax(x)[i], CHEAP,
             check=_vector("pickneglogsoftmax"), index_bounds=_first_dim_bound)


def pickneglogsoftmax(x, label):
    """``-log_softmax(x)[label]``: the cross-entropy loss of one label."""
    return _single(PNLS, x, "i", (label,))


SQDIST = OpDef("squared_distance", lambda a, b: jnp.sum(jnp.square(a - b)), CHEAP,
               check=_all_same("squared_distance"))


def squared_distance(a, b):
    """``sum((a - b)**2)``."""
    return _apply(SQDIST, a, b)


def _bll(p, y):
    # The logs are clamped at log(tiny) (-87.3 in float32), as in DyNet: a saturated
    # prediction (logistic(17) is 1.0 in float32) must not make the loss 0 * log(0) = NaN.
    # log(1 - p) is log1p(-p) for small p, where 1 - p rounds; each branch's argument is
    # clamped so that the branch not taken has a finite derivative too (jnp.where gives it
    # a zero cotangent, and zero times infinity is NaN).
    tiny = jnp.finfo(p.dtype).tiny
    log_p = jnp.log(jnp.maximum(p, tiny))
    log_q = jnp.where(p < 0.5, jnp.log1p(-jnp.minimum(p, 0.5)),
                      jnp.log(jnp.maximum(1.0 - p, tiny)))
    return -jnp.sum(y * log_p + (1.0 - y) * log_q)


BLL = OpDef("binary_log_loss", _bll, CHEAP, check=_same_or_scalar("binary_log_loss"))


def binary_log_loss(p, y):
    """``-sum(y log p + (1 - y) log(1 - p))`` for probabilities ``p`` and targets ``y``; each
    log is at least log of the smallest normal float (-87.3 in float32), as in DyNet, so a
    prediction saturated at exactly 0 or 1 gives a finite loss and gradient."""
    return _apply(BLL, p, y)


def _hinge(x, label, margin):
    violations = jnp.maximum(0.0, margin - x[label] + x)
    # the j == label term masked out, not subtracted: at large scores margin - x + x
    # rounds, and the difference could be negative (x[label] = 1e4: -2e-4)
    return jnp.sum(jnp.where(jnp.arange(x.shape[0]) == label, 0.0, violations))


HINGE = OpDef("hinge", _hinge, CHEAP, check=_vector("hinge"), index_bounds=_first_dim_bound)


def hinge(x, label, margin: float = 1.0):
    """Multi-class hinge loss ``sum_{j != label} max(0, margin - x[label] + x[j])``."""
    return _single(HINGE, x, "is", (label, _real("hinge", "margin", margin)))


# ---- lookup ----------------------------------------------------------------------------------

LOOKUP = OpDef("lookup", lambda E, i: E[i], CHEAP, row_gather=True,
               index_bounds=lambda avals: (avals[0].shape[0],))


def lookup(E, i, update: bool = True):
    """Row ``i`` of a lookup parameter (``E[i]``); with ``update=False`` (DyNet's), no
    gradient flows back into the table from this use."""
    if type(E) not in _PARAMETER_TYPES and not isinstance(E, Parameter):
        raise ArgumentTypeError(f"lookup: the table must be a LookupParameter (or a "
                                f"Parameter), got {type(E).__name__}")
    if update is not True:
        _flag_arg("lookup", "update", update)
        from .extra import const_lookup
        return const_lookup(E, i)
    return _node(LOOKUP, "pi", (E, i))


# imported last: nn.parameters imports this module for its operators
from ..nn.parameters import LookupParameter, Parameter  # noqa: E402

_PARAMETER_TYPES = frozenset((Parameter, LookupParameter))  # exact types: the fast path

from .. import operators as _operators  # noqa: E402

_operators.bind(sys.modules[__name__])
