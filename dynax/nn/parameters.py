"""Parameters and the collection that owns them.

A ``Parameter`` holds a JAX array and its accumulated gradient. It is a *shared* argument
of every node it appears in: one copy serves the whole batch, and its gradient is the sum
over lanes. A ``LookupParameter`` is a table whose rows are read with ``E[i]``; it records
which rows were used so trainers can update only those.
"""
from __future__ import annotations

import math
import numbers
import operator
import re

import jax
import jax.numpy as jnp
import numpy as np

from ..device import get_device, zeros
from ..errors import (ArgumentTypeError, IndexOutOfRangeError, InvalidArgumentError,
                      warn_float64_stored_as_float32)
from ..operators import Operators

INITS = ("glorot", "normal", "uniform", "zeros", "ones")


def _real_array(value, what: str) -> np.ndarray:
    """``value`` as a float32 NumPy array; a clear error for non-real data."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{what}: cannot make an array of "
                                   f"{type(value).__name__} ({e})") from None
    if not (jnp.issubdtype(arr.dtype, jnp.floating) or np.issubdtype(arr.dtype, np.integer)
            or arr.dtype == np.bool_):
        raise InvalidArgumentError(f"{what}: expected real numbers, got dtype {arr.dtype} "
                                   f"(shape {arr.shape})")
    warn_float64_stored_as_float32(what, arr.dtype)
    return arr.astype(np.float32)


def _real_number(what: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not np.isfinite(x):
        raise InvalidArgumentError(f"{what}: expected a finite number, got {x!r}")
    return float(x)


def glorot_scale(shape, is_lookup: bool = False) -> float:
    """Half-width of DyNet's (2.1) Glorot uniform init: ``sqrt(6 / (fan_in + fan_out))``
    for a matrix, ``sqrt(3 * d / sum(dims))`` for the ``d`` dimensions of a vector or a
    3-d tensor, and for a 4-d convolution filter ``(rows, cols, in, out)`` the fans times
    its receptive field, ``sqrt(6 / (rows * cols * (in + out)))``. With ``is_lookup`` a
    table's rows count alone (``dims`` without the vocabulary)."""
    dims = tuple(shape[1:]) if is_lookup and len(shape) > 1 else tuple(shape)
    if len(dims) == 4:
        return float(np.sqrt(6.0 / (dims[0] * dims[1] * (dims[2] + dims[3]))))
    return float(np.sqrt(3.0 * len(dims) / sum(dims)))


DRAW_MIN = 1 << 10  # the shortest flat draw of ``draw``


def draw(key, shape, dist: str, lo: float = 0.0, hi: float = 1.0) -> np.ndarray:
    """``jax.random.uniform(key, shape, float32, lo, hi)`` (``dist="uniform"``) or
    ``jax.random.normal(key, shape, float32)`` (``"normal"``), as a NumPy array.

    Drawn as a flat vector whose length is a power of two (at least ``DRAW_MIN``) and cut on
    the host: JAX compiles its random functions anew for each shape (0.1-0.2 s each on a
    CPU, most of a small model's set-up), so this compiles them once per length instead.
    Under JAX's default threefry (``jax_threefry_partitionable``) an element's bits follow
    its flat index alone, so the uniform values equal a direct draw's and the normal ones
    agree with it to an ulp.
    """
    size = math.prod(shape)
    n = max(DRAW_MIN, 1 << (size - 1).bit_length())
    if dist == "uniform":
        flat = jax.random.uniform(key, (n,), jnp.float32, lo, hi)
    elif dist == "normal":
        flat = jax.random.normal(key, (n,), jnp.float32)
    else:
        raise ValueError(f"draw: unknown distribution {dist!r}")
    return np.asarray(flat)[:size].reshape(shape)


