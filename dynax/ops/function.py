"""``@dx.function``: a user's single-instance JAX function as ONE batchable graph node.

The recursion paper's SubGraph idea: a whole cell (an LSTM step, a Tree-LSTM composition)
becomes one node with one signature, so the autobatcher launches one fused XLA kernel for all
the calls that share it instead of a kernel per primitive op.
"""
from __future__ import annotations

import functools
import numbers
import types

import jax
import numpy as np

from ..errors import ArgumentTypeError
from ..graph.appenders import typed_appender
from ..graph.computation_graph import _local
from ..graph.expression import Expression
from .core import _PARAMETER_TYPES, _node, atomic, input
from .registry import HEAVY, OpDef


_OPS: dict = {}  # fn -> its OpDef, for callables other than plain functions (_op_of)
_OP_ATTR = "__dynax_op__"  # where a plain function keeps its OpDef
_KINDS: dict = {}  # tuple of argument types -> kinds string ("" when no graph argument)
_INT_POSITIONS: dict = {}  # kinds string -> positions of its per-instance integers


def _fast_kinds(types) -> str | None:
    """The kinds of arguments of these exact types, "" if none is an Expression or a
    Parameter (a plain call), None if one needs the general path."""
    kinds = []
    for t in types:
        if t is Expression:
            kinds.append("v")
        elif t in _PARAMETER_TYPES:
            kinds.append("p")
        elif t is int or t is float or t is str:
            kinds.append("s")  # static: part of the signature
        elif issubclass(t, np.integer):
            kinds.append("i")  # per-instance integer data
        else:
            return None
    kinds = "".join(kinds)
    return kinds if "v" in kinds or "p" in kinds else ""


def _op_of(fn) -> OpDef:
    """The one OpDef of ``fn``: wrappers of one fn share signatures and kernels. A plain
    function (a def, a lambda, a closure) keeps its own, so that one the user drops (one
    defined per model) goes with its signatures and kernels (those on a parameter that
    lives on stay with it: ``registry.signature_table``); other callables (bound methods,
    partials) are interned for the process's life."""
    table, key = (fn.__dict__, _OP_ATTR) if type(fn) is types.FunctionType else (_OPS, fn)
    op = table.get(key)
    if op is None:
        op = table[key] = OpDef(getattr(fn, "__qualname__", "function"), fn, HEAVY)
        op.user_function = True
    return op


def _no_appender(g, args):
    return None


class Function:
    """A fused, batchable node type made from a pure single-instance JAX function.

    Calling it with Expressions appends one node (Expressions out; a tuple if ``fn`` returns a
    tuple). Argument kinds: ``Expression`` (and NumPy arrays, as constants) are per-instance,
    ``Parameter``/``LookupParameter`` are shared across the batch, Python scalars, strings,
    ``None`` and tuples of those are static (part of the signature). Called with plain arrays
    (e.g. from inside another ``dx.function`` being traced) it simply runs ``fn``.

    NumPy integer scalars (``np.int32(label)``, an element of an int array) are per-instance
    integer data, as ``jax.jit`` traces them: ``fn`` receives an int32 scalar, and calls that
    differ only in those integers share one signature and run as one kernel (a Python int
    there would be static: one signature, so one batch, per distinct value). They must be
    in ``[0, 2**31 - 1)``; index with them as ``x[i]`` (a dynamic index inside ``fn``).
    JAX clamps an index past the end (``x[10]`` of a 5-vector reads ``x[4]``), so where
    ``fn`` indexes with one as it is (``x[i]``, ``E[i, j]``, ``lax.dynamic_slice``), a call
    with a value past that axis is refused (``ops/index_uses.py``); after arithmetic
    (``x[i + 1]``) it is not checked: check such integers before the call. A static Python
    int that ``fn`` uses as an index is checked the same way (JAX clamps it too), with
    Python's negative indices allowed.
    """

    def __init__(self, fn):
        self.fn = fn
        self.op = _op_of(fn)
        # the op's node appender for the last call's kinds, checking the argument types
        # first (None where they differ) and converting NumPy integers, once there is one
        self._append = _no_appender
        self._typed: dict = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if kwargs:
            from ..nn.parameters import Parameter
            if any(type(a) is Expression or isinstance(a, Parameter)
                   for a in (*args, *kwargs.values())):
                raise ArgumentTypeError(f"{self.op.name}: a dx.function node takes positional "
                                        "arguments only")
            return self.fn(*args, **kwargs)  # a plain call (e.g. inside another traced one)
        g = _local.cg
        if g is not None:  # the usual call: straight to the node's appender
            out = self._append(g, args)
            if out is not None:
                return out
        types = tuple(map(type, args))
        # Expressions, Parameters and plain static scalars: kinds cached per pattern of
        # argument types (one dict lookup instead of a branch per argument)
        kinds = _KINDS.get(types)
        if kinds is None:
            kinds = _fast_kinds(types)
            if kinds is None:
                from ..nn.parameters import Parameter
                if not any(t is Expression or issubclass(t, Parameter) for t in types):
                    # no graph argument (JAX arrays: a call inside a traced dx.function):
                    # straight to fn, one frame per level of a recursion
                    return self.fn(*args)
                return self._call_general(args)
            _KINDS[types] = kinds
            _INT_POSITIONS[kinds] = tuple(i for i, k in enumerate(kinds) if k == "i")
        if not kinds:
            return self.fn(*args)  # no graph argument: a plain call
        ints = _INT_POSITIONS.get(kinds)
        if ints:  # NumPy integers as plain ints, which the appenders check against the bound
            args = list(args)
            for i in ints:
                args[i] = int(args[i])
        out = _node(self.op, kinds, args)
        if kinds in self.op.appenders:  # made by this call if it was the first
            append = self._typed.get(kinds)
            if append is None:
                append = self._typed[kinds] = typed_appender(self.op, kinds)
            self._append = append
        return out

    @atomic
    def _call_general(self, args):
        from ..nn.parameters import Parameter
        kinds, items, graph_mode = [], [], False
        for a in args:
            if type(a) is Expression:
                kinds.append("v"); items.append(a); graph_mode = True
            elif isinstance(a, Parameter):
                kinds.append("p"); items.append(a); graph_mode = True
            elif isinstance(a, jax.Array):  # includes tracers
                kinds.append("a"); items.append(a)
            elif isinstance(a, np.integer):
                kinds.append("i"); items.append(int(a))
            elif isinstance(a, np.ndarray):
                kinds.append("n"); items.append(a)
            elif a is None or isinstance(a, (str, numbers.Number, tuple, np.bool_)):
                try:
                    hash(a)
                except TypeError:
                    raise ArgumentTypeError(f"{self.op.name}: static argument {a!r} is not hashable"
                                            ) from None
                kinds.append("s"); items.append(a)
            else:
                raise ArgumentTypeError(
                    f"{self.op.name}: unsupported argument of type {type(a).__name__}")
        if not graph_mode:
            return self.fn(*args)  # plain JAX call (nested inside a traced dx.function)
        for i, k in enumerate(kinds):
            if k == "a":
                raise ArgumentTypeError(f"{self.op.name}: argument {i} is a JAX array mixed with "
                                        "Expressions; wrap constants with dx.input")
            if k == "n":
                kinds[i], items[i] = "v", input(items[i])
        return _node(self.op, "".join(kinds), items)

    def __repr__(self):
        return f"dx.function({self.op.name})"


def function(fn) -> Function:
    """Decorator: make ``fn`` a fused, batchable graph node (see ``Function``)."""
    return Function(fn)
