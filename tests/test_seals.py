"""Seals (outbox._seals): once maintain() has sealed the log's past, claims, settles and
status skip the partitions behind the seal (they are never scanned), and nothing is lost for
it: an open transaction holds the seal back, and a clock gone back behind a seal drops them."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from support.db import insert_event_at, keys_in_shard, partitions_scanned, waits_for_a_lock
from support.peers import wait_for
from support.relay import Relay

OLD = 20  # hourly partitions before today's: inside the 2-day retention at any hour


def make_old_partitions(db) -> None:
    """OLD partitions of an hour each, ending where today's daily one starts."""
    db.execute("""SELECT count(outbox_internal._create_partition('outbox.events',
                                 date_trunc('day', now()) - g * interval '1 hour', '1 hour'))
                    FROM generate_series(1, %s) g""", (OLD,))


def scanned_old_partitions(db, sql: str, *args) -> int:
    """How many of the old partitions (before today's) sql's scans visit."""
    return partitions_scanned(db, "p.upper <= date_trunc('day', now())", sql, *args)


def read_past_everything(db, relay: Relay) -> None:
    """The consumer has read every event so far, then maintain() seals the past, then the
    consumer reads on past the seal's seq (two windows on: transactions in progress at a
    window's bound, in any database, keep its floor one window back)."""
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    relay.drain()
    db.execute("SELECT * FROM outbox.maintain()")
    for _ in range(2):
        db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
        relay.drain()


def test_claims_settles_and_status_skip_the_partitions_behind_a_seal(db):
    db.execute("SELECT outbox.create_consumer('c')")
    make_old_partitions(db)
    relay = Relay(db, "c", batch_size=10)
    read_past_everything(db, relay)
    assert db.execute("SELECT max(upper) FROM outbox._seals").fetchone()[0] is not None
    for i in range(20):
        db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (f"k{i}",))
    batch = relay.claim()
    assert batch
    assert scanned_old_partitions(db, "SELECT * FROM outbox.claim('c', 10)") == 0
    assert scanned_old_partitions(db, "SELECT outbox.settle('c', %s, %s, '[]')", batch[0].shard, batch[0].epoch) == 0
    assert scanned_old_partitions(db, "SELECT * FROM outbox.status") == 0
    assert scanned_old_partitions(db, "SELECT * FROM outbox.shard_status") == 0
    # without the seal every partition is read again: what the seal saves
    db.execute("DELETE FROM outbox._seals")
    assert scanned_old_partitions(db, "SELECT * FROM outbox.claim('c', 10)") == OLD
    relay.settle(batch[0].shard, batch[0].epoch)
    assert len(relay.drain()) == 20 - len(batch)


def test_a_consumer_behind_a_seal_reads_every_partition_it_may_still_find_events_in(db):
    """A seal is used only by a cursor past its seq: one still behind it reads everything."""
    db.execute("SELECT outbox.create_consumer('ahead'); SELECT outbox.create_consumer('behind')")
    make_old_partitions(db)
    ahead = Relay(db, "ahead", batch_size=10)
    for i in range(30):
        db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (f"k{i}",))
    read_past_everything(db, ahead)
    assert db.execute("SELECT count(*) FROM outbox._seals").fetchone()[0] == 1
    db.execute("SELECT outbox.emit('order', 'new', 'e', '{}')")
    assert scanned_old_partitions(db, "SELECT * FROM outbox.claim('ahead', 10)") == 0
    assert scanned_old_partitions(db, "SELECT * FROM outbox.claim('behind', 10)") == OLD
    assert len(Relay(db, "behind", batch_size=7).drain()) == 34


def test_an_open_transaction_holds_the_seal_back(db, connect):
    """No seal at or after a minute before the oldest open transaction began (in any database):
    such a transaction may still write events made then."""
    db.execute("UPDATE outbox.partition_config SET width = '1 second', ahead = 5 WHERE parent = 'outbox.events'::regclass")
    for (part,) in db.execute("SELECT partition::text FROM outbox.partitions"
                              " WHERE parent = 'outbox.events'::regclass AND NOT is_default").fetchall():
        db.execute(f"DROP TABLE {part}")
    db.execute("""SELECT count(outbox_internal._create_partition('outbox.events',
                                 date_trunc('second', now()) - g * interval '1 second', '1 second'))
                    FROM generate_series(1, 90) g""")
    other = connect(autocommit=False)
    began = other.execute("SELECT now()").fetchone()[0]   # a transaction, open from here on
    time.sleep(2)
    db.execute("SELECT * FROM outbox.maintain()")
    held = db.execute("SELECT max(upper) FROM outbox._seals").fetchone()[0]
    assert held is not None and held <= began - timedelta(minutes=1)
    other.rollback()
    db.execute("SELECT * FROM outbox.maintain()")
    freed = db.execute("SELECT max(upper) FROM outbox._seals").fetchone()[0]
    assert freed > held, "the seal moves on once the transaction has ended"