def _init_array(init, key, shape, dtype):
    if callable(init) and not isinstance(init, (np.ndarray, jax.Array)):
        arr = _real_array(init(key, shape), "add_parameters: init callable's result")
        if arr.shape != tuple(shape):
            raise InvalidArgumentError(f"add_parameters: init callable returned shape "
                                       f"{arr.shape}, expected {tuple(shape)}")
        return jnp.asarray(arr)  # a new array: the parameter never shares the caller's
    if isinstance(init, numbers.Real) and not isinstance(init, bool):  # DyNet: a constant
        return np.full(shape, float(init), dtype)
    if isinstance(init, (np.ndarray, jax.Array, list, tuple)):
        arr = _real_array(init, "add_parameters: init array")
        if arr.shape != tuple(shape):
            raise InvalidArgumentError(f"add_parameters: init array has shape {arr.shape}, "
                                       f"expected {tuple(shape)}")
        return jnp.asarray(arr)
    # NumPy arrays: the caller's device_put compiles nothing (jnp.zeros would, per shape)
    if init == "glorot":
        scale = glorot_scale(shape)
        return draw(key, shape, "uniform", -scale, scale)
    if init == "normal":
        return draw(key, shape, "normal")
    if init == "uniform":
        return draw(key, shape, "uniform", -0.1, 0.1)
    if init == "zeros":
        return np.zeros(shape, dtype)
    if init == "ones":
        return np.ones(shape, dtype)
    raise InvalidArgumentError(f"add_parameters: unknown init {init!r}; use one of {INITS}, "
                               "a number, an array of the right shape or a callable "
                               "(key, shape) -> array")


class Parameter(Operators):
    """A trainable array, usable directly inside expressions (``W @ x``)."""

    __slots__ = ("name", "shape", "dtype", "_value", "_grad", "_has_grad", "_exported",
                 "updated", "_signatures", "__weakref__")

    def __init__(self, name: str, value: jax.Array):
        self.name = name
        self.shape = tuple(value.shape)
        self.dtype = value.dtype
        self._value = value
        self._grad = None
        self._has_grad = False
        # Trainers update values in place (the old array is donated to the step); once the
        # user holds the current array (``value``), the next update works on a copy instead.
        self._exported = False
        self.updated = True  # trainers skip it when False (DyNet's set_updated)
        # the signatures of nodes whose first parameter it is (registry.signature_table):
        # they go when it does
        self._signatures: dict = {}

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r}, shape={self.shape})"

    # ---- value and gradient ------------------------------------------------------------------
    @property
    def value(self) -> jax.Array:
        """The current array (stays valid: the next update leaves it alone)."""
        self._exported = True
        return self._value

    def _own_value(self) -> jax.Array:
        """The current array, safe to donate: copied first if the user holds it."""
        if self._exported:
            self._value = jnp.array(self._value, copy=True)
            self._exported = False
        return self._value

    def set_value(self, array) -> None:
        """Replace the value with ``array`` (same shape)."""
        arr = _real_array(array, f"set_value of {self.name}")
        if arr.shape != self.shape:
            raise InvalidArgumentError(
                f"set_value: {self.name} has shape {self.shape}, got {arr.shape}")
        self._value = jax.device_put(arr, get_device())

    def npvalue(self) -> np.ndarray:
        """A NumPy copy of the current value."""
        return np.array(self._value)

    as_array = npvalue  # DyNet's name

    def grad_as_array(self) -> np.ndarray:
        """A NumPy copy of the accumulated gradient (DyNet's name)."""
        return np.array(self.grad)

    def scale(self, s: float) -> None:
        """Multiply the value by ``s`` (DyNet's ``scale``)."""
        self.set_value(np.asarray(self._value) * _real_number("scale", s))

    def clip_inplace(self, left: float, right: float) -> None:
        """Clip every entry of the value to ``[left, right]`` (DyNet's ``clip_inplace``)."""
        lo, hi = _real_number("clip_inplace", left), _real_number("clip_inplace", right)
        if lo > hi:
            raise InvalidArgumentError(f"clip_inplace of {self.name}: left {lo} > right {hi}")
        self.set_value(np.clip(np.asarray(self._value), lo, hi))

    def set_updated(self, updated: bool) -> None:
        """Freeze (``False``) or unfreeze the parameter, as DyNet's ``set_updated``: trainers
        leave a frozen parameter's value alone and drop the gradient it accumulates, and it
        takes no part in gradient clipping. Its optimizer state is dropped with it: after
        unfreezing, its moments start again from zero (the others keep theirs)."""
        if not isinstance(updated, (bool, np.bool_)):
            raise InvalidArgumentError(f"set_updated of {self.name}: expected a bool, got "
                                       f"{updated!r}")
        self.updated = bool(updated)

    def is_updated(self) -> bool:
        """Whether trainers update this parameter (see ``set_updated``)."""
        return self.updated

    @property
    def grad(self) -> jax.Array:
        """The gradient accumulated by ``backward()`` since the last update (a copy)."""
        if self._grad is None:
            return jnp.zeros(self.shape, self.dtype)
        return jnp.array(self._grad, copy=True)

    def _grad_buffer(self) -> jax.Array:
        """The live gradient buffer (donated to backward kernels)."""
        if self._grad is None:
            self._grad = zeros(self.shape, self.dtype)
        return self._grad

    def _accumulate(self, new_grad, sig, graph, nodes) -> None:
        self._grad = new_grad
        self._has_grad = True

    def zero_grad(self) -> None:
        """Forget the accumulated gradient."""
        self._grad = None
        self._has_grad = False

    # ---- in expressions (operators from ``Operators``: it joins the current graph by itself) --
    def expr(self, update: bool = True):
        """The parameter as an Expression of the current graph; with ``update=False``
        (DyNet's), one no gradient flows back from (``dx.const_parameter``)."""
        if _ops._flag_arg(f"expr of {self.name}", "update", update):
            return _ops.parameter(self)
        from ..ops.extra import const_parameter
        return const_parameter(self)

    def __getitem__(self, i):
        """``W[i]`` / ``W[a:b]``: as on the parameter's expression (``pick``, ``pick_range``)."""
        return _ops.parameter_item(self, i)

    def __iter__(self):  # indexable, but not a sequence: a node per row behind the user's back
        raise TypeError(f"{type(self).__name__} {self.name} is not iterable: index rows with "
                        "W[i], read the array with npvalue()")

    __array_priority__ = 1000


