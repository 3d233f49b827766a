"""``dx.nn.from_flax``: Flax modules as one batched graph node per call.

Values and parameter gradients of a block inside a dynax graph are compared with plain JAX
(``module.apply`` and ``jax.grad`` over the same parameter tree) under every strategy.
"""
import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dynax as dx

TOL = dict(rtol=1e-5, atol=1e-6)
IN, OUT, N = 4, 3, 6
RNG = np.random.default_rng(0)
XS = RNG.standard_normal((N, IN)).astype(np.float32)
YS = [i % OUT for i in range(N)]


class MLP(nn.Module):
    hidden: int = 8

    @nn.compact
    def __call__(self, x):
        return nn.Dense(OUT)(nn.tanh(nn.Dense(self.hidden)(x)))


class TwoHeads(nn.Module):
    """Two inputs, two outputs (a dict), to check structure in and out."""

    @nn.compact
    def __call__(self, x, h):
        z = nn.tanh(nn.Dense(IN)(x) + h)
        return {"logits": nn.Dense(OUT, use_bias=False)(z), "state": z}


PC = dx.ParameterCollection(seed=0)
MODULE = MLP()
BLOCK = dx.nn.from_flax(MODULE, PC, np.zeros(IN, np.float32))
# references are jitted: eagerly, Flax compiles op by op (seconds per test)
mlp_apply = jax.jit(lambda params, x: MODULE.apply({"params": params}, x))


@jax.jit
def _reference(params):
    """Outputs, loss and loss gradient in plain JAX (jitted: one compile, not one per op)."""
    def loss(params):
        logits = jax.vmap(lambda x: MODULE.apply({"params": params}, x))(XS)
        return -jnp.sum(jax.nn.log_softmax(logits)[jnp.arange(N), jnp.asarray(YS)]), logits
    (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logits, value, grads


def test_parameters_are_named_by_flax_path_and_initialised_by_init():
    names = [p.name for p in BLOCK.params]
    assert names == ["MLP/Dense_0/bias", "MLP/Dense_0/kernel",
                     "MLP/Dense_1/bias", "MLP/Dense_1/kernel"]
    assert PC["MLP/Dense_0/kernel"] is BLOCK.params[1]
    key = jax.random.PRNGKey(7)
    block = dx.nn.from_flax(MODULE, dx.ParameterCollection(), XS[0], rng=key)
    want = jax.tree_util.tree_leaves(jax.jit(MODULE.init)(key, XS[0])["params"])
    for p, leaf in zip(block.params, want, strict=True):
        np.testing.assert_array_equal(np.asarray(p.value), np.asarray(leaf), err_msg=p.name)


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda"])
def test_values_and_gradients_match_plain_jax(strategy):
    for p in PC.parameters():
        p.zero_grad()
    cg = dx.renew_cg(autobatch=strategy)
    xs = [dx.input(x) for x in XS]
    before = cg.stats()["nodes"]
    outs = [BLOCK(x) for x in xs]
    assert cg.stats()["nodes"] - before == N  # one node per call
    loss = dx.esum([dx.pickneglogsoftmax(o, y) for o, y in zip(outs, YS)])
    loss.backward()

    logits, value, grads = _reference(BLOCK.flax_params())
    for o, want in zip(outs, np.asarray(logits), strict=True):
        np.testing.assert_allclose(o.npvalue(), want, **TOL)
    np.testing.assert_allclose(loss.scalar_value(), float(value), **TOL)
    grads = jax.tree_util.tree_leaves(grads)
    for p, g in zip(BLOCK.params, grads, strict=True):
        assert np.abs(np.asarray(g)).max() > 0, p.name  # the check below is not vacuous
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(g), err_msg=p.name, **TOL)
    if strategy != "none":  # all six calls ran as one kernel
        assert cg.stats()["batches"] < cg.stats()["nodes"] - N + 1