def test_a_clock_gone_back_behind_a_seal_drops_the_seals(db):
    db.execute("SELECT outbox.create_consumer('c')")
    make_old_partitions(db)
    relay = Relay(db, "c")
    read_past_everything(db, relay)
    # a seal made an hour ahead of the clock as it is now: the clock went back since
    db.execute("INSERT INTO outbox._seals (max_seq, upper) SELECT max(max_seq), now() + interval '1 hour' FROM outbox._seals")
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    assert scanned_old_partitions(db, "SELECT * FROM outbox.claim('c', 10)") == OLD, "no seal trusted"
    notices: list[str] = []
    db.add_notice_handler(lambda d: notices.append(d.message_primary))
    db.execute("SELECT * FROM outbox.maintain()")
    assert any("dropped the seals" in n for n in notices), notices
    assert db.execute("SELECT count(*) FROM outbox._seals").fetchone()[0] == 0
    assert [e.aggregate_id for e in relay.drain()] == ["k"]  # the one emitted after the seal


def test_a_restore_drops_the_seals_and_none_is_made_until_it_is_rebased(db, connect):
    """A seal made while a dump loaded (after its partitions, before its rows) knew nothing of
    the dump's events: a restore drops the seals, and none is made before the rebase."""
    db.execute("SELECT outbox.create_consumer('c')")
    make_old_partitions(db)
    read_past_everything(db, Relay(db, "c"))
    seals = "SELECT count(*) FROM outbox._seals"
    assert db.execute(seals).fetchone()[0] == 1
    restorer = connect()
    restorer.execute("INSERT INTO outbox._origin (made_in) VALUES ('another cluster/1')")  # the dump's row
    assert db.execute(seals).fetchone()[0] == 0
    db.execute("SELECT outbox_internal._seal(outbox_internal._partition_list())")
    assert db.execute(seals).fetchone()[0] == 0, "no seal before the rebase"
    pid = restorer.execute("SELECT pg_backend_pid()").fetchone()[0]
    restorer.close()   # the restore is over once its backend is gone (outbox_internal._restore_running)
    wait_for(lambda: not db.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0])
    db.execute("SELECT * FROM outbox.maintain()")   # rebases, then seals
    assert db.execute("SELECT restore_pending FROM outbox._origin").fetchone()[0] is False
    assert db.execute(seals).fetchone()[0] == 1, "the rebased log is sealed again"


def sealed_consumer(db) -> tuple[Relay, str]:
    """A consumer read past a seal, and the time five minutes behind the seal, from now (an
    interval, for insert_event_at)."""
    db.execute("SELECT outbox.create_consumer('c')")
    make_old_partitions(db)
    relay = Relay(db, "c")
    read_past_everything(db, relay)
    behind = db.execute("SELECT extract(epoch FROM max(upper) - interval '5 minutes' - now())::text || ' s'"
                        " FROM outbox._seals").fetchone()[0]
    return relay, behind


def test_an_event_made_behind_a_seal_is_claimed_after_the_clock_has_caught_up(db):
    """A clock stepped back past a sealed partition boundary: an event made then (created_at
    behind the seal, seq above it) lands in a sealed partition. Claims that trust the seal,
    once the clock is past it again (before maintain() has run), would skip the event for
    good: it breaks the seals above it in its own transaction, so it is claimed."""
    relay, behind = sealed_consumer(db)
    insert_event_at(db, "late", behind)   # as emit writes it, its transaction begun behind the seal
    assert [e.aggregate_id for e in relay.drain()] == ["late"]
    db.execute("SELECT * FROM outbox.maintain()")
    assert db.execute("SELECT count(*) FROM outbox._seals s, outbox.events e WHERE e.aggregate_id = 'late'"
                      " AND s.upper > e.created_at AND s.max_seq < e.seq").fetchone()[0] == 0, \
        "maintain() drops the broken seals (and may seal again, above the event's seq)"
    assert db.execute("SELECT count(*) FROM outbox._seal_breaks").fetchone()[0] == 0


