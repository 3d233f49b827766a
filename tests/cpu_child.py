"""A fresh CPU-only Python process for tests that read what XLA:CPU's threads look like
(their count, their priority): this test process's threads were set up by earlier tests."""
import os
import subprocess
import sys


def run_cpu_child(code: str, *args) -> str:
    """The stdout of ``python -c code args...`` under JAX's CPU backend, without the thread
    count variables of this process (``PJRT_NPROC``, ``NPROC``); its failure fails the test."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout
