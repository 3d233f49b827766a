"""Op definitions and signatures.

An op is ONE pure single-instance JAX function plus its batching contract, kept as data
(an ``OpDef``). Each argument position of a node has a *kind*:

* ``'v'`` a per-instance value (an Expression): stacked across the batch (vmap axis 0);
* ``'p'`` a shared Parameter: passed once to the whole batch (vmap ``in_axes=None``);
* ``'i'`` per-instance integer data known at construction (an index or a label): it travels
  to the kernel in the batch's int packet, so different indices still batch together;
* ``'s'`` a static Python value (a scalar, a string): part of the signature.

A ``Signature`` interns everything that must agree for two nodes to run in one kernel:
op, kinds, statics, per-instance argument shapes/dtypes and shared-parameter identities.
Output shapes come from ``jax.eval_shape`` of the op function, cached with the signature,
so no op has a hand-written shape rule and the cost is paid once per signature.
"""
from __future__ import annotations

import itertools
import numbers
import threading
import weakref
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ArgumentTypeError, DynaxError, IndexOutOfRangeError, ShapeError
from .index_uses import index_bounds

CHEAP, HEAVY = 0, 1
INDEX_LIMIT = 2**31 - 1  # int32: the bound of an 'i' argument with no op-specific one


class OpDef:
    """One operation: its single-instance math and its batching contract.

    It also keeps what is interned for it: its signatures without parameters, its kernel
    families and its node appenders. A ``@dx.function`` the user drops (one defined per
    model, a closure) goes with them; signatures with parameters are kept by their first
    parameter instead (``signature_table``), so a dropped model goes with its own."""

    __slots__ = ("name", "fn", "stacked", "cost", "check", "index_bounds", "row_gather",
                 "part", "neg_inf_ok", "stops_gradient", "sequence_step", "user_function",
                 "signatures", "kernel_families", "appenders", "__weakref__")

    def __init__(self, name: str, fn: Callable, cost: int = CHEAP,
                 check: Callable | None = None, index_bounds: Callable | None = None,
                 row_gather: bool = False, neg_inf_ok: bool = False,
                 stops_gradient: bool = False, stacked: Callable | None = None,
                 part: Callable | None = None):
        self.name = name
        # single-instance JAX function: positional args in node order -> array or tuple
        self.fn = fn
        # A list op's ``fn`` over its items stacked, ``stacked(X, *rest)`` (``X``: the value
        # arguments, all of one shape, stacked on a new axis 0; ``rest``: the arguments after
        # them): kernels read such a list as one block of rows (``kernels._stacked_list``)
        self.stacked = stacked
        self.cost = cost  # agenda tie-break: cheap ops run before heavy ones
        # (avals by position, statics) -> None; raises ShapeError
        self.check = check
        # (avals by position) -> upper bound per 'i' arg; None: every 'i' arg is any
        # non-negative int32 (a dx.function's per-instance integers)
        self.index_bounds = index_bounds
        # The op is ``table[i]`` on a shared table: its backward scatter-adds the row
        # cotangents into the table's gradient in place instead of materialising a dense
        # table cotangent (measured: 20000x300 embedding, ~2 dense passes per lookup batch).
        self.row_gather = row_gather
        # The op takes a part of its one tensor argument ``x`` (its others are ints and
        # statics): ``part(rows, ints, statics)`` indexes the lanes' parts in the arena of
        # ``x``, lane axis first, from their rows and 'i' arguments (arrays over lanes).
        # Kernels read just that and scatter-add the cotangents back there
        # (``kernels._reads_part``); the general path gathers ``x`` whole for each lane
        # (1,000 picks from two 1 MB vectors: a 1 GB gather and a 1 GB cotangent)
        self.part = part
        # -inf is a legitimate value of this op (a masked log-probability): the validity
        # mode (``renew_cg(check_validity=True)``) lets it pass, and still stops at NaN, +inf
        self.neg_inf_ok = neg_inf_ok
        # No gradient flows back through it (nobackprop): backward counts its input as
        # unread by it (``engine._loss_ancestors``), so what only it reads is not
        # differentiated
        self.stops_gradient = stops_gradient
        # An RNN's step (``dx.nn``'s cells): a lone batch of it continuing a sequence in
        # its forward pass runs through its size's run kernel (``engine._chain_step``)
        self.sequence_step = False
        # A ``@dx.function``'s op (``ops/function.py``): its static ints are checked
        # against what they index (``_check_static_indices``); built-in ops check theirs
        self.user_function = False
        self.signatures: dict = {}  # key -> Signature, for keys without a parameter
        self.kernel_families: dict = {}  # kernel key -> the family's Signature
        self.appenders: dict = {}  # kinds -> generated node appender (graph/appenders.py)

    # Identity semantics (object's): each operation has one OpDef, and a node's signature
    # key is hashed on every node built; hashing the fields cost up to 1 us.

    def __repr__(self):
        return f"OpDef({self.name!r})"


