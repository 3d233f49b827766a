"""Padded sizes: the ladder that bounds compilations.

Kernels are cached per padded batch size, so the ladder trades compilations against padded
(wasted) lanes. Up to 16 it is the powers of two; above, four steps per octave
(4, 5, 6, 7 times a power of two), so at most 25% of a large batch is padding where powers of
two alone waste up to 50% (measured: a 1515-leaf Tree-LSTM batch padded to 2048 instead of
1792).

Batches of small work take a coarser ladder, the powers of four (``coarse_bucket``): there
padding costs microseconds and each size saved is a compilation saved (``engine._lanes``).
"""


def bucket(n: int) -> int:
    """The padded size for ``n`` lanes (``n >= 1``)."""
    if n <= 16:
        b = 1
        while b < n:
            b *= 2
        return b
    shift = max(0, n.bit_length() - 3)  # n >> shift is in 4..7 (or 8 when rounding up)
    m = -(-n >> shift)  # ceil(n / 2**shift)
    return m << shift


def coarse_bucket(n: int) -> int:
    """The padded size for ``n`` lanes on the coarse ladder, the powers of four from 4: for
    batches whose padding costs next to nothing (``engine._lanes``)."""
    b = 4
    while b < n:
        b *= 4
    return b
