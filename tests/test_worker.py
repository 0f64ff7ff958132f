"""The background worker, as real processes: it waits quietly for CREATE EXTENSION (and, after
a library upgrade, for ALTER EXTENSION UPDATE), runs outbox.maintain() on its schedule, comes
back after being killed or after a restart of the server, follows outbox_ext.databases on
SIGHUP, and shows itself in pg_stat_activity."""

from __future__ import annotations

import time

import pytest

from support.db import cpu_seconds, worker_pid
from support.peers import Receiver, check_delivery, create_sink, wait_for
from support.versions import NEW, RELEASED


def test_waits_quietly_for_create_extension_then_runs_maintenance(cluster, worker_db):
    log_start = len(cluster.log())
    wait_for(lambda: worker_pid(cluster))
    wait_for(lambda: "waiting for CREATE EXTENSION outbox_ext in \"worker_db\"" in cluster.log()[log_start:])
    cpu_before = cpu_seconds(worker_pid(cluster))
    time.sleep(2)
    assert cpu_seconds(worker_pid(cluster)) - cpu_before < 0.1, "waiting costs next to no CPU"
    assert "ERROR" not in cluster.log()[log_start:] and "FATAL" not in cluster.log()[log_start:]
    with cluster.connect(worker_db) as db:
        db.execute("CREATE EXTENSION outbox_ext")
        db.execute("""INSERT INTO outbox.events (id, aggregate_type, aggregate_id, event_type, payload, created_at, shard)
                      VALUES (outbox.uuid_v7(), 'order', 'k', 'e', '{}', now() + interval '40 days', outbox.shard_of('k'))""")

        def moved():
            """the worker's outbox.maintain() to move the row out of the default partition"""
            # a query planned just before maintain attaches the new partition sees no row at all
            row = db.execute("SELECT tableoid::regclass::text FROM outbox.events").fetchone()
            return row is not None and row[0] != "outbox.events_default"
        wait_for(moved, timeout=15)
    assert "outbox_ext maintain: moved" in cluster.log()[log_start:]


def test_an_extension_at_another_version_than_its_library_is_left_alone_until_updated(cluster, worker_db):
    """After a library upgrade the SQL is still the old version's until ALTER EXTENSION UPDATE:
    the worker says so once and leaves the database alone; emit goes on, and the update
    brings delivery back with nothing lost and each key in order. Likewise when the SQL
    moves on under a running worker."""
    old = RELEASED[-1]
    receiver = Receiver()
    log_start = len(cluster.log())
    try:
        with cluster.connect(worker_db) as db:
            db.execute(f"CREATE EXTENSION outbox_ext VERSION '{old}'")
            db.execute("SELECT * FROM outbox.maintain()")
            create_sink(db, "hook", "webhook", receiver.url)
            emitted = {f"k{k}": [str(db.execute("SELECT outbox.emit('order', %s, 'e', %s)",
                                                (f"k{k}", f'{{"i": {i}}}')).fetchone()[0])
                                 for i in range(5)] for k in range(4)}
            said = f'"worker_db" has outbox_ext {old} and the library is {NEW}'
            wait_for(lambda: said in cluster.log()[log_start:])
            wait_for(lambda: db.execute("SELECT query FROM pg_stat_activity WHERE pid = %s",
                                        (worker_pid(cluster),)).fetchone()[0]
                     == "waiting for ALTER EXTENSION outbox_ext UPDATE")
            time.sleep(2)
            assert receiver.accepted_events() == [], "delivered through SQL of another version"
            log = cluster.log()[log_start:]
            assert log.count(said) == 1, "said once"
            assert "HINT:  Run ALTER EXTENSION outbox_ext UPDATE in \"worker_db\"." in log
            assert "ERROR" not in log

            db.execute("ALTER EXTENSION outbox_ext UPDATE")
            wait_for(lambda: len(receiver.accepted_events()) >= 20)
            check_delivery(emitted, receiver.accepted_events())

            # an UPDATE while the server still runs the library of before (here: the catalog
            # says so) is seen on maintain's schedule
            db.execute("UPDATE pg_catalog.pg_extension SET extversion = '99.0' WHERE extname = 'outbox_ext'")
            wait_for(lambda: f'"worker_db" has outbox_ext 99.0 and the library is {NEW}'
                     in cluster.log()[log_start:])
            later = [str(db.execute("SELECT outbox.emit('order', 'k0', 'e', '{}')").fetchone()[0])]
            time.sleep(2)
            assert len(receiver.accepted_events()) == 20, "delivered through SQL of another version"
            db.execute("UPDATE pg_catalog.pg_extension SET extversion = %s WHERE extname = 'outbox_ext'", (NEW,))
            wait_for(lambda: len(receiver.accepted_events()) >= 21)
            emitted["k0"] += later
            check_delivery(emitted, receiver.accepted_events())
    finally:
        receiver.close()


