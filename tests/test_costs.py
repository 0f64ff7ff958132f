"""Costs that do not grow with what a call does not need to read: a relay session's claims keep
index plans however its tables grew after they were planned, and outbox.status counts a
shard's pending events exactly only up to a bound. (How fast, bench/claim.sh measures.)"""

from __future__ import annotations


from support.db import keys_in_shard
from support.events import emit
from support.relay import Relay


def pages_read(db, table: str) -> int:
    """Heap pages of table read (hit or not) by this backend so far, as the statistics say."""
    db.execute("SELECT pg_stat_force_next_flush()")
    db.execute("SELECT pg_stat_clear_snapshot()")
    return db.execute("SELECT heap_blks_hit + heap_blks_read FROM pg_statio_all_tables "
                      "WHERE relid = %s::regclass", (table,)).fetchone()[0] or 0


def no_autovacuum_of_parking(db) -> None:
    """No ANALYZE of the parking tables but the test's own: its statistics would make the plans
    again, as the fix under test does."""
    for table in ("outbox._parked", "outbox._parked_events"):
        db.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")


def test_a_sessions_claims_stay_index_walks_as_cursor_history_grows(db):
    db.execute("SELECT outbox.create_consumer('sink')")
    relay = Relay(db, "sink", batch_size=5)
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    shard = db.execute("SELECT outbox.shard_of('k')").fetchone()[0]
    db.execute("VACUUM ANALYZE outbox._cursor_log")   # as autovacuum does: "it is tiny"
    for _ in range(20):   # the session plans its statements while the cursor log is tiny
        db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
        batch = relay.claim()
        relay.settle(batch[0].shard, batch[0].epoch)
    # then the shard's history grows under the session's cached plans (rows older than its
    # newest, as a long run without maintain leaves them)
    db.execute("""INSERT INTO outbox._cursor_log (consumer_id, shard, pos, epoch, lo_snap, lo_seq, lo_top, lo_txids, lo_floors)
                  OVERRIDING SYSTEM VALUE
                  SELECT c.id, %s, -g, 0, '1:1:', 0, '1', '{}', '{}'
                    FROM outbox.consumers c, generate_series(1, 30000) g""", (shard,))
    size = db.execute("SELECT pg_relation_size('outbox._cursor_log') / 8192").fetchone()[0]
    assert size > 100
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    before = pages_read(db, "outbox._cursor_log")
    batch = relay.claim()
    relay.settle(batch[0].shard, batch[0].epoch)
    read = pages_read(db, "outbox._cursor_log") - before
    assert read < 100, f"a claim and a settle read {read} of the cursor log's {size} pages (a few a shard: not its history)"


def queue_pages_read_once_grown(db, cycle) -> tuple[int, int]:
    """Runs cycle six times while the parking tables are tiny (the session plans its statements
    then, just after autovacuum would have analyzed them as tiny), then parks other keys of the
    consumer with long queues, for a day, and runs cycle once more. Returns the queues' heap
    pages that last cycle read, and how many pages the queues have."""
    no_autovacuum_of_parking(db)
    db.execute("VACUUM ANALYZE outbox._parked")
    db.execute("VACUUM ANALYZE outbox._parked_events")
    for _ in range(6):
        cycle()
    db.execute("""INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
                  SELECT c.id, 'far' || g, outbox.shard_of('far' || g), now() + interval '1 day'
                    FROM outbox.consumers c, generate_series(1, 1000) g""")
    db.execute("""INSERT INTO outbox._parked_events (consumer_id, aggregate_id, id, aggregate_type, event_type,
                                                     payload, created_at, seq)
                  SELECT c.id, 'far' || (g % 1000 + 1), gen_random_uuid(), 'order', 'e', '{}', now(), g
                    FROM outbox.consumers c, generate_series(1, 30000) g""")
    size = db.execute("SELECT pg_relation_size('outbox._parked_events') / 8192").fetchone()[0]
    assert size > 200
    before = pages_read(db, "outbox._parked_events")
    cycle()
    return pages_read(db, "outbox._parked_events") - before, size