def reads_part(op: OpDef, kinds: str) -> bool:
    """Whether ``op``'s nodes of ``kinds`` are a part of their one value argument, and
    kernels read just that part (``OpDef.part``)."""
    return op.part is not None and kinds[0] == "v" and "v" not in kinds[1:] \
        and "p" not in kinds


# ---- abstract values: interned (shape, dtype) keys, one arena per key -------------------

_AKEYS: dict[tuple, int] = {}
AKEY_AVAL: list[jax.ShapeDtypeStruct] = []
AKEY_SIZE: list[int] = []  # akey -> elements per value (padding, arena rows, lane work)
# Interning is shared by every thread's graphs: a new id is its table's length, so making
# one must not interleave with another thread's (two shapes or signatures with one id would
# batch together). Lookups of existing ids stay lock-free.
_INTERN_LOCK = threading.RLock()


def akey_of(shape: tuple, dtype) -> int:
    """Interned id of a per-instance (shape, dtype); values with one id share an arena."""
    k = (tuple(shape), np.dtype(dtype))
    a = _AKEYS.get(k)
    if a is None:
        with _INTERN_LOCK:
            a = _AKEYS.get(k)
            if a is None:
                AKEY_AVAL.append(jax.ShapeDtypeStruct(k[0], k[1]))
                AKEY_SIZE.append(int(np.prod(k[0], dtype=np.int64)))
                a = _AKEYS[k] = len(AKEY_AVAL) - 1
    return a


# ---- signatures ---------------------------------------------------------------------------

class Signature:
    """Everything nodes must share to run as one batched kernel (interned, global)."""

    __slots__ = ("sid", "op", "kinds", "statics", "params", "param_pos", "in_akeys",
                 "out_akeys", "multi", "bounds", "n_ints", "kernels", "has_params",
                 "values_only", "family", "param_elements", "value_elements", "lane_work",
                 "repeats", "last_used", "__weakref__")

    def __init__(self, sid, op, kinds, statics, params, param_pos, in_akeys, out_akeys,
                 multi, bounds):
        self.sid = sid
        self.op: OpDef = op
        self.kinds: str = kinds
        self.statics: tuple = statics  # static values in 's' order
        self.params: tuple = params  # distinct shared Parameters
        self.param_pos: tuple = param_pos  # for each 'p' position: index into params
        self.in_akeys: tuple = in_akeys  # akey of each 'v' argument
        self.out_akeys: tuple = out_akeys  # akey of each output
        self.multi: bool = multi  # the op returns a tuple
        self.bounds: tuple = bounds  # exclusive upper bound of each 'i' argument
        self.n_ints = kinds.count("i")
        self.has_params = bool(params)
        self.kernels: dict = {}  # executor's cache of jitted kernels (its family's)
        self.family: Signature = self  # what its kernels are compiled from (see below)
        self.last_used = 0  # the pass that last looked up one of its kernels (a family's)
        self.param_elements = 0  # elements of its parameters: about a lane's multiply-adds
        self.value_elements = 1  # elements of a lane's values, read and written
        # a lane's work in elements, its parameters' or its values' (what it reads and
        # writes), whichever is larger: it sizes padding and how hard XLA optimises
        self.lane_work = 1
        # why its forward cannot save vjp residuals (a callback without a JVP rule), or '':
        # training graphs run it values-only, and a backward that needs it says it cannot
        self.values_only = ""
        self.repeats = None  # the executor's RepeatGate (executor/repeats.py), made on use

    def __repr__(self):
        return f"Signature({self.op.name}, {self.kinds}, sid={self.sid})"

    def assemble(self, vals, params, ints):
        """Positional arguments of the op function from the per-kind sequences."""
        args, iv, ip, ii, is_ = [], 0, 0, 0, 0
        for k in self.kinds:
            if k == "v":
                args.append(vals[iv]); iv += 1
            elif k == "p":
                args.append(params[self.param_pos[ip]]); ip += 1
            elif k == "i":
                args.append(ints[ii]); ii += 1
            else:
                args.append(self.statics[is_]); is_ += 1
        return args


