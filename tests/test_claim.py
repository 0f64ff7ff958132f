"""Claims: commit order without gaps, per-key order across parallel relays, leases and epochs,
key isolation with retries, dead letters and replay; no UPDATE or DELETE of event rows."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict

import psycopg
import pytest

from support.db import keys_in_shard, waits_for_a_lock
from support.events import emit
from support.relay import Relay, first_deliveries


def committed_events(db) -> list[tuple]:
    return db.execute("SELECT id, aggregate_id, seq FROM outbox.events ORDER BY seq").fetchall()


@pytest.fixture
def consumer(db):
    db.execute("SELECT outbox.create_consumer('sink', backoff_base => '10 ms', backoff_max => '50 ms')")
    return "sink"


@pytest.mark.parametrize("shards", [1, 3])
def test_each_committed_event_once_in_commit_order(db, consumer, shards):
    for i in range(300):
        emit(db, f"k{i % 7}", payload={"i": i})
    delivered = Relay(db, consumer, batch_size=25, shards=shards).drain()
    assert sorted(e.seq for e in delivered) == [r[2] for r in committed_events(db)]
    per_key = defaultdict(list)
    for e in delivered:
        per_key[e.aggregate_id].append(e.seq)
    assert all(seqs == sorted(seqs) for seqs in per_key.values())
    assert Relay(db, consumer).claim() == []


def test_a_transaction_that_commits_late_is_not_skipped(db, connect, consumer):
    """A emits first (lower seq and id) but commits after B: an id cursor would skip A."""
    a = connect(autocommit=False)
    emit(a, "a")                      # seq 1, uncommitted
    emit(db, "b")                     # seq 2, committed
    relay = Relay(db, consumer)
    first = relay.drain()
    assert [e.aggregate_id for e in first] == ["b"]
    last_seq_seen = max(e.seq for e in first)
    a.commit()
    a_seq = db.execute("SELECT seq FROM outbox.events WHERE aggregate_id = 'a'").fetchone()[0]
    assert a_seq < last_seq_seen, "the trap: a 'seq > last seen' cursor would never return A"
    assert [e.aggregate_id for e in relay.drain()] == ["a"]


def test_a_long_open_writer_across_many_windows(db, connect, consumer):
    long_tx = connect(autocommit=False)
    emit(long_tx, "long", 3)
    relay = Relay(db, consumer, batch_size=5)
    seen = []
    for i in range(20):               # many windows open and close while it stays open
        emit(db, f"k{i}", 2)
        seen += relay.drain()
    assert "long" not in {e.aggregate_id for e in seen}
    emit(long_tx, "long", 2)
    long_tx.commit()
    late = relay.drain()
    assert [e.aggregate_id for e in late] == ["long"] * 5
    assert [e.seq for e in late] == sorted(e.seq for e in late)
    assert len(seen) + len(late) == len(committed_events(db))


def test_uncommitted_and_rolled_back_events_are_never_claimed(db, connect, consumer):
    open_tx = connect(autocommit=False)
    emit(open_tx, "open")
    rolled = connect(autocommit=False)
    emit(rolled, "rolled")
    rolled.rollback()
    emit(db, "done")
    assert [e.aggregate_id for e in Relay(db, consumer).drain()] == ["done"]
    open_tx.rollback()
    assert Relay(db, consumer).drain() == []


def test_concurrent_writers_with_random_rollbacks(cluster, dbname, db, consumer):
    committed: set = set()
    lock = threading.Lock()

    def writer(w: int) -> None:
        rnd = random.Random(w)
        with cluster.connect(dbname, autocommit=False) as conn:
            for t in range(120):
                ids = [conn.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (f"w{w}-{rnd.randrange(5)}",)).fetchone()[0]
                       for _ in range(rnd.randint(1, 3))]
                if rnd.random() < 0.3:
                    conn.rollback()
                else:
                    conn.commit()
                    with lock:
                        committed.update(ids)
                if rnd.random() < 0.2:
                    time.sleep(0.001)

    claimed: list = []
    stop = threading.Event()

    def claimer() -> None:
        with cluster.connect(dbname) as conn:
            relay = Relay(conn, consumer, batch_size=7)
            while not stop.is_set():
                got = relay.drain()
                claimed.extend(e.id for e in got)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    drainer = threading.Thread(target=claimer)
    drainer.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    drainer.join()
    claimed.extend(e.id for e in Relay(db, consumer).drain())
    assert len(claimed) == len(set(claimed)), "no event claimed twice"
    assert set(claimed) == committed, "every committed event, and only those"


@pytest.mark.parametrize("shards", [1, 4])
def test_parallel_claimers_keep_per_key_order_through_failures_and_kills(cluster, dbname, db, consumer, shards):
    """Writers serialize per key (a lock on the aggregate, as applications do), so each key's
    commit order is its seq order. Three claimers on separate connections fail deliveries at
    random and are killed with pg_terminate_backend mid-batch; leases are short. With shards
    4, each claim takes up to four shards' batches, settled one by one."""
    keys = [f"agg-{i}" for i in range(12)]
    sink: list = []                   # events, in delivery order
    sink_lock = threading.Lock()
    killed_batches: list = []
    stop_writing = threading.Event()

    def writer(w: int) -> None:
        rnd = random.Random(100 + w)
        with cluster.connect(dbname, autocommit=False) as conn:
            for _ in range(150):
                key = rnd.choice(keys)
                conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (key,))
                conn.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (key,))
                conn.rollback() if rnd.random() < 0.1 else conn.commit()
        stop_writing.set()

    def claimer(c: int) -> None:
        rnd = random.Random(200 + c)
        conn = cluster.connect(dbname)
        relay = Relay(conn, consumer, batch_size=rnd.choice([3, 10, 50]), lease="300 milliseconds",
                      owner=f"c{c}", shards=shards)
        idle = 0
        while idle < 30:
            try:
                claimed = relay.claim()
                if not claimed:
                    idle = idle + 1 if stop_writing.is_set() else 0
                    time.sleep(0.01)
                    continue
                idle = 0
                for batch in Relay.batches(claimed):
                    failed = set()
                    kill_at = rnd.randrange(len(batch) * 8)
                    for i, e in enumerate(batch):
                        if e.aggregate_id in failed:
                            continue
                        if i == kill_at:   # the relay dies mid-batch, after delivering part of it
                            killed_batches.append((e.shard, e.epoch))
                            db_kill = cluster.connect(dbname)
                            db_kill.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
                            db_kill.close()
                            raise psycopg.OperationalError("killed")
                        if rnd.random() < 0.05:
                            failed.add(e.aggregate_id)
                            relay.nack(e, "random failure", retry_after="20 milliseconds")
                            continue
                        with sink_lock:
                            sink.append(e)
                    relay.ack(batch[0].shard, batch[0].epoch)
            except psycopg.Error:
                conn.close()
                conn = cluster.connect(dbname)
                relay.conn = conn
        conn.close()

    writers = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    claimers = [threading.Thread(target=claimer, args=(c,)) for c in range(3)]
    for t in writers + claimers:
        t.start()
    for t in writers + claimers:
        t.join()
    # whatever is left (parked retries, expired leases), one relay finishes it
    time.sleep(0.5)
    rest = Relay(db, consumer)
    for _ in range(50):
        sink.extend(rest.drain())
        time.sleep(0.05)

    committed = committed_events(db)
    assert {r[0] for r in committed} == {e.id for e in sink}, "nothing lost, nothing phantom"
    expected = defaultdict(list)
    for eid, key, seq in committed:
        expected[key].append(eid)
    assert first_deliveries((e.id, e.aggregate_id) for e in sink) == dict(expected), "per key, first deliveries follow commit order"
    duplicates = len(sink) - len(committed)
    assert duplicates == 0 or killed_batches, "duplicates only after a killed relay's lease expired"
    assert db.execute("SELECT count(*) FROM outbox.dead_letters").fetchone()[0] == 0


