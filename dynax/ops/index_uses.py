"""What a ``@dx.function``'s per-instance integers index: the bounds their uses imply.

Inside a function an integer indexes as in JAX, where an index past the end is clamped
(``x[10]`` of a 5-vector reads ``x[4]``): a label one past the output layer would silently
train on the last class. So each signature's jaxpr is read once, and an integer used
directly as an index (``x[i]``, ``E[i, j]``, ``lax.dynamic_slice``, a clamping gather, in
nested jits too) gets that axis as its bound, checked when a node is built, as
``dx.pick``'s is. A static Python int is read the same way, traced once more as an int32
for its signature (``registry._check_static_indices``).
Other uses (``x[i + 1]``, ``one_hot(i, n)``, inside ``lax.cond``, ``jnp.take``'s filling
gather, which may mean its out-of-range indices) are left unbounded.
"""
from __future__ import annotations

import numpy as np
from jax.extend import core as jcore
from jax.lax import GatherScatterMode

# calls whose body sees its operands as they are (not loops or branches, where an integer
# may change or be guarded): followed into
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint"})


def index_bounds(closed, positions) -> list:
    """Per integer input of ``closed`` (a ClosedJaxpr) at ``positions``: the exclusive upper
    bound its uses as an index imply (the smallest, if several), or None if it has none."""
    jaxpr = closed.jaxpr
    facts = {jaxpr.invars[p]: ("is", j) for j, p in enumerate(positions)}
    bounds = [None] * len(positions)
    _walk(jaxpr, facts, bounds)
    return bounds


def _walk(jaxpr, facts, bounds):
    """Follow each int through ``jaxpr``: ``facts[var]`` is ("is", j) for a var equal to
    int j, ("neg", j) for ``j < 0``, ("plus", j) for ``j + constant``."""
    def fact(v):
        return None if isinstance(v, jcore.Literal) else facts.get(v)

    def the_int(v):
        f = fact(v)
        return f[1] if f is not None and f[0] == "is" else None

    def bound(j, b):
        if j is not None:
            bounds[j] = b if bounds[j] is None else min(bounds[j], b)

    for e in jaxpr.eqns:
        name, ins, outs = e.primitive.name, e.invars, e.outvars
        if name in ("convert_element_type", "squeeze", "reshape", "broadcast_in_dim") \
                and the_int(ins[0]) is not None and np.prod(outs[0].aval.shape) == 1:
            facts[outs[0]] = ("is", the_int(ins[0]))
        elif name == "lt" and the_int(ins[0]) is not None and isinstance(ins[1], jcore.Literal) \
                and ins[1].val == 0:
            facts[outs[0]] = ("neg", the_int(ins[0]))
        elif name == "add" and len(ins) == 2 and the_int(ins[0]) is not None \
                and isinstance(ins[1], jcore.Literal):
            facts[outs[0]] = ("plus", the_int(ins[0]))
        elif name == "select_n" and len(ins) == 3:
            # x[i]'s wrap of negative indices, (i < 0 ? i + n : i): i itself for i >= 0
            j = the_int(ins[1])
            if j is not None and fact(ins[0]) == ("neg", j) and fact(ins[2]) == ("plus", j):
                facts[outs[0]] = ("is", j)
        elif name == "dynamic_slice":
            for k, v in enumerate(ins[1:]):
                bound(the_int(v), ins[0].aval.shape[k] - e.params["slice_sizes"][k] + 1)
        elif name == "dynamic_update_slice":
            for k, v in enumerate(ins[2:]):
                bound(the_int(v), ins[0].aval.shape[k] - ins[1].aval.shape[k] + 1)
        elif name == "gather" and e.params["mode"] != GatherScatterMode.FILL_OR_DROP:
            # (a filling gather, jnp.take's default, may mean its out-of-range indices)
            dn = e.params["dimension_numbers"]
            if len(dn.start_index_map) == 1 and not dn.operand_batching_dims:
                d = dn.start_index_map[0]
                bound(the_int(ins[1]), ins[0].aval.shape[d] - e.params["slice_sizes"][d] + 1)
        elif name in _CALLS:
            sub = next((p for p in e.params.values()
                        if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))), None)
            sub = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
            if sub is None or len(sub.invars) != len(ins):
                continue
            inner = {iv: fact(ov) for iv, ov in zip(sub.invars, ins) if fact(ov) is not None}
            _walk(sub, inner, bounds)
            for so, o in zip(sub.outvars, outs):
                if not isinstance(so, jcore.Literal) and so in inner:
                    facts[o] = inner[so]
