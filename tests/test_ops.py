"""Every operation of API.md, under every autobatch strategy: values and gradients against
the same math written in plain JAX, and a check that the batched strategies really batch.

Each case builds one op application per *instance* (N instances per graph, different random
inputs each) so the autobatcher has something to group. ``params`` name the parameters the
case uses, ``data(rng, k)`` makes instance k's inputs, ``build(P, d)`` is the dynax version and
``ref(V, d)`` the plain-JAX version (``V`` holds the parameters' values).
"""
from __future__ import annotations

import operator
from typing import Callable, NamedTuple

import jax
import jax.scipy.special
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx

STRATEGIES = ("none", "depth", "agenda")
N = 3  # instances per graph: batches of 3 run padded to 4 lanes, so padding is tested too
TOL = dict(rtol=1e-5, atol=1e-5)


# ---- helpers ------------------------------------------------------------------------------------

def inp(a):
    return dx.input(a)


def normal(r, *shape):
    return r.normal(size=shape).astype(np.float32)


def positive(r, *shape):
    return r.uniform(0.5, 1.5, size=shape).astype(np.float32)


def prob(r, *shape):
    return r.uniform(0.05, 0.95, size=shape).astype(np.float32)


class Case(NamedTuple):
    name: str
    params: dict  # name -> (shape, init): init in {"glorot", "pos", "lookup"}
    data: Callable  # (rng, k) -> dict of per-instance inputs
    build: Callable  # (P, d) -> Expression or tuple of Expressions
    ref: Callable  # (V, d) -> jnp array or tuple of them
    cg_kwargs: dict = {}


_PC = None
_POOL: dict = {}  # (name, shape, init) -> Parameter, shared by every case that asks for it


def make_params(case):
    """The case's parameters and their values. Parameters of one (name, shape, init) are shared
    between cases: a signature includes its Parameter objects, so sharing them lets cases and
    strategies reuse compiled kernels (this keeps the file fast)."""
    global _PC
    if _PC is None:
        _PC = dx.ParameterCollection(seed=0)
    P = {}
    for name, (shape, init) in sorted(case.params.items()):
        key = (name, shape, init)
        if key not in _POOL:
            if init == "glorot":
                _POOL[key] = _PC.add_parameters(shape)
            elif init == "pos":
                r = np.random.default_rng(len(_POOL))
                arr = r.uniform(0.5, 1.5, shape).astype(np.float32)
                _POOL[key] = _PC.add_parameters(shape, init=arr)
            elif init == "lookup":
                _POOL[key] = _PC.add_lookup_parameters(shape)
            else:  # pragma: no cover
                raise AssertionError(init)
        P[name] = _POOL[key]
    for p in P.values():
        p.zero_grad()
    V = {name: p.value for name, p in P.items()}
    return P, V


def instance_data(case):
    return [case.data(np.random.default_rng(100 + k), k) for k in range(N)]


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


CASES = []


def case(name, params, data, build, ref, **kw):
    CASES.append(pytest.param(Case(name, params, data, build, ref, **kw), id=name))


# Shapes and parameters are shared between cases wherever the op allows it (vectors (3,),
# matrices (2, 3), the parameters "A"/"M"): a signature includes its Parameter objects and
# shapes, so sharing keeps the number of XLA compilations, and the file's run time, low.
A3 = {"A": ((3,), "glorot")}
AP3 = {"A": ((3,), "pos")}
M23 = {"M": ((2, 3), "glorot")}


def ev(P, x):
    """A vector expression depending on parameter A."""
    return inp(x) + P["A"]


def em(P, X):
    """A matrix expression depending on parameter M."""
    return inp(X) + P["M"]


def vec_data(gen=normal):
    return lambda r, k: {"x": gen(r, 3), "y": gen(r, 3)}


# ---- arithmetic: + - * / ------------------------------------------------------------------------
# Expression with Expression, with a Parameter, with a Python number on either side (a
# Parameter on the left: see cdiv_param_expr).

for _name, _f in {"add": operator.add, "sub": operator.sub,
                  "mul": operator.mul, "div": operator.truediv}.items():
    _params, _data = (AP3, vec_data(positive)) if _name == "div" else (A3, vec_data())
    case(f"{_name}_expr_expr", _params, _data,
         lambda P, d, f=_f: f(ev(P, d["x"]), inp(d["y"]) * P["A"]),
         lambda V, d, f=_f: f(d["x"] + V["A"], d["y"] * V["A"]))
    case(f"{_name}_expr_param", _params, _data,
         lambda P, d, f=_f: f(inp(d["x"]), P["A"]), lambda V, d, f=_f: f(d["x"], V["A"]))
    case(f"{_name}_expr_scalar", _params, _data,
         lambda P, d, f=_f: f(ev(P, d["x"]), 1.5), lambda V, d, f=_f: f(d["x"] + V["A"], 1.5))
    case(f"{_name}_scalar_expr", _params, _data,  # an int on the left
         lambda P, d, f=_f: f(2, ev(P, d["x"])), lambda V, d, f=_f: f(2.0, d["x"] + V["A"]))

case("mul_vector_by_scalar_expr", A3, vec_data(),  # a 0-d expression broadcasts
     lambda P, d: ev(P, d["x"]) * dx.sum_elems(inp(d["y"]) * P["A"]),
     lambda V, d: (d["x"] + V["A"]) * jnp.sum(d["y"] * V["A"]))
case("neg_expr", A3, vec_data(), lambda P, d: -ev(P, d["x"]), lambda V, d: -(d["x"] + V["A"]))

# ---- matmul -------------------------------------------------------------------------------------

case("matmul_mv_param_expr", M23, vec_data(),
     lambda P, d: P["M"] @ inp(d["x"]), lambda V, d: V["M"] @ d["x"])
case("matmul_mm_param_expr", M23, lambda r, k: {"X": normal(r, 3, 3)},
     lambda P, d: P["M"] @ inp(d["X"]), lambda V, d: V["M"] @ d["X"])
case("matmul_mv_expr_expr", {**M23, **A3},
     lambda r, k: {"X": normal(r, 2, 3), "x": normal(r, 3)},
     lambda P, d: em(P, d["X"]) @ ev(P, d["x"]),
     lambda V, d: (d["X"] + V["M"]) @ (d["x"] + V["A"]))
case("matmul_mv_array_expr", A3, lambda r, k: {"X": normal(r, 2, 3), "x": normal(r, 3)},
     lambda P, d: d["X"] @ ev(P, d["x"]),  # a NumPy matrix on the left: Expression.__rmatmul__
     lambda V, d: d["X"] @ (d["x"] + V["A"]))

# ---- unary elementwise --------------------------------------------------------------------------

for _name, _f, _g in (("tanh", dx.tanh, jnp.tanh), ("logistic", dx.logistic, jax.nn.sigmoid),
                      ("rectify", dx.rectify, jax.nn.relu), ("exp", dx.exp, jnp.exp),
                      ("log", dx.log, jnp.log), ("abs", dx.abs, jnp.abs)):
    _params, _data = (AP3, vec_data(positive)) if _name == "log" else (A3, vec_data())
    case(f"{_name}_expr", _params, _data,
         lambda P, d, f=_f: f(ev(P, d["x"])), lambda V, d, g=_g: g(d["x"] + V["A"]))
case("tanh_param", A3, lambda r, k: {}, lambda P, d: dx.tanh(P["A"]),
     lambda V, d: jnp.tanh(V["A"]))

# ---- cmult / cdiv -------------------------------------------------------------------------------

case("cmult_expr_expr", A3, vec_data(),
     lambda P, d: dx.cmult(ev(P, d["x"]), inp(d["y"]) * P["A"]),
     lambda V, d: (d["x"] + V["A"]) * (d["y"] * V["A"]))
case("cmult_expr_param", A3, vec_data(),
     lambda P, d: dx.cmult(inp(d["x"]), P["A"]), lambda V, d: d["x"] * V["A"])
case("cdiv_expr_expr", AP3, vec_data(positive),
     lambda P, d: dx.cdiv(ev(P, d["x"]), inp(d["y"]) * P["A"]),
     lambda V, d: (d["x"] + V["A"]) / (d["y"] * V["A"]))
