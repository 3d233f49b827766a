"""A BiLSTM part-of-speech tagger on synthetic sentences with ambiguous words.

The data
--------
A seeded generator writes English-like sentences from a small grammar (clauses joined by
"and"/"but", noun phrases with determiners, adjectives and prepositional phrases, optional
adverbs) and tags every word with one of nine tags (DET ADJ NOUN VERB PRON PREP ADV CONJ
PUNCT). Many words are ambiguous, as in English: "watch", "run", "drink" are nouns after a
determiner and verbs after a subject; "light", "cold", "clean" are adjectives before a noun
and nouns at the end of a noun phrase; "that", "this" are determiners before a noun and
pronouns elsewhere. Their tag is decided by the words on *both* sides, so a tagger that looks
at one word at a time cannot get them right, while a bidirectional LSTM can.

The model
---------
``E[word]`` (a lookup parameter, updated sparsely: only the rows a minibatch used) feeds a
one-layer ``dx.nn.BiRNNBuilder`` of ``dx.nn.LSTMBuilder`` cells; each position's
``[forward; backward]`` state is scored by an affine layer and trained with
``pickneglogsoftmax``. Every sentence of a minibatch is built naively, one node at a time, on
one graph; the agenda autobatcher runs the same LSTM step of all sentences together.

What to expect
--------------
It prints the data (with a tagged example), the baselines -- the most frequent tag overall
(about 0.2) and the most frequent tag *of each word* in the training data (about 0.9: wrong
on the ambiguous words) -- then a learning curve (training loss per token), the held-out tag
accuracy, overall and on ambiguous words only, and the training speed under autobatch
"none" and "agenda" on the same minibatch. With the default budget the BiLSTM reaches ~0.99
overall and well above the per-word baseline on the ambiguous words.

Run ``python examples/tagger.py`` (``--budget`` seconds for the whole run, ``--quick`` for a
smoke-test-sized run, ``--seed`` changes data and initialisation).
"""
from __future__ import annotations

import time

import numpy as np

import dynax as dx
from _training import (compare_speed, count, minibatches, new_kernels, parse_run_args,
                       positive_int, run_parser, train_loop)

# ============================================================================================
# Data: a tagged lexicon, a small grammar and a seeded sentence generator.
# ============================================================================================

TAGS = ("DET", "ADJ", "NOUN", "VERB", "PRON", "PREP", "ADV", "CONJ", "PUNCT")
TAG_ID = {t: i for i, t in enumerate(TAGS)}

# Words by the tag they get in a given grammatical slot. A word listed under several tags is
# ambiguous; the grammar decides which reading a sentence uses.
LEXICON = {
    "DET": "the a every some no this that".split(),
    "ADJ": "big small red old new happy quiet light cold clean dark open".split(),
    "NOUN": ("dog cat man woman park car house tree book city bird river child teacher "
             "watch run drink walk plant light cold clean dark fish").split(),
    "VERB": ("sees likes finds reads takes wants knows hears "
             "watch run drink walk plant clean open fish").split(),
    "PRON": "she he it they this that".split(),
    "PREP": "in on with near under behind".split(),
    "ADV": "quickly often rarely today".split(),
    "CONJ": "and but".split(),
    "PUNCT": ".".split(),
}
VOCAB = sorted({w for words in LEXICON.values() for w in words})
WORD_ID = {w: i for i, w in enumerate(VOCAB)}
AMBIGUOUS = frozenset(w for w in VOCAB if sum(w in ws for ws in LEXICON.values()) > 1)


