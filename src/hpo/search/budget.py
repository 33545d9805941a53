"""The study-wide trial budget, kept exactly by many workers.

Optuna's MaxTrialsCallback checks the count after a trial, so N workers overshoot by up to
N - 1. Here a worker claims a trial inside a lock shared through the database (a PostgreSQL
advisory lock; a file lock beside an SQLite file) and only when COMPLETE + PRUNED + RUNNING
trials stay below the budget: a failed trial frees its slot, so another is made up.

Under `study.budget: trainings` the budget of N counts the steps of N full trainings
instead (`Trainings`): a trial starts, or a paused one resumes, only while every step it may
still train fits beside those the study's trials trained (COMPLETE, PRUNED and RUNNING ones)
and those its training trials may still train. So the study never trains more than N full
trainings, and a pruned or paused trial gives back the steps it did not train.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import optuna
import sqlalchemy

# Optuna's RDB schema (private names, versioned by its migrations): counting and finding
# trials in SQL keeps claiming and reaping cheap as a study grows. tests/search/test_budget.py fails
# if these tables or columns change.
from optuna.storages._rdb.models import (
    TrialHeartbeatModel,
    TrialIntermediateValueModel,
    TrialModel,
    TrialUserAttributeModel,
)
from optuna.trial import FrozenTrial, TrialState

from hpo import interrupts
from hpo.search.pausing import PAUSED_AT, RETRAINED
from hpo.search.resilience import retrying_on

_LOCK_NAMESPACE = 0x6870_6F00  # "hpo\0": keeps our advisory-lock keys apart from others'

T = TypeVar("T")


@dataclass(frozen=True)
class Counts:
    complete: int = 0
    pruned: int = 0
    running: int = 0
    waiting: int = 0
    failed: int = 0

    @property
    def finished(self) -> int:
        return self.complete + self.pruned

    @property
    def started(self) -> int:
        """The trials that hold a slot of the budget: finished or running."""
        return self.finished + self.running

    @property
    def claimed(self) -> int:
        return self.finished + self.running + self.waiting


def count(study: optuna.Study) -> Counts:
    states = [t.state for t in study.get_trials(deepcopy=False)]
    return Counts(
        complete=states.count(TrialState.COMPLETE),
        pruned=states.count(TrialState.PRUNED),
        running=states.count(TrialState.RUNNING),
        waiting=states.count(TrialState.WAITING),
        failed=states.count(TrialState.FAIL),
    )


def count_in_database(connection: sqlalchemy.Connection, study_id: int) -> Counts:
    """The same counts in one grouped query: claiming must stay cheap as a study grows, and
    loading every trial (params, attributes) to count states does not."""
    trials = TrialModel.__table__
    rows = connection.execute(
        sqlalchemy.select(trials.c.state, sqlalchemy.func.count())
        .where(trials.c.study_id == study_id)
        .group_by(trials.c.state)
    ).all()
    by_name = {str(getattr(state, "name", state)): n for state, n in rows}
    return Counts(
        complete=by_name.get("COMPLETE", 0),
        pruned=by_name.get("PRUNED", 0),
        running=by_name.get("RUNNING", 0),
        waiting=by_name.get("WAITING", 0),
        failed=by_name.get("FAIL", 0),
    )


def unbeaten_trial_ids(connection: sqlalchemy.Connection, study_id: int,
                       started_before: datetime.datetime) -> list[int]:
    """RUNNING trials that started before `started_before` and never recorded a heartbeat."""
    trials, beats = TrialModel.__table__, TrialHeartbeatModel.__table__
    return list(connection.execute(
        sqlalchemy.select(trials.c.trial_id)
        .where(trials.c.study_id == study_id, trials.c.state == TrialState.RUNNING,
               trials.c.datetime_start < started_before,
               ~sqlalchemy.exists().where(beats.c.trial_id == trials.c.trial_id))
    ).scalars())


def stale_trial_ids(connection: sqlalchemy.Connection, study_id: int,
                    grace: float) -> list[int]:
    """RUNNING trials whose last heartbeat is more than `grace` seconds old by the database's
    clock (Optuna's reaper's rule)."""
    trials, beats = TrialModel.__table__, TrialHeartbeatModel.__table__
    now = connection.execute(sqlalchemy.select(sqlalchemy.func.now())).scalar_one()
    # Naive, as Optuna compares them: PostgreSQL answers with a time zone.
    now = now.replace(tzinfo=None)
    rows = connection.execute(
        sqlalchemy.select(trials.c.trial_id, beats.c.heartbeat)
        .join(beats, beats.c.trial_id == trials.c.trial_id)
        .where(trials.c.study_id == study_id, trials.c.state == TrialState.RUNNING)
    ).all()
    return [trial_id for trial_id, beat in rows
            if now - beat > datetime.timedelta(seconds=grace)]


def may_claim(counts: Counts, budget: float) -> bool:
    """Whether a trial may start: fewer than `budget` are finished or running. A claim takes a
    waiting trial first (Optuna's ask does), so a retry copy runs in the slot its failed
    original freed, and enqueued sets beyond the budget stay waiting (a later, larger budget
    runs them) instead of each of several workers starting one past the budget."""
    return counts.started < budget


@dataclass(frozen=True)
class Trained:
    """One COMPLETE, PRUNED or RUNNING trial's training: the `steps` it reported (at least
    one: a trial that trained nothing, an OOM say, still cost its set-up, and so failing
    trials cannot start without end) and whether it still trains (RUNNING, not paused)."""

    steps: int
    training: bool
    retrained: int = 0  # steps trained again, its checkpoint given up (pausing.RETRAINED)


@dataclass(frozen=True)
class Trainings:
    """A budget of `n` full trainings of `steps` steps each (`study.budget: trainings`)."""

    n: float
    steps: int

    def room(self, trials: list[Trained]) -> float:
        """The steps left once every trial's are counted: a training trial's whole training
        (it may train them all), any other's trained steps."""
        committed = sum((max(t.steps, self.steps) if t.training else t.steps) + t.retrained
                        for t in trials)
        return self.n * self.steps - committed

    def spent(self, trials: list[Trained]) -> float:
        """How many full trainings the trials' trained steps come to."""
        return sum(t.steps + t.retrained for t in trials) / self.steps


