"""Exceptions raised by dynax. Construction errors are ``ValueError`` subclasses so that
``except ValueError`` catches every bad-input failure, as with NumPy and JAX, and their
messages end with the user's file:line where the bad call was made."""
import numpy as np

from .sites import user_site


class DynaxError(Exception):
    """Base class of dynax's own errors."""


class _AtUserSite:
    """Mixin: the message ends with the user's file:line (found when the error is made, so the
    hot path of building nodes pays nothing for it)."""

    def __init__(self, message: str = ""):
        self.site = user_site()
        super().__init__(f"{message} [at {self.site}]")


class StaleExpressionError(_AtUserSite, DynaxError, RuntimeError):
    """An expression of a graph that ``dx.renew_cg`` has since replaced was used, or a
    backward pass would run through values computed with parameters changed since."""

    def __init__(self, message: str = "", reason: str | None = None):
        super().__init__(message)
        self.reason = reason  # the cause alone, for a caller that words its own error


class ShapeError(_AtUserSite, DynaxError, ValueError):
    """The shapes given to an operation do not fit together."""


class IndexOutOfRangeError(_AtUserSite, DynaxError, ValueError, IndexError):
    """An index or label given to an operation lies outside the valid range."""


class DTypeError(_AtUserSite, DynaxError, ValueError):
    """A value of an unsupported dtype was given to an operation."""


class NonScalarBackwardError(_AtUserSite, DynaxError, ValueError):
    """``backward()`` was called on an expression with more than one element."""


class InvalidArgumentError(_AtUserSite, DynaxError, ValueError):
    """An argument has an invalid value (an empty list, a probability outside [0, 1), ...)."""


class ArgumentTypeError(_AtUserSite, DynaxError, TypeError, ValueError):
    """An argument has a type the operation does not accept (a ``TypeError``, and a
    ``ValueError`` like every other construction error)."""


class NonFiniteValueError(DynaxError, FloatingPointError):
    """A value or gradient computed by the graph is NaN or infinite
    (``dx.renew_cg(check_validity=True)``)."""


class PrecisionWarning(UserWarning):
    """A value was stored at a lower precision than it came in (dynax computes in float32)."""


_float64_warned = False


def warn_float64_stored_as_float32(what: str, dtype) -> None:
    """Warn, once per process, that a float64 array (under ``jax_enable_x64``, where a JAX
    user may expect float64 math) is stored as float32: parameters and constants are
    float32 in dynax, as in DyNet."""
    global _float64_warned
    if _float64_warned or dtype != np.float64:
        return
    import jax
    if not jax.config.jax_enable_x64:
        return
    _float64_warned = True
    import warnings
    warnings.warn(f"{what}: a float64 array is stored as float32; dynax's parameters and "
                  "constants are float32 (jax_enable_x64 does not change that). This "
                  "warning is shown once.", PrecisionWarning, stacklevel=3)
