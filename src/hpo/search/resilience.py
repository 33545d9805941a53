"""A storage that outlives short database outages: every storage call that fails for want of a
connection is retried with bounded exponential backoff, so a result computed during an outage
is written once the database is back rather than dropped; and what the reaper needs to know of
its own contact with the database."""

from __future__ import annotations

import contextlib
import functools
import inspect
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import optuna
import sqlalchemy
from optuna.storages import RDBStorage

# Private names of Optuna's RDB storage, as its own setters use them: one session, many
# attributes (`ResilientRDBStorage.set_trial_user_attrs`; its test fails if they change).
from optuna.storages._rdb.models import TrialUserAttributeModel
from optuna.storages._rdb.storage import _create_scoped_session
from optuna.trial import TrialState
from sqlalchemy import exc as sa_exc

from hpo import interrupts

# How long a call waits for the database to come back before the worker gives up.
OUTAGE_SECONDS = 300.0
# The longest wait between two tries, where the study's heartbeat interval is not shorter
# (`most_backoff`).
MAX_BACKOFF = 10.0

T = TypeVar("T")


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


def retrying(call: Callable[[], T], *, seconds: float, what: str,
             most: float = MAX_BACKOFF) -> T:
    """Run `call`, retrying connection errors with jittered exponential backoff, waiting at
    most `most` seconds (give or take the jitter) between two tries."""
    deadline = time.monotonic() + seconds
    delay = min(0.5, most)
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
        delay = min(most, delay * 2)


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
            return retrying(attempt, seconds=seconds, what=method.__name__,
                            most=self.most_backoff())
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
        _OPENED[self.engine] = weakref.ref(self)

    def most_backoff(self) -> float:
        """The longest wait between two tries of a call through an outage: never longer than
        the heartbeat interval. A reaper judges after a grace period of unbroken contact
        (`trusts_heartbeats`), in which every live trial must have beaten again; the heartbeat
        thread tries every interval, but a trial claimed as an outage began records its first
        beat from the worker's own thread, whose tries would otherwise drift MAX_BACKOFF
        apart: past a short grace period (the fleet tests' 4 s), and the live trial was
        reaped as one that never beat."""
        interval = self.heartbeat_interval
        return min(MAX_BACKOFF, interval) if interval else MAX_BACKOFF

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


# The engine of every storage this process opened, while anything still holds it, and the
# storage, while anything holds that. Keyed by the engines, not the storages: a storage freed
# by its reference count leaves its engine and pool in SQLAlchemy's reference cycles,
# connections open.
_OPENED: weakref.WeakKeyDictionary[sqlalchemy.Engine, weakref.ref[ResilientRDBStorage]] = (
    weakref.WeakKeyDictionary())


def most_backoff(engine: sqlalchemy.Engine) -> float:
    """`ResilientRDBStorage.most_backoff` of the storage that opened `engine`, for what hpo
    says to the database directly (the study lock, its reads): MAX_BACKOFF for another engine."""
    opened = _OPENED.get(engine)
    storage = opened() if opened is not None else None
    return storage.most_backoff() if storage is not None else MAX_BACKOFF


def retrying_on(engine: sqlalchemy.Engine, call: Callable[[], T], *, what: str) -> T:
    """`call`, which talks to `engine` directly, retried through an outage as a storage call
    on it is: for OUTAGE_SECONDS, its tries at most `most_backoff(engine)` apart."""
    return retrying(call, seconds=OUTAGE_SECONDS, what=what, most=most_backoff(engine))


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
