"""Elements per value of each interned shape (``AKEY_SIZE``). What a signature's lane costs
(``Signature.lane_work``, which sizes a batch's padding in ``engine._lanes`` and how hard XLA
optimises its kernels in ``kernels._jit``) is computed with its kernel family
(``registry._new_signature``)."""
from __future__ import annotations

import numpy as np

from ..ops.registry import AKEY_AVAL


class _AkeySizes(dict):
    def __missing__(self, akey):
        size = self[akey] = int(np.prod(AKEY_AVAL[akey].shape, dtype=np.int64))
        return size


AKEY_SIZE = _AkeySizes()  # akey -> elements per value
