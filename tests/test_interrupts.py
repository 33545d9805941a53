"""Ctrl-C and SIGTERM raised outside the database code, on a real SQLite storage: a signal
that comes inside a storage call is raised as the call ends, with its write made and the
database free for the next one."""

from __future__ import annotations

import inspect
import os
import signal
import time

import optuna
import pytest
import sqlalchemy

from hpo import interrupts
from hpo.errors import Terminated
from hpo.search.storage import open_storage


def send_once(engine: sqlalchemy.Engine, signum: int) -> None:
    """Send `signum` to this process from inside the next statement the engine runs."""
    sent = []

    def send(*_args: object) -> None:
        if not sent:  # (a listener cannot remove itself while SQLAlchemy runs it)
            sent.append(signum)
            os.kill(os.getpid(), signum)

    sqlalchemy.event.listen(engine, "before_cursor_execute", send)


def test_frames_inside_sqlalchemy_are_database_code(tmp_path):
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'f.db'}")
    seen = []
    sqlalchemy.event.listen(engine, "before_cursor_execute",
                            lambda *_: seen.append(interrupts.in_database_code(
                                inspect.currentframe())))
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text("select 1"))
    engine.dispose()
    assert seen == [True]
    assert not interrupts.in_database_code(inspect.currentframe())


@pytest.mark.parametrize(("signum", "raised"), [(signal.SIGTERM, Terminated),
                                                 (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_inside_a_storage_call_is_raised_as_it_ends(tmp_path, signum, raised):
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = optuna.create_study(study_name="s", storage=storage)
    trial_id = study.ask()._trial_id
    with interrupts.raised_outside_the_database():
        send_once(storage.engine, signum)
        with pytest.raises(raised):
            storage.set_trial_user_attr(trial_id, "written", True)
        # The call went to its end before the stop, and left the database free.
        assert storage.get_trial(trial_id).user_attrs == {"written": True}
        began = time.monotonic()
        storage.set_trial_user_attr(trial_id, "after", True)
        assert time.monotonic() - began < 1  # not SQLite's 5 s busy timeout
    storage.engine.dispose()


def test_a_signal_held_without_a_storage_call_is_raised_once_outside(tmp_path):
    # A direct use of an engine (the study lock, the budget's counts) has no raise_held at
    # its end: the look raises it at the first bytecode outside, and only once.
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'e.db'}")
    with interrupts.raised_outside_the_database():
        send_once(engine, signal.SIGTERM)
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text("select 1"))  # no exception in here
        began = time.monotonic()
        with pytest.raises(Terminated):
            time.sleep(5)
        assert time.monotonic() - began < 2
        time.sleep(3 * interrupts.RECHECK_SECONDS)  # nothing more is raised
    engine.dispose()


def test_a_signal_in_a_finalizer_is_not_lost():
    class Finalized:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here, in __del__

    with interrupts.raised_outside_the_database(), pytest.raises(Terminated):
        Finalized()  # freed at once: __del__ runs, the stop comes after it
        time.sleep(5)


def test_the_handlers_are_put_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    with interrupts.raised_outside_the_database():
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
