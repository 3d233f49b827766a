"""An LSTM language model on sentences from a small probabilistic grammar, with sampling.

The data
--------
A seeded probabilistic grammar writes English-like sentences with number agreement:
singular and plural subjects ("the dog", "some cats"), transitive and intransitive verbs that
must agree with their subject ("sees" / "see"), optional adjectives, and relative clauses --
subject relatives ("the dog that chases the cats sleeps") and object relatives ("the dogs that
the cat sees sleep"), nested up to twice. Agreement across a relative clause is a
long-distance dependency: the verb after it agrees with a noun several words back, which a
bigram model cannot see. ``grammatical(words)`` recognises the grammar exactly.

The model
---------
``E[word]`` (a lookup parameter, sparse row updates) feeds a one-layer ``dx.nn.LSTMBuilder``;
a ``dx.nn.StandardSoftmaxBuilder`` predicts the next word (``<s>`` in, ``</s>`` out). Every
sentence of a minibatch is built on one graph; the agenda autobatcher runs the same LSTM
step of all sentences as one kernel. Sampling runs several sentences in lockstep: each step
builds the next-word distributions of all unfinished sentences, computes them with one
``dx.forward``, draws the next words from their values, and feeds them back -- the graph grows
from values computed while it runs.

What to expect
--------------
It prints the data and two count-based baselines (add-one unigram and interpolated bigram
perplexity on held-out sentences), a learning curve (training loss per word), then held-out
perplexity (well below the unigram's ~30 and below the bigram's), sentences sampled from the
trained LSTM with the fraction that the grammar accepts, next to the same fraction for
sentences sampled from the bigram model, and the training speed under autobatch "none" and
"agenda" on the same minibatch.

Run ``python examples/rnnlm.py`` (``--budget`` seconds for the whole run, ``--quick`` for a
smoke-test-sized run, ``--seed`` changes data and initialisation).
"""
from __future__ import annotations

import time

import numpy as np

import dynax as dx
from _training import (compare_speed, count, minibatches, new_kernels, parse_run_args,
                       positive_int, run_parser, train_loop)

# ============================================================================================
# Data: a probabilistic grammar with agreement and relative clauses, and its recogniser.
# ============================================================================================

LEX = {
    ("DET", "sg"): "a the every this".split(),
    ("DET", "pl"): "the some many these".split(),
    ("N", "sg"): "dog cat bird child farmer teacher".split(),
    ("N", "pl"): "dogs cats birds children farmers teachers".split(),
    ("VT", "sg"): "sees likes chases feeds".split(),
    ("VT", "pl"): "see like chase feed".split(),
    ("VI", "sg"): "sleeps runs sings".split(),
    ("VI", "pl"): "sleep run sing".split(),
    ("ADJ", None): "big small old happy".split(),
    ("THAT", None): ["that"],
    ("END", None): ["."],
}
BOS, EOS = "<s>", "</s>"
VOCAB = [BOS, EOS] + sorted({w for ws in LEX.values() for w in ws})
WORD_ID = {w: i for i, w in enumerate(VOCAB)}
NUMBERS = ("sg", "pl")


class Grammar:
    """Seeded sampler of sentences (lists of words, without ``<s>``/``</s>``)."""

    def __init__(self, rng: np.random.Generator, p_rel: float = 0.3, max_rel: int = 2):
        self.rng, self.p_rel, self.max_rel = rng, p_rel, max_rel

    def word(self, cat, num=None):
        ws = LEX[(cat, num)]
        return [ws[self.rng.integers(len(ws))]]

    def np_(self, num, depth):
        out = self.word("DET", num)
        if self.rng.random() < 0.3:
            out += self.word("ADJ")
        out += self.word("N", num)
        if depth < self.max_rel and self.rng.random() < self.p_rel:
            out += self.word("THAT")
            if self.rng.random() < 0.5:  # subject relative: that VP (agrees with this noun)
                out += self.vp(num, depth + 1)
            else:  # object relative: that NP VT (the verb agrees with the inner subject)
                inner = NUMBERS[self.rng.integers(2)]
                out += self.np_(inner, depth + 1) + self.word("VT", inner)
        return out

    def vp(self, num, depth):
        if self.rng.random() < 0.5:
            return self.word("VI", num)
        return self.word("VT", num) + self.np_(NUMBERS[self.rng.integers(2)], depth)

    def sentence(self):
        num = NUMBERS[self.rng.integers(2)]
        return self.np_(num, 0) + self.vp(num, 0) + self.word("END")


