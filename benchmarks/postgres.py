"""PostgreSQL helpers for the tests and the soak (benchmarks/soak.py): throwaway databases on
the shared server at 127.0.0.1:5432, and a private, disposable PostgreSQL instance for what
takes the database down. Here, beside the soak, so that a benchmark imports nothing from
tests/; the tests find it through pytest's `pythonpath`."""

from __future__ import annotations

import gc
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

SERVER_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432"
CONNECT_TIMEOUT = 3  # seconds


def _execute(url: str, *statements: str, **params: str) -> None:
    """Run statements outside a transaction (AUTOCOMMIT), as CREATE/DROP DATABASE require."""
    engine = create_engine(
        url,
        isolation_level="AUTOCOMMIT",
        poolclass=NullPool,
        connect_args={"connect_timeout": CONNECT_TIMEOUT},
    )
    try:
        with engine.connect() as connection:
            for statement in statements:
                connection.execute(text(statement), params)
    finally:
        engine.dispose()


def _quote(name: str) -> str:
    """Quote a PostgreSQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def server_available() -> bool:
    """Whether the shared server at SERVER_URL accepts a connection within 3 s."""
    try:
        _execute(f"{SERVER_URL}/postgres", "select 1")
    except OperationalError:
        return False
    return True


def fresh_database(prefix: str = "hpo_test") -> str:
    """Create a uniquely named database on the shared server and return its SQLAlchemy URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    _execute(f"{SERVER_URL}/postgres", f"CREATE DATABASE {_quote(name)}")
    return f"{SERVER_URL}/{name}"


def open_connections(url: str, wait: float = 10.0, collect: bool = True) -> list[str]:
    """Connections still open to the database at url, after a garbage collection (a storage
    nobody references closes its pool then; `collect` False: none) and up to `wait` seconds
    for exiting processes."""
    parsed = make_url(url)
    admin = parsed.set(database="postgres").render_as_string(hide_password=False)
    engine = create_engine(admin, poolclass=NullPool,
                           connect_args={"connect_timeout": CONNECT_TIMEOUT})
    query = text("select application_name, state, left(query, 80) from pg_stat_activity"
                 " where datname = :name and pid <> pg_backend_pid()")
    deadline = time.monotonic() + wait
    try:
        while True:
            if collect:
                gc.collect()
            with engine.connect() as connection:
                rows = connection.execute(query, {"name": parsed.database}).all()
            if not rows or time.monotonic() >= deadline:
                return [" | ".join(str(v) for v in row) for row in rows]
            time.sleep(0.5)
    finally:
        engine.dispose()


def study_trials(url: str, study: str) -> list:
    """The trials of `study` at url, read over one connection that is closed before the
    return: a poll that opened a pooled storage each time would hold connections until a
    garbage collection (an RDBStorage closes none when dropped), and a server's
    `max_connections` is shared with the workers under test."""
    import optuna

    storage = optuna.storages.RDBStorage(url, engine_kwargs={"poolclass": NullPool})
    try:
        return storage.get_all_trials(storage.get_study_id_from_name(study), deepcopy=False)
    finally:
        storage.remove_session()
        storage.engine.dispose()


def drop_database(url: str) -> None:
    """Drop the database at url after terminating its connections; a missing one is fine."""
    parsed = make_url(url)
    name = parsed.database
    _execute(
        parsed.set(database="postgres").render_as_string(hide_password=False),
        "select pg_terminate_backend(pid) from pg_stat_activity"
        " where datname = :name and pid <> pg_backend_pid()",
        f"DROP DATABASE IF EXISTS {_quote(name)}",
        name=name,
    )


