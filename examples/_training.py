"""What the training examples share: their common flags, ``--quick``, endless minibatches, the
budgeted training loop and the none-vs-agenda speed comparison. (Not an example: the
examples import it.)"""
from __future__ import annotations

import argparse
import time

import numpy as np

import dynax as dx


def run_parser(doc: str, *, budget_covers: str, quick_is: str, train_size: int = 4000,
               test_size: int = 256) -> argparse.ArgumentParser:
    """An argument parser with the flags every training example has; add the model's own."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--budget", type=float, default=80.0,
                    help=f"seconds for the whole run, {budget_covers} included")
    ap.add_argument("--updates", type=count, default=0,
                    help="train for exactly this many updates instead (0: use the budget)")
    ap.add_argument("--min-updates", type=count, default=40,
                    help="train at least this long even if the budget is spent (slow machine)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke test: the QUICK settings ({quick_is})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-size", type=positive_int, default=train_size)
    ap.add_argument("--test-size", type=positive_int, default=test_size)
    add_device_flags(ap)
    return ap


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (a size, a dimension)."""
    return _int_at_least(text, 1)


def new_kernels(stats: dict) -> int:
    """The kernels a graph's ``stats()`` say it compiled or loaded from the persistent
    compilation cache (``--compilation-cache``): warm-up goes on while a pass makes any."""
    return stats["compiles"] + stats["cache_loads"]


def count(text: str) -> int:
    """argparse type: an integer of at least 0 (a number of things; 0: none)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
    return n


def add_device_flags(ap: argparse.ArgumentParser) -> None:
    """``--cpu-threads N`` and ``--compilation-cache DIR``, for ``apply_device_flags``."""
    ap.add_argument("--cpu-threads", type=positive_int, default=None,
                    help="XLA:CPU threads per kernel (dx.set_cpu_threads; default: one per core)")
    ap.add_argument("--compilation-cache", metavar="DIR", default=None,
                    help="keep compiled kernels in DIR, so that a later run loads them "
                         "(dx.set_compilation_cache)")


def apply_device_flags(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Apply the flags given: an argparse error if one cannot take effect."""
    try:
        if args.cpu_threads is not None:
            dx.set_cpu_threads(args.cpu_threads)  # only takes effect before any JAX work
        if args.compilation_cache is not None:
            dx.set_compilation_cache(args.compilation_cache)
    except (ValueError, RuntimeError) as e:
        ap.error(str(e))


def parse_run_args(ap: argparse.ArgumentParser, argv, quick: dict) -> argparse.Namespace:
    """The parsed flags; with ``--quick``, ``quick``'s settings replace the defaults of every
    flag not given on the command line."""
    args = ap.parse_args(argv)
    apply_device_flags(ap, args)
    if args.quick:
        apply_quick(ap, args, quick)
    check_batch(ap, args)
    return args


def apply_quick(ap: argparse.ArgumentParser, args: argparse.Namespace, quick: dict) -> None:
    """``quick``'s settings for every flag not given on the command line."""
    defaults = vars(ap.parse_args([]))
    given = {k for k, v in vars(args).items() if v != defaults[k]}
    vars(args).update({k: v for k, v in quick.items() if k not in given})


def check_batch(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An argparse error unless the training set holds at least one minibatch."""
    if args.train_size < args.batch:
        ap.error(f"--train-size ({args.train_size}) must be at least --batch ({args.batch})")


def minibatches(data, size: int, rng: np.random.Generator):
    """Endless shuffled minibatches (a new permutation each epoch)."""
    if not 0 < size <= len(data):  # else no minibatch, ever: the loop would wait forever
        raise ValueError(f"minibatches of {size} from {len(data)} examples")
    return _endless_minibatches(data, size, rng)


def _endless_minibatches(data, size, rng):
    while True:
        order = rng.permutation(len(data))
        for start in range(0, len(order) - size + 1, size):
            yield [data[i] for i in order[start:start + size]]


TIMED_PASSES = 5


def compare_speed(step, batches, max_warmup: int = 4):
    """Items/s of ``step(batch, strategy) -> (items, new kernels)`` under "none" and "agenda"
    on the same minibatches, each timed after warm-up passes (at most ``max_warmup``) that
    compile its kernels (or load them: ``new_kernels``): the median of ``TIMED_PASSES``
    passes. Returns (speeds and their "ratio", updates run)."""
    result, updates = {}, 0
    # under dx.settled_heap, as the training loop: one full collection of the heap (~150 ms)
    # inside a timing of a few minibatches cut the rate it read by up to half
    with dx.settled_heap():
        for strategy in ("none", "agenda"):
            for _ in range(max_warmup):
                made = 0
                for b in batches:
                    made += step(b, strategy)[1]
                    updates += 1
                if made == 0:
                    break
            rates = []  # the median of a few timed passes: an agenda pass can last ~10 ms
            for _ in range(TIMED_PASSES):
                t0 = time.perf_counter()
                items = sum(step(b, strategy)[0] for b in batches)
                rates.append(items / (time.perf_counter() - t0))
                updates += len(batches)
            result[strategy] = float(np.median(rates))
    result["ratio"] = result["agenda"] / result["none"]
    return result, updates


def train_loop(args, step, batches, *, t_start: float, deadline: float, how: str, unit: str,
               show_loss=lambda x: f"{x:.4f}"):
    """Train for ``args.updates`` updates, or until ``deadline`` and for at least
    ``args.min_updates``; print the loss curve about ten times along the way.

    ``step(batch) -> (summed loss, items, compilations, extras)``: ``items`` are what the
    loss is summed over (tokens, trees: ``unit``), ``extras`` a dict of further rates to
    show, ``name -> (count, out of)``. Returns (curve, updates, items, seconds): curve points
    are ``(updates, mean loss per item, *extras' rates)`` over the updates since the last.
    """
    t_train = time.perf_counter()
    if args.updates:
        print(f"Training for {args.updates} updates ({how}):")
        log_every = 0.0
    else:
        log_every = max((deadline - t_train) / 10, 2.0)
        print(f"Training for {max(deadline - t_train, 0):.0f}s, at least {args.min_updates} "
              f"updates ({how}):")
    curve, updates, items = [], 0, 0
    window, extras, compiles, t_log, items_log = [], {}, 0, t_train, 0

    def more():
        if args.updates:
            return updates < args.updates
        return time.perf_counter() < deadline or updates < args.min_updates

    with dx.settled_heap():
        while more():
            loss, n, new_compiles, new_extras = step(next(batches))
            window.append(loss / n)
            for name, (k, m) in new_extras.items():
                k0, m0 = extras.get(name, (0, 0))
                extras[name] = (k0 + k, m0 + m)
            items += n
            compiles += new_compiles
            updates += 1
            now = time.perf_counter()
            if args.updates and (updates % max(args.updates // 4, 1) == 0 or not more()) \
                    or not args.updates and (now - t_log >= log_every or not more()):
                rates = [k / max(m, 1) for k, m in extras.values()]
                curve.append((updates, float(np.mean(window)), *rates))
                shown = "".join(f"{name} {r:.3f}  " for name, r in zip(extras, rates))
                print(f"  update {updates:5d}  loss/{unit} {show_loss(curve[-1][1])}  {shown}"
                      f"{(items - items_log) / (now - t_log):7.0f} {unit}s/s  {compiles:3d} "
                      f"compiles  [{now - t_start:5.1f}s]", flush=True)
                window, extras, compiles, t_log, items_log = [], {}, 0, now, items
    return curve, updates, items, time.perf_counter() - t_train
