"""ListOps with a binary Tree-LSTM: dynax's main demo.

The task (Nangia & Bowman, 2018, "ListOps: A Diagnostic Dataset for Latent Tree Learning")
------------------------------------------------------------------------------------------
Each example is a bracketed prefix expression over the digits 0-9 with four list operators,

    MIN  the smallest argument         MED  the median (``int(np.median(args))``, as published)
    MAX  the largest argument          SM   the sum modulo 10

for example ``[MAX 2 9 [MIN 4 7 ] 0 ]``; its value (here 9) is the label, one of ten classes.
The data here is generated on the fly by a deterministic, seeded generator with a controllable
maximum nesting depth and number of arguments, so the demo needs no download.

The model
---------
A binary Tree-LSTM (Tai et al., 2015, the N-ary variant with N = 2) reads the *gold* tree.
An operator node ``[OP a1 ... ak ]`` is binarised into a left-nested chain that reads like
a little program::

    compose(...compose(compose(leaf([OP), a1), a2)..., ak), leaf(]))

so the state after each argument summarises "the operator applied to the arguments so far"
and the closing bracket lets the cell finish the computation. Digits and operator tokens
are leaves: ``E[token]`` (a lookup parameter) goes through the leaf cell. The root's hidden
state is classified with ``pickneglogsoftmax(W @ h_root + b, label)``.

Both cells are ``@dx.function``s, so one cell application is ONE graph node; every tree
of a minibatch is built naively, one node at a time, on one graph, and dynax's agenda
autobatcher runs all the ready cells of equal signature together as one vmapped kernel.

What it prints: the data and the majority-class baseline; then the training throughput of the
same few minibatches without batching (``autobatch="none"``, node by node) and with the agenda
autobatcher, each timed once its kernels are compiled (measured before the training loop,
whose steps these also are); then, every ``--log-every`` updates, the mean training loss per
tree, trees/s and the XLA compilations in that interval; finally the held-out accuracy (all
test trees scored in one ``train=False`` graph and one ``dx.forward``), overall and per root
operator, and a summary.

Run ``python examples/tree_listops.py`` (``--seconds`` sets the training budget,
``--quick`` makes a smoke-test-sized run, ``--seed`` changes data and initialisation).
"""
from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

import dynax as dx
from _training import (add_device_flags, apply_device_flags, apply_quick, check_batch,
                       minibatches, new_kernels, positive_int)
from _training import compare_speed as timed_comparison  # the name compare_speed is ours

# ============================================================================================
# Data: the ListOps grammar, a seeded generator, an evaluator and a binariser.
# ============================================================================================

OPS = ("MIN", "MAX", "MED", "SM")
VOCAB = [str(d) for d in range(10)] + ["[" + op for op in OPS] + ["]"]
TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB)}
N_CLASSES = 10

# An expression is either an int (a digit) or a tuple ``(op, (arg, arg, ...))``.


def evaluate(expr) -> int:
    """The value (0..9) of an expression, by the published ListOps semantics."""
    if isinstance(expr, int):
        return expr
    op, args = expr
    values = [evaluate(a) for a in args]
    if op == "MIN":
        return min(values)
    if op == "MAX":
        return max(values)
    if op == "MED":
        return int(np.median(values))
    if op == "SM":
        return sum(values) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def to_string(expr) -> str:
    """The bracketed text form, e.g. ``[MAX 2 9 [MIN 4 7 ] 0 ]``."""
    if isinstance(expr, int):
        return str(expr)
    op, args = expr
    return "[" + op + " " + " ".join(to_string(a) for a in args) + " ]"


def parse(text: str):
    """Inverse of ``to_string`` (tokens separated by whitespace)."""
    tokens = text.split()
    pos = 0

    def read():
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok.isdigit():
            return int(tok)
        if not tok.startswith("[") or tok[1:] not in OPS:
            raise ValueError(f"parse: unexpected token {tok!r}")
        args = []
        while tokens[pos] != "]":
            args.append(read())
        pos += 1
        if len(args) < 1:
            raise ValueError(f"parse: operator {tok} without arguments")
        return tok[1:], tuple(args)

    expr = read()
    if pos != len(tokens):
        raise ValueError(f"parse: trailing tokens {tokens[pos:]}")
    return expr