def test_an_event_behind_a_seal_in_an_open_transaction_does_not_hold_maintain_up(db, connect):
    """What an event behind a seal records is seen by maintain() once it commits; until then
    maintain() goes on without it (no lock of a seal is held by the event's transaction)."""
    relay, behind = sealed_consumer(db)
    writer = connect(autocommit=False)
    insert_event_at(writer, "late", behind)
    db.execute("SET statement_timeout = '10s'")
    db.execute("SELECT * FROM outbox.maintain()")
    writer.commit()
    assert [e.aggregate_id for e in relay.drain()] == ["late"]


def test_maintain_arms_the_partitions_behind_the_clock_and_only_those(db):
    """The trigger that breaks seals is on where events land only from a clock gone back (the
    partitions whose time is over, and the default one) and off where emits write (there it
    would cost every event its native path)."""
    make_old_partitions(db)
    db.execute("SELECT * FROM outbox.maintain()")
    states = dict(db.execute("""
        SELECT CASE WHEN p.is_default THEN 'default' WHEN p.upper <= now() THEN 'over' ELSE 'current or ahead' END,
               string_agg(DISTINCT t.tgenabled::text, '')
          FROM outbox.partitions p JOIN pg_trigger t ON t.tgrelid = p.partition AND t.tgname = 'outbox_seal'
         WHERE p.parent = 'outbox.events'::regclass GROUP BY 1""").fetchall())
    assert states == {"default": "A", "over": "A", "current or ahead": "D"}, states
    # a data-only restore's ENABLE TRIGGER ALL turns it on everywhere: maintain() mends that
    db.execute("ALTER TABLE outbox.events ENABLE TRIGGER outbox_seal")
    db.execute("SELECT * FROM outbox.maintain()")
    on_now = db.execute("""
        SELECT count(*) FROM outbox.partitions p JOIN pg_trigger t ON t.tgrelid = p.partition AND t.tgname = 'outbox_seal'
         WHERE p.parent = 'outbox.events'::regclass AND p.upper > now() AND t.tgenabled <> 'D'""").fetchone()[0]
    assert on_now == 0


def test_an_event_behind_a_seal_that_maintain_has_not_committed_yet_is_claimed(db, connect):
    """maintain() seals, then waits (here on a row its trim deletes; in life on any lock, or a
    clock stepped back while it runs) before it commits; meanwhile a transaction writes an
    event behind that seal, and the consumer reads past it (the event in flight) before both
    commit. The event's trigger cannot see the seal yet: it records a break all the same (it
    fires only where events land behind time), or claims would trust the seal once committed
    and skip the event for good."""
    relay, behind = sealed_consumer(db)
    db.execute("DELETE FROM outbox._seals")           # the partitions stay armed; maintain() seals again
    db.execute("UPDATE outbox._cursor_log SET at = now() - interval '2 minutes' "
               "WHERE pos = (SELECT min(pos) FROM outbox._cursor_log)")   # for the trim to delete
    holder = connect(autocommit=False)
    holder.execute("SELECT FROM outbox._cursor_log WHERE pos = (SELECT min(pos) FROM outbox._cursor_log) FOR UPDATE")
    runner = connect()
    pid = runner.execute("SELECT pg_backend_pid()").fetchone()[0]
    run = threading.Thread(target=lambda: runner.execute("SELECT * FROM outbox.maintain()").fetchall())
    run.start()
    writer = connect(autocommit=False)
    try:
        waits_for_a_lock(db, pid)
        assert db.execute("SELECT count(*) FROM outbox._seals").fetchone()[0] == 0, "its seal not committed"
        insert_event_at(writer, "late", behind)
        k, = keys_in_shard(db, db.execute("SELECT outbox.shard_of('late')").fetchone()[0], 1)
        db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (k,))
        assert [e.aggregate_id for e in relay.drain()] == [k]   # its shard read past 'late', in flight
    finally:
        holder.rollback()
        run.join(30)
    assert db.execute("SELECT count(*) FROM outbox._seals").fetchone()[0] == 1, "maintain() sealed"
    writer.commit()
    assert [e.aggregate_id for e in relay.drain()] == ["late"]


def test_a_transaction_writing_events_behind_a_seal_records_one_break(db):
    relay, behind = sealed_consumer(db)
    with db.transaction():
        for i in range(5):
            insert_event_at(db, f"late{i}", behind)
    assert db.execute("SELECT count(*) FROM outbox._seal_breaks").fetchone()[0] == 1
    assert sorted(e.aggregate_id for e in relay.drain()) == [f"late{i}" for i in range(5)]
