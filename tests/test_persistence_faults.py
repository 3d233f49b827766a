"""A save killed midway leaves the previous file intact (saves go to a temporary file that is
renamed over the target only when complete). The saving process is a real subprocess killed
with SIGKILL: no Python cleanup runs, as when a job is killed by a scheduler."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import dynax as dx

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

SHAPE = (512, 512)


def _collection(fill: float) -> dx.ParameterCollection:
    pc = dx.ParameterCollection(seed=0)
    pc.add_parameters(SHAPE, init=np.full(SHAPE, fill, np.float32), name="W")
    pc.add_lookup_parameters((1000, 64), init=np.full((1000, 64), fill, np.float32), name="E")
    return pc


# The child builds the same collection with other values and saves it over the file.
CHILD = textwrap.dedent("""
    import os, sys, numpy as np
    import dynax as dx
    path, mode = sys.argv[1], sys.argv[2]
    pc = dx.ParameterCollection(seed=0)
    pc.add_parameters({shape}, init=np.full({shape}, 2.0, np.float32), name="W")
    pc.add_lookup_parameters((1000, 64), init=np.full((1000, 64), 2.0, np.float32), name="E")
    if mode == "stall":
        # every byte of the new file is written; stall before it is made durable and renamed
        def stall(fd):
            print("written", flush=True)
            import time
            time.sleep(600)
        os.fsync = stall
        pc.save(path)
    else:
        print("saving", flush=True)
        while True:
            pc.save(path)
""").format(shape=SHAPE)


def _start_child(path, mode):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # blocks until the child reaches its save
    if not line:
        proc.kill()
        raise AssertionError(f"child failed: {proc.stderr.read()}")
    return proc


def _load_values(path):
    pc = _collection(0.0)
    pc.populate(path)
    return {p.name: np.asarray(p.value) for p in pc.parameters()}


def test_killed_midway_keeps_previous_file(tmp_path):
    path = tmp_path / "model.npz"
    _collection(1.0).save(path)
    before = path.read_bytes()
    proc = _start_child(path, "stall")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == before  # the target was never touched
    values = _load_values(path)
    assert all((v == 1.0).all() for v in values.values())
    # the abandoned temporary file is the only trace, and it is hidden next to the target
    leftovers = [f for f in os.listdir(tmp_path) if f != "model.npz"]
    assert all(f.startswith(".dynax-") for f in leftovers), leftovers


def test_killed_at_random_points_always_leaves_a_whole_file(tmp_path):
    path = tmp_path / "model.npz"
    _collection(1.0).save(path)
    rng = np.random.default_rng(0)
    for _ in range(4):
        proc = _start_child(path, "loop")
        time.sleep(float(rng.uniform(0.05, 0.4)))  # somewhere inside a save, or between two
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        values = _load_values(path)  # never truncated or corrupt
        fills = {float(v.flat[0]) for v in values.values()}
        assert len(fills) == 1 and fills <= {1.0, 2.0}, fills  # one whole version, not a mix
        assert all((v == v.flat[0]).all() for v in values.values())
