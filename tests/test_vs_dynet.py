"""``benchmarks.vs_dynet``: dynax against DyNet itself in one run.

DyNet is not a dependency (it has no wheel for Python 3.11 and builds from source), so the
comparison with a real DyNet runs only where ``DYNAX_DYNET_PYTHON`` names a Python that can
``import dynet``: there the DyNet models must train to the same losses as dynax's from the
same parameters on the same batches. Everywhere, the parts that need no DyNet are tested:
the parameter translation, the batch encoding and the errors a wrong interpreter gives.
"""
import os
import shutil
import sys
import types

import numpy as np
import optax
import pytest

import dynax as dx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness, vs_dynet  # noqa: E402
from tiny_tasks import TINY  # noqa: E402

NAMES = sorted(vs_dynet.TASKS)  # the tasks with a DyNet model


def tiny_task(name):
    """A task namespace at tiny sizes, as DyNetSystem and ``compare`` read it, and three
    batches of three."""
    mod, data_kw, model_kw = TINY[name]
    task = types.SimpleNamespace(
        NAME=name, LR=mod.LR, UNIT=mod.UNIT, BATCH=3,
        DynaxModel=lambda seed=0: mod.DynaxModel(seed=seed, **model_kw),
        make_batches=lambda n, seed, bs: mod.make_batches(n, seed=seed, batch_size=bs,
                                                          **data_kw))
    return task, task.make_batches(3, 0, 3)


@pytest.mark.parametrize("name", NAMES)
def test_initial_parameters_translate_one_to_one(name):
    task, _ = tiny_task(name)
    values = harness.initial_values(task)
    init = vs_dynet.INITS[name](values)
    # every dynax parameter goes over exactly once, unchanged
    assert sorted(id(v) for v in init.values()) == sorted(id(v) for v in values.values())


def test_batches_encode_as_plain_lists():
    _, (batch, *_) = tiny_task("tagger")
    enc = vs_dynet.encode_batch("tagger", batch)
    assert enc == [[list(s.words), list(s.tags)] for s in batch]
    _, (trees, *_) = tiny_task("treelstm")
    enc = vs_dynet.encode_batch("treelstm", trees)
    for (words, children, label), t in zip(enc, trees):
        assert tuple(words) == t.words and label == t.label
        assert [tuple(c) for c in children] == list(t.children)
        assert len(children) == len(words) - 1


@pytest.mark.parametrize("python, message", [
    (sys.executable, "cannot import DyNet"),  # this venv has no DyNet
    ("/nonexistent/python", "cannot run"),
    (shutil.which("false"), "DyNet worker .* stopped"),  # exits without a reply
])
def test_a_wrong_interpreter_is_reported(python, message):
    task, _ = tiny_task("tagger")
    system = vs_dynet.DyNetSystem(task, python)
    try:
        with pytest.raises(RuntimeError, match=message):
            system.start()
    finally:
        system.close()


def test_unknown_tasks_are_refused(capsys):
    with pytest.raises(SystemExit):
        vs_dynet.main(["--dynet-python", sys.executable, "--task", "parser"])
    assert "no DyNet model of task 'parser'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no DyNet model"):
        vs_dynet.DyNetSystem(types.SimpleNamespace(NAME="rnnlm"), sys.executable)


FAKE_WORKER = """#!{python}
# speaks dynet_worker's protocol with made-up figures: 10 ms per update, loss 1.0 per item
import json, sys
sys.stdin.readline()
print("@@ " + json.dumps({{"ready": True}}), flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    if msg["op"] == "update":
        print("@@ " + json.dumps({{"total": 0.01, "cpu": 0.01, "host_cpu": 0.008, "build": 0.002,
                                  "forward": 0.003, "backward": 0.004, "update": 0.001,
                                  "loss": 3.0}}), flush=True)
    elif msg["op"] == "quit":
        break
"""


def test_compare_runs_both_systems_and_flags_different_losses(tmp_path, capsys):
    """The protocol and the bookkeeping, end to end, against a stand-in worker (no DyNet):
    rates from the worker's own timings, the table, and the warning that losses differ."""
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_WORKER.format(python=sys.executable))
    fake.chmod(0o755)
    task, _ = tiny_task("tagger")
    results = vs_dynet.compare(task, str(fake), quick=True)
    out = capsys.readouterr().out
    assert results["dynet"]["items_per_s"] == pytest.approx(task.BATCH / 0.01)
    assert results["dynet"]["loss_first"] == pytest.approx(1.0)  # 3.0 over 3 items
    assert results["agenda"]["x_dynet"] == pytest.approx(
        results["agenda"]["items_per_s"] / results["dynet"]["items_per_s"])
    assert results["dynet"]["host_cpu_ms_per_update"] == pytest.approx(8.0)
    agenda = results["agenda"]  # dynax's own clocks: its Python thread is part of the process
    assert 0 < agenda["host_cpu_ms_per_update"] <= agenda["cpu_ms_per_update"] + 1e-6
    assert "DyNet (autobatch 1)" in out and "agenda / DyNet" in out
    assert "on the Python thread" in out
    assert "WARNING: the two models compute different losses" in out


DYNET_PYTHON = os.environ.get("DYNAX_DYNET_PYTHON")


@pytest.mark.skipif(not DYNET_PYTHON, reason="DYNAX_DYNET_PYTHON names no Python with DyNet")
@pytest.mark.parametrize("name", NAMES)
def test_dynet_trains_to_the_same_losses(name):
    task, batches = tiny_task(name)
    system = vs_dynet.DyNetSystem(task, DYNET_PYTHON)
    try:
        system.start()
        dynet_losses = [system.update(b)["loss"] for b in batches]
    finally:
        system.close()
    model = task.DynaxModel(seed=0)
    trainer = dx.Trainer(model.pc, optax.adam(task.LR), sparse_updates=True)
    losses = []
    for b in batches:
        dx.renew_cg(autobatch="agenda")
        loss = model.loss(b)
        losses.append(float(loss.value()))
        loss.backward()
        trainer.update()
    np.testing.assert_allclose(dynet_losses, losses, rtol=1e-4)
    assert losses[-1] != losses[0]  # the updates changed the parameters
