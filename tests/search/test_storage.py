"""hpo/search/storage.py: storage URLs and their drivers, passwords kept out of every
message, and the connections a worker holds."""

import sys
import types

import optuna
import pytest
import sqlalchemy

from hpo.cli import main
from hpo.errors import StorageError
from hpo.search import storage


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