case("cdiv_param_expr", AP3, vec_data(positive),
     lambda P, d: dx.cdiv(P["A"], inp(d["x"])), lambda V, d: V["A"] / d["x"])

# ---- dropout (identity cases; p > 0 has its own test) -------------------------------------------

case("dropout_p0", A3, vec_data(), lambda P, d: dx.dropout(ev(P, d["x"]), 0.0),
     lambda V, d: d["x"] + V["A"])

# ---- linear algebra -----------------------------------------------------------------------------

case("dot_product_expr_expr", A3, vec_data(),
     lambda P, d: dx.dot_product(ev(P, d["x"]), inp(d["y"])),
     lambda V, d: jnp.dot(d["x"] + V["A"], d["y"]))

case("affine_two_terms", {**M23, **A3, "b": ((2,), "glorot"), "W": ((2, 4), "glorot")},
     lambda r, k: {"x": normal(r, 3), "z": normal(r, 4)},
     lambda P, d: dx.affine_transform([P["b"], P["M"], ev(P, d["x"]), P["W"], inp(d["z"])]),
     lambda V, d: V["b"] + V["M"] @ (d["x"] + V["A"]) + V["W"] @ d["z"])

case("transpose", M23, lambda r, k: {"X": normal(r, 2, 3)},
     lambda P, d: dx.transpose(em(P, d["X"])), lambda V, d: (d["X"] + V["M"]).T)

# ---- structure ----------------------------------------------------------------------------------

case("concatenate_vectors", {**A3, "B": ((2,), "glorot")},
     lambda r, k: {"x": normal(r, 3), "z": normal(r, 1)},
     lambda P, d: dx.concatenate([ev(P, d["x"]), inp(d["z"]), P["B"]]),
     lambda V, d: jnp.concatenate([d["x"] + V["A"], d["z"], V["B"]]))
case("concatenate_matrices_d0", M23,
     lambda r, k: {"X": normal(r, 2, 3), "Y": normal(r, 4, 3)},
     lambda P, d: dx.concatenate([em(P, d["X"]), inp(d["Y"])], d=0),
     lambda V, d: jnp.concatenate([d["X"] + V["M"], d["Y"]], axis=0))
case("concatenate_matrices_d1", {**M23, "C": ((2, 1), "glorot")},
     lambda r, k: {"X": normal(r, 2, 3), "Y": normal(r, 2, 4)},
     lambda P, d: dx.concatenate([em(P, d["X"]), inp(d["Y"]), P["C"]], d=1),
     lambda V, d: jnp.concatenate([d["X"] + V["M"], d["Y"], V["C"]], axis=1))

case("concatenate_scalars", {**A3, "B": ((3,), "glorot")},  # attention scores, as in DyNet
     lambda r, k: {"x": normal(r, 3), "y": normal(r, 3)},
     lambda P, d: dx.concatenate([dx.dot_product(ev(P, d["x"]), P["B"]),
                                  dx.dot_product(inp(d["y"]), P["A"])]),
     lambda V, d: jnp.stack([jnp.dot(d["x"] + V["A"], V["B"]), jnp.dot(d["y"], V["A"])]))
case("concatenate_scalar_and_vector", A3, vec_data(),
     lambda P, d: dx.concatenate([dx.sum_elems(ev(P, d["x"])), inp(d["y"]) * P["A"]]),
     lambda V, d: jnp.concatenate([jnp.sum(d["x"] + V["A"])[None], d["y"] * V["A"]]))
case("concatenate_one_scalar", A3, vec_data(),
     lambda P, d: dx.concatenate([dx.dot_product(ev(P, d["x"]), inp(d["y"]))]),
     lambda V, d: jnp.dot(d["x"] + V["A"], d["y"])[None])

_IDX = [2, 0, 2, 1]  # per-instance indices; a repeated one too
case("pick", A3, lambda r, k: {"x": normal(r, 3), "i": _IDX[k]},
     lambda P, d: dx.pick(ev(P, d["x"]), d["i"]), lambda V, d: (d["x"] + V["A"])[d["i"]])
case("pick_getitem_numpy_int", A3, lambda r, k: {"x": normal(r, 3), "i": np.int64(_IDX[k])},
     lambda P, d: ev(P, d["x"])[d["i"]], lambda V, d: (d["x"] + V["A"])[int(d["i"])])

case("reshape_mat_to_mat", M23, lambda r, k: {"X": normal(r, 2, 3)},
     lambda P, d: dx.reshape(em(P, d["X"]), (3, 2)),
     lambda V, d: jnp.reshape(d["X"] + V["M"], (3, 2)))
case("reshape_mat_to_vec", M23, lambda r, k: {"X": normal(r, 2, 3)},
     lambda P, d: dx.reshape(em(P, d["X"]), (6,)),
     lambda V, d: jnp.reshape(d["X"] + V["M"], (6,)))

for _name, _f, _g in (("esum", dx.esum, lambda xs: jnp.sum(jnp.stack(xs), axis=0)),
                      ("average", dx.average, lambda xs: jnp.mean(jnp.stack(xs), axis=0)),
                      ("emax", dx.emax, lambda xs: jnp.max(jnp.stack(xs), axis=0)),
                      ("logsumexp", dx.logsumexp,
                       lambda xs: jax.nn.logsumexp(jnp.stack(xs), axis=0))):
    case(f"{_name}_3_and_4", A3,  # lengths 3 and 4 in one graph: one padded signature
         lambda r, k: {"xs": [normal(r, 3) for _ in range(1 + k % 2)], "y": normal(r, 3)},
         lambda P, d, f=_f: f([ev(P, d["xs"][0]), inp(d["y"]), P["A"]]
                              + [inp(x) for x in d["xs"][1:]]),
         lambda V, d, g=_g: g([d["xs"][0] + V["A"], d["y"], V["A"]] + d["xs"][1:]))

case("sum_elems_expr", M23, lambda r, k: {"X": normal(r, 2, 3)},
     lambda P, d: dx.sum_elems(em(P, d["X"])), lambda V, d: jnp.sum(d["X"] + V["M"]))

# ---- distributions and losses -------------------------------------------------------------------

case("softmax_columns", M23, lambda r, k: {"X": normal(r, 2, 3)},  # DyNet: per column
     lambda P, d: dx.softmax(em(P, d["X"])), lambda V, d: jax.nn.softmax(d["X"] + V["M"], 0))
case("log_softmax_columns", M23, lambda r, k: {"X": normal(r, 2, 3)},
     lambda P, d: dx.log_softmax(em(P, d["X"])),
     lambda V, d: jax.nn.log_softmax(d["X"] + V["M"], 0))
case("softmax", A3, vec_data(), lambda P, d: dx.softmax(ev(P, d["x"])),
     lambda V, d: jax.nn.softmax(d["x"] + V["A"]))
case("log_softmax", A3, vec_data(), lambda P, d: dx.log_softmax(ev(P, d["x"])),
     lambda V, d: jax.nn.log_softmax(d["x"] + V["A"]))

case("pickneglogsoftmax", A3, lambda r, k: {"x": normal(r, 3), "y": _IDX[k]},
     lambda P, d: dx.pickneglogsoftmax(ev(P, d["x"]), d["y"]),
     lambda V, d: -jax.nn.log_softmax(d["x"] + V["A"])[d["y"]])
case("pickneglogsoftmax_param", A3, lambda r, k: {"y": _IDX[k]},
     lambda P, d: dx.pickneglogsoftmax(P["A"], d["y"]),
     lambda V, d: -jax.nn.log_softmax(V["A"])[d["y"]])

case("squared_distance_expr_expr", A3, vec_data(),
     lambda P, d: dx.squared_distance(ev(P, d["x"]), inp(d["y"])),
     lambda V, d: jnp.sum((d["x"] + V["A"] - d["y"]) ** 2))


def _bll_ref(p, y):
    return -jnp.sum(y * jnp.log(p) + (1.0 - y) * jnp.log(1.0 - p))


case("binary_log_loss_pred", A3,
     lambda r, k: {"x": normal(r, 3), "y": np.float32([1, 0, 1]) if k % 2 else prob(r, 3)},
     lambda P, d: dx.binary_log_loss(dx.logistic(ev(P, d["x"])), inp(d["y"])),
     lambda V, d: _bll_ref(jax.nn.sigmoid(d["x"] + V["A"]), d["y"]))