def postgres_bin_dir() -> Path | None:
    """The newest PostgreSQL server binary directory (Debian layout, else PATH), or None."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
        key=lambda p: [int(part) for part in p.parents[1].name.split(".") if part.isdigit()],
    )
    if found:
        return found[-1].parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PrivateServer:
    """A throwaway PostgreSQL instance on its own port, which tests may stop and restart.

    The data directory lives in a fresh /tmp directory owned by the ``postgres`` OS user
    (pytest's tmp dirs are root-only); ``base_dir`` receives a copy of the server log on
    ``destroy()`` so a failed run can be diagnosed.
    """

    def __init__(self, base_dir: Path | str, max_connections: int = 200) -> None:
        self.base_dir = Path(base_dir)
        self.max_connections = max_connections
        self.root: Path | None = None
        self.port: int | None = None

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (exists only after start())."""
        if self.root is None:
            raise RuntimeError("PrivateServer has not been started")
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        """The server log, inside the data directory."""
        return self.data_dir / "server.log"

    def url_of(self, database: str) -> str:
        """SQLAlchemy URL of a database on this server."""
        if self.port is None:
            raise RuntimeError("PrivateServer has not been started")
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the database ``hpo`` on this server."""
        return self.url_of("hpo")

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a PostgreSQL binary as the postgres OS user (when we are root)."""
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            raise RuntimeError("no PostgreSQL binaries found (initdb, pg_ctl)")
        command = [str(bin_dir / tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(
            command,
            cwd=self.root,
            env={k: v for k, v in os.environ.items() if not k.startswith("PG")},
            capture_output=True,
            text=True,
            timeout=90,
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(command)} failed with exit code {result.returncode}:\n"
                f"{result.stderr.strip() or result.stdout.strip()}{self._log_tail()}"
            )
        return result

    def _log_tail(self, lines: int = 30) -> str:
        """The end of the server log, for error messages."""
        if self.root is None or not self.log_file.exists():
            return ""
        tail = self.log_file.read_text(errors="replace").splitlines()[-lines:]
        return "\nserver log (" + str(self.log_file) + "):\n" + "\n".join(tail)

    def _pg_ctl_start(self) -> None:
        options = (
            f"-p {self.port} -k {shlex.quote(str(self.root))} -c listen_addresses=127.0.0.1"
            f" -c fsync=off -c max_connections={self.max_connections}"
        )
        where = ["-D", str(self.data_dir), "-l", str(self.log_file)]
        self._run("pg_ctl", "start", "-w", "-t", "30", *where, "-o", options)

    def start(self) -> None:
        """Create the cluster (initdb, trust auth, UTF8), start it and create database hpo."""
        if self.root is not None:
            raise RuntimeError("PrivateServer.start() runs once; use start_again() after stop()")
        self.root = Path(tempfile.mkdtemp(prefix="hpo-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.root, user="postgres", group="postgres")
        self.port = free_port()
        settings = ["-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-locale", "--no-sync"]
        self._run("initdb", "-D", str(self.data_dir), *settings)
        self._pg_ctl_start()
        _execute(self.url_of("postgres"), "CREATE DATABASE hpo")

    def stop(self) -> None:
        """Stop the server (fast shutdown, waits until it is down): simulates an outage."""
        self._run("pg_ctl", "stop", "-m", "fast", "-w", "-t", "30", "-D", str(self.data_dir))

    def start_again(self) -> None:
        """Restart a stopped server on the same data directory and port."""
        self._pg_ctl_start()

    def is_running(self) -> bool:
        """Whether the server process is up (``pg_ctl status``)."""
        if self.root is None or not self.data_dir.exists():
            return False
        return self._run("pg_ctl", "status", "-D", str(self.data_dir), check=False).returncode == 0

    def destroy(self) -> None:
        """Stop the server if it runs and delete its files, keeping the log in base_dir."""
        if self.root is None or not self.root.exists():
            return
        if self.is_running():
            self.stop()
        if self.log_file.exists() and self.base_dir.is_dir():
            shutil.copyfile(self.log_file, self.base_dir / "postgres.log")
        shutil.rmtree(self.root)