# writes rows in place: the old table is donated (``Parameter._own_value`` copies it first
# if the user holds it), so one row costs a row, not a round trip of the whole table
_set_rows = jax.jit(lambda table, rows, values: table.at[rows].set(values), donate_argnums=(0,))

_first = operator.itemgetter(0)
ALL_ROWS = None  # marker: every row of a lookup table may have a gradient


class LookupParameter(Parameter):
    """A table of vectors; ``E[i]`` / ``dx.lookup(E, i)`` reads row ``i``."""

    __slots__ = ("touched",)

    def __init__(self, name, value):
        super().__init__(name, value)
        self.touched: set | None = set()  # rows used since the last update; None = all

    def __getitem__(self, i):
        """``E[i]``: row ``i`` of the table as an expression (``dx.lookup``); ``i`` an int
        (a NumPy one too) in ``[0, rows)``. Slices and lists are not rows: look each row up
        (the autobatcher gathers a batch's rows in one kernel)."""
        return _ops._node(_ops.LOOKUP, "pi", (self, i))  # dx.lookup's node, a frame less

    # ---- DyNet's row access ------------------------------------------------------------------
    def _row(self, i, what: str) -> int:
        n = self.shape[0]
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise ArgumentTypeError(f"{what} of {self.name}: a row must be an int, got {i!r}")
        if not 0 <= i < n:
            raise IndexOutOfRangeError(f"{what} of {self.name}: row {i} out of range [0, {n})")
        return int(i)

    def init_row(self, i: int, row) -> None:
        """Set row ``i`` of the table to ``row`` (on the device: the rest stays put)."""
        i = self._row(i, "init_row")
        arr = _real_array(row, f"init_row of {self.name}")
        if arr.shape != self.shape[1:]:
            raise InvalidArgumentError(f"init_row of {self.name}: a row has shape "
                                       f"{self.shape[1:]}, got {arr.shape}")
        self._write_rows(np.array([i], np.int32), arr[None])

    def init_rows(self, rows, values) -> None:
        """Set each of ``rows`` of the table to its row of ``values`` (one per row) in one
        kernel on the device, e.g. to renormalise the rows an update touched. A row given
        twice takes its last value."""
        if isinstance(rows, (str, bytes)) or np.ndim(rows) != 1:
            raise ArgumentTypeError(f"init_rows of {self.name}: rows must be a list of ints, "
                                    f"got {rows!r}")
        idx = np.array([self._row(i, "init_rows") for i in rows], np.int32)
        arr = _real_array(values, f"init_rows of {self.name}")
        if arr.shape != (len(idx),) + self.shape[1:]:
            raise InvalidArgumentError(
                f"init_rows of {self.name}: expected {len(idx)} row(s) of shape "
                f"{self.shape[1:]}, got values of shape {arr.shape}")
        if len(idx):
            _, last = np.unique(idx[::-1], return_index=True)  # a repeated row: its last
            keep = np.sort(len(idx) - 1 - last)               # value (XLA's scatter picks any)
            self._write_rows(idx[keep], arr[keep])

    def _write_rows(self, idx, arr) -> None:
        # distinct rows; their count padded to its bucket with copies of the last one
        # (bounded compiles, as the trainers' row updates); the table is written in place
        from ..executor.buckets import bucket  # the executor package imports this module
        pad = bucket(len(idx)) - len(idx)
        idx = np.concatenate([idx, np.repeat(idx[-1:], pad)])
        arr = np.concatenate([arr, np.repeat(arr[-1:], pad, axis=0)]).astype(self.dtype)
        self._value = _set_rows(self._own_value(), idx, arr)

    def init_from_array(self, array) -> None:
        """Set the whole table (DyNet's name for ``set_value``)."""
        self.set_value(array)

    def row_as_array(self, i: int) -> np.ndarray:
        """A NumPy copy of row ``i``."""
        return np.array(self._value[self._row(i, "row_as_array")])

    def rows_as_array(self, rows) -> np.ndarray:
        """A NumPy copy of the given rows, one per row of the result."""
        return np.array(self._value[np.array([self._row(i, "rows_as_array") for i in rows],
                                             np.int32)])

    def row_grad_as_array(self, i: int) -> np.ndarray:
        """A NumPy copy of row ``i`` of the accumulated gradient."""
        return np.array(self.grad[self._row(i, "row_grad_as_array")])

    def _accumulate(self, new_grad, sig, graph, nodes):
        super()._accumulate(new_grad, sig, graph, nodes)
        if self.touched is None:
            return
        if sig.op is _ops.LOOKUP and sig.kinds == "pi":
            self.touched.update(map(_first, map(graph.node_ints.__getitem__, nodes)))
        else:  # used as a whole inside some other op: any row may have a gradient
            self.touched = ALL_ROWS

    def zero_grad(self):
        """Forget the accumulated gradient and the rows it touched."""
        super().zero_grad()
        self.touched = set()