def _hinge_ref(x, label, margin=1.0):
    terms = jnp.maximum(0.0, margin - x[label] + x)
    return jnp.sum(jnp.where(jnp.arange(x.shape[0]) == label, 0.0, terms))


case("hinge", A3, lambda r, k: {"x": normal(r, 3), "y": _IDX[k]},
     lambda P, d: dx.hinge(ev(P, d["x"]), d["y"]),
     lambda V, d: _hinge_ref(d["x"] + V["A"], d["y"]))
case("hinge_param_margin", A3, lambda r, k: {"y": _IDX[k]},
     lambda P, d: dx.hinge(P["A"], d["y"], margin=0.5),
     lambda V, d: _hinge_ref(V["A"], d["y"], 0.5))

# ---- inputs and lookup --------------------------------------------------------------------------

_ROWS = [3, 6, 3, 0]  # a repeated row: its gradient accumulates
case("lookup", {"E": ((7, 3), "lookup")}, lambda r, k: {"i": _ROWS[k]},
     lambda P, d: dx.lookup(P["E"], d["i"]), lambda V, d: V["E"][d["i"]])
case("lookup_getitem", {"E": ((7, 3), "lookup"), **A3},
     lambda r, k: {"i": _ROWS[k], "x": normal(r, 3)},
     lambda P, d: dx.cmult(P["E"][d["i"]], ev(P, d["x"])),
     lambda V, d: V["E"][d["i"]] * (d["x"] + V["A"]))

# ---- dx.function --------------------------------------------------------------------------------


@dx.function
def ffn(x, W, b):
    return jnp.tanh(W @ x + b)


@dx.function
def two_out(x, W, scale):
    h = W @ x
    return jnp.tanh(h) * scale, jax.nn.sigmoid(h)


case("function_single", {**M23, **A3, "b": ((2,), "glorot")}, vec_data(),
     lambda P, d: ffn(ev(P, d["x"]), P["M"], P["b"]),
     lambda V, d: jnp.tanh(V["M"] @ (d["x"] + V["A"]) + V["b"]))
case("function_tuple", M23, vec_data(),
     lambda P, d: two_out(inp(d["x"]), P["M"], 2.0),
     lambda V, d: (jnp.tanh(V["M"] @ d["x"]) * 2.0, jax.nn.sigmoid(V["M"] @ d["x"])))


@dx.function
def shifted(x, W, offsets, mode, k):
    """Static tuple and None arguments, and a per-instance NumPy integer: these take
    ``Function``'s general path (the fast one knows Expressions, Parameters, int, float and
    str only)."""
    h = W @ x + jnp.asarray(offsets)
    h = jnp.tanh(h) if mode is None else jax.nn.relu(h)
    return h * x[k]


case("function_static_tuple_none", {**M23, **A3}, lambda r, k: {**vec_data()(r, k), "k": k},
     lambda P, d: shifted(ev(P, d["x"]), P["M"], (0.5, -0.25), None, np.int32(d["k"])),
     lambda V, d: (jnp.tanh(V["M"] @ (d["x"] + V["A"]) + jnp.array([0.5, -0.25]))
                   * (d["x"] + V["A"])[d["k"]]))
case("function_numpy_constant", {**M23, "b": ((2,), "glorot")}, vec_data(),
     lambda P, d: ffn(d["x"], P["M"], P["b"]),  # a NumPy array: a constant input
     lambda V, d: jnp.tanh(V["M"] @ d["x"] + V["b"]))


# ---- DyNet's further ops (dynax/ops/extra.py) ---------------------------------------------------


@jax.custom_vjp
def _flipped(x):
    return x


_flipped.defvjp(lambda x: (x, None), lambda _, g: (-g,))

for _name, _f, _g in (("selu", dx.selu, jax.nn.selu), ("softsign", dx.softsign, jax.nn.soft_sign),
                      ("log_sigmoid", dx.log_sigmoid, jax.nn.log_sigmoid),
                      ("cube", dx.cube, lambda x: x ** 3),
                      ("erf", dx.erf, jax.scipy.special.erf),
                      ("elu_alpha", lambda x: dx.elu(x, 0.7), lambda x: jax.nn.elu(x, 0.7)),
                      ("leaky_relu", dx.leaky_relu, jax.nn.leaky_relu),
                      ("leaky_relu_0.2", lambda x: dx.leaky_relu(x, 0.2),
                       lambda x: jax.nn.leaky_relu(x, 0.2)),
                      ("nobackprop", lambda x: dx.nobackprop(x) * x,
                       lambda x: jax.lax.stop_gradient(x) * x),
                      ("flip_gradient", lambda x: dx.flip_gradient(x) * 2.0,
                       lambda x: _flipped(x) * 2.0),
                      ("mean_elems", dx.mean_elems, jnp.mean),
                      ("l2_norm", dx.l2_norm, jnp.linalg.norm)):
    case(f"{_name}_expr", A3, vec_data(),
         lambda P, d, f=_f: f(ev(P, d["x"])), lambda V, d, g=_g: g(d["x"] + V["A"]))

for _name, _f, _g in (("bmax", dx.bmax, jnp.maximum), ("bmin", dx.bmin, jnp.minimum),
                      ("pow", dx.pow, jnp.power)):
    case(f"{_name}_expr_expr", AP3, vec_data(positive),
         lambda P, d, f=_f: f(ev(P, d["x"]), inp(d["y"]) * P["A"]),
         lambda V, d, g=_g: g(d["x"] + V["A"], d["y"] * V["A"]))
case("pow_expr_number", AP3, vec_data(positive), lambda P, d: dx.pow(ev(P, d["x"]), 1.5),
     lambda V, d: (d["x"] + V["A"]) ** 1.5)
case("bmax_number_expr", A3, vec_data(), lambda P, d: dx.bmax(0.1, ev(P, d["x"])),
     lambda V, d: jnp.maximum(0.1, d["x"] + V["A"]))

for _name, _f, _g in (("sum_dim", lambda x: dx.sum_dim(x, 1), lambda x: jnp.sum(x, 1)),
                      ("sum_dim_both", lambda x: dx.sum_dim(x, [1, 0]), jnp.sum),
                      ("mean_dim", lambda x: dx.mean_dim(x, 0), lambda x: jnp.mean(x, 0)),
                      ("max_dim", lambda x: dx.max_dim(x, 1), lambda x: jnp.max(x, 1)),
                      ("min_dim", dx.min_dim, lambda x: jnp.min(x, 0)),
                      ("logsumexp_dim", lambda x: dx.logsumexp_dim(x, 1),
                       lambda x: jax.nn.logsumexp(x, 1)),
                      ("pick_range_d1", lambda x: dx.pick_range(x, 1, 3, d=1),
                       lambda x: x[:, 1:3]),
                      ("pick_range_d0", lambda x: dx.pick_range(x, 0, 1), lambda x: x[0:1])):
    case(f"{_name}", M23, lambda r, k: {"X": normal(r, 2, 3)},
         lambda P, d, f=_f: f(em(P, d["X"])), lambda V, d, g=_g: g(d["X"] + V["M"]))
case("squared_norm", M23, lambda r, k: {"X": normal(r, 2, 3)},
     lambda P, d: dx.squared_norm(em(P, d["X"])), lambda V, d: jnp.sum((d["X"] + V["M"]) ** 2))
case("colwise_add", {**M23, "B": ((2,), "glorot")}, lambda r, k: {"X": normal(r, 2, 3)},
     lambda P, d: dx.colwise_add(em(P, d["X"]), P["B"]),
     lambda V, d: d["X"] + V["M"] + V["B"][:, None])
case("select_rows", M23, lambda r, k: {"X": normal(r, 2, 3)},
     lambda P, d: dx.select_rows(em(P, d["X"]), [1, 0, 1]),
     lambda V, d: (d["X"] + V["M"])[jnp.array([1, 0, 1])])
case("select_cols", M23, lambda r, k: {"X": normal(r, 2, 3)},
     lambda P, d: dx.select_cols(em(P, d["X"]), [2, 0]),
     lambda V, d: (d["X"] + V["M"])[:, jnp.array([2, 0])])
