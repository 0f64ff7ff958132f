"""outbox.maintain(): partitions ahead, default-partition rows moved, partitions dropped only
when past retention and read by every consumer, safe when run twice at once."""

import threading
import time

import psycopg
import pytest

from support.db import insert_event_at, waits_for_a_lock
from support.relay import Relay


def maintain(conn) -> list[tuple]:
    return conn.execute("SELECT action, relation, detail FROM outbox.maintain()").fetchall()


def forget_seals(db) -> None:
    """After insert_event_at in a transaction begun now: a transaction that really began then
    would have kept maintain() from sealing the partitions since (outbox._seals)."""
    db.execute("DELETE FROM outbox._seals")


def partition_of(conn, key: str) -> str:
    return conn.execute("SELECT tableoid::regclass::text FROM outbox.events WHERE aggregate_id = %s", (key,)).fetchone()[0]


def a_read_partition_with_a_late_writer(db, connect) -> tuple[str, object]:
    """An old partition whose events consumer 'c' has read, and a transaction still writing one
    more event there ('late', uncommitted). Returns the partition and the writer."""
    db.execute("SELECT outbox.create_consumer('c')")
    insert_event_at(db, "old", "-10 days")
    maintain(db)
    part = partition_of(db, "old")
    writer = connect(autocommit=False)
    insert_event_at(writer, "late", "-10 days")   # uncommitted, lands in the same old partition
    forget_seals(db)
    Relay(db, "c").drain()
    return part, writer


def test_partitions_cover_now_and_ahead_and_maintain_is_idempotent(db):
    assert [a for a, *_ in maintain(db) if a == "created"] == []
    covered = db.execute("""
        SELECT parent::text, bool_or(lower <= now() AND upper > now()),
               bool_or(lower <= now() + interval '2 days' AND upper > now() + interval '2 days')
          FROM outbox.partitions WHERE NOT is_default GROUP BY 1 ORDER BY 1""").fetchall()
    assert covered == [("inbox.messages", True, True), ("outbox.events", True, True)]


def test_rows_in_the_default_partition_are_reported_and_moved(db):
    db.execute("SELECT outbox.create_consumer('c')")
    insert_event_at(db, "future", "40 days")
    assert partition_of(db, "future") == "outbox.events_default"
    with _notices(db) as notices:
        actions = maintain(db)
    moved = [r for a, r, _ in actions if a == "moved"]
    assert len(moved) == 1 and partition_of(db, "future") == moved[0]
    assert any("default partition" in n for n in notices)
    assert db.execute("SELECT count(*) FROM outbox.events_default").fetchone()[0] == 0
    # still delivered, from its new partition
    assert [e.aggregate_id for e in Relay(db, "c").drain()] == ["future"]


def test_inbox_rows_in_the_default_partition_are_moved_once_in_reach(db):
    """An id beyond the partitions made ahead stays in the default partition (deduplicated
    there) until partitions reach its time; then it is moved into its own."""
    mid = db.execute("SELECT inbox.uuid_at(now() + interval '30 days')").fetchone()[0]
    db.execute("SELECT inbox.claim(%s, 'c')", (mid,))
    assert db.execute("SELECT tableoid::regclass::text FROM inbox.messages").fetchone()[0] == "inbox.messages_default"
    assert "moved" not in [a for a, *_ in maintain(db)]
    assert db.execute("SELECT inbox.claim(%s, 'c')", (mid,)).fetchone()[0] is False, "deduplicated meanwhile"
    db.execute("UPDATE outbox.partition_config SET ahead = 31 WHERE parent = 'inbox.messages'::regclass")
    assert "moved" in [a for a, *_ in maintain(db)]
    assert db.execute("SELECT tableoid::regclass::text FROM inbox.messages").fetchone()[0] != "inbox.messages_default"
    assert db.execute("SELECT inbox.claim(%s, 'c')", (mid,)).fetchone()[0] is False, "still deduplicated"