def grammatical(words) -> bool:
    """Whether ``words`` (no ``<s>``/``</s>``) is a sentence of the grammar (any nesting)."""
    words = list(words)
    n = len(words)

    def cat(pos, c, num=None):  # positions after one word of category c
        return {pos + 1} if pos < n and words[pos] in LEX[(c, num)] else set()

    def np_(pos, num):
        ends = set()
        for p in cat(pos, "DET", num):
            for q in cat(p, "ADJ") | {p}:
                for r in cat(q, "N", num):
                    ends.add(r)
                    for t in cat(r, "THAT"):
                        ends |= vp(t, num)
                        for inner in NUMBERS:
                            for u in np_(t, inner):
                                ends |= cat(u, "VT", inner)
        return ends

    def vp(pos, num):
        ends = cat(pos, "VI", num)
        for p in cat(pos, "VT", num):
            for inner in NUMBERS:
                ends |= np_(p, inner)
        return ends

    return any(n in cat(q, "END") for num in NUMBERS for p in np_(0, num) for q in vp(p, num))


def make_splits(n_train: int, n_test: int, seed: int, max_len: int = 30):
    """Train and held-out lists of word-id sentences (no ``<s>``/``</s>``)."""
    g = Grammar(np.random.default_rng(seed))
    data = []
    while len(data) < n_train + n_test:
        words = g.sentence()
        if len(words) <= max_len:
            data.append([WORD_ID[w] for w in words])
    return data[:n_train], data[n_train:]


# ---- count-based baselines ---------------------------------------------------------------------

class NGramBaseline:
    """Add-one unigram, and a bigram interpolated with it (weight ``lam`` on the bigram)."""

    def __init__(self, train, lam: float = 0.9):
        V = len(VOCAB)
        self.lam = lam
        uni = np.ones(V)
        uni[WORD_ID[BOS]] = 0.0  # never predicted
        big = np.zeros((V, V))
        for sent in train:
            seq = [WORD_ID[BOS]] + sent + [WORD_ID[EOS]]
            np.add.at(uni, seq[1:], 1)
            np.add.at(big, (seq[:-1], seq[1:]), 1)
        self.unigram = uni / uni.sum()
        rows = big.sum(1, keepdims=True)
        big = np.where(rows > 0, big / np.maximum(rows, 1), self.unigram)
        self.bigram = lam * big + (1 - lam) * self.unigram

    def perplexities(self, data) -> tuple[float, float]:
        nll_u = nll_b = 0.0
        n = 0
        for sent in data:
            seq = [WORD_ID[BOS]] + sent + [WORD_ID[EOS]]
            nll_u -= np.log(self.unigram[seq[1:]]).sum()
            nll_b -= np.log(self.bigram[seq[:-1], seq[1:]]).sum()
            n += len(seq) - 1
        return float(np.exp(nll_u / n)), float(np.exp(nll_b / n))

    def sample(self, rng, max_len: int = 30):
        out, prev = [], WORD_ID[BOS]
        for _ in range(max_len):
            prev = int(rng.choice(len(VOCAB), p=self.bigram[prev]))
            if prev == WORD_ID[EOS]:
                break
            out.append(prev)
        return out


# ============================================================================================
# Model
# ============================================================================================

class LSTMLanguageModel:
    """Embeddings -> LSTM -> softmax over the next word."""

    def __init__(self, pc: dx.ParameterCollection, vocab: int, dim: int, hidden: int):
        self.E = pc.add_lookup_parameters((vocab, dim), init="normal", name="E")
        self.lstm = dx.nn.LSTMBuilder(1, dim, hidden, pc)
        self.softmax = dx.nn.StandardSoftmaxBuilder(hidden, vocab, pc)

    def losses(self, sent):
        """``-log p(w_t | w_<t)`` for every word of ``sent`` and the final ``</s>``."""
        inputs = [WORD_ID[BOS]] + sent
        targets = sent + [WORD_ID[EOS]]
        hs = self.lstm.initial_state().transduce([self.E[w] for w in inputs])
        return [self.softmax.neg_log_softmax(h, t) for h, t in zip(hs, targets)]

    def sample(self, n: int, rng: np.random.Generator, max_len: int = 30, autobatch="agenda"):
        """``n`` sentences drawn from the model, generated in lockstep on one graph.

        Each step builds the next-word distribution of every unfinished sentence, computes
        them together (``dx.forward``) and feeds the drawn words back as the next inputs.
        """
        dx.renew_cg(autobatch=autobatch)  # no dropout: train=True reuses the training kernels
        states = [self.lstm.initial_state().add_input(self.E[WORD_ID[BOS]]) for _ in range(n)]
        out = [[] for _ in range(n)]
        active = list(range(n))
        for _ in range(max_len + 1):
            dists = {i: dx.softmax(self.softmax.full_logits(states[i].output())) for i in active}
            dx.forward(list(dists.values()))
            still = []
            for i in active:
                p = dists[i].npvalue().astype(np.float64)
                w = int(rng.choice(len(p), p=p / p.sum()))
                if w == WORD_ID[EOS] or len(out[i]) == max_len:
                    continue
                out[i].append(w)
                states[i] = states[i].add_input(self.E[w])
                still.append(i)
            active = still
            if not active:
                break
        return out


