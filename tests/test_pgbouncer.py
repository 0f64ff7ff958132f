"""Behind PgBouncer in transaction mode (docs/guides/pgbouncer.md): producers, relays and an
inbox consumer share 4 server connections, and every event arrives once, in order per key.

A real PgBouncer (Debian's package; 1.18 in CI) runs as the postgres OS user with
pool_mode = transaction and at most 4 server connections to the test's database. In that mode
each transaction may run on a different server connection, so nothing a client relies on may
live in a session: a claim's lease is its (shard, epoch), not the connection that took it.
Clients must not use server-side prepared statements (psycopg: prepare_threshold=None):
PgBouncer 1.18 does not track them, and a statement prepared by one client runs on
connections that other clients then get (the last test shows what that does).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict

import psycopg
import pytest
from psycopg.types.json import Jsonb

from support.pgbouncer import Bouncer
from support.relay import Relay, first_deliveries

SERVER_CONNECTIONS = 4   # to the database, for all roles together (max_db_connections)
POOL_SIZE = 2            # per role (PgBouncer keeps a pool per database and user): 2 roles x 2
PRODUCERS, PER_PRODUCER, RELAYS, ORDERS = 16, 200, 6, 40
TOTAL = PRODUCERS * PER_PRODUCER   # 3,200 events committed
CONSUMER = "orders-feed"           # the outbox consumer the relays serve
INBOX = "orders-view"              # the inbox consumer that applies each event once


@pytest.fixture
def bouncer(cluster, dbname):
    b = Bouncer(dbname, POOL_SIZE, SERVER_CONNECTIONS)
    try:
        b.start(cluster.port)
        yield b
    finally:
        b.stop()


@pytest.fixture
def orders(db):
    """The application's tables: orders, whose version a producer bumps in the transaction that
    emits the order's events (so per order, commit order is version order), and applied, the
    effect of the inbox consumer."""
    db.execute("CREATE TABLE orders (id text PRIMARY KEY, version int NOT NULL DEFAULT 0)")
    db.execute("INSERT INTO orders (id) SELECT 'order-' || i FROM generate_series(1, %s) i", (ORDERS,))
    db.execute("CREATE TABLE applied (pos bigint GENERATED ALWAYS AS IDENTITY, event_id uuid UNIQUE, "
               "order_id text NOT NULL, version int NOT NULL)")
    db.execute("GRANT SELECT, UPDATE ON orders TO producer_user")
    db.execute("GRANT SELECT, INSERT ON applied TO producer_user")
    db.execute("SELECT outbox.create_consumer(%s, backoff_base => '10 ms', backoff_max => '50 ms')", (CONSUMER,))
    return [f"order-{i}" for i in range(1, ORDERS + 1)]


def pid_of(conn) -> int:
    return conn.execute("SELECT pg_backend_pid()").fetchone()[0]


def hold(bouncer, user: str, pid: int) -> psycopg.Connection:
    """A client of user in an open transaction on server connection pid (of user's pool), so
    that the next transaction of any other client of user runs on another one. PgBouncer hands
    out the server connection released last first (server_round_robin = 0, the default)."""
    holder = bouncer.connect(user)
    holder.execute("BEGIN")
    assert pid_of(holder) == pid, "the server connection released last was not reused first"
    return holder


def release(holder: psycopg.Connection) -> None:
    """Ends the holder's transaction: its server connection is the one released last."""
    holder.execute("COMMIT")
    holder.close()


def test_producers_relays_and_an_inbox_consumer_over_four_server_connections(cluster, dbname, db, bouncer, orders):
    """16 producers commit 3,200 events (1-3 per transaction; 1 transaction in 20 rolls back)
    while 6 relays claim and settle (2% of deliveries fail and are retried; a relay whose 4th
    batch has two events or more to send dies halfway through it, leaving its lease to run
    out) and apply each batch with inbox.claim in one transaction; 28 client connections, all
    through PgBouncer's 4 server connections."""
    delivered: list[tuple] = []   # (event id, order id) as the consumer committed them, in order
    seen: set = set()
    redeliverable: set = set()    # events of batches left unsettled: they may come twice
    stats = Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()
    deadline = time.monotonic() + 45

    def guarded(body):
        def run(*args):
            try:
                body(*args)
            except BaseException as e:   # reported after the join
                errors.append(e)
        return run

    @guarded
    def produce(p: int) -> None:
        rnd = random.Random(p)
        with bouncer.connect("producer_user") as conn:
            left = PER_PRODUCER
            while left:
                order, n, rollback = rnd.choice(orders), min(left, rnd.randint(1, 3)), rnd.random() < 0.05
                with conn.transaction(force_rollback=rollback):
                    version = conn.execute("UPDATE orders SET version = version + %s WHERE id = %s RETURNING version",
                                           (n, order)).fetchone()[0]
                    payloads = [Jsonb({"version": v}) for v in range(version - n + 1, version + 1)]
                    if n == 1:
                        conn.execute("SELECT outbox.emit('order', %s, 'order.changed', %s)", (order, payloads[0]))
                    else:
                        conn.execute("SELECT outbox.emit_many('order', 'order.changed', %s, %s::jsonb[])",
                                     ([order] * n, payloads))
                if not rollback:
                    left -= n

    def apply(conn, events) -> None:
        """The consumer: each event's effect once, in the transaction that claims its id."""
        duplicates = 0
        with conn.transaction():
            for e in events:
                if conn.execute("SELECT inbox.claim(%s, %s)", (e.id, INBOX)).fetchone()[0]:
                    conn.execute("INSERT INTO applied (event_id, order_id, version) VALUES (%s, %s, %s)",
                                 (e.id, e.aggregate_id, e.payload["version"]))
                else:
                    duplicates += 1
        with lock:
            delivered.extend((e.id, e.aggregate_id) for e in events)
            seen.update(e.id for e in events)
            stats["inbox duplicates"] += duplicates

    @guarded
    def relay(r: int) -> None:
        rnd = random.Random(100 + r)
        with bouncer.connect("relay_user") as conn, bouncer.connect("producer_user") as consumer:
            relay = Relay(conn, CONSUMER, batch_size=rnd.choice([10, 25, 50]), lease="1 second", owner=f"relay-{r}")
            batches = 0
            while len(seen) < TOTAL and time.monotonic() < deadline:
                batch = relay.claim()
                if not batch:
                    time.sleep(0.005)
                    continue
                batches += 1
                failures, failed, sent = [], set(), []
                for e in batch:
                    if e.aggregate_id in failed:
                        continue   # never ahead of its key's failed event: settle holds it back
                    if rnd.random() < 0.02:
                        failed.add(e.aggregate_id)
                        failures.append(relay.failure(e, "refused", retry_after="10 milliseconds"))
                    else:
                        sent.append(e)
                if batches == 4 and len(sent) > 1:   # dies after delivering half: never settles
                    with lock:
                        redeliverable.update(e.id for e in batch)
                        stats["abandoned batches"] += 1
                    apply(consumer, sent[:len(sent) // 2])
                    continue
                apply(consumer, sent)
                try:
                    relay.settle(batch[0].shard, batch[0].epoch, failures)
                except psycopg.errors.ObjectNotInPrerequisiteState:   # 55000: the lease ran out first
                    with lock:
                        redeliverable.update(e.id for e in batch)
                        stats["late settles"] += 1
                with lock:
                    stats["batches"] += 1
                    stats["failures"] += len(failures)

    servers: set[int] = set()
    busiest = [0]
    running = threading.Event()
    running.set()

    @guarded
    def watch() -> None:
        """The server connections PgBouncer opens to the database, sampled."""
        with cluster.connect(dbname) as conn:
            while running.is_set():
                pids = [r[0] for r in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND usename IN ('producer_user', 'relay_user')").fetchall()]
                servers.update(pids)
                busiest[0] = max(busiest[0], len(pids))
                time.sleep(0.01)

    started = time.monotonic()
    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = ([threading.Thread(target=produce, args=(p,)) for p in range(PRODUCERS)]
               + [threading.Thread(target=relay, args=(r,)) for r in range(RELAYS)])
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    running.clear()
    watcher.join()
    elapsed = time.monotonic() - started
    assert not errors, f"{errors!r}\n{bouncer.log()[-3000:]}"

    committed = db.execute("SELECT id, aggregate_id, (payload->>'version')::int FROM outbox.events "
                           "ORDER BY seq").fetchall()
    assert len(committed) == TOTAL, "the producers' committed events, and no rolled-back one"
    expected = defaultdict(list)
    for event_id, order, version in committed:
        expected[order].append(event_id)
        assert version == len(expected[order]), f"{order}: versions in commit order, without gaps"

    counts = Counter(event_id for event_id, _ in delivered)
    assert set(counts) == {r[0] for r in committed}, "every committed event delivered, nothing else"
    assert first_deliveries(delivered) == dict(expected), "per key, first deliveries in commit order"
    twice = {event_id for event_id, n in counts.items() if n > 1}
    assert twice <= redeliverable, f"{len(twice - redeliverable)} events came twice though their batch was settled"

    applied = db.execute("SELECT event_id, order_id, version FROM applied ORDER BY pos").fetchall()
    assert len(applied) == TOTAL == len({r[0] for r in applied}), "each event applied once"
    versions = defaultdict(list)
    for _, order, version in applied:
        versions[order].append(version)
    assert all(v == list(range(1, len(v) + 1)) for v in versions.values()), "applied in order per key"
    assert stats["inbox duplicates"] == len(delivered) - TOTAL, "every redelivery stopped by inbox.claim"

    assert busiest[0] <= SERVER_CONNECTIONS, f"{busiest[0]} server connections at once"
    assert len(servers) <= SERVER_CONNECTIONS, f"{len(servers)} server connections opened: the pools do not fit"
    assert db.execute("SELECT count(*) FROM outbox.dead_letters").fetchone()[0] == 0
    print(f"\n{TOTAL} events, {PRODUCERS} producers, {RELAYS} relays and {RELAYS} consumers in {elapsed:.1f} s; "
          f"{len(servers)} server connections used, at most {busiest[0]} at once; {dict(stats)}; "
          f"{len(twice)} events delivered twice")


def test_a_batch_settles_from_another_server_connection(bouncer, orders):
    """A lease is (shard, epoch), held by no session: a batch claimed on one server connection
    settles from another, and the shard goes on."""
    with bouncer.connect("producer_user") as producer:
        producer.execute("SELECT outbox.emit('order', 'order-1', 'order.changed', '{\"version\": 1}')")
        producer.execute("SELECT outbox.emit('order', 'order-1', 'order.changed', '{\"version\": 2}')")
    with bouncer.connect("relay_user") as relay:
        rows = relay.execute("SELECT c.shard, c.epoch, c.payload, pg_backend_pid() "
                             "FROM outbox.claim(%s, 1, '30 seconds', 'relay-a') c", (CONSUMER,)).fetchall()
        assert [r[2] for r in rows] == [{"version": 1}]
        shard, epoch, _, claimed_on = rows[0]
        holder = hold(bouncer, "relay_user", claimed_on)
        try:
            kept, settled_on = relay.execute("SELECT outbox.settle(%s, %s, %s), pg_backend_pid()",
                                             (CONSUMER, shard, epoch)).fetchone()
        finally:
            release(holder)
        assert (kept, settled_on != claimed_on) == (0, True)
        rest = Relay(relay, CONSUMER).drain()
        assert [e.payload for e in rest] == [{"version": 2}]


def test_server_side_prepared_statements_run_in_other_clients_places(bouncer, orders):
    """Why prepare_threshold=None: with psycopg's prepared statements on, PgBouncer 1.18 in
    transaction mode leaves each one on the server connection it was prepared on, under a name
    that every client gives its own first prepared statement (_pg3_0, then _pg3_1, ...). A
    client whose later transaction lands on another server connection runs the statement
    another client prepared there under that name, silently, or gets 26000 (does not exist) or
    42P05 (already exists). Here one client's upper() writes an event, and the other client's
    next statement fails."""
    a = bouncer.connect("producer_user", prepare_threshold=0)   # prepares at the first execution
    b = bouncer.connect("producer_user", prepare_threshold=0)
    emit = "SELECT outbox.emit('order', %s, 'order.changed', '{}')::text, pg_backend_pid()"
    query = "SELECT upper(%s), pg_backend_pid()"
    length = "SELECT length(%s)::text, pg_backend_pid()"
    try:
        x = a.execute(emit, ("order-1",)).fetchone()[1]   # a's _pg3_0, the emit, on server X
        holder = hold(bouncer, "producer_user", x)
        try:
            y = b.execute(query, ("order-2",)).fetchone()[1]   # b's _pg3_0, upper(), on Y
        finally:
            release(holder)   # X released last: the next transaction runs there
        assert y != x
        result, on = b.execute(query, ("order-2",)).fetchone()   # runs a's _pg3_0 on X
        assert (result != "ORDER-2", on) == (True, x), "b's upper() ran a's emit"

        x = a.execute(length, ("abc",)).fetchone()[1]   # a's _pg3_1, on X again
        holder = hold(bouncer, "producer_user", x)
        try:
            with pytest.raises(psycopg.errors.InvalidSqlStatementName, match='"_pg3_1" does not exist'):
                a.execute(length, ("abc",))   # on Y, which has no _pg3_1
        finally:
            release(holder)
        with bouncer.connect("relay_user") as relay:
            keys = [r[0] for r in relay.execute("SELECT aggregate_id FROM outbox.events ORDER BY seq")]
        assert keys == ["order-1", "order-2"], "an event for order-2, which b never emitted"
    finally:
        a.close()
        b.close()