def test_a_partition_past_retention_is_kept_until_every_consumer_read_it(db):
    db.execute("SELECT outbox.create_consumer('fast'); SELECT outbox.create_consumer('stuck')")
    for i in range(5):
        insert_event_at(db, f"old-{i}", "-10 days")
    maintain(db)                                  # moves them into a partition 10 days old
    old_part = partition_of(db, "old-0")
    assert old_part != "outbox.events_default"
    Relay(db, "fast").drain()
    actions = maintain(db)
    assert ("kept", old_part) in [(a, r) for a, r, _ in actions], actions
    assert db.execute("SELECT count(*) FROM outbox.events WHERE aggregate_id LIKE 'old-%'").fetchone()[0] == 5
    assert len(Relay(db, "stuck").drain()) == 5
    actions = maintain(db)
    assert ("dropped", old_part) in [(a, r) for a, r, _ in actions], actions
    assert db.execute("SELECT to_regclass(%s)", (old_part,)).fetchone()[0] is None


def test_an_open_transaction_keeps_its_partition(db, connect):
    part, writer = a_read_partition_with_a_late_writer(db, connect)
    assert ("kept", part) in [(a, r) for a, r, _ in maintain(db)]
    writer.commit()
    assert [e.aggregate_id for e in Relay(db, "c").drain()] == ["late"]
    assert ("dropped", part) in [(a, r) for a, r, _ in maintain(db)]


def a_read_old_partition(db) -> str:
    """A partition 10 days old whose one event ('old') consumer 'c' has read."""
    db.execute("SELECT outbox.create_consumer('c')")
    insert_event_at(db, "old", "-10 days")
    maintain(db)
    Relay(db, "c").drain()
    return partition_of(db, "old")


def test_a_consumer_being_made_from_the_beginning_keeps_the_partitions_it_will_read(db, connect):
    """A consumer made from the beginning in a transaction still open has no cursor a run can
    see: the partition stays, and its events are there for the consumer once it commits."""
    part = a_read_old_partition(db)
    maker = connect(autocommit=False)
    maker.execute("SELECT outbox.create_consumer('audit', from_beginning => true)")
    assert [(a, r) for a, r, _ in maintain(db) if r == part] == [("kept", part)]
    maker.commit()
    assert [(a, r, d) for a, r, d in maintain(db) if r == part] == [
        ("kept", part, "past retention, but a consumer has not read all its events")]
    assert [e.aggregate_id for e in Relay(db, "audit").drain()] == ["old"]


def test_a_session_without_track_activities_keeps_the_partitions_past_retention(db, connect):
    """Such a session shows no transaction start: it may have one open since before the
    partition ended, about to write there."""
    part = a_read_old_partition(db)
    quiet = connect(autocommit=False)
    quiet.execute("SET track_activities = off")
    quiet.commit()
    actions = [(a, r) for a, r, _ in maintain(db) if r == part]
    assert actions == [("kept", part)]
    pid = quiet.info.backend_pid
    quiet.close()
    deadline = time.monotonic() + 10   # (a backend leaves pg_stat_activity a moment after)
    while db.execute("SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %s)", (pid,)).fetchone()[0]:
        assert time.monotonic() < deadline, "the session never ended"
        time.sleep(0.02)
    assert ("dropped", part) in [(a, r) for a, r, _ in maintain(db)]


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_run_in_a_snapshot_older_than_the_writers_is_refused(db, connect, level):
    """maintain() reads a partition's events once the transactions that may write there have
    ended. In a REPEATABLE READ or SERIALIZABLE transaction that read used a snapshot taken
    before: an event committed since was not seen, and its partition was dropped with it.
    Refused (25000); the event stays and is delivered."""
    part, writer = a_read_partition_with_a_late_writer(db, connect)
    runner = connect(autocommit=False)
    runner.execute(f"BEGIN ISOLATION LEVEL {level}")
    runner.execute("SELECT count(*) FROM outbox.events")   # its snapshot, before the commit
    writer.commit()
    try:
        actions = maintain(runner)
        runner.commit()
    except psycopg.errors.InvalidTransactionState as e:
        runner.rollback()
        actions = e
    assert isinstance(actions, Exception) or ("dropped", part) not in [(a, r) for a, r, _ in actions], \
        "the partition went with an event committed since"
    assert isinstance(actions, psycopg.errors.InvalidTransactionState), actions
    assert "READ COMMITTED" in str(actions)
    assert [e.aggregate_id for e in Relay(db, "c").drain()] == ["late"]
    assert ("dropped", part) in [(a, r) for a, r, _ in maintain(db)]


