"""``benchmarks.device_streams``: its kernels compute what they claim, and it runs with two
CPU devices (timings are the script's output, not asserted here)."""
import json
import os
import subprocess
import sys

import jax
import numpy as np

from benchmarks import device_streams as ds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_chains_in_one_kernel_equal_each_chain_alone():
    a = ds.chain_data(jax.random.PRNGKey(0), 4, 3)
    b = ds.chain_data(jax.random.PRNGKey(1), 4, 3)
    one, both = ds.recurrence(4, 3), ds.recurrence(4, 3, chains=2)
    ha, hb = both(*a, *b)
    np.testing.assert_allclose(ha, one(*a), rtol=1e-6)
    np.testing.assert_allclose(hb, one(*b), rtol=1e-6)
    assert not np.allclose(ha, hb)  # two different chains


def test_half_lanes_equal_the_whole_chain():
    xs, Wx, Wh = ds.chain_data(jax.random.PRNGKey(2), 6, 4)
    whole = ds.recurrence(6, 4)(xs, Wx, Wh)
    half = ds.recurrence(3, 4)
    np.testing.assert_allclose(np.concatenate([half(xs[:, :3], Wx, Wh), half(xs[:, 3:], Wx, Wh)]),
                               whole, rtol=1e-6)


def test_measure_with_two_cpu_devices_times_every_case():
    code = ("import json; from benchmarks import device_streams as ds; "
            "print(json.dumps(ds.measure(lanes=4, steps=3, repeats=2, rounds=2)))")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    times = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(times) == {"one chain", "two chains, one device", "two chains, one kernel",
                          "two chains, two devices", "half lanes on each device"}
    assert all(t > 0 for t in times.values())