def test_a_poisoned_key_blocks_only_itself_then_dead_letters_and_replays(db, consumer):
    db.execute("SELECT outbox.drop_consumer('sink')")
    db.execute("SELECT outbox.create_consumer('sink', max_attempts => 3, backoff_base => '20 ms', backoff_max => '40 ms')")
    poison, *others = keys_in_shard(db, 5, 4)
    emit(db, poison, payload={"poison": True})
    emit(db, poison, 2)
    for k in others:
        emit(db, k, 3)
    relay = Relay(db, "sink", batch_size=4)
    attempts = []
    fixed = False

    def deliver(e):
        if e.payload == {"poison": True} and not fixed:
            attempts.append(e.attempt)
            return False
        return True

    delivered = []
    deadline = time.time() + 10
    while time.time() < deadline and db.execute("SELECT count(*) FROM outbox.dead_letters").fetchone()[0] == 0:
        delivered += relay.drain(deliver)
        time.sleep(0.02)
    delivered += relay.drain(deliver)
    time.sleep(0.1)
    delivered += relay.drain(deliver)
    # the others flowed although they share the poisoned key's shard
    others_delivered = [e.aggregate_id for e in delivered if e.aggregate_id != poison]
    assert sorted(others_delivered) == sorted(others * 3)
    assert attempts == [1, 2, 3]
    dead = db.execute("SELECT aggregate_id, attempts, last_error, payload FROM outbox.dead_letters").fetchall()
    assert len(dead) == 1 and dead[0][0] == poison and dead[0][1] == 3 and "failed" in dead[0][2]
    assert dead[0][3] == {"poison": True}
    # the key moved on: its later events were delivered, in order
    poison_seqs = [e.seq for e in delivered if e.aggregate_id == poison]
    assert len(poison_seqs) == 2 and poison_seqs == sorted(poison_seqs)
    assert db.execute("SELECT count(*) FROM outbox._parked").fetchone()[0] == 0
    # replay re-queues the dead letter; now it goes through
    fixed = True
    assert db.execute("SELECT outbox.replay('sink')").fetchone()[0] == 1
    replayed = relay.drain(deliver)
    assert [(e.aggregate_id, e.payload) for e in replayed] == [(poison, {"poison": True})]
    assert db.execute("SELECT count(*) FROM outbox.dead_letters").fetchone()[0] == 0


def test_backoff_grows_with_attempts(db):
    db.execute("SELECT outbox.create_consumer('slow', backoff_base => '1 second', backoff_max => '1 hour')")
    emit(db, "k")
    relay = Relay(db, "slow")
    batch = relay.claim()
    relay.nack(batch[0], "down")
    relay.ack(batch[0].shard, batch[0].epoch)
    delays = []
    for _ in range(4):
        delay = db.execute("SELECT extract(epoch FROM next_attempt_at - now()) FROM outbox._parked").fetchone()[0]
        delays.append(float(delay))
        db.execute("UPDATE outbox._parked SET next_attempt_at = now()")
        batch = relay.claim()
        assert len(batch) == 1 and batch[0].attempt == len(delays) + 1
        relay.nack(batch[0], "down")
        relay.ack(batch[0].shard, batch[0].epoch)
    for n, d in enumerate(delays):   # base * 2^n, with jitter in [0.5, 1]
        assert 0.5 * 2 ** n - 0.1 <= d <= 2 ** n + 0.1, delays
    assert Relay(db, "slow").claim() == [], "not due: the parked key waits"