class Grammar:
    """A seeded generator of (words, tags) sentences; every tag comes from the slot a word fills."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def pick(self, tag: str):
        words = LEXICON[tag]
        return [(words[self.rng.integers(len(words))], tag)]

    def noun_phrase(self, allow_pp: bool = True):
        r = self.rng
        if r.random() < 0.2:
            return self.pick("PRON")
        out = self.pick("DET")
        for _ in range(2):  # zero to two adjectives
            if r.random() < 0.3:
                out += self.pick("ADJ")
        out += self.pick("NOUN")
        if allow_pp and r.random() < 0.25:
            out += self.pick("PREP") + self.noun_phrase(allow_pp=False)
        return out

    def verb_phrase(self):
        r = self.rng
        out = self.pick("ADV") if r.random() < 0.15 else []
        out += self.pick("VERB")
        if r.random() < 0.7:
            out += self.noun_phrase()
        if r.random() < 0.2:
            out += self.pick("PREP") + self.noun_phrase(allow_pp=False)
        if r.random() < 0.15:
            out += self.pick("ADV")
        return out

    def sentence(self):
        out = self.noun_phrase() + self.verb_phrase()
        if self.rng.random() < 0.25:
            out += self.pick("CONJ") + self.noun_phrase() + self.verb_phrase()
        out += self.pick("PUNCT")
        words, tags = zip(*out)
        return [WORD_ID[w] for w in words], [TAG_ID[t] for t in tags]


def make_splits(n_train: int, n_test: int, seed: int, max_len: int = 30):
    """Train and held-out lists of ``(word ids, tag ids)``; deterministic in ``seed``."""
    g = Grammar(np.random.default_rng(seed))
    data = []
    while len(data) < n_train + n_test:
        words, tags = g.sentence()
        if len(words) <= max_len:
            data.append((words, tags))
    return data[:n_train], data[n_train:]


def baselines(train, test) -> dict:
    """Accuracy on ``test`` of the most frequent tag overall and of each word's most frequent
    tag in ``train`` (words never seen in training get the overall most frequent tag)."""
    counts = np.zeros((len(VOCAB), len(TAGS)), np.int64)
    for words, tags in train:
        np.add.at(counts, (words, tags), 1)
    majority = int(counts.sum(0).argmax())
    per_word = np.where(counts.sum(1) > 0, counts.argmax(1), majority)
    words = np.concatenate([w for w, _ in test])
    tags = np.concatenate([t for _, t in test])
    amb = np.isin(words, [WORD_ID[w] for w in AMBIGUOUS])
    return {"majority": float(np.mean(tags == majority)),
            "per_word": float(np.mean(per_word[words] == tags)),
            "per_word_ambiguous": float(np.mean(per_word[words][amb] == tags[amb])),
            "majority_tag": TAGS[majority]}


# ============================================================================================
# Model
# ============================================================================================

class BiLSTMTagger:
    """Embeddings -> BiLSTM -> affine tag scores per position."""

    def __init__(self, pc: dx.ParameterCollection, vocab: int, dim: int, hidden: int,
                 n_tags: int):
        self.E = pc.add_lookup_parameters((vocab, dim), init="normal", name="E")
        self.bilstm = dx.nn.BiRNNBuilder(1, dim, hidden, pc, dx.nn.LSTMBuilder)
        self.W = pc.add_parameters((n_tags, hidden), name="W_tag")
        self.b = pc.add_parameters((n_tags,), init="zeros", name="b_tag")

    def scores(self, words):
        """One tag-score vector per word."""
        hs = self.bilstm.transduce([self.E[w] for w in words])
        return [dx.affine_transform([self.b, self.W, h]) for h in hs]

    def losses(self, words, tags):
        return [dx.pickneglogsoftmax(s, t) for s, t in zip(self.scores(words), tags)]


# ============================================================================================
# Training, evaluation, speed
# ============================================================================================

def train_step(model, trainer, batch, autobatch: str = "agenda"):
    """Build every sentence of ``batch`` on one graph; backward and update.

    Returns (summed loss, tokens, graph stats)."""
    cg = dx.renew_cg(autobatch=autobatch)
    losses = [l for words, tags in batch for l in model.losses(words, tags)]
    loss = dx.esum(losses)
    value = loss.scalar_value()
    loss.backward()
    trainer.update()
    return value, len(losses), cg.stats()


def forward_values(model, batch, autobatch: str) -> np.ndarray:
    """Every token's loss of ``batch`` under one strategy (for none-vs-agenda checks)."""
    dx.renew_cg(autobatch=autobatch)
    losses = [l for words, tags in batch for l in model.losses(words, tags)]
    dx.forward(losses)
    return np.array([l.scalar_value() for l in losses])