# ============================================================================================
# Training, evaluation, speed
# ============================================================================================

def train_step(model, trainer, batch, autobatch: str = "agenda"):
    """One minibatch on one graph: backward and update. Returns (loss, words, stats)."""
    cg = dx.renew_cg(autobatch=autobatch)
    losses = [l for sent in batch for l in model.losses(sent)]
    loss = dx.esum(losses)
    value = loss.scalar_value()
    loss.backward()
    trainer.update()
    return value, len(losses), cg.stats()


def forward_values(model, batch, autobatch: str) -> np.ndarray:
    """Every predicted word's loss in ``batch`` under one strategy.

    The model has no dropout, so a default (``train=True``) graph computes what
    ``train=False`` would, and reuses the training step's compiled forward kernels (a
    ``train=False`` graph compiles residual-free variants: more compilation for a short run).
    """
    dx.renew_cg(autobatch=autobatch)
    losses = [l for sent in batch for l in model.losses(sent)]
    dx.forward(losses)
    return np.array([l.scalar_value() for l in losses])


def evaluate(model, data, chunk: int = 32) -> dict:
    """Held-out loss per predicted word and perplexity; ``chunk`` sentences per graph."""
    total, n = 0.0, 0
    for start in range(0, len(data), chunk):
        dx.renew_cg()  # no dropout: train=True reuses the training kernels
        losses = [l for sent in data[start:start + chunk] for l in model.losses(sent)]
        total += dx.esum(losses).scalar_value()  # one read (each read is a device round trip)
        n += len(losses)
    return {"loss": total / n, "perplexity": float(np.exp(total / n))}


def text(ids) -> str:
    return " ".join(VOCAB[i] for i in ids)


def parse_args(argv=None):
    ap = run_parser(__doc__, budget_covers="compilation, evaluation and sampling",
                    quick_is="4 sentences, 12 updates, tiny model", train_size=5000)
    ap.add_argument("--dim", type=positive_int, default=32, help="word embedding size")
    ap.add_argument("--hidden", type=positive_int, default=64, help="LSTM size")
    ap.add_argument("--batch", type=positive_int, default=32, help="sentences per update")
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--samples", type=positive_int, default=32, help="sentences sampled at the end")
    ap.add_argument("--speed-batches", type=count, default=1,
                    help="minibatches timed for the none-vs-agenda comparison (0: skip)")
    return parse_run_args(ap, argv, QUICK)


SPEED_RESERVE = 12.0  # seconds kept for the none-vs-agenda comparison (compiles "none" kernels)
EVAL_RESERVE = 4.0  # at most this many seconds kept for the final evaluation
SAMPLE_RESERVE = 8.0  # seconds kept for sampling (its softmax and batch sizes are new kernels)


