"""Optuna RDB storage from a URL: the embedded SQLite default, PostgreSQL for many workers.

A worker outlives short database outages: every storage call that fails for want of a
connection is retried with bounded exponential backoff, so a result computed during an outage
is written once the database is back rather than dropped. Passwords never leave this module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import random
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import optuna
import sqlalchemy
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

# Private names of Optuna's RDB storage, as its own setters use them: one session, many
# attributes (`ResilientRDBStorage.set_trial_user_attrs`; its test fails if they change).
from optuna.storages._rdb.models import TrialUserAttributeModel
from optuna.storages._rdb.storage import _create_scoped_session
from optuna.trial import TrialState
from sqlalchemy import exc as sa_exc

from hpo import interrupts
from hpo.errors import StorageError

DEFAULT_STORAGE = "sqlite:///hpo.db"
# How long a call waits for the database to come back before the worker gives up.
OUTAGE_SECONDS = 300.0
# How long a command waits for an unreachable database at start before exit code 2, unless
# HPO_STORAGE_WAIT says otherwise (a database that a deployment starts beside the workers).
START_SECONDS = 15.0
MAX_BACKOFF = 10.0

T = TypeVar("T")


def storage_url(option: str | None, from_file: str | None) -> str:
    """--storage, else HPO_STORAGE, else the study file, else the embedded SQLite file."""
    for candidate in (option, os.environ.get("HPO_STORAGE"), from_file):
        if candidate:
            return candidate
    return DEFAULT_STORAGE


def missing_sqlite_file(url: str) -> str | None:
    """The path of a SQLite storage file that does not exist, else None: reading it would
    create an empty database and report an empty storage instead of a mistyped path."""
    try:
        parsed = sqlalchemy.engine.make_url(url)
    except (sa_exc.ArgumentError, ValueError):
        return None
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return None
    return None if os.path.exists(database) else database


# scheme://user:password@host...: the password runs to the last "@", so one that holds an
# unencoded "@" or ":" (which SQLAlchemy cannot parse) is still hidden whole.
_CREDENTIALS = re.compile(r"^(?P<head>[^:/?#]+://[^:@/?#]*):(?P<password>.*)@(?P<tail>[^@]*)$")


def redact(url: str) -> str:
    """The URL with its password, if any, replaced by ***; never raises."""
    match = _CREDENTIALS.match(url)
    if match is None:
        return url
    return f"{match['head']}:***@{match['tail']}"


def _password(url: str) -> str | None:
    match = _CREDENTIALS.match(url)
    return match["password"] if match else None


def is_connection_error(exc: BaseException) -> bool:
    """True for errors that mean "the database is not reachable right now"."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, sa_exc.OperationalError | sa_exc.InterfaceError):
            return True
        if isinstance(seen, sa_exc.DBAPIError) and seen.connection_invalidated:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def retrying(call: Callable[[], T], *, seconds: float, what: str) -> T:
    """Run `call`, retrying connection errors with jittered exponential backoff."""
    deadline = time.monotonic() + seconds
    delay = 0.5
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_connection_error(exc) or time.monotonic() + delay > deadline:
                raise
            optuna.logging.get_logger("hpo").warning(
                "storage unreachable during %s; retrying in %.1fs", what, delay
            )
        time.sleep(delay * random.uniform(0.8, 1.2))
        delay = min(MAX_BACKOFF, delay * 2)


_retrying_here = threading.local()


class Contact:
    """Since when a storage has reached its database without a break. Every worker's
    heartbeats stop during an outage, so a reaper that was itself cut off must see a grace
    period of unbroken contact, in which every live worker beats again, before it judges."""

    def __init__(self) -> None:
        self.since = time.monotonic()
        self._broken = False

    def lost(self) -> None:
        self._broken = True

    def made(self) -> None:
        if self._broken:
            self.since, self._broken = time.monotonic(), False

    def unbroken_seconds(self) -> float:
        return 0.0 if self._broken else time.monotonic() - self.since


@contextlib.contextmanager
def single_attempt() -> Iterator[None]:
    """Storage calls of this thread, inside the block, try once and raise: for a caller
    that tries again on its own schedule, as the heartbeat does every interval."""
    _retrying_here.single = True
    try:
        yield
    finally:
        _retrying_here.single = False


