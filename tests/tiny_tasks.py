"""Benchmark tasks at tiny sizes, for the tests that compare their models (nothing timed).

``TINY[name]`` is ``(task module, make_batches kwargs, DynaxModel kwargs)``. The importing
test puts the repository root on ``sys.path`` first (``benchmarks`` is not installed).
"""
from benchmarks.tasks import bilstm_synthetic, char_tagger, tagger, treelstm

TINY = {
    "tagger": (tagger, dict(vocab=50, n_tags=4, min_len=2, max_len=6),
               dict(vocab=50, emb=8, hid=6, mlp=5, n_tags=4)),
    "bilstm_synthetic": (bilstm_synthetic, dict(vocab=50, n_tags=4, length=4),
                         dict(vocab=50, emb=8, hid=6, n_tags=4)),
    "char_tagger": (char_tagger, dict(vocab=50, n_tags=4, n_chars=7, min_len=2, max_len=6,
                                      corpus_tokens=100),
                    dict(vocab=50, emb=8, hid=6, mlp=5, n_tags=4, n_chars=7, cemb=3)),
    "treelstm": (treelstm, dict(vocab=50, max_leaves=5), dict(vocab=50, emb=8, hid=6)),
}