class ParameterCollection:
    """Owns parameters (and through them their gradients); a named, nestable store."""

    def __init__(self, seed: int = 0, _root=None, _prefix: str = ""):
        self._root = self if _root is None else _root
        self._prefix = _prefix
        if _root is None:
            self._params: list[Parameter] = []
            self._names: dict[str, Parameter] = {}
            self._key = jax.random.PRNGKey(seed)
            self._counter = 0

    def _next_key(self):
        root = self._root
        root._counter += 1
        return jax.random.fold_in(root._key, root._counter)

    def _unique_name(self, name: str | None, kind: str) -> str:
        root = self._root
        base = self._prefix + (name if name else kind)
        if not re.fullmatch(r"[\w./-]+", base):
            raise InvalidArgumentError(
                f"parameter name {base!r} may contain only letters, digits, _ . / -")
        full, i = base, 0
        while full in root._names:
            i += 1
            full = f"{base}_{i}"
        return full

    def _add(self, cls, shape, init, name, kind):
        if isinstance(shape, (int, np.integer)):
            shape = (shape,)
        ok = isinstance(shape, (tuple, list)) and all(
            isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in shape)
        if not ok or not shape or any(s <= 0 for s in shape):
            hint = " (a scalar parameter, as in DyNet: shape (1,))" if ok and not shape else ""
            raise InvalidArgumentError(f"add_parameters: invalid shape {shape!r}; expected "
                                       f"a tuple of positive ints{hint}")
        shape = tuple(int(s) for s in shape)
        full = self._unique_name(name, kind)
        counter = self._root._counter
        try:
            value = _init_array(init, self._next_key(), shape, jnp.float32)
        except BaseException:
            self._root._counter = counter  # a failed call draws no key: later inits unchanged
            raise
        p = cls(full, jax.device_put(value, get_device()))
        self._root._params.append(p)
        self._root._names[full] = p
        return p

    def add_parameters(self, shape, init="glorot", name: str | None = None) -> Parameter:
        """A new parameter of ``shape`` initialised by ``init``: ``"glorot"`` (DyNet's
        uniform Glorot, ``glorot_scale``), ``"normal"`` (standard normal), ``"uniform"``
        (U[-0.1, 0.1]), ``"zeros"``, ``"ones"``, a number (every entry), an array of the
        shape, or a callable ``(key, shape) -> array`` (``dx.GlorotInitializer()``, ...)."""
        return self._add(Parameter, shape, init, name, "param")

    def add_lookup_parameters(self, shape, init="normal", name: str | None = None
                              ) -> LookupParameter:
        """A new lookup table of shape ``(vocab, dim...)``.

        ``init`` defaults to ``"normal"`` (rows of standard normal values), unlike
        ``add_parameters``' ``"glorot"``: a Glorot scale counts the table's rows as fan-in,
        so every embedding would shrink as the vocabulary grows (0.076 for 1000 rows of 50).
        Pass ``init="glorot"`` or any other init to choose."""
        return self._add(LookupParameter, shape, init, name, "lookup")

    def add_subcollection(self, name: str) -> "ParameterCollection":
        """A child collection whose parameters are named ``name/...`` (same store).

        A view of that namespace: the same name twice gives views of one namespace (the
        builders take fresh names, ``lstm``, ``lstm_1``, ...)."""
        if not isinstance(name, str) or not re.fullmatch(r"[\w.-][\w./-]*", name):
            raise InvalidArgumentError(f"add_subcollection: name {name!r} must be non-empty "
                                       "and contain only letters, digits, _ . / -")
        return ParameterCollection(_root=self._root, _prefix=f"{self._prefix}{name}/")

    def parameters(self) -> list[Parameter]:
        """Parameters of this collection (and its children), in creation order."""
        return [p for p in self._root._params if p.name.startswith(self._prefix)]

    def zero_grad(self) -> None:
        """Forget the accumulated gradients of this collection's parameters (and its
        children's). A trainer's update zeroes only those it updates: e.g. a GAN's generator
        step backpropagates into the discriminator too, whose gradient then waits for the
        discriminator's next update unless zeroed (or kept out with ``update=False``)."""
        for p in self.parameters():
            p.zero_grad()

    reset_gradient = zero_grad  # DyNet's name

    def parameters_list(self) -> list[Parameter]:
        """The plain parameters (not lookup tables), in creation order (DyNet's name)."""
        return [p for p in self.parameters() if not isinstance(p, LookupParameter)]

    def lookup_parameters_list(self) -> list[LookupParameter]:
        """The lookup tables, in creation order (DyNet's name)."""
        return [p for p in self.parameters() if isinstance(p, LookupParameter)]

    def parameter_count(self) -> int:
        """Total number of scalars over all parameters."""
        return int(sum(np.prod(p.shape) for p in self.parameters()))

    def __getitem__(self, name: str) -> Parameter:
        """The parameter of this collection called ``name`` (relative to its prefix)."""
        if not isinstance(name, str):
            raise ArgumentTypeError(f"ParameterCollection[...]: a parameter name is a str, "
                                    f"got {name!r}")
        p = self._root._names.get(self._prefix + name)
        if p is None:
            names = [q.name[len(self._prefix):] for q in self.parameters()]
            shown = ", ".join(map(repr, names[:10])) + (", ..." if len(names) > 10 else "")
            raise KeyError(f"ParameterCollection: no parameter {name!r}"
                           f"{f' in {self._prefix[:-1]!r}' if self._prefix else ''}; it has "
                           f"{shown or 'none'}")
        return p

    def save(self, path) -> None:
        """Write all parameter values to ``path`` (see ``dynax.nn.persistence``)."""
        from .persistence import save_parameters
        save_parameters(self.parameters(), path, strip=self._prefix)

    def populate(self, path) -> None:
        """Restore values saved by ``save`` into this identically built collection.

        Raises ``ValueError`` on a missing name or shape mismatch and then changes nothing.
        """
        from .persistence import populate_parameters
        populate_parameters(self.parameters(), path, strip=self._prefix)


from ..ops import core as _ops  # noqa: E402  (imports this module; bound last)
