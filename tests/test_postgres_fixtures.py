"""Tests of the PostgreSQL test helpers in benchmarks/postgres.py (the tests' and the soak's)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import psutil
import pytest
from conftest import require_postgres
from postgres import (
    SERVER_URL,
    PrivateServer,
    drop_database,
    fresh_database,
    open_connections,
    postgres_bin_dir,
    server_available,
)
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

if postgres_bin_dir() is None:
    pytest.skip(
        "no PostgreSQL binaries (pg_ctl) under /usr/lib/postgresql/*/bin or on PATH",
        allow_module_level=True,
    )

# Start/stop must stay fast; generous against a loaded CI machine, far below pg_ctl's timeouts.
MAX_SECONDS = 10


def scalar(url: str, sql: str, **params: str) -> object:
    engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            return connection.execute(text(sql), params).scalar()
    finally:
        engine.dispose()


def database_exists(name: str) -> bool:
    sql = "select count(*) from pg_database where datname = :name"
    return bool(scalar(f"{SERVER_URL}/postgres", sql, name=name))


def process_gone(pid: int) -> bool:
    """No such process, or only an unreaped zombie (containers may lack a reaping init)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def timed(action) -> float:
    began = time.monotonic()
    action()
    return time.monotonic() - began


def test_shared_server_is_up() -> None:
    require_postgres()
    assert server_available()


def test_fresh_database_create_connect_drop() -> None:
    require_postgres()
    first, second = fresh_database(), fresh_database(prefix="hpo_other")
    try:
        assert first != second
        names = [make_url(url).database for url in (first, second)]
        assert names[0].startswith("hpo_test_") and names[1].startswith("hpo_other_")
        assert first == f"{SERVER_URL}/{names[0]}"
        for url, name in zip((first, second), names, strict=True):
            assert scalar(url, "select current_database()") == name

        # An open connection must not block the drop: drop_database terminates it.
        engine = create_engine(first, poolclass=NullPool)
        held = engine.connect()
        held.execute(text("select 1"))
        drop_database(first)
        assert not database_exists(names[0])
        with pytest.raises(OperationalError):
            held.execute(text("select 1"))
        held.close()
        engine.dispose()

        drop_database(second)
        assert not database_exists(names[1])
        drop_database(second)  # already gone: no error
    finally:
        drop_database(first)
        drop_database(second)


def test_a_connection_left_open_is_found_and_a_closed_one_is_not() -> None:
    require_postgres()
    url = fresh_database()
    engine = create_engine(url, poolclass=NullPool)
    try:
        held = engine.connect()
        held.execute(text("select 1"))
        assert len(open_connections(url, wait=0)) == 1
        held.close()
        assert open_connections(url, wait=5) == []
    finally:
        engine.dispose()
        drop_database(url)


def test_private_server_outage_and_recovery(tmp_path: Path) -> None:
    require_postgres()  # to show that the private server's outage leaves the shared one up
    server = PrivateServer(tmp_path)
    try:
        server.start()
        assert server.is_running()
        assert server.url == f"postgresql+psycopg2://postgres@127.0.0.1:{server.port}/hpo"
        assert server.port != 5432
        assert scalar(server.url, "select 1") == 1
        pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])

        assert timed(server.stop) < MAX_SECONDS
        assert not server.is_running()
        with pytest.raises(OperationalError):
            scalar(server.url, "select 1")
        assert server_available(), "stopping the private server must not touch the shared one"

        assert timed(server.start_again) < MAX_SECONDS
        assert server.is_running()
        assert scalar(server.url, "select 1") == 1
        pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])
        with pytest.raises(RuntimeError, match=r"pg_ctl start .*exit code 1"):
            server.start_again()  # already running: pg_ctl fails, its stderr is in the error
        assert server.is_running()
    finally:
        root = server.root
        server.destroy()

    assert not port_open(server.port)
    assert root is not None and not root.exists()
    assert not server.is_running()
    assert process_gone(pid)
    assert (tmp_path / "postgres.log").is_file()
    server.destroy()  # idempotent


def test_private_server_not_started(tmp_path: Path) -> None:
    server = PrivateServer(tmp_path)
    with pytest.raises(RuntimeError, match="not been started"):
        server.stop()
    server.destroy()  # never started: nothing to do


def test_a_missing_service_skips_its_test_with_the_reason_or_fails_it_in_ci(monkeypatch):
    from conftest import require

    monkeypatch.delenv("HPO_TESTS_REQUIRE_SERVICES", raising=False)
    require(True, "never said")
    with pytest.raises(pytest.skip.Exception, match="chromium is not installed"):
        require(False, "chromium is not installed")
    monkeypatch.setenv("HPO_TESTS_REQUIRE_SERVICES", "1")
    with pytest.raises(pytest.fail.Exception,
                       match=r"chromium is not installed \(HPO_TESTS_REQUIRE_SERVICES=1\)"):
        require(False, "chromium is not installed")
