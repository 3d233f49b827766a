"""Ctrl-C held over the steps that update buffers in place.

A trainer's step and the backward kernels take their buffers donated (parameter values and
optimizer state; gradient buffers): XLA writes the results over them, and the old arrays are
deleted as the call starts. A ``KeyboardInterrupt`` that lands between that call and the
line that stores its results leaves the parameter holding a deleted array, and the model is
lost (it can no longer be read or saved). So within these steps SIGINT is held and raised as
soon as they end: the interrupt still arrives, with the model whole.
"""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupts_held():
    """Hold SIGINT until the block ends, then deliver it to the handler that was in place.

    Only the main thread receives signals in Python, so elsewhere (and where SIGINT is
    ignored or left to the OS) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            previous(*held[0])  # the default handler raises KeyboardInterrupt here
