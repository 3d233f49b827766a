"""An arc-standard transition parser over BiLSTM features, many sentences in lockstep.

The data
--------
A seeded generator builds projective dependency trees for English-like sentences: the verb
is the root; its subject, object, adverbs, prepositional phrases and the final "." depend on
it; determiners and adjectives depend on their noun; a preposition's object noun depends on
the preposition. Where a prepositional phrase attaches follows learnable rules: "of",
"about", "from" attach to the noun just before them, "in", "on", "near", "during" to the
verb, and "with" to the preceding noun when that noun is animate ("the man with the dog")
and to the verb otherwise ("saw the hill with the telescope"). Words are emitted in head
order (left dependents, head, right dependents), so every tree is projective.

The model (Kiperwasser & Goldberg, 2016, with the arc-standard system)
------------------------------------------------------------------------
``E[word]`` feeds a ``dx.nn.BiRNNBuilder`` of ``dx.nn.LSTMBuilder`` cells over the sentence
followed by a ROOT token. A configuration (stack, buffer) is scored by an MLP -- one
``@dx.function`` node -- over the BiLSTM vectors of the top three stack items and the first
buffer item (a learned padding vector where one is missing), giving scores for SHIFT,
LEFT-ARC and RIGHT-ARC.

Parsing is incremental and value-driven: all parsers of a minibatch advance in lockstep;
each step builds the scores of every unfinished parser, computes them with ONE
``dx.forward([...])`` (the autobatcher runs the MLPs of all parsers as one kernel; the first
step also runs the BiLSTMs), reads the values and applies one transition per parser.
Training follows the static oracle with a multi-class hinge loss (``dx.hinge``: the oracle
action should beat every other action by 1); the values decide where a loss node is needed
at all -- only at steps where the margin is violated.
At test time each parser follows its own highest-scoring legal action (greedy decoding).

What to expect
--------------
It prints the data with baselines (each word attached to the previous word, or to the next
word), a learning curve (hinge loss per sentence and how often the model's own choice
agrees with the oracle during training), then the unlabeled attachment score (UAS) of greedy
decoding on held-out sentences -- far above both baselines, near 1.0 with the default budget
since the attachment rules are deterministic -- and the accuracy on prepositions alone (PP
attachment, where the "with" rule needs the noun's animacy) against always attaching low;
then speeds (sentences/s of training; lockstep decoding under autobatch "none" and
"agenda").

Run ``python examples/parser.py`` (``--budget`` seconds for the whole run, ``--quick`` for a
smoke-test-sized run, ``--seed`` changes data and initialisation).
"""
from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

import dynax as dx
from _training import (count, minibatches, new_kernels, parse_run_args, positive_int, run_parser,
                       train_loop)

# ============================================================================================
# Data: a head-driven generator of projective dependency trees.
# ============================================================================================

LEX = {
    "DET": "the a some every this".split(),
    "ADJ": "big old red small quiet happy".split(),
    "N_ANIMATE": "dog cat man woman friend child".split(),
    "N_THING": "park telescope hill garden book river city box".split(),
    "VT": "saw liked found took watched carried".split(),
    "VI": "slept ran smiled waited".split(),
    "P_NOUN": "of about from".split(),  # attach to the preceding noun
    "P_VERB": "in on near during".split(),  # attach to the verb
    "ADV": "quickly today often".split(),
    "END": ["."],
}
WITH = "with"  # to the preceding noun if animate, else to the verb
ROOT = "<root>"
VOCAB = [ROOT, WITH] + sorted({w for ws in LEX.values() for w in ws})
WORD_ID = {w: i for i, w in enumerate(VOCAB)}
ANIMATE = frozenset(LEX["N_ANIMATE"])