def evaluate(model, data, chunk: int = 32) -> dict:
    """Held-out loss per token and tag accuracy (overall and on ambiguous words).

    ``chunk`` sentences per graph, one ``dx.forward`` each. The model has no dropout, so a
    default (``train=True``) graph computes the same values as ``train=False`` would, and it
    reuses the training step's compiled forward kernels (a ``train=False`` graph compiles
    residual-free variants: more compilation for a short run).
    """
    amb_ids = [WORD_ID[w] for w in AMBIGUOUS]
    loss, correct, amb_correct, amb_total, total = 0.0, 0, 0, 0, 0
    for start in range(0, len(data), chunk):
        dx.renew_cg()
        part = data[start:start + chunk]
        scores = [s for words, _ in part for s in model.scores(words)]
        gold = np.concatenate([tags for _, tags in part])
        words = np.concatenate([w for w, _ in part])
        # one read for the loss (each value read is a device round trip)
        loss_sum = dx.esum([dx.pickneglogsoftmax(s, int(t)) for s, t in zip(scores, gold)])
        dx.forward(scores + [loss_sum])
        pred = np.array([int(np.argmax(s.npvalue())) for s in scores])
        amb = np.isin(words, amb_ids)
        loss += loss_sum.scalar_value()
        correct += int(np.sum(pred == gold))
        amb_correct += int(np.sum((pred == gold) & amb))
        amb_total += int(np.sum(amb))
        total += len(gold)
    return {"loss": loss / total, "accuracy": correct / total,
            "accuracy_ambiguous": amb_correct / max(amb_total, 1)}


def parse_args(argv=None):
    ap = run_parser(__doc__, budget_covers="compilation and evaluation",
                    quick_is="4 sentences, 12 updates, tiny model", train_size=4000)
    ap.add_argument("--dim", type=positive_int, default=32, help="word embedding size")
    ap.add_argument("--hidden", type=positive_int, default=64,
                    help="BiLSTM output size (both directions)")
    ap.add_argument("--batch", type=positive_int, default=32, help="sentences per update")
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--speed-batches", type=count, default=1,
                    help="minibatches timed for the none-vs-agenda comparison (0: skip)")
    return parse_run_args(ap, argv, QUICK)


SPEED_RESERVE = 12.0  # seconds kept for the none-vs-agenda comparison (compiles "none" kernels)
EVAL_RESERVE = 4.0  # at most this many seconds kept for the final evaluation


