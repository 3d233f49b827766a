"""``dx.set_cpu_threads``: XLA:CPU's intra-op pool takes the size asked for, the setting is
refused once JAX's backends exist, and bad counts are rejected.

The pool size is read from the thread names of a fresh subprocess (Linux ``/proc``): XLA
names its intra-op workers ``XLAEigen``.
"""
import os
import textwrap

import jax
import pytest

import dynax as dx

from cpu_child import run_cpu_child

CHILD = textwrap.dedent("""
    import os, sys
    import dynax as dx
    dx.set_cpu_threads(int(sys.argv[1]))
    import jax, jax.numpy as jnp
    x = jnp.ones((256, 256))
    jax.block_until_ready(jax.jit(lambda a: a @ a)(x))
    names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
    print(sum("XLAEigen" in s for s in names))
""")


def _eigen_threads(n: int) -> int:
    return int(run_cpu_child(CHILD, n).split()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_pool_takes_the_requested_size():
    three = _eigen_threads(3)  # more than this 2-core machine has: the count is taken
    if three == 0:
        pytest.skip("this jaxlib does not name its intra-op threads XLAEigen")
    assert three == 3
    assert _eigen_threads(1) == 1


def test_refused_once_backends_exist():
    jax.devices()  # this test process has its backends (the other tests use them too)
    before = os.environ.get("PJRT_NPROC")
    with pytest.raises(RuntimeError, match="before the first JAX computation"):
        dx.set_cpu_threads(1)
    assert os.environ.get("PJRT_NPROC") == before  # nothing half-applied


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True, None])
def test_bad_counts_are_rejected(bad):
    with pytest.raises(ValueError, match="positive integer"):
        dx.set_cpu_threads(bad)