def test_retry_after_is_honoured(db, consumer):
    emit(db, "k")
    relay = Relay(db, consumer)
    batch = relay.claim()
    relay.nack(batch[0], "429", retry_after="1 hour")
    relay.ack(batch[0].shard, batch[0].epoch)
    assert db.execute("SELECT next_attempt_at > now() + interval '59 minutes' FROM outbox._parked").fetchone()[0]


def test_a_stale_epoch_is_refused_after_the_lease_expires(db, connect, consumer):
    emit(db, "k", 3)
    slow = Relay(connect(), consumer, lease="100 milliseconds", owner="slow")
    batch = slow.claim()
    time.sleep(0.3)
    fast = Relay(connect(), consumer, owner="fast")
    again = fast.claim()
    assert [e.id for e in again] == [e.id for e in batch], "the expired batch is handed out again, in order"
    assert again[0].epoch == batch[0].epoch + 1
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as err:
        slow.ack(batch[0].shard, batch[0].epoch)
    assert err.value.diag.message_hint and "held by fast" in err.value.diag.message_detail
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
        slow.nack(batch[0], "late")
    fast.ack(again[0].shard, again[0].epoch)
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
        fast.ack(again[0].shard, again[0].epoch)   # twice
    assert fast.claim() == []


def test_an_expired_lease_nobody_took_can_still_ack(db, consumer):
    emit(db, "k")
    relay = Relay(db, consumer, lease="50 milliseconds")
    batch = relay.claim()
    time.sleep(0.1)
    relay.ack(batch[0].shard, batch[0].epoch)
    assert relay.claim() == []


def test_a_leased_shard_is_not_handed_out_twice(db, connect, consumer):
    key_a, key_b = keys_in_shard(db, 3, 2)
    emit(db, key_a)
    emit(db, key_b)
    first = Relay(connect(), consumer, batch_size=1).claim()
    assert len(first) == 1
    assert Relay(connect(), consumer).claim() == [], "the shard is leased; nothing else has work"


def test_release_gives_the_batch_back_and_waits(db, consumer):
    emit(db, "k", 2)
    relay = Relay(db, consumer)
    batch = relay.claim()
    relay.release(batch[0].shard, batch[0].epoch, "300 milliseconds")
    assert relay.claim() == []
    time.sleep(0.4)
    again = relay.claim()
    assert [e.id for e in again] == [e.id for e in batch]


def test_consumers_fan_out_independently(db):
    db.execute("SELECT outbox.create_consumer('a'); SELECT outbox.create_consumer('b')")
    emit(db, "k", 5)
    assert len(Relay(db, "a").drain()) == 5
    assert len(Relay(db, "b").drain()) == 5
    assert Relay(db, "a").drain() == []


def test_a_consumer_starts_now_unless_from_beginning(db):
    emit(db, "old", 2)
    db.execute("SELECT outbox.create_consumer('new'); SELECT outbox.create_consumer('all', true)")
    emit(db, "fresh")
    assert [e.aggregate_id for e in Relay(db, "new").drain()] == ["fresh"]
    assert sorted(e.aggregate_id for e in Relay(db, "all").drain()) == ["fresh", "old", "old"]


def test_claims_never_update_or_delete_event_rows(db, consumer):
    for i in range(200):
        emit(db, f"k{i % 9}")
    relay = Relay(db, consumer, batch_size=10)
    relay.drain(lambda e: e.seq % 17 != 0)   # some failures too: parking copies, never touches
    time.sleep(0.1)
    relay.drain()
    assert db.execute("SELECT count(*) FROM outbox.events WHERE xmax <> '0'").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM outbox._cursor_log WHERE xmax <> '0'").fetchone()[0] == 0


@pytest.mark.parametrize("sql,sqlstate", [
    ("SELECT * FROM outbox.claim('nope')", "42704"),
    ("SELECT * FROM outbox.claim('sink', 0)", "22023"),
    ("SELECT * FROM outbox.claim('sink', 10, '0 seconds')", "22023"),
    ("SELECT * FROM outbox.claim('sink', shards => 0)", "22023"),
    ("SELECT * FROM outbox.claim('sink', shards => NULL)", "22004"),
    ("SELECT * FROM outbox.settle_and_claim('sink', 1, 1, shards => 0)", "22023"),
    ("SELECT outbox.ack('sink', 99, 1)", "22023"),
    ("SELECT outbox.ack('sink', 1, 12345)", "55000"),
    ("SELECT outbox.create_consumer('sink')", "42710"),
    ("SELECT outbox.create_consumer('')", "22023"),
    ("SELECT outbox.create_consumer('x', max_attempts => 0)", "22023"),
])
def test_bad_calls_get_clear_errors(db, consumer, sql, sqlstate):
    with pytest.raises(psycopg.Error) as err:
        db.execute(sql)
    assert err.value.sqlstate == sqlstate and err.value.diag.message_hint


def test_nack_of_an_event_not_in_the_batch(db, consumer):
    emit(db, "k")
    batch = Relay(db, consumer).claim()
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        db.execute("SELECT outbox.nack('sink', %s, %s, gen_random_uuid(), 'x')", (batch[0].shard, batch[0].epoch))


def test_roles_for_claims(connect, db, consumer):
    emit(db, "k")
    relay = Relay(connect("relay_user"), consumer)
    batch = relay.claim()
    relay.ack(batch[0].shard, batch[0].epoch)
    for user, sql in [("relay_user", "SELECT outbox.create_consumer('x')"),
                      ("relay_user", "SELECT outbox.replay('sink')"),
                      ("relay_user", "SELECT * FROM outbox.dead_letters"),
                      ("producer_user", "SELECT * FROM outbox.claim('sink')"),
                      ("producer_user", "SELECT * FROM outbox.consumers")]:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connect(user).execute(sql)
    connect("admin_user").execute("SELECT outbox.create_consumer('by-admin')")


