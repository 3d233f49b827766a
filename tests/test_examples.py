"""The four examples (tagger, rnnlm, parser, td_treelstm): their data generators, a quick
end-to-end run of each (it must learn something), and none-vs-agenda forward values.

Each quick run trains on one fixed minibatch for a fixed number of updates, so it is
deterministic and its kernel shapes are few (compilation dominates such tiny runs).
"""
from __future__ import annotations

import gc
import importlib.util
import math
import pathlib
import sys

import numpy as np
import pytest

import dynax as dx
from dynax.heap import TRAINING_THRESHOLD

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    if str(EXAMPLES) not in sys.path:  # as when run as a script: examples/_training.py
        sys.path.insert(0, str(EXAMPLES))
    # a private module name: "parser" is also a (removed) standard-library module
    spec = importlib.util.spec_from_file_location(f"dynax_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tagger():
    return _load("tagger")


@pytest.fixture(scope="module")
def rnnlm():
    return _load("rnnlm")


@pytest.fixture(scope="module")
def parser():
    return _load("parser")


@pytest.fixture(scope="module")
def td():
    return _load("td_treelstm")


def _decreasing(curve):
    return curve[-1][1] < curve[0][1]


def _same(a, b):
    assert a.shape == b.shape and a.size > 0
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# ---- tagger -------------------------------------------------------------------------------------

def test_tagger_data(tagger):
    train, test = tagger.make_splits(50, 20, seed=3)
    again, _ = tagger.make_splits(50, 20, seed=3)
    assert train == again
    for words, tags in train + test:
        assert len(words) == len(tags) and tagger.TAGS[tags[-1]] == "PUNCT"
        for w, t in zip(words, tags):
            assert tagger.VOCAB[w] in tagger.LEXICON[tagger.TAGS[t]]
    base = tagger.baselines(*tagger.make_splits(500, 200, seed=0))
    assert base["majority"] < base["per_word"] < 0.95  # the ambiguous words cost accuracy
    assert base["per_word_ambiguous"] < 0.75


def test_tagger_quick_run(tagger, capsys):
    r = tagger.main(["--quick", "--seed", "1"])
    out = capsys.readouterr().out
    assert r["updates"] == tagger.QUICK["updates"]
    assert _decreasing(r["curve"])
    assert r["after"]["loss"] < r["before"]["loss"]
    for key in ("accuracy", "accuracy_ambiguous"):
        assert 0.0 <= r["after"][key] <= 1.0
    assert r["after"]["accuracy"] > r["before"]["accuracy"]
    assert "held-out tag accuracy" in out and "most frequent tag" in out


def test_tagger_none_equals_agenda(tagger):
    q = tagger.QUICK
    pc = dx.ParameterCollection(seed=5)
    model = tagger.BiLSTMTagger(pc, len(tagger.VOCAB), q["dim"], q["hidden"], len(tagger.TAGS))
    batch, _ = tagger.make_splits(4, 0, seed=5)
    _same(tagger.forward_values(model, batch, "none"),
          tagger.forward_values(model, batch, "agenda"))


# ---- rnnlm --------------------------------------------------------------------------------------

def test_rnnlm_grammar(rnnlm):
    g = rnnlm.Grammar(np.random.default_rng(0))
    assert all(rnnlm.grammatical(g.sentence()) for _ in range(300))
    for good in ("the dogs that the cat sees sleep .", "a dog that chases the cats runs .",
                 "every child likes some old birds ."):
        assert rnnlm.grammatical(good.split()), good
    for bad in ("the dogs that the cat see sleep .",  # agreement inside the relative clause
                "the dog that chases the cats run .",  # ... and across it
                "the dog sleeps", "dog sleeps .", "the dog sees ."):
        assert not rnnlm.grammatical(bad.split()), bad
    train, test = rnnlm.make_splits(400, 100, seed=0)
    uni, bi = rnnlm.NGramBaseline(train).perplexities(test)
    assert 1.0 < bi < uni < len(rnnlm.VOCAB)


def test_rnnlm_quick_run(rnnlm, capsys):
    r = rnnlm.main(["--quick", "--seed", "1"])
    out = capsys.readouterr().out
    assert r["updates"] == rnnlm.QUICK["updates"]
    assert _decreasing(r["curve"])  # (4 training sentences: held-out perplexity may rise)
    assert 1.0 < r["after"]["perplexity"] < 10 * len(rnnlm.VOCAB)
    assert math.isclose(r["after"]["perplexity"], math.exp(r["after"]["loss"]), rel_tol=1e-6)
    assert 0.0 <= r["grammatical"] <= 1.0 and 0.0 <= r["bigram_grammatical"] <= 1.0
    assert len(r["samples"]) == rnnlm.QUICK["samples"]
    assert all(set(s.split()) <= set(rnnlm.VOCAB) for s in r["samples"])
    assert "held-out perplexity" in out and "unigram" in out


def test_rnnlm_none_equals_agenda(rnnlm):
    q = rnnlm.QUICK
    pc = dx.ParameterCollection(seed=5)
    model = rnnlm.LSTMLanguageModel(pc, len(rnnlm.VOCAB), q["dim"], q["hidden"])
    batch, _ = rnnlm.make_splits(4, 0, seed=5)
    _same(rnnlm.forward_values(model, batch, "none"), rnnlm.forward_values(model, batch, "agenda"))
    # sampling reads values while the graph grows: the same draws give the same sentences
    a = model.sample(3, np.random.default_rng(0), max_len=6, autobatch="none")
    b = model.sample(3, np.random.default_rng(0), max_len=6, autobatch="agenda")
    assert a == b


# ---- parser -------------------------------------------------------------------------------------

def test_parser_data_and_oracle(parser):
    train, _ = parser.make_splits(300, 0, seed=2)
    for words, heads in train:
        assert parser.is_projective(heads)
        assert sum(h == 0 for h in heads) == 1
        c = parser.Configuration(len(words))
        gold = [-1] + heads
        while not c.done():
            action = c.oracle(gold)
            assert action in c.legal()
            c.apply(action)
        assert c.heads[1:] == heads  # the static oracle rebuilds the gold tree
    assert not parser.is_projective([3, 4, 0, 3])  # arcs 3->1 and 4->2 cross
    base = parser.baseline_uas(train)
    assert 0.0 < base["previous"] < 0.5 and 0.0 < base["next"] < 0.5


def test_parser_quick_run(parser, capsys):
    r = parser.main(["--quick", "--seed", "1"])
    out = capsys.readouterr().out
    assert r["updates"] == parser.QUICK["updates"]
    assert _decreasing(r["curve"])
    assert r["curve"][-1][2] > r["curve"][0][2]  # agrees with the oracle more often
    assert 0.0 <= r["before"]["uas"] <= 1.0 and 0.0 <= r["after"]["uas"] <= 1.0
    assert 0.0 <= r["after"]["pp_attachment"] <= 1.0 and 0.0 < r["baselines"]["pp_previous"] < 1.0
    assert "held-out UAS" in out


def test_parser_none_equals_agenda(parser):
    q = parser.QUICK
    pc = dx.ParameterCollection(seed=5)
    model = parser.BiLSTMParser(pc, len(parser.VOCAB), q["dim"], q["hidden"], q["mlp"])
    batch, _ = parser.make_splits(4, 0, seed=5)
    _same(parser.forward_values(model, batch, "none"),
          parser.forward_values(model, batch, "agenda"))


# ---- top-down tree generator ------------------------------------------------------------------

def test_td_grammar(td):
    train, _ = td.make_splits(300, 0, seed=0, max_depth=5)
    for tree in train:
        assert td.well_formed(("ROOT", [tree]))
        assert td.log_prob(tree, 5) <= 0.0
    d, n, v = ("D", []), ("N", []), ("V", [])
    good = ("S", [("NP", [d, n]), ("VP", [v])])
    assert td.well_formed(("ROOT", [good]))
    assert math.isclose(td.log_prob(good, 5), math.log(0.45 * 0.20))
    assert not td.well_formed(("ROOT", [good, good]))  # one S under the root
    assert not td.well_formed(("ROOT", [("S", [("NP", [n, d]), ("VP", [v])])]))  # no NP -> N D
    assert not td.well_formed(("ROOT", [("S", [("NP", [d, ("N", [d])]), ("VP", [v])])]))  # leaf
    assert td.bracket(("ROOT", [good])) == "(S (NP D N) (VP V))"


def test_td_quick_run(td, capsys):
    r = td.main(["--quick", "--seed", "1"])
    out = capsys.readouterr().out
    assert r["updates"] == td.QUICK["updates"]
    assert _decreasing(r["curve"])
    assert r["entropy"] < r["after"] < r["before"]
    assert 0.0 <= r["well_formed"] <= 1.0 and 0.0 <= r["capped"] <= 1.0
    assert "well-formed" in out


def test_td_none_equals_agenda_and_generation_terminates(td):
    q = td.QUICK
    pc = dx.ParameterCollection(seed=5)
    model = td.TopDownTreeLSTM(pc, q["dim"], q["hidden"])
    batch, _ = td.make_splits(3, 0, seed=5, max_depth=3)
    _same(td.forward_values(model, batch, "none"), td.forward_values(model, batch, "agenda"))
    # an untrained model wants to branch forever: the caps stop it, the same way under both
    kw = dict(max_depth=3, max_children=3, max_nodes=12)
    a, capped_a = model.generate(3, np.random.default_rng(0), autobatch="none", **kw)
    b, capped_b = model.generate(3, np.random.default_rng(0), autobatch="agenda", **kw)
    assert a == b and capped_a == capped_b
    assert all(td.size(t) <= 12 and td.depth_of(t) <= 3 + 1 for t in a)  # + the virtual root


def test_cpu_threads_flag_refused_once_jax_runs(tagger, capsys):
    # in this process JAX's backends exist, so the flag cannot apply: an argparse error
    # naming the cause, rather than a run at another thread count than asked for
    import jax
    jax.devices()
    with pytest.raises(SystemExit):
        tagger.main(["--quick", "--cpu-threads", "1"])
    assert "before the first JAX computation" in capsys.readouterr().err


def test_compilation_cache_flag_rejects_a_bad_path(tagger, capsys):
    # an empty path is refused before anything runs (an argparse error naming the setter);
    # the cache itself is tested in test_compilation_cache.py, in subprocesses
    with pytest.raises(SystemExit):
        tagger.main(["--quick", "--compilation-cache", ""])
    assert "set_compilation_cache" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--batch", "0"], "--batch: must be at least 1, got 0"),
    (["--updates", "-3"], "--updates: must be at least 0, got -3"),
    (["--dim", "x"], "--dim: expected an integer, got 'x'"),
    (["--quick", "--train-size", "3"], "--train-size (3) must be at least --batch (4)")])
