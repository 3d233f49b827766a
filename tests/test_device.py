"""``dx.set_device`` / ``dx.get_device``: parameters made afterwards and the graph arenas
live on the selected device, training there gives what it gives on another device, and a
change ends the graphs whose values are on the old one.

Two devices on a CPU-only machine take XLA's ``--xla_force_host_platform_device_count``,
which must be set before JAX starts: that test runs in a subprocess.
"""
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import dynax as dx


def test_set_device_by_platform_name_or_device_and_get_device():
    before = dx.get_device()
    try:
        assert dx.set_device("cpu") == jax.devices("cpu")[0] == dx.get_device()
        dx.renew_cg()
        x = dx.tanh(dx.input(np.ones(3, np.float32)))
        assert x.value()[0] == pytest.approx(np.tanh(1.0))
        # selecting the device in use again ends nothing
        assert dx.set_device(jax.devices("cpu")[0]) is jax.devices("cpu")[0]
        np.testing.assert_allclose((x * 2.0).npvalue(), 2 * np.tanh(np.ones(3)), rtol=1e-6)
        pc = dx.ParameterCollection(seed=0)
        assert pc.add_parameters((2,)).value.devices() == {jax.devices("cpu")[0]}
    finally:
        dx.set_device(before)


@pytest.mark.parametrize("device, error, message", [
    (3, TypeError, "set_device: expected 'cpu', 'gpu', 'tpu' or a jax.Device, got 3"),
    ("tpu", ValueError, "set_device: no 'tpu' device is available"),
], ids=["not-a-device", "no-such-platform"])
def test_set_device_refuses_what_it_cannot_select_and_changes_nothing(device, error, message):
    if device == "tpu" and any(d.platform == "tpu" for d in jax.devices()):
        pytest.skip("this machine has a TPU")
    before = dx.get_device()
    g = dx.renew_cg()
    x = dx.input(np.ones(2, np.float32))
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        dx.set_device(device)
    assert dx.get_device() == before
    assert dx.current_graph() is g and x.value()[0] == 1.0


CHILD = textwrap.dedent("""
    import threading
    import numpy as np
    import jax, optax
    import dynax as dx

    def train(device):
        dx.set_device(device)
        pc = dx.ParameterCollection(seed=0)
        lstm = dx.nn.LSTMBuilder(1, 3, 4, pc)
        W = pc.add_parameters((2, 4), name="W")
        E = pc.add_lookup_parameters((5, 3), name="E")
        trainer = dx.Trainer(pc, optax.adam(0.1), sparse_updates=True)
        losses = []
        for _ in range(2):
            dx.renew_cg(autobatch="agenda")
            terms = []
            for seq in ([0, 1, 2], [3, 4], [1]):
                s = lstm.initial_state()
                for w in seq:
                    s = s.add_input(E[w])
                terms.append(dx.pickneglogsoftmax(W @ s.output(), len(seq) % 2))
            loss = dx.esum(terms)
            losses.append(loss.value())
            loss.backward()
            trainer.update()
        devices = {d for p in pc.parameters() for d in p.value.devices()}
        return losses, [np.asarray(p.value) for p in pc.parameters()], devices

    d0, d1 = jax.devices("cpu")
    l1, v1, on1 = train(d1)
    l0, v0, on0 = train(d0)
    print("devices", on1 == {d1}, on0 == {d0})
    print("same", l1 == l0, all(np.array_equal(a, b) for a, b in zip(v0, v1)))

    # a change ends this thread's graph ...
    old = dx.tanh(dx.input(np.ones(2, np.float32)))
    old.value()
    dx.set_device(d1)
    try:
        old.value()
    except dx.StaleExpressionError as e:
        print("ended:", "dx.set_device" in str(e))
    # ... and another thread's graph with values is refused when it computes again
    results = {}
    ready, switched = threading.Event(), threading.Event()

    def other():
        dx.renew_cg()
        x = dx.tanh(dx.input(np.ones(2, np.float32)))
        x.value()
        ready.set()
        switched.wait()
        try:
            (x * 2.0).value()
        except dx.StaleExpressionError as e:
            results["refused"] = "dx.set_device has selected" in str(e)
        dx.renew_cg()  # its next graph runs on the new device
        results["next"] = float(dx.tanh(dx.input(np.ones(1, np.float32))).npvalue()[0])

    t = threading.Thread(target=other)
    t.start()
    ready.wait()
    dx.set_device(d0)
    switched.set()
    t.join()
    print("other:", results["refused"], round(results["next"], 4))
""")


def test_training_on_a_second_device_and_switching_devices():
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                      " --xla_force_host_platform_device_count=2").strip(),
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines == ["devices True True", "same True True", "ended: True",
                     f"other: True {round(float(np.tanh(1.0)), 4)}"], out.stdout
