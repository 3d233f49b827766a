"""The benchmark tasks compare like with like: each hand-batched JAX baseline computes the same
loss as its per-instance dynax model (under ``agenda`` and ``none``) from the same parameters on
the same batch, and the same update (dense Adam). Tiny sizes; nothing here is timed."""
import os
import sys

import numpy as np
import pytest

import dynax as dx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness, replot  # noqa: E402
from tiny_tasks import TINY  # noqa: E402


def _setup(name, n_batches=1, batch_size=2):
    mod, data_kw, model_kw = TINY[name]
    batches = mod.make_batches(n_batches, seed=0, batch_size=batch_size, **data_kw)
    model = mod.DynaxModel(seed=0, **model_kw)
    init = {p.name: np.asarray(p.value) for p in model.pc.parameters()}
    return mod, batches, model, init


@pytest.mark.parametrize("name", sorted(TINY))
def test_hand_baseline_matches_dynax(name):
    mod, (batch,), model, init = _setup(name)
    hand = mod.HandModel(init)
    hand_first, _ = hand.update(batch)
    hand_second, _ = hand.update(batch)
    assert len(hand.signatures) == 1
    for strategy in ("none", "agenda"):
        dx.renew_cg(autobatch=strategy)
        loss = model.loss(batch)
        np.testing.assert_allclose(loss.value(), hand_first, rtol=2e-5, err_msg=strategy)
    # the gradients agree too: Adam's first step (in NumPy: bias-corrected moments are g and
    # g**2, so the step is -lr * g / (|g| + eps)) from dynax's gradients gives the second loss
    # of the baseline, whose jitted step applied optax.adam to its own gradients
    loss.backward()
    for p in model.pc.parameters():
        g = np.asarray(p.grad)
        p.set_value(np.asarray(p.value) - mod.LR * g / (np.abs(g) + 1e-8))
    dx.renew_cg(autobatch="agenda")
    np.testing.assert_allclose(model.loss(batch).value(), hand_second, rtol=1e-4)
    assert hand_second < hand_first


def test_char_tagger_batches_have_rare_words():
    _, batches, _, _ = _setup("char_tagger")
    chars = [c for s in batches[0] for c in s.chars]
    assert any(c is None for c in chars) and any(c is not None for c in chars)


def test_harness_tables(tmp_path, capsys):
    """The harness's bookkeeping on made-up timings (no JAX work): summary, ratios, table, CSV."""
    def rows(total, compiles):
        return [{"total": total, "cpu": total, "host_cpu": total / 2, "build": total / 4,
                 "schedule": 0.0, "forward": total / 2, "backward": total / 4, "wait": 0.0,
                 "update": 0.0, "loss": 10.0 - i, "nodes": 5, "batches": 2, "launches": 2,
                 "compiles": compiles}
                for i in range(4)]
    res = {"none": harness.summarise("dynax/none", rows(1.0, 0), 1, 8),
           "agenda": harness.summarise("dynax/agenda", rows(0.1, 1), 1, 8),
           "hand": harness.summarise("hand-batched JAX", rows(0.2, 0), 1, 8)}
    harness.add_ratios(res)
    assert res["agenda"]["items_per_s"] == pytest.approx(80.0)
    assert res["agenda"]["x_none"] == pytest.approx(10.0)
    assert res["agenda"]["x_hand"] == pytest.approx(2.0)
    assert res["agenda"]["loss_first"] == pytest.approx(10.0 / 8)
    assert res["agenda"]["compiles_per_step"] == 1 and res["agenda"]["timed_compiles"] == 3
    assert res["agenda"]["host_cpu_ms_per_update"] == pytest.approx(50.0)
    harness.print_result(res["agenda"], "sentences")
    assert "(process CPU 100.0 ms, 50.0 of it on the Python thread)" in capsys.readouterr().out
    harness.print_table(res, "sentences")
    assert "dynax/agenda" in capsys.readouterr().out
    harness.write_csv(list(res.values()), str(tmp_path / "t.csv"))
    assert (tmp_path / "t.csv").read_text().count("\n") == 4
    # the CSV reads back as the plot's input (benchmarks.replot), numbers to 4 digits
    by_batch, _, _ = replot.read_results(str(tmp_path / "t.csv"))
    assert list(by_batch) == [8] and set(by_batch[8]) == {"none", "agenda", "hand"}
    for s, r in res.items():
        assert by_batch[8][s]["items_per_s"] == pytest.approx(r["items_per_s"], rel=1e-3)
        assert by_batch[8][s]["x_none"] == pytest.approx(r["x_none"], rel=1e-3)
    (tmp_path / "other.csv").write_text("optimizer,rate\nadam,1.0\n")
    assert replot.read_results(str(tmp_path / "other.csv")) is None