def test_a_claim_of_several_shards_hands_out_a_batch_per_shard(db, connect, consumer):
    """shards => 2: two shards' batches in one call, each with its own epoch and its events
    together in commit order; each settles on its own; the third shard is left for another
    claim, which does not get the two leased ones."""
    keys = {shard: keys_in_shard(db, shard, 1)[0] for shard in (2, 5, 9)}
    for i in range(3):
        for shard, key in keys.items():
            emit(db, key, payload={"i": i})
    first = Relay(db, consumer, shards=2).claim()
    batches = Relay.batches(first)
    assert len(batches) == 2 and len({b[0].shard for b in batches}) == 2
    for b in batches:
        assert [e.aggregate_id for e in b] == [keys[b[0].shard]] * 3
        assert [e.seq for e in b] == sorted(e.seq for e in b)
    other = Relay(connect(), consumer, shards=16).claim()
    assert {e.shard for e in other} == set(keys) - {b[0].shard for b in batches}
    for b in batches + Relay.batches(other):
        Relay(db, consumer).ack(b[0].shard, b[0].epoch)
    assert Relay(db, consumer, shards=16).claim() == []
    assert sorted(e.seq for e in first + other) == [r[2] for r in committed_events(db)]


def test_a_claim_of_a_sparse_stream_locks_only_the_shards_with_work(db, connect, consumer):
    """One new event at a time, each in another shard: the claim takes only that shard's row,
    not every shard it would try in turn from a random one (#38: most of a sparse claim)."""
    relay_conn = connect(autocommit=False)
    relay = Relay(relay_conn, consumer)
    for shard in (3, 11, 6, 0, 15):
        emit(db, keys_in_shard(db, shard, 1)[0])
        batch = relay.claim()
        xid = relay_conn.execute("SELECT (pg_current_xact_id()::text::bigint % 4294967296)::text").fetchone()[0]
        locked = db.execute("SELECT s.shard FROM outbox._shards s JOIN outbox.consumers c ON c.id = s.consumer_id "
                            "WHERE c.name = %s AND s.xmax = %s::xid", (consumer, xid)).fetchall()
        relay_conn.commit()
        assert [e.shard for e in batch] == [shard] and locked == [(shard,)]
        relay.ack(shard, batch[0].epoch)
        relay_conn.commit()


def test_a_claim_takes_the_shard_that_has_waited_longest(db, consumer):
    """With several shards holding work, a claim takes the one whose cursor last moved longest
    ago, whatever the order their events committed in: picked at random, a shard could be
    passed over claim after claim while the others were served (events waited up to 280 ms
    into Kafka at 1,000 events/s)."""
    served = [9, 2, 14, 5, 11, 0]
    keys = {shard: keys_in_shard(db, shard, 1)[0] for shard in served}
    relay = Relay(db, consumer)
    for shard in served:  # each shard's cursor moves, in this order
        emit(db, keys[shard])
        batch = relay.claim()
        assert [e.shard for e in batch] == [shard]
        relay.ack(shard, batch[0].epoch)
    for shard in reversed(served):  # new events in every one, newest served first
        emit(db, keys[shard])
    taken = []
    for _ in served:
        batch = relay.claim()
        taken.append(batch[0].shard)
        relay.ack(batch[0].shard, batch[0].epoch)
    assert taken == served
    assert relay.claim() == []


def test_settle_and_claim_takes_several_shards(db, consumer):
    keys = [keys_in_shard(db, shard, 1)[0] for shard in (1, 4, 7)]
    emit(db, keys[0])
    relay = Relay(db, consumer)
    batch = relay.claim()
    for key in keys:
        emit(db, key)
    rows = db.execute("SELECT shard, epoch FROM outbox.settle_and_claim('sink', %s, %s, shards => 3)",
                      (batch[0].shard, batch[0].epoch)).fetchall()
    assert sorted({r[0] for r in rows}) == [1, 4, 7] and len(rows) == 3


def test_a_shard_with_a_parked_key_hands_out_the_others_in_commit_order(db, consumer):
    a, b = keys_in_shard(db, 3, 2)
    for i in range(3):
        emit(db, a, payload={"i": i})
        emit(db, b, payload={"i": i})
    relay = Relay(db, consumer)
    batch = relay.claim()
    relay.nack(batch[0], "down", retry_after="1 hour")   # a is parked, its events queue
    relay.ack(batch[0].shard, batch[0].epoch)
    for i in range(3, 9):
        emit(db, a, payload={"i": i})
        emit(db, b, payload={"i": i})
    batch = relay.claim()
    assert [(e.aggregate_id, e.payload["i"]) for e in batch] == [(b, i) for i in range(3, 9)]
    queued = db.execute("SELECT (payload->>'i')::int FROM outbox._parked_events ORDER BY pos").fetchall()
    assert [r[0] for r in queued] == list(range(9)), "a's events queue in order"


@pytest.mark.parametrize("parked", [2, 7])
def test_a_page_is_sorted_by_parked_keys_whether_they_are_few_or_many(db, consumer, parked):
    """A claim of a shard with parked keys reads their keys once when they are no more than a
    page (batch_size 5), and looks each event's key up otherwise: either way the page's events
    of parked keys join their queues, in order, and only the others go out, in commit order."""
    keys = keys_in_shard(db, 3, parked + 3)
    stuck, free = keys[:parked], keys[parked:]
    relay = Relay(db, consumer, batch_size=5)
    for key in stuck:
        emit(db, key, payload={"i": 0})
    first = Relay(db, consumer, batch_size=100).claim()
    relay.settle(3, first[0].epoch, [Relay.failure(e, "down", retry_after="1 hour") for e in first])
    for i in range(1, 4):
        for key in keys:
            emit(db, key, payload={"i": i})
    out = [(e.aggregate_id, e.payload["i"]) for e in relay.drain()]
    assert out == [(key, i) for i in range(1, 4) for key in free]
    queued = db.execute("SELECT aggregate_id, (payload->>'i')::int FROM outbox._parked_events ORDER BY pos").fetchall()
    assert sorted(queued, key=lambda r: (stuck.index(r[0]), r[1])) == [(k, i) for k in stuck for i in range(4)]
    assert [r for r in queued if r[0] == stuck[0]] == [(stuck[0], i) for i in range(4)], "each key's queue in order"