def trained_in_database(connection: sqlalchemy.Connection, study_id: int) -> list[Trained]:
    """Each COMPLETE, PRUNED or RUNNING trial's `Trained`, in one query: a paused trial is
    RUNNING with `paused_at` set, and its steps are those before its checkpoint; the steps
    a trial trained again (its checkpoint given up) are its `retrained_steps`."""
    trials = TrialModel.__table__
    values = TrialIntermediateValueModel.__table__
    attributes = TrialUserAttributeModel.__table__
    # Only this study's trials are joined to their values, then grouped: the claim runs this
    # under the study lock, on a database that may hold many studies.
    paused = sqlalchemy.exists().where(
        attributes.c.trial_id == trials.c.trial_id, attributes.c.key == PAUSED_AT,
        attributes.c.value_json != "null")
    retrained = (sqlalchemy.select(attributes.c.value_json)
                 .where(attributes.c.trial_id == trials.c.trial_id,
                        attributes.c.key == RETRAINED).scalar_subquery())
    rows = connection.execute(
        sqlalchemy.select(trials.c.state, sqlalchemy.func.max(values.c.step), paused,
                          retrained)
        .select_from(trials.outerjoin(values, values.c.trial_id == trials.c.trial_id))
        .where(trials.c.study_id == study_id, trials.c.state.in_(_COUNTED))
        .group_by(trials.c.trial_id, trials.c.state)
    ).all()
    return [Trained(max(int(step or 0), 1),
                    str(getattr(state, "name", state)) == "RUNNING" and not is_paused,
                    int(json.loads(again)) if again else 0)
            for state, step, is_paused, again in rows]


