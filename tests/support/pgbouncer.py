"""A real PgBouncer (Debian's pgbouncer 1.18) in front of a test database, run as the postgres
OS user (it refuses to run as root), in a directory of its own."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import psycopg

from .peers import wait_for
from .pgcluster import as_postgres, free_port

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


class Bouncer:
    """A PgBouncer pooling one database in transaction mode, with pool_size server connections
    per role and server_connections in all; connect() opens a client connection through it."""

    def __init__(self, dbname: str, pool_size: int, server_connections: int):
        self.dbname, self.pool_size, self.server_connections = dbname, pool_size, server_connections
        self.home = Path(tempfile.mkdtemp(prefix="outbox-pgbouncer-"))
        self.port = free_port()

    def start(self, server_port: int) -> None:
        (self.home / "userlist.txt").write_text('"producer_user" ""\n"relay_user" ""\n')
        (self.home / "pgbouncer.ini").write_text(f"""\
[databases]
{self.dbname} = host=127.0.0.1 port={server_port} dbname={self.dbname}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.home / 'userlist.txt'}
pool_mode = transaction
default_pool_size = {self.pool_size}
max_db_connections = {self.server_connections}
logfile = {self.home / 'pgbouncer.log'}
pidfile = {self.home / 'pgbouncer.pid'}
""")
        if os.geteuid() == 0:
            shutil.chown(self.home, "postgres", "postgres")
        as_postgres(PGBOUNCER, "-d", str(self.home / "pgbouncer.ini"))   # refuses to run as root

        def accepts() -> bool:
            """PgBouncer accepting connections"""
            try:
                self.connect("producer_user").close()
                return True
            except psycopg.OperationalError:
                return False

        wait_for(accepts, timeout=10, every=0.05)

    def connect(self, user: str, autocommit: bool = True, prepare_threshold: int | None = None) -> psycopg.Connection:
        """prepare_threshold=None: no server-side prepared statements (psycopg's default is 5)."""
        return psycopg.connect(f"host=127.0.0.1 port={self.port} dbname={self.dbname} user={user}",
                               autocommit=autocommit, prepare_threshold=prepare_threshold)

    def log(self) -> str:
        try:
            return (self.home / "pgbouncer.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        try:
            pid = int((self.home / "pgbouncer.pid").read_text())
        except (OSError, ValueError):
            pid = None
        if pid:
            os.kill(pid, signal.SIGTERM)   # immediate shutdown

            def gone() -> bool:
                """PgBouncer gone"""
                try:
                    os.kill(pid, 0)
                    return False
                except ProcessLookupError:
                    return True

            wait_for(gone, timeout=10, every=0.05)
        shutil.rmtree(self.home, ignore_errors=True)