def test_several_inputs_and_structured_outputs():
    pc = dx.ParameterCollection(seed=1)
    module = TwoHeads()
    x0, h0 = np.zeros(IN, np.float32), np.zeros(IN, np.float32)
    block = dx.nn.from_flax(module, pc, (x0, h0), name="heads")
    assert [p.name for p in pc.parameters()] == [
        "heads/Dense_0/bias", "heads/Dense_0/kernel", "heads/Dense_1/kernel"]
    dx.renew_cg(autobatch="agenda")
    outs = [block(dx.input(x), dx.input(XS[-1 - i])) for i, x in enumerate(XS[:3])]
    assert set(outs[0]) == {"logits", "state"}
    dx.forward([o["logits"] for o in outs])
    apply = jax.jit(module.apply)
    for i, o in enumerate(outs):
        want = apply({"params": block.flax_params()}, XS[i], XS[-1 - i])
        for k in ("logits", "state"):
            np.testing.assert_allclose(o[k].npvalue(), np.asarray(want[k]), **TOL)


def test_nnx_module_values_and_gradients():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(IN, 5, rngs=rngs)
            self.b = nnx.Linear(5, OUT, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    net = Net(nnx.Rngs(0))
    pc = dx.ParameterCollection(seed=2)
    block = dx.nn.from_flax(net, pc, np.zeros(IN, np.float32))
    assert [p.name for p in pc.parameters()] == ["Net/a/bias", "Net/a/kernel",
                                                 "Net/b/bias", "Net/b/kernel"]
    dx.renew_cg(autobatch="agenda")
    outs = [block(dx.input(x)) for x in XS]
    dx.esum([dx.sum_elems(o) for o in outs]).backward()
    want = np.asarray(nnx.jit(nnx.vmap(lambda m, x: m(x), in_axes=(None, 0)))(net, XS))
    for o, w in zip(outs, want, strict=True):
        np.testing.assert_allclose(o.npvalue(), w, **TOL)
    graphdef, state = nnx.split(net, nnx.Param)

    @jax.jit
    def ref_grad(state):
        return jax.grad(lambda s: jnp.sum(jax.vmap(nnx.merge(graphdef, s))(XS)))(state)
    grads = jax.tree_util.tree_leaves(ref_grad(state))
    for p, g in zip(block.params, grads, strict=True):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(g), err_msg=p.name, **TOL)
    # new dynax values go back into the nnx module in its own layout
    for p in block.params:
        p.set_value(np.asarray(p.value) * 0.5)
    nnx.update(net, block.flax_params())
    np.testing.assert_allclose(np.asarray(net.b.kernel[...]),
                               np.asarray(pc["Net/b/kernel"].value), **TOL)


def test_trainer_updates_flax_parameters_and_lowers_the_loss():
    pc = dx.ParameterCollection(seed=3)
    block = dx.nn.from_flax(MLP(), pc, np.zeros(IN, np.float32))
    start = {p.name: np.array(p.value) for p in block.params}
    trainer = dx.Trainer(pc, optax.adam(0.1))
    losses = []
    for _ in range(15):
        dx.renew_cg()
        loss = dx.esum([dx.pickneglogsoftmax(block(dx.input(x)), y) for x, y in zip(XS, YS)])
        losses.append(loss.scalar_value())
        loss.backward()
        trainer.update()
    assert losses[-1] < 0.3 * losses[0], losses
    for p in block.params:
        assert not np.array_equal(np.asarray(p.value), start[p.name]), p.name
    # the trained tree, in Flax's layout, gives Flax the block's outputs
    dx.renew_cg()
    x = XS[0]
    np.testing.assert_allclose(
        block(dx.input(x)).npvalue(),
        np.asarray(mlp_apply(block.flax_params(), x)), **TOL)


def test_wrong_input_shape_is_a_clear_error():
    dx.renew_cg()
    cg = dx.current_graph()
    with pytest.raises(ValueError, match=r"input 0 has shape \(5,\), expected \(4,\)"):
        BLOCK(np.zeros(5, np.float32))
    assert cg.stats()["values"] == 0  # the failed call left no constant in the graph
    with pytest.raises(ValueError, match="expected 1 input"):
        BLOCK(dx.input(XS[0]), dx.input(XS[1]))

    class Fixed(nn.Module):  # needs exactly 4 inputs: an example of another shape cannot work
        @nn.compact
        def __call__(self, x):
            return self.param("W", nn.initializers.ones, (2, IN)) @ x

    pc = dx.ParameterCollection()
    with pytest.raises(ValueError, match=r"Fixed.init failed on an example input of shape "
                                         r"\(2, 4\)"):
        dx.nn.from_flax(Fixed(), pc, np.zeros((2, IN), np.float32))  # a batch by mistake
    assert pc.parameters() == []
    with pytest.raises(TypeError, match="flax"):
        dx.nn.from_flax(lambda x: x, pc, np.zeros(IN))


