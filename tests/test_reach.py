"""Reach (outbox._reach): claims, settles and status skip the partitions ahead of now, which
they would otherwise open and read in every statement, and nothing is lost for it: an event
that lands ahead of the clock (a clock that once ran ahead) records how far, in its own
transaction, and is claimed like any other; maintain() turns that recording off as a
partition's time nears."""

from __future__ import annotations

import time

import psycopg

from support.db import insert_event_at, partitions_scanned
from support.relay import Relay

AHEAD = 20  # one-minute partitions made ahead


def one_minute_partitions(db, ahead: int = AHEAD, width: str = "1 minute") -> None:
    """Only partitions of a width, from this one on, ahead more of them, as if the database
    had had no others: the reach recorded for the daily ones goes with them (it only grows)."""
    for (part,) in db.execute("SELECT partition::text FROM outbox.partitions"
                              " WHERE parent = 'outbox.events'::regclass AND NOT is_default").fetchall():
        db.execute(f"DROP TABLE {part}")
    db.execute("DELETE FROM outbox._reach")
    db.execute("UPDATE outbox.partition_config SET width = %s, ahead = %s"
               " WHERE parent = 'outbox.events'::regclass", (width, ahead))
    db.execute("SELECT * FROM outbox.maintain()")


def reach(db):
    return db.execute("SELECT max(upper) FROM outbox._reach").fetchone()[0]


def armed(db) -> list[str]:
    """The events partitions whose reach trigger is on."""
    return [r[0] for r in db.execute("""
        SELECT p.partition::text FROM outbox.partitions p
          JOIN pg_trigger t ON t.tgrelid = p.partition AND t.tgname = 'outbox_reach' AND t.tgenabled = 'A'
         WHERE p.parent = 'outbox.events'::regclass AND NOT p.is_default ORDER BY p.lower""").fetchall()]


def scanned_ahead(db, sql: str, *args) -> int:
    """How many partitions a minute or more ahead of now sql's scans visit."""
    return partitions_scanned(db, "p.lower >= now() + interval '1 minute'", sql, *args)


def test_claims_settles_and_status_skip_the_partitions_ahead_of_the_reach(db):
    db.execute("SELECT outbox.create_consumer('c')")
    one_minute_partitions(db)
    ahead = len(armed(db))
    assert ahead >= AHEAD - 2, "the partitions a minute or more ahead record their reach"
    for i in range(20):
        db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (f"k{i}",))
    relay = Relay(db, "c", batch_size=10)
    batch = relay.claim()
    assert batch
    assert scanned_ahead(db, "SELECT * FROM outbox.claim('c', 10)") == 0
    assert scanned_ahead(db, "SELECT outbox.settle('c', %s, %s, '[]')", batch[0].shard, batch[0].epoch) == 0
    assert scanned_ahead(db, "SELECT * FROM outbox.status") == 0
    assert scanned_ahead(db, "SELECT * FROM outbox.shard_status") == 0
    # without a reach every partition ahead is read again: what it saves
    db.execute("DELETE FROM outbox._reach")
    assert scanned_ahead(db, "SELECT * FROM outbox.claim('c', 10)") >= ahead - 1
    relay.settle(batch[0].shard, batch[0].epoch)
    assert len(relay.drain()) == 20 - len(batch)


def test_an_event_ahead_of_the_clock_is_claimed_in_its_keys_order(db):
    db.execute("SELECT outbox.create_consumer('c')")
    one_minute_partitions(db)
    before = reach(db)
    # a clock ten minutes ahead when this was written: it lands in a partition ahead
    insert_event_at(db, "k", "10 minutes")
    part = db.execute("SELECT tableoid::regclass::text FROM outbox.events").fetchone()[0]
    assert part in armed(db)
    db.execute("SELECT outbox.emit('order', 'k', 'second', '{}')")
    db.execute("SELECT outbox.emit('order', 'other', 'e', '{}')")
    got = Relay(db, "c", batch_size=10).drain()
    assert [(e.aggregate_id, e.event_type) for e in got if e.aggregate_id == "k"] == [("k", "e"), ("k", "second")]
    assert len(got) == 3
    assert reach(db) > before  # what let the claims see it


def test_an_event_beyond_every_partition_is_claimed(db):
    db.execute("SELECT outbox.create_consumer('c')")
    one_minute_partitions(db)
    insert_event_at(db, "far", "40 days")
    assert db.execute("SELECT tableoid::regclass::text FROM outbox.events").fetchone()[0] == "outbox.events_default"
    db.execute("SELECT outbox.emit('order', 'near', 'e', '{}')")
    assert sorted(e.aggregate_id for e in Relay(db, "c").drain()) == ["far", "near"]


def test_rows_that_came_in_with_the_trigger_off_are_bounded_by_maintain(db):
    """Rows moved out of the default partition into a partition ahead, with nothing recorded
    for them (as rows restored or attached with their trigger off): maintain()'s bound covers
    them."""
    db.execute("SELECT outbox.create_consumer('c')")
    one_minute_partitions(db)
    insert_event_at(db, "far", "40 days")
    db.execute("DELETE FROM outbox._reach")   # as if its row had never been recorded
    db.execute("SELECT * FROM outbox.maintain()")
    part = db.execute("SELECT tableoid::regclass::text FROM outbox.events").fetchone()[0]
    assert part != "outbox.events_default" and part in armed(db), "moved into a partition ahead"
    db.execute("SELECT outbox.emit('order', 'near', 'e', '{}')")
    assert sorted(e.aggregate_id for e in Relay(db, "c").drain()) == ["far", "near"]


