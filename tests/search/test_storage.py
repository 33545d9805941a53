"""Storage URLs, passwords kept out of every message, and workers that wait out a database
outage without losing a result."""

import re
import sys
import time
import types
from collections import Counter

import optuna
import pytest
import sqlalchemy
from conftest import start_worker, trial_states
from optuna.trial import TrialState

from hpo.cli import main
from hpo.errors import StorageError
from hpo.search import storage

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def test_storage_url_precedence(monkeypatch):
    monkeypatch.delenv("HPO_STORAGE", raising=False)
    assert storage.storage_url(None, None) == "sqlite:///hpo.db"
    assert storage.storage_url(None, "sqlite:///file.db") == "sqlite:///file.db"
    monkeypatch.setenv("HPO_STORAGE", "sqlite:///env.db")
    assert storage.storage_url(None, "sqlite:///file.db") == "sqlite:///env.db"
    assert storage.storage_url("sqlite:///option.db", "sqlite:///file.db") == (
        "sqlite:///option.db")


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql+psycopg2://hpo:Sup3rS3cret@db:5432/hpo",
     "postgresql+psycopg2://hpo:***@db:5432/hpo"),
    # Unencoded "@" and ":" in the password: SQLAlchemy cannot parse these URLs at all.
    ("postgresql+psycopg2://u:p@ss:w@rd@127.0.0.1:1/x", "postgresql+psycopg2://u:***@127.0.0.1:1/x"),
    ("postgresql+psycopg2://u:pa:ss@db/x", "postgresql+psycopg2://u:***@db/x"),
    ("postgresql://u:p%40ss@db/x?sslmode=require", "postgresql://u:***@db/x?sslmode=require"),
    ("postgresql://u@db/x", "postgresql://u@db/x"),
    ("sqlite:///hpo.db", "sqlite:///hpo.db"),
    ("::not a url::", "::not a url::"),
])
def test_redact_hides_the_whole_password(url, shown):
    assert storage.redact(url) == shown


def test_a_url_with_unencoded_password_characters_is_bad_input_without_the_password():
    url = "postgresql+psycopg2://u:p@ss:w@rd@127.0.0.1:1/x"
    with pytest.raises(StorageError) as caught:
        storage.open_storage(url, start_seconds=0)
    message = str(caught.value)
    assert message == ("storage URL postgresql+psycopg2://u:***@127.0.0.1:1/x is not a database "
                       "URL; write a password's special characters percent-encoded (@ as %40, "
                       ": as %3A)")


def test_only_connection_errors_are_retried():
    lost = sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed"))
    wrapped = RuntimeError("during tell")
    wrapped.__cause__ = lost
    assert storage.is_connection_error(lost) and storage.is_connection_error(wrapped)
    assert not storage.is_connection_error(ValueError("bad value"))
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise lost
        return "written"

    assert storage.retrying(flaky, seconds=30, what="test") == "written" and len(calls) == 3
    with pytest.raises(ValueError):
        storage.retrying(lambda: (_ for _ in ()).throw(ValueError("x")), seconds=30, what="t")


def test_an_unreachable_storage_at_start_is_bad_input_without_the_password():
    url = "postgresql+psycopg2://hpo:Sup3rS3cret@127.0.0.1:1/hpo"
    with pytest.raises(StorageError) as caught:
        storage.open_storage(url, start_seconds=0)
    assert "Sup3rS3cret" not in str(caught.value) and "***" in str(caught.value)


@pytest.mark.parametrize("wait", ["soon", "-1", "inf", "nan"])
def test_a_bad_storage_wait_is_refused_before_any_connection(monkeypatch, tmp_path, wait):
    monkeypatch.setenv("HPO_STORAGE_WAIT", wait)
    with pytest.raises(StorageError, match=rf"^HPO_STORAGE_WAIT={wait!r}: expected a number"):
        storage.open_storage(f"sqlite:///{tmp_path / 'never.db'}")
    assert not (tmp_path / "never.db").exists()


def test_the_storage_wait_bounds_the_retries_at_start(monkeypatch, capsys):
    monkeypatch.setenv("HPO_STORAGE_WAIT", "")
    assert storage.start_wait() == storage.START_SECONDS  # empty is unset
    monkeypatch.setenv("HPO_STORAGE_WAIT", "1.5")
    assert storage.start_wait() == 1.5
    started = time.monotonic()
    with pytest.raises(StorageError, match="cannot be opened after"):
        storage.open_storage("postgresql+psycopg2://u:p@127.0.0.1:1/x")
    assert time.monotonic() - started < 15  # not the default wait
    # A wait this short passes in silence: bad input stays one line on stderr.
    assert capsys.readouterr().err == ""