def test_a_claim_with_nothing_to_read_locks_nothing_and_writes_nothing(db, connect, consumer):
    """An idle relay's poll: no xid, no shard row locked, no mark or cursor row written, so it
    costs no WAL and no commit; events and parked keys are still found at once."""
    emit(db, "k", 3)
    Relay(db, consumer, batch_size=100).drain()
    marks, cursors = (db.execute(f"SELECT count(*) FROM outbox.{t}").fetchone()[0] for t in ("_marks", "_cursor_log"))
    with db.transaction():
        assert db.execute("SELECT count(*) FROM outbox.claim('sink')").fetchone()[0] == 0
        assert db.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0] is None
        assert db.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' "
                          "AND pid = pg_backend_pid()").fetchone()[0] == 0
    assert (db.execute("SELECT count(*) FROM outbox._marks").fetchone()[0],
            db.execute("SELECT count(*) FROM outbox._cursor_log").fetchone()[0]) == (marks, cursors)
    emit(db, "k2")
    assert len(connect().execute("SELECT * FROM outbox.claim('sink')").fetchall()) == 1


def test_an_idle_poll_stays_idle_while_a_long_transaction_holds_an_xid(db, connect, consumer):
    """A transaction that took an xid and stays open (a long report, a migration, a session
    left idle in transaction) is in progress at every window's bound after it: its events are
    read once it ends. Until 0.29.0 the floors of the shards stayed below it, so every shard
    that had an event since looked as if it had work, and each idle poll locked them all, took
    an xid and wrote a cursor row. Now a poll with nothing to read stays idle; the long
    transaction's own event arrives once it commits, and others' events as they come."""
    keys = [keys_in_shard(db, s, 1)[0] for s in range(16)]
    relay = Relay(db, consumer, batch_size=100, shards=16)
    long = connect(autocommit=False)
    emit(long, keys[3], payload={"late": True})    # the lowest seq, committed last
    for key in keys:
        emit(db, key)
    assert sorted(e.aggregate_id for e in relay.drain()) == sorted(keys)
    emit(db, keys[5])
    assert [e.aggregate_id for e in relay.drain()] == [keys[5]]
    cursors = db.execute("SELECT count(*) FROM outbox._cursor_log").fetchone()[0]
    for _ in range(3):
        with db.transaction():
            assert db.execute("SELECT count(*) FROM outbox.claim('sink', shards => 16)").fetchone()[0] == 0
            assert db.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0] is None, "no xid, no lock"
    assert db.execute("SELECT count(*) FROM outbox._cursor_log").fetchone()[0] == cursors, "nothing written"
    emit(db, keys[7])
    assert [e.aggregate_id for e in relay.drain()] == [keys[7]], "others' events as they come"
    long.commit()
    late = relay.drain()
    assert [(e.aggregate_id, e.payload) for e in late] == [(keys[3], {"late": True})], "its own once it commits"


def test_an_idle_poll_stays_idle_after_a_transaction_in_flight_at_a_bound_ends(db, connect, consumer):
    """While a long transaction holds an xid, another one (T) is in flight when a claim takes
    its bound for shard B: T is in that bound's in-progress list, with a floor below B's event.
    Once T ends, B is probed from that floor again, finds its delivered event and opens an
    empty window once; that window must be recorded (the probe floor rose), or the long
    transaction keeps the pending floor where it was and every idle poll opens it again,
    taking an xid."""
    a, = keys_in_shard(db, 2, 1)
    b, = keys_in_shard(db, 9, 1)
    relay = Relay(db, consumer, batch_size=100, shards=16)
    long = connect(autocommit=False)
    long.execute("SELECT pg_current_xact_id()")
    t = connect(autocommit=False)
    emit(t, a)
    emit(db, b)
    assert [e.aggregate_id for e in relay.drain()] == [b]
    t.commit()
    assert [e.aggregate_id for e in relay.drain()] == [a]
    relay.drain()   # B's empty window, once
    for _ in range(3):
        with db.transaction():
            assert db.execute("SELECT count(*) FROM outbox.claim('sink', shards => 16)").fetchone()[0] == 0
            assert db.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0] is None, "no xid, no lock"
    long.rollback()


def test_a_claim_whose_only_work_is_leased_stays_idle(db, connect, consumer):
    """Events wait in a shard another relay holds: a second relay's poll finds nothing to take
    and, as an idle poll, takes no xid and writes nothing."""
    key = keys_in_shard(db, 3, 1)[0]
    emit(db, key)
    held = Relay(connect(), consumer).claim()
    emit(db, key, 2)
    other = connect(autocommit=False)
    assert other.execute("SELECT count(*) FROM outbox.claim('sink')").fetchone()[0] == 0
    assert other.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0] is None
    other.rollback()
    Relay(db, consumer).ack(3, held[0].epoch)
    assert [e.shard for e in Relay(other, consumer).claim()] == [3, 3]