def test_a_partition_attached_by_hand_records_its_reach(db):
    db.execute("SELECT outbox.create_consumer('c')")
    one_minute_partitions(db)
    db.execute("""DO $$ BEGIN EXECUTE format('CREATE TABLE outbox.events_by_hand PARTITION OF outbox.events
                      FOR VALUES FROM (%L) TO (%L)', now() + interval '1 day', now() + interval '2 days'); END $$""")
    assert "outbox.events_by_hand" in armed(db)
    insert_event_at(db, "by-hand", "25 hours")
    db.execute("SELECT outbox.emit('order', 'near', 'e', '{}')")
    assert sorted(e.aggregate_id for e in Relay(db, "c").drain()) == ["by-hand", "near"]


def test_an_event_made_before_the_first_bound_does_not_hide_the_others(db):
    """Until maintain() records a bound, an event recording its own (here an old one, in the
    default partition) must not become the bound of everything."""
    db.execute("SELECT outbox.create_consumer('c')")
    db.execute("DELETE FROM outbox._reach")
    db.execute("INSERT INTO outbox._reach (upper) VALUES ('infinity')")  # as CREATE EXTENSION leaves it
    insert_event_at(db, "old", "-40 days")
    db.execute("SELECT outbox.emit('order', 'now', 'e', '{}')")
    assert sorted(e.aggregate_id for e in Relay(db, "c").drain()) == ["now", "old"]


def test_an_infinite_created_at_is_refused(db):
    try:
        db.execute("""INSERT INTO outbox.events (id, aggregate_type, aggregate_id, event_type, payload, created_at, shard)
                      VALUES (outbox.uuid_v7(), 'order', 'k', 'e', '{}', 'infinity', outbox.shard_of('k'))""")
        raise AssertionError("an event no read could bound was written")
    except psycopg.errors.InvalidDatetimeFormat as e:
        assert "finite" in str(e)


def test_maintain_makes_the_default_partitions_trigger_fire_always_again(db):
    """A data-only restore with --disable-triggers ends with ENABLE TRIGGER ALL, which leaves it
    firing in origin sessions only (not in logical replication's)."""
    db.execute("ALTER TABLE outbox.events_default ENABLE TRIGGER outbox_reach")
    db.execute("SELECT * FROM outbox.maintain()")
    assert db.execute("""SELECT tgenabled FROM pg_trigger WHERE tgname = 'outbox_reach'
                          AND tgrelid = 'outbox.events_default'::regclass""").fetchone()[0] == "A"


def test_maintain_turns_the_trigger_off_as_a_partitions_time_nears_and_moves_the_reach(db):
    one_minute_partitions(db, ahead=10, width="2 seconds")
    first = reach(db)
    on = armed(db)
    bounds = dict(db.execute("""SELECT partition::text, lower FROM outbox.partitions
                                 WHERE parent = 'outbox.events'::regclass AND NOT is_default""").fetchall())
    assert len(on) >= 8 and all(bounds[p] >= first for p in on), "the trigger is on beyond the reach only"
    time.sleep(4.5)
    db.execute("SELECT * FROM outbox.maintain()")
    assert (reach(db) - first).total_seconds() >= 4
    assert len(set(on) - set(armed(db))) >= 2
    # emits where the trigger is off record nothing; maintain() keeps only the greatest row
    for i in range(10):
        db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (f"k{i}",))
    assert db.execute("SELECT count(*) FROM outbox._reach").fetchone()[0] == 1


def test_emits_that_land_ahead_at_once_do_not_wait_for_each_other(db, connect):
    one_minute_partitions(db)
    first = connect(autocommit=False)
    insert_event_at(first, "a", "10 minutes")   # records the reach, not committed yet
    second = connect()
    second.execute("SET statement_timeout = '5s'")
    insert_event_at(second, "b", "10 minutes")  # would wait on first's row if it were unique
    first.commit()
    assert db.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 2


def test_partitions_made_before_the_reach_are_covered_by_it(cluster, new_database):
    """0.11.0 made partitions without the trigger: the reach maintain() records covers them."""
    name = new_database()
    with cluster.connect(name) as db:
        db.execute("CREATE EXTENSION outbox_ext VERSION '0.11.0'")
        db.execute("UPDATE outbox.partition_config SET ahead = 5")
        db.execute("SELECT * FROM outbox.maintain()")
        db.execute("SELECT outbox.create_consumer('c')")
        db.execute("ALTER EXTENSION outbox_ext UPDATE")
        insert_event_at(db, "before", "4 days")   # no bound yet: claims read every partition
        insert_event_at(db, "old", "-40 days")    # the default partition records its own
        assert sorted(e.aggregate_id for e in Relay(db, "c").drain()) == ["before", "old"]
        db.execute("SELECT * FROM outbox.maintain()")
        last = db.execute("""SELECT max(upper) FROM outbox.partitions
                              WHERE parent = 'outbox.events'::regclass AND NOT is_default""").fetchone()[0]
        assert reach(db) >= last
        insert_event_at(db, "after", "4 days")
        assert [e.aggregate_id for e in Relay(db, "c").drain()] == ["after"]


def test_no_role_can_write_the_reach(db, connect):
    for role in ("producer_user", "relay_user", "admin_user"):
        user = connect(role)
        try:
            user.execute("DELETE FROM outbox._reach")
            raise AssertionError(f"{role} deleted the reach")
        except psycopg.errors.InsufficientPrivilege:
            pass