def test_a_long_wait_at_start_says_once_that_it_retries_and_ends_on_time(monkeypatch, capsys):
    monkeypatch.setattr(storage, "QUIET_WAIT", 0.0)  # the note, without a long test
    monkeypatch.setenv("HPO_STORAGE_WAIT", "1")
    started = time.monotonic()
    with pytest.raises(StorageError, match="cannot be opened after") as refused:
        storage.open_storage("postgresql://nobody:Sup3rS3cret@127.0.0.1:1/x")
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 3.0  # the wait, not seconds of backoff past it
    notes = capsys.readouterr().err.splitlines()
    assert notes == ["hpo: warning: storage postgresql://nobody:***@127.0.0.1:1/x unreachable "
                     "(connection refused); retrying for 1 s (HPO_STORAGE_WAIT sets how long)"]
    assert "Sup3rS3cret" not in str(refused.value)


@pytest.mark.parametrize("scheme", ["postgresql", "postgresql+psycopg2"])
def test_a_postgresql_url_opens_with_or_without_its_driver(pg_url, scheme):
    """SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3; hpo installs psycopg2."""
    url = pg_url.replace("postgresql+psycopg2://", f"{scheme}://")
    opened = storage.open_storage(url, start_seconds=0)
    try:
        optuna.create_study(study_name="s", storage=opened).ask()
        assert opened.engine.dialect.driver == "psycopg2"
        assert opened.engine.url.render_as_string(hide_password=False) == pg_url
    finally:
        opened.engine.dispose()


def _installed(monkeypatch, **modules: bool) -> None:
    """Each named driver module as present (an empty stand-in) or missing (None, so that
    importing it fails), whatever this machine has."""
    for name, present in modules.items():
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name) if present else None)


def test_a_bare_postgresql_url_takes_psycopg_3_where_psycopg2_is_missing(monkeypatch):
    _installed(monkeypatch, psycopg2=False, psycopg=True)
    parsed = sqlalchemy.engine.make_url("postgresql://u:p%40ss@db/x?sslmode=require")
    resolved = storage.with_installed_driver(parsed, "shown")
    assert resolved.render_as_string(hide_password=False) == (
        "postgresql+psycopg://u:p%40ss@db/x?sslmode=require")
    _installed(monkeypatch, psycopg=False)
    with pytest.raises(StorageError) as refused:
        storage.open_storage("postgresql://u:Sup3rS3cret@db/x", start_seconds=0)
    assert str(refused.value) == (
        "storage postgresql://u:***@db/x: no postgresql driver is installed; "
        "pip install psycopg2-binary or 'psycopg[binary]'")


@pytest.mark.parametrize(("url", "installed", "message"), [
    ("postgresql+psycopg://u:Sup3rS3cret@127.0.0.1:1/x", {"psycopg": False},
     "storage postgresql+psycopg://u:***@127.0.0.1:1/x: its driver psycopg is not installed; "
     "pip install 'psycopg[binary]', or use postgresql+psycopg2:// (psycopg2 is installed)"),
    ("postgresql+psycopg2://u@db/x", {"psycopg2": False, "psycopg": True},
     "storage postgresql+psycopg2://u@db/x: its driver psycopg2 is not installed; "
     "pip install psycopg2-binary, or use postgresql+psycopg:// (psycopg is installed)"),
    ("mysql+pymysql://u@db/x", {"pymysql": False, "MySQLdb": False},
     "storage mysql+pymysql://u@db/x: its driver pymysql is not installed; pip install pymysql"),
])
def test_a_url_whose_driver_is_missing_names_the_package(monkeypatch, url, installed, message):
    _installed(monkeypatch, **installed)
    with pytest.raises(StorageError) as refused:
        storage.open_storage(url, start_seconds=0)
    assert str(refused.value) == message


