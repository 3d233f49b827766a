"""``dx.set_compilation_cache``: a second process loads the first one's kernels instead of
compiling them (``cg.stats()`` tells loads from compilations), with identical results; the
cache cannot move once JAX has opened it; bad paths are rejected.

The cache is process-wide JAX state, so everything that sets it runs in subprocesses.
"""
import os
import subprocess
import sys
import textwrap

import pytest

import dynax as dx

CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import dynax as dx
    dx.set_compilation_cache(sys.argv[1])
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((20, 6), name="E")
    W = pc.add_parameters((4, 6), name="W")
    trainer = dx.AdamTrainer(pc, alpha=0.1)
    cg = dx.renew_cg()
    loss = dx.esum([dx.pickneglogsoftmax(W @ dx.tanh(E[i]), i % 4) for i in range(5)])
    value = loss.value()
    loss.backward()
    trainer.update()
    st = cg.stats()
    print(st["compiles"], st["cache_loads"], repr(value), repr(np.asarray(W.value).tolist()))
    try:
        dx.set_compilation_cache(sys.argv[1] + "-elsewhere")
    except RuntimeError as e:
        print("refused:", e)
    dx.set_compilation_cache(sys.argv[1])  # the same directory again is fine
""")


def _run(cache_dir):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(cache_dir)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    counts, refusal = out.stdout.strip().split("\n")
    compiles, loads, value, w = counts.split(" ", 3)
    return int(compiles), int(loads), value, w, refusal


def test_second_process_loads_instead_of_compiling(tmp_path):
    cache = tmp_path / "cache"
    c1, l1, v1, w1, refusal = _run(cache)
    assert c1 > 0 and l1 == 0
    assert any(cache.iterdir())
    c2, l2, v2, w2, _ = _run(cache)
    assert (c2, l2) == (0, c1)  # every kernel loaded, none compiled
    assert (v2, w2) == (v1, w1)  # the same loss and the same trained parameters, to the bit
    assert refusal.startswith("refused:") and "cannot switch" in refusal


@pytest.mark.parametrize("bad", [3, None, "", b"/tmp/x"])
def test_bad_paths_are_rejected(bad):
    with pytest.raises(ValueError, match="set_compilation_cache"):
        dx.set_compilation_cache(bad)


def test_a_directory_that_cannot_be_made_is_rejected_at_once(tmp_path):
    """JAX itself only warns at its first compilation and caches nothing; the setter says
    so where it is called, and leaves the setting as it was."""
    import jax
    before = jax.config.jax_compilation_cache_dir
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="cannot create the directory"):
        dx.set_compilation_cache(blocker / "cache")
    assert jax.config.jax_compilation_cache_dir == before
