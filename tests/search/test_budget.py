"""The study-wide budget: counts taken in the database, the claim rule, the lock every worker
claims under, and eight real workers ending exactly on the budget."""

import threading
import time

import optuna
import pytest
import sqlalchemy
from conftest import Quiet, start_worker, trial_states
from optuna.trial import TrialState

from hpo.search import budget
from hpo.search.budget import Counts
from hpo.search.storage import open_storage


def test_counts_in_the_database_match_the_study(any_storage):
    storage = open_storage(any_storage)
    study = optuna.create_study(study_name="b", storage=storage)
    for state in (TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
        trial = study.ask()
        study.tell(trial, 0.5 if state == TrialState.COMPLETE else None, state=state)
    study.ask()  # running
    study.enqueue_trial({})  # waiting
    study_id = storage.get_study_id_from_name("b")
    with budget.study_lock(storage.engine, "b") as connection:
        counted = budget.count_in_database(connection, study_id)
    assert counted == budget.count(study) == Counts(complete=2, pruned=1, running=1,
                                                    waiting=1, failed=1)
    assert (counted.finished, counted.claimed) == (3, 5)
    storage.engine.dispose()


@pytest.mark.parametrize(
    ("counts", "claims"),
    [
        (Counts(complete=3), False),  # the budget of 3 is spent
        (Counts(complete=1, running=2), False),  # the rest is running elsewhere
        (Counts(complete=1, running=1, failed=5), True),  # failed trials free their slot
        (Counts(complete=2, failed=1, waiting=1), True),  # a retry takes its failed slot
        # An enqueued set beyond the budget waits for a larger one (issue 30: several
        # workers each took one and the budget overshot).
        (Counts(complete=2, running=1, waiting=1), False),
    ],
)
def test_a_worker_claims_only_below_the_budget(counts, claims):
    assert budget.may_claim(counts, 3) is claims


def test_steps_trained_in_the_database_match_the_loaded_trials(any_storage):
    """Per trial: the steps it reported (at least one), and whether it trains (RUNNING, not
    paused); FAIL and WAITING trials hold nothing."""
    storage = open_storage(any_storage)
    study = optuna.create_study(study_name="t", storage=storage)

    def trial_with(steps: int, state: TrialState | None, **attrs) -> None:
        trial = study.ask()
        for step in range(1, steps + 1):
            trial.report(0.1 * step, step)
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if state is not None:
            study.tell(trial, 0.5 if state == TrialState.COMPLETE else None, state=state)

    trial_with(4, TrialState.COMPLETE)
    trial_with(1, TrialState.PRUNED)
    trial_with(0, TrialState.PRUNED)  # an OOM before any epoch still costs its set-up
    trial_with(3, TrialState.FAIL)  # its retry copy carries its reports: counted there
    trial_with(2, None)  # training
    trial_with(1, None, paused_at=1)  # paused at step 1
    trial_with(2, None, paused_at=None)  # resumed
    study.enqueue_trial({})
    study_id = storage.get_study_id_from_name("t")
    with budget.study_lock(storage.engine, "t") as connection:
        counted = budget.trained_in_database(connection, study_id)
    expected = [budget.Trained(4, False), budget.Trained(1, False), budget.Trained(1, False),
                budget.Trained(2, True), budget.Trained(1, False), budget.Trained(2, True)]
    assert sorted(counted, key=repr) == sorted(expected, key=repr)
    assert sorted(budget.trained_of(study.get_trials()), key=repr) == sorted(expected, key=repr)
    storage.engine.dispose()


def test_a_budget_of_trainings_holds_each_training_trials_whole_training():
    trainings = budget.Trainings(3, 4)  # 12 steps
    trained = [budget.Trained(4, False), budget.Trained(1, False), budget.Trained(2, True)]
    # 4 + 1 trained, the running trial may train 4: 3 left, too few for a new trial
    assert trainings.room(trained) == 3
    assert trainings.spent(trained) == pytest.approx(7 / 4)
    assert trainings.room([]) == 12
    # Unpruned, N trainings are N trials: the third starts with 4 left, a fourth never.
    assert trainings.room([budget.Trained(4, False)] * 2) == 4
    assert trainings.room([budget.Trained(4, False)] * 3) == 0


def test_workers_leave_enqueued_sets_beyond_the_budget_waiting(pg_url):
    """Issue 30: with more sets enqueued than the budget, every worker took one while any
    waited, so three workers finished 4 trials for a budget of 2."""
    from hpo.app.worker import Limits, run_worker
    from hpo.outcome import Outcome

    setup = open_storage(pg_url)
    study = optuna.create_study(study_name="q", storage=setup, direction="maximize")
    for x in range(5):
        study.enqueue_trial({"x": x / 10})
    errors: list[BaseException] = []

    def slow(context):
        trial = context.trial
        trial.suggest_float("x", 0.0, 1.0)
        time.sleep(0.5)  # long enough that every worker claims while the others run
        return Outcome(TrialState.COMPLETE, value=0.5), context.study.tell(trial, 0.5)

    def worker() -> None:
        storage = open_storage(pg_url)
        try:
            run_worker(optuna.load_study(study_name="q", storage=storage), storage, slow,
                       Quiet(), Limits(2, poll_seconds=0.1))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            storage.engine.dispose()

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert (states.count(TrialState.COMPLETE), states.count(TrialState.WAITING)) == (2, 3)
    setup.engine.dispose()


def test_the_study_lock_excludes_other_holders(any_storage):
    engine = open_storage(any_storage).engine
    order: list[str] = []
    held = threading.Event()

    def first() -> None:
        with budget.study_lock(engine, "b"):
            order.append("first in")
            held.set()
            time.sleep(0.5)
            order.append("first out")

    thread = threading.Thread(target=first)
    thread.start()
    held.wait(timeout=10)
    with budget.study_lock(engine, "b"):
        order.append("second in")
    thread.join()
    assert order == ["first in", "first out", "second in"]
    engine.dispose()


@pytest.mark.slow
def test_eight_workers_end_exactly_on_budget(tiny_study, pg_url):
    procs = [start_worker(tiny_study, pg_url, 24) for _ in range(8)]
    try:
        for p in procs:
            assert p.wait(timeout=900) == 0, p.stderr.read()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    counts = trial_states(pg_url)
    assert counts[TrialState.COMPLETE] + counts[TrialState.PRUNED] == 24
    assert sum(counts.values()) == 24, counts


def test_a_lock_whose_connection_died_is_known_lost_and_free_for_others(pg_url):
    from postgres import _execute

    engine = sqlalchemy.create_engine(pg_url)
    try:
        with budget.study_lock(engine, "s") as connection:
            assert budget.lock_held(connection)
            pid = connection.execute(sqlalchemy.text("select pg_backend_pid()")).scalar()
            # A server restart, a failover or a reset ends the session that held the lock.
            _execute(pg_url, f"select pg_terminate_backend({pid})")
            assert not budget.lock_held(connection)
            other = sqlalchemy.create_engine(pg_url)
            try:
                with budget.study_lock(other, "s") as again:  # not blocked by the dead one
                    assert budget.lock_held(again)
            finally:
                other.dispose()
    finally:
        engine.dispose()


def _cut_first(pg_url: str, connection: sqlalchemy.Connection, sessions: list[int]) -> None:
    """Note `connection`'s server session in `sessions`; the first one, end it from another
    connection, as a server restart or a failover does: its holder learns of it on its next
    statement."""
    from postgres import _execute

    sessions.append(connection.execute(sqlalchemy.text("select pg_backend_pid()")).scalar())
    if len(sessions) == 1:
        _execute(pg_url, f"select pg_terminate_backend({sessions[0]})")


def test_a_section_cut_off_under_the_lock_runs_again_under_the_lock_taken_again(pg_url):
    engine = sqlalchemy.create_engine(pg_url)
    sessions: list[int] = []

    def section(connection: sqlalchemy.Connection) -> bool:
        _cut_first(pg_url, connection, sessions)
        connection.execute(sqlalchemy.text("select 1"))
        return budget.lock_held(connection)

    try:
        assert budget.under_lock(engine, "s", section)
        assert len(sessions) == 2 and sessions[0] != sessions[1]
        with pytest.raises(ZeroDivisionError):  # anything but a lost connection is raised
            budget.under_lock(engine, "s", lambda connection: 1 / 0)
    finally:
        engine.dispose()


def test_a_read_cut_off_is_made_again_on_a_new_connection(pg_url):
    engine = sqlalchemy.create_engine(pg_url)
    sessions: list[int] = []

    def query(connection: sqlalchemy.Connection) -> int:
        _cut_first(pg_url, connection, sessions)
        return connection.execute(sqlalchemy.text("select 7")).scalar()

    try:
        assert budget.read(engine, query) == 7
        assert len(sessions) == 2
    finally:
        engine.dispose()
