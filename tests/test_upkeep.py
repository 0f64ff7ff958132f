"""No role stops the outbox's upkeep or holds a role of ours on the side: a role that holds the
locks the worker and maintain() used to take (advisory locks anyone can take), calls itself
pg_restore, or feeds the inbox ids from thousands of distinct days, keeps neither the worker out
of its database nor maintain() from running to the end; no setting makes a run do more than a
bounded share of its work; CREATE EXTENSION refuses a role of ours that someone else may grant."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from support.db import worker_pid
from support.peers import wait_for


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


def test_a_role_flickering_the_lock_does_not_make_maintain_skip(connect, db):
    """A statement a role may not run still takes its lock before the check that refuses it
    (CREATE STATISTICS: SHARE UPDATE EXCLUSIVE, then "must be owner"). Repeated, it made the
    runs that came in that instant skip."""
    other = connect("relay_user")
    stop = threading.Event()
    tries = 0

    failed = []

    def flicker():
        nonlocal tries
        while not stop.is_set():
            try:
                other.execute("CREATE STATISTICS flicker ON width, ahead FROM outbox.partition_config")
                failed.append("it ran")
            except psycopg.errors.InsufficientPrivilege:
                tries += 1
            except Exception as e:   # noqa: BLE001 (reported below)
                failed.append(repr(e))
                return

    thread = threading.Thread(target=flicker)
    thread.start()
    try:
        actions = [a for _ in range(200) for a in maintain(db)]
    finally:
        stop.set()
        thread.join()
    assert not failed and tries > 200, (failed, tries)
    assert not [a for a in actions if a[0] == "skipped"]


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


PER_RUN = 100   # partitions one run of maintain() drops, moves rows into or creates


def one_minute_events(db, **settings) -> None:
    """event partitions one minute wide from now on, in place of the day-wide ones made at
    install (empty): what they cover no minute partition is made for"""
    for (part,) in db.execute("""SELECT partition FROM outbox.partitions
                                  WHERE parent = 'outbox.events'::regclass AND NOT is_default""").fetchall():
        db.execute(f"DROP TABLE {part}")
    db.execute("DELETE FROM outbox._reach")   # their recorded reach goes with them
    sets = ", ".join(f"{k} = %({k})s" for k in settings)
    db.execute(f"UPDATE outbox.partition_config SET width = '1 minute', {sets} WHERE parent = 'outbox.events'::regclass",
               settings)


def minute_partitions(db) -> list:
    """lower bounds of the event partitions one minute wide, in order"""
    return [r[0] for r in db.execute("""
        SELECT lower FROM outbox.partitions WHERE parent = 'outbox.events'::regclass
           AND upper - lower = interval '1 minute' ORDER BY lower""")]


def counted(actions, verb, detail="") -> int:
    return sum(1 for a in actions if a[0] == verb and a[1] != "inbox.messages" and detail in (a[2] or ""))


def test_a_huge_ahead_is_made_a_bounded_share_per_run_nearest_first(db):
    """ahead = 100000 used to make every run fail (out of shared memory) and so make nothing."""
    one_minute_events(db, ahead=100000)
    before = db.execute("SELECT date_trunc('minute', now())").fetchone()[0]
    first = maintain(db)
    after = db.execute("SELECT date_trunc('minute', now())").fetchone()[0]
    assert counted(first, "created") == PER_RUN
    assert ("deferred", "outbox.events", "more partitions to create than one run takes: the next run goes on") in first
    made = minute_partitions(db)
    assert made[0] in (before, after), "the partition of now first"
    assert len(made) == PER_RUN
    assert all((b - a).total_seconds() == 60 for a, b in zip(made, made[1:])), "the nearest ones, with no gap"
    second = maintain(db)
    assert counted(second, "created") == PER_RUN and counted(second, "deferred") == 1
    assert minute_partitions(db)[:PER_RUN] == made and len(minute_partitions(db)) == 2 * PER_RUN


def test_a_retention_cut_far_back_drops_a_bounded_share_per_run(db):
    one_minute_events(db, ahead=2)
    db.execute("""SELECT count(outbox_internal._create_partition('outbox.events',
                         date_trunc('minute', now()) - g * interval '1 minute', '1 minute'))
                    FROM generate_series(10, 259) g""")
    assert len(minute_partitions(db)) == 250
    db.execute("UPDATE outbox.partition_config SET retention = '5 minutes' WHERE parent = 'outbox.events'::regclass")
    runs = [maintain(db) for _ in range(3)]
    assert [counted(r, "dropped") for r in runs] == [PER_RUN, PER_RUN, 50]
    assert [counted(r, "deferred", "past retention") for r in runs] == [1, 1, 0]
    # the partitions of now and the next minute are made though the drops took the run's share
    assert counted(runs[0], "created") == 2
    oldest = db.execute("""SELECT min(lower) FROM outbox.partitions WHERE parent = 'outbox.events'::regclass
                            AND NOT is_default""").fetchone()[0]
    assert oldest >= db.execute("SELECT date_trunc('minute', now()) - interval '10 minutes'").fetchone()[0]


def test_a_default_partition_holding_rows_of_many_ranges_is_moved_a_bounded_share_per_run(db):
    one_minute_events(db, ahead=2)
    db.execute("""INSERT INTO outbox.events (id, aggregate_type, aggregate_id, event_type, payload, created_at, shard)
                  SELECT outbox.uuid_v7(), 'order', 'k', 'e', '{}', now() + interval '30 days' + g * interval '1 minute',
                         outbox.shard_of('k')
                    FROM generate_series(1, 150) g""")
    runs = [maintain(db), maintain(db)]
    assert [counted(r, "moved") for r in runs] == [PER_RUN, 50]
    assert [counted(r, "deferred", "default partition") for r in runs] == [1, 0]
    assert db.execute("SELECT count(*) FROM outbox.events_default").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 150


def test_a_retention_ahead_of_now_this_month_drops_nothing_current(db):
    """'-1 mon +30 days' passes the CHECK (retention >= 0: a month counts 30 days) and yet
    lies a day ahead of now in months of 31 days: it used to drop the inbox partition of now
    (forgetting the ids it deduplicates) and the ones ahead, which the same run made again."""
    retention = "-1 mon +30 days"
    if not db.execute("SELECT now() - %s::interval > now()", (retention,)).fetchone()[0]:
        pytest.skip("the interval does not lie ahead of now in this month")
    assert db.execute("SELECT inbox.claim(outbox.uuid_v7(), 'c')").fetchone()[0]
    db.execute("UPDATE outbox.partition_config SET retention = %s", (retention,))
    actions = maintain(db)
    assert not [a for a in actions if a[0] in ("dropped", "detached", "created")], actions


def test_the_worker_goes_on_at_once_with_what_a_run_deferred(cluster, worker_db):
    with cluster.connect() as conn:
        conn.execute("ALTER SYSTEM SET outbox_ext.maintain_interval = 3600")
        conn.execute("SELECT pg_reload_conf()")
    try:
        with cluster.connect(worker_db, autocommit=False) as db:
            # in the transaction that installs it: the worker's first run finds the setting
            db.execute("CREATE EXTENSION outbox_ext")
            one_minute_events(db, ahead=250)
            db.commit()
            db.autocommit = True
            wait_for(lambda: len(minute_partitions(db)) >= 251, timeout=60)   # in three runs
    finally:
        with cluster.connect() as conn:
            conn.execute("ALTER SYSTEM RESET outbox_ext.maintain_interval")
            conn.execute("SELECT pg_reload_conf()")


def test_a_role_of_ours_that_someone_else_may_grant_is_refused(cluster, new_database):
    """On PostgreSQL 16 and later, a CREATEROLE holder that made outbox_admin before the
    extension keeps ADMIN on it, and could give itself the role once it holds privileges. The
    hint's REVOKE works as written, also once that role has granted outbox_admin on."""
    with cluster.connect() as conn:
        for role in ("early_bird", "early_friend"):
            conn.execute(f"DO $$ BEGIN CREATE ROLE {role} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        conn.execute("GRANT outbox_admin TO early_bird WITH ADMIN OPTION")
        conn.execute("SET ROLE early_bird")
        conn.execute("GRANT outbox_admin TO early_friend")
        conn.execute("RESET ROLE")
    try:
        with cluster.connect(new_database()) as db:
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as err:
                db.execute("CREATE EXTENSION outbox_ext")
            assert 'role "early_bird" may grant it' in err.value.diag.message_primary
            hint = err.value.diag.message_hint
            assert "REVOKE ADMIN OPTION FOR outbox_admin FROM early_bird CASCADE" in hint
            db.execute(hint.split(": ", 1)[1].split(";")[0])   # the hint's statement, as written
            db.execute("CREATE EXTENSION outbox_ext")
    finally:
        with cluster.connect() as conn:
            conn.execute("REVOKE outbox_admin FROM early_bird CASCADE")
            conn.execute("REVOKE outbox_admin FROM early_friend")
    with cluster.connect(new_database()) as db:
        db.execute("CREATE EXTENSION outbox_ext")


@pytest.mark.parametrize("setting", [
    "partition_config SET ahead = 2000000000",            # maintain() made a series of 2e9 times
    "partition_config SET width = '1 mon -28 days'",       # advances by nothing in February
    "partition_config SET width = '100000 days'",          # bounds out of range: every run failed
    "partition_config SET retention = '1000000 years'",    # now() - retention out of range
    "consumers SET backoff_max = '1000000 days'",          # every settle of a failure failed
    "consumers SET backoff_base = '2 hours', backoff_max = '1 hour'",
])
def test_an_admin_cannot_write_a_setting_that_stops_maintain_or_settles(db, connect, setting):
    db.execute("SELECT outbox.create_consumer('c')")
    admin = connect("admin_user")
    with pytest.raises(psycopg.errors.CheckViolation):
        admin.execute(f"UPDATE outbox.{setting}")
