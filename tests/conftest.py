"""Fixtures: one real cluster per PostgreSQL major, a fresh database per test.

OUTBOX_PG_MAJORS (default "15 18") chooses the majors; every test runs on each.
"""

from __future__ import annotations

import itertools
import os

import psycopg
import pytest

from pgcluster import Cluster

MAJORS = os.environ.get("OUTBOX_PG_MAJORS", "15 18").split()
TEMPLATE = "outbox_template"
_counter = itertools.count()


@pytest.fixture(scope="session", params=MAJORS, ids=[f"pg{m}" for m in MAJORS])
def cluster(request):
    # the background worker serves these databases (tests/test_worker.py creates them)
    c = Cluster(request.param, {"outbox_ext.databases": "'worker_db'",
                                "outbox_ext.maintain_interval": "1"}).init()
    c.start()
    with c.connect() as conn:
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    with c.connect(TEMPLATE) as conn:
        conn.execute("CREATE EXTENSION outbox_ext")
        for role, member_of in [("producer_user", "outbox_producer"), ("relay_user", "outbox_relay"),
                                ("admin_user", "outbox_admin"), ("nobody_user", None)]:
            conn.execute(f"DO $$ BEGIN CREATE ROLE {role} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
            if member_of:
                conn.execute(f"GRANT {member_of} TO {role}")
    yield c
    c.destroy()


@pytest.fixture
def dbname(cluster):
    """A fresh database with outbox_ext installed, dropped after the test."""
    name = f"t{next(_counter)}_{os.getpid()}"
    with cluster.connect() as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    yield name
    with cluster.connect() as conn:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture
def db(cluster, dbname):
    """An autocommit superuser connection to the test's database."""
    with cluster.connect(dbname) as conn:
        yield conn


@pytest.fixture
def connect(cluster, dbname):
    """connect(user=..., autocommit=...) opens more connections to the test's database."""
    opened: list[psycopg.Connection] = []

    def _connect(user: str = "postgres", autocommit: bool = True) -> psycopg.Connection:
        conn = cluster.connect(dbname, user, autocommit)
        opened.append(conn)
        return conn

    yield _connect
    for conn in opened:
        conn.close()


def count_events(conn, where: str = "true", params=()) -> int:
    return conn.execute(f"SELECT count(*) FROM outbox.events WHERE {where}", params).fetchone()[0]