_SIDS = itertools.count()  # signature ids, never reused
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every signature still in use (introspection)


def live_signatures() -> list:
    """The signatures still alive (kept by a live op or parameter, or a graph), oldest
    first: for tests and debugging."""
    with _INTERN_LOCK:  # another thread may be adding one
        return sorted(_LIVE, key=lambda s: s.sid)


_FAMILIES: weakref.WeakSet = weakref.WeakSet()  # every kernel family still kept (introspection)


def live_kernel_families() -> list:
    """The kernel families still kept by their ops, oldest first, whether or not a live
    signature shares them (a dropped model's stay with its op): for tests and debugging."""
    with _INTERN_LOCK:  # another thread may be adding one (iterating raised then)
        return sorted(_FAMILIES, key=lambda s: s.sid)


def signature_table(key: tuple) -> dict:
    """Where the signature of ``key = (op, kinds, *items)`` is interned: with its first
    parameter if it has one, else with its op. Nothing global holds a signature, so a
    model or a ``@dx.function`` the user drops is freed with its signatures (a
    hyperparameter sweep in one process)."""
    i = key[1].find("p")
    return key[0].signatures if i < 0 else key[2 + i]._signatures


def static_type(a):
    """What tells apart static arguments that Python finds equal (``3``, ``3.0`` and
    ``True``; ``(3,)`` and ``(3.0,)``), as ``jax.jit`` tells them apart: signature keys end
    with their static arguments' types. NumPy's scalars count as Python's (``np.True_`` as
    ``True``, ``np.float32(0.5)`` as ``0.5``): one signature, as before, where ``jax.jit``
    would compile each type apart."""
    t = type(a)
    if t is tuple:
        return tuple(map(static_type, a))
    kind = _STATIC_KINDS.get(t)
    if kind is None:
        kind = _STATIC_KINDS[t] = next(
            (k for base, k in ((bool, bool), (np.bool_, bool), (numbers.Integral, int),
                               (numbers.Real, float), (numbers.Complex, complex))
             if issubclass(t, base)), t)
    return kind


_STATIC_KINDS: dict = {}  # type -> the kind static_type gives it


def describe(kinds: str, key_items: tuple) -> str:
    """Human-readable argument shapes for error messages."""
    out = []
    for k, item in zip(kinds, key_items):
        if k == "v":
            a = AKEY_AVAL[item]
            out.append(f"{tuple(a.shape)}" + ("" if a.dtype == np.float32 else f":{a.dtype}"))
        elif k == "p":
            out.append(f"{item.name}{tuple(item.shape)}")
        elif k == "i":
            out.append("index")
        else:
            out.append(repr(item))
    return ", ".join(out)


# errors of a function's own code under tracing (TypeErrors to Python, but not shape errors)
_BODY = threading.local()  # depth of op functions being traced for their output shapes