def test_a_partitions_events_are_read_after_its_writers_are_seen_ended(db, connect):
    """maintain() reads a partition's events once no transaction may still write there (one
    open since before the partition ends, or holding a lock on it). That read used the snapshot
    of the statement calling it, taken before it looked: a writer that ended in between was
    neither seen open nor its events read, and the partition went with them. Here the writer
    commits while the check waits between its statement's snapshot and that look (an
    advisory lock holds it there)."""
    part, writer = a_read_partition_with_a_late_writer(db, connect)
    upper = db.execute("SELECT upper FROM outbox.partitions WHERE partition = %s::regclass", (part,)).fetchone()[0]
    writer.execute("SELECT pg_advisory_xact_lock(4242)")
    checker = connect()
    said: list = []

    def check() -> None:
        said.append(checker.execute(
            "SELECT outbox_internal._partition_pending(%s::regclass, %s)"
            "  FROM (SELECT pg_advisory_xact_lock(4242) OFFSET 0) AS after_the_writer", (part, upper)).fetchone()[0])

    thread = threading.Thread(target=check)
    thread.start()
    waits_for_a_lock(db, checker.info.backend_pid)
    writer.commit()
    thread.join(30)
    assert said == ["a consumer has not read all its events"], "the partition would go with the writer's event"


def a_detached_partition(db) -> str:
    """With detach = true, consumer 'c' reads an old partition's event; maintain() detaches the
    partition. Returns its name."""
    db.execute("UPDATE outbox.partition_config SET detach = true WHERE parent = 'outbox.events'::regclass")
    db.execute("SELECT outbox.create_consumer('c')")
    insert_event_at(db, "old", "-10 days")
    maintain(db)
    part = partition_of(db, "old")
    Relay(db, "c").drain()
    assert ("detached", part) in [(a, r) for a, r, _ in maintain(db)]
    return part


def test_detach_instead_of_drop(db):
    part = a_detached_partition(db)
    assert db.execute(f"SELECT count(*) FROM {part}").fetchone()[0] == 1, "kept as a plain table"
    assert db.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = %s::regclass", (part,)).fetchone()[0] == 0, \
        "with no trigger of ours (the archive outlives the extension)"


def test_a_drop_waits_for_readers_without_deadlocking_them(db, connect):
    """maintain drops before it creates: waiting for the parent's lock (held by a reader) it
    must not hold the default partition, which the reader goes on to read. Found by the soak
    benchmark as a deadlock between a claim and maintain."""
    db.execute("SELECT outbox.create_consumer('c')")
    insert_event_at(db, "old", "-10 days")
    maintain(db)
    old_part = partition_of(db, "old")
    Relay(db, "c").drain()
    # a partition ahead to create again (its creation locks the default partition)
    ahead = db.execute("""SELECT partition::text FROM outbox.partitions
                           WHERE parent = 'outbox.events'::regclass AND lower > now()
                           ORDER BY lower DESC LIMIT 1""").fetchone()[0]
    db.execute(f"DO $$ BEGIN ALTER EXTENSION outbox_ext DROP TABLE {ahead}; EXCEPTION WHEN OTHERS THEN NULL; END $$")
    db.execute(f"DROP TABLE {ahead}")
    reader = connect(autocommit=False)
    reader.execute("LOCK TABLE ONLY outbox.events IN ACCESS SHARE MODE")   # holds the parent
    done: dict = {}
    other = connect()
    thread = threading.Thread(target=lambda: done.update(actions=maintain(other)))
    thread.start()
    waits_for_a_lock(db, other.info.backend_pid)     # maintain now waits for the parent
    reader.execute("SELECT count(*) FROM outbox.events_default")  # not blocked, no deadlock
    reader.commit()
    thread.join(10)
    actions = [(a, r) for a, r, _ in done["actions"]]
    assert ("dropped", old_part) in actions and ("created", ahead) in actions, actions


