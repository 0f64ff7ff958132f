"""Queries on a test database: keys that land in a shard, counts of events, a backend waiting
for a lock, an event written at a time of our choosing, the partitions a statement scans, the
worker's pid and the CPU time of a process."""

from __future__ import annotations

import os
import time


def keys_in_shard(db, shard: int, n: int) -> list[str]:
    """n aggregate ids that land in `shard`."""
    return [r[0] for r in db.execute(
        "SELECT k FROM (SELECT 'key-' || i AS k FROM generate_series(1, 10000) i) s "
        "WHERE outbox.shard_of(k) = %s LIMIT %s", (shard, n)).fetchall()]


def count_events(conn, where: str = "true", params=()) -> int:
    return conn.execute(f"SELECT count(*) FROM outbox.events WHERE {where}", params).fetchone()[0]


def insert_event_at(conn, key: str, at: str) -> None:
    """An event written as emit writes it, but with a created_at of our choosing."""
    conn.execute("""INSERT INTO outbox.events (id, aggregate_type, aggregate_id, event_type, payload, created_at, shard)
                    VALUES (outbox.uuid_v7(), 'order', %s, 'e', '{}', now() + %s::interval, outbox.shard_of(%s))""",
                 (key, at, key))


def waits_for_a_lock(db, pid: int) -> None:
    """Returns once backend pid waits for a lock."""
    deadline = time.monotonic() + 10
    while db.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0] != "Lock":
        assert time.monotonic() < deadline, "never waited for a lock"
        time.sleep(0.02)


def partitions_scanned(db, which: str, sql: str, *args) -> int:
    """How many event partitions that `which` (a condition on p, a row of outbox.partitions)
    picks sql's scans visit (it runs in a transaction that is rolled back;
    pg_stat_xact_user_tables counts its scans per partition, once the counts of earlier
    transactions, which it shows until they are flushed, are)."""
    db.execute("SELECT pg_stat_force_next_flush()")   # flushed as the session goes idle
    db.execute("BEGIN")
    try:
        db.execute(sql, args)
        return db.execute(f"""SELECT count(*) FROM pg_stat_xact_user_tables t
                               JOIN outbox.partitions p ON p.partition = t.relid
                              WHERE p.parent = 'outbox.events'::regclass AND NOT p.is_default
                                AND ({which}) AND t.idx_scan + t.seq_scan > 0""").fetchone()[0]
    finally:
        db.execute("ROLLBACK")


def worker_pid(cluster, db: str = "worker_db"):
    """the worker's pid"""
    return cluster.worker_pid(db)


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process"""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