def test_block_saves_and_loads_with_dx_save(tmp_path):
    pc = dx.ParameterCollection(seed=4)
    block = dx.nn.from_flax(MLP(), pc, np.zeros(IN, np.float32))
    dx.save(tmp_path / "mlp.npz", [BLOCK])
    dx.load(tmp_path / "mlp.npz", [block])
    for p, q in zip(BLOCK.params, block.params, strict=True):
        np.testing.assert_array_equal(np.asarray(q.value), np.asarray(p.value))


def test_equal_modules_share_compiled_kernels():
    pc = dx.ParameterCollection(seed=5)
    first = dx.nn.from_flax(MLP(), pc, np.zeros(IN, np.float32))
    second = dx.nn.from_flax(MLP(), pc, np.zeros(IN, np.float32))
    assert second.params[0].name == "MLP_1/Dense_0/bias"

    def run(block):
        cg = dx.renew_cg(autobatch="agenda")
        outs = [block(dx.input(x)) for x in XS]
        dx.esum([dx.pickneglogsoftmax(o, y) for o, y in zip(outs, YS)]).backward()
        return cg.stats()["compiles"], outs[0].npvalue()

    run(first)
    compiles, out = run(second)
    assert compiles == 0
    np.testing.assert_allclose(
        out, np.asarray(mlp_apply(second.flax_params(), XS[0])), **TOL)


class Normed(nn.Module):
    """A Dense then a BatchNorm in inference mode: parameters and batch statistics."""

    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=True)(nn.Dense(OUT)(x))


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_linen_block_from_pretrained_variables_and_back(strategy):
    """``variables=`` starts a block from pretrained weights and statistics (not
    ``module.init``); ``flax_variables()`` gives every collection back, so Flax applies the
    trained module itself. Values and gradients match plain JAX on those variables."""
    module = Normed()
    init = jax.jit(module.init)(jax.random.PRNGKey(3), XS[0])
    stats = jax.tree_util.tree_map(lambda a: a + 0.5, init["batch_stats"])  # "pretrained"
    params = jax.tree_util.tree_map(lambda a: a * 2.0 + 0.1, init["params"])
    pretrained = {"params": params, "batch_stats": stats}
    block = dx.nn.from_flax(module, dx.ParameterCollection(seed=0), XS[0],
                            variables=pretrained)
    dx.renew_cg(autobatch=strategy)
    outs = [block(dx.input(x)) for x in XS]
    loss = dx.esum([dx.pickneglogsoftmax(o, y) for o, y in zip(outs, YS)])
    loss.backward()

    def ref(params):
        logits = jax.vmap(lambda x: module.apply({"params": params, "batch_stats": stats},
                                                 x))(XS)
        return -jnp.sum(jax.nn.log_softmax(logits)[jnp.arange(N), jnp.asarray(YS)]), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(ref, has_aux=True))(params)
    np.testing.assert_allclose(np.stack([o.npvalue() for o in outs]), logits, **TOL)
    np.testing.assert_allclose(loss.scalar_value(), float(value), **TOL)
    for p, g in zip(block.params, jax.tree_util.tree_leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(g), err_msg=p.name, **TOL)
    got = block.flax_variables()
    assert set(got) == {"params", "batch_stats"}
    np.testing.assert_allclose(jax.jit(module.apply)(got, XS[1]), outs[1].npvalue(), **TOL)
    with pytest.raises(ValueError, match="'params' entry"):
        dx.nn.from_flax(module, dx.ParameterCollection(), XS[0], variables=params)