def test_a_url_with_an_unknown_driver_says_which_forms_work():
    with pytest.raises(StorageError) as refused:
        storage.open_storage("postgresql+psycopg4://u:Sup3rS3cret@db/x", start_seconds=0)
    assert str(refused.value) == (
        "storage URL postgresql+psycopg4://u:***@db/x: SQLAlchemy knows no database or driver "
        "'postgresql+psycopg4'; for PostgreSQL write postgresql://, postgresql+psycopg2:// or "
        "postgresql+psycopg://")


def test_password_never_printed(tiny_study, capsys):
    url = "postgresql+psycopg2://postgres:Sup3rS3cret@127.0.0.1:5432/postgres"
    main(["status", "--config", str(tiny_study), "--storage", url])
    captured = capsys.readouterr()
    assert "Sup3rS3cret" not in captured.out + captured.err


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


def _report_and_prune(trial: optuna.Trial) -> bool:
    trial.report(0.2, 1)
    return trial.should_prune()


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")
def test_a_worker_holds_one_server_connection_between_trials(pg_url):
    from postgres import open_connections

    from hpo.search import budget

    opened = storage.open_storage(pg_url, heartbeat_interval=30, grace_period=120)
    study = optuna.create_study(study_name="one", storage=opened)
    with budget.study_lock(opened.engine, "one") as connection:
        budget.count_in_database(connection, opened.get_study_id_from_name("one"))
        trial = study.ask()  # a second connection, while the lock holds the first
    opened.record_heartbeat(trial._trial_id)
    study.tell(trial, 0.5)
    assert len(open_connections(pg_url, wait=0)) == 1
    opened.engine.dispose()


def test_a_server_without_a_free_connection_is_named_as_the_cause_with_what_to_set(tmp_path):
    from postgres import PrivateServer

    server = PrivateServer(tmp_path, max_connections=6)
    server.start()
    engine = sqlalchemy.create_engine(server.url, poolclass=sqlalchemy.pool.NullPool)
    held = []
    try:
        with pytest.raises(sqlalchemy.exc.OperationalError):
            while True:
                held.append(engine.connect())
        with pytest.raises(StorageError) as refused:
            storage.open_storage(server.url, start_seconds=1)
        message = str(refused.value)
        assert "too many clients" in message
        assert "raise the server's max_connections to 1.5 x workers + 10" in message
        assert "An exception is raised during the commit" not in message
    finally:
        for connection in held:
            connection.close()
        engine.dispose()
        server.destroy()


def test_commands_in_process_leave_no_server_connection_open(tiny_study, pg_url, capsys):
    """Issue 30: `main(["run", ...])` in a long-lived process left three idle connections
    that only a garbage collection closed."""
    import gc

    from postgres import open_connections

    from hpo.cli import main

    gc.disable()  # the cycles that hold the storages stay uncollected, as between GCs
    try:
        for argv in (["create", "--skip-check"], ["run", "--n-trials", "1"], ["status"]):
            assert main([argv[0], "--config", str(tiny_study), "--storage", pg_url,
                         *argv[1:]]) == 0, capsys.readouterr().err
            assert open_connections(pg_url, wait=0, collect=False) == [], argv[0]
    finally:
        gc.enable()


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
        with storage.batched_user_attrs():
            trial.set_user_attr("a", 1)
            trial.set_user_attr("b", {"x": [1, 2]})
            with storage.batched_user_attrs():  # nested: written with the outermost
                trial.set_user_attr("a", 2)
            assert commits == []
        assert len(commits) == 1
        assert opened.get_trial(trial._trial_id).user_attrs == {"a": 2, "b": {"x": [1, 2]}}
        with storage.batched_user_attrs():
            trial.set_user_attr("z", 0)
            assert "z" not in opened.get_trial(trial._trial_id).user_attrs
        # A block that raises still writes what it set.
        with pytest.raises(RuntimeError), storage.batched_user_attrs():
            trial.set_user_attr("c", 3)
            raise RuntimeError("the trial failed")
        assert opened.get_trial(trial._trial_id).user_attrs["c"] == 3
        # Outside a block each attribute is written at once, as Optuna writes it.
        trial.set_user_attr("d", 4)
        assert opened.get_trial(trial._trial_id).user_attrs["d"] == 4
        # A trial finished meanwhile refuses the batch, as it refuses an attribute.
        study.tell(trial, 0.5)
        with pytest.raises(optuna.exceptions.UpdateFinishedTrialError), \
                storage.batched_user_attrs():
            trial.set_user_attr("e", 5)
    finally:
        opened.engine.dispose()