def generate(rng: np.random.Generator, max_depth: int = 3, min_args: int = 2,
             max_args: int = 5, p_nest: float = 0.3, depth: int = 1):
    """A random expression whose root is an operator.

    Each argument is a nested operator with probability ``p_nest`` (while the nesting depth is
    below ``max_depth``), otherwise a digit; each operator gets ``min_args..max_args`` arguments.
    """
    op = OPS[rng.integers(len(OPS))]
    args = []
    for _ in range(int(rng.integers(min_args, max_args + 1))):
        if depth < max_depth and rng.random() < p_nest:
            args.append(generate(rng, max_depth, min_args, max_args, p_nest, depth + 1))
        else:
            args.append(int(rng.integers(10)))
    return op, tuple(args)


def binarize(expr):
    """The binary tree the Tree-LSTM reads: a token id (leaf) or a pair ``(left, right)``."""
    if isinstance(expr, int):
        return TOKEN_ID[str(expr)]
    op, args = expr
    node = TOKEN_ID["[" + op]
    for a in args:
        node = (node, binarize(a))
    return node, TOKEN_ID["]"]


def make_splits(n_train: int, n_test: int, seed: int, **gen_kwargs):
    """Disjoint train and test sets of ``(binary tree, label, text)``; deterministic in seed."""
    rng = np.random.default_rng(seed)
    seen, data = set(), []
    while len(data) < n_train + n_test:
        expr = generate(rng, **gen_kwargs)
        text = to_string(expr)
        if text in seen:  # keep the test set unseen in training
            continue
        seen.add(text)
        data.append((binarize(expr), evaluate(expr), text))
    return data[:n_train], data[n_train:]


def tree_size(tree) -> tuple[int, int]:
    """(leaves, internal nodes) of a binary tree."""
    if isinstance(tree, int):
        return 1, 0
    (la, na), (lb, nb) = tree_size(tree[0]), tree_size(tree[1])
    return la + lb, na + nb + 1


# ============================================================================================
# Model: a binary Tree-LSTM of two @dx.function cells.
# ============================================================================================

@dx.function
def leaf_cell(x, W, b):
    """Tai et al.'s leaf: an LSTM step from a zero state (input, output and update gates)."""
    i, o, u = jnp.split(W @ x + b, 3)
    c, h = dx.nn.lstm_state(i, u, o)
    return h, c


@dx.function
def compose_cell(hl, cl, hr, cr, U, b):
    """Binary (N-ary, N = 2) Tree-LSTM node: one forget gate per child."""
    i, fl, fr, o, u = jnp.split(U @ jnp.concatenate([hl, hr]) + b, 5)
    c, h = dx.nn.lstm_state(i, u, o, (fl, fr), (cl, cr))
    return h, c


class TreeLSTMClassifier:
    def __init__(self, pc: dx.ParameterCollection, vocab: int, dim: int, hidden: int,
                 classes: int):
        H = hidden
        self.E = pc.add_lookup_parameters((vocab, dim), init="uniform", name="E")
        self.W_leaf = pc.add_parameters((3 * H, dim), name="W_leaf")
        self.b_leaf = pc.add_parameters((3 * H,), init="zeros", name="b_leaf")
        self.U = pc.add_parameters((5 * H, 2 * H), name="U")
        # gate order i, f_l, f_r, o, u: start the forget gates open (bias 1)
        self.b = pc.add_parameters((5 * H,), name="b",
                                   init=np.r_[np.zeros(H), np.ones(2 * H), np.zeros(2 * H)])
        self.W_out = pc.add_parameters((classes, H), name="W_out")
        self.b_out = pc.add_parameters((classes,), init="zeros", name="b_out")

    def encode(self, tree):
        """(h, c) of a tree's root, built recursively, one node per cell application."""
        if isinstance(tree, int):
            return leaf_cell(self.E[tree], self.W_leaf, self.b_leaf)
        hl, cl = self.encode(tree[0])
        hr, cr = self.encode(tree[1])
        return compose_cell(hl, cl, hr, cr, self.U, self.b)

    def scores(self, tree):
        h, _ = self.encode(tree)
        return self.W_out @ h + self.b_out

    def loss(self, tree, label: int):
        return dx.pickneglogsoftmax(self.scores(tree), label)


# ============================================================================================
# Training, evaluation and the speed comparison.
# ============================================================================================

