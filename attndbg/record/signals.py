"""Signals in ring mode (`attndbg record --ring K`), installed by the startup hook in every process:
SIGUSR1 writes the ring now; SIGTERM and SIGHUP, whose default action ends a process without
running atexit, first leave the ring for `record` (spool.py), then end the process as the default
action would (its exit status stays "killed by SIGTERM").

Torch-free on purpose: the startup hook runs in every Python process of the command, most of which
never record. A handler finds the process's session only if the recorder was imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

TERMINATE_WAIT_SECONDS = 20.0  # how long a SIGTERM'd process may spend leaving its ring


def _session() -> Any:
    module = sys.modules.get("attndbg.record.session")
    return getattr(module, "_SESSION", None) if module is not None else None


def _on_usr1(signum: int, frame: Any) -> None:
    session = _session()
    if session is not None and session.flight is not None:
        from attndbg.record.triggers import Trigger, TriggerKind

        session.flight.request(Trigger(kind=TriggerKind.SIGNAL, step=session.last_step, message="SIGUSR1: write the ring now", code=signum))


def _on_terminate(signum: int, frame: Any) -> None:
    session = _session()
    if session is not None:
        # On a thread of its own, bounded: the handler may have interrupted this thread inside one
        # of the session's locks, and a process asked to end must end.
        closing = threading.Thread(target=session.close, name="attndbg-close-on-signal", daemon=True)
        closing.start()
        closing.join(TERMINATE_WAIT_SECONDS)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install() -> None:
    """Where the process left the default action (an engine's own handler is never replaced) and on
    the main thread only (Python's rule)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in ((signal.SIGUSR1, _on_usr1), (signal.SIGTERM, _on_terminate), (signal.SIGHUP, _on_terminate)):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, handler)
