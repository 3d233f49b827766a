"""Padded sizes: the ladder that bounds compilations.

Kernels are cached per padded batch size, so the ladder trades compilations against padded
(wasted) lanes. Up to 16 it is the powers of two; above, four steps per octave
(4, 5, 6, 7 times a power of two), so at most 25% of a batch is padding where powers of
two alone waste up to 50% (measured: a 1515-leaf Tree-LSTM batch padded to 2048 instead of
1792). Above ``FINE_FROM`` lanes, eight steps per octave (at most 12.5%): there a lane's
compute is what a batch costs, and the few sizes more compile once (Tree-LSTM, whose leaf
and lowest compose batches are 600-1,500 lanes, alternated in one process in both orders:
31.8 -> 30.1 and 30.5 -> 29.7 ms per update; 8 steps from 256 lanes or 16 from 1,024 gained
nothing more; tagger and char tagger on par, RNN LM at batch 64 -2%).

Batches of small work take a coarser ladder, the powers of four (``coarse_bucket``): there
padding costs microseconds and each size saved is a compilation saved (``engine._lanes``).
"""


FINE_FROM = 512  # batches above this many lanes take eight steps per octave


def bucket(n: int) -> int:
    """The padded size for ``n`` lanes (``n >= 1``)."""
    if n <= 16:
        b = 1
        while b < n:
            b *= 2
        return b
    steps = 3 if n > FINE_FROM else 2  # log2 of the steps per octave
    shift = max(0, n.bit_length() - 1 - steps)  # n >> shift is in 2**steps..2**(steps+1)-1
    m = -(-n >> shift)  # ceil(n / 2**shift)
    return m << shift


def coarse_bucket(n: int) -> int:
    """The padded size for ``n`` lanes on the coarse ladder, the powers of four from 4: for
    batches whose padding costs next to nothing (``engine._lanes``)."""
    b = 4
    while b < n:
        b *= 4
    return b
