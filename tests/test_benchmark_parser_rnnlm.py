"""The parser and RNNLM benchmark tasks: the transition system is right, and the hand-batched
baselines compute the same loss as the dynax models (tiny sizes)."""
import copy

import numpy as np
import pytest

import dynax as dx
from benchmarks.tasks import parser, rnnlm

TINY = dict(vocab=40, min_len=2, max_len=7)


def _projective(heads):
    """Whether every arc's span holds only descendants of its head."""
    n = len(heads) - 1

    def ancestors(x):
        out = set()
        while x != -1:
            out.add(x)
            x = heads[x]
        return out

    anc = [ancestors(x) for x in range(n + 1)]
    return all(h in anc[k] for d in range(1, n + 1) for h in [heads[d]]
               for k in range(min(h, d) + 1, max(h, d)))


def test_random_trees_are_projective_with_one_root_child():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 41))
        heads = parser.random_projective_heads(rng, n)
        assert heads[0] == -1 and len(heads) == n + 1
        assert sum(h == 0 for h in heads[1:]) == 1
        assert _projective(heads), heads


def test_static_oracle_produces_the_gold_tree():
    for batch in parser.make_batches(4, seed=5, batch_size=32):
        for sent in batch:
            p, steps = parser.Parser(sent.heads), 0
            while not p.done():
                a = p.static_oracle()
                assert p.valid()[a]
                p.apply(a)
                steps += 1
            assert p.heads == list(sent.heads)
            assert steps == 2 * len(sent)


def _can_reach_gold(p, memo):
    """Exhaustive search: can some sequence of valid actions from ``p`` end in the gold tree?"""
    key = (tuple(p.stack), p.b, tuple(p.heads))
    if key not in memo:
        if p.done():
            memo[key] = p.heads == p.gold
        else:
            memo[key] = any(_can_reach_gold(_after(p, a), memo)
                            for a, ok in enumerate(p.valid()) if ok)
    return memo[key]


def _after(p, a):
    q = copy.deepcopy(p)
    q.apply(a)
    return q


def test_zero_cost_actions_match_exhaustive_search():
    """On every gold-reachable configuration of small trees, ``zero_cost`` says exactly which
    actions keep the gold tree reachable (the rule the parsers follow in training)."""
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(25):
        heads = parser.random_projective_heads(rng, int(rng.integers(1, 7)))
        memo = {}
        todo = [parser.Parser(heads)]
        seen = set()
        while todo:
            p = todo.pop()
            key = (tuple(p.stack), p.b, tuple(p.heads))
            if key in seen or p.done():
                continue
            seen.add(key)
            assert _can_reach_gold(p, memo)
            want = tuple(ok and _can_reach_gold(_after(p, a), memo)
                         for a, ok in enumerate(p.valid()))
            assert p.zero_cost() == want, (heads, p.stack, p.b, p.heads)
            todo += [_after(p, a) for a in range(3) if want[a]]
            checked += 1
    assert checked > 100


def _first_losses(task, model_kw, data_kw, batch_size):
    batch = task.make_batches(1, seed=2, batch_size=batch_size, **data_kw)[0]
    model = task.DynaxModel(seed=0, **model_kw)
    got = {}
    for strategy in ("agenda", "none"):
        dx.renew_cg(autobatch=strategy)
        got[strategy] = model.loss(batch).value()
    init = {p.name: np.asarray(p.value) for p in model.pc.parameters()}
    hand = task.HandModel(init)
    got["hand"], pack_s = hand.update(batch)
    assert pack_s >= 0.0 and hand.signatures
    return got


def test_parser_hand_baseline_matches_dynax():
    got = _first_losses(parser, dict(vocab=TINY["vocab"], emb=6, hid=8, mlp=7), TINY, 3)
    assert got["agenda"] > 0
    for k in ("none", "hand"):
        assert got[k] == pytest.approx(got["agenda"], rel=1e-5, abs=1e-5), got


@pytest.mark.parametrize("batch_size", [1, 3])
def test_rnnlm_hand_baseline_matches_dynax(batch_size):
    got = _first_losses(rnnlm, dict(vocab=TINY["vocab"], emb=6, hid=8), TINY, batch_size)
    assert got["agenda"] > 0
    for k in ("none", "hand"):
        assert got[k] == pytest.approx(got["agenda"], rel=1e-5, abs=1e-5), got


def test_rnnlm_signature_is_the_compiled_one():
    batch = rnnlm.make_batches(1, seed=4, batch_size=2, **TINY)[0]
    model = rnnlm.DynaxModel(seed=0, vocab=TINY["vocab"], emb=6, hid=8)
    hand = rnnlm.HandModel({p.name: np.asarray(p.value) for p in model.pc.parameters()})
    assert hand.pack(batch)[0] == hand.signature(batch)
    B, L, N = hand.signature(batch)
    assert B == 2 and L % 8 == 0 and N >= sum(len(s) + 1 for s in batch)


def test_parser_hand_signature_is_known_before_the_parse():
    """The hand parser's step shapes come from the batch alone (the decision count's upper
    bound), so the harness can compile them ahead: batches of one signature share one compiled
    step however many decisions their parses record."""
    batches = parser.make_batches(6, seed=3, batch_size=3, **TINY)
    model = parser.DynaxModel(seed=0, vocab=TINY["vocab"], emb=6, hid=8, mlp=7)
    hand = parser.HandModel({p.name: np.asarray(p.value) for p in model.pc.parameters()})
    sigs = set()
    for batch in batches:
        sig = hand.signature(batch)
        _, B, L, T = sig
        assert B == 3 and L % 8 == 0 and T >= sum(2 * len(s) for s in batch)
        hand.update(batch)
        assert sig in hand.signatures
        sigs.add(sig)
    assert hand.step._cache_size() == len(sigs)
