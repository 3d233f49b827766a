"""Where parameters live and kernels run: ``dx.set_device``, ``dx.set_cpu_threads``,
``dx.set_xla_thread_nice``, ``dx.set_compilation_cache``."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

_device: jax.Device | None = None


def set_device(device) -> jax.Device:
    """Select the device for parameters created afterwards and for graph arenas.

    A change ends this thread's current graph (its values are on the old device: its
    expressions raise ``StaleExpressionError``); another thread's graph that has values is
    refused when it next computes, and that thread's next graph uses the new device.
    Parameters made before stay where they are: make them after selecting the device.

    Args:
      device: ``"cpu"``, ``"gpu"``, ``"tpu"`` or a ``jax.Device``.
    Returns:
      the selected ``jax.Device``.
    """
    global _device
    if isinstance(device, str):
        try:
            new = jax.devices(device)[0]
        except RuntimeError as e:
            raise ValueError(f"set_device: no {device!r} device is available ({e})") from None
    elif isinstance(device, jax.Device):
        new = device
    else:
        raise TypeError(f"set_device: expected 'cpu', 'gpu', 'tpu' or a jax.Device, got {device!r}")
    old = get_device()
    if new != old:
        # this thread's graph holds its values on the old device: it ends (other threads'
        # graphs are refused when they next compute, and their next graphs use the new one)
        from .graph.computation_graph import retire_current_graph
        retire_current_graph(f"whose values are on {old}, before dx.set_device({new})")
    _device = new
    return _device


def get_device() -> jax.Device:
    """The device selected by ``set_device`` (JAX's default device if none was)."""
    return _device if _device is not None else jax.devices()[0]


def set_cpu_threads(n: int) -> None:
    """Run XLA:CPU kernels on ``n`` threads (its intra-op pool; default: one per core).

    Call it before the first JAX computation of the process: XLA reads the setting (the
    ``PJRT_NPROC`` environment variable, which this sets) when it creates its CPU client.

    Which is faster depends on the model. Graphs of many small kernels run faster on one
    thread: splitting a small product or copy across threads costs more than it saves,
    and the second thread competes with the Python thread building the next graph.
    Large products want every core. Measured on a 2-core CPU, ``n=1`` against the
    default: BiLSTM tagger, tagger with character BiLSTM and transition parser 13-22%
    faster per update, and the ListOps demo's Tree-LSTM (hidden 64) 20% more updates in
    its time budget; the benchmark's Tree-LSTM (hidden 150) 10%, synthetic BiLSTM
    (1024-row gates) 39% and RNN LM (10,000-word softmax) 74% slower per update, and the
    hand-batched JAX baselines of the first three 11-37% slower.

    Raises:
      ValueError: ``n`` is not a positive integer.
      RuntimeError: JAX has already created its backends, so the setting cannot apply.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"set_cpu_threads: expected a positive integer, got {n!r}")
    if _backends_initialized():
        raise RuntimeError(
            "set_cpu_threads: JAX's backends already exist, so the thread count can no "
            "longer change; call it before the first JAX computation (or set the "
            "environment variable PJRT_NPROC before starting Python)")
    os.environ["PJRT_NPROC"] = str(int(n))


XLA_THREAD_NICE = 5  # the default of set_xla_thread_nice
_xla_nice = {"levels": XLA_THREAD_NICE, "applied": False}


def set_xla_thread_nice(levels: int) -> None:
    """Run XLA:CPU's kernel threads at a nice value ``levels`` above the Python thread's,
    i.e. at a lower priority (0 to 19; default 5, set when dynax first computes on the CPU).

    Why: dynax's Python thread builds each graph, schedules it and launches its kernels,
    while XLA's threads (one per core) run the kernels launched before. Where the machine
    has no more cores than those threads, the OS shares the cores evenly among all of
    them, so the Python thread, which the next kernels wait for, gets a fraction of a core.
    Nicer kernel threads leave it a whole core whenever it has work, and take every core
    while it waits. Measured on a 2-core CPU, level 5 against 0 alternated in one process
    (``benchmarks/RESULTS.md``, session 43): BiLSTM tagger, char tagger and transition
    parser 8-11% less time per update; Tree-LSTM, RNN LM and synthetic BiLSTM, whose
    kernels are the critical path, within noise; hand-batched JAX steps within noise
    (-6% to +7%). Niced with them, XLA's other threads (unnamed) made it worse.
    Higher levels favour the Python thread more, at the kernels' cost (session 54, 5 / 10
    / 19 alternated): tagger 1-10% and parser 5% faster at 10; the Tree-LSTM's median
    update -1 to +5% at 10 and +4 to +10% at 19, but some updates stall as kernel threads
    starve (its mean 15-18% slower in 2 of 3 runs at 19, once at 10); synthetic BiLSTM
    8-13% slower. A model whose Python work bounds each update may gain from 10; one
    whose kernels do loses.
    With more cores than threads it changes nothing. Linux only: elsewhere, or where XLA
    does not name its threads ``tf_XLAEigen``, nothing is changed.

    Lowering a thread's priority needs no privilege; raising it again (a smaller ``levels``
    after a larger one was applied) needs ``CAP_SYS_NICE``: choose before the first
    computation.

    Raises:
      ValueError: ``levels`` is not an int in [0, 19].
      RuntimeError: the threads' priority would rise and the process may not raise it.
    """
    if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)) \
            or not 0 <= levels <= 19:
        raise ValueError(f"set_xla_thread_nice: expected an int in [0, 19], got {levels!r}")
    _xla_nice["levels"] = int(levels)
    if _xla_nice["applied"]:
        _renice_xla_threads(strict=True)


def xla_thread_nice() -> int:
    """The levels ``set_xla_thread_nice`` chose (the default until it is called)."""
    return _xla_nice["levels"]


def yield_xla_threads() -> None:
    """Give XLA:CPU's kernel threads the nice value ``set_xla_thread_nice`` chose, once per
    process (the engine calls it when it first computes on a CPU device). Never raises:
    a scheduling hint must not fail a computation."""
    if not _xla_nice["applied"]:
        _xla_nice["applied"] = True
        _renice_xla_threads(strict=False)


def _renice_xla_threads(strict: bool) -> None:
    if not hasattr(os, "setpriority"):
        return
    # on Linux, PRIO_PROCESS 0 is the calling thread: the levels count from its nice value
    target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + _xla_nice["levels"])
    for tid in xla_kernel_threads():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
        except PermissionError:
            if strict:
                raise RuntimeError(
                    f"set_xla_thread_nice: raising XLA's kernel threads back to nice {target} "
                    "needs CAP_SYS_NICE; choose the level before dynax's first computation"
                ) from None
        except OSError:  # the thread has ended
            continue


def xla_kernel_threads() -> list:
    """The thread ids of XLA:CPU's kernel threads (its intra-op pool, which XLA names
    ``tf_XLAEigen``); empty where Linux's ``/proc`` is not there."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("tf_XLAEigen"):
                    found.append(int(tid))
        except OSError:  # the thread has ended
            continue
    return found