def _resilient(method: Callable[..., Any]) -> Callable[..., Any]:
    """The method, retried as a whole through an outage. Only the outermost storage call of a
    thread retries: a public method calls private ones, and nested retries would multiply
    the wait."""

    @functools.wraps(method)
    def wrapper(self: ResilientRDBStorage, *args: Any, **kwargs: Any) -> Any:
        if getattr(_retrying_here, "active", False):
            return method(self, *args, **kwargs)
        _retrying_here.active, _retrying_here.attempts = True, 0

        def attempt() -> Any:
            _retrying_here.attempts += 1
            return method(self, *args, **kwargs)

        seconds = 0.0 if getattr(_retrying_here, "single", False) else self.outage_seconds
        try:
            return retrying(attempt, seconds=seconds, what=method.__name__)
        finally:
            _retrying_here.active = False
            # Out of the database code: a Ctrl-C or SIGTERM it held is raised here.
            interrupts.raise_held()

    return wrapper


def _note_error(contact: Contact, context: sqlalchemy.engine.ExceptionContext) -> None:
    if context.is_disconnect or is_connection_error(
            context.sqlalchemy_exception or context.original_exception):
        contact.lost()


class ResilientRDBStorage(RDBStorage):
    """RDBStorage whose calls wait out a database outage instead of failing the worker."""

    outage_seconds = OUTAGE_SECONDS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.contact = Contact()
        super().__init__(*args, **kwargs)
        # Every statement on the engine tells the contact, not only the retried storage calls:
        # the study lock and the budget count query it directly, and an idle worker does
        # nothing else. SQLAlchemy calls handle_error for failed connects too. The listeners
        # hold the contact, not the storage: SQLAlchemy's event registry keeps them, and
        # through the storage they would keep the engine and its connections alive.
        contact = self.contact
        sqlalchemy.event.listen(self.engine, "after_cursor_execute", lambda *_: contact.made())
        # A local SQLite file cannot be cut off; its errors ("database is locked") are not
        # lost contact.
        if self.engine.dialect.name != "sqlite":
            sqlalchemy.event.listen(self.engine, "handle_error",
                                    lambda context: _note_error(contact, context))
        _OPENED.add(self.engine)

    def trusts_heartbeats(self) -> bool:
        """True when this storage has been in unbroken contact for a grace period, so a
        trial whose heartbeat is older than that is dead, not cut off by an outage."""
        grace = self.grace_period or 2 * (self.heartbeat_interval or 0)
        return self.contact.unbroken_seconds() >= grace

    @_resilient
    def set_trial_state_values(self, trial_id: int, state: TrialState,
                               values: Sequence[float] | None = None) -> bool:
        try:
            return RDBStorage.set_trial_state_values(self, trial_id, state, values)
        except optuna.exceptions.UpdateFinishedTrialError:
            # An earlier attempt may have committed and lost its answer with the connection.
            if _retrying_here.attempts > 1 and self.get_trial(trial_id).state == state:
                return True
            raise

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        pending = getattr(_batching, "pending", None)
        if pending is not None:
            pending.setdefault((self, trial_id), {})[key] = value
            return
        self._set_trial_user_attr(trial_id, key, value)

    @_resilient
    def _set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        RDBStorage.set_trial_user_attr(self, trial_id, key, value)

    @_resilient
    def set_trial_user_attrs(self, trial_id: int, attrs: dict[str, Any]) -> None:
        """Several user attributes of a trial in one transaction: one commit where a commit
        each costs a trial tens of milliseconds an attribute on an SQLite file. Optuna has no
        such call; this one is built of its RDBStorage's private session helper and per-
        attribute write (tests/search/test_storage.py's batch test fails if either changes)."""
        with _create_scoped_session(self.scoped_session, True) as session:
            for key, value in attrs.items():
                self._set_trial_attr_without_commit(session, TrialUserAttributeModel, trial_id,
                                                    key, value)


_batching = threading.local()


@contextlib.contextmanager
def batched_user_attrs() -> Iterator[None]:
    """The trial user attributes this thread sets on a ResilientRDBStorage inside the block
    are written when it ends, each trial's in one transaction (`set_trial_user_attrs`), also
    when the block raises. Nested blocks write with the outermost. Attributes only: a trial's
    reports, state and parameters are written at once, as the pruner and the sampler read
    them."""
    if getattr(_batching, "pending", None) is not None:
        yield
        return
    _batching.pending = {}
    try:
        yield
    finally:
        pending, _batching.pending = _batching.pending, None
        for (storage, trial_id), attrs in pending.items():
            storage.set_trial_user_attrs(trial_id, attrs)


# Not storage calls: construction, pickling, settings, and helpers that work inside a
# session their caller opened (their caller is retried as a whole).
_LOCAL = {"__init__", "__getstate__", "__setstate__", "remove_session",
          "_build_frozen_trial_from_trial_model", "get_heartbeat_interval",
          "get_heartbeat_stale_trial_callback", "get_failed_trial_callback"}