def test_a_parked_key_not_yet_due_leaves_a_poll_idle(db, connect, consumer):
    """A key parked until later gives a claim nothing to do: the poll takes no xid and writes
    nothing (until 0.23.0 every poll did, while any key was parked); once the key is due, the
    next claim hands out its head."""
    emit(db, "k", 2)
    relay = Relay(db, consumer, batch_size=100)
    batch = relay.claim()
    relay.settle(batch[0].shard, batch[0].epoch, [Relay.failure(batch[0], "503", "1 hour")])
    cursors = db.execute("SELECT count(*) FROM outbox._cursor_log").fetchone()[0]
    with db.transaction():
        assert db.execute("SELECT count(*) FROM outbox.claim('sink')").fetchone()[0] == 0
        assert db.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0] is None
    assert db.execute("SELECT count(*) FROM outbox._cursor_log").fetchone()[0] == cursors
    db.execute("UPDATE outbox._parked SET next_attempt_at = now()")
    assert [r[0] for r in connect().execute("SELECT id FROM outbox.claim('sink')").fetchall()] == [batch[0].id]


def test_relays_write_without_locking_the_consumers_row(db, connect, consumer):
    """Two relays' claims (open at once), settles that park and dead-letter keys, settle_and_claim,
    release_owner and replay write cursor rows and parked keys under the shard rows they hold:
    the consumer's row is never locked (its xmax stays), so overlapping relays make no
    multixact and write no lock record on it."""
    for i in range(40):
        emit(db, f"k{i}", 3)
    xmax = db.execute("SELECT xmax::text FROM outbox.consumers WHERE name = 'sink'").fetchone()[0]
    one, two = connect(autocommit=False), connect(autocommit=False)
    a, b = Relay(one, consumer, batch_size=5, owner="a"), Relay(two, consumer, batch_size=5, owner="b")
    first, second = a.claim(), b.claim()  # both transactions open: each has written its claim row
    assert first and second and first[0].shard != second[0].shard
    one.commit(), two.commit()
    a.settle(first[0].shard, first[0].epoch, [Relay.failure(first[0], "503", "0")])
    b.settle(second[0].shard, second[0].epoch, [Relay.failure(second[0], "400", final=True)])
    one.commit(), two.commit()
    batch = a.claim()
    one.commit()
    a.settle_and_claim(batch[0].shard, batch[0].epoch)
    one.commit()
    assert db.execute("SELECT outbox.release_owner('sink', 'a')").fetchone()[0] == 1
    assert db.execute("SELECT outbox.replay('sink')").fetchone()[0] == 1
    assert db.execute("SELECT xmax::text FROM outbox.consumers WHERE name = 'sink'").fetchone()[0] == xmax


def test_drop_consumer_takes_its_cursors_parked_keys_and_dead_letters_and_no_one_elses(db, consumer):
    """Cursor rows and parked keys have no foreign key to cascade from (sql/cursors.sql says why):
    drop_consumer deletes them itself, with the queues behind parked keys, and leaves the other
    consumers' alone."""
    db.execute("SELECT outbox.create_consumer('other', from_beginning => true)")
    for key in keys_in_shard(db, 5, 3):  # one batch holds them all
        emit(db, key, 3)
    ids = {}
    for name in (consumer, "other"):
        ids[name] = db.execute("SELECT id FROM outbox.consumers WHERE name = %s", (name,)).fetchone()[0]
        relay = Relay(db, name, batch_size=30)
        batch = relay.claim()
        keys = sorted({e.aggregate_id for e in batch})
        first = {k: next(e for e in batch if e.aggregate_id == k) for k in keys[:2]}
        relay.settle(batch[0].shard, batch[0].epoch, [Relay.failure(first[keys[0]], "503", "1 hour"),
                                                      Relay.failure(first[keys[1]], "400", final=True)])
    left = "SELECT count(*) FROM {t} WHERE {col} = %s"
    tables = {"outbox._shards": "consumer_id", "outbox._cursor_log": "consumer_id", "outbox._parked": "consumer_id",
              "outbox._parked_events": "consumer_id", "outbox.dead_letters": "consumer"}

    def rows(name):
        return {t: db.execute(left.format(t=t, col=col), (name if col == "consumer" else ids[name],)).fetchone()[0]
                for t, col in tables.items()}

    before = rows("other")
    assert all(rows(consumer).values()) and all(before.values()), "each consumer has rows in every table"
    assert db.execute("SELECT outbox.drop_consumer(%s)", (consumer,)).fetchone()[0] is True
    assert not any(rows(consumer).values()), rows(consumer)
    assert rows("other") == before
    assert db.execute("SELECT outbox.drop_consumer(%s)", (consumer,)).fetchone()[0] is False


def test_drop_consumer_refuses_a_snapshot_older_than_its_locks(db, connect, consumer):
    """At REPEATABLE READ or SERIALIZABLE its deletes would not see the rows relays commit while
    it waits for their shards, and would leave them behind: refused (25000), nothing dropped.
    READ UNCOMMITTED is READ COMMITTED in PostgreSQL: allowed."""
    for level in ("REPEATABLE READ", "SERIALIZABLE"):
        conn = connect(autocommit=False)
        conn.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        with pytest.raises(psycopg.errors.InvalidTransactionState, match="READ COMMITTED"):
            conn.execute("SELECT outbox.drop_consumer(%s)", (consumer,))
        conn.rollback()
    conn = connect(autocommit=False)
    conn.execute("SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")  # READ COMMITTED in PostgreSQL
    assert conn.execute("SELECT outbox.drop_consumer(%s)", (consumer,)).fetchone()[0] is True
    conn.commit()


