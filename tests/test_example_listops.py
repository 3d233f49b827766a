"""The ListOps demo (examples/tree_listops.py): its data generator and a quick end-to-end run."""
from __future__ import annotations

import importlib.util
import math
import pathlib
import sys
import time

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "tree_listops.py"


@pytest.fixture(scope="module")
def listops():
    if str(EXAMPLE.parent) not in sys.path:  # as when run as a script: examples/_training.py
        sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("tree_listops", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the generator's evaluator, parser and binariser ------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[SM 5 6 ]", 1),
    ("[MED 1 5 3 ]", 3),
    ("[MED 1 2 ]", 1),  # int(np.median), as in the published generator
    ("[MIN 3 [MAX 8 1 ] 2 ]", 2),
    ("[SM [SM 9 9 ] [MED 7 0 4 4 ] 1 ]", 3),
])
def test_evaluate(listops, text, value):
    expr = listops.parse(text)
    assert listops.evaluate(expr) == value
    assert listops.to_string(expr) == text


def test_parse_rejects_garbage(listops):
    with pytest.raises(ValueError):
        listops.parse("[FOO 1 2 ]")
    with pytest.raises(ValueError):
        listops.parse("[MIN 1 2 ] 3")


def test_binarize_reads_the_gold_tree_left_nested(listops):
    T = listops.TOKEN_ID
    tree = listops.binarize(listops.parse("[SM 5 [MIN 4 7 ] ]"))
    inner = (((T["[MIN"], T["4"]), T["7"]), T["]"])
    assert tree == (((T["[SM"], T["5"]), inner), T["]"])
    assert listops.tree_size(tree) == (7, 6)  # 7 tokens, 6 compositions


def test_generator_is_deterministic_and_respects_limits(listops):
    def depth(e):
        return 0 if isinstance(e, int) else 1 + max(depth(a) for a in e[1])

    def widths(e):
        return [] if isinstance(e, int) else [len(e[1])] + sum((widths(a) for a in e[1]), [])

    a = [listops.generate(np.random.default_rng(7), max_depth=3, max_args=4) for _ in range(3)]
    b = [listops.generate(np.random.default_rng(7), max_depth=3, max_args=4) for _ in range(3)]
    assert a == b
    rng = np.random.default_rng(0)
    for _ in range(300):
        e = listops.generate(rng, max_depth=3, max_args=4)
        assert 1 <= depth(e) <= 3
        assert all(2 <= w <= 4 for w in widths(e))
        assert 0 <= listops.evaluate(e) <= 9
        assert listops.parse(listops.to_string(e)) == e


def test_splits_are_disjoint_and_deterministic(listops):
    train, test = listops.make_splits(200, 50, seed=3, max_depth=2, max_args=4)
    again, _ = listops.make_splits(200, 50, seed=3, max_depth=2, max_args=4)
    assert [t for _, _, t in train] == [t for _, _, t in again]
    assert not {t for _, _, t in train} & {t for _, _, t in test}
    assert all(label == listops.evaluate(listops.parse(t)) for _, label, t in train + test)


def test_accuracy_by_operator_splits_by_the_root(listops):
    texts = ["[MIN 1 2 ]", "[MIN 3 [MAX 4 5 ] ]", "[SM 5 6 ]", "[MAX 0 [MIN 1 2 ] ]"]
    data = [(None, listops.evaluate(listops.parse(t)), t) for t in texts]
    predicted = np.array([1, 0, 1, 0])  # right, wrong, right, wrong
    assert listops.accuracy_by_operator(data, predicted) == {
        "MIN": (0.5, 2), "MAX": (0.0, 1), "SM": (1.0, 1)}


# ---- the demo itself, in quick mode -----------------------------------------------------------

def test_quick_run(listops, capsys):
    t0 = time.perf_counter()
    result = listops.main(["--quick", "--seed", "1"])
    elapsed = time.perf_counter() - t0
    out = capsys.readouterr().out

    assert 0.0 <= result["accuracy"] <= 1.0
    by_op = result["accuracy_by_operator"]  # the test trees split by their root operator
    assert set(by_op) <= set(listops.OPS)
    assert sum(n for _, n in by_op.values()) == 32  # --quick's test set
    assert math.isclose(sum(acc * n for acc, n in by_op.values()) / 32, result["accuracy"])
    assert 0.0 < result["majority"] <= 1.0
    assert result["updates"] > 0 and result["trees"] > 0
    assert result["curve"] and all(math.isfinite(loss) and loss > 0 for _, loss in result["curve"])
    speed = result["speed"]
    assert speed["none"] > 0 and speed["agenda"] > 0
    assert math.isclose(speed["ratio"], speed["agenda"] / speed["none"])
    for text in ("majority-class baseline", "test accuracy", "by root operator",
                 "autobatch='none'",
                 "autobatch='agenda'", "trees/s"):
        assert text in out
    assert elapsed < 120, f"quick mode took {elapsed:.0f}s"


def test_quick_keeps_the_flags_given_and_sizes_are_checked(listops, capsys):
    """``--quick`` fills in the flags not given (it used to override --batch and the
    rest), and bad sizes are argparse errors, as in the other examples."""
    args = listops.parse_args(["--quick", "--batch", "3"])
    assert args.batch == 3 and args.train_size == 128
    for argv, message in ((["--batch", "-1"], "--batch: must be at least 1"),
                          (["--train-size", "16"], "--train-size (16) must be at least "
                                                   "--batch (32)")):
        with pytest.raises(SystemExit):
            listops.parse_args(argv)
        assert message in capsys.readouterr().err


def test_the_speed_comparison_warms_up_through_kernels_loaded_from_the_cache(listops,
                                                                             monkeypatch):
    """A pass that loads kernels from the persistent compilation cache (a second
    ``make demo``) is warm-up too: timing it reported agenda at 229 trees/s, not 1,295."""
    script = {"none": [(0, 3), (0, 0)], "agenda": [(0, 5), (1, 0), (0, 0)]}
    calls = []

    def fake_step(model, trainer, batch, strategy="agenda"):
        calls.append(strategy)
        k = sum(1 for c in calls if c == strategy) - 1
        compiles, loads = script[strategy][k] if k < len(script[strategy]) else (0, 0)
        return 0.0, {"compiles": compiles, "cache_loads": loads}

    monkeypatch.setattr(listops, "train_step", fake_step)
    speed, steps = listops.compare_speed(None, None, [["a tree"]])
    # warm-up until a pass made no kernel, then the timed passes
    from _training import TIMED_PASSES as T  # listops' module put examples/ on the path
    assert calls == ["none"] * (2 + T) + ["agenda"] * (3 + T)
    assert steps == 5 + 2 * T and speed["none"] > 0 and speed["agenda"] > 0