def train_step(model, trainer, batch, autobatch: str = "agenda"):
    """One minibatch: build every tree on one fresh graph, backward, update.

    Returns the summed loss and the graph's ``stats()`` (which count the XLA compilations
    the step caused, the optimizer's included).
    """
    cg = dx.renew_cg(autobatch=autobatch)
    loss = dx.esum([model.loss(tree, label) for tree, label, _ in batch])
    value = loss.scalar_value()
    loss.backward()
    trainer.update()
    return value, cg.stats()


def predictions(model, data) -> np.ndarray:
    """The predicted label of every tree: all trees' scores in one inference graph, one
    forward."""
    dx.renew_cg(train=False)
    scores = [model.scores(tree) for tree, _, _ in data]
    dx.forward(scores)
    return np.array([int(np.argmax(s.npvalue())) for s in scores])


def accuracy_by_operator(data, predicted) -> dict:
    """``{operator: (accuracy, trees)}`` over the trees whose root is that operator (which
    of the four the model has learned), given each tree's ``predicted`` label."""
    roots = np.array([text.split()[0][1:] for _, _, text in data])
    right = predicted == np.array([y for _, y, _ in data])
    return {op: (float(np.mean(right[roots == op])), int(np.sum(roots == op)))
            for op in OPS if np.any(roots == op)}


def compare_speed(model, trainer, batches, max_warmup: int = 4) -> tuple[dict, int]:
    """Trees/s of full training steps, autobatch "none" vs "agenda", on the same minibatches
    (``_training.compare_speed``: warm-up passes until one makes no kernel, then the median
    of ``TIMED_PASSES`` timed passes). Returns the speeds and the training steps taken."""
    def step(batch, strategy):
        return len(batch), new_kernels(train_step(model, trainer, batch, strategy)[1])
    return timed_comparison(step, batches, max_warmup)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=50.0, help="training time budget")
    ap.add_argument("--quick", action="store_true", help="a few updates only (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-size", type=positive_int, default=20000)
    ap.add_argument("--test-size", type=positive_int, default=1000)
    ap.add_argument("--max-depth", type=positive_int, default=3)
    ap.add_argument("--max-args", type=positive_int, default=5)
    ap.add_argument("--dim", type=positive_int, default=32, help="token embedding size")
    # 128 learns more within the 50 s budget than 64 (benchmarks/RESULTS.md, session 63)
    ap.add_argument("--hidden", type=positive_int, default=128, help="Tree-LSTM state size")
    ap.add_argument("--batch", type=positive_int, default=32)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--log-every", type=positive_int, default=25,
                    help="updates between progress lines")
    ap.add_argument("--speed-batches", type=positive_int, default=2,
                    help="minibatches timed for the none-vs-agenda comparison")
    add_device_flags(ap)
    args = ap.parse_args(argv)
    apply_device_flags(ap, args)
    if args.quick:  # small, shallow trees and small batches: few kernels to compile
        apply_quick(ap, args, QUICK)
    check_batch(ap, args)
    return args


QUICK = dict(train_size=128, test_size=32, batch=8, max_depth=2, max_args=3, log_every=2,
             speed_batches=1)  # --quick's settings, for the flags not given