def test_a_drop_gives_up_on_a_long_reader_and_retries(db, connect):
    """A drop waits for its lock at most a second (every emit would queue behind it): the
    partition is kept, and dropped by the next run."""
    db.execute("SELECT outbox.create_consumer('c')")
    insert_event_at(db, "old", "-10 days")
    maintain(db)
    old_part = partition_of(db, "old")
    Relay(db, "c").drain()
    reader = connect(autocommit=False)
    reader.execute("LOCK TABLE ONLY outbox.events IN ACCESS SHARE MODE")
    db.execute("SET statement_timeout = '10s'")   # a drop that waits for good fails, not hangs
    started = time.monotonic()
    actions = maintain(db)
    assert time.monotonic() - started < 5
    assert [(a, r) for a, r, _ in actions if r == old_part] == [("kept", old_part)], actions
    db.execute("SELECT outbox.emit('order', '1', 'e', '{}')")   # emits were not held up
    reader.commit()
    assert ("dropped", old_part) in [(a, r) for a, r, _ in maintain(db)]


def test_a_drop_that_deadlocks_gives_way_to_the_application(db, connect):
    """An application transaction that claims an inbox message and then emits holds the inbox
    and waits for the events table, while maintain, having dropped an old events partition,
    waits for the inbox to drop an old inbox partition. maintain gives way: it keeps that
    partition for its next run and finishes the rest; the application's transaction commits."""
    db.execute("SELECT outbox.create_consumer('c')")
    insert_event_at(db, "old", "-10 days")
    old_mid = db.execute("SELECT inbox.uuid_at(now() - interval '30 days')").fetchone()[0]
    db.execute("SELECT inbox.claim(%s, 'c')", (old_mid,))
    # an inbox partition of 30 days ago: made while the retention kept that long
    db.execute("UPDATE outbox.partition_config SET retention = '40 days' WHERE parent = 'inbox.messages'::regclass")
    maintain(db)                                   # both old rows now in partitions of their own
    db.execute("UPDATE outbox.partition_config SET retention = '7 days' WHERE parent = 'inbox.messages'::regclass")
    old_events = partition_of(db, "old")
    old_inbox = db.execute("SELECT tableoid::regclass::text FROM inbox.messages WHERE message_id = %s",
                           (old_mid,)).fetchone()[0]
    Relay(db, "c").drain()
    app = connect(autocommit=False)
    app.execute("SELECT inbox.claim(outbox.uuid_v7(), 'c')")      # holds the inbox
    done: dict = {}
    other = connect()
    other.execute("SET deadlock_timeout = '500ms'")  # maintain's check finds the cycle (app's: 1 s)
    thread = threading.Thread(target=lambda: done.update(actions=maintain(other)))
    thread.start()
    waits_for_a_lock(db, other.info.backend_pid)   # dropped the events partition; waits for the inbox
    app.execute("SELECT outbox.emit('order', '1', 'e', '{}')")    # waits for maintain to end
    app.commit()
    thread.join(10)
    actions = [(a, r, d) for a, r, d in done["actions"]]
    assert ("dropped", old_events, None) in actions, actions
    assert ("kept", old_inbox, "past retention, but in use (deadlock): next run") in actions, actions
    assert ("dropped", old_inbox) in [(a, r) for a, r, _ in maintain(db)]


