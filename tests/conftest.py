"""Fixtures: one real cluster per PostgreSQL major, a fresh database per test.

OUTBOX_PG_MAJORS (default "15 16 18") chooses the majors; every test runs on each.
"""

from __future__ import annotations

import itertools
import os

import psycopg
import pytest

from support.kafka_cluster import KafkaCluster
from support.peers import create_sink
from support.pgcluster import Cluster, install_released_scripts
from support.versions import RELEASED

MAJORS = os.environ.get("OUTBOX_PG_MAJORS", "15 16 18").split()
# The servers inherit it: as on a developer's machine, an error pgrx catches and raises again
# would show a Rust backtrace (tests/test_claim.py checks that claims' errors do not).
os.environ.setdefault("RUST_BACKTRACE", "1")
TEMPLATE = "outbox_template"
DELIVER_DB = "deliver_db"
SECURITY_DB = "security_db"  # tests/test_security.py plants hostile objects there
_counter = itertools.count()


# Tests marked every_release (parametrized by a released version, "old") run for every release
# on the oldest and the newest major; on a major between, for the releases whose scripts or
# dumps changed shape (the first, 0.6.0's first dump with rows, 0.18.0 and 0.19.0 around the
# foreign keys) and the last three. A version's upgrade script is the same SQL on every major:
# what a major changes shows on its own and the newest's in any release.
MIDDLE_MAJOR_RELEASES = {RELEASED[0], "0.6.0", "0.18.0", "0.19.0", *RELEASED[-3:]}


# scripts/test runs the suite as two pytest processes side by side (OUTBOX_TEST_HALF=1 and 2):
# most tests wait on servers more than they compute, and 2 cores run two at once. The first half
# has every test that needs the Kafka cluster, Debezium or Go (one Kafka cluster for the run: three
# JVMs are the heaviest thing here), then the longest matrices to even out the halves.
HALF = os.environ.get("OUTBOX_TEST_HALF")
FIRST_HALF_MODULES = {"test_debezium", "test_example_go", "test_backup", "test_upgrade", "test_metrics"}


def in_first_half(item) -> bool:
    return "kafka" in getattr(item, "fixturenames", ()) or item.module.__name__ in FIRST_HALF_MODULES


def pytest_configure(config):
    config.addinivalue_line("markers", "every_release: parametrized by every released version (see conftest)")


def pytest_collection_modifyitems(config, items):
    middle = set(MAJORS) - {min(MAJORS, key=int), max(MAJORS, key=int)}

    def skipped_release(item) -> bool:
        return (item.get_closest_marker("every_release") is not None and hasattr(item, "callspec")
                and item.callspec.params.get("cluster") in middle
                and item.callspec.params.get("old") not in MIDDLE_MAJOR_RELEASES)

    def other_half(item) -> bool:
        return HALF is not None and in_first_half(item) != (HALF == "1")

    deselected = [item for item in items if skipped_release(item) or other_half(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        gone = set(deselected)
        items[:] = [item for item in items if item not in gone]


# A failing test's report carries what the server logged while it ran (the worker's warnings
# above all): in CI the cluster's directory is gone by the time anyone reads the report.
LOG_TAIL = 200


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    cluster = item.funcargs.get("cluster")
    item.log_offset = cluster.log_file.stat().st_size if cluster and cluster.log_file.exists() else None
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    cluster = item.funcargs.get("cluster") if hasattr(item, "funcargs") else None
    offset = getattr(item, "log_offset", None)
    if report.when == "call" and report.failed and cluster and offset is not None:
        lines = cluster.log_file.read_bytes()[offset:].decode(errors="replace").splitlines()
        report.sections.append(("server log during the test", "\n".join(lines[-LOG_TAIL:])))


@pytest.fixture(scope="session", params=MAJORS, ids=[f"pg{m}" for m in MAJORS])
def cluster(request):
    install_released_scripts(request.param)
    # the background worker serves these databases (the worker_db fixture, below, creates worker_db;
    # deliver_db, below, is where the delivery tests create their sinks)
    c = Cluster(request.param, {"outbox_ext.databases": f"'worker_db, {DELIVER_DB}, {SECURITY_DB}'",
                                "outbox_ext.maintain_interval": "1",
                                "wal_level": "logical"}).init()  # tests/test_cdc.py decodes the log
    c.start()
    with c.connect() as conn:
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    with c.connect(TEMPLATE) as conn:
        conn.execute("CREATE EXTENSION outbox_ext")
        conn.execute("SELECT * FROM outbox.maintain()")  # partitions (the worker makes them too)
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
def new_database(cluster):
    """new_database(template=None) makes an empty database, or a copy of template; all are
    dropped after the test."""
    names = []

    def make(template: str | None = None) -> str:
        names.append(f"db{next(_counter)}_{os.getpid()}")
        with cluster.connect() as conn:
            conn.execute(f"CREATE DATABASE {names[-1]}" + (f" TEMPLATE {template}" if template else ""))
        return names[-1]

    yield make
    with cluster.connect() as conn:
        for name in names:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


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


@pytest.fixture(scope="session")
def deliver_db(cluster):
    """The database the worker delivers from; tests add sinks of their own (see new_sink)."""
    with cluster.connect() as conn:
        conn.execute(f"CREATE DATABASE {DELIVER_DB} TEMPLATE {TEMPLATE}")
    return DELIVER_DB


@pytest.fixture
def conn(cluster, deliver_db):
    """An autocommit superuser connection to deliver_db."""
    with cluster.connect(deliver_db) as c:
        yield c


@pytest.fixture
def new_sink(cluster, deliver_db):
    """new_sink(kind, url, **options) creates a sink in deliver_db (retries fast by default) and
    returns its name; every sink is dropped after the test."""
    names = []

    def make(kind: str, url: str, **options) -> str:
        with cluster.connect(deliver_db) as conn:
            names.append(create_sink(conn, f"s{next(_counter)}", kind, url, **options))
        return names[-1]

    yield make
    with cluster.connect(deliver_db) as conn:
        for name in names:
            conn.execute("SELECT outbox.drop_sink(%s)", (name,))


@pytest.fixture(scope="session")
def kafka():
    """A real 3-node Apache Kafka cluster (support/kafka_cluster.py), one for the whole run:
    started on first use, it takes about half a minute. A test that stops or pauses nodes
    starts them again before it ends."""
    cluster = KafkaCluster()
    yield cluster
    cluster.close()


@pytest.fixture
def worker_db(cluster):
    with cluster.connect() as conn:
        conn.execute("DROP DATABASE IF EXISTS worker_db WITH (FORCE)")
        conn.execute("CREATE DATABASE worker_db")
    yield "worker_db"
    with cluster.connect() as conn:
        conn.execute("DROP DATABASE IF EXISTS worker_db WITH (FORCE)")