def test_a_claim_at_repeatable_read_cannot_take_a_batch_another_relay_holds(db, connect, consumer):
    """A claim locks a free shard, then reads its cursor. At REPEATABLE READ that read used a
    snapshot taken before the lock: a claim committed in between did not show, and the same
    batch went out again under the same epoch. Claims, settles, releases and replays refuse
    REPEATABLE READ and SERIALIZABLE (25000); the other relay's batch stays its own."""
    for i in range(5):
        emit(db, "k", payload={"i": i})
    late = connect(autocommit=False)
    late.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    late.execute("SELECT 1")                              # its snapshot, before the other's claim
    taken = db.execute("SELECT shard, epoch FROM outbox.claim(%s, 100)", (consumer,)).fetchall()
    assert len(taken) == 5
    with pytest.raises(psycopg.errors.InvalidTransactionState, match="READ COMMITTED"):
        late.execute("SELECT * FROM outbox.claim(%s, 100)", (consumer,)).fetchall()
    late.rollback()
    shard, epoch = taken[0]
    calls = {
        "claim": ("SELECT count(*) FROM outbox.claim(%s, 100)", (consumer,)),
        "settle": ("SELECT outbox.settle(%s, %s, %s, '[]')", (consumer, shard, epoch)),
        "settle_and_claim": ("SELECT count(*) FROM outbox.settle_and_claim(%s, %s, %s, '[]')",
                             (consumer, shard, epoch)),
        "ack": ("SELECT outbox.ack(%s, %s, %s)", (consumer, shard, epoch)),
        "release": ("SELECT outbox.release(%s, %s, %s)", (consumer, shard, epoch)),
        "release_owner": ("SELECT outbox.release_owner(%s, 'someone')", (consumer,)),
        "replay": ("SELECT outbox.replay(%s)", (consumer,)),
    }
    for level in ("REPEATABLE READ", "SERIALIZABLE"):
        for name, (sql, args) in calls.items():
            conn = connect(autocommit=False)
            conn.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
            with pytest.raises(psycopg.errors.InvalidTransactionState, match="READ COMMITTED"):
                conn.execute(sql, args)
            conn.rollback()
    assert db.execute("SELECT outbox.settle(%s, %s, %s, '[]')", (consumer, shard, epoch)).fetchone() is not None


def test_replay_refuses_a_consumer_dropped_while_it_waited(db, connect, consumer):
    """A replay that found the consumer, then waited for its shards while it was dropped and
    made again under the same name, would queue the new consumer's dead letters under the old
    one's id, where no one reads them: refused (42704), and the dead letter stays."""
    dropper = connect(autocommit=False)
    dropper.execute("SELECT outbox.drop_consumer(%s)", (consumer,))
    dropper.execute("SELECT outbox.create_consumer(%s)", (consumer,))
    dropper.execute("INSERT INTO outbox.dead_letters (consumer, event_id, aggregate_type, aggregate_id,"
                    " event_type, created_at, seq, attempts) VALUES (%s, outbox.uuid_v7(), 'order', 'k', 'e',"
                    " now(), 1, 1)", (consumer,))
    replayer = connect()
    pid = replayer.execute("SELECT pg_backend_pid()").fetchone()[0]
    outcome = {}

    def replay():
        try:
            outcome["replayed"] = replayer.execute("SELECT outbox.replay(%s)", (consumer,)).fetchone()[0]
        except psycopg.Error as e:
            outcome["error"] = e

    waiting = threading.Thread(target=replay)
    waiting.start()
    waits_for_a_lock(db, pid)  # on the old consumer's shards, which the drop holds
    dropper.commit()
    waiting.join(10)
    assert isinstance(outcome.get("error"), psycopg.errors.UndefinedObject), outcome
    assert db.execute("SELECT count(*) FROM outbox.dead_letters").fetchone()[0] == 1
    assert db.execute("SELECT count(*) FROM outbox._parked").fetchone()[0] == 0


def test_polls_after_a_window_read_to_its_end_write_nothing(db, consumer):
    """A batch that fills its limit leaves its window open; the claim that then finds nothing
    more in it records the empty window, once, so the polls after it are idle ones (no xid)
    instead of reading that window again each time."""
    emit(db, "k", 5)
    relay = Relay(db, consumer, batch_size=5)
    batch = relay.claim()
    assert len(batch) == 5
    relay.settle(batch[0].shard, batch[0].epoch)
    assert relay.claim() == []          # reads the rest of the window: nothing
    for _ in range(3):
        with db.transaction():
            assert db.execute("SELECT count(*) FROM outbox.claim('sink', 5)").fetchone()[0] == 0
            assert db.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0] is None
    emit(db, "k")
    assert len(relay.claim()) == 1


def test_polls_while_a_key_waits_out_its_backoff_write_nothing(db, consumer):
    """As above, in a shard with a parked key: the batch fills its limit and one of its keys
    fails for an hour; the claim that finds nothing more records the empty window, and the polls
    after it are idle ones, not a claim of the shard each time."""
    a, b = keys_in_shard(db, 3, 2)
    emit(db, a, 3)
    emit(db, b, 2)
    relay = Relay(db, consumer, batch_size=5)
    batch = relay.claim()
    assert len(batch) == 5
    relay.settle(3, batch[0].epoch, [Relay.failure(batch[0], "down", retry_after="1 hour")])
    assert relay.claim() == []          # reads the rest of the window: nothing
    for _ in range(3):
        with db.transaction():
            assert db.execute("SELECT count(*) FROM outbox.claim('sink', 5)").fetchone()[0] == 0
            assert db.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0] is None
    emit(db, b)
    assert [e.aggregate_id for e in relay.claim()] == [b]


def test_a_parked_key_coming_due_is_claimed_with_no_new_event(db, consumer):
    emit(db, "k")
    relay = Relay(db, consumer)
    batch = relay.claim()
    relay.nack(batch[0], "down")
    relay.ack(batch[0].shard, batch[0].epoch)
    db.execute("UPDATE outbox._parked SET next_attempt_at = now()")
    assert [e.id for e in relay.claim()] == [batch[0].id]