def test_two_maintain_at_once_one_skips(db, connect):
    """The first run makes a partition ahead (as after midnight), so it holds the default
    partition: the second skips all the same. (It read the partitions' bounds before its lock,
    which opens each partition, and waited for the first run's commit.)"""
    db.execute("UPDATE outbox.partition_config SET ahead = ahead + 1 WHERE parent = 'outbox.events'::regclass")
    db.execute("SET statement_timeout = '10s'")
    first = connect(autocommit=False)
    first.execute("SELECT * FROM outbox.maintain()")   # holds its lock until commit
    assert maintain(db) == [("skipped", None, "another outbox.maintain() is running")]
    first.commit()
    assert ("skipped", None, "another outbox.maintain() is running") not in maintain(db)


def test_cursor_history_is_trimmed_and_claims_go_on(db):
    db.execute("SELECT outbox.create_consumer('c')")
    for i in range(30):
        db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (f"k{i}",))
    relay = Relay(db, "c", batch_size=2)
    relay.drain()
    db.execute("UPDATE outbox._cursor_log SET at = now() - interval '1 hour'")
    before = db.execute("SELECT count(*) FROM outbox._cursor_log").fetchone()[0]
    assert "trimmed" in [a for a, *_ in maintain(db)]
    assert db.execute("SELECT count(*) FROM outbox._cursor_log").fetchone()[0] == 16 < before
    db.execute("SELECT outbox.emit('order', 'after', 'e', '{}')")
    assert [e.aggregate_id for e in relay.drain()] == ["after"]


def test_the_inbox_forgets_after_its_retention(db):
    """The dedup window: a message is recognized for the retention, counted from its id's time
    or, for an id older than that, from its receipt; then it is no longer recognized."""
    recent = db.execute("SELECT inbox.uuid_at(now() - interval '3 days')").fetchone()[0]
    old = db.execute("SELECT inbox.uuid_at(now() - interval '30 days')").fetchone()[0]
    assert db.execute("SELECT inbox.claim(%s, 'c') AND inbox.claim(%s, 'c')", (recent, old)).fetchone()[0] is True
    maintain(db)
    assert db.execute("SELECT inbox.claim(%s, 'c') OR inbox.claim(%s, 'c')", (recent, old)).fetchone()[0] is False
    # a week later: the partition of the recent id's day is dropped (drops come first in a
    # run); the old id, left in the default partition, ages out by its receipt
    db.execute("UPDATE outbox.partition_config SET retention = '2 days' WHERE parent = 'inbox.messages'::regclass")
    db.execute("UPDATE inbox.messages SET received_at = now() - interval '8 days' WHERE message_id = %s", (old,))
    actions = maintain(db)
    assert "dropped" in [a for a, *_ in actions], actions
    assert db.execute("SELECT inbox.claim(%s, 'c') AND inbox.claim(%s, 'c')", (recent, old)).fetchone()[0] is True


class _notices:
    def __init__(self, conn):
        self.conn, self.items = conn, []

    def __enter__(self):
        self.conn.add_notice_handler(self._handle)
        return self.items

    def _handle(self, diag):
        self.items.append(diag.message_primary)

    def __exit__(self, *exc):
        self.conn.remove_notice_handler(self._handle)


def test_a_prepared_transaction_keeps_its_partition(db, connect):
    db.execute("SELECT outbox.create_consumer('c')")
    insert_event_at(db, "old", "-10 days")
    maintain(db)
    part = partition_of(db, "old")
    writer = connect()
    writer.execute("BEGIN")
    insert_event_at(writer, "prepared", "-10 days")
    forget_seals(db)
    writer.execute("PREPARE TRANSACTION 'held'")
    Relay(db, "c").drain()
    assert ("kept", part) in [(a, r) for a, r, _ in maintain(db)]
    db.execute("COMMIT PREPARED 'held'")
    assert [e.aggregate_id for e in Relay(db, "c").drain()] == ["prepared"]
    assert ("dropped", part) in [(a, r) for a, r, _ in maintain(db)]


