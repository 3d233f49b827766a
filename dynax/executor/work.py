"""What a signature's lane costs, in elements: it sizes a batch's padding (``engine._lanes``)
and how hard XLA optimises its kernels (``kernels._jit``)."""
from __future__ import annotations

import numpy as np

from ..ops.registry import AKEY_AVAL


class _AkeySizes(dict):
    def __missing__(self, akey):
        size = self[akey] = int(np.prod(AKEY_AVAL[akey].shape, dtype=np.int64))
        return size


AKEY_SIZE = _AkeySizes()  # akey -> elements per value

_PARAM_ELEMENTS: dict = {}  # signature id -> elements of its parameters
_LANE_WORK: dict = {}  # signature id -> lane_work


def param_elements(sig) -> int:
    """Elements of a signature's parameters: per lane, about the multiply-adds of a step."""
    n = _PARAM_ELEMENTS.get(sig.sid)
    if n is None:
        n = _PARAM_ELEMENTS[sig.sid] = sum(int(np.prod(p.shape)) for p in sig.params)
    return n


def lane_work(sig) -> int:
    """A lane's work, in elements: its parameters' (about its multiply-adds) or its values'
    (what it reads and writes), whichever is larger."""
    w = _LANE_WORK.get(sig.sid)
    if w is None:
        values = sum(AKEY_SIZE[a] for a in sig.in_akeys + sig.out_akeys)
        w = _LANE_WORK[sig.sid] = max(1, param_elements(sig), values)
    return w