case("logsumexp_vectors", A3, vec_data(),
     lambda P, d: dx.logsumexp([ev(P, d["x"]), inp(d["y"]), P["A"]]),
     lambda V, d: jax.nn.logsumexp(jnp.stack([d["x"] + V["A"], d["y"], V["A"]]), axis=0))
case("logsumexp_scalars", A3, vec_data(),
     lambda P, d: dx.logsumexp([dx.sum_elems(ev(P, d["x"])), dx.dot_product(inp(d["y"]),
                                                                           P["A"])]),
     lambda V, d: jax.nn.logsumexp(jnp.stack([jnp.sum(d["x"] + V["A"]),
                                              jnp.dot(d["y"], V["A"])])))
case("logsumexp_matrices", M23, lambda r, k: {"X": normal(r, 2, 3)},  # DyNet: any shape
     lambda P, d: dx.logsumexp([em(P, d["X"]), em(P, d["X"]) * 2.0, P["M"]]),
     lambda V, d: jax.nn.logsumexp(jnp.stack([d["X"] + V["M"], (d["X"] + V["M"]) * 2.0,
                                              V["M"]]), axis=0))
case("logsumexp_20_items", A3, vec_data(),  # chunks of 16, then one node over the chunks
     lambda P, d: dx.logsumexp([ev(P, d["x"]) * (0.1 * i) for i in range(20)]),
     lambda V, d: jax.nn.logsumexp(jnp.stack([(d["x"] + V["A"]) * (0.1 * i)
                                              for i in range(20)]), axis=0))
case("pow_operator", AP3, vec_data(positive), lambda P, d: ev(P, d["x"]) ** 2.5,
     lambda V, d: (d["x"] + V["A"]) ** 2.5)
case("noise_eval_graph", A3, vec_data(), lambda P, d: dx.noise(ev(P, d["x"]), 0.5),
     lambda V, d: d["x"] + V["A"], cg_kwargs={"train": False})
case("l1_distance", A3, vec_data(), lambda P, d: dx.l1_distance(ev(P, d["x"]), inp(d["y"])),
     lambda V, d: jnp.sum(jnp.abs(d["x"] + V["A"] - d["y"])))


# ---- DyNet's further ops, second set (dynax/ops/extra.py) ---------------------------------------


def _straight_through(f):
    return lambda x: x + jax.lax.stop_gradient(f(x) - x)


def _sparsemax_reference(z):
    # the projection onto the simplex found another way than the op's sort: bisection for
    # the threshold tau with sum(max(z - tau, 0)) = 1, then tau recomputed from the support
    # found, so that it is a differentiable function of z and gradients are checked too
    # (a loop, not 60 unrolled steps: those took the reference seconds to compile)
    zs = jax.lax.stop_gradient(z)

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        above = jnp.sum(jnp.maximum(zs - mid, 0.0)) > 1.0
        return jnp.where(above, mid, lo), jnp.where(above, hi, mid)

    lo, hi = jax.lax.fori_loop(0, 60, halve, (jnp.min(zs) - 1.0, jnp.max(zs)))
    support = (zs > (lo + hi) / 2).astype(z.dtype)
    tau = (jnp.sum(z * support) - 1.0) / jnp.sum(support)
    return jnp.maximum(z - tau, 0.0)


def unit(r, *shape):
    return r.uniform(-0.6, 0.6, size=shape).astype(np.float32)


for _name, _f, _g, _gen in (
        ("sin", dx.sin, jnp.sin, normal), ("cos", dx.cos, jnp.cos, normal),
        ("tan", dx.tan, jnp.tan, unit), ("asin", dx.asin, jnp.arcsin, unit),
        ("acos", dx.acos, jnp.arccos, unit), ("atan", dx.atan, jnp.arctan, normal),
        ("sinh", dx.sinh, jnp.sinh, normal), ("cosh", dx.cosh, jnp.cosh, normal),
        ("asinh", dx.asinh, jnp.arcsinh, normal), ("atanh", dx.atanh, jnp.arctanh, unit),
        ("round", dx.round, lambda x: jax.lax.stop_gradient(jnp.round(x)), normal),
        ("floor_straight", lambda x: dx.floor(x, "straight_through_gradient"),
         _straight_through(jnp.floor), normal),
        ("ceil", dx.ceil, lambda x: jax.lax.stop_gradient(jnp.ceil(x)), normal),
        ("round_straight", lambda x: dx.round(x, gradient_mode="straight_through_gradient"),
         _straight_through(jnp.round), normal),
        ("argmax_straight", lambda x: dx.argmax(x, "straight_through_gradient") * x,
         lambda x: _straight_through(lambda y: jax.nn.one_hot(jnp.argmax(y), 3))(x) * x, normal),
        ("argmax_zero", lambda x: dx.argmax(x) * x,
         lambda x: jax.lax.stop_gradient(jax.nn.one_hot(jnp.argmax(x), 3)) * x, normal),
        ("std_elems", dx.std_elems, jnp.std, normal),
        ("moment_elems", lambda x: dx.moment_elems(x, 3), lambda x: jnp.mean(x ** 3), normal),
        ("cumsum", dx.cumsum, jnp.cumsum, normal),
        ("sparsemax", lambda x: dx.sparsemax(x * 2.0), lambda x: _sparsemax_reference(x * 2.0),
         normal),
        ("sparsemax_one_hot", lambda x: dx.sparsemax(x * 50.0),  # the support is one entry
         lambda x: _sparsemax_reference(x * 50.0), normal)):
    case(f"{_name}_expr", A3, vec_data(_gen),
         lambda P, d, f=_f: f(inp(d["x"]) * 0.5 + P["A"] * 0.5),
         lambda V, d, g=_g: g(d["x"] * 0.5 + V["A"] * 0.5))

for _name, _f, _g, _gen in (
        ("acosh", dx.acosh, jnp.arccosh, lambda r, *s: r.uniform(1.5, 3, size=s)),
        ("lgamma", dx.lgamma, jax.scipy.special.gammaln, positive)):
    case(f"{_name}_expr", AP3, vec_data(lambda r, *s, gen=_gen: gen(r, *s).astype(np.float32)),
         lambda P, d, f=_f: f(inp(d["x"]) + P["A"]), lambda V, d, g=_g: g(d["x"] + V["A"]))

for _name, _f, _g in (("std_dim", lambda x: dx.std_dim(x, 1), lambda x: jnp.std(x, 1)),
                      ("moment_dim", lambda x: dx.moment_dim(x, [0, 1], 2),
                       lambda x: jnp.mean(x ** 2)),
                      ("cumsum_d1", lambda x: dx.cumsum(x, 1), lambda x: jnp.cumsum(x, 1)),
                      ("weight_norm", lambda x: dx.weight_norm(x, dx.sum_elems(x)),
                       lambda x: x * jnp.sum(x) / jnp.linalg.norm(x))):
    case(f"{_name}", M23, lambda r, k: {"X": normal(r, 2, 3)},
         lambda P, d, f=_f: f(em(P, d["X"])), lambda V, d, g=_g: g(d["X"] + V["M"]))

case("layer_norm", {**A3, "G": ((3,), "pos"), "B": ((3,), "glorot")}, vec_data(),
     lambda P, d: dx.layer_norm(ev(P, d["x"]), P["G"], P["B"]),
     lambda V, d: V["G"] * (lambda c: c / (jnp.sqrt(jnp.mean(c * c)) + 1e-8))(
         d["x"] + V["A"] - jnp.mean(d["x"] + V["A"])) + V["B"])
case("huber_distance", A3, lambda r, k: {"x": 2 * normal(r, 3), "y": normal(r, 3)},
     lambda P, d: dx.huber_distance(ev(P, d["x"]), d["y"], c=1.0),  # an array operand
     lambda V, d: jnp.sum(jnp.where(jnp.abs(d["x"] + V["A"] - d["y"]) < 1.0,
                                    (d["x"] + V["A"] - d["y"]) ** 2,
                                    2 * jnp.abs(d["x"] + V["A"] - d["y"]) - 1.0)))
