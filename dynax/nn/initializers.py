"""DyNet's parameter initializers, as ``init=`` callables ``(key, shape) -> array``.

``pc.add_parameters((n, m), init=dx.ConstInitializer(0.5))`` works as in DyNet; any other
callable of that form, an array, a number or a name (``"glorot"``, ...) works too.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from ..ops.core import _real
from .parameters import draw, glorot_scale


class ConstInitializer:
    """Every entry ``c``."""

    def __init__(self, c: float):
        self.c = _real("ConstInitializer", "c", c)

    def __call__(self, key, shape):
        return np.full(shape, self.c, np.float32)


class NormalInitializer:
    """Entries from N(mean, var) (DyNet gives the variance, not the deviation)."""

    def __init__(self, mean: float = 0.0, var: float = 1.0):
        self.mean = _real("NormalInitializer", "mean", mean)
        self.var = _real("NormalInitializer", "var", var, 0.0)

    def __call__(self, key, shape):
        return self.mean + np.sqrt(self.var) * draw(key, shape, "normal")


class UniformInitializer:
    """Entries from U[-scale, scale]."""

    def __init__(self, scale: float):
        self.scale = abs(_real("UniformInitializer", "scale", scale))

    def __call__(self, key, shape):
        return draw(key, shape, "uniform", -self.scale, self.scale)


class GlorotInitializer:
    """Uniform in ``[-s, s]``, ``s = gain * glorot_scale(shape, is_lookup)``, as DyNet's:
    ``sqrt(6 / (fan_in + fan_out))`` for a matrix, receptive-field fans for a 4-d filter
    (``parameters.glorot_scale``); with ``is_lookup`` a table's rows count alone."""

    def __init__(self, is_lookup: bool = False, gain: float = 1.0):
        self.is_lookup = bool(is_lookup)
        self.gain = _real("GlorotInitializer", "gain", gain)

    def __call__(self, key, shape):
        s = self.gain * glorot_scale(shape, self.is_lookup)
        return draw(key, shape, "uniform", -s, s)


class IdentityInitializer:
    """The identity matrix (a square parameter)."""

    def __call__(self, key, shape):
        if len(shape) != 2 or shape[0] != shape[1]:
            raise InvalidArgumentError(f"IdentityInitializer: needs a square matrix, got "
                                       f"shape {tuple(shape)}")
        return np.eye(shape[0], dtype=np.float32)


class NumpyInitializer:
    """The values of an array of the parameter's shape."""

    def __init__(self, array):
        self.array = np.array(array, np.float32)

    def __call__(self, key, shape):
        return self.array