def test_a_sessions_settles_of_parked_keys_stay_lookups_as_the_queues_grow(db):
    """Plans made while the parking tables were tiny (a few hundred rows look like one row to
    the planner) keep looking each parked key and queued event up, not reading all of a
    consumer's queue for each, once the queues have grown under them."""
    db.execute("SELECT outbox.create_consumer('sink')")
    relay = Relay(db, "sink", batch_size=10)
    key = keys_in_shard(db, 3, 1)[0]

    def fail_once_then_catch_up():
        """key parked with 3 events queued; its head fails again (the heads kept back), then
        goes through (delivered heads leave the queue) and the key unparks (its queue empty)"""
        emit(db, key, 3)
        batch = relay.claim()
        relay.settle(batch[0].shard, batch[0].epoch, [Relay.failure(batch[0], "down", retry_after="0")])
        for deliver in (lambda e: False, lambda e: True, lambda e: True):
            relay.step(deliver, retry_after="0")
        assert db.execute("SELECT count(*) FROM outbox._parked WHERE aggregate_id = %s", (key,)).fetchone()[0] == 0

    read, size = queue_pages_read_once_grown(db, fail_once_then_catch_up)
    assert read < 100, f"one key failing once read {read} of the queues' {size} pages"


def test_a_riding_keys_failures_and_give_backs_stay_lookups_as_the_queues_grow(db):
    """The same for a key that rides (its queue, then its new events of the page): a failure of
    one of its new events, given back, then reported at settle, looks up its key's queue, not
    all of the consumer's queues, once they have grown under plans made while they were tiny."""
    db.execute("SELECT outbox.create_consumer('sink')")
    relay = Relay(db, "sink", batch_size=10)
    key = keys_in_shard(db, 3, 1)[0]

    def ride_fail_give_back_and_catch_up():
        """key parked with 3 events queued, its head through; it rides with two new events, the
        first of which fails, given back (release), then failed at settle; then it catches up"""
        emit(db, key, 3)
        batch = relay.claim()
        relay.settle(batch[0].shard, batch[0].epoch, [Relay.failure(batch[0], "down", retry_after="0")])
        relay.step(lambda e: True, retry_after="0")
        emit(db, key, 2)
        for give_back in (True, False):
            batch = relay.claim()
            assert len(batch) == 4, "the queue's two and the two new ones"
            if give_back:
                relay.nack(batch[2], "down", retry_after="0")
                relay.release(batch[0].shard, batch[0].epoch)
            else:
                relay.settle(batch[0].shard, batch[0].epoch, [Relay.failure(batch[2], "down", retry_after="0")])
        for _ in range(3):
            relay.step(lambda e: True, retry_after="0")
        assert db.execute("SELECT count(*) FROM outbox._parked WHERE aggregate_id = %s", (key,)).fetchone()[0] == 0

    read, size = queue_pages_read_once_grown(db, ride_fail_give_back_and_catch_up)
    assert read < 100, f"one riding key failing read {read} of the queues' {size} pages"


def test_plans_made_while_nothing_was_parked_are_made_again_as_keys_park(db):
    """A session's first failure plans settle while the parking tables are empty (one row, to
    the planner, which then takes any index for any lookup); once thousands of keys have
    parked, a settle still looks its failed key up, not reading every parked key: a parking
    table's plans are made again as it grows."""
    db.execute("SELECT outbox.create_consumer('sink')")
    no_autovacuum_of_parking(db)
    db.execute("VACUUM ANALYZE outbox._parked")
    db.execute("VACUUM ANALYZE outbox._parked_events")
    keys = [r[0] for r in db.execute("SELECT k FROM (SELECT 'p' || g AS k FROM generate_series(1, 200000) g) s "
                                     "WHERE outbox.shard_of(k) = 5 LIMIT 6001").fetchall()]
    relay = Relay(db, "sink", batch_size=10000)

    def fail_all(keys: list[str]) -> int:
        """one event of each key claimed and failed, due in a day; pages of _parked settle read"""
        db.execute("SELECT count(*) FROM outbox.emit_many('order', 'e', %s, array_fill('{}'::jsonb, ARRAY[%s]))",
                   (keys, len(keys)))
        batch = relay.claim()
        assert len(batch) == len(keys)
        before = pages_read(db, "outbox._parked")
        relay.settle(5, batch[0].epoch, [Relay.failure(e, "down", retry_after="1 day") for e in batch])
        return pages_read(db, "outbox._parked") - before

    fail_all(keys[:1])   # planned with nothing parked
    fail_all(keys[1:6000])
    size = db.execute("SELECT pg_relation_size('outbox._parked') / 8192").fetchone()[0]
    assert size > 50
    read = fail_all(keys[6000:])
    assert read < 10, f"a settle failing one key read {read} of the {size} pages of parked keys"