# --quick: one minibatch of training data, seen at every update, so a tiny run has a fixed
# set of kernel shapes (compilation dominates tiny runs) and a fixed number of updates
QUICK = dict(train_size=4, test_size=4, batch=4, dim=16, hidden=16, lr=2e-2, updates=12,
             speed_batches=0)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()

    # ---- data -------------------------------------------------------------------------------
    train, test = make_splits(args.train_size, args.test_size, args.seed)
    base = baselines(train, test)
    lengths = np.array([len(w) for w, _ in train])
    words, tags = train[0]
    print(f"Tagging: {len(train)} train / {len(test)} held-out sentences, {len(VOCAB)} words "
          f"({len(AMBIGUOUS)} ambiguous), {len(TAGS)} tags, {lengths.mean():.1f} words/sentence")
    print("  e.g. " + " ".join(f"{VOCAB[w]}/{TAGS[t]}" for w, t in zip(words, tags)))
    print(f"  baselines on held-out: most frequent tag ({base['majority_tag']}) "
          f"{base['majority']:.3f}; most frequent tag of each word {base['per_word']:.3f} "
          f"({base['per_word_ambiguous']:.3f} on ambiguous words)")

    # ---- model ------------------------------------------------------------------------------
    pc = dx.ParameterCollection(seed=args.seed)
    model = BiLSTMTagger(pc, len(VOCAB), args.dim, args.hidden, len(TAGS))
    # E gets lazy sparse (row-wise) Adam updates: the used rows only
    trainer = dx.AdamTrainer(pc, alpha=args.lr, sparse_updates=True)
    print(f"BiLSTM tagger: embedding {args.dim}, BiLSTM {args.hidden}, "
          f"{pc.parameter_count()} parameters; Adam lr {args.lr} (sparse row updates of the "
          f"embeddings), {args.batch} sentences/update")
    batches = minibatches(train, args.batch, np.random.default_rng(args.seed + 1))
    t0 = time.perf_counter()
    # the untrained model on a part of the held-out set (its compilations are mostly the
    # training step's forward kernels; the rest of the set would mostly add new batch sizes)
    before_set = test[:2 * args.batch]
    before = evaluate(model, before_set, args.batch)
    eval_seconds = time.perf_counter() - t0  # compiles included: the final one will be faster
    print(f"  untrained: loss/token {before['loss']:.3f}, accuracy {before['accuracy']:.3f} "
          f"on {len(before_set)} held-out sentences ({eval_seconds:.1f}s)")

    # ---- training ---------------------------------------------------------------------------
    # the final evaluation finds its kernels compiled: it takes a fraction of the first one
    reserve = min(eval_seconds, EVAL_RESERVE) + (SPEED_RESERVE if args.speed_batches else 0.0)

    def step(batch):
        loss, tokens, stats = train_step(model, trainer, batch)
        return loss, tokens, stats["compiles"], {}

    curve, updates, tokens, train_seconds = train_loop(
        args, step, batches, t_start=t_start, deadline=t_start + args.budget - reserve,
        how="autobatch='agenda'", unit="token")

    # ---- evaluation ---------------------------------------------------------------------------
    t0 = time.perf_counter()
    after = evaluate(model, test, args.batch)
    eval_seconds = time.perf_counter() - t0

    # ---- speed: no batching vs the agenda autobatcher (a few more training steps) -------------
    speed = None
    if args.speed_batches > 0:
        print(f"Timing {args.speed_batches} minibatch(es) of training with autobatch='none' "
              "and 'agenda' (each after warm-up passes that compile its kernels)...", flush=True)

        def step(batch, strategy):  # (tokens, kernels compiled or loaded)
            _, tokens, stats = train_step(model, trainer, batch, strategy)
            return tokens, new_kernels(stats)

        speed, _ = compare_speed(step, [next(batches) for _ in range(args.speed_batches)])

    print("Results")
    print(f"  {updates} updates: training loss/token {curve[0][1]:.4f} (update {curve[0][0]}) -> "
          f"{curve[-1][1]:.4f} (update {curve[-1][0]}); {tokens / train_seconds:.0f} tokens/s "
          "in the training loop (compilation included)")
    print(f"  held-out loss/token {after['loss']:.4f} (untrained {before['loss']:.4f})")
    print(f"  held-out tag accuracy {after['accuracy']:.3f} vs most frequent tag "
          f"{base['majority']:.3f}, most frequent tag of each word {base['per_word']:.3f}")
    print(f"    on ambiguous words {after['accuracy_ambiguous']:.3f} vs most frequent tag of "
          f"each word {base['per_word_ambiguous']:.3f}   (evaluated in {eval_seconds:.1f}s)")
    if speed:
        print(f"  speed, same minibatch(es), kernels warm: none {speed['none']:.0f} tokens/s, "
              f"agenda {speed['agenda']:.0f} tokens/s ({speed['ratio']:.1f}x faster)")
    print(f"  total {time.perf_counter() - t_start:.1f}s")
    return {"before": before, "after": after, "baselines": base, "curve": curve,
            "updates": updates, "tokens_per_s": tokens / train_seconds, "speed": speed}


if __name__ == "__main__":
    main()
