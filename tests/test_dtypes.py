"""Values of other float dtypes than float32 (what a ``@dx.function`` returns: bfloat16,
float16) keep their dtype through list ops and number operands, as in JAX: a list's
padding item and a number operand take the items' or the other operand's dtype."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from reference import STRATEGIES

to_low = {d: dx.function(lambda x, d=d: x.astype(d)) for d in (jnp.bfloat16, jnp.float16)}
to_f32 = dx.function(lambda x: x.astype(jnp.float32))
LIST_OPS = {"esum": (dx.esum, lambda xs: sum(xs[1:], xs[0])),
            "average": (dx.average, lambda xs: sum(xs[1:], xs[0]) / len(xs)),
            "emax": (dx.emax, lambda xs: jnp.max(jnp.stack(xs), axis=0))}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("op", sorted(LIST_OPS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_list_ops_keep_the_items_dtype_at_every_length(strategy, op, dtype):
    """A float32 padding zero made the result float32 at the lengths that were padded
    (3, 5, 6, 7, 9, ...); the values and gradients are JAX's for the same casts."""
    dx_op, jax_op = LIST_OPS[op]
    pc = dx.ParameterCollection(seed=1)
    W = pc.add_parameters((4, 4), name="W")
    lengths = (1, 2, 3, 5, 8, 9, 17)
    dx.renew_cg(autobatch=strategy)
    x = dx.input(np.linspace(-1, 1, 4, dtype=np.float32))
    outs = []
    for n in lengths:
        items = [to_low[dtype](dx.tanh(W @ x * float(k + 1))) for k in range(n)]
        out = dx_op(items)
        assert out.dtype == dtype, (n, out.dtype)
        outs.append(dx.sum_elems(to_f32(out)))
    loss = dx.esum(outs)
    value = loss.value()
    loss.backward()

    def f(w):
        xv = jnp.linspace(-1, 1, 4, dtype=jnp.float32)
        total = 0.0
        for n in lengths:
            items = [jnp.tanh(w @ xv * (k + 1)).astype(dtype) for k in range(n)]
            total = total + jnp.sum(jax_op(items).astype(jnp.float32))
        return total
    want, g = jax.value_and_grad(f)(jnp.asarray(W.value))
    np.testing.assert_allclose(value, want, rtol=2e-2)
    np.testing.assert_allclose(W.grad, g, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_number_operands_are_weakly_typed(strategy):
    """``e * 2.0`` of a bfloat16 ``e`` is bfloat16, as in JAX (a float32 0-d constant made
    it float32); of a float32 ``e``, float32."""
    dx.renew_cg(autobatch=strategy)
    x = np.array([0.1, -1.3, 2.7], np.float32)
    e = to_low[jnp.bfloat16](dx.input(x))
    xj = jnp.asarray(x).astype(jnp.bfloat16)
    pairs = [(e * 2.0, xj * 2.0), (0.3 + e, 0.3 + xj), (e / 3.0, xj / 3.0), (1.0 - e, 1.0 - xj),
             (dx.input(x) * 0.3, jnp.asarray(x) * 0.3)]
    for got, want in pairs:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.npvalue(), np.asarray(want))


def test_float64_under_x64_warns_once_that_it_is_stored_as_float32():
    """A JAX user with ``jax_enable_x64`` may expect float64 math: a float64 init or
    constant is stored as float32, and dynax says so once (a PrecisionWarning)."""
    import subprocess
    import sys
    code = """if True:
        import warnings, numpy as np, jax
        jax.config.update("jax_enable_x64", True)
        import dynax as dx
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            pc = dx.ParameterCollection(seed=0)
            W = pc.add_parameters((2, 2), init=np.eye(2))            # float64
            x = dx.input(np.array([1.0, 2.0]))                       # float64
            y = dx.input(np.array([1.0, 2.0], np.float32))
            v = dx.sum_elems(W @ x + y).value()
        kinds = [type(m.message).__name__ for m in w]
        print(kinds, W.value.dtype, x.dtype, v)
        """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("]")[0] + "]" == "['PrecisionWarning']", out.stdout
    assert "float32 float32 6.0" in out.stdout


def test_float64_without_x64_does_not_warn():
    """NumPy's float64 default is what a DyNet user passes: no warning without x64."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dx.renew_cg()
        pc = dx.ParameterCollection(seed=0)
        W = pc.add_parameters((2, 2), init=np.eye(2))
        assert dx.sum_elems(W @ dx.input(np.array([1.0, 2.0]))).value() == 3.0