def main(argv=None) -> dict:
    args = parse_args(argv)
    max_updates = 4 if args.quick else None

    # ---- data -------------------------------------------------------------------------------
    train, test = make_splits(args.train_size, args.test_size, args.seed,
                              max_depth=args.max_depth, max_args=args.max_args)
    counts = np.bincount([label for _, label, _ in test], minlength=N_CLASSES)
    majority = counts.max() / counts.sum()
    sizes = np.array([sum(tree_size(t)) for t, _, _ in train])
    print(f"ListOps: {len(train)} train / {len(test)} test expressions "
          f"(depth <= {args.max_depth}, 2..{args.max_args} args), "
          f"{sizes.mean():.1f} tree nodes on average (max {sizes.max()})")
    print(f"  e.g. {train[0][2]}  ->  {train[0][1]}")
    print(f"  majority-class baseline on test: {majority:.3f} (always label {counts.argmax()})")

    # ---- model ------------------------------------------------------------------------------
    pc = dx.ParameterCollection(seed=args.seed)
    model = TreeLSTMClassifier(pc, len(VOCAB), args.dim, args.hidden, N_CLASSES)
    trainer = dx.AdamTrainer(pc, alpha=args.lr, sparse_updates=True)  # lazy Adam on tables
    print(f"Tree-LSTM: embedding {args.dim}, hidden {args.hidden}, "
          f"{pc.parameter_count()} parameters; Adam lr {args.lr}, minibatch {args.batch}; "
          f"XLA:CPU threads per kernel: {args.cpu_threads or 'one per core'}")
    rng = np.random.default_rng(args.seed + 1)
    batches = minibatches(train, args.batch, rng)

    # ---- speed: no batching vs the agenda autobatcher ----------------------------------------
    # Measured first, while dynax's value arenas are still training-sized (the big evaluation
    # graph at the end grows them). These are ordinary training steps; the loop goes on from
    # them, and its first kernels are already compiled by the agenda warm-up.
    print(f"Timing {args.speed_batches} minibatch(es) with autobatch='none' and 'agenda' "
          "(each after warm-up passes that compile its kernels)...", flush=True)
    t0 = time.perf_counter()
    timed = [next(batches) for _ in range(args.speed_batches)]
    speed, updates = compare_speed(model, trainer, timed)
    trees = updates * args.batch
    print(f"  done in {time.perf_counter() - t0:.1f}s ({updates} updates)")

    # ---- training -----------------------------------------------------------------------------
    print(f"Training for {f'{max_updates} updates' if max_updates else f'{args.seconds:.0f}s'}:")
    curve, window, compiles = [], [], 0
    made = {"compiles": 0, "cache_loads": 0}  # the training loop's kernels, all told
    start = t_log = time.perf_counter()
    trees_at_log, trees_at_start = trees, trees
    steps = 0

    def more():
        if max_updates is not None:
            return steps < max_updates
        return time.perf_counter() - start < args.seconds

    with dx.settled_heap():
        while more():
            batch = next(batches)
            loss, stats = train_step(model, trainer, batch)
            window.append(loss / len(batch))
            compiles += stats["compiles"]
            for key in made:
                made[key] += stats[key]
            steps += 1
            updates += 1
            trees += len(batch)
            if updates % args.log_every == 0:
                now = time.perf_counter()
                rate = (trees - trees_at_log) / (now - t_log)
                mean_loss = float(np.mean(window))
                curve.append((updates, mean_loss))
                print(f"  update {updates:5d}  trees {trees:6d}  loss {mean_loss:.3f}  "
                      f"{rate:6.0f} trees/s  {compiles:3d} compiles  [{now - start:5.1f}s]",
                      flush=True)
                window, t_log, trees_at_log, compiles = [], now, trees, 0
    train_seconds = time.perf_counter() - start
    if window:
        curve.append((updates, float(np.mean(window))))
    train_rate = (trees - trees_at_start) / train_seconds

    # ---- evaluation ---------------------------------------------------------------------------
    t0 = time.perf_counter()
    predicted = predictions(model, test)
    eval_seconds = time.perf_counter() - t0
    test_acc = float(np.mean(predicted == np.array([y for _, y, _ in test])))
    by_op = accuracy_by_operator(test, predicted)

    print("Results")
    print(f"  trained {updates} updates, {trees} trees; training loop "
          f"{train_rate:.0f} trees/s over {train_seconds:.1f}s (compilation included: "
          f"{made['compiles']} kernels compiled, {made['cache_loads']} loaded from the "
          "compilation cache)")
    print(f"  loss per tree: {curve[0][1]:.3f} (update {curve[0][0]}) -> "
          f"{curve[-1][1]:.3f} (update {curve[-1][0]})")
    print(f"  test accuracy {test_acc:.3f} vs majority baseline {majority:.3f} "
          f"({len(test)} trees scored in one graph in {eval_seconds:.1f}s)")
    print("    by root operator: " + ", ".join(f"{op} {acc:.3f} ({n} trees)"
                                              for op, (acc, n) in by_op.items()))
    print(f"  speed on the same {len(timed)} minibatch(es) of {args.batch} trees, kernels warm:")
    print(f"    autobatch='none'   {speed['none']:7.1f} trees/s")
    print(f"    autobatch='agenda' {speed['agenda']:7.1f} trees/s   "
          f"({speed['ratio']:.1f}x faster)")

    return {"accuracy": test_acc, "accuracy_by_operator": by_op,
            "majority": float(majority), "curve": curve,
            "updates": updates, "trees": trees, "train_seconds": train_seconds,
            "train_trees_per_s": train_rate, "speed": speed}


if __name__ == "__main__":
    main()