def test_bad_sizes_are_argparse_errors(tagger, capsys, argv, message):
    """Sizes are checked where they are given: a size of 0 crashed deep in the run, and a
    training set smaller than one minibatch made the endless minibatches loop forever."""
    with pytest.raises(SystemExit):
        tagger.parse_args(argv)
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="minibatches of 4 from 3 examples"):
        tagger.minibatches([1, 2, 3], 4, np.random.default_rng(0))


def test_the_training_loop_runs_with_the_settled_heap_for_its_block_only():
    """``_training.train_loop`` (every example's training loop but the demo's own) runs its
    steps inside ``dx.settled_heap`` (the README's tip): the heap frozen and the collector's
    first threshold raised; both as before once it returns."""
    import argparse
    import gc
    _load("tagger")  # puts examples/ on the path
    from _training import train_loop
    before = gc.get_threshold()
    seen = []

    def step(batch):
        seen.append((gc.get_freeze_count(), gc.get_threshold()[0]))
        return 2.0, 1, 0, {}

    args = argparse.Namespace(updates=3, min_updates=0)
    _, updates, _, _ = train_loop(args, step, iter(range(10)), t_start=0.0, deadline=0.0,
                                  how="test", unit="item")
    assert updates == 3 and len(seen) == 3
    assert all(frozen > 1000 and first == dx.heap.TRAINING_THRESHOLD for frozen, first in seen)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_warm_up_goes_on_while_a_pass_compiles_or_loads_kernels():
    """The none-vs-agenda comparison times a strategy only after a pass made no new kernel;
    kernels loaded from the persistent compilation cache count (timing their loads made a
    second ``make demo`` report agenda at 229 trees/s against 1,295 for the first)."""
    _load("tagger")  # puts examples/ on the path
    from _training import TIMED_PASSES, compare_speed, new_kernels
    passes = {"none": [{"compiles": 0, "cache_loads": 2}, {"compiles": 1, "cache_loads": 0},
                       {"compiles": 0, "cache_loads": 0}],
              "agenda": [{"compiles": 0, "cache_loads": 0}]}
    calls, thresholds = [], []

    def step(batch, strategy):
        calls.append(strategy)
        thresholds.append(gc.get_threshold()[0])
        made = passes[strategy]
        k = sum(1 for c in calls if c == strategy) - 1
        return 1, new_kernels(made[k]) if k < len(made) else 0

    speed, updates = compare_speed(step, ["one batch"])
    # three warm-up passes (none) and one (agenda), then the timed ones
    assert calls == ["none"] * (3 + TIMED_PASSES) + ["agenda"] * (1 + TIMED_PASSES)
    assert updates == 4 + 2 * TIMED_PASSES and speed["none"] > 0 and speed["agenda"] > 0
    # every pass under dx.settled_heap, as the training loop (a full collection in a short
    # timing halved the rate it read)
    assert set(thresholds) == {TRAINING_THRESHOLD} != {gc.get_threshold()[0]}