def test_partitions_made_by_create_extension_can_be_dropped_too(db):
    """Partitions CREATE EXTENSION made before 0.6.0 belong to the extension; maintain still lets them go."""
    db.execute("SELECT outbox.create_consumer('c')")
    insert_event_at(db, "old", "-10 days")
    maintain(db)
    part = partition_of(db, "old")
    db.execute(f"ALTER EXTENSION outbox_ext ADD TABLE {part}")   # as if CREATE EXTENSION had made it
    Relay(db, "c").drain()
    assert ("dropped", part) in [(a, r) for a, r, _ in maintain(db)]
    assert db.execute("SELECT to_regclass(%s)", (part,)).fetchone()[0] is None


def test_a_reader_of_the_default_partition_holds_maintain_up_a_second_at_most(db, connect):
    """A pg_dump over midnight holds every table, the default partition among them, in ACCESS
    SHARE mode. The ATTACH of a partition made ahead takes the default one in ACCESS EXCLUSIVE
    mode: maintain() waits for it at most a second (the next run goes on), or its queued
    request would block every claim, and the worker's loop with this run, for the whole dump."""
    count = "SELECT count(*) FROM outbox.partitions WHERE parent = 'outbox.events'::regclass AND NOT is_default"
    db.execute("SELECT outbox.create_consumer('c')")
    before = db.execute(count).fetchone()[0]
    reader = connect(autocommit=False)
    reader.execute("SELECT count(*) FROM outbox.events_default")
    db.execute("UPDATE outbox.partition_config SET ahead = ahead + 2 WHERE parent = 'outbox.events'::regclass")
    db.execute("SET statement_timeout = '20s'")
    started = time.monotonic()
    db.execute("SELECT * FROM outbox.maintain()")
    assert time.monotonic() - started < 10
    assert db.execute(count).fetchone()[0] == before, "nothing attached while the reader holds the default"
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    assert [e.aggregate_id for e in Relay(db, "c").drain()] == ["k"]
    reader.rollback()
    db.execute("SELECT * FROM outbox.maintain()")
    assert db.execute(count).fetchone()[0] == before + 2


def repartition(db, parent: str, width: str, ahead: int) -> None:
    """Drops parent's dated partitions (empty here) and sets a new width for the next run."""
    for (part,) in db.execute("SELECT partition::text FROM outbox.partitions WHERE parent = %s::regclass "
                              "AND NOT is_default", (parent,)).fetchall():
        db.execute(f"DROP TABLE {part}")
    db.execute("UPDATE outbox.partition_config SET width = %s, ahead = %s WHERE parent = %s::regclass",
               (width, ahead, parent))


def test_partitions_come_out_right_in_any_datestyle_and_time_zone(db):
    """In DateStyle SQL a time prints with its zone's abbreviation, which may stand for another
    zone when read back ('CST' of Asia/Shanghai is US Central): partitions read and made in
    such a session were 14 hours off."""
    db.execute("SET datestyle = 'SQL, DMY'")
    db.execute("SET timezone = 'Asia/Shanghai'")
    off = ("SELECT count(*) FROM outbox.partitions WHERE parent = 'outbox.events'::regclass AND NOT is_default"
           " AND (extract(epoch FROM lower)::bigint %% %s <> 0 OR extract(epoch FROM upper)::bigint %% %s <> 0)")
    assert db.execute(off, (86400, 86400)).fetchone()[0] == 0, "the daily partitions are read at UTC midnights"
    repartition(db, "outbox.events", "1 hour", 30)
    db.execute("SELECT * FROM outbox.maintain()")
    assert db.execute(off, (3600, 3600)).fetchone()[0] == 0
    assert db.execute("""SELECT count(*) FROM outbox.partitions
                          WHERE parent = 'outbox.events'::regclass AND upper - lower = interval '1 hour'""").fetchone()[0] >= 20
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    assert db.execute("SELECT count(*) FROM outbox.events_default").fetchone()[0] == 0