def test_plans_made_while_the_parking_tables_look_empty_bound_each_lookup(db):
    """Plans made as claim and settle make theirs (generic, sequential scans off) while the
    parking tables were last analyzed empty, with a hundred rows in them: each lookup, by key,
    by event id or by shard, is bounded by the index for it, not by consumer_id alone (a scan
    of every row of the consumer; before 0.26.0 every index led with consumer_id)."""
    db.execute("SELECT outbox.create_consumer('sink')")
    no_autovacuum_of_parking(db)
    db.execute("VACUUM ANALYZE outbox._parked")
    db.execute("VACUUM ANALYZE outbox._parked_events")
    db.execute("""INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
                  SELECT c.id, 'k' || g, g % 16, now() FROM outbox.consumers c, generate_series(1, 100) g""")
    db.execute("""INSERT INTO outbox._parked_events (consumer_id, aggregate_id, id, aggregate_type, event_type,
                                                     payload, created_at, seq)
                  SELECT c.id, 'k' || (g % 100), gen_random_uuid(), 'order', 'e', '{}', now(), g
                    FROM outbox.consumers c, generate_series(1, 150) g""")
    for setting in ("plan_cache_mode = force_generic_plan", "enable_seqscan = off", "enable_bitmapscan = off"):
        db.execute(f"SET {setting}")
    lookups = {   # name: (statement, its arguments, the column that must bound it)
        "event_by_id": ("SELECT q.pos FROM outbox._parked_events q WHERE q.consumer_id = $1 AND q.id = $2",
                        "int, uuid", "1, gen_random_uuid()", "id"),
        "queue_of_key": ("SELECT q.pos FROM outbox._parked_events q WHERE q.consumer_id = $1 AND q.aggregate_id = $2 "
                         "ORDER BY q.pos LIMIT 5", "int, text", "1, 'k5'", "aggregate_id"),
        "key_has_queue": ("SELECT EXISTS (SELECT FROM outbox._parked_events q "
                          "WHERE q.consumer_id = $1 AND q.aggregate_id = $2)", "int, text", "1, 'k5'", "aggregate_id"),
        "parked_key": ("SELECT p.attempts FROM outbox._parked p WHERE p.consumer_id = $1 AND p.aggregate_id = $2",
                       "int, text", "1, 'k5'", "aggregate_id"),
        "keys_of_shard": ("SELECT p.aggregate_id FROM outbox._parked p WHERE p.consumer_id = $1 AND p.shard = $2",
                          "int, int", "1, 3", "shard"),
    }
    for name, (statement, types, args, column) in lookups.items():
        db.execute(f"PREPARE {name}({types}) AS {statement}")
        plan = [r[0] for r in db.execute(f"EXPLAIN EXECUTE {name}({args})").fetchall()]
        bounds = [line for line in plan if "Index Cond:" in line]
        assert any(f"{column} = $2" in line for line in bounds), f"{name}: " + "\n".join(plan)


