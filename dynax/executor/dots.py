"""Weight-gradient products laid out for XLA:CPU's fast matmul path.

A batched kernel's weight gradient is ``dW = g^T x`` (``g`` the ``[B, M]`` output cotangents,
``x`` the ``[B, K]`` inputs, summed over the B lanes). ``jax.vjp`` writes it as a product of
``transpose(g)``, and XLA:CPU folds that transpose into the product, which makes the matmul
read its left operand transposed: that form falls off its fast (YNNPACK) path onto Eigen.
Materialising ``g^T`` (an ``optimization_barrier`` stops the fold; the copy is M x B
elements) keeps the product in the fast form.

Measured on this 2-core CPU, one ``[M, B] x [B, K]`` product alone (B = 16-1400 lanes):
M = 512, 1024, 2048 or 4096 rows (LSTM gate matrices), 1.1-2.2x faster at almost every
size tried; other row counts mixed, 0.6-1.5x (M = 10000, a softmax: 0.6-0.96x; M = 450 or
750 with K = 300, the Tree-LSTM's: 0.84-1.8x). Hence the rule: rows a multiple of 512, at
most 4096. Same arithmetic either way; only the memory layout differs.
"""
from __future__ import annotations

import jax
from jax import lax

try:
    from jax.extend.core import Literal
except ImportError:  # older JAX
    from jax.core import Literal

_ROW_STEP, _MAX_ROWS = 512, 4096


def _pays(lhs_var) -> bool:
    """Whether materialising this transposed left operand ``[M, B]`` pays (module doc)."""
    m = lhs_var.aval.shape[0]
    return m % _ROW_STEP == 0 and m <= _MAX_ROWS


def materialised_transposes(fn):
    """``fn`` (arrays in, a pytree of arrays out) evaluated from its jaxpr, the left operand
    of a 2-D matmul materialised where that operand is a transpose contracted over its last
    axis and ``_pays`` says so. Meant for use while tracing (inside ``jax.jit``)."""
    def wrapped(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = _eval(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), out)
    return wrapped


def _eval(jaxpr, consts, args) -> list:
    """``jax.core.eval_jaxpr``, with the barrier inserted before the matmuls it pays for."""
    env: dict = {}
    transposed: set = set()  # variables made by a transpose

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive is lax.dot_general_p:
            (lc, _), (lb, _) = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0]
            if (not isinstance(lhs, Literal) and lhs in transposed and not lb
                    and len(lhs.aval.shape) == 2
                    and tuple(lc) == (1,) and _pays(lhs)):
                ins[0] = lax.optimization_barrier(ins[0])
        bind = eqn.primitive.get_bind_params(eqn.params)
        subfuns, params = bind if isinstance(bind, tuple) else ((), bind)  # older JAX: a pair
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*subfuns, *ins, **params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        env.update(zip(eqn.outvars, outs))
        if eqn.primitive is lax.transpose_p:
            transposed.add(eqn.outvars[0])
    return [read(v) for v in jaxpr.outvars]
