"""Ctrl-C for the commands that promise a partial result on it, however they were started."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def ctrl_c_interrupts() -> Iterator[None]:
    """Make SIGINT raise KeyboardInterrupt for the block, even where it was inherited as ignored.

    A shell without job control starts background commands (`cmd &` in a script, CI steps, test
    runners started that way) with SIGINT ignored, and Python keeps an ignored SIGINT ignored; a
    replay, a demo or a profile run started so would then run to its end through `kill -INT`. The
    commands that promise a partial report on Ctrl-C take it explicitly, as the node does, and give
    the old handling back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread (CliRunner in a worker thread)
        return
    old = signal.getsignal(signal.SIGINT)
    if old is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if old is signal.SIG_IGN:
            signal.signal(signal.SIGINT, old)
