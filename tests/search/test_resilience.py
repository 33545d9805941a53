"""hpo/search/resilience.py: storage calls retried through database outages, written
in few transactions."""

import re
import time
from collections import Counter

import optuna
import pytest
import sqlalchemy
from conftest import start_worker, trial_states
from optuna.trial import TrialState

from hpo.search import resilience, storage

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def test_only_connection_errors_are_retried():
    lost = sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed"))
    wrapped = RuntimeError("during tell")
    wrapped.__cause__ = lost
    assert resilience.is_connection_error(lost) and resilience.is_connection_error(wrapped)
    assert not resilience.is_connection_error(ValueError("bad value"))
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise lost
        return "written"

    assert resilience.retrying(flaky, seconds=30, what="test") == "written" and len(calls) == 3
    with pytest.raises(ValueError):
        resilience.retrying(lambda: (_ for _ in ()).throw(ValueError("x")), seconds=30, what="t")


def test_retries_wait_at_most_the_bound_between_tries(monkeypatch):
    lost = sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed"))
    waits: list[float] = []

    class Clock:  # the module's clock, advanced by its waits: no real sleep
        @staticmethod
        def monotonic() -> float:
            return sum(waits)

        sleep = staticmethod(waits.append)

    monkeypatch.setattr(resilience, "time", Clock)

    def never() -> None:
        raise lost

    with pytest.raises(sqlalchemy.exc.OperationalError):
        resilience.retrying(never, seconds=60, what="test", most=1.0)
    assert waits and max(waits) <= 1.0 * 1.2  # the jitter's 20%
    waits.clear()
    with pytest.raises(sqlalchemy.exc.OperationalError):
        resilience.retrying(never, seconds=600, what="test")
    assert max(waits) > 1.2 and max(waits) <= resilience.MAX_BACKOFF * 1.2