def test_status_counts_exactly_up_to_five_hundred_per_shard_and_estimates_beyond(db):
    db.execute("SELECT outbox.create_consumer('sink')")

    def emit(n: int) -> None:
        db.execute("SELECT count(*) FROM outbox.emit_many('order', 'e', "
                   "ARRAY(SELECT 'k' || (g %% 500) FROM generate_series(1, %s) g), array_fill('{}'::jsonb, ARRAY[%s]))",
                   (n, n))

    def pending() -> list[tuple[int, int]]:   # (shown, true) per shard
        return db.execute("""SELECT s.pending, (SELECT count(*) FROM outbox.events e WHERE e.shard = s.shard)
                               FROM outbox.shard_status s ORDER BY s.shard""").fetchall()

    emit(4000)   # about 250 a shard: counted
    assert all(shown == true for shown, true in pending())
    emit(40000)  # about 3,000 a shard: estimated
    for shown, true in pending():
        assert true > 500 and abs(shown - true) < true * 0.25, (shown, true)
    assert db.execute("""SELECT bool_and(s.oldest_pending_at = (SELECT min(created_at) FROM outbox.events e
                                                                 WHERE e.shard = s.shard))
                           FROM outbox.shard_status s""").fetchone()[0]
    Relay(db, "sink", batch_size=5000).drain()
    assert db.execute("SELECT sum(pending) FROM outbox.shard_status").fetchone()[0] == 0


def event_partitions_locked(db) -> int:
    """Partitions of outbox.events this backend holds a lock on, in its open transaction."""
    return db.execute("""SELECT count(*) FROM pg_locks l JOIN pg_inherits i ON i.inhrelid = l.relation
                          WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation'
                            AND i.inhparent = 'outbox.events'::regclass""").fetchone()[0]


def minute_partitions(db, ahead: int) -> int:
    """The events table in one-minute partitions, `ahead` of them ahead of now (as bench/costs.sh
    makes them); returns how many partitions it has."""
    for (part,) in db.execute("SELECT partition FROM outbox.partitions "
                              "WHERE parent = 'outbox.events'::regclass AND NOT is_default").fetchall():
        db.execute(f"DROP TABLE {part}")
    db.execute("DELETE FROM outbox._reach")   # their reach (days ahead) goes with them
    db.execute("UPDATE outbox.partition_config SET width = '1 minute', ahead = %s "
               "WHERE parent = 'outbox.events'::regclass", (ahead,))
    db.execute("SELECT count(*) FROM outbox.maintain()")
    return db.execute("SELECT count(*) FROM outbox.partitions WHERE parent = 'outbox.events'::regclass").fetchone()[0]


def test_claims_and_settles_lock_only_the_partitions_they_may_read(db):
    """A statement planned once for the session locks every partition at each execution; the
    claim path's reads lock only those around their time range (the partition of now, the
    next and the default): the first claim of a window (probe, late range, page), a claim
    with a parked key, a settle with a failure (it reads its batch), an idle poll."""
    assert minute_partitions(db, 60) > 60
    db.execute("SELECT outbox.create_consumer('sink', backoff_base => '1 ms', backoff_max => '1 ms')")
    relay = Relay(db, "sink", batch_size=10)
    keys = keys_in_shard(db, 5, 3)
    for i in range(30):
        db.execute("SELECT outbox.emit('order', %s, 'e', %s::jsonb)", (keys[i % 3], f'{{"i": {i}}}'))

    def locked_by(step):
        with db.transaction():
            result = step()
            locked = event_partitions_locked(db)
        assert locked <= 3, f"{step.__name__} locked {locked} event partitions"
        return result

    def first_claim():
        return relay.claim()
    batch = locked_by(first_claim)
    assert len(batch) == 10

    def settle_with_a_failure():
        return relay.settle(batch[0].shard, batch[0].epoch, [Relay.failure(batch[0], "down", retry_after="0")])
    locked_by(settle_with_a_failure)

    def claim_with_a_parked_key():
        return relay.claim()
    delivered = {e.payload["i"] for e in batch if e.aggregate_id != batch[0].aggregate_id}
    for _ in range(20):
        got = locked_by(claim_with_a_parked_key)
        if not got:
            continue
        delivered |= {e.payload["i"] for e in got}
        relay.settle(got[0].shard, got[0].epoch)
        if len(delivered) == 30:
            break
    assert delivered == set(range(30)), "every event is delivered across the minute partitions"

    def idle_poll():
        return relay.claim()
    assert locked_by(idle_poll) == []