case("pairwise_rank_loss", A3, vec_data(),
     lambda P, d: dx.pairwise_rank_loss(ev(P, d["x"]), inp(d["y"]) * P["A"], m=0.5),
     lambda V, d: jnp.maximum(0.0, 0.5 - (d["x"] + V["A"]) + d["y"] * V["A"]))
case("poisson_loss", A3, lambda r, k: {"x": normal(r, 3), "n": k + 2},
     lambda P, d: dx.poisson_loss(dx.sum_elems(ev(P, d["x"])) * 0.3, d["n"]),
     lambda V, d: (lambda ll: jnp.exp(ll) - d["n"] * ll + jax.scipy.special.gammaln(d["n"] + 1.0))(
         jnp.sum(d["x"] + V["A"]) * 0.3))
_SPD = {"S": ((3, 3), "glorot")}
case("inverse", _SPD, lambda r, k: {"X": normal(r, 3, 3)},
     lambda P, d: dx.inverse(inp(d["X"]) * 0.3 + P["S"] * 0.3 + inp(3 * np.eye(3, dtype="f"))),
     lambda V, d: jnp.linalg.inv(d["X"] * 0.3 + V["S"] * 0.3 + 3 * jnp.eye(3)))
case("logdet", _SPD, lambda r, k: {"X": normal(r, 3, 3)},
     lambda P, d: dx.logdet(inp(d["X"]) * 0.3 + P["S"] * 0.3 + inp(3 * np.eye(3, dtype="f"))),
     lambda V, d: jnp.linalg.slogdet(d["X"] * 0.3 + V["S"] * 0.3 + 3 * jnp.eye(3))[1])
case("trace_of_product", M23, lambda r, k: {"X": normal(r, 2, 3), "Y": normal(r, 2, 3)},
     lambda P, d: dx.trace_of_product(em(P, d["X"]), inp(d["Y"])),
     lambda V, d: jnp.trace((d["X"] + V["M"]) @ d["Y"].T))
_T = {"T": ((2, 3, 3), "glorot")}
case("contract3d_1d", {**_T, **A3}, vec_data(),
     lambda P, d: dx.contract3d_1d(P["T"], ev(P, d["x"])),
     lambda V, d: jnp.einsum("ijk,k->ij", V["T"], d["x"] + V["A"]))
case("contract3d_1d_bias", {**_T, **A3, **M23},
     lambda r, k: {"x": normal(r, 3), "X": normal(r, 2, 3)},
     lambda P, d: dx.contract3d_1d_bias(P["T"], ev(P, d["x"]), em(P, d["X"])),
     lambda V, d: jnp.einsum("ijk,k->ij", V["T"], d["x"] + V["A"]) + d["X"] + V["M"])
case("circ_conv", A3, vec_data(), lambda P, d: dx.circ_conv(ev(P, d["x"]), inp(d["y"]) * P["A"]),
     lambda V, d: jnp.array([sum((d["x"] + V["A"])[i] * (d["y"] * V["A"])[(k - i) % 3]
                                 for i in range(3)) for k in range(3)]))
case("circ_corr", A3, vec_data(), lambda P, d: dx.circ_corr(ev(P, d["x"]), inp(d["y"]) * P["A"]),
     lambda V, d: jnp.array([sum((d["x"] + V["A"])[i] * (d["y"] * V["A"])[(i + k) % 3]
                                 for i in range(3)) for k in range(3)]))
case("cwise_multiply", A3, vec_data(), lambda P, d: dx.cwise_multiply(ev(P, d["x"]), P["A"]),
     lambda V, d: (d["x"] + V["A"]) * V["A"])
case("constant", A3, vec_data(), lambda P, d: ev(P, d["x"]) * dx.constant((3,), 1.5)
     + dx.zeroes(3), lambda V, d: (d["x"] + V["A"]) * 1.5)


# ---- DyNet's shapes and arguments (session 23) -------------------------------------------------

def mat_data(gen=normal):
    return lambda r, k: {"X": gen(r, 2, 3), "c": gen(r, 2, 1), "w": gen(r, 1, 3),
                         "x": gen(r, 3), "i": _IDX[k]}


for _name, _f in {"add": operator.add, "sub": operator.sub,
                  "mul": operator.mul, "div": operator.truediv}.items():
    _gen = positive if _name == "div" else normal
    _p = {"M": ((2, 3), "pos")} if _name == "div" else M23
    case(f"{_name}_broadcast_column", _p, mat_data(_gen),  # (2, 3) with (2, 1)
         lambda P, d, f=_f: f(em(P, d["X"]), inp(d["c"]) * dx.sum_elems(P["M"])),
         lambda V, d, f=_f: f(d["X"] + V["M"], d["c"] * jnp.sum(V["M"])))
    case(f"{_name}_broadcast_row_on_the_left", _p, mat_data(_gen),  # (1, 3) with (2, 3)
         lambda P, d, f=_f: f(inp(d["w"]) * dx.sum_elems(P["M"]), em(P, d["X"])),
         lambda V, d, f=_f: f(d["w"] * jnp.sum(V["M"]), d["X"] + V["M"]))
case("cmult_broadcast_both_ways", M23, mat_data(),  # (2, 1) with (1, 3): an outer product
     lambda P, d: dx.cmult(inp(d["c"]) * dx.sum_elems(P["M"]), dx.transpose(
         dx.pick_range(dx.transpose(em(P, d["X"])), 0, 1, d=1))),
     lambda V, d: (d["c"] * jnp.sum(V["M"])) * (d["X"] + V["M"])[:1, :])
case("concatenate_cols_vectors", A3, vec_data(),
     lambda P, d: dx.concatenate_cols([ev(P, d["x"]), inp(d["y"]) * P["A"]]),
     lambda V, d: jnp.stack([d["x"] + V["A"], d["y"] * V["A"]], axis=1))
case("concatenate_cols_matrices_and_a_vector", {**M23, **A3}, mat_data(),
     lambda P, d: dx.concatenate_cols([em(P, d["X"]), inp(d["c"]),
                                       dx.pick_range(ev(P, d["x"]), 0, 2)]),
     lambda V, d: jnp.concatenate([d["X"] + V["M"], d["c"], (d["x"] + V["A"])[:2, None]], 1))
case("concatenate_cols_scalars", A3, vec_data(),  # a (1, k) row, as DyNet's
     lambda P, d: dx.concatenate_cols([dx.sum_elems(ev(P, d["x"])), dx.dot_product(
         inp(d["y"]), P["A"])]),
     lambda V, d: jnp.array([[jnp.sum(d["x"] + V["A"]), jnp.dot(d["y"], V["A"])]]))
case("pick_dim_1_is_a_column", M23, mat_data(),
     lambda P, d: dx.pick(em(P, d["X"]), d["i"], 1), lambda V, d: (d["X"] + V["M"])[:, d["i"]])
case("pick_dim_0_of_a_matrix", M23, lambda r, k: {"X": normal(r, 2, 3), "i": _IDX[k] % 2},
     lambda P, d: dx.pick(em(P, d["X"]), d["i"], 0), lambda V, d: (d["X"] + V["M"])[d["i"]])
case("log_softmax_restricted", A3, vec_data(),  # the others are -inf: pick restricted ones
     lambda P, d: dx.pick_range(dx.log_softmax(ev(P, d["x"]), [2, 0]), 0, 1)
     + dx.pick(dx.log_softmax(ev(P, d["x"]), [0, 2]), 2),
     lambda V, d: jax.nn.log_softmax((d["x"] + V["A"])[jnp.array([0, 2])])[:1]
     + jax.nn.log_softmax((d["x"] + V["A"])[jnp.array([0, 2])])[1])
_KEEP = ([0, 2], [1], [0, 1, 2])  # instance k's restrict set: the sets batch as data
case("log_softmax_restricted_per_instance", A3, lambda r, k: {"x": normal(r, 3), "i": k},
     lambda P, d: dx.pick(dx.log_softmax(ev(P, d["x"]), _KEEP[d["i"]]), _KEEP[d["i"]][-1]),
     lambda V, d: jax.nn.log_softmax((d["x"] + V["A"])[jnp.array(_KEEP[d["i"]])])[-1])