# The engine of every storage this process opened, while anything still holds it. The engines,
# not the storages: a storage freed by its reference count leaves its engine and pool in
# SQLAlchemy's reference cycles, connections open.
_OPENED: weakref.WeakSet[sqlalchemy.Engine] = weakref.WeakSet()


def close_opened() -> None:
    """Close the pooled connections of every storage opened so far. A command's engines sit
    in reference cycles, so without this their server connections stay open until a garbage
    collection: in a long-lived process that calls `hpo.cli.main` (a notebook, a scheduler, a
    test run) that is a few idle connections per command against the server's shared
    max_connections. A storage used again afterwards opens a new connection."""
    for engine in list(_OPENED):
        engine.dispose()


def _storage_calls(cls: type) -> Iterator[str]:
    """Every method of the RDB storage that talks to the database, public or private:
    Optuna's `_CachedStorage` calls private ones (`_get_trials`, `_create_new_trial`,
    `_set_trial_param`, `_get_best_trial_id`, ...), and a list of names would fall behind."""
    for klass in reversed(cls.__mro__):
        for name, attribute in vars(klass).items():
            if (name in _LOCAL or not inspect.isfunction(attribute)
                    or "session" in inspect.signature(attribute).parameters):
                continue
            yield name


for _name in sorted(set(_storage_calls(RDBStorage)) - set(vars(ResilientRDBStorage))):
    setattr(ResilientRDBStorage, _name, _resilient(getattr(RDBStorage, _name)))


def retry_callback(max_retry: int) -> RetryHeartbeatStaleTrialCallback:
    """Optuna's re-queueing of a dead worker's trial, at most `max_retry` times."""
    with warnings.catch_warnings():
        # Experimental in Optuna 5; its documented way to retry a dead worker's trial.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RetryHeartbeatStaleTrialCallback(max_retry=max_retry)


def open_storage(
    url: str,
    *,
    heartbeat_interval: int | None = None,
    grace_period: int | None = None,
    max_retry: int = 2,
    start_seconds: float | None = None,
    storage_class: type[ResilientRDBStorage] = ResilientRDBStorage,
) -> ResilientRDBStorage:
    """Open (creating its tables if needed) the storage at `url`.

    Many workers may start at once on an empty database: creating the schema races, and the
    loser sees an integrity or programming error; it simply tries again. An unreachable
    database is tried again for `start_seconds` (default: `start_wait()`).
    """
    safe = redact(url)
    from_environment = start_seconds is None
    if start_seconds is None:
        start_seconds = start_wait()
    parsed = _parse(url, safe)
    resolved = with_installed_driver(parsed, safe)
    # The URL as written unless its driver was filled in; Optuna takes a string, so the
    # password goes back in (it is never printed: messages use `safe`).
    target = url if resolved is parsed else resolved.render_as_string(hide_password=False)
    engine_kwargs = _engine_kwargs(resolved)

    def build() -> ResilientRDBStorage:
        with warnings.catch_warnings():
            # Heartbeats and their retry callback are marked experimental in Optuna 5;
            # they are its documented way to reap dead workers' trials.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            callback = retry_callback(max_retry) if heartbeat_interval else None
            return storage_class(
                target, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_interval,
                grace_period=grace_period, heartbeat_stale_trial_callback=callback,
            )

    wait = _StartWait(safe, start_seconds, from_environment, (_password(url), parsed.password))
    try:
        return wait.retry(build)
    except ImportError as exc:
        # Optuna turns the driver's ImportError into "Failed to import DB access module for
        # the specified storage URL", which names neither the driver nor its package.
        message = missing_driver(safe, resolved, exc)
        if message is None:
            raise
        raise StorageError(message) from None


def _parse(url: str, safe: str) -> sqlalchemy.engine.URL:
    """The parsed URL, its dialect known to SQLAlchemy; else bad input naming the URL."""
    try:
        parsed = sqlalchemy.engine.make_url(url)
    except (sa_exc.ArgumentError, ValueError):
        hint = ("; write a password's special characters percent-encoded (@ as %40, : as %3A)"
                if _password(url) else "")
        raise StorageError(f"storage URL {safe} is not a database URL{hint}") from None
    try:
        parsed.get_dialect()
    except sa_exc.NoSuchModuleError:
        raise StorageError(
            f"storage URL {safe}: SQLAlchemy knows no database or driver "
            f"{parsed.drivername!r}; for PostgreSQL write postgresql://, "
            f"postgresql+psycopg2:// or postgresql+psycopg://") from None
    return parsed


