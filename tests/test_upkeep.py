"""No role stops the outbox's upkeep or holds a role of ours on the side: a role that holds the
locks the worker and maintain() used to take (advisory locks anyone can take), calls itself
pg_restore, or feeds the inbox ids from thousands of distinct days, keeps neither the worker out
of its database nor maintain() from running to the end; CREATE EXTENSION refuses a role of ours
that someone else may grant."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from sinks import wait_for
from test_worker import worker_db, worker_pid  # noqa: F401 (a fixture)


def maintain(conn) -> list[tuple]:
    return conn.execute("SELECT action, relation, detail FROM outbox.maintain()").fetchall()


def dated_partitions(conn) -> int:
    return conn.execute("SELECT count(*) FROM outbox.partitions WHERE NOT is_default").fetchone()[0]


def test_no_role_keeps_the_worker_out_of_its_database(cluster, worker_db):
    """The worker used to hold a session advisory lock of a fixed key for its life, and leave
    when it could not take it: a role queued for that lock took it when the worker restarted."""
    first = wait_for(lambda: worker_pid(cluster))
    nobody = cluster.connect(worker_db, user="nobody_user")
    try:
        queued = threading.Thread(target=nobody.execute,
                                  args=("SELECT pg_advisory_lock(hashtext('outbox_ext worker'))",))
        queued.start()
        time.sleep(0.5)
        with cluster.connect() as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (first,))
        queued.join(10)
        assert not queued.is_alive(), "the role holds the lock"
        wait_for(lambda: (pid := worker_pid(cluster)) and pid != first, timeout=20)
        with cluster.connect(worker_db) as db:
            db.execute("CREATE EXTENSION outbox_ext")
            assert dated_partitions(db) == 0
            # the worker's outbox.maintain() makes them
            wait_for(lambda: dated_partitions(db) > 0, timeout=15)
    finally:
        nobody.close()


@pytest.mark.parametrize("user, how", [
    ("nobody_user", "SELECT pg_advisory_lock(hashtext('outbox.maintain'))"),
    ("nobody_user", "SET application_name = 'pg_restore'"),
    # statements it may not run still lock what they name when prepared
    ("relay_user", "PREPARE p AS SELECT * FROM outbox.partition_config FOR UPDATE"),
    ("relay_user", "PREPARE p AS DELETE FROM outbox.partition_config"),
])
def test_no_role_makes_maintain_skip(connect, db, user, how):
    other = connect(user, autocommit=False)
    other.execute(how)   # held until its transaction (or session) ends
    actions = maintain(db)
    assert not [a for a in actions if a[0] == "skipped"], actions


def test_a_restore_still_makes_maintain_skip(connect, db):
    restorer = connect()   # a superuser, as a restore runs
    restorer.execute("SET application_name = 'pg_restore'")
    assert maintain(db) == [("skipped", None, "a restore into this database is running")]


def test_inbox_ids_from_thousands_of_days_cannot_break_maintain(connect, db):
    """Callers choose inbox ids: one partition per distinct day of theirs made maintain() fail
    (out of shared memory) on every run. They stay deduplicated in the default partition."""
    producer = connect("producer_user")
    claimed = producer.execute("""
        SELECT count(*) FILTER (WHERE inbox.claim(inbox.uuid_at(date_trunc('day', now()) + d * interval '1 day'), 'c'))
          FROM generate_series(-3000, 3000) d WHERE abs(d) > 10""").fetchone()[0]
    assert claimed == 5980
    before = dated_partitions(db)
    actions = maintain(db)
    assert not [a for a in actions if a[0] in ("moved", "skipped")], actions
    assert dated_partitions(db) == before
    again = producer.execute("""
        SELECT count(*) FILTER (WHERE inbox.claim(inbox.uuid_at(date_trunc('day', now()) + d * interval '1 day'), 'c'))
          FROM generate_series(-3000, 3000) d WHERE abs(d) > 10""").fetchone()[0]
    assert again == 0, "every one still deduplicated"
    # and maintain goes on making what it should
    db.execute("UPDATE outbox.partition_config SET ahead = 12 WHERE parent = 'inbox.messages'::regclass")
    assert [a for a, *_ in maintain(db)].count("moved") == 2   # days 11 and 12


def test_a_role_of_ours_that_someone_else_may_grant_is_refused(cluster, new_database):
    """On PostgreSQL 16 and later, a CREATEROLE holder that made outbox_admin before the
    extension keeps ADMIN on it, and could give itself the role once it holds privileges."""
    with cluster.connect() as conn:
        conn.execute("DO $$ BEGIN CREATE ROLE early_bird LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        conn.execute("GRANT outbox_admin TO early_bird WITH ADMIN OPTION")
    try:
        with cluster.connect(new_database()) as db:
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as err:
                db.execute("CREATE EXTENSION outbox_ext")
            assert 'role "early_bird" may grant it' in err.value.diag.message_primary
            assert "REVOKE ADMIN OPTION FOR outbox_admin FROM early_bird" in err.value.diag.message_hint
    finally:
        with cluster.connect() as conn:
            conn.execute("REVOKE outbox_admin FROM early_bird")
    with cluster.connect(new_database()) as db:
        db.execute("CREATE EXTENSION outbox_ext")
