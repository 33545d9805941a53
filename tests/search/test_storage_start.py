"""hpo/search/storage_start.py: opening a storage at start, its wait and its one-line
errors."""

import time

import pytest
import sqlalchemy

from hpo.errors import StorageError
from hpo.search import storage, storage_start


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
    assert storage_start.start_wait() == storage_start.START_SECONDS  # empty is unset
    monkeypatch.setenv("HPO_STORAGE_WAIT", "1.5")
    assert storage_start.start_wait() == 1.5
    started = time.monotonic()
    with pytest.raises(StorageError, match="cannot be opened after"):
        storage.open_storage("postgresql+psycopg2://u:p@127.0.0.1:1/x")
    assert time.monotonic() - started < 15  # not the default wait
    # A wait this short passes in silence: bad input stays one line on stderr.
    assert capsys.readouterr().err == ""


def test_a_long_wait_at_start_says_once_that_it_retries_and_ends_on_time(monkeypatch, capsys):
    monkeypatch.setattr(storage_start, "QUIET_WAIT", 0.0)  # the note, without a long test
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