def _backends_initialized() -> bool:
    try:
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:  # a JAX without it: the setting is made, and applies if in time
        return False
    return backends_are_initialized()


def set_compilation_cache(path) -> str:
    """Keep compiled kernels on disk under ``path``, so later processes load them instead of
    compiling them again (a new process otherwise compiles every batch kernel anew).

    This is JAX's persistent compilation cache with its threshold set for dynax: by default
    JAX stores only programs that took at least one second to compile, and dynax's batch
    kernels take ~0.1-0.5 s each, so it would store none of them. Measured on a 2-core CPU,
    the BiLSTM tagger's first 5 updates (110 kernels): 29 s in a fresh process, 4.5 s in
    the next one. Loads are not compilations: ``cg.stats()`` counts them as
    ``cache_loads``. Use a directory only you can write to: JAX runs what it loads from it.

    Call it before the process's first JAX compilation that should be stored; JAX opens
    the cache at its first compilation after a directory is set, and keeps it.

    Returns:
      the absolute path of the cache directory (created here if it does not exist).
    Raises:
      ValueError: ``path`` is not a path, or not a directory that can be created and
        written (JAX would only warn at its first compilation, and cache nothing).
      RuntimeError: JAX already opened a cache in another directory in this process.
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"set_compilation_cache: expected a directory path, got {path!r}")
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"set_compilation_cache: cannot create the directory {path!r} "
                         f"({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"set_compilation_cache: cannot write to the directory {path!r}")
    current = jax.config.jax_compilation_cache_dir
    if _cache_opened() and current and os.path.abspath(current) != path:
        raise RuntimeError(
            f"set_compilation_cache: JAX already uses the compilation cache in {current!r} "
            "in this process and cannot switch to another; call it before the first JAX "
            "compilation")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def _cache_opened() -> bool:
    """Whether JAX has opened its persistent cache (private state; False where unknown)."""
    try:
        from jax._src import compilation_cache
    except ImportError:
        return False
    return bool(getattr(compilation_cache, "_cache_initialized", False))


_ZEROS: dict = {}  # (device, shape, dtype) -> jitted fill


def zeros(shape, dtype) -> jax.Array:
    """A new zero array on the selected device.

    A cached jitted fill: eager ``jnp.zeros`` costs ~0.33 ms of host time per call (JAX
    0.10, CPU), the cached kernel ~0.03 ms, and gradient buffers are made every update.
    """
    device = get_device()
    key = (device, tuple(shape), np.dtype(dtype))
    fill = _ZEROS.get(key)
    if fill is None:
        fill = _ZEROS[key] = jax.jit(lambda: jnp.zeros(key[1], key[2]),
                                     out_shardings=SingleDeviceSharding(device))
    return fill()