def test_summary_marks_targets_and_says_how_fast_the_machine_ran(capsys):
    """The summary marks each target met or missed, and reads the machine's speed off the
    hand-batched Tree-LSTM's rate against the reference (1,090 trees/s)."""
    from benchmarks import run

    def result(rate):
        return {"items_per_s": rate, "unit": "trees"}

    agenda = {**result(1200.0), "x_none": 20.0, "x_hand": 2.2}
    run.print_summary({"treelstm": {64: {"agenda": agenda, "hand": result(545.0)}}},
                      {"treelstm": 64})
    out = capsys.readouterr().out
    assert "[  met  ] treelstm          agenda >= 1100 trees/s" in out
    assert "[missed ] treelstm          agenda >= 2200 trees/s" in out
    assert "[not run] tagger" in out
    assert "ran 545 trees/s, 0.50x the ~1,090 trees/s" in out
    assert "benchmarks.vs_dynet" in out  # where DyNet itself is measured
    assert "smoke test" not in out
    run.print_summary({"tagger": {64: {"agenda": agenda}}}, {"tagger": 64})
    assert "Machine speed" not in capsys.readouterr().out
    run.print_summary({"tagger": {64: {"agenda": agenda}}}, {"tagger": 64}, quick=True)
    assert "Speed targets (a quick run: a few updates each, a smoke test" in \
        capsys.readouterr().out  # a quick run's met/missed is no measurement


class _FakeSystem:
    """Records what the harness asks of it; compiles on its first ``compiling`` updates."""

    def __init__(self, name, log, compiling):
        self.name, self.log, self.compiling = name, log, compiling

    def start(self):
        self.log.append((self.name, "start"))

    def untimed_batches(self, timed):
        return timed[:1]

    def update(self, batch):
        self.log.append((self.name, "update", batch))
        c = 1 if self.compiling > 0 else 0
        self.compiling -= 1
        return {"total": 0.5, "cpu": 0.5, "host_cpu": 0.5, "build": 0.0, "schedule": 0.0,
                "forward": 0.0, "backward": 0.0, "wait": 0.0, "update": 0.0, "loss": 1.0,
                "nodes": 1, "batches": 1, "launches": 1, "compiles": c}

    def settle(self):
        self.log.append((self.name, "settle"))

    def extra(self):
        return {}


def test_run_systems_interleaves_timed_blocks_in_alternating_order():
    """Warm-ups first (fresh starts), untimed passes until one compiles nothing, then each
    system's timed updates in blocks, the order of systems reversed every round, each block
    after an untimed lead-in update (the batch before the block's first) and followed by a
    wait for the device."""
    log = []
    systems = {"a": _FakeSystem("a", log, compiling=3), "b": _FakeSystem("b", log, compiling=2)}
    batches = {"a": (["aw"], [f"a{i}" for i in range(4)]), "b": (["bw"], ["b0", "b1", "b2"])}
    res = harness.run_systems(systems, batches, 2, rounds=2, log=lambda *a, **k: None)
    assert log[:3] == [("a", "start"), ("a", "update", "aw"), ("a", "settle")]
    updates = [e[2] for e in log if e[1] == "update"]
    # warm-up compiled 1 each; untimed pass 1: a 1 (and b 1), pass 2: a 1, pass 3: none
    assert updates[2:8] == ["a0", "b0"] * 3
    last_pass = [i for i, e in enumerate(log) if e[1] == "update"][7] + 1  # pass 3's b0
    assert log[last_pass] == ("b", "settle")

    def block(name, lead, timed):
        return [(name, "update", lead)] + [(name, "update", t) for t in timed] + \
            [(name, "settle")]
    assert log[last_pass + 1:] == (block("a", "a3", ["a0", "a1"]) + block("b", "b2", ["b0"])
                                   + block("b", "b0", ["b1", "b2"])
                                   + block("a", "a1", ["a2", "a3"]))  # round 0: a, b; 1: b, a
    assert res["a"]["precompile_passes"] == 3 and res["a"]["precompile_pass_compiles"] == 2
    assert res["b"]["precompile_pass_compiles"] == 1
    assert res["a"]["timed_updates"] == 4 and res["b"]["timed_updates"] == 3
    assert res["a"]["items_per_s"] == pytest.approx(4.0)


def test_every_system_times_the_same_batches_and_warms_up_on_others():
    task = type("Task", (), {"make_batches": staticmethod(lambda n, seed, bs: list(range(n)))})
    runs = harness.split_batches(task, {"none": (2, 3), "agenda": (5, 20)}, 64)
    assert runs["none"] == ([20, 21], [0, 1, 2])
    assert runs["agenda"] == ([20, 21, 22, 23, 24], list(range(20)))


def test_host_cpu_reports_each_figure_of_a_training_loop():
    """``benchmarks.host_cpu`` (the A/B measure for host-side changes) runs the harness's
    loop on a task and reports every figure, in ms (nothing here is compared with a time)."""
    from benchmarks import host_cpu
    mod, data_kw, model_kw = TINY["treelstm"]
    r = host_cpu.measure(mod, 2, 1, model_kw, dict(batch_size=2, **data_kw))
    assert set(r) == {"build", "run", "wall", "python"}
    assert all(np.isfinite(v) and v > 0 for v in r.values()), r