def test_shows_itself_in_pg_stat_activity(cluster, worker_db):
    wait_for(lambda: worker_pid(cluster))
    with cluster.connect() as conn:
        rows = conn.execute("SELECT backend_type, datname, query FROM pg_stat_activity "
                            "WHERE backend_type LIKE 'outbox_ext%' ORDER BY 1").fetchall()
    kinds = {r[0] for r in rows}
    assert kinds == {"outbox_ext launcher", "outbox_ext worker"}
    assert all(r[2] in ("idle", "outbox.maintain()", "starting workers") for r in rows)


def test_a_killed_worker_is_started_again(cluster, worker_db):
    first = wait_for(lambda: worker_pid(cluster))
    with cluster.connect() as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (first,))
    second = wait_for(lambda: (pid := worker_pid(cluster)) and pid != first and pid, timeout=20)
    assert second != first
    with cluster.connect() as conn:   # the cluster itself is fine
        assert conn.execute("SELECT 1").fetchone()[0] == 1


def launcher_pid(cluster):
    """the launcher's pid"""
    with cluster.connect() as conn:
        row = conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_ext launcher'").fetchone()
    return row and row[0]


def launcher_state(cluster):
    """what the launcher says it is doing"""
    with cluster.connect() as conn:
        row = conn.execute("SELECT query FROM pg_stat_activity WHERE backend_type = 'outbox_ext launcher'").fetchone()
    return row and row[0]


def test_a_killed_launcher_is_started_again_and_restarts_workers(cluster, worker_db):
    """A launcher stopped by pg_terminate_backend used to exit with status 0, which the
    postmaster never restarts: from then on no stopped worker was started again."""
    worker = wait_for(lambda: worker_pid(cluster))
    launcher = wait_for(lambda: launcher_pid(cluster))
    log_start = len(cluster.log())
    with cluster.connect() as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (launcher,))
    wait_for(lambda: (pid := launcher_pid(cluster)) and pid != launcher, timeout=20)
    wait_for(lambda: launcher_state(cluster) == "idle")   # its first round is done
    time.sleep(6)   # and a second (every 5 s)
    assert worker_pid(cluster) == worker, "the worker serving the database goes on"
    assert "serves this database already" not in cluster.log()[log_start:], \
        "the new launcher starts no second worker for a database served"
    with cluster.connect() as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (worker,))
    wait_for(lambda: (pid := worker_pid(cluster)) and pid != worker, timeout=20)


def test_sighup_serves_newly_listed_databases(cluster, worker_db):
    with cluster.connect() as conn:
        conn.execute("DROP DATABASE IF EXISTS worker_db2")
        conn.execute("CREATE DATABASE worker_db2")
        try:
            assert worker_pid(cluster, "worker_db2") is None
            conn.execute("ALTER SYSTEM SET outbox_ext.databases = 'worker_db, worker_db2, deliver_db'")
            conn.execute("SELECT pg_reload_conf()")
            wait_for(lambda: worker_pid(cluster, "worker_db2"), timeout=20)
        finally:
            conn.execute("ALTER SYSTEM RESET outbox_ext.databases")
            conn.execute("SELECT pg_reload_conf()")
            conn.execute("DROP DATABASE IF EXISTS worker_db2 WITH (FORCE)")


def test_a_listed_database_that_does_not_exist_is_reported_once(cluster, worker_db):
    wait_for(lambda: worker_pid(cluster))
    log_start = len(cluster.log())
    with cluster.connect() as conn:
        conn.execute("DROP DATABASE worker_db WITH (FORCE)")
    wait_for(lambda: 'database "worker_db" in outbox_ext.databases does not exist' in cluster.log()[log_start:])
    time.sleep(6)   # a launcher round later: no repeat, no crash loop
    assert cluster.log()[log_start:].count('"worker_db" in outbox_ext.databases does not exist') == 1
    # at most the one worker restarted while DROP DATABASE was under way fails to connect
    assert cluster.log()[log_start:].count("FATAL") <= 1


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_stops_cleanly_and_comes_back_after_a_server_restart(cluster, worker_db, mode):
    wait_for(lambda: worker_pid(cluster))
    log_start = len(cluster.log())
    cluster.restart(mode)
    if mode == "fast":
        assert 'outbox_ext worker for "worker_db" stopping' in cluster.log()[log_start:]
    wait_for(lambda: worker_pid(cluster), timeout=30)
