"""``Operators``: the arithmetic operators shared by ``Expression`` and ``Parameter``.

Each one builds a node with the matching op function (``a + b`` is ``dx.add(a, b)``). The op
module is bound at the bottom because it imports ``Expression`` itself.
"""
from __future__ import annotations


class Operators:
    """Mixin: ``+ - * / ** @`` (either side may be a Python number for ``+ - * / **``),
    unary ``-`` and ``abs()``, each appending one node to the current graph."""

    __slots__ = ()

    def __add__(self, other):
        return _ops.add(self, other)

    def __radd__(self, other):
        return _ops.add(other, self)

    def __sub__(self, other):
        return _ops.sub(self, other)

    def __rsub__(self, other):
        return _ops.sub(other, self)

    def __mul__(self, other):
        return _ops.mul(self, other)

    def __rmul__(self, other):
        return _ops.mul(other, self)

    def __truediv__(self, other):
        return _ops.div(self, other)

    def __rtruediv__(self, other):
        return _ops.div(other, self)

    def __pow__(self, other):
        from .ops.extra import pow as power  # extra imports core, which imports this module
        return power(self, other)

    def __rpow__(self, other):
        from .ops.extra import pow as power
        return power(other, self)

    def __neg__(self):
        return _ops.negate(self)

    def __abs__(self):
        return _ops.abs(self)

    def __matmul__(self, other):
        return _ops.matmul(self, other)

    def __rmatmul__(self, other):
        return _ops.matmul(other, self)


def bind(ops_module) -> None:
    """Called by ``dynax.ops.core`` once it is loaded."""
    global _ops
    _ops = ops_module


_ops = None
