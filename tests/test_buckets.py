"""The padding ladder: never smaller than n, at most 20% padding above 16, few sizes."""
from dynax.executor.buckets import bucket, coarse_bucket


def test_bucket_ladder():
    sizes = [bucket(n) for n in range(1, 10000)]
    assert all(b >= n for n, b in zip(range(1, 10000), sizes))
    assert all((b - n) / b <= 0.2 for n, b in zip(range(17, 10000), sizes[16:]))
    assert [bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 1515)] == [1, 2, 4, 8, 16, 20, 40, 1536]
    assert len(set(sizes)) <= 5 + 4 * 10  # powers of two to 16, then 4 per octave
    assert all(bucket(b) == b for b in set(sizes))  # idempotent: a ladder


def test_coarse_ladder():
    """Powers of four from 4: for batches whose padding costs next to nothing."""
    sizes = [coarse_bucket(n) for n in range(1, 5000)]
    assert all(b >= n for n, b in zip(range(1, 5000), sizes))
    assert all(b < 4 * n for n, b in zip(range(2, 5000), sizes[1:]))
    assert sorted(set(sizes)) == [4, 16, 64, 256, 1024, 4096, 16384]
    assert all(coarse_bucket(b) == b for b in set(sizes))
