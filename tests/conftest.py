import os
import shutil
import tempfile

import jax

import dynax as dx

# Implicit rank promotion hides broadcasting bugs; dynax must never rely on it.
jax.config.update("jax_numpy_rank_promotion", "raise")

# Compiled kernels shared through JAX's persistent cache, one directory per test session: the
# two xdist workers compile many of the same kernels, and a worker compiles again the kernels
# of each test's fresh parameters (new signatures, the same XLA program). Loaded kernels count
# as ``cache_loads``, not ``compiles``; tests that count what a pass builds count both. The
# controller makes the directory before the workers start (they inherit the variable).
_KERNELS = "DYNAX_TEST_KERNEL_CACHE"
_made_here = _KERNELS not in os.environ
if _made_here:
    os.environ[_KERNELS] = tempfile.mkdtemp(prefix="dynax-test-kernels-")
dx.set_compilation_cache(os.environ[_KERNELS])


def pytest_unconfigure(config):
    if _made_here:
        shutil.rmtree(os.environ.pop(_KERNELS), ignore_errors=True)
