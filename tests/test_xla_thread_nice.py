"""``dx.set_xla_thread_nice``: XLA:CPU's kernel threads run nicer than the Python thread
once dynax computes on the CPU, by the levels chosen, counted from the Python thread's own
nice value; bad levels are rejected, and a rise the process may not make is reported.

The thread priorities are read in fresh subprocesses (Linux ``/proc``): this test process's
threads were reniced by whichever test computed first.
"""
import json
import os
import textwrap

import pytest

import dynax as dx
from dynax import device

from cpu_child import run_cpu_child

CHILD = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import dynax as dx
    from dynax.device import xla_kernel_threads
    base, levels, later = (None if a == "-" else int(a) for a in sys.argv[1:4])
    if base is not None:
        os.nice(base)  # this thread, before XLA starts the threads it then inherits from
    if levels is not None:
        dx.set_xla_thread_nice(levels)
    import jax
    jax.block_until_ready(jax.numpy.ones(3) + 1)  # XLA's threads exist, dynax ran nothing

    def nices():
        return sorted({os.getpriority(os.PRIO_PROCESS, t) for t in xla_kernel_threads()})

    before = nices()
    dx.renew_cg()
    dx.tanh(dx.input(np.ones(3, np.float32))).value()
    after = nices()
    if later is not None:
        dx.set_xla_thread_nice(later)
    own = os.getpriority(os.PRIO_PROCESS, 0)
    print(json.dumps([len(xla_kernel_threads()), own, before, after, nices()]))
""")


def _run(base=None, levels=None, later=None):
    """(the child's Python thread's nice; its kernel threads' nice values before dynax
    computes, after, and after the ``later`` call)."""
    out = run_cpu_child(CHILD, *("-" if a is None else a for a in (base, levels, later)))
    n, *figures = json.loads(out.strip().splitlines()[-1])
    if n == 0:
        pytest.skip("this jaxlib does not name its kernel threads tf_XLAEigen")
    return figures


def _niced(own, levels):
    return [min(19, own + levels)]


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


@needs_proc
def test_kernel_threads_yield_once_dynax_computes():
    own, before, after, later = _run(later=9)  # own: this machine may run the tests niced
    assert before == [own]  # JAX alone leaves them as they were
    assert after == _niced(own, device.XLA_THREAD_NICE)
    assert later == _niced(own, 9)  # a further lowering applies at once


@needs_proc
def test_levels_count_from_the_python_threads_nice():
    own, before, after, _ = _run(base=3, levels=4)
    assert before == [own]  # 3 more than the test process's
    assert after == _niced(own, 4)


@needs_proc
def test_level_zero_chosen_first_leaves_them_alone():
    own, before, after, _ = _run(levels=0)
    assert before == after == [own]


@pytest.mark.parametrize("bad", [-1, 20, 2.0, "5", True, None])
def test_bad_levels_are_rejected(bad):
    with pytest.raises(ValueError, match=r"int in \[0, 19\]"):
        dx.set_xla_thread_nice(bad)


def _refusing_rises(monkeypatch, applied: bool):
    """One kernel thread at nice 5, and a process that may not raise a thread's priority."""
    monkeypatch.setitem(device._xla_nice, "applied", applied)
    monkeypatch.setitem(device._xla_nice, "levels", device._xla_nice["levels"])
    monkeypatch.setattr(device, "xla_kernel_threads", lambda: [12345])
    monkeypatch.setattr(os, "getpriority", lambda which, who: 0 if who == 0 else 5)
    calls = []

    def refused(which, who, nice):
        calls.append((who, nice))
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refused)
    return calls


def test_a_rise_the_process_may_not_make_is_reported(monkeypatch):
    calls = _refusing_rises(monkeypatch, applied=True)
    with pytest.raises(RuntimeError, match="CAP_SYS_NICE"):
        dx.set_xla_thread_nice(2)
    assert calls == [(12345, 2)]


def test_the_engines_call_never_raises(monkeypatch):
    calls = _refusing_rises(monkeypatch, applied=False)
    monkeypatch.setitem(device._xla_nice, "levels", 1)
    device.yield_xla_threads()  # refused, and quiet about it: a hint must not fail a run
    assert calls == [(12345, 1)]
    assert device._xla_nice["applied"]
    device.yield_xla_threads()  # once per process
    assert calls == [(12345, 1)]