case("slice_getitem", A3, vec_data(),  # bounds past the ends clip, as NumPy's
     lambda P, d: (ev(P, d["x"])[1:], ev(P, d["x"])[-3:-1], ev(P, d["x"])[:],
                   ev(P, d["x"])[1:100], ev(P, d["x"])[-10:2]),
     lambda V, d: ((d["x"] + V["A"])[1:], (d["x"] + V["A"])[-3:-1], d["x"] + V["A"],
                   (d["x"] + V["A"])[1:100], (d["x"] + V["A"])[-10:2]))
case("int_getitem", M23, mat_data(),  # negative ints count from the end, as NumPy's
     lambda P, d: (em(P, d["X"])[-1], em(P, d["X"])[-2][np.int32(-3)], em(P, d["X"])[1][2]),
     lambda V, d: ((d["X"] + V["M"])[-1], (d["X"] + V["M"])[-2][-3], (d["X"] + V["M"])[1][2]))
case("transpose_dims", M23, lambda r, k: {"X": normal(r, 2, 3), "T": normal(r, 2, 3, 4)},
     lambda P, d: (dx.transpose(em(P, d["X"]), [1, 0]),
                   dx.transpose(inp(d["T"]) * dx.sum_elems(P["M"]), [2, 0, 1])),
     lambda V, d: ((d["X"] + V["M"]).T, jnp.transpose(d["T"] * jnp.sum(V["M"]), (2, 0, 1))))
case("transpose_scalar", A3, vec_data(), lambda P, d: dx.transpose(dx.sum_elems(ev(P, d["x"]))),
     lambda V, d: jnp.sum(d["x"] + V["A"]))
case("sum_cols", M23, mat_data(), lambda P, d: dx.sum_cols(em(P, d["X"])),
     lambda V, d: jnp.sum(d["X"] + V["M"], axis=1))
def _sparsemax_loss_ref(z, support):
    """The loss in its Fenchel-Young form, ``p.z - |p|^2/2 - q.z + |q|^2/2`` with p the
    sparsemax, its threshold the largest of ``(sum of the top k - 1) / k`` (another route
    than the op's support count)."""
    top = jnp.cumsum(jnp.sort(z)[::-1])
    tau = jnp.max((top - 1.0) / jnp.arange(1, z.shape[0] + 1))
    p = jnp.maximum(z - tau, 0.0)
    q = jnp.zeros(z.shape).at[jnp.array(support)].set(1.0 / len(support))
    return p @ z - 0.5 * p @ p - q @ z + 0.5 * q @ q


_SUPPORTS = [[0], [1, 2], [2, 0], [2]]  # per instance: different supports batch together
case("sparsemax_loss", A3, lambda r, k: {"x": normal(r, 3), "s": _SUPPORTS[k]},
     lambda P, d: dx.sparsemax_loss(ev(P, d["x"]), d["s"]),
     lambda V, d: _sparsemax_loss_ref(d["x"] + V["A"], d["s"]))
case("affine_transform_column_bias", {**M23, **A3},  # (2,) and (2, 1) biases on (2, 4)
     lambda r, k: {"X": normal(r, 3, 4), "b": normal(r, 2), "c": normal(r, 2, 1)},
     lambda P, d: (dx.affine_transform([inp(d["b"]) * dx.sum_elems(P["A"]), P["M"], inp(d["X"])]),
                   dx.affine_transform([inp(d["c"]), P["M"], inp(d["X"]) * dx.sum_elems(P["A"])])),
     lambda V, d: ((d["b"] * jnp.sum(V["A"]))[:, None] + V["M"] @ d["X"],
                   d["c"] + V["M"] @ (d["X"] * jnp.sum(V["A"]))))
case("average_cols", M23, mat_data(), lambda P, d: dx.average_cols(em(P, d["X"])),
     lambda V, d: jnp.mean(d["X"] + V["M"], axis=1))
case("softmax_rows", M23, mat_data(), lambda P, d: dx.softmax(em(P, d["X"]), d=1),
     lambda V, d: jax.nn.softmax(d["X"] + V["M"], axis=1))
case("silu", A3, vec_data(), lambda P, d: dx.silu(ev(P, d["x"]), 0.7),
     lambda V, d: (d["x"] + V["A"]) * jax.nn.sigmoid(0.7 * (d["x"] + V["A"])))
case("scale_gradient", A3, vec_data(),  # value x, gradient times 0.25
     lambda P, d: dx.square(dx.scale_gradient(ev(P, d["x"]), 0.25)),
     lambda V, d: jnp.square(0.25 * (d["x"] + V["A"])
                             + 0.75 * jax.lax.stop_gradient(d["x"] + V["A"])))


# ---- the generic tests --------------------------------------------------------------------------

_REFS: dict = {}


def case_reference(c):
    """(values, targets, loss, gradients) of a case in plain JAX. The loss is a sum of squared
    distances of each output to a random target (so every gradient is informative); it and
    its gradients come from ``jax.value_and_grad`` under one ``jax.jit``. The same for every
    strategy, so computed once."""
    if c.name not in _REFS:
        _, V = make_params(c)
        datas = instance_data(c)

        def ref_all(V):
            return [as_tuple(c.ref(V, d)) for d in datas]

        shapes = jax.eval_shape(ref_all, V)
        ws = [[normal(np.random.default_rng(500 + 10 * k + j), *o.shape)
               for j, o in enumerate(out)] for k, out in enumerate(shapes)]

        def ref_loss(V):
            outs = ref_all(V)
            total = 0.0
            for out, w in zip(outs, ws):
                for o, wj in zip(out, w):
                    total = total + jnp.sum(jnp.square(o - wj))
            return total, outs

        (loss, refs), grads = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(V)
        refs = [tuple(np.asarray(o) for o in out) for out in refs]
        _REFS[c.name] = (refs, ws, np.asarray(loss),
                         {k: np.asarray(g) for k, g in grads.items()})
    return _REFS[c.name]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("c", CASES)
def test_value_and_grad(c, strategy):
    """Values of N instances against plain JAX, then gradients of a scalar loss over them
    against ``jax.grad`` of the same math."""
    P, V = make_params(c)
    for p in P.values():
        np.testing.assert_array_equal(np.asarray(p.grad), np.zeros(p.shape))
    cg = dx.renew_cg(autobatch=strategy, **c.cg_kwargs)
    datas = instance_data(c)
    outs = [as_tuple(c.build(P, d)) for d in datas]
    refs, ws, want_loss, want_grads = case_reference(c)
    assert cg.stats()["batches"] == 0  # nothing computed while building

    # -- values
    for out, want in zip(outs, refs):
        assert len(out) == len(want)
        for e, w in zip(out, want):
            assert isinstance(e, dx.Expression)
            w = np.asarray(w)
            assert tuple(e.shape) == w.shape
            got = e.npvalue()
            assert isinstance(got, np.ndarray)
            assert got.shape == w.shape
            np.testing.assert_allclose(got, w, **TOL)
    st = cg.stats()
    if strategy == "none":
        assert st["batches"] == st["nodes"]
    elif st["nodes"] >= N:  # N same-signature instances: the batched strategies batch
        assert st["batches"] < st["nodes"]

    # -- gradients
    # sum of squared distances to random targets: each output gets a non-uniform cotangent
    terms = [dx.squared_distance(e, inp(wj)) for out, w in zip(outs, ws) for e, wj in zip(out, w)]
    loss = dx.esum(terms)
    assert loss.shape == ()
    loss.backward()

    np.testing.assert_allclose(loss.scalar_value(), want_loss, rtol=1e-5, atol=1e-4)
    for name, p in P.items():
        g = p.grad
        assert isinstance(g, jax.Array)
        assert g.shape == p.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(want_grads[name]), **TOL,
                                   err_msg=f"gradient of {name}")
        p.zero_grad()


@pytest.mark.parametrize("c", [c for c in CASES if not c.values[0].cg_kwargs])
def test_agenda_batches_fewer_than_none(c):
    """The same multi-instance graph: "agenda" and "depth" launch fewer kernels than "none"."""
    stats = {}
    P, V = make_params(c)
    for strategy in STRATEGIES:
        cg = dx.renew_cg(autobatch=strategy)
        outs = [e for d in instance_data(c) for e in as_tuple(c.build(P, d))]
        dx.forward(outs)
        stats[strategy] = cg.stats()
    assert stats["none"]["nodes"] == stats["agenda"]["nodes"] == stats["depth"]["nodes"]
    assert stats["none"]["batches"] == stats["none"]["nodes"] >= N
    assert stats["agenda"]["batches"] < stats["none"]["batches"]
    assert stats["depth"]["batches"] < stats["none"]["batches"]


