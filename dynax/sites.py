"""Where user code built a node: file:line outside the dynax package (for error messages)."""
from __future__ import annotations

import os
import sys

import jax
import jaxlib

# dynax's frames, and JAX's: a dynax op that JAX calls (``jax.jit(dx.input)``) was called
# from the user's line that handed it to JAX, not from JAX's tracing machinery
_SKIPPED_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep
                      for f in (__file__, jax.__file__, jaxlib.__file__))


def user_site() -> str:
    """file:line of the innermost caller outside the dynax and JAX packages."""
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_SKIPPED_DIRS):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "<unknown>"