class TreeGenerator:
    """Seeded sampler of dependency trees ``(word, left deps, right deps)``."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def word(self, cat):
        ws = LEX[cat]
        return ws[self.rng.integers(len(ws))]

    def noun_phrase(self, depth):
        r = self.rng
        noun = self.word("N_ANIMATE" if r.random() < 0.5 else "N_THING")
        left = [(self.word("DET"), [], [])]
        for _ in range(2):
            if r.random() < 0.3:
                left.append((self.word("ADJ"), [], []))
        right = []
        if depth < 2 and r.random() < 0.3:  # a PP on this noun
            p = WITH if noun in ANIMATE and r.random() < 0.4 else self.word("P_NOUN")
            right.append((p, [], [self.noun_phrase(depth + 1)]))
        return noun, left, right

    def sentence(self):
        r = self.rng
        transitive = r.random() < 0.7
        left = [self.noun_phrase(0)]
        if r.random() < 0.2:
            left.append((self.word("ADV"), [], []))
        right = [self.noun_phrase(0)] if transitive else []
        for _ in range(2):
            if r.random() < 0.35:  # a PP on the verb; "with" only after a non-animate noun
                last = linearize(right[-1])[0][-1] if right else None
                p = WITH if last not in ANIMATE and r.random() < 0.3 else self.word("P_VERB")
                right.append((p, [], [self.noun_phrase(1)]))
        if r.random() < 0.15:
            right.append((self.word("ADV"), [], []))
        right.append((".", [], []))
        return self.word("VT" if transitive else "VI"), left, right


def linearize(tree):
    """(words, heads) of a tree: heads are 1-based positions, 0 for the root."""
    words, heads = [], []

    def visit(node, head):
        word, left, right = node
        children = []
        for child in left:
            children.append(visit(child, None))
        words.append(word)
        heads.append(head)
        me = len(words)  # 1-based position of this word
        for child in right:
            children.append(visit(child, None))
        for c in children:
            heads[c - 1] = me
        return me

    visit(tree, 0)
    return words, heads


def is_projective(heads) -> bool:
    """No two arcs cross (heads 1-based, 0 = root)."""
    arcs = [(min(d, h), max(d, h)) for d, h in enumerate(heads, 1)]
    return not any(a < c < b < d for a, b in arcs for c, d in arcs)


def make_splits(n_train: int, n_test: int, seed: int, max_len: int = 30):
    """Train and held-out lists of ``(word ids, heads)``; deterministic in ``seed``."""
    g = TreeGenerator(np.random.default_rng(seed))
    data = []
    while len(data) < n_train + n_test:
        words, heads = linearize(g.sentence())
        if len(words) <= max_len:
            data.append(([WORD_ID[w] for w in words], heads))
    return data[:n_train], data[n_train:]


PREPOSITIONS = frozenset(WORD_ID[w] for w in LEX["P_NOUN"] + LEX["P_VERB"] + [WITH])


def baseline_uas(data) -> dict:
    """UAS of attaching every word to the previous word (the first to the root) and to the
    next word (the last to the root); and how often "previous word" is right for the
    prepositions alone (always attaching a PP low, to the noun before it)."""
    prev = nxt = total = pp_prev = pp_total = 0
    for words, heads in data:
        n = len(words)
        prev += sum(h == i for i, h in enumerate(heads))  # word i+1 -> i
        nxt += sum(h == (i + 2 if i + 1 < n else 0) for i, h in enumerate(heads))
        total += n
        pp = [i for i, w in enumerate(words) if w in PREPOSITIONS]
        pp_prev += sum(heads[i] == i for i in pp)
        pp_total += len(pp)
    return {"previous": prev / total, "next": nxt / total,
            "pp_previous": pp_prev / max(pp_total, 1)}


# ============================================================================================
# The arc-standard system and its static oracle.
# ============================================================================================

SHIFT, LEFT, RIGHT = 0, 1, 2
ACTIONS = ("SHIFT", "LEFT-ARC", "RIGHT-ARC")


class Configuration:
    """Stack, buffer position and the arcs so far; token 0 is ROOT, words are 1..n."""

    def __init__(self, n: int):
        self.n = n
        self.stack = [0]
        self.next = 1  # first buffer item
        self.heads = [-1] * (n + 1)

    def done(self) -> bool:
        return self.next > self.n and self.stack == [0]

    def legal(self) -> list[int]:
        out = []
        if self.next <= self.n:
            out.append(SHIFT)
        if len(self.stack) >= 2:
            if self.stack[-2] != 0:
                out.append(LEFT)
            if self.stack[-2] != 0 or self.next > self.n:  # ROOT takes one dependent, last
                out.append(RIGHT)
        return out

    def apply(self, action: int) -> None:
        if action == SHIFT:
            self.stack.append(self.next)
            self.next += 1
        elif action == LEFT:  # s1 <- s0
            s0 = self.stack.pop()
            self.heads[self.stack.pop()] = s0
            self.stack.append(s0)
        else:  # s1 -> s0
            s0 = self.stack.pop()
            self.heads[s0] = self.stack[-1]

    def oracle(self, gold: list[int]) -> int:
        """The static oracle's action for gold heads ``gold`` (``gold[i]`` for word i, 1..n;
        ``gold[0]`` unused)."""
        legal = self.legal()
        if len(self.stack) >= 2:
            s1, s0 = self.stack[-2], self.stack[-1]
            if LEFT in legal and gold[s1] == s0:
                return LEFT
            if RIGHT in legal and gold[s0] == s1 and all(
                    self.heads[d] == s0 for d in range(1, self.n + 1) if gold[d] == s0):
                return RIGHT
        return SHIFT


# ============================================================================================
# Model
# ============================================================================================

@dx.function
def mlp_scores(s2, s1, s0, b0, W1, b1, W2, b2):
    """Action scores of one configuration from its four feature vectors (one graph node)."""
    h = jnp.tanh(W1 @ jnp.concatenate([s2, s1, s0, b0]) + b1)
    return W2 @ h + b2


class BiLSTMParser:
    def __init__(self, pc: dx.ParameterCollection, vocab: int, dim: int, hidden: int,
                 mlp: int):
        self.E = pc.add_lookup_parameters((vocab, dim), init="normal", name="E")
        self.PAD = pc.add_lookup_parameters((1, hidden), init="normal", name="PAD")
        self.bilstm = dx.nn.BiRNNBuilder(1, dim, hidden, pc, dx.nn.LSTMBuilder)
        self.W1 = pc.add_parameters((mlp, 4 * hidden), name="W1")
        self.b1 = pc.add_parameters((mlp,), init="zeros", name="b1")
        self.W2 = pc.add_parameters((len(ACTIONS), mlp), name="W2")
        self.b2 = pc.add_parameters((len(ACTIONS),), init="zeros", name="b2")

    def encode(self, words):
        """Token vectors: index 0 is ROOT (read last by the BiLSTM), then the words; and the
        learned vector that stands for a missing stack or buffer item."""
        hs = self.bilstm.transduce([self.E[w] for w in words] + [self.E[WORD_ID[ROOT]]])
        return [hs[-1]] + hs[:-1], self.PAD[0]

    def scores(self, vecs, pad, c: Configuration):
        st = c.stack

        def item(k):
            return vecs[st[-k]] if len(st) >= k else pad

        b0 = vecs[c.next] if c.next <= c.n else pad
        return mlp_scores(item(3), item(2), item(1), b0, self.W1, self.b1, self.W2, self.b2)


def run_parsers(model, batch, train: bool):
    """Parse every sentence of ``batch`` in lockstep on the current graph.

    Each step: the scores of all unfinished parsers, one ``dx.forward`` over them, then one
    transition each -- the oracle's when ``train`` (with a hinge-loss node where the oracle
    action does not win by 1), else the best-scoring legal action. Returns (loss
    expressions, predicted heads per sentence, oracle agreement count, decisions).
    """
    encoded = [model.encode(words) for words, _ in batch]
    configs = [Configuration(len(words)) for words, _ in batch]
    golds = [[-1] + heads for _, heads in batch]
    losses, agree, decisions = [], 0, 0
    active = list(range(len(batch)))
    while active:
        scores = [model.scores(*encoded[i], configs[i]) for i in active]
        dx.forward(scores)
        for i, s in zip(active, scores):
            c = configs[i]
            values = s.npvalue()
            legal = c.legal()
            best = max(legal, key=lambda a: values[a])
            if train:
                gold = c.oracle(golds[i])
                agree += best == gold
                # the values say whether the oracle action wins by the margin: a loss node
                # only where it does not (a zero hinge would add nothing to the gradient)
                if any(values[gold] - values[a] < 1.0 for a in range(len(ACTIONS)) if a != gold):
                    losses.append(dx.hinge(s, gold, 1.0))
                c.apply(gold)
            else:
                c.apply(best)
            decisions += 1
        active = [i for i in active if not configs[i].done()]
    return losses, [c.heads[1:] for c in configs], agree, decisions


def train_step(model, trainer, batch, autobatch: str = "agenda"):
    """One minibatch parsed with the oracle in lockstep; backward over the hinge losses and
    update. Returns (summed loss, oracle agreement, decisions, graph stats)."""
    cg = dx.renew_cg(autobatch=autobatch)
    losses, _, agree, decisions = run_parsers(model, batch, train=True)
    value = 0.0
    if losses:
        loss = dx.esum(losses)
        value = loss.scalar_value()
        loss.backward()
        trainer.update()
    return value, agree, decisions, cg.stats()


def parse(model, sentences, autobatch: str = "agenda"):
    """Greedy lockstep decoding of ``sentences`` (word-id lists) on one graph; heads each.

    The model has no dropout, so a default (``train=True``) graph computes what
    ``train=False`` would, and reuses the training step's compiled forward kernels.
    """
    dx.renew_cg(autobatch=autobatch)
    return run_parsers(model, [(w, [0] * len(w)) for w in sentences], train=False)[1]


def forward_values(model, batch, autobatch: str) -> np.ndarray:
    """The action scores of the first three lockstep steps of greedy decoding, flattened
    (for none-vs-agenda checks: the later steps depend on the earlier values)."""
    dx.renew_cg(autobatch=autobatch)
    encoded = [model.encode(words) for words, _ in batch]
    configs = [Configuration(len(words)) for words, _ in batch]
    out = []
    for _ in range(3):
        scores = [model.scores(*e, c) for e, c in zip(encoded, configs)]
        dx.forward(scores)
        for s, c in zip(scores, configs):
            v = s.npvalue()
            out.append(v)
            c.apply(max(c.legal(), key=lambda a: v[a]))
    return np.concatenate(out)


def evaluate(model, data, chunk: int = 32) -> dict:
    """Unlabeled attachment score of greedy decoding, overall and on prepositions alone (PP
    attachment); ``chunk`` sentences per graph."""
    correct = total = pp_correct = pp_total = 0
    for start in range(0, len(data), chunk):
        part = data[start:start + chunk]
        for (words, gold), pred in zip(part, parse(model, [w for w, _ in part])):
            right = [p == g for p, g in zip(pred, gold)]
            correct += sum(right)
            total += len(gold)
            pp_correct += sum(r for r, w in zip(right, words) if w in PREPOSITIONS)
            pp_total += sum(w in PREPOSITIONS for w in words)
    return {"uas": correct / total, "pp_attachment": pp_correct / max(pp_total, 1)}


def compare_speed(model, sentences, max_warmup: int = 3) -> dict:
    """Sentences/s of lockstep greedy decoding under "none" and "agenda", each timed after
    warm-up passes that compile its kernels."""
    result = {}
    for strategy in ("none", "agenda"):
        for _ in range(max_warmup):
            parse(model, sentences, strategy)
            if new_kernels(dx.current_graph().stats()) == 0:
                break
        t0 = time.perf_counter()
        parse(model, sentences, strategy)
        result[strategy] = len(sentences) / (time.perf_counter() - t0)
    result["ratio"] = result["agenda"] / result["none"]
    return result


def parse_args(argv=None):
    ap = run_parser(__doc__, budget_covers="compilation and evaluation",
                    quick_is="4 sentences, 10 updates, tiny model", train_size=4000)
    ap.add_argument("--dim", type=positive_int, default=32, help="word embedding size")
    ap.add_argument("--hidden", type=positive_int, default=64,
                    help="BiLSTM output size (both directions)")
    ap.add_argument("--mlp", type=positive_int, default=64, help="MLP hidden size")
    ap.add_argument("--batch", type=positive_int, default=32, help="sentences per update")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--speed-sentences", type=count, default=32,
                    help="sentences decoded for the none-vs-agenda comparison (0: skip)")
    return parse_run_args(ap, argv, QUICK)


SPEED_RESERVE = 12.0  # seconds kept for the none-vs-agenda comparison (compiles "none" kernels)
EVAL_RESERVE = 4.0  # at most this many seconds kept for the final evaluation


# --quick: one minibatch of training data, seen at every update, so a tiny run has a fixed
# set of kernel shapes (compilation dominates tiny runs) and a fixed number of updates
QUICK = dict(train_size=4, test_size=4, batch=4, dim=16, hidden=16, mlp=16, lr=1e-2, updates=10,
             speed_sentences=0)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()

    # ---- data and baselines -----------------------------------------------------------------
    train, test = make_splits(args.train_size, args.test_size, args.seed)
    base = baseline_uas(test)
    lengths = np.array([len(w) for w, _ in train])
    words, heads = train[0]
    print(f"Dependency parsing: {len(train)} train / {len(test)} held-out projective trees, "
          f"{len(VOCAB)} word types, {lengths.mean():.1f} words/sentence (max {lengths.max()})")
    print("  e.g. " + " ".join(f"{VOCAB[w]}<-{h}" for w, h in zip(words, heads))
          + "   (word<-head position, 0 = root)")
    print(f"  baselines on held-out: attach to previous word UAS {base['previous']:.3f}, "
          f"to next word {base['next']:.3f}; prepositions attached low (to the previous "
          f"word) {base['pp_previous']:.3f}")

    # ---- model ------------------------------------------------------------------------------
    pc = dx.ParameterCollection(seed=args.seed)
    model = BiLSTMParser(pc, len(VOCAB), args.dim, args.hidden, args.mlp)
    trainer = dx.AdamTrainer(pc, alpha=args.lr, sparse_updates=True)  # lazy Adam on tables
    print(f"BiLSTM arc-standard parser: embedding {args.dim}, BiLSTM {args.hidden}, MLP "
          f"{args.mlp}, {pc.parameter_count()} parameters; Adam lr {args.lr}, "
          f"{args.batch} sentences/update")
    batches = minibatches(train, args.batch, np.random.default_rng(args.seed + 1))
    t0 = time.perf_counter()
    # the untrained parser on a part of the held-out set: its decoding compiles kernels
    # (batch sizes) that training will not need, so keep it short
    before_set = test[:2 * args.batch]
    before = evaluate(model, before_set, args.batch)
    eval_seconds = time.perf_counter() - t0  # compiles included: the final one will be faster
    print(f"  untrained: UAS {before['uas']:.3f} on {len(before_set)} held-out sentences "
          f"({eval_seconds:.1f}s)")

    # ---- training ---------------------------------------------------------------------------
    # the final evaluation finds its kernels compiled: it takes a fraction of the first one
    reserve = min(eval_seconds, EVAL_RESERVE) + (SPEED_RESERVE if args.speed_sentences else 0.0)

    def step(batch):
        loss, agree, decisions, stats = train_step(model, trainer, batch)
        return loss, len(batch), stats["compiles"], {"agrees with oracle": (agree, decisions)}

    curve, updates, sentences, train_seconds = train_loop(
        args, step, batches, t_start=t_start, deadline=t_start + args.budget - reserve,
        how="static oracle, autobatch='agenda'", unit="sentence",
        show_loss=lambda x: f"{x:7.3f}")

    # ---- evaluation and speed -----------------------------------------------------------------
    t0 = time.perf_counter()
    after = evaluate(model, test, args.batch)
    eval_seconds = time.perf_counter() - t0
    speed = None
    if args.speed_sentences > 0:
        print(f"Timing greedy decoding of {args.speed_sentences} sentences in lockstep with "
              "autobatch='none' and 'agenda' (each after warm-up)...", flush=True)
        speed = compare_speed(model, [w for w, _ in test[:args.speed_sentences]])

    print("Results")
    print(f"  {updates} updates: loss/sentence {curve[0][1]:.3f} (update {curve[0][0]}) -> "
          f"{curve[-1][1]:.3f} (update {curve[-1][0]}); oracle agreement {curve[0][2]:.3f} -> "
          f"{curve[-1][2]:.3f}; {sentences / train_seconds:.1f} sentences/s in the training "
          "loop (compilation included)")
    print(f"  held-out UAS {after['uas']:.3f} (untrained {before['uas']:.3f}) vs attach to "
          f"previous word {base['previous']:.3f}, to next word {base['next']:.3f}   "
          f"({len(test) / eval_seconds:.0f} sentences/s decoding)")
    print(f"  PP attachment (prepositions' heads) {after['pp_attachment']:.3f} vs attaching "
          f"low {base['pp_previous']:.3f}")
    if speed:
        print(f"  lockstep decoding, kernels warm: none {speed['none']:.1f} sentences/s, "
              f"agenda {speed['agenda']:.1f} sentences/s ({speed['ratio']:.1f}x faster)")
    print(f"  total {time.perf_counter() - t_start:.1f}s")
    return {"before": before, "after": after, "baselines": base, "curve": curve,
            "updates": updates, "sentences_per_s": sentences / train_seconds, "speed": speed}


if __name__ == "__main__":
    main()
