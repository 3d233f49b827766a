"""Property-based equivalence: random DAGs of ops give the same values and gradients under
every strategy, and the same as plain ``jax.grad`` of the same program.

A random *program* is a list of instructions over a growing pool of vector and scalar values;
it runs once per instance (with different constant inputs) so that the autobatcher has work.
Programs mix primitive ops, ``@dx.function`` calls (single and tuple outputs), Python scalars
of different values, parameters used directly and through a batched expression
(``dx.parameter(W) @ x``), fan-out (any earlier value may be reused), list ops, parts of
values (``pick``, ``pick_range``, a column of a matrix), and incremental forwards in the
middle of construction. The loss sums every value, so every node gets a gradient.

CI runs a bounded number of examples; ``DYNAX_HYPOTHESIS=long`` runs many more by hand.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynax as dx
from reference import STRATEGIES, assert_close

settings.register_profile("ci", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("DYNAX_HYPOTHESIS", "ci")

D = 3
SCALARS = (0.5, -1.5, 2.0)
PC = dx.ParameterCollection(seed=7)  # module-level: signatures (and kernels) are reused
W = PC.add_parameters((D, D), name="W")
B = PC.add_parameters((D,), name="b")
W2 = PC.add_parameters((D, D), name="W2")
PARAMS = (W, B, W2)


def _cell(x, h, w, b):
    return jnp.tanh(w @ x + h * b)


def _pair(x, y):
    return x * 2.0 - y, jnp.tanh(x + y)


cell = dx.function(_cell)
pair = dx.function(_pair)

UNARY = ("tanh", "logistic", "rectify", "negate", "square")
VEC_OPS = UNARY + ("add", "sub", "cmult", "scal_mul", "scal_radd", "scal_rsub", "matW",
                   "matW_expr", "affine", "cell", "pair", "esum", "emax", "average",
                   "scale_by", "div_pos", "softmax", "splice", "column")
SCALAR_OPS = ("dot", "pick", "sum_elems", "pnls", "sqdist")


def _backend_dx():
    return dict(
        tanh=dx.tanh, logistic=dx.logistic, rectify=dx.rectify, negate=lambda x: -x,
        square=dx.square, add=lambda a, b: a + b, sub=lambda a, b: a - b, cmult=dx.cmult,
        scal_mul=lambda a, c: a * c, scal_radd=lambda a, c: c + a, scal_rsub=lambda a, c: c - a,
        matW=lambda a, P: P[0] @ a, matW_expr=lambda a, P: dx.parameter(P[2]) @ a,
        affine=lambda a, P: dx.affine_transform([P[1], P[0], a]),
        cell=lambda a, b, P: cell(a, b, P[2], P[1]), pair=pair, esum=dx.esum, emax=dx.emax,
        average=dx.average, scale_by=lambda a, s: a * s,
        div_pos=lambda a, b: a / (dx.square(b) + 1.0), softmax=dx.softmax,
        dot=dx.dot_product, pick=dx.pick, sum_elems=dx.sum_elems,
        pnls=dx.pickneglogsoftmax, sqdist=dx.squared_distance,
        splice=lambda a, b, k: dx.concatenate([a[:k], dx.pick_range(b, k, D)]),
        column=lambda a, b, j: dx.pick(dx.concatenate_cols([a, b]), j, 1) + a,
        const=dx.input, total=lambda xs: dx.esum(xs))


def _backend_jax():
    return dict(
        tanh=jnp.tanh, logistic=jax.nn.sigmoid, rectify=jax.nn.relu, negate=lambda x: -x,
        square=jnp.square, add=lambda a, b: a + b, sub=lambda a, b: a - b, cmult=jnp.multiply,
        scal_mul=lambda a, c: a * c, scal_radd=lambda a, c: c + a, scal_rsub=lambda a, c: c - a,
        matW=lambda a, P: P[0] @ a, matW_expr=lambda a, P: P[2] @ a,
        affine=lambda a, P: P[1] + P[0] @ a, cell=lambda a, b, P: _cell(a, b, P[2], P[1]),
        pair=_pair, esum=lambda xs: sum(xs[1:], xs[0]), emax=lambda xs: jnp.max(jnp.stack(xs), 0),
        average=lambda xs: sum(xs[1:], xs[0]) / len(xs), scale_by=lambda a, s: a * s,
        div_pos=lambda a, b: a / (jnp.square(b) + 1.0), softmax=jax.nn.softmax,
        dot=jnp.dot, pick=lambda a, i: a[i], sum_elems=jnp.sum,
        pnls=lambda a, i: -jax.nn.log_softmax(a)[i], sqdist=lambda a, b: jnp.sum((a - b) ** 2),
        splice=lambda a, b, k: jnp.concatenate([a[:k], b[k:]]),
        column=lambda a, b, j: jnp.stack([a, b], axis=1)[:, j] + a,
        const=jnp.asarray, total=lambda xs: sum(xs[1:], xs[0]))


def run_program(program, consts, P, be, forward_at=()):
    """Evaluate ``program`` for every instance; return the summed loss."""
    terms = []
    for inst_consts in consts:
        vecs = [be["const"](c) for c in inst_consts]
        scalars = []
        for step, (op, a, b, extra) in enumerate(program):
            x, y = vecs[a % len(vecs)], vecs[b % len(vecs)]
            if op in UNARY or op == "softmax":
                vecs.append(be[op](x))
            elif op in ("add", "sub", "cmult", "div_pos"):
                vecs.append(be[op](x, y))
            elif op == "splice":  # parts of two values (pick_range), joined
                vecs.append(be[op](x, y, 1 + extra % (D - 1)))
            elif op == "column":  # a column of a matrix (pick along dimension 1)
                vecs.append(be[op](x, y, extra % 2))
            elif op.startswith("scal_"):
                vecs.append(be[op](x, SCALARS[extra % len(SCALARS)]))
            elif op in ("matW", "matW_expr", "affine"):
                vecs.append(be[op](x, P))
            elif op == "cell":
                vecs.append(be[op](x, y, P))
            elif op == "pair":
                vecs.extend(be[op](x, y))
            elif op in ("esum", "emax", "average"):
                vecs.append(be[op]([vecs[(a + k * b) % len(vecs)] for k in range(extra % 4 + 1)]))
            elif op == "scale_by":
                if scalars:
                    vecs.append(be[op](x, scalars[b % len(scalars)]))
            elif op in ("dot", "sqdist"):
                scalars.append(be[op](x, y))
            elif op in ("pick", "pnls"):
                scalars.append(be[op](x, extra % D))
            else:
                scalars.append(be[op](x))
            if step in forward_at and be is _DX:
                vecs[-1].forward()  # incremental forward between constructions
        terms.append(be["total"]([be["sum_elems"](v) for v in vecs] + scalars))
    return be["total"](terms)


_DX = _backend_dx()
_JAX = _backend_jax()

instruction = st.tuples(st.sampled_from(VEC_OPS + SCALAR_OPS), st.integers(0, 50),
                        st.integers(0, 50), st.integers(0, 50))


@settings(settings.get_profile(PROFILE))
@given(program=st.lists(instruction, min_size=1, max_size=12),
       n_inst=st.integers(1, 3), seed=st.integers(0, 2**16),
       forward_at=st.sets(st.integers(0, 11), max_size=2))
def test_random_programs_agree_across_strategies_and_with_jax(program, n_inst, seed, forward_at):
    rng = np.random.default_rng(seed)
    consts = [[rng.normal(size=D).astype(np.float32) for _ in range(2)] for _ in range(n_inst)]
    values = [p.value for p in PARAMS]
    ref = float(run_program(program, consts, values, _JAX))
    ref_grads = jax.grad(lambda P: run_program(program, consts, P, _JAX))(values)
    for strategy in STRATEGIES:
        for p in PARAMS:
            p.zero_grad()
        dx.renew_cg(autobatch=strategy)
        loss = run_program(program, consts, PARAMS, _DX, forward_at)
        assert_close(loss.value(), ref, rtol=1e-4, atol=1e-4, what=strategy)
        loss.backward()
        for p, g in zip(PARAMS, ref_grads):
            assert_close(p.grad, g, rtol=1e-4, atol=1e-4, what=f"{strategy} d/d{p.name}")
