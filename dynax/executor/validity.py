"""``renew_cg(check_validity=True)``: stop at the first non-finite value or gradient.

A debugging mode: every batch's outputs (forward) and output cotangents (backward) are read
back and checked, which costs a device-to-host sync per batch. The error names the node's op
and the file:line of user code that built it (recorded at construction in this mode only).
"""
from __future__ import annotations

import numpy as np

from ..errors import NonFiniteValueError


def _first_bad(block: np.ndarray, n: int, neg_inf_ok: bool = False):
    rows = block[:n].reshape(n, -1)
    bad = (np.isnan(rows) | (rows == np.inf) if neg_inf_ok else ~np.isfinite(rows)).any(axis=1)
    return int(np.argmax(bad)) if bad.any() else None


def _raise(g, sig, node, what):
    site = g.node_site.get(node, "<unknown>")
    raise NonFiniteValueError(f"non-finite {what} in node {node} ({sig.op.name}) built at {site}")


def check_block(g, arena, start: int, nodes, sig, what: str):
    """Raise if any of the ``len(nodes)`` rows from ``start`` of ``arena`` is non-finite."""
    n = len(nodes)
    i = _first_bad(np.asarray(arena[start:start + n]), n, what == "value" and sig.op.neg_inf_ok)
    if i is not None:
        _raise(g, sig, nodes[i], what)


def check_forward(engine, g, plan):
    for nodes in plan:
        sig = g.node_sig[nodes[0]]
        for j, a in enumerate(sig.out_akeys):
            start = g.val_row[g.node_out[nodes[0]] + j]
            check_block(g, engine.arenas[a], start, nodes, sig, "value")


def check_argument_grads(g, grads, sig, nodes, gflags):
    """After a batch's backward: the cotangents it added to its arguments are finite. Its
    output cotangents were checked before it ran, so a non-finite one here is its own op's
    doing (``l2_norm`` of a zero vector), not that of the node that holds the argument."""
    for k, (a, flag) in enumerate(zip(sig.in_akeys, gflags)):
        if flag:
            rows = np.array([g.val_row[g.node_vals[nd][k]] for nd in nodes], np.int32)
            i = _first_bad(np.asarray(grads[a][rows]), len(nodes))
            if i is not None:
                _raise(g, sig, nodes[i], f"gradient (its backward's, for argument {k})")


def check_param_grads(g, sig, nodes):
    for p in sig.params:
        if not np.isfinite(np.asarray(p._grad)).all():
            _raise(g, sig, nodes[0], f"gradient of parameter {p.name}")