# --quick: one minibatch of training data, seen at every update, so a tiny run has a fixed
# set of kernel shapes (compilation dominates tiny runs) and a fixed number of updates
QUICK = dict(train_size=4, test_size=4, batch=4, dim=16, hidden=16, lr=2e-2, updates=12,
             samples=4, speed_batches=0)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()

    # ---- data and baselines -----------------------------------------------------------------
    train, test = make_splits(args.train_size, args.test_size, args.seed)
    ngram = NGramBaseline(train)
    uni_ppl, bi_ppl = ngram.perplexities(test)
    rng = np.random.default_rng(args.seed + 2)
    bigram_ok = float(np.mean([grammatical(text(ngram.sample(rng)).split())
                               for _ in range(500)]))
    lengths = np.array([len(s) + 1 for s in train])
    print(f"Language modelling: {len(train)} train / {len(test)} held-out sentences, "
          f"{len(VOCAB)} word types, {lengths.mean():.1f} predicted words/sentence")
    for sent in train[:2]:
        print(f"  e.g. {text(sent)}")
    print(f"  baselines on held-out: unigram perplexity {uni_ppl:.2f}, bigram {bi_ppl:.2f}; "
          f"{bigram_ok:.0%} of bigram samples are grammatical")

    # ---- model ------------------------------------------------------------------------------
    pc = dx.ParameterCollection(seed=args.seed)
    model = LSTMLanguageModel(pc, len(VOCAB), args.dim, args.hidden)
    # E gets lazy sparse (row-wise) Adam updates: the used rows only
    trainer = dx.AdamTrainer(pc, alpha=args.lr, sparse_updates=True)
    print(f"LSTM LM: embedding {args.dim}, hidden {args.hidden}, {pc.parameter_count()} "
          f"parameters; Adam lr {args.lr}, {args.batch} sentences/update")
    batches = minibatches(train, args.batch, np.random.default_rng(args.seed + 1))
    t0 = time.perf_counter()
    # the untrained model on a part of the held-out set (its compilations are mostly the
    # training step's forward kernels; the rest of the set would mostly add new batch sizes)
    before_set = test[:2 * args.batch]
    before = evaluate(model, before_set, args.batch)
    eval_seconds = time.perf_counter() - t0  # compiles included: the final one will be faster
    print(f"  untrained: perplexity {before['perplexity']:.2f} on {len(before_set)} held-out "
          f"sentences ({eval_seconds:.1f}s)")

    # ---- training ---------------------------------------------------------------------------
    # the final evaluation finds its kernels compiled: it takes a fraction of the first one
    reserve = (min(eval_seconds, EVAL_RESERVE) + SAMPLE_RESERVE
               + (SPEED_RESERVE if args.speed_batches else 0.0))

    def step(batch):
        loss, words, stats = train_step(model, trainer, batch)
        return loss, words, stats["compiles"], {}

    curve, updates, words, train_seconds = train_loop(
        args, step, batches, t_start=t_start, deadline=t_start + args.budget - reserve,
        how="autobatch='agenda'", unit="word",
        show_loss=lambda x: f"{x:.4f} (perplexity {np.exp(x):6.2f})")

    # ---- evaluation, sampling, speed ----------------------------------------------------------
    t0 = time.perf_counter()
    after = evaluate(model, test, args.batch)
    eval_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    samples = model.sample(args.samples, np.random.default_rng(args.seed + 3))
    sample_seconds = time.perf_counter() - t0
    ok = [grammatical(text(s).split()) for s in samples]
    speed = None
    if args.speed_batches > 0:
        print(f"Timing {args.speed_batches} minibatch(es) of training with autobatch='none' "
              "and 'agenda' (each after warm-up passes that compile its kernels)...", flush=True)

        def step(batch, strategy):  # (words, kernels compiled or loaded)
            _, words, stats = train_step(model, trainer, batch, strategy)
            return words, new_kernels(stats)

        speed, _ = compare_speed(step, [next(batches) for _ in range(args.speed_batches)])

    print("Results")
    print(f"  {updates} updates: training loss/word {curve[0][1]:.4f} (update {curve[0][0]}) -> "
          f"{curve[-1][1]:.4f} (update {curve[-1][0]}); {words / train_seconds:.0f} words/s "
          "in the training loop (compilation included)")
    print(f"  held-out perplexity {after['perplexity']:.2f} (untrained {before['perplexity']:.2f})"
          f" vs unigram {uni_ppl:.2f}, bigram {bi_ppl:.2f}   (evaluated in {eval_seconds:.1f}s)")
    print(f"  {len(samples)} sentences sampled in lockstep in {sample_seconds:.1f}s: "
          f"{np.mean(ok):.0%} grammatical (bigram samples: {bigram_ok:.0%}); e.g. "
          "(* = not grammatical)")
    for s, good in list(zip(samples, ok))[:6]:
        print(f"    {'  ' if good else '* '}{text(s)}")
    if speed:
        print(f"  speed, same minibatch(es), kernels warm: none {speed['none']:.0f} words/s, "
              f"agenda {speed['agenda']:.0f} words/s ({speed['ratio']:.1f}x faster)")
    print(f"  total {time.perf_counter() - t_start:.1f}s")
    return {"before": before, "after": after, "unigram_perplexity": uni_ppl,
            "bigram_perplexity": bi_ppl, "grammatical": float(np.mean(ok)),
            "bigram_grammatical": bigram_ok, "samples": [text(s) for s in samples],
            "curve": curve, "updates": updates, "words_per_s": words / train_seconds,
            "speed": speed}


if __name__ == "__main__":
    main()