def test_a_sessions_claims_follow_partitions_made_and_dropped_under_them(db, connect):
    """The claim path's plans are kept for the session per pair of partition bounds: a
    partition made or dropped afterwards (rows moved out of the default partition into it)
    is read all the same, nothing lost or doubled, in order per key."""
    minute_partitions(db, 2)
    db.execute("SELECT outbox.create_consumer('sink')")
    relay = Relay(connect(), "sink", batch_size=7)   # one session throughout
    emitted, delivered = [], []

    def emit(n):
        for _ in range(n):
            i = len(emitted)
            db.execute("SELECT outbox.emit('order', %s, 'e', %s::jsonb)", (f"k{i % 4}", f'{{"i": {i}}}'))
            emitted.append(i)

    def drain():
        delivered.extend(e.payload["i"] for e in relay.drain())

    emit(20)
    drain()
    # now's partition goes (its rows into the default partition), then maintain moves them out
    # into a partition made anew: the session's kept plans name neither arrangement
    emit(20)
    part = db.execute("SELECT partition FROM outbox.partitions WHERE parent = 'outbox.events'::regclass "
                      "AND lower <= now() AND now() < upper").fetchone()[0]
    db.execute(f"ALTER TABLE outbox.events DETACH PARTITION {part}")
    db.execute(f"INSERT INTO outbox.events SELECT * FROM {part}")
    db.execute(f"DROP TABLE {part}")
    emit(5)
    drain()
    emit(5)
    db.execute("SELECT count(*) FROM outbox.maintain()")   # moves the default partition's rows
    assert db.execute("SELECT count(*) FROM outbox.events_default").fetchone()[0] == 0
    emit(10)
    drain()
    assert sorted(delivered) == emitted, "nothing lost or doubled"
    per_key = {}
    for i in delivered:
        per_key.setdefault(i % 4, []).append(i)
    assert all(seq == sorted(seq) for seq in per_key.values()), "per-key order kept"


def test_a_session_that_only_claims_keeps_a_bounded_number_of_plans(db, connect):
    """The claim path keeps a plan per pair of partition bounds and lets them go past 64
    (src/claim/statements.rs), also while a claim's body runs them: a session that only claims,
    as the worker's does, keeps no more however often the bounds move."""
    minute_partitions(db, 100)
    db.execute("SELECT outbox.create_consumer('sink')")
    conn = connect()
    relay = Relay(conn, "sink")
    for minutes in range(1, 91):   # the reach a minute further each time: new bounds to probe
        db.execute("INSERT INTO outbox._reach (upper) VALUES (now() + %s * interval '1 minute')", (minutes,))
        assert relay.claim() == []
    kept = conn.execute("SELECT count(*) FROM pg_backend_memory_contexts "
                        "WHERE name = 'CachedPlanSource' AND ident LIKE '%_shards_with_events%'").fetchone()[0]
    assert 0 < kept <= 64


def test_partitions_bounded_by_infinity_leave_claims_working(db):
    """A partition made by hand FROM ('-infinity') or TO ('infinity') has bounds no constant
    in seconds can name: the claim path leaves them out of its bounds (a wider range)."""
    minute_partitions(db, 2)
    lowest, highest = db.execute("SELECT min(lower), max(upper) FROM outbox.partitions "
                                 "WHERE parent = 'outbox.events'::regclass AND NOT is_default").fetchone()
    db.execute("CREATE TABLE outbox.events_before PARTITION OF outbox.events "
               f"FOR VALUES FROM ('-infinity') TO ('{lowest.isoformat()}')")
    db.execute("CREATE TABLE outbox.events_after PARTITION OF outbox.events "
               f"FOR VALUES FROM ('{highest.isoformat()}') TO ('infinity')")
    db.execute("INSERT INTO outbox._reach (upper) VALUES ('infinity')")   # as after a restore
    db.execute("SELECT outbox.create_consumer('sink')")
    for i in range(5):
        db.execute("SELECT outbox.emit('order', 'k', 'e', %s::jsonb)", (f'{{"i": {i}}}',))
    relay = Relay(db, "sink")
    assert [e.payload["i"] for e in relay.drain()] == list(range(5))
