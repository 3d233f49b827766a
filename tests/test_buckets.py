"""The padding ladder: never smaller than n, at most 20% padding above 16 (12.5% above
512), few sizes."""
from dynax.executor.buckets import bucket, coarse_bucket


def test_bucket_ladder():
    sizes = [bucket(n) for n in range(1, 10000)]
    assert all(b >= n for n, b in zip(range(1, 10000), sizes))
    assert all((b - n) / b <= 0.2 for n, b in zip(range(17, 10000), sizes[16:]))
    assert all((b - n) / b <= 0.125 for n, b in zip(range(513, 10000), sizes[512:]))
    assert [bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 512, 513, 1300, 1515)] == \
        [1, 2, 4, 8, 16, 20, 40, 512, 576, 1408, 1536]
    # powers of two to 16, then 4 per octave to 512, then 8
    assert len(set(sizes)) <= 5 + 4 * 5 + 8 * 5
    assert all(bucket(b) == b for b in set(sizes))  # idempotent: a ladder


def test_coarse_ladder():
    """Powers of four from 4: for batches whose padding costs next to nothing."""
    sizes = [coarse_bucket(n) for n in range(1, 5000)]
    assert all(b >= n for n, b in zip(range(1, 5000), sizes))
    assert all(b < 4 * n for n, b in zip(range(2, 5000), sizes[1:]))
    assert sorted(set(sizes)) == [4, 16, 64, 256, 1024, 4096, 16384]
    assert all(coarse_bucket(b) == b for b in set(sizes))