# ---- ops with their own tests -------------------------------------------------------------------
# (they reuse the cases' parameters and shapes, so mostly the compiled kernels too)

def pooled(params):
    return make_params(Case("pooled", params, None, None, None))[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dropout_p_positive(strategy):
    """Each entry is either dropped (0) or kept and scaled by 1/(1-p); the gradient uses the
    same mask; instances draw different masks."""
    p = 0.5
    P = pooled(M23)
    dx.renew_cg(autobatch=strategy)
    r = np.random.default_rng(0)
    pre = [em(P, normal(r, 2, 3)) for _ in range(4)]
    outs = [dx.dropout(e, p) for e in pre]
    masks = []
    for e, o in zip(pre, outs):
        v, dv = e.npvalue(), o.npvalue()
        assert dv.shape == (2, 3)
        kept = dv != 0
        np.testing.assert_allclose(dv[kept], v[kept] / (1 - p), **TOL)
        masks.append(kept)
    masks = np.array(masks)
    assert 0 < masks.sum() < masks.size  # (fails with probability 2**-23)
    # identical masks in all 4 instances: probability 2**-18
    assert any(not np.array_equal(masks[0], m) for m in masks[1:]), "identical masks"
    ws = [normal(r, 2, 3) for _ in range(4)]
    loss = dx.esum([dx.squared_distance(o, inp(w)) for o, w in zip(outs, ws)])
    loss.backward()
    want = sum(2 * (o.npvalue() - w) * m / (1 - p) for o, w, m in zip(outs, ws, masks))
    np.testing.assert_allclose(np.asarray(P["M"].grad), want, **TOL)
    for o, m in zip(outs, masks):  # backward did not redraw the masks
        assert np.array_equal(o.npvalue() != 0, m)
    P["M"].zero_grad()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dropout_identity(strategy):
    x = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    dx.renew_cg(autobatch=strategy)
    e = inp(x)
    assert dx.dropout(e, 0.0).shape == (2, 3)
    np.testing.assert_array_equal(dx.dropout(e, 0.0).npvalue(), x)
    dx.renew_cg(autobatch=strategy, train=False)
    e = inp(x)
    for p in (0.1, 0.5, 0.9):
        np.testing.assert_array_equal(dx.dropout(e, p).npvalue(), x)
    # and the gradient passes through unchanged (an eval-mode graph can be differentiated)
    A = pooled(A3)["A"]
    v, w = np.array([0.5, -1.0, 2.0], np.float32), np.array([1.0, 0.0, -1.0], np.float32)
    dx.squared_distance(dx.dropout(inp(v) + A, 0.5), inp(w)).backward()
    np.testing.assert_allclose(np.asarray(A.grad), 2 * (v + np.asarray(A.value) - w), **TOL)
    A.zero_grad()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_input_values(strategy):
    dx.renew_cg(autobatch=strategy)
    f64 = np.linspace(-1, 1, 6).reshape(2, 3)
    ints = np.arange(3, dtype=np.int64)
    bools = np.array([True, False, True])
    nonfinite = np.array([np.nan, np.inf, -np.inf])
    es = [inp(f64), inp(ints), inp(bools), inp(nonfinite), inp(2.5), inp(3), inp(np.array(1.5)),
          inp([1.0, 2.0, 3.0]), inp(jnp.ones((2, 3)))]
    wants = [f64, ints, bools, nonfinite, 2.5, 3, 1.5, [1.0, 2.0, 3.0], np.ones((2, 3))]
    for e, w in zip(es, wants):
        w = np.asarray(w, np.float32)
        assert tuple(e.shape) == w.shape
        got = e.npvalue()
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        np.testing.assert_array_equal(got, w)
    assert es[4].value() == 2.5 and isinstance(es[4].value(), float)
    assert es[4].scalar_value() == 2.5
    assert isinstance(es[0].value(), np.ndarray)
    # a scalar constant combines with a vector; a non-finite one flows through ops as in NumPy
    np.testing.assert_allclose((es[7] * es[4]).npvalue(), [2.5, 5.0, 7.5], **TOL)
    np.testing.assert_allclose(dx.exp(es[3]).npvalue(), np.exp(nonfinite.astype(np.float32)),
                               rtol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_input_is_constant(strategy):
    """dx.input copies its argument: later changes to the array do not leak into the lazy
    graph; and it gets no gradient (only the parameter does)."""
    A = pooled(A3)["A"]
    dx.renew_cg(autobatch=strategy)
    x = np.array([1.0, 2.0, 3.0], np.float32)
    e = inp(x)
    loss = dx.sum_elems(dx.cmult(e, A))
    x[:] = 0.0
    loss.backward()
    np.testing.assert_allclose(np.asarray(A.grad), [1.0, 2.0, 3.0], **TOL)
    np.testing.assert_array_equal(e.npvalue(), [1.0, 2.0, 3.0])
    A.zero_grad()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_incremental_forward(strategy):
    """Values asked for in stages: later calls compute only what is new, earlier values stay."""
    P = pooled({**A3, "E": ((7, 3), "lookup")})
    A, E = P["A"], P["E"]
    cg = dx.renew_cg(autobatch=strategy)
    r = np.random.default_rng(3)
    xs = [normal(r, 3) for _ in range(3)]
    hs = [dx.tanh(ev(P, x)) for x in xs]
    first = hs[0].npvalue()
    np.testing.assert_allclose(first, np.tanh(xs[0] + A.value), **TOL)
    n_batches = cg.stats()["batches"]
    assert n_batches > 0
    losses = [dx.pickneglogsoftmax(dx.cmult(h, E[i]), y) for h, i, y in zip(hs, (1, 2, 6), _IDX)]
    total = dx.esum(losses)
    ref = sum(-jax.nn.log_softmax(jnp.tanh(x + A.value) * E.value[i])[y]
              for x, i, y in zip(xs, (1, 2, 6), _IDX))
    np.testing.assert_allclose(total.scalar_value(), ref, **TOL)
    assert cg.stats()["batches"] > n_batches
    np.testing.assert_array_equal(hs[0].npvalue(), first)
    assert cg.stats()["nodes"] == 3 * 5 + 1


def test_backward_accumulates_across_graphs():
    A = pooled(A3)["A"]
    x = np.array([1.0, -2.0, 0.5], np.float32)
    for _ in range(2):
        dx.renew_cg()
        dx.sum_elems(dx.cmult(inp(x), A)).backward()
    np.testing.assert_allclose(np.asarray(A.grad), 2 * x, **TOL)
    A.zero_grad()
    np.testing.assert_array_equal(np.asarray(A.grad), np.zeros(3))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_backward_of_part_of_a_batch(strategy):
    """The loss uses some lanes of a batch only, and nodes built after it exist: the other
    lanes contribute nothing to the gradient."""
    P = pooled(A3)
    A = P["A"]
    cg = dx.renew_cg(autobatch=strategy)
    r = np.random.default_rng(7)
    xs = [normal(r, 3) for _ in range(N)]
    ys = [normal(r, 3) for _ in range(N)]
    hs = [dx.tanh(ev(P, x)) for x in xs]
    loss = dx.esum([dx.squared_distance(hs[k], inp(ys[k])) for k in (0, 2)])
    later = [dx.tanh(ev(P, xs[1]))]  # built after the loss, same signatures (4 lanes in all)
    dx.forward(hs + later)
    loss.backward()

    def ref(a):
        return sum(jnp.sum((jnp.tanh(xs[k] + a) - ys[k]) ** 2) for k in (0, 2))

    want_loss, want_grad = jax.value_and_grad(ref)(A.value)
    np.testing.assert_allclose(loss.scalar_value(), want_loss, **TOL)
    np.testing.assert_allclose(np.asarray(A.grad), want_grad, **TOL)
    # a second backward of the same loss accumulates, and another loss adds its own part
    loss.backward()
    np.testing.assert_allclose(np.asarray(A.grad), 2 * want_grad, **TOL)
    dx.sum_elems(later[0]).backward()
    extra = jax.grad(lambda a: jnp.sum(jnp.tanh(xs[1] + a)))(A.value)
    np.testing.assert_allclose(np.asarray(A.grad), 2 * want_grad + extra, **TOL)
    if strategy != "none":
        assert cg.stats()["batches"] < cg.stats()["nodes"]
    A.zero_grad()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forward_fetches_values_together(strategy):
    """dx.forward copies the listed values to the host together (one gather per shape);
    reads after it equal one-by-one reads, for every shape including 0-d, and reading a
    value computed by a later forward still works."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 4), name="W")
    xs = [np.full(4, i / 7, np.float32) for i in range(11)]

    def build():
        hs = [dx.tanh(W @ dx.input(x)) for x in xs]
        return hs + [dx.sum_elems(h) for h in hs]

    dx.renew_cg(autobatch="none")
    want = [e.npvalue() for e in build()]
    cg = dx.renew_cg(autobatch=strategy)
    exprs = build()
    dx.forward(exprs[::2])
    assert len(cg.host_values) == len(exprs[::2])
    for e, w in zip(exprs, want):  # fetched and not-fetched values alike
        got = e.npvalue()
        assert isinstance(got, np.ndarray) and got.shape == w.shape
        np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6)
    late = dx.tanh(exprs[0] * 2.0)
    dx.forward([late])
    np.testing.assert_allclose(late.npvalue(), np.tanh(2 * want[0]), rtol=1e-6, atol=1e-6)
    dx.renew_cg()
    with pytest.raises(dx.StaleExpressionError):
        dx.forward(exprs[:1])
    with pytest.raises(TypeError):
        dx.forward([np.ones(3)])


def test_fetches_of_small_values_share_few_gather_sizes(monkeypatch):
    """A step-by-step model fetches a different number of values at almost every step (a
    parser's scores as its parsers finish); each padded row count is a gather kernel to
    compile, so small values take the coarse ladder: fetching 1 to 64 three-element values
    gathers 4, 16 or 64 rows, and every value read equals its node-by-node reference."""
    from dynax.executor import engine
    gathered = []
    real = engine._gather_rows
    monkeypatch.setattr(engine, "_gather_rows",
                        lambda arena, rows: gathered.append(len(rows)) or real(arena, rows))
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 4), name="W")
    xs = [np.full(4, i / 70, np.float32) for i in range(64)]
    dx.renew_cg(autobatch="none")
    want = [dx.tanh(W @ dx.input(x)).npvalue() for x in xs]
    gathered.clear()  # the reference's reads gather one row each
    for n in range(1, 65):
        dx.renew_cg(autobatch="agenda")
        hs = [dx.tanh(W @ dx.input(x)) for x in xs[:n]]
        dx.forward(hs)
        for h, w in zip(hs, want):
            np.testing.assert_allclose(h.npvalue(), w, rtol=1e-6, atol=1e-6)
    assert set(gathered) == {4, 16, 64}, sorted(set(gathered))


@pytest.mark.parametrize("strategy", ["agenda", "depth", "none"])
def test_binary_log_loss_of_saturated_predictions(strategy):
    """``logistic(z)`` rounds to exactly 1 (or 0) in float32 for |z| > ~17: the loss and
    its gradient stay finite and close to the exact softplus, and a wrong prediction at
    exactly 0 costs -log(tiny) = 87.3, as in DyNet."""
    pc = dx.ParameterCollection(seed=0)
    z0 = np.float32([17.0, -17.0, 100.0, -100.0, 3.0])
    y = np.float32([1, 0, 1, 0, 1])
    Z = pc.add_parameters((5,), init=z0, name="Z")
    dx.renew_cg(autobatch=strategy)
    loss = dx.binary_log_loss(dx.logistic(Z), dx.input(y))
    value = loss.scalar_value()
    loss.backward()
    exact = np.logaddexp(0.0, -np.where(y > 0, z0, -z0).astype(np.float64))  # per element
    np.testing.assert_allclose(value, exact.sum(), rtol=1e-6, atol=1e-7)
    # in float64: exp(100) overflows float32 (the exact value, 0, is the same)
    exact_grad = -np.where(y > 0, 1.0, -1.0) / (
        1.0 + np.exp(np.where(y > 0, z0, -z0).astype(np.float64)))
    np.testing.assert_allclose(np.asarray(Z.grad), exact_grad, rtol=1e-5, atol=1e-7)
    wrong = dx.binary_log_loss(dx.input(np.float32([0.0])), dx.input(np.float32([1.0])))
    np.testing.assert_allclose(wrong.scalar_value(), -np.log(np.finfo(np.float32).tiny),
                               rtol=1e-6)


@pytest.mark.parametrize("strategy", ["agenda", "depth", "none"])
def test_hinge_at_large_scores_is_exact(strategy):
    """The label's own term is left out exactly: no rounding of margin - x + x at large
    scores (a subtraction gave -2e-4 for a loss of 0 at x[label] = 1e4)."""
    dx.renew_cg(autobatch=strategy)
    losses = [dx.hinge(dx.input(np.float32(x)), label, margin=m)
              for x, label, m in (([1e4, 0.0, -5.0], 0, 0.3), ([3e7, 0.0, 1.0], 0, 1.0),
                                  ([1e5, -3.0, 1e5 - 8.0], 0, 1.0))]
    dx.forward(losses)
    np.testing.assert_array_equal([l.scalar_value() for l in losses], [0.0, 0.0, 0.0])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_number_operands_are_data_not_signature(strategy):
    """``e * w``, ``w - e``, ``e / w``, ``w + e`` for a different Python number per instance
    (per-instance weights, an annealed factor): the numbers are data, so each operator is
    one batch whatever the values, and a new graph with new numbers compiles nothing (as
    part of the signature, each value was a batch and a compilation). Values and gradients
    equal jax.grad's."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 4), name="W")
    xs = np.random.default_rng(0).standard_normal((12, 4)).astype(np.float32)

    def build(weights):
        cg = dx.renew_cg(autobatch=strategy)
        terms = []
        for x, w in zip(xs, weights):
            h = dx.tanh(W @ dx.input(x))
            terms.append(dx.sum_elems(((h * w) / (w + 1.0) + (2.0 - h) * -0.0) * (1 - w)))
        return cg, dx.esum(terms)

    def ref(Wv, weights):
        return sum(jnp.sum((jnp.tanh(Wv @ x) * w) / (w + 1.0) * (1 - w))
                   for x, w in zip(xs, weights))

    for seed in (1, 2):
        weights = [float(w) for w in np.random.default_rng(seed).uniform(0.1, 0.9, len(xs))]
        W.zero_grad()
        cg, loss = build(weights)
        loss.backward()
        np.testing.assert_allclose(loss.scalar_value(), ref(W.value, weights), rtol=1e-5)
        np.testing.assert_allclose(W.grad, jax.grad(ref)(jnp.asarray(W.value), weights),
                                   rtol=1e-5, atol=1e-6)
        if strategy != "none":  # every operator one batch: the 12 instances' values differ
            assert cg.stats()["batches"] <= 12
        if seed == 2:  # the same graph shape with new numbers: nothing new to compile
            assert cg.stats()["compiles"] == 0


def test_bfloat16_data_is_taken_as_float32():
    """bfloat16 arrays (JAX's own low-precision type) are real numbers: inputs, initial
    values and set_value take them, converted to float32, as float16 ones are."""
    x = jnp.asarray([1.5, -2.0, 0.25], jnp.bfloat16)
    dx.renew_cg()
    np.testing.assert_array_equal(dx.input(x).npvalue(), [1.5, -2.0, 0.25])
    pc = dx.ParameterCollection(seed=0)
    p = pc.add_parameters((3,), init=np.asarray(x))
    np.testing.assert_array_equal(p.value, [1.5, -2.0, 0.25])
    p.set_value(x * 2)
    assert p.value.dtype == jnp.float32
    np.testing.assert_array_equal(p.value, [3.0, -4.0, 0.5])