class Switched(nn.Module):
    """A module whose call needs a keyword: ``train`` changes the math, ``scale`` multiplies
    the output and ``with_hidden`` changes the output's structure."""

    @nn.compact
    def __call__(self, x, *, train: bool, scale: float = 1.0, with_hidden: bool = False):
        h = nn.tanh(nn.Dense(IN)(x))
        y = nn.Dense(OUT)(h if train else 0.5 * h) * scale
        return (y, h) if with_hidden else y


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_call_keywords_are_static_and_batched_apart(strategy):
    """``call_kwargs`` serve ``init`` and every call; a call's own keywords override them.
    Calls with different keywords are different node types, each batched; values and
    gradients equal ``module.apply`` with the same keywords under ``jax.grad``."""
    module = Switched()
    pc = dx.ParameterCollection(seed=2)
    with pytest.raises(ValueError, match="Switched.init failed .*train"):
        dx.nn.from_flax(module, pc, XS[0])  # the call needs ``train``
    assert not pc.parameters()
    block = dx.nn.from_flax(module, pc, XS[0], call_kwargs={"train": False})
    kws = [{}, {"train": True}, {"scale": 3.0}, {"train": False}, {"train": True}, {}]
    cg = dx.renew_cg(autobatch=strategy)
    outs = [block(dx.input(x), **kw) for x, kw in zip(XS, kws)]
    hidden = block(dx.input(XS[0]), with_hidden=True, train=True)
    assert isinstance(hidden, tuple) and hidden[1].shape == (IN,)
    names = {s.op.name for s in cg.node_sig if s.op.name.startswith("flax:")}
    assert names == {"flax:Switched,train=False", "flax:Switched,train=True",
                     "flax:Switched,scale=3.0,train=False",
                     "flax:Switched,train=True,with_hidden=True"}
    loss = dx.esum([dx.pickneglogsoftmax(o, y) for o, y in zip(outs, YS)]
                   + [dx.sum_elems(hidden[1])])
    loss.backward()
    if strategy == "agenda":  # equal keywords batch: 3 node types for the 6 plain calls
        assert cg.stats()["batches"] < cg.stats()["nodes"]

    def ref(params):
        total = 0.0
        for x, y, kw in zip(XS, YS, kws):
            logits = module.apply({"params": params}, x, **{"train": False, **kw})
            total -= jax.nn.log_softmax(logits)[y]
        _, h = module.apply({"params": params}, XS[0], train=True, with_hidden=True)
        return total + jnp.sum(h)

    params = block.flax_params()
    want = [module.apply({"params": params}, x, **{"train": False, **kw})
            for x, kw in zip(XS, kws)]
    for o, w in zip(outs, want, strict=True):
        np.testing.assert_allclose(o.npvalue(), np.asarray(w), **TOL)
    train_value = module.apply({"params": params}, XS[0], train=True)
    assert not np.allclose(outs[0].npvalue(), np.asarray(train_value))  # train matters
    grads = jax.tree_util.tree_leaves(jax.grad(ref)(params))
    for p, g in zip(block.params, grads, strict=True):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(g), err_msg=p.name, **TOL)
    with pytest.raises(dx.ArgumentTypeError,
                       match=r"keyword argument scale=array.* of type ndarray.* are static"):
        block(dx.input(XS[0]), scale=np.ones(2))
    with pytest.raises(ValueError, match="Switched failed .*train=False, zoom=2"):
        block(dx.input(XS[0]), zoom=2)