def trained_of(trials: list[FrozenTrial]) -> list[Trained]:
    """`trained_in_database`'s answer from trials already loaded."""
    return [Trained(max(max(t.intermediate_values, default=0), 1),
                    t.state == TrialState.RUNNING and t.user_attrs.get(PAUSED_AT) is None,
                    int(t.user_attrs.get(RETRAINED, 0)))
            for t in trials if t.state in _COUNTED]


_COUNTED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)


@contextlib.contextmanager
def study_lock(engine: sqlalchemy.Engine, study_name: str) -> Iterator[sqlalchemy.Connection]:
    """Mutual exclusion among all workers of one study, wherever they run; yields a
    connection for the queries made under the lock. A Ctrl-C or SIGTERM held while it
    queried is raised as it is released."""
    with _locked(engine, study_name) as connection:
        yield connection
    interrupts.raise_held()


@contextlib.contextmanager
def _locked(engine: sqlalchemy.Engine, study_name: str) -> Iterator[sqlalchemy.Connection]:
    backend = engine.url.get_backend_name()
    if backend == "postgresql":
        with _advisory_lock(engine, study_name) as connection:
            yield connection
        return
    lock: contextlib.AbstractContextManager[object]
    if backend == "sqlite" and engine.url.database not in (None, "", ":memory:"):
        lock = _file_lock(Path(engine.url.database).with_suffix(".hpo-lock"))
    else:
        # An in-memory SQLite database lives in one process: a thread lock is enough there.
        lock = _process_lock
    with lock, retrying_on(engine, engine.connect, what="lock") as connection:
        yield connection


def under_lock(engine: sqlalchemy.Engine, study_name: str,
               section: Callable[[sqlalchemy.Connection], T]) -> T:
    """`section` run under the study lock with the lock's connection, and run again from
    its start, under the lock taken again once the database is back, where an outage cuts
    that connection (and the lock with it) while it runs. So `section` reads before it
    writes, and writes only through storage calls, which wait out an outage on their own."""

    def once() -> T:
        with study_lock(engine, study_name) as connection:
            return section(connection)

    return retrying_on(engine, once, what="lock")


def read(engine: sqlalchemy.Engine, query: Callable[[sqlalchemy.Connection], T]) -> T:
    """`query` made on a connection of its own, and made again through an outage, as a
    storage call is (`resilience`)."""

    def once() -> T:
        with engine.connect() as connection:
            return query(connection)

    return retrying_on(engine, once, what="read")


_process_lock = threading.Lock()


@contextlib.contextmanager
def _advisory_lock(
    engine: sqlalchemy.Engine, study_name: str
) -> Iterator[sqlalchemy.Connection]:
    key = _LOCK_NAMESPACE << 32 | zlib.crc32(study_name.encode())
    key -= 1 << 63 if key >= 1 << 63 else 0  # bigint is signed
    # A session-level lock on its own connection: released on unlock, or by the server when
    # the connection dies with its worker, so a killed worker never holds it.
    def acquire() -> sqlalchemy.Connection:
        connection = engine.connect()
        try:
            # The server notices a holder cut off by a partition within about 25 s, and
            # ends its session, which frees the lock, instead of when TCP gives up (hours).
            connection.execute(sqlalchemy.text(
                "SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; "
                "SET tcp_keepalives_count = 3"))
            connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": key})
        except Exception:
            connection.close()
            raise
        return connection

    connection = retrying_on(engine, acquire, what="lock")
    try:
        try:
            yield connection
        finally:
            try:
                connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
            except sqlalchemy.exc.SQLAlchemyError:
                # Never hand a connection that may still hold the lock back to the pool.
                connection.invalidate()
    finally:
        with contextlib.suppress(sqlalchemy.exc.SQLAlchemyError):
            connection.close()


def lock_held(connection: sqlalchemy.Connection) -> bool:
    """Whether the study lock yielded with `connection` is still held. A PostgreSQL
    session lock dies with its connection (a server restart, a failover, a reset), and its
    holder learns of it only on its next use of that connection."""
    if connection.engine.url.get_backend_name() != "postgresql":
        return True
    try:
        connection.execute(sqlalchemy.text("SELECT 1"))
    except sqlalchemy.exc.SQLAlchemyError:
        return False
    return True


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
