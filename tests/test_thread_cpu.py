"""``benchmarks.thread_cpu``: each thread's CPU time per update, from Linux's ``/proc``."""
import os
import threading
import time

import pytest

from benchmarks import thread_cpu


def test_per_update_divides_each_threads_cpu_and_counts_new_threads_from_zero():
    before = {1: ("python", 0, 2.0), 2: ("tf_XLAEigen", 5, 1.0), 3: ("python", 0, 0.5)}
    after = {1: ("python", 0, 3.0), 2: ("tf_XLAEigen", 5, 1.0), 4: ("python", 0, 0.2)}
    # thread 3 ended (left out), 2 spent nothing (left out), 4 started in between
    assert thread_cpu.per_update(before, after, 10) == [("python", 0, 1, 100.0),
                                                        ("python", 0, 4, 20.0)]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux's /proc")
def test_thread_times_sees_a_busy_thread_and_its_nice_value():
    spin = {"stop": False}

    def busy():
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 3)
        while not spin["stop"]:
            pass

    t = threading.Thread(target=busy, name="busy")
    t.start()
    try:
        first = thread_cpu.thread_times()
        time.sleep(0.3)
        rows = thread_cpu.per_update(first, thread_cpu.thread_times(), 1)
        tid = t.native_id
    finally:
        spin["stop"] = True
        t.join()
    row = next(r for r in rows if r[2] == tid)
    assert row[1] == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)  # its own nice value
    assert row[3] >= 30.0  # of its 300 ms, in 10 ms ticks, on a machine busy with other tests
    assert os.getpid() in thread_cpu.thread_times()  # the main thread is listed too
