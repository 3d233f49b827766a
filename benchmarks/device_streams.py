"""Whether XLA:CPU runs independent programs side by side: on one device, and on two.

dynax runs a pass as a chain of kernels on one device. ``benchmarks.xla_ops`` showed that
XLA keeps one thread busy at a time over most of a tagger or Tree-LSTM update (session 66),
although the two directions of a BiLSTM, or two sentences, are independent. This script
times the question in isolation, with a recurrence like an LSTM's (``T`` steps of two
``[M, 128] x [128, 512]`` products and the gates, in one ``fori_loop``):

* ``one chain``: ``--repeats`` launches of one recurrence;
* ``two chains, one device``: as many launches of each of two independent recurrences,
  alternated (no data flows between them);
* ``two chains, one kernel``: both recurrences in one loop body;
* ``two chains, two devices``: the second recurrence's data on a second CPU device;
* ``half lanes on each device``: the first recurrence's lanes split between two devices.

The last two need two CPU devices: run it as
``XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.device_streams``.
Measured on this 2-core CPU (session 66, M = 64, T = 40, 10 launches): one chain 71 ms;
two chains on one device 141 ms, in one kernel 143 ms; on two devices 72 ms; the lanes of
one chain split between two devices 43 ms instead of 71. In the BiLSTM tagger itself, its
batch split over two devices (one thread and one copy of the model each) ran only 2-3%
faster: its update already keeps both cores busy, the Python thread's work included.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

HID = 128


def recurrence(lanes: int, steps: int, chains: int = 1):
    """A jitted loop of ``steps`` LSTM-like steps over ``chains`` independent sequences of
    ``lanes`` lanes each; its arguments are ``(xs, Wx, Wh)`` per chain."""
    def step(x, h, Wx, Wh):
        z = x @ Wx.T + h @ Wh.T
        return jnp.tanh(z[:, :HID]) * jax.nn.sigmoid(z[:, HID:2 * HID])

    def run(*args):
        groups = [args[3 * c:3 * c + 3] for c in range(chains)]

        def body(t, hs):
            return tuple(step(xs[t], h, Wx, Wh) for (xs, Wx, Wh), h in zip(groups, hs))
        hs = lax.fori_loop(0, steps, body, tuple(jnp.zeros((lanes, HID)) for _ in groups))
        return hs[0] if chains == 1 else hs
    return jax.jit(run)


def chain_data(key, lanes: int, steps: int) -> tuple:
    """``(xs, Wx, Wh)`` of one chain, on JAX's default device."""
    k = jax.random.split(key, 3)
    return (jax.random.normal(k[0], (steps, lanes, HID)),
            jax.random.normal(k[1], (4 * HID, HID)) * 0.05,
            jax.random.normal(k[2], (4 * HID, HID)) * 0.05)


def median_ms(launch, repeats: int, rounds: int) -> float:
    """Median over ``rounds`` of the time to run ``launch()`` ``repeats`` times and wait for
    all its results, in ms (one untimed round first: compilation)."""
    def once():
        t = time.perf_counter()
        jax.block_until_ready([launch() for _ in range(repeats)])
        return time.perf_counter() - t
    once()
    return 1000 * statistics.median(once() for _ in range(rounds))


def measure(lanes: int = 64, steps: int = 40, repeats: int = 10, rounds: int = 15) -> dict:
    """``{case: ms}`` for the cases of the module doc (the two-device ones only where JAX
    has two CPU devices)."""
    devices = jax.devices("cpu")
    a = chain_data(jax.random.PRNGKey(0), lanes, steps)
    b = chain_data(jax.random.PRNGKey(1), lanes, steps)
    one, both = recurrence(lanes, steps), recurrence(lanes, steps, chains=2)
    out = {"one chain": median_ms(lambda: one(*a), repeats, rounds),
           "two chains, one device": median_ms(lambda: (one(*a), one(*b)), repeats, rounds),
           "two chains, one kernel": median_ms(lambda: both(*a, *b), repeats, rounds)}
    if len(devices) >= 2 and lanes % 2 == 0:
        b1 = tuple(jax.device_put(x, devices[1]) for x in b)
        out["two chains, two devices"] = median_ms(lambda: (one(*a), one(*b1)), repeats, rounds)
        half = recurrence(lanes // 2, steps)
        xs, Wx, Wh = a
        h0 = tuple(jax.device_put(x, devices[0]) for x in (xs[:, :lanes // 2], Wx, Wh))
        h1 = tuple(jax.device_put(x, devices[1]) for x in (xs[:, lanes // 2:], Wx, Wh))
        out["half lanes on each device"] = median_ms(lambda: (half(*h0), half(*h1)),
                                                     repeats, rounds)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=10, help="launches per timed round")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    n = len(jax.devices("cpu"))
    print(f"{n} CPU device(s); {args.lanes} lanes, {args.steps} steps, {args.repeats} launches "
          f"per round, median of {args.rounds} rounds")
    for case, ms in measure(args.lanes, args.steps, args.repeats, args.rounds).items():
        print(f"  {case:28s} {ms:8.2f} ms")
    if n < 2:
        print("  (two devices: XLA_FLAGS=--xla_force_host_platform_device_count=2)")


if __name__ == "__main__":
    main()
