"""Costs that do not grow with what a call does not need to read: a relay session's claims keep
index plans however its tables grew after they were planned, and outbox.status counts a
shard's pending events exactly only up to a bound. (How fast, bench/claim.sh measures.)"""

from __future__ import annotations

import pytest

from relay import Relay


def pages_read(db, table: str) -> int:
    """Heap pages of table read (hit or not) by this backend so far, as the statistics say."""
    db.execute("SELECT pg_stat_force_next_flush()")
    db.execute("SELECT pg_stat_clear_snapshot()")
    return db.execute("SELECT heap_blks_hit + heap_blks_read FROM pg_statio_all_tables "
                      "WHERE relid = %s::regclass", (table,)).fetchone()[0] or 0


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
