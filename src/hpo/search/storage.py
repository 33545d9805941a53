"""Optuna RDB storage from a URL: the embedded SQLite default, PostgreSQL for many workers;
which driver a URL gets and how its engine is set up. The storage's calls outlive outages
(`resilience`); opening one waits for its database a while (`storage_start`). Passwords never
leave these three modules: messages show URLs through `redact`.
"""

from __future__ import annotations

import importlib
import os
import re
import warnings
from typing import Any

import optuna
import sqlalchemy
from sqlalchemy import exc as sa_exc

from hpo.errors import StorageError
from hpo.search.liveness import RetryFromScratch
from hpo.search.resilience import ResilientRDBStorage
from hpo.search.storage_start import StartWait, scrub, start_wait

DEFAULT_STORAGE = "sqlite:///hpo.db"


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


def retry_callback(max_retry: int) -> RetryFromScratch:
    """Optuna's re-queueing of a dead worker's trial, at most `max_retry` times."""
    with warnings.catch_warnings():
        # Experimental in Optuna 5; its documented way to retry a dead worker's trial.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RetryFromScratch(max_retry=max_retry)


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

    wait = StartWait(safe, start_seconds, from_environment, (_password(url), parsed.password))
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
        problem = f"its driver {module} cannot be imported ({scrub(str(root))})"
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