def in_traced_body() -> bool:
    """Whether this thread is tracing an op's function (a ``@dx.function`` body), where
    graph ops must not add nodes."""
    return getattr(_BODY, "depth", 0) > 0


_TRACING_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                   jax.errors.TracerIntegerConversionError, jax.errors.UnexpectedTracerError)


def signature_for(key: tuple) -> Signature:
    """The interned signature for ``key = (op, kinds, *items)``.

    ``items[i]`` is the akey for a 'v' argument, the Parameter for a 'p' argument,
    ``None`` for an 'i' argument and the value itself for an 's' argument; where there are
    's' arguments, one more item follows: their ``static_type``s.
    """
    table = signature_table(key)
    sig = table.get(key)
    if sig is None:
        with _INTERN_LOCK:
            sig = table.get(key)
            if sig is None:
                sig = table[key] = _new_signature(key[0], key[1], key[2:])
    return sig


def _traceable(op: OpDef, avals: list, positions: list):
    """``op.fn`` as a function of its arguments at ``positions`` (to trace), the others
    fixed as in ``avals`` (statics: Python values)."""
    def call(*shaped):
        args = list(avals)
        for i, a in zip(positions, shaped):
            args[i] = a
        return op.fn(*args)
    return call


def _check_static_indices(op: OpDef, kinds: str, avals: list, key_items: tuple) -> None:
    """Refuse a ``@dx.function``'s static Python int that it uses as an index past the
    end: JAX clamps a static index as it does a traced one (``x[4]`` of a 4-vector reads
    ``x[3]``), so ``f(scores, 4)`` would silently train on the last class.

    Each such int is traced once more as an int32, for its signature only; where that
    trace fails, the function needs the value itself (a shape, a loop count) and it is
    not an index. As in Python, ``-n <= i < n`` is in range for an axis of ``n``."""
    for pos, (k, value) in enumerate(zip(kinds, avals)):
        if k != "s" or type(value) is not int:
            continue
        traced = [j for j, kj in enumerate(kinds) if kj != "s" or j == pos]
        shaped = [jax.ShapeDtypeStruct((), np.int32) if j == pos else avals[j] for j in traced]
        try:
            closed = jax.make_jaxpr(_traceable(op, avals, traced))(*shaped)
        except Exception:  # noqa: BLE001  (the function needs the int as a Python value)
            continue
        (bound,) = index_bounds(closed, [traced.index(pos)])
        if bound is not None and not -bound <= value < bound:
            raise IndexOutOfRangeError(
                f"{op.name}: index {value} (argument {pos + 1}, a static int) out of range "
                f"[-{bound}, {bound}), what the function indexes with it (arguments: "
                f"{describe(kinds, key_items)}); JAX would clamp it there")