def test_a_storage_retries_within_its_heartbeat_interval(tmp_path):
    """Once an outage ends, every live worker's waiting call goes through within a heartbeat
    interval, so a reaper's grace period of unbroken contact sees every live trial beat
    again: a trial claimed as the outage began records its first beat from the worker's own
    thread, through these retries (tests/system/test_fleet.py's outage test once reaped one,
    alive, when they waited up to MAX_BACKOFF against a grace period of 4 s)."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    beating = storage.open_storage(url, heartbeat_interval=1, grace_period=4)
    slow = storage.open_storage(url, heartbeat_interval=60, grace_period=180)
    silent = storage.open_storage(url)
    try:
        assert beating.most_backoff() == 1
        assert slow.most_backoff() == silent.most_backoff() == resilience.MAX_BACKOFF
        # The study lock and hpo's own reads take the bound of the storage's engine.
        assert resilience.most_backoff(beating.engine) == 1
        assert resilience.most_backoff(slow.engine) == resilience.MAX_BACKOFF
        beating.heartbeat_interval = 3  # as `study.pin_liveness` sets the study's
        assert resilience.most_backoff(beating.engine) == 3
        other = sqlalchemy.create_engine(url)
        assert resilience.most_backoff(other) == resilience.MAX_BACKOFF
        other.dispose()
    finally:
        for opened in (beating, slow, silent):
            opened.engine.dispose()


@pytest.mark.slow
def test_workers_survive_a_database_outage(tiny_study, tmp_path):
    from postgres import PrivateServer

    server = PrivateServer(tmp_path)
    server.start()
    procs = []
    try:
        url = server.url
        slow = ["--set", "training.epochs=6"]
        procs = [start_worker(tiny_study, url, 8, *slow) for _ in range(2)]
        deadline = time.monotonic() + 300
        finished = 0
        while finished < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                finished = sum(trial_states(url)[s] for s in FINISHED)
            except Exception:
                finished = 0
        assert finished >= 3, "the study did not get going"
        server.stop()
        time.sleep(20)
        server.start_again()
        outputs = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
            outputs.append(out)
        study = optuna.load_study(study_name="tiny", storage=url)
        counts = Counter(t.state for t in study.trials)
        assert counts[TrialState.COMPLETE] + counts[TrialState.PRUNED] == 8
        assert counts[TrialState.RUNNING] == counts[TrialState.WAITING] == 0
        # Every result a worker reported is in the storage, with the same value.
        stored = {t.number: t.value for t in study.trials}
        reported = [(int(n), float(v)) for out in outputs
                    for n, v in re.findall(r"^trial (\d+) value ([\d.]+)", out, re.MULTILINE)]
        assert len(reported) == counts[TrialState.COMPLETE]
        for number, value in reported:
            assert stored[number] == pytest.approx(value, abs=1e-4)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.destroy()


def test_every_storage_call_optuna_makes_is_retried_through_an_outage(tmp_path):
    """Optuna's cache calls the backend's private methods (`_get_trials`,
    `_create_new_trial`, `_set_trial_param`, `_get_best_trial_id`); each of the calls a
    trial makes during an outage waits for the database instead of failing the trial."""
    import threading

    from postgres import PrivateServer

    server = PrivateServer(tmp_path)
    server.start()
    opened = None
    try:
        opened = storage.open_storage(server.url)
        study = optuna.create_study(study_name="s", storage=opened, direction="maximize",
                                    pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
        study.enqueue_trial({"x": 0.5})
        for value in (0.1, 0.9):
            study.tell(study.ask({"x": optuna.distributions.FloatDistribution(0, 1)}), value)
        calls = {
            "ask": study.ask,
            "suggest": lambda: study.ask().suggest_float("x", 0.0, 1.0),
            "report and should_prune": lambda: _report_and_prune(study.ask()),
            "get_trials": study.get_trials,
            "best_trial": lambda: study.best_trial,
            "tell": lambda: study.tell(study.ask(), 0.3),
        }
        for what, call in calls.items():
            server.stop()
            restart = threading.Timer(2.0, server.start_again)
            restart.start()
            try:
                call()
            except Exception as exc:
                pytest.fail(f"{what} failed during the outage: {exc!r}")
            finally:
                restart.join()
    finally:
        if opened is not None:
            opened.engine.dispose()
        server.destroy()


def test_a_batch_of_user_attributes_is_one_commit_written_when_the_block_ends(any_storage):
    """The records of a trial are written in a few transactions, not one an attribute (tens
    of milliseconds each on an SQLite file). Built of Optuna's private session helper and
    attribute setter: this fails if they change."""
    opened = storage.open_storage(any_storage)
    try:
        study = optuna.create_study(study_name="s", storage=opened)
        trial = study.ask()
        commits = []
        sqlalchemy.event.listen(opened.engine, "commit", lambda _conn: commits.append(1))
        with resilience.batched_user_attrs():
            trial.set_user_attr("a", 1)
            trial.set_user_attr("b", {"x": [1, 2]})
            with resilience.batched_user_attrs():  # nested: written with the outermost
                trial.set_user_attr("a", 2)
            assert commits == []
        assert len(commits) == 1
        assert opened.get_trial(trial._trial_id).user_attrs == {"a": 2, "b": {"x": [1, 2]}}
        with resilience.batched_user_attrs():
            trial.set_user_attr("z", 0)
            assert "z" not in opened.get_trial(trial._trial_id).user_attrs
        # A block that raises still writes what it set.
        with pytest.raises(RuntimeError), resilience.batched_user_attrs():
            trial.set_user_attr("c", 3)
            raise RuntimeError("the trial failed")
        assert opened.get_trial(trial._trial_id).user_attrs["c"] == 3
        # Outside a block each attribute is written at once, as Optuna writes it.
        trial.set_user_attr("d", 4)
        assert opened.get_trial(trial._trial_id).user_attrs["d"] == 4
        # A trial finished meanwhile refuses the batch, as it refuses an attribute.
        study.tell(trial, 0.5)
        with pytest.raises(optuna.exceptions.UpdateFinishedTrialError), \
                resilience.batched_user_attrs():
            trial.set_user_attr("e", 5)
    finally:
        opened.engine.dispose()


def _report_and_prune(trial: optuna.Trial) -> bool:
    trial.report(0.2, 1)
    return trial.should_prune()