def gaps(db, parent: str = "outbox.events") -> list:
    """The ranges from now's partition to the furthest one ahead that no partition covers."""
    return db.execute("""
        SELECT array_agg(g::text) FROM unnest(
            (SELECT tstzmultirange(tstzrange(min(lower), max(upper))) - range_agg(tstzrange(lower, upper))
               FROM outbox.partitions
              WHERE parent = %s::regclass AND NOT is_default AND upper > now())) AS g""",
                      (parent,)).fetchone()[0] or []


@pytest.mark.parametrize("parent", ["outbox.events", "inbox.messages"])
def test_a_wider_width_leaves_no_gap_between_the_partitions_made_before(db, parent):
    """Hourly partitions, then daily: the day's partition was clipped to the first gap before
    the hourly ones, and the hours after them were never covered (rows of that time stayed in
    the default partition, and every run tried again)."""
    repartition(db, parent, "1 hour", 3)
    maintain(db)
    db.execute("UPDATE outbox.partition_config SET width = '1 day', ahead = 2 WHERE parent = %s::regclass", (parent,))
    maintain(db)
    assert gaps(db, parent) == []
    assert [a for a, *_ in maintain(db) if a in ("created", "moved")] == [], "nothing left to make"


def test_rows_in_one_gap_of_a_day_are_moved_and_the_other_gap_is_made_empty(db):
    """A day two days ahead holds one hourly partition (12:00 to 13:00) and, in the default
    partition, an event of 18:00: the daily partitions come as [00:00, 12:00), empty, and
    [13:00, 24:00), which the event moves to; only that one says it moved rows."""
    day = "date_trunc('day', now() + interval '2 days', 'UTC')"
    repartition(db, "outbox.events", "1 hour", 0)
    db.execute(f"SELECT outbox_internal._create_partition('outbox.events', {day} + interval '12 hours', '1 hour')")
    hours = db.execute(f"SELECT extract(epoch FROM {day} + interval '18 hours' - now())::text || ' s'").fetchone()[0]
    insert_event_at(db, "evening", hours)
    assert partition_of(db, "evening") == "outbox.events_default"
    db.execute("UPDATE outbox.partition_config SET width = '1 day', ahead = 3 WHERE parent = 'outbox.events'::regclass")
    with _notices(db) as notices:
        actions = maintain(db)
    moved = [r for a, r, _ in actions if a == "moved"]
    assert moved == [partition_of(db, "evening")], actions
    assert len([n for n in notices if "moved them" in n]) == 1, notices
    assert gaps(db) == []


def test_partitions_of_a_width_under_a_second_get_names_of_their_own(db):
    repartition(db, "outbox.events", "250 milliseconds", 8)
    made = [r for a, r, _ in maintain(db) if a == "created"]
    assert len(made) >= 8 and len(set(made)) == len(made)


def test_a_range_whose_name_a_detached_partition_keeps_gets_another(db):
    """With detach = true, a partition past retention stays as a table of its own under its
    name; a partition made again for that range (an event of that time in the default
    partition) failed on every run with 42P07."""
    part = a_detached_partition(db)
    insert_event_at(db, "old again", "-10 days")
    forget_seals(db)
    moved = [r for a, r, _ in maintain(db) if a == "moved"]
    assert len(moved) == 1 and moved[0] != part and partition_of(db, "old again") == moved[0]
    assert [e.aggregate_id for e in Relay(db, "c").drain()] == ["old again"]