def _new_signature(op: OpDef, kinds: str, key_items: tuple) -> Signature:
    avals, statics, params, param_pos, in_akeys = [], [], [], [], []
    for k, item in zip(kinds, key_items):
        if k == "v":
            in_akeys.append(item)
            avals.append(AKEY_AVAL[item])
        elif k == "p":
            if not any(item is q for q in params):
                params.append(item)
            param_pos.append(next(j for j, q in enumerate(params) if q is item))
            avals.append(jax.ShapeDtypeStruct(item.shape, item.dtype))
        elif k == "i":
            avals.append(jax.ShapeDtypeStruct((), np.int32))
        else:
            statics.append(item)
            avals.append(item)
    if op.check is not None:
        op.check(avals, tuple(statics))
    if op.index_bounds is not None:
        bounds = tuple(op.index_bounds(avals))
    else:  # a dx.function's integers: what they index in its jaxpr, or any int32 (below)
        bounds = (INDEX_LIMIT,) * kinds.count("i")

    shaped_positions = [i for i, k in enumerate(kinds) if k != "s"]
    call = _traceable(op, avals, shaped_positions)

    _BODY.depth = getattr(_BODY, "depth", 0) + 1
    try:
        shaped = [avals[i] for i in shaped_positions]
        if op.index_bounds is None and "i" in kinds:
            closed, out = jax.make_jaxpr(call, return_shape=True)(*shaped)
            found = index_bounds(closed, [j for j, i in enumerate(shaped_positions)
                                          if kinds[i] == "i"])
            bounds = tuple(INDEX_LIMIT if b is None else b for b in found)
        else:
            out = jax.eval_shape(call, *shaped)
        if op.user_function:
            _check_static_indices(op, kinds, avals, key_items)
    except _TRACING_ERRORS as e:  # Python control flow on a traced value: JAX's error
        # and advice, and which function, called how (the message names neither)
        e.add_note(f"dynax: while tracing {op.name}({describe(kinds, key_items)}), which "
                   "runs once per signature on abstract values: branch with jnp.where or "
                   "lax.cond, or decide outside the function on a .value()")
        raise
    except DynaxError:  # a dynax op used inside the body, with its own message
        raise
    except (TypeError, ValueError) as e:  # what JAX raises on incompatible shapes (these
        # exact types); any other exception, a subclass of them included (the function's
        # own check), is the function's and reaches the user as it is
        if type(e) not in (TypeError, ValueError):
            raise
        raise ShapeError(f"{op.name}: incompatible arguments ({describe(kinds, key_items)}): "
                         f"{str(e).splitlines()[0]}") from e
    finally:
        _BODY.depth -= 1
    multi = isinstance(out, (tuple, list))
    outs = tuple(out) if multi else (out,)
    for o in outs:
        if not isinstance(o, jax.ShapeDtypeStruct):
            raise ArgumentTypeError(
                f"{op.name}: outputs must be arrays or a tuple of arrays, got {out!r}")
        if not jnp.issubdtype(o.dtype, jnp.floating):  # values live in float arenas, and
            # gradients flow through every output
            raise ArgumentTypeError(
                f"{op.name}: outputs must be floating-point, got {o.dtype} (shape "
                f"{tuple(o.shape)}); return a float (e.g. .astype(jnp.float32)), or read "
                "integer results such as an argmax from the value on the host")
    out_akeys = tuple(akey_of(o.shape, o.dtype) for o in outs)
    sig = Signature(next(_SIDS), op, kinds, tuple(statics), tuple(params), tuple(param_pos),
                    tuple(in_akeys), out_akeys, multi, bounds)
    # Kernels take parameters as arguments, so signatures that differ only in WHICH
    # parameters (of equal shapes) they use share compiled kernels: the two directions of a
    # BiRNN, stacked layers of one size, per-class softmax matrices. The kernels are
    # compiled from the family's signature, which names no parameter: kernels outlive the
    # model that first compiled them without keeping it alive.
    kernel_key = (kinds, sig.statics, tuple(map(static_type, sig.statics)), sig.in_akeys,
                  sig.param_pos, tuple((p.shape, np.dtype(p.dtype)) for p in params))
    family = op.kernel_families.get(kernel_key)
    if family is None:
        family = Signature(next(_SIDS), op, kinds, sig.statics, (), sig.param_pos,
                           sig.in_akeys, out_akeys, multi, bounds)
        family.has_params = bool(params)
        family.param_elements = sum(int(np.prod(p.shape)) for p in params)
        # a lane's values read and written; a part reads only what it writes (see OpDef)
        read = out_akeys if reads_part(op, kinds) else sig.in_akeys
        family.value_elements = max(1, sum(AKEY_SIZE[a] for a in read + out_akeys))
        family.lane_work = max(family.param_elements, family.value_elements)
        op.kernel_families[kernel_key] = family
        _FAMILIES.add(family)
    sig.family, sig.kernels = family, family.kernels
    sig.param_elements, sig.lane_work = family.param_elements, family.lane_work
    sig.value_elements = family.value_elements
    _LIVE.add(sig)
    return sig
