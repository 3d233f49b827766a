"""``Expression``: a thin handle ``(graph, value id)`` with operators and value accessors."""
from __future__ import annotations

import numbers

import numpy as np

from ..errors import NonScalarBackwardError, ShapeError
from ..ops.registry import AKEY_AVAL
from ..operators import Operators


class Expression(Operators):
    """A lazily computed value of a computation graph.

    Building expressions computes nothing; ``value()``, ``npvalue()``, ``scalar_value()``,
    ``forward()`` and ``backward()`` run the autobatched computation of everything pending.
    """

    __slots__ = ("g", "v")

    def __init__(self, graph, value_id: int):
        self.g = graph
        self.v = value_id

    # ---- static facts ---------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        """The value's shape (known at construction)."""
        return AKEY_AVAL[self.g.val_akey[self.v]].shape

    @property
    def dtype(self):
        """The value's dtype: float32, but what a ``@dx.function`` returns (bfloat16, ...)."""
        return AKEY_AVAL[self.g.val_akey[self.v]].dtype

    def dim(self) -> tuple:
        """DyNet spelling of ``shape``."""
        return self.shape

    def __len__(self):
        s = self.shape
        if not s:
            raise TypeError("len() of a 0-d expression")
        return s[0]

    def __repr__(self):
        return f"Expression(shape={self.shape}, id={self.v})"

    # ---- values -----------------------------------------------------------------------------
    def forward(self) -> "Expression":
        """Compute this expression and everything pending before it."""
        self.g.forward_to(self.v)
        return self

    def npvalue(self) -> np.ndarray:
        """The value as a ``numpy.ndarray`` (the caller's own copy, writable)."""
        return np.array(self.g.read(self.v))

    def value(self):
        """The value: a Python float when it has one element, else a ``numpy.ndarray`` (a
        copy, as ``npvalue``)."""
        a = self.g.read(self.v)
        return float(a.reshape(())) if a.size == 1 else np.array(a)

    def vec_value(self) -> list:
        """The value's elements as a flat list of Python floats (DyNet's ``vec_value``)."""
        return self.g.read(self.v).reshape(-1).tolist()

    def scalar_value(self) -> float:
        """The value of a one-element expression as a Python float."""
        self.g.check_alive()
        if int(np.prod(self.shape)) != 1:  # told before computing anything
            raise ShapeError(f"scalar_value: expression has shape {self.shape}, not one "
                             "element; use value() or npvalue()")
        return float(self.g.read(self.v).reshape(()))

    def backward(self, full: bool = False) -> None:
        """Accumulate d(self)/d(p) into ``p.grad`` of every parameter that contributed.

        With ``full`` (DyNet's), the pass also computes the gradient of every expression
        the loss depends on, inputs and other constants included, for ``gradient()``; its
        batches that no parameter reaches run backward kernels that recompute their vjp,
        so it costs more than a plain pass."""
        if int(np.prod(self.shape)) != 1:
            raise NonScalarBackwardError(
                f"backward: expression has shape {self.shape}; backward() needs one element "
                "(reduce it first, e.g. with dx.sum_elems)")
        self.g.backward(self.v, bool(full))

    def gradient(self) -> np.ndarray:
        """d(loss)/d(self) from the last ``loss.backward()`` of this graph (DyNet's
        ``gradient``), as an array of this expression's shape. Kept until the next backward
        pass of any graph of this thread; for an expression that depends on no parameter
        (an input), only after ``backward(full=True)``."""
        return self.g.gradient(self.v)

    # ---- operators (``+ - * / @`` and unary ``-`` come from ``Operators``) -----------------
    def __getitem__(self, i):
        """``e[i]`` is ``pick(e, i)``; ``e[a:b]`` is ``pick_range(e, a, b)`` (DyNet's), with
        Python's meaning of omitted and negative bounds, and of a negative ``i`` (``e[-1]``
        is the last element or row; ``pick`` itself takes ``[0, n)`` only, as DyNet's)."""
        if type(i) is slice:
            return _ops.slice_first_dim(self, i)
        if isinstance(i, numbers.Integral) and i < 0 and self.shape and i >= -self.shape[0]:
            i += self.shape[0]
        return _ops.pick(self, i)

    # Not a sequence: iterating would add a pick node per element behind the user's back
    # (``dx.esum(e)`` for ``dx.esum([e])``, ``np.asarray([e1, e2])``).
    def __iter__(self):
        raise TypeError("an Expression is not iterable: pick elements with e[i], or give "
                        "list operations a list of Expressions")

    def __bool__(self):  # ``if e:`` would test the handle, not the value (not computed yet)
        raise TypeError("an Expression has no truth value: read its value with e.value() "
                        "or e.scalar_value() to decide in Python")

    def __array__(self, *args, **kwargs):
        raise TypeError("an Expression is not an array: read its value with e.npvalue(), "
                        "or combine Expressions with dx operations")

    __array_priority__ = 1000  # numpy scalars on the left defer to our operators


from ..ops import core as _ops  # noqa: E402  (imports this module; bound last)
