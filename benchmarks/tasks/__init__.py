"""Benchmark tasks: one module per workload, all to one interface (see ``benchmarks.harness``).

A task module defines ``NAME``, ``UNIT``, ``BATCH``, ``LR``, ``make_batches``, ``DynaxModel``
(per-instance dynax code) and ``HandModel`` (a hand-batched JAX baseline, or ``None``);
``BATCH_SIZES`` optionally runs it at several batch sizes. Tasks are imported by name
(``benchmarks.harness.load_task``), so a missing module only skips that task.
"""

TASKS = ("bilstm_synthetic", "tagger", "char_tagger", "treelstm", "rnnlm", "parser")