# The drivers hpo knows per database, in the order a URL without one (postgresql://) tries
# them: the DBAPI module each imports and the pip requirement that installs it. psycopg2 comes
# first since hpo depends on psycopg2-binary; mysqldb is SQLAlchemy's default for mysql://.
_DRIVERS: dict[str, dict[str, tuple[str, str]]] = {
    "postgresql": {"psycopg2": ("psycopg2", "psycopg2-binary"),
                   "psycopg": ("psycopg", "'psycopg[binary]'")},
    "mysql": {"mysqldb": ("MySQLdb", "mysqlclient"), "pymysql": ("pymysql", "pymysql")},
}
# Drivers built on libpq, which take its keepalive and connect_timeout settings.
_LIBPQ = {"psycopg2", "psycopg", "psycopg2cffi"}


def _importable(module: str) -> bool:
    """Whether the driver module imports: one present but broken (psycopg 3 without a libpq
    to load) is as good as missing."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def with_installed_driver(parsed: sqlalchemy.engine.URL, safe: str) -> sqlalchemy.engine.URL:
    """`parsed` with a driver that is installed. SQLAlchemy fills in a URL's missing driver
    with its own default, which changed (postgresql:// is psycopg2 in SQLAlchemy 2.0 and
    psycopg 3 in 2.1) and need not be the one installed; hpo installs psycopg2. A URL that
    names its driver is returned as it is (the same object)."""
    backend = parsed.get_backend_name()
    drivers = _DRIVERS.get(backend)
    if drivers is None or "+" in parsed.drivername:
        return parsed
    for driver, (module, _) in drivers.items():
        if _importable(module):
            return parsed.set(drivername=f"{backend}+{driver}")
    wanted = " or ".join(requirement for _, requirement in drivers.values())
    raise StorageError(f"storage {safe}: no {backend} driver is installed; pip install {wanted}")


def missing_driver(safe: str, resolved: sqlalchemy.engine.URL, exc: ImportError) -> str | None:
    """One line: which driver the URL needs, the package that installs it, and the URL forms
    whose driver is installed; None for an ImportError that is not about the driver."""
    root: BaseException = exc
    while (deeper := root.__cause__ or root.__context__) is not None:
        root = deeper
    missing = isinstance(root, ModuleNotFoundError)
    if not missing and "DB access module" not in str(exc):
        return None
    backend, driver = resolved.get_backend_name(), resolved.get_driver_name()
    known = _DRIVERS.get(backend, {})
    if driver in known:
        module, requirement = known[driver]
        install = f"pip install {requirement}"
    else:
        module = getattr(root, "name", None) or driver
        install = f"install the package that provides {module}"
    if missing:
        problem = f"its driver {module} is not installed"
    else:  # present but broken, as psycopg 3 without a libpq to load
        problem = f"its driver {module} cannot be imported ({_scrub(str(root))})"
    others = [f"{backend}+{other}:// ({other_module} is installed)"
              for other, (other_module, _) in known.items()
              if other != driver and _importable(other_module)]
    instead = f", or use {' or '.join(others)}" if others else ""
    return f"storage {safe}: {problem}; {install}{instead}"


def _engine_kwargs(resolved: sqlalchemy.engine.URL) -> dict[str, Any]:
    if resolved.get_backend_name() == "sqlite":
        return {}
    # One connection kept between trials, so a fleet of N workers holds about N of the
    # server's max_connections; more while claiming (the study lock has its own) or while
    # a trial's heartbeat overlaps a write, each closed when returned. The overflow is
    # generous because a pool that runs dry waits 30 s and then fails the call.
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True, "pool_size": 1, "max_overflow": 4,
                                     "pool_recycle": 1800}
    if resolved.get_backend_name() == "postgresql" and resolved.get_driver_name() in _LIBPQ:
        # TCP keepalives: a worker learns of a server that vanished (a partition, a
        # failover) in about 25 s, instead of waiting on a dead socket for hours.
        engine_kwargs["connect_args"] = {
            "connect_timeout": 5, "keepalives": 1, "keepalives_idle": 10,
            "keepalives_interval": 5, "keepalives_count": 3,
        }
    return engine_kwargs


# A wait at start up to this long ends in its one-line error soon enough to pass in silence; a
# longer one says at once why the command is waiting.
QUIET_WAIT = 3.0


class _StartWait:
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
                detail = _scrub(_cause(exc), *self.passwords)
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
        # Printed, not logged: the storage layer sits below hpo's reporter, and a command's
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


def _scrub(message: str, *passwords: str | None) -> str:
    """The message's first line without the password, as written in the URL or decoded."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    for password in passwords:
        if password:
            first = first.replace(password, "***")
    return first
