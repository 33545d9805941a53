"""Opening a storage at start: an unreachable database tried again for a while (a database that
a deployment starts beside the workers), and a one-line error in the database's own words,
without the password, with what to change where the server is full."""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import exc as sa_exc

from hpo.errors import StorageError
from hpo.search.resilience import is_connection_error

# How long a command waits for an unreachable database at start before exit code 2, unless
# HPO_STORAGE_WAIT says otherwise (a database that a deployment starts beside the workers).
START_SECONDS = 15.0

T = TypeVar("T")


# A wait at start up to this long ends in its one-line error soon enough to pass in silence; a
# longer one says at once why the command is waiting.
QUIET_WAIT = 3.0


class StartWait:
    """Opening a storage at start: an unreachable database is tried again until `seconds`
    have passed, saying so once on stderr when that is long enough to look like a hang."""

    def __init__(self, safe: str, seconds: float, from_environment: bool,
                 passwords: tuple[str | None, ...]) -> None:
        self.safe, self.seconds, self.passwords = safe, seconds, passwords
        self.from_environment = from_environment
        now = time.monotonic()
        self.deadline = now + seconds
        # Losing the race to create the schema is retried for the default wait even when
        # HPO_STORAGE_WAIT is shorter: the database is there, another worker is creating it.
        self.race_deadline = now + max(seconds, START_SECONDS)
        self.noted = False

    def retry(self, build: Callable[[], T]) -> T:
        attempt = 0
        while True:
            attempt += 1
            try:
                return build()
            except ImportError:
                raise
            except Exception as exc:
                racing = isinstance(exc, sa_exc.IntegrityError | sa_exc.ProgrammingError)
                limit = self.race_deadline if racing else self.deadline
                detail = scrub(_cause(exc), *self.passwords)
                if not (is_connection_error(exc) or racing) or time.monotonic() >= limit:
                    waited = f" after {attempt} attempts" if attempt > 1 else ""
                    raise StorageError(f"storage {self.safe} cannot be opened{waited}: "
                                       f"{detail}{_advice(detail)}") from None
                if not racing:
                    self._note(detail)
            # Never past the deadline: the last attempt comes when the wait is up, not seconds
            # later.
            pause = min(2.0, 0.2 * attempt) * random.uniform(0.5, 1.5)
            time.sleep(max(0.0, min(pause, limit - time.monotonic())))

    def _note(self, detail: str) -> None:
        if self.noted or self.seconds <= QUIET_WAIT:
            return
        self.noted = True
        # Printed, not logged: the storage layer sits below hpo's display, and a command's
        # warnings all read "hpo: warning: ..." on stderr.
        setting = " (HPO_STORAGE_WAIT sets how long)" if self.from_environment else ""
        print(f"hpo: warning: storage {self.safe} unreachable ({_reason(detail)}); retrying "
              f"for {self.seconds:g} s{setting}", file=sys.stderr, flush=True)


def _reason(detail: str) -> str:
    """The driver's reason without libpq's preamble: 'connection to server at "HOST", port
    5432 failed: Connection refused' -> 'connection refused'."""
    reason = detail.rsplit(" failed: ", 1)[-1].strip()
    return reason[:1].lower() + reason[1:]


def start_wait() -> float:
    """HPO_STORAGE_WAIT seconds, else START_SECONDS."""
    text = os.environ.get("HPO_STORAGE_WAIT", "").strip()
    if not text:
        return START_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise StorageError(f"HPO_STORAGE_WAIT={text!r}: expected a number of seconds, 0 or more")
    return seconds


def _cause(exc: BaseException) -> str:
    """The database's own words: Optuna wraps a failed commit in "An exception is raised
    during the commit", which hides why (a full server, a refused login)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, sa_exc.DBAPIError) and seen.orig is not None:
            return str(seen.orig)
        seen = seen.__cause__ or seen.__context__
    return str(exc)


# PostgreSQL's words when every connection its max_connections allows is taken.
_FULL = ("too many clients", "remaining connection slots are reserved")


def _advice(detail: str) -> str:
    if not any(words in detail for words in _FULL):
        return ""
    return ("; every connection the server allows is taken: each worker holds one between "
            "trials and up to three while it claims one, and a fleet starting at once up to "
            "1.5 per worker; raise the server's max_connections to 1.5 x workers + 10, or run "
            "fewer workers")


def scrub(message: str, *passwords: str | None) -> str:
    """The message's first line without the password, as written in the URL or decoded."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    for password in passwords:
        if password:
            first = first.replace(password, "***")
    return first
