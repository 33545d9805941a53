"""Ctrl-C and SIGTERM stop a command by an exception in its main thread, raised wherever that
thread is, as Python's own Ctrl-C is: a worker unwinds and frees its running trial at once.

The rule: never inside the database code (SQLAlchemy, Optuna's RDB storage, the drivers), nor
in a finalizer. An exception raised between two of SQLAlchemy's bytecodes can leave a
connection checked out with its transaction open: a SQLite file then stays locked, and the
worker's own freeing of its trial fails on it (the busy timeout, then the storage's retries);
one raised in a finalizer or a weak reference's callback is printed and dropped, and the
worker goes on as if never stopped. A signal that arrives in either is held, and raised at
the first of:
- `raise_held()`, which the storage calls as each of its calls ends, outside that code;
- a look every RECHECK_SECONDS (SIGALRM, while a signal is held) that finds the thread
  outside both, for the paths that reach the database some other way.

A handler runs as soon as the blocking call it interrupted returns, so a signal that comes
while the thread waits on the database is almost always handled just inside SQLAlchemy; the
look alone could wait long in a loop of database calls: both are needed. The wait is one
database call: bounded by the driver's timeouts, not by an outage, whose retries sleep
outside that code.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from hpo.errors import Terminated

# Modules whose frames an exception must not cut through: a name, or a package and its
# submodules.
DATABASE_MODULES = ("sqlalchemy", "optuna.storages._rdb", "psycopg2", "sqlite3")
# Where Python prints an exception and drops it ("Exception ignored in"): a finalizer, a
# weak reference's callback run by the garbage collector wherever the thread was. A stop
# raised there would be lost.
_FINALIZER_MODULES = ("weakref", "_weakrefset")
RECHECK_SECONDS = 0.02
_STOPS = (signal.SIGINT, signal.SIGTERM)


class _State:
    held: int | None = None  # a signal received in database code, not raised yet
    alarm: Any = None  # SIGALRM's handler before the look took it


def in_database_code(frame: FrameType | None) -> bool:
    """Whether the thread whose innermost frame this is runs database code (any frame of
    its stack in DATABASE_MODULES)."""
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if any(name == m or name.startswith(m + ".") for m in DATABASE_MODULES):
            return True
        frame = frame.f_back
    return False


def _must_wait(frame: FrameType | None) -> bool:
    if frame is not None and (frame.f_code.co_name == "__del__"
                              or frame.f_globals.get("__name__") in _FINALIZER_MODULES):
        return True
    return in_database_code(frame)


def _exception(signum: int) -> BaseException:
    return Terminated("SIGTERM") if signum == signal.SIGTERM else KeyboardInterrupt()


def raise_held() -> None:
    """Raise the signal held in database code, if any: for a caller that has just left it.
    Anywhere but the main thread it does nothing (a handler only holds for that thread)."""
    if _State.held is None or threading.current_thread() is not threading.main_thread():
        return
    signum = _State.held
    _release()
    raise _exception(signum)


def _hold(signum: int) -> None:
    if _State.held is None:
        _State.held = signum
        _State.alarm = signal.signal(signal.SIGALRM, _look)
    signal.setitimer(signal.ITIMER_REAL, RECHECK_SECONDS)


def _release() -> None:
    if _State.held is not None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        # None: a handler set outside Python, which cannot be put back; the default then.
        signal.signal(signal.SIGALRM,
                      signal.SIG_DFL if _State.alarm is None else _State.alarm)
        _State.held, _State.alarm = None, None


def _look(_signum: int, frame: FrameType | None) -> None:
    if _State.held is None:
        return
    if _must_wait(frame):
        signal.setitimer(signal.ITIMER_REAL, RECHECK_SECONDS)
    else:
        raise_held()


def _stop(signum: int, frame: FrameType | None) -> None:
    if _must_wait(frame):
        _hold(signum)
        return
    _release()
    raise _exception(signum)


@contextlib.contextmanager
def raised_outside_the_database() -> Iterator[None]:
    """While the block runs, Ctrl-C raises KeyboardInterrupt and SIGTERM raises
    errors.Terminated, each outside the database code (the rule above). Outside the main
    thread, where no handler can be set, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _stop) for s in _STOPS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _release()