def test_a_claim_after_a_write_is_refused_even_with_nothing_to_read(db, consumer):
    with pytest.raises(psycopg.errors.ActiveSqlTransaction) as err, db.transaction():
        db.execute("SELECT outbox.emit('order', 'x', 'e', '{}')")
        db.execute("SELECT * FROM outbox.claim('sink')")
    assert err.value.diag.message_hint
    with pytest.raises(psycopg.errors.ActiveSqlTransaction), db.transaction():
        db.execute("CREATE TEMP TABLE t (x int)")
        db.execute("INSERT INTO t VALUES (1)")   # any write, nothing pending at all
        db.execute("SELECT * FROM outbox.claim('sink')")


def test_a_page_goes_only_into_the_result_of_a_claim_in_progress(db, consumer):
    """A claim's page is written into the result of the claim in progress (src/claim/result.rs).
    A claim that fails in a transaction that goes on leaves none behind: a page read after it,
    outside any claim, is refused instead of written into the failed claim's freed result."""
    emit(db, "k", 3)
    page = ("SELECT outbox_internal._claim_page(outbox_internal._cursor((outbox_internal._consumer('sink')).id, 0),"
            " 10, 'x', '1 minute', '-infinity', 'infinity')")
    with db.transaction():
        with pytest.raises(psycopg.errors.InvalidParameterValue), db.transaction():
            db.execute("SELECT * FROM outbox.claim('sink', 0)")   # fails inside the claim
        with pytest.raises(psycopg.errors.InternalError_) as err, db.transaction():
            db.execute(page)
        assert "only inside a claim" in str(err.value)
    relay = Relay(db, "sink")
    assert sorted(e.aggregate_id for e in relay.claim()) == ["k", "k", "k"]


def test_a_page_is_refused_in_a_subtransaction_inside_a_claim(db, consumer):
    """A row written into a claim's result stays there whatever happens after, so a page read
    inside an exception block within a claim (here a superuser's trigger on the claim row,
    rolling its block back after the page) is refused: the claim hands out its events once."""
    db.execute("""CREATE FUNCTION public.page_in_a_subtransaction() RETURNS trigger LANGUAGE plpgsql AS $$
                  BEGIN
                      IF pg_catalog.pg_trigger_depth() = 1 AND NEW.owner IS NOT NULL THEN
                          BEGIN
                              PERFORM outbox_internal._claim_page(NEW, 10, 'x', '1 minute', '-infinity', 'infinity');
                              RAISE EXCEPTION 'roll the block back';
                          EXCEPTION WHEN OTHERS THEN NULL;
                          END;
                      END IF;
                      RETURN NEW;
                  END $$""")
    db.execute("CREATE TRIGGER page_in_a_subtransaction AFTER INSERT ON outbox._cursor_log "
               "FOR EACH ROW EXECUTE FUNCTION public.page_in_a_subtransaction()")
    emit(db, "k", 3)
    ids = [e.id for e in Relay(db, "sink").claim()]
    assert len(ids) == 3 and len(set(ids)) == 3


def test_errors_of_a_claims_body_reach_the_caller_as_raised(db, consumer):
    """outbox.claim and settle_and_claim are native around PL/pgSQL bodies: an error of the
    body reaches the caller with its SQLSTATE, message, detail and hint, and no Rust backtrace
    for detail (the servers run with RUST_BACKTRACE set: see conftest.py)."""
    for sql in ("SELECT * FROM outbox.claim('missing')",
                "SELECT * FROM outbox.settle_and_claim('missing', 0, 1)"):
        with pytest.raises(psycopg.errors.UndefinedObject) as err:
            db.execute(sql)
        assert err.value.diag.message_primary == 'consumer "missing" does not exist'
        assert err.value.diag.message_hint
        assert err.value.diag.message_detail is None
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as err:
        db.execute("SELECT * FROM outbox.settle_and_claim('sink', 0, 12345)")
    assert err.value.diag.message_detail.startswith("The shard is at epoch")


@pytest.mark.parametrize("with_a_head", [False, True])
def test_a_claim_ends_while_a_key_parked_for_long_streams_in(db, connect, with_a_head):
    """A key parked for an hour whose producer commits faster than a window is read: each
    window held only its events, which join its queue, and the claim went on to the next
    window for as long as the stream lasted (the shard locked meanwhile). A claim opens two
    windows at most; the next goes on where it stopped. (With another key's head due, the
    head goes out with what the claim read.)"""
    db.execute("SELECT outbox.create_consumer('c')")
    hot, other = keys_in_shard(db, 5, 2)
    relay = Relay(connect(), "c")
    emit(db, hot, 1)
    emit(db, other, 1)
    batch = relay.claim()
    failures = [relay.failure(e, "HTTP 503", retry_after="1 hour") for e in batch if e.aggregate_id == hot]
    if with_a_head:
        failures += [relay.failure(e, "HTTP 503", retry_after="0") for e in batch if e.aggregate_id == other]
    relay.settle(batch[0].shard, batch[0].epoch, failures)
    stop = threading.Event()

    def produce():
        with connect() as c:
            while not stop.is_set():
                c.execute("SELECT outbox.emit_many('order', 'e', array_fill(%s::text, ARRAY[10]), "
                          "array_fill('{}'::jsonb, ARRAY[10]))", (hot,))
    producers = [threading.Thread(target=produce, daemon=True) for _ in range(3)]
    for p in producers:
        p.start()
    try:
        time.sleep(0.5)
        relay.conn.execute("SET statement_timeout = '3s'")
        before = db.execute("SELECT max(pos) FROM outbox._cursor_log").fetchone()[0]
        got = relay.claim()               # before: canceled by the statement_timeout
        windows = db.execute("SELECT count(DISTINCT lo_seq) FROM outbox._cursor_log WHERE pos > %s",
                             (before,)).fetchone()[0]
        assert windows <= 2, "the window it began in, and one more at most"
        assert [e.aggregate_id for e in got] == ([other] if with_a_head else [])
    finally:
        stop.set()
        for p in producers:
            p.join()