def test_nnx_call_keywords():
    class Doubler(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(IN, OUT, rngs=rngs)

        def __call__(self, x, *, double=False):
            return self.lin(x) * (2.0 if double else 1.0)

    module = Doubler(nnx.Rngs(0))
    block = dx.nn.from_flax(module, dx.ParameterCollection(seed=0), XS[0])
    dx.renew_cg()
    one, two = block(dx.input(XS[1])), block(dx.input(XS[1]), double=True)
    np.testing.assert_allclose(two.npvalue(), 2 * one.npvalue(), **TOL)
    np.testing.assert_allclose(one.npvalue(), np.asarray(module(XS[1])), **TOL)


class Head(nn.Module):
    """An int ``k`` keeps the first k outputs, a float scales them: equal values of different
    types (2 and 2.0) are different settings."""

    @nn.compact
    def __call__(self, x, k=2):
        y = nn.Dense(OUT)(x)
        return y[:k] if isinstance(k, int) else y * k


def test_equal_keyword_values_of_different_types_are_different_settings():
    x = XS[0]
    block = dx.nn.from_flax(Head(), dx.ParameterCollection(seed=0), x)
    dx.renew_cg()
    as_float, as_int = block(dx.input(x), k=2.0), block(dx.input(x), k=2)
    nans = [block(dx.input(x), k=float("nan")) for _ in range(2)]
    assert (as_float.shape, as_int.shape) == ((OUT,), (2,))
    # the default, 2.0, 2 and nan: the second nan call reuses the first's setting
    assert nans[1].shape == (OUT,) and len(block._variants) == 4
    want = Head().apply(block.flax_variables(), x, k=2.0)
    np.testing.assert_allclose(as_float.npvalue(), np.asarray(want), **TOL)
    # blocks of equal modules share kernels per setting, not across 2 and 2.0
    b2 = dx.nn.from_flax(Head(), dx.ParameterCollection(seed=0), x, call_kwargs={"k": 2.0})
    b3 = dx.nn.from_flax(Head(), dx.ParameterCollection(seed=0), x, call_kwargs={"k": 2})
    assert (b2.output_shapes, b3.output_shapes) == ([(OUT,)], [(2,)])
    dx.renew_cg()
    np.testing.assert_allclose(b3(dx.input(x)).npvalue(), np.asarray(want)[:2] / 2.0, **TOL)


# Parameter leaves inside containers: a namedtuple (attribute keys), a tuple (sequence keys),
# a pytree node registered without keys (flattened-index keys) and one registered with keys
# of its own type (named by their str, made a valid dynax name).
Pair = collections.namedtuple("Pair", "a b")


class Opaque:
    def __init__(self, w):
        self.w = w


class OddKey:
    def __str__(self):
        return "w[1]"

    def __hash__(self):
        return 1

    def __eq__(self, other):
        return isinstance(other, OddKey)


class Keyed:
    def __init__(self, w):
        self.w = w


jax.tree_util.register_pytree_node(Opaque, lambda o: ((o.w,), None), lambda _, c: Opaque(*c))
jax.tree_util.register_pytree_with_keys(Keyed, lambda o: (((OddKey(), o.w),), None),
                                        lambda _, c: Keyed(*c))


class Containers(nn.Module):
    @nn.compact
    def __call__(self, x):
        pair = self.param("pair", lambda k: Pair(jnp.ones(IN), jnp.zeros(IN)))
        seq = self.param("seq", lambda k: (jnp.full(IN, 2.0),))
        opaque = self.param("opaque", lambda k: Opaque(jnp.full(IN, 3.0)))
        keyed = self.param("keyed", lambda k: Keyed(jnp.full(IN, 0.5)))
        return pair.a * x + pair.b + seq[0] + opaque.w * keyed.w


def test_parameters_inside_containers_are_named_by_their_path():
    pc = dx.ParameterCollection(seed=0)
    block = dx.nn.from_flax(Containers(), pc, np.zeros(IN, np.float32))
    assert [p.name for p in pc.parameters()] == [
        "Containers/keyed/w_1_", "Containers/opaque/0", "Containers/pair/a",
        "Containers/pair/b", "Containers/seq/0"]
    assert repr(block) == "FlaxBlock(Containers, inputs=((4,),), parameters=5)"
    pc["Containers/pair/a"].set_value(np.full(IN, 2.0, np.float32))
    dx.renew_cg()
    got = block(dx.input(XS[0])).npvalue()
    np.testing.assert_allclose(got, 2.0 * XS[0] + 3.5, **TOL)
    np.testing.assert_allclose(
        got, np.asarray(jax.jit(Containers().apply)(block.flax_variables(), XS[0])), **TOL)


class Widths(nn.Module):
    """A list field: the module cannot be hashed (nor cached by ``jax.jit``'s static args)."""
    widths: list

    @nn.compact
    def __call__(self, x):
        for w in self.widths:
            x = nn.Dense(w)(x)
        return x


def test_a_module_with_unhashable_fields_works_with_a_kernel_of_its_own():
    module = Widths(widths=[5, OUT])
    with pytest.raises(TypeError):
        hash(module)
    pc = dx.ParameterCollection(seed=0)
    key = jax.random.PRNGKey(1)
    first = dx.nn.from_flax(module, pc, XS[0], rng=key)
    second = dx.nn.from_flax(Widths(widths=[5, OUT]), pc, XS[0], rng=key)
    want = jax.jit(module.init)(key, XS[0])["params"]
    for p, leaf in zip(first.params, jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(p.value), np.asarray(leaf), err_msg=p.name)
    assert first._default[0] is not second._default[0]  # no shared Function
    dx.renew_cg()
    out = first(dx.input(XS[1]))
    np.testing.assert_allclose(
        out.npvalue(), np.asarray(jax.jit(module.apply)(first.flax_variables(), XS[1])), **TOL)


class Counter(nn.Module):
    @nn.compact
    def __call__(self, x):
        self.param("n", lambda k: jnp.zeros((2,), jnp.int32))
        return x


class Silent(nn.Module):
    @nn.compact
    def __call__(self, x):
        nn.Dense(2)(x)
        return {}


class Argmax(nn.Module):
    @nn.compact
    def __call__(self, x, as_int=True):
        y = nn.Dense(OUT)(x)
        return jnp.argmax(y) if as_int else y


def test_an_example_input_of_ints_or_bools_is_taken_as_dx_input_takes_it():
    """dx.input stores float, int and bool arrays as float32; an example input may be
    any of them, and the block computes what the module does on the float32 values."""
    for example in (np.array([True, False, True, False]), np.arange(IN)):
        pc = dx.ParameterCollection(seed=0)
        block = dx.nn.from_flax(MLP(), pc, example)
        dx.renew_cg()
        want = MLP().apply(block.flax_variables(), example.astype(np.float32))
        np.testing.assert_allclose(block(dx.input(example)).npvalue(), want, rtol=1e-5,
                                   atol=1e-6)


def test_bad_examples_and_modules_are_refused_and_add_nothing():
    pc = dx.ParameterCollection(seed=0)
    cases = [
        (ValueError, r"example input 0 has dtype complex64", lambda: dx.nn.from_flax(
            MLP(), pc, np.ones(IN, np.complex64))),
        (ValueError, r"example input 1 has dtype <U1", lambda: dx.nn.from_flax(
            TwoHeads(), pc, (XS[0], np.array(list("abcd"))))),
        (ValueError, "example_input is an empty tuple",
         lambda: dx.nn.from_flax(MLP(), pc, ())),
        (ValueError, "parameter 'n' of Counter has dtype int32",
         lambda: dx.nn.from_flax(Counter(), pc, XS[0])),
        (ValueError, "Silent returned no arrays", lambda: dx.nn.from_flax(Silent(), pc, XS[0])),
        (ValueError, "Argmax returns a int32 array",
         lambda: dx.nn.from_flax(Argmax(), pc, XS[0])),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
    assert pc.parameters() == []
    net = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
    with pytest.raises(dx.ArgumentTypeError, match=r"variables= is for linen modules; an nnx "
                                                   r"module \(Linear\)"):
        dx.nn.from_flax(net, pc, XS[0], variables={"params": {}})
    # a construction error like any other: except ValueError catches it
    with pytest.raises(ValueError, match="from_flax: expected a flax.linen or flax.nnx Module, "
                                         "got object"):
        dx.nn.from_flax(object(), pc, XS[0])
    assert pc.parameters() == []
    block = dx.nn.from_flax(net, pc, XS[0])
    with pytest.raises(TypeError, match="flax_variables: an nnx block"):
        block.flax_variables()
    # a call whose keywords make the module return integers: refused, the graph unchanged
    argmax = dx.nn.from_flax(Argmax(), pc, XS[0], call_kwargs={"as_int": False})
    cg = dx.renew_cg()
    before = cg.stats()["nodes"], cg.stats()["values"]
    with pytest.raises(ValueError, match="Argmax, as_int=True returns a int32 array"):
        argmax(XS[0], as_int=True)
    assert (cg.stats()["nodes"], cg.stats()["values"]) == before
