"""Soak: sustained emit and claim over many partition rotations (driven by bench/soak.sh).

Producers emit in business transactions at a steady rate; one relay claims and acks; a
scheduler runs outbox.maintain() every few seconds with short partitions and retention.
Every 30 s it prints storage, partitions and dead tuples; at the end it checks that every
committed event was delivered, and that storage stayed bounded.
"""

import sys
import threading
import time

import psycopg

dsn, minutes, width_s, rate = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stop = threading.Event()
emitted, delivered = set(), set()
lock = threading.Lock()


def producer(n: int) -> None:
    with psycopg.connect(dsn) as conn:
        per_thread = rate / n
        next_at = time.monotonic()
        i = 0
        while not stop.is_set():
            with conn.transaction():
                conn.execute("INSERT INTO business (v) VALUES (%s)", (i,))
                eid = conn.execute("SELECT outbox.emit('order', %s, 'order.created', '{\"v\": 1}')",
                                   (f"k{i % 5000}",)).fetchone()[0]
            with lock:
                emitted.add(eid)
            i += 1
            next_at += 1 / per_thread
            time.sleep(max(0.0, next_at - time.monotonic()))


def relay() -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not (stop.is_set() and drained(conn)):
            rows = conn.execute("SELECT shard, epoch, id FROM outbox.claim('soak', 100)").fetchall()
            if not rows:
                time.sleep(0.01)
                continue
            with lock:
                delivered.update(r[2] for r in rows)
            conn.execute("SELECT outbox.ack('soak', %s, %s)", (rows[0][0], rows[0][1]))


def drained(conn) -> bool:
    """Nothing pending or parked (asked of outbox.status: a claim would take a lease)."""
    return conn.execute("SELECT pending + parked_events = 0 FROM outbox.status WHERE consumer = 'soak'").fetchone()[0]


def maintainer() -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.add_notice_handler(lambda d: None)
        while not stop.is_set():
            conn.execute("SELECT * FROM outbox.maintain()").fetchall()
            time.sleep(min(5, width_s / 4))


def sample(conn) -> tuple:
    conn.execute("SELECT pg_stat_force_next_flush()")
    return conn.execute("""
        SELECT count(*) FILTER (WHERE NOT is_default),
               coalesce(sum(bytes), 0),
               (SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables
                 WHERE schemaname = 'outbox' AND relname LIKE 'events%%'),
               (SELECT count(*) FROM outbox._cursor_log)
          FROM outbox.partitions WHERE parent = 'outbox.events'::regclass""").fetchone()


with psycopg.connect(dsn, autocommit=True) as conn:
    conn.execute("SELECT outbox.create_consumer('soak')")
    conn.execute("UPDATE outbox.partition_config SET width = %s, ahead = 2, retention = %s",
                 (f"{width_s} seconds", f"{width_s} seconds"))
    conn.execute("SELECT * FROM outbox.maintain()")   # the first partitions, of the soak's width
    threads = [threading.Thread(target=producer, args=(2,)) for _ in range(2)]
    threads += [threading.Thread(target=relay), threading.Thread(target=maintainer)]
    for t in threads:
        t.start()
    print("| minute | emitted | delivered | event partitions | event storage | dead tuples (events) | cursor log rows |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    start = time.monotonic()
    sizes = []
    while time.monotonic() - start < minutes * 60:
        time.sleep(min(30, minutes * 60 - (time.monotonic() - start)))
        parts, size, dead, log_rows = sample(conn)
        size = float(size)
        sizes.append(size)
        with lock:
            e, d = len(emitted), len(delivered)
        print(f"| {(time.monotonic() - start) / 60:.1f} | {e} | {d} | {parts} | {size / 1e6:.1f} MB | {dead} | {log_rows} |", flush=True)
    stop.set()
    for t in threads:
        t.join()
    parts, size, dead, log_rows = sample(conn)
    size = float(size)
    lost = emitted - delivered
    print()
    print(f"emitted {len(emitted)}, delivered {len(delivered)}, lost {len(lost)}, "
          f"dead tuples in event tables {dead}, storage at the end {size / 1e6:.1f} MB, "
          f"largest sample {max(sizes) / 1e6:.1f} MB")
    # bounded: once partitions rotate, the end is no larger than the middle of the run
    third = max(1, len(sizes) // 3)
    bounded = len(sizes) < 3 or sizes[-1] <= 1.25 * max(sizes[third:2 * third] or sizes[:1])
    print(f"storage bounded: {'yes' if bounded else 'NO'}; every event delivered: {'yes' if not lost else 'NO'}")
    sys.exit(0 if not lost and bounded else 1)
