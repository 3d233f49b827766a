"""``benchmarks.xla_ops``: the per-operation self times it prints, from XLA:CPU's thunk events."""
import jax
import jax.numpy as jnp
import pytest

from benchmarks import xla_ops


def _event(module, op, ts, dur, tid=1):
    return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"hlo_module": module, "hlo_op": op}}


def test_self_time_is_duration_less_direct_children_and_families_drop_sizes():
    events = [
        _event("jit_cell_fwd_B64_T8", "while.2", 0, 100),  # a loop: its body runs inside
        _event("jit_cell_fwd_B64_T8", "ynn_fusion.1", 10, 30),
        _event("jit_cell_fwd_B64_T8", "ynn_fusion.3", 50, 20),
        _event("jit_cell_fwd_B32", "ynn_fusion", 200, 40),
        _event("jit_cell_fwd_B64_T8", "wrapped_add.7", 5, 50, tid=2),  # another thread
        _event("jit__apply", "multiply_add_fusion.3", 300, 25),
    ]
    family, own, calls = xla_ops.self_times(events)
    assert family == {"jit_cell_fwd": 100 + 40 + 50, "jit__apply": 25}
    assert own[("jit_cell_fwd", "while")] == 100 - 30 - 20
    assert own[("jit_cell_fwd", "ynn_fusion")] == 30 + 20 + 40
    assert calls[("jit_cell_fwd", "ynn_fusion")] == 3
    assert own[("jit_cell_fwd", "wrapped_add")] == 50
    assert own[("jit__apply", "multiply_add_fusion")] == 25


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="XLA:CPU's thunk events")
def test_the_profiler_reports_xla_cpu_thunks_by_kernel_and_operation():
    """The JAX in use still names each thunk's kernel and operation at tracer level 3."""
    f = jax.jit(lambda a, b: jnp.tanh(a @ b) + 1.0)
    a = jnp.ones((64, 64))
    f(a, a).block_until_ready()
    family, own, _ = xla_ops.self_times(xla_ops.traced_events(
        lambda: f(a, a).block_until_ready()))
    assert "jit__lambda" in family and family["jit__lambda"] > 0
    assert any(name == "jit__lambda" for name, _ in own)


def test_busy_threads_counts_outermost_thunks_running_at_once():
    events = [
        _event("jit_a", "while.1", 0, 100),  # thread 1: a loop and its body
        _event("jit_a", "ynn_fusion.2", 10, 30),
        _event("jit_b", "fusion.3", 150, 50),  # thread 1 again, after a 50 us gap
        _event("jit_c", "fusion.4", 80, 40, tid=2),  # thread 2 overlaps both: 80-120
    ]
    busy, span = xla_ops.busy_threads(events)
    assert span == 200
    # 0-80 thread 1; 80-100 both; 100-120 thread 2; 120-150 none; 150-200 thread 1
    assert busy == {1: 80 + 20 + 50, 2: 20, 0: 30}
