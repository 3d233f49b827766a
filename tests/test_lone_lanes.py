"""A lone node runs as one lane (``engine._lanes``), where it used to run as two: XLA:CPU
does a 1-row product as a matrix-vector product, at half the time of the 2-row one. Its
kernel must not copy the arena it writes: a 1-row gather becomes a slice aliasing the
arena, and XLA then copies the arena before the in-place write, which
``kernels._read_inputs`` avoids by reading a lone row twice. Values and gradients are
checked against ``jax.grad`` in ``test_runs.py`` (one sentence: lone steps)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

import dynax as dx
from dynax.executor import engine
from reference import record_kernel_texts

IN, HID = 3, 4  # x and the state (c, h) in different arenas; c and h in the one written


@pytest.fixture
def compiled_texts(monkeypatch):
    """Kernels made from here on, by name: their compiled HLO text on the first call's
    arguments."""
    return record_kernel_texts(monkeypatch)


def _arena_copies(text: str, shapes: set) -> list:
    """The HLO lines copying a buffer of one of the arenas' shapes
    (``%copy.1 = f32[1024,256]{1,0} copy(%warenas_0_.1)``)."""
    copies = (re.search(r"= f32\[([\d,]+)\]\{[^}]*\} copy\(", line) for line in text.splitlines())
    return [m.group(0) for m in copies if m and m.group(1) in shapes]


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_a_lone_lstm_step_runs_on_one_lane_without_copying_its_arena(strategy, compiled_texts):
    pc = dx.ParameterCollection(seed=1)
    lstm = dx.nn.LSTMBuilder(1, IN, HID, pc)
    rng = np.random.default_rng(0)
    dx.renew_cg(autobatch=strategy)
    hs = lstm.initial_state().transduce(
        [dx.input(rng.standard_normal(IN).astype(np.float32)) for _ in range(6)])
    loss = dx.sum_elems(dx.esum(hs))
    loss.value()
    loss.backward()
    texts, first_calls = compiled_texts()
    cells = {n: t for n, t in texts.items() if "lstm_cell_fwd" in n}
    assert cells and all(re.search(r"_B1(_T\d+)?$", n) for n in cells), sorted(texts)
    for name, text in cells.items():
        written = first_calls[name][1][0]  # the arenas the kernel writes in place
        shapes = {",".join(map(str, a.shape)) for a in written}
        assert _arena_copies(text, shapes) == [], name


@pytest.mark.parametrize("lane_work", [8, 1 << 20])  # the coarse ladder, the fine one
def test_a_lone_node_takes_one_lane_and_every_batch_room_for_its_nodes(lane_work):
    sig = SimpleNamespace(lane_work=lane_work)  # all that the ladder reads of a signature
    assert engine._lanes(1, sig) == 1
    assert all(engine._lanes(n, sig) >= n for n in range(2, 300))
