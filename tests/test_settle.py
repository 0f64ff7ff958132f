"""outbox.settle: one call settles a claimed batch. The hold-back rule lives in it: a failed
key's later events in the batch wait behind it, in order, whatever the relay said of them;
if recording one failure fails, the rest of the batch still settles and the reason shows in
outbox.status."""

from __future__ import annotations

import datetime
import os
import random
import time

import psycopg
import pytest

from support.db import keys_in_shard
from support.relay import Relay

# the random runs of the model test: more with OUTBOX_MODEL_SEEDS (e.g. 500 after a change to
# claim, settle or parking)
MODEL_SEEDS = int(os.environ.get("OUTBOX_MODEL_SEEDS", "8"))


@pytest.fixture
def relay(db):
    db.execute("SELECT outbox.create_consumer('sink', max_attempts => 3, backoff_base => '1 ms', "
               "backoff_max => '1 ms')")
    return Relay(db, "sink")


def emit_batch(db, relay, counts: dict[str, int]):
    """Emit counts[key] events per key (in one shard, interleaved) and claim them all; returns
    the batch and its events by key."""
    for i in range(max(counts.values())):
        for key, n in counts.items():
            if i < n:
                db.execute("SELECT outbox.emit('order', %s, 'e', jsonb_build_object('i', %s::int))", (key, i))
    batch = relay.claim()
    assert len(batch) == sum(counts.values())
    return batch, {k: [e for e in batch if e.aggregate_id == k] for k in counts}


def parked(db) -> dict[str, list[int]]:
    rows = db.execute("SELECT aggregate_id, array_agg((payload->>'i')::int ORDER BY pos) "
                      "FROM outbox._parked_events GROUP BY 1").fetchall()
    return dict(rows)


def dead(db) -> list[tuple]:
    return db.execute("SELECT aggregate_id, (payload->>'i')::int, last_error FROM outbox.dead_letters ORDER BY id").fetchall()


def drain_after_backoff(db, relay) -> list:
    delivered = []
    for _ in range(10):
        db.execute("SELECT pg_sleep(0.01)")
        delivered += relay.drain()
    return delivered


def test_a_failed_keys_later_events_wait_behind_it_whatever_was_listed(db, relay):
    a, b, c = keys_in_shard(db, 2, 3)
    batch, by_key = emit_batch(db, relay, {a: 3, b: 2, c: 2})
    # a: its second event failed (the third "delivered" after it: it must wait all the same);
    # b: its first failed for good; c: all delivered
    kept = relay.settle(batch[0].shard, batch[0].epoch, [
        relay.failure(by_key[a][1], "HTTP 503", retry_after="300 ms"),
        relay.failure(by_key[b][0], "HTTP 422", final=True),
    ])
    assert kept == 2 + 2
    assert parked(db) == {a: [1, 2], b: [1]}
    assert dead(db) == [(b, 0, "HTTP 422")]
    # the shard moved on: b's next event is due at once (its head went dead), a's after 300 ms
    again = relay.claim()
    assert [(e.aggregate_id, e.payload["i"]) for e in again] == [(b, 1)]
    relay.settle(again[0].shard, again[0].epoch)
    time.sleep(0.3)
    retried = drain_after_backoff(db, relay)
    assert [(e.aggregate_id, e.payload["i"]) for e in retried] == [(a, 1), (a, 2)]
    assert not [e for e in retried if e.aggregate_id == c], "c was delivered the first time"
    assert parked(db) == {}


def test_a_later_failure_listed_first_still_holds_back_from_the_earliest(db, relay):
    a, = keys_in_shard(db, 4, 1)
    batch, by_key = emit_batch(db, relay, {a: 3})
    kept = relay.settle(batch[0].shard, batch[0].epoch, [
        relay.failure(by_key[a][2], "third"), relay.failure(by_key[a][0], "first")])
    assert kept == 3
    assert parked(db) == {a: [0, 1, 2]}
    assert db.execute("SELECT last_error, attempts FROM outbox._parked").fetchone() == ("first", 1)


def test_parked_heads_are_settled_too_retried_dead_lettered_and_replayed(db, relay):
    a, b = keys_in_shard(db, 6, 2)
    batch, by_key = emit_batch(db, relay, {a: 2, b: 2})
    relay.settle(batch[0].shard, batch[0].epoch,
                 [relay.failure(by_key[a][0], "down"), relay.failure(by_key[b][0], "down")])
    attempts = []
    for _ in range(2):   # max_attempts 3: two more failures of a's head; b's head goes through
        time.sleep(0.01)
        heads = relay.claim()
        assert {e.aggregate_id for e in heads} == {a, b} or {e.aggregate_id for e in heads} == {a}
        head_a = next(e for e in heads if e.aggregate_id == a)
        attempts.append(head_a.attempt)
        relay.settle(heads[0].shard, heads[0].epoch, [relay.failure(head_a, "still down")])
    assert attempts == [2, 3]
    assert dead(db) == [(a, 0, "still down")]
    assert relay.drain() and parked(db) == {}
    assert db.execute("SELECT outbox.replay('sink')").fetchone()[0] == 1
    assert [(e.aggregate_id, e.payload["i"]) for e in drain_after_backoff(db, relay)] == [(a, 0)]


def test_a_stale_or_settled_batch_is_refused(db, connect, relay):
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    slow = Relay(connect(), "sink", lease="100 milliseconds", owner="slow")
    batch = slow.claim()
    time.sleep(0.2)
    fast = Relay(connect(), "sink", owner="fast")
    again = fast.claim()
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as e:
        slow.settle(batch[0].shard, batch[0].epoch, [slow.failure(batch[0], "late")])
    assert e.value.diag.message_hint
    assert fast.settle(again[0].shard, again[0].epoch) == 0
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
        fast.settle(again[0].shard, again[0].epoch)   # twice
    assert db.execute("SELECT count(*) FROM outbox._parked").fetchone()[0] == 0


def test_a_lease_runs_from_the_claim_not_from_its_transactions_start(db, connect):
    """A relay that polls in one transaction (a driver out of autocommit) and finds work a
    while after it began holds the batch for its lease from then: it had run out already, and
    another relay took the same batch while the first was sending it."""
    db.execute("SELECT outbox.create_consumer('c')")
    slow = connect(autocommit=False)
    slow.execute("SELECT 1")   # its transaction begins
    time.sleep(1.5)
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    assert Relay(slow, "c", lease="1 second").claim()
    slow.commit()
    assert Relay(connect(), "c").claim() == [], "the lease is live"


def test_a_dead_letter_replayed_while_its_batch_is_out_then_given_back_leaves_no_empty_queue(db, connect):
    """A page's event rejected (a dead letter), replayed while its batch is out (queued again,
    its key parked), then the batch given back: the page is read again, so the queued copy goes;
    its key, left parked with nothing queued, took a due key's place in claims, which then
    handed out nothing and moved the shard past the rest of its window."""
    db.execute("SELECT outbox.create_consumer('c')")
    keys = keys_in_shard(db, 3, 4)
    db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (keys[0],))
    relay = Relay(connect(), "c", batch_size=10)
    batch = relay.claim()
    db.execute("SELECT outbox.reject('c', %s, %s, %s, 'bad')", (batch[0].shard, batch[0].epoch, batch[0].id))
    db.execute("SELECT outbox.replay('c')")
    db.execute("SELECT outbox.release('c', %s, %s)", (batch[0].shard, batch[0].epoch))
    assert db.execute("""SELECT count(*) FROM outbox._parked p WHERE NOT EXISTS (
                             SELECT FROM outbox._parked_events q
                              WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id)""").fetchone()[0] == 0
    for k in keys[1:4]:
        db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (k,))
    got = Relay(connect(), "c", batch_size=1).drain()
    assert sorted(e.aggregate_id for e in got) == sorted(keys[:4])


def test_a_batch_of_a_dropped_consumer_settles_nothing_of_its_namesakes(db, connect):
    """A consumer dropped and made again under its name is another consumer. A relay of the old
    one, back late, must not settle a batch of the new one that holds the same shard: its
    epochs are its own (they began at 0 for every consumer, so its first batch of a shard had
    the old one's first epoch), else the new batch was taken for delivered while its relay
    was still sending it."""
    db.execute("SELECT outbox.create_consumer('c')")
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    old = Relay(connect(), "c", owner="old").claim()
    db.execute("SELECT outbox.drop_consumer('c')")
    db.execute("SELECT outbox.create_consumer('c')")
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    new_relay = Relay(connect(), "c", owner="new")
    new = new_relay.claim()
    assert new[0].shard == old[0].shard
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
        Relay(connect(), "c", owner="old").settle(old[0].shard, old[0].epoch)
    assert new_relay.settle(new[0].shard, new[0].epoch) == 0


@pytest.mark.parametrize("failures", [
    '{"id": "x"}',                                             # not an array
    '[{"error": "no id"}]',
    '[{"id": "not-a-uuid"}]',
    '[{"id": "00000000-0000-0000-0000-000000000000", "colour": "red"}]',
    '[{"id": "00000000-0000-0000-0000-000000000000", "retry_after": "soon"}]',
    '[{"id": "00000000-0000-0000-0000-000000000000", "retry_after": -1}]',
    '[{"id": "00000000-0000-0000-0000-000000000000", "final": "perhaps"}]',
    '[{"id": "00000000-0000-0000-0000-000000000000"}]',        # not in the batch
])
def test_bad_failures_are_refused_with_22023_and_settle_nothing(db, relay, failures):
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    batch = relay.claim()
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        db.execute("SELECT outbox.settle('sink', %s, %s, %s::jsonb)", (batch[0].shard, batch[0].epoch, failures))
    assert e.value.diag.message_hint
    assert relay.settle(batch[0].shard, batch[0].epoch) == 0, "the batch is still held"


@pytest.mark.parametrize("bad, says", [
    ('{"id": "not-a-uuid"}', "invalid input syntax for type uuid"),
    ('{"id": "00000000-0000-0000-0000-000000000000", "colour": "red"}', "not an object with an id"),
    ('7', "not an object with an id"),
    ('{"id": "00000000-0000-0000-0000-000000000000", "retry_after": "31 days"}', "retry_after 31 days is out of range"),
    ('{"id": "00000000-0000-0000-0000-000000000000", "final": true, "attempted": false}', "cannot be final"),
])
def test_a_bad_failure_among_good_ones_is_named_with_its_place_and_why(db, relay, bad, says):
    """The failures are read together; one that is invalid is still named by its place in the
    array, with what is wrong with it, whatever came before it."""
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    batch = relay.claim()
    good = f'{{"id": "{batch[0].id}", "error": "HTTP 500"}}'
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        db.execute("SELECT outbox.settle('sink', %s, %s, %s::jsonb)",
                   (batch[0].shard, batch[0].epoch, f"[{good}, {good}, {bad}]"))
    assert e.value.diag.message_primary.startswith("failure 3 of failures is invalid: ")
    assert says in e.value.diag.message_primary
    assert e.value.diag.message_detail.startswith("It is ")
    assert relay.settle(batch[0].shard, batch[0].epoch) == 0, "the batch is still held"


def test_if_recording_a_failure_fails_the_rest_settles_and_status_says_why(cluster, db, relay):
    a, b, c = keys_in_shard(db, 1, 3)
    batch, by_key = emit_batch(db, relay, {a: 2, b: 2, c: 1})
    # a fault no real relay can cause: recording this error fails (a superuser's trigger)
    with cluster.connect(db.info.dbname) as su:
        su.execute("""
            CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.last_error LIKE 'poison%' THEN RAISE EXCEPTION 'cannot store this error'; END IF;
                RETURN NEW;
            END $$""")
        su.execute("CREATE TRIGGER refuse BEFORE UPDATE ON outbox._parked FOR EACH ROW EXECUTE FUNCTION public.refuse()")
    kept = relay.settle(batch[0].shard, batch[0].epoch, [
        relay.failure(by_key[a][0], "poison: a 2 GB error page"), relay.failure(by_key[b][0], "HTTP 500")])
    assert kept == 4
    assert parked(db) == {a: [0, 1], b: [0, 1]}, "both keys kept back, in order"
    errors = dict(db.execute("SELECT aggregate_id, last_error FROM outbox._parked").fetchall())
    assert errors[b] == "HTTP 500"
    assert "cannot store this error" in errors[a] and "poison" in errors[a]
    status = db.execute("SELECT parked_keys, parked_events, last_error FROM outbox.status").fetchone()
    assert status[:2] == (2, 4) and status[2] in errors.values()
    assert db.execute("SELECT pending FROM outbox.status").fetchone()[0] == 0, "the shard moved on"
    assert {e.aggregate_id for e in relay.claim()} <= {a, b}, "c was delivered; only the parked heads come back"


@pytest.mark.parametrize("one_call", [False, True], ids=["settle", "settle_and_claim"])
def test_parallel_relays_settling_with_kills_keep_per_key_order(cluster, dbname, db, relay, one_call):
    """Three relays on their own connections settle batches with random failures (some final)
    and are killed with pg_terminate_backend between claim and settle, while writers commit
    (some late, from transactions left open across several claims); a key's first deliveries
    follow its commit order and nothing is lost. Writers serialize per key, as applications do."""
    import random
    import threading
    keys = [f"agg-{i}" for i in range(10)]
    for i in range(200):
        db.execute("SELECT outbox.emit('order', %s, 'e', jsonb_build_object('i', %s::int))", (keys[i % 10], i))
    delivered, dead_ids, lock = [], set(), threading.Lock()
    writers = [2]                     # still writing
    writing = threading.Event()
    writing.set()

    def write(w: int) -> None:
        rnd = random.Random(50 + w)
        with cluster.connect(dbname, autocommit=False) as conn:
            for i in range(200 + w, 400, 2):
                key = keys[i % 10]
                conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (key,))
                conn.execute("SELECT outbox.emit('order', %s, 'e', jsonb_build_object('i', %s::int))", (key, i))
                if rnd.random() < 0.1:
                    time.sleep(0.05)   # open across claims: commits late
                conn.commit()
        with lock:
            writers[0] -= 1
            if not writers[0]:
                writing.clear()

    def run(n: int) -> None:
        rnd = random.Random(n)
        conn = cluster.connect(dbname)
        r = Relay(conn, "sink", batch_size=rnd.choice([5, 20]), lease="300 milliseconds", owner=f"r{n}")
        idle, batch = 0, []
        while idle < 40:
            try:
                batch = batch or r.claim()
                if not batch:
                    idle = 0 if writing.is_set() else idle + 1
                    time.sleep(0.01)
                    continue
                idle = 0
                if rnd.random() < 0.1:
                    with cluster.connect(dbname) as killer:
                        killer.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
                    raise psycopg.OperationalError("killed before settling")
                failures, failed, sent = [], set(), []
                for e in batch:
                    if e.aggregate_id in failed:
                        continue
                    if rnd.random() < 0.05:
                        failed.add(e.aggregate_id)
                        failures.append(r.failure(e, "random", retry_after="5 ms", final=rnd.random() < 0.3))
                    else:
                        sent.append(e)
                with lock:   # delivered before settling, as a sink would see them
                    delivered.extend((e.aggregate_id, e.payload["i"], e.id) for e in sent)
                if one_call:
                    batch = r.settle_and_claim(batch[0].shard, batch[0].epoch, failures)
                else:
                    r.settle(batch[0].shard, batch[0].epoch, failures)
                    batch = []
            except psycopg.Error:
                batch = []
                conn.close()
                conn = r.conn = cluster.connect(dbname)
        conn.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(3)]
    threads += [threading.Thread(target=write, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.4)
    delivered += [(e.aggregate_id, e.payload["i"], e.id) for e in drain_after_backoff(db, relay)]
    dead_ids = {r[0] for r in db.execute("SELECT event_id FROM outbox.dead_letters").fetchall()}
    got = {d[2] for d in delivered}
    assert len(got | dead_ids) == 400, "each event delivered or dead, never lost"
    first = {}
    for key, i, eid in delivered:
        first.setdefault(eid, (key, i))
    for key in keys:
        seen = [i for k, i in first.values() if k == key]
        # settled deliveries of a key are in order except for events that died in between
        assert seen == sorted(seen), key
    assert db.execute("SELECT count(*) FROM outbox._parked").fetchone()[0] == 0


def test_settle_and_claim_reads_on_in_one_call_and_misses_no_late_commit(db, connect, relay):
    late = connect(autocommit=False)
    late.execute("SELECT outbox.emit('order', 'late', 'e', jsonb_build_object('i', -1))")  # open: commits later
    for i in range(30):
        db.execute("SELECT outbox.emit('order', %s, 'e', jsonb_build_object('i', %s::int))", (f"k{i % 3}", i))
    relay.batch_size = 4
    seen, batch = [], relay.claim()
    while batch:
        seen += batch
        if len(seen) > 12 and late.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            late.commit()   # commits while the relay is in the middle of its windows
        batch = relay.settle_and_claim(batch[0].shard, batch[0].epoch)
        if not batch:
            batch = relay.claim()   # the shards whose windows ended: a new window each
    assert sorted(e.payload["i"] for e in seen) == list(range(-1, 30)), "each event once, the late one too"
    for key in ("k0", "k1", "k2"):
        mine = [e.payload["i"] for e in seen if e.aggregate_id == key]
        assert mine == sorted(mine)


def test_settle_and_claim_refuses_a_stale_batch_and_a_transaction_that_wrote(db, connect, relay):
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    batch = relay.claim()
    relay.settle(batch[0].shard, batch[0].epoch)
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
        relay.settle_and_claim(batch[0].shard, batch[0].epoch)
    assert db.execute("SELECT count(*) FROM outbox.shard_status WHERE leased_by IS NOT NULL").fetchone()[0] == 0
    conn = connect(autocommit=False)
    conn.execute("SELECT outbox.emit('order', 'other', 'e', '{}')")
    with pytest.raises(psycopg.errors.ActiveSqlTransaction):
        conn.execute("SELECT * FROM outbox.settle_and_claim('sink', 0, 1)")


def test_a_failure_reported_before_one_already_recorded_is_refused_not_lost(db, relay):
    a, = keys_in_shard(db, 5, 1)
    batch, by_key = emit_batch(db, relay, {a: 3})
    relay.nack(by_key[a][2], "third failed")           # reported first, as parallel sends come back
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[a][0], "first failed")])
    assert e.value.diag.message_hint
    # refused whole: the batch is still held, and reported in order it settles
    relay.nack(by_key[a][2], "again: nothing changes")
    assert parked(db) == {a: [2]}


def test_a_rejected_event_listed_again_stays_dead(db, relay):
    a, b = keys_in_shard(db, 7, 2)
    batch, by_key = emit_batch(db, relay, {a: 1, b: 1})
    db.execute("SELECT outbox.reject('sink', %s, %s, %s, 'HTTP 422')", (batch[0].shard, batch[0].epoch, by_key[a][0].id))
    assert parked(db) == {}, "its only event is dead: the key moved on"
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[a][0], "HTTP 422", final=True)])
    assert dead(db) == [(a, 0, "HTTP 422")] and parked(db) == {}
    assert relay.drain() == [], "not delivered again"


@pytest.mark.parametrize("how", ["reject", "settle"])
def test_a_reject_of_an_event_nacked_in_its_batch_is_refused_not_ignored(db, relay, how):
    """nack queues the event for a retry; a reject of it in the same batch (or a settle that
    lists it final) changed nothing, silently, though the relay took the event for
    dead-lettered."""
    a, = keys_in_shard(db, 7, 1)
    batch, by_key = emit_batch(db, relay, {a: 2})
    relay.nack(by_key[a][0], "HTTP 503")
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        if how == "reject":
            db.execute("SELECT outbox.reject('sink', %s, %s, %s, 'HTTP 422')", (batch[0].shard, batch[0].epoch, by_key[a][0].id))
        else:
            relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[a][0], "HTTP 422", final=True)])
    assert e.value.diag.message_hint
    # a later event of the key is held back behind the nacked one, never sent: as before
    db.execute("SELECT outbox.reject('sink', %s, %s, %s, 'HTTP 422')", (batch[0].shard, batch[0].epoch, by_key[a][1].id))
    relay.ack(batch[0].shard, batch[0].epoch)
    assert dead(db) == [] and parked(db) == {a: [0, 1]}


@pytest.mark.parametrize("events", [1, 2])
def test_a_rejected_event_replayed_then_listed_final_again_is_not_refused(db, relay, events):
    """A reject dead-letters the event, a replay queues it again while the batch is out (behind
    the key's later event, queued by the reject), and the relay's settle lists it final, as it
    said before: nothing to refuse (the replay stands). (With a later event, the replayed copy
    was taken for one a nack had queued: refused with 22023.)"""
    a, = keys_in_shard(db, 7, 1)
    batch, by_key = emit_batch(db, relay, {a: events})
    db.execute("SELECT outbox.reject('sink', %s, %s, %s, 'HTTP 422')", (batch[0].shard, batch[0].epoch, by_key[a][0].id))
    db.execute("SELECT outbox.replay('sink')")
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[a][0], "HTTP 422", final=True)])
    assert dead(db) == [] and parked(db) == {a: list(range(1, events)) + [0]}


def test_an_event_listed_as_retried_and_as_final_in_one_settle_is_dead_lettered(db, relay):
    a, = keys_in_shard(db, 7, 1)
    batch, by_key = emit_batch(db, relay, {a: 1})
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[a][0], "HTTP 503"),
                                                  relay.failure(by_key[a][0], "HTTP 422", final=True)])
    assert dead(db) == [(a, 0, "HTTP 422")] and parked(db) == {}


def test_a_batch_given_back_after_a_nack_and_a_replay_of_its_key_counts_no_attempt(db, connect):
    """A key's dead letter replayed while a batch holding a nacked event of the key is out, then
    the batch given back: the key stays parked for the replayed event, but "as if never
    claimed": not on the nack's attempt and backoff (an hour here), which held the replay back."""
    db.execute("SELECT outbox.create_consumer('c', backoff_base => '1 hour', backoff_max => '1 hour')")
    relay = Relay(connect(), "c")
    a, = keys_in_shard(db, 7, 1)
    db.execute("SELECT outbox.emit('order', %s, 'e', '{\"i\": 0}')", (a,))
    first = relay.claim()
    relay.settle(first[0].shard, first[0].epoch, [relay.failure(first[0], "HTTP 422", final=True)])
    for i in (1, 2):
        db.execute("SELECT outbox.emit('order', %s, 'e', jsonb_build_object('i', %s::int))", (a, i))
    batch = relay.claim()
    relay.nack(batch[0], "HTTP 503")
    db.execute("SELECT outbox.replay('c')")
    relay.release(batch[0].shard, batch[0].epoch)
    assert db.execute("SELECT attempts, next_attempt_at <= now() FROM outbox._parked").fetchall() == [(0, True)]
    assert [e.payload["i"] for e in relay.drain()] == [0, 1, 2]


@pytest.mark.parametrize("how", ["reject", "nack at max_attempts"])
def test_a_dead_head_replayed_before_its_batch_is_acked_is_not_acked_with_it(db, relay, how):
    """A parked key's only queued event, handed out as its head, dies by reject (or a nack of
    its last attempt), which empties the queue and unparks the key; outbox.replay runs before
    the relay acks the batch. The ack delivers the batch's heads by id: it must not take the
    event queued again by the replay for delivered (it was refused, and the log is past it)."""
    a, = keys_in_shard(db, 3, 1)
    batch, by_key = emit_batch(db, relay, {a: 1})
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[a][0], "HTTP 503", retry_after="0")])
    heads = relay.claim()
    assert [(e.payload["i"], e.attempt) for e in heads] == [(0, 2)]
    if how == "reject":
        db.execute("SELECT outbox.reject('sink', %s, %s, %s, 'HTTP 422')", (heads[0].shard, heads[0].epoch, heads[0].id))
    else:
        db.execute("UPDATE outbox.consumers SET max_attempts = 2 WHERE name = 'sink'")
        relay.nack(heads[0], "HTTP 422")
    assert dead(db) == [(a, 0, "HTTP 422")] and parked(db) == {}
    replayed = db.execute("SELECT outbox.replay('sink')").fetchone()[0]
    relay.ack(heads[0].shard, heads[0].epoch)
    again = db.execute("SELECT outbox.replay('sink')").fetchone()[0]
    assert replayed + again == 1, "replayed once: while its batch was out, or after"
    assert [(e.aggregate_id, e.payload["i"]) for e in drain_after_backoff(db, relay)] == [(a, 0)]
    assert dead(db) == [] and parked(db) == {}


def test_a_retry_policy_of_hours_doubling_thirty_times_still_records_failures(db):
    """backoff_base doubles per attempt up to backoff_max: computed as an interval first, a
    base of hours times 2^30 overflowed it (22008), so a settle of the failure raised on every
    try; the key was never counted on, nor dead-lettered, and its shard's batch came again."""
    db.execute("SELECT outbox.create_consumer('slow', max_attempts => 40, backoff_base => '6 hours', "
               "backoff_max => '1 day')")
    relay = Relay(db, "slow")
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    batch = relay.claim()
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(batch[0], "HTTP 500")])
    db.execute("UPDATE outbox._parked SET attempts = 39, next_attempt_at = now()")
    heads = relay.claim()
    assert heads[0].attempt == 40
    relay.settle(heads[0].shard, heads[0].epoch, [relay.failure(heads[0], "HTTP 500")])
    assert db.execute("SELECT count(*) FROM outbox.dead_letters").fetchone()[0] == 1
    waits = db.execute("SELECT outbox_internal._backoff(c, a) FROM outbox.consumers c, "
                       "generate_series(1, 40) a WHERE c.name = 'slow'").fetchall()
    assert all(datetime.timedelta(hours=3) <= w <= datetime.timedelta(days=1) for (w,) in waits)


def test_a_batch_given_back_after_a_nack_brings_the_keys_events_back_in_order(db, relay):
    """nack parks the key from the failed event on; the relay then gives the batch back instead
    of settling it (release): the key's earlier events of the batch must not come after it."""
    a, = keys_in_shard(db, 5, 1)
    batch, by_key = emit_batch(db, relay, {a: 3})
    relay.nack(by_key[a][1], "second failed")
    assert parked(db) == {a: [1, 2]}
    relay.release(batch[0].shard, batch[0].epoch)
    assert parked(db) == {}, "given back: as if never claimed"
    assert [e.id for e in relay.drain()] == [e.id for e in by_key[a]], "in emit order"


def emit_many(db, key: str, first: int, n: int) -> None:
    """n events of key in one transaction, payload i = first .. first + n - 1."""
    db.execute("SELECT outbox.emit_many('order', 'e', array_fill(%s::text, ARRAY[%s]), "
               "ARRAY(SELECT jsonb_build_object('i', i) FROM generate_series(%s::int, %s::int) i))",
               (key, n, first, first + n - 1))


def drain_counting_claims(relay, fail_first_of: str | None = None) -> tuple[int, list]:
    """Claims and settles until nothing is left; the first event of fail_first_of that comes out
    fails once, due again at once. Returns the claims that found something, and the events."""
    claims, out, failed = 0, [], fail_first_of is None
    while batch := relay.claim():
        claims += 1
        failures = []
        if not failed and (first := next((e for e in batch if e.aggregate_id == fail_first_of), None)):
            failures, failed = [relay.failure(first, "HTTP 503", retry_after="0")], True
        relay.settle(batch[0].shard, batch[0].epoch, failures)
        out += [e for e in batch if not (failures and e.aggregate_id == fail_first_of)]  # held back
    return claims, out


@pytest.mark.parametrize("failing", [False, True], ids=["clean", "hot key fails once"])
def test_a_hot_key_failing_once_drains_in_about_the_claims_of_a_clean_drain(db, relay, failing):
    """The issue's case: 2,000 events of one hot key and 2,000 of 200 others, batch 500. A
    parked key that gave out one event per claim took about 2,000 claims; catching up a batch at
    a time it takes a few more than a clean drain (about ten)."""
    relay.batch_size = 500
    emit_many(db, "hot", 0, 2000)
    db.execute("SELECT outbox.emit('order', 'k' || i % 200, 'e', jsonb_build_object('i', i / 200)) "
               "FROM generate_series(0, 1999) i")
    claims, out = drain_counting_claims(relay, "hot" if failing else None)
    hot = [e.payload["i"] for e in out if e.aggregate_id == "hot"]
    assert hot == list(range(2000)), "every event of the hot key, once, in order"
    assert len(out) == 4000 and parked(db) == {}
    clean_claims = 4000 // 500 + outbox_shards(db)   # a claim per full page, one more per shard at most
    assert claims <= 1.5 * clean_claims, f"{claims} claims"


def outbox_shards(db) -> int:
    return db.execute("SELECT outbox.shard_count()").fetchone()[0]


def test_a_hot_key_catches_up_and_unparks_while_its_producer_keeps_emitting(db, relay):
    """After one transient failure the key's producer goes on emitting several events per claim:
    the key drains its queue a batch at a time, catches up with its shard and leaves the parked
    state, its events in order."""
    hot, other = keys_in_shard(db, 3, 2)
    relay.batch_size = 50
    emit_many(db, hot, 0, 10)
    batch = relay.claim()
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(batch[0], "HTTP 503", retry_after="0")])
    assert parked(db) == {hot: list(range(10))}
    delivered, unparked_at, n = [], None, 10
    for step in range(30):
        emit_many(db, hot, n, 5)            # five per claim: more than one event per claim
        db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (other,))
        n += 5
        batch = relay.claim()
        relay.settle(batch[0].shard, batch[0].epoch)
        delivered += [e.payload["i"] for e in batch if e.aggregate_id == hot]
        if unparked_at is None and not parked(db):
            unparked_at = step
    assert unparked_at is not None and unparked_at <= 2, f"still parked after {unparked_at} claims"
    assert delivered == list(range(n)), "in order, none missing"


def test_a_hot_key_failing_once_leaves_its_backlog_in_the_log(db, relay):
    """A hot key with a backlog fails once: its queue takes the failed batch's events and at
    most a page more, not the backlog (the backlog waits in the log until the queue is empty
    and the key flows with its shard again), and the backlog drains in full batches, in order,
    with about as many claims as without the failure."""
    hot, other = keys_in_shard(db, 3, 2)
    relay.batch_size = 20
    emit_many(db, hot, 0, 200)
    db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (other,))
    batch = relay.claim()
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(batch[0], "HTTP 503", retry_after="0")])
    delivered, others, claims = [], 0, 0
    while batch := relay.claim():
        claims += 1
        relay.settle(batch[0].shard, batch[0].epoch)
        delivered += [e.payload["i"] for e in batch if e.aggregate_id == hot]
        others += sum(e.aggregate_id == other for e in batch)
    assert delivered == list(range(200)) and others == 1, "in order, none missing"
    db.execute("SELECT pg_stat_force_next_flush()")
    queued = db.execute("SELECT pg_stat_clear_snapshot(), n_tup_ins FROM pg_stat_user_tables "
                        "WHERE relid = 'outbox._parked_events'::regclass").fetchone()[1]
    assert queued <= 2 * relay.batch_size, f"{queued} events of the hot key copied into its queue"
    assert claims <= 200 // relay.batch_size + 3, f"{claims} claims"


def test_a_key_the_sink_keeps_refusing_unjudged_blocks_only_itself(db, relay):
    """A parked key whose heads the sink keeps refusing without judging them ("attempted":
    false, due again at once: no attempt counted, never dead-lettered) is not catching up:
    a page of its events is moved past, and the next key's event goes out."""
    stuck, other = keys_in_shard(db, 3, 2)
    relay.batch_size = 5

    def refused(event):
        return {"id": str(event.id), "error": "HTTP 429", "retry_after": 0, "attempted": False}

    emit_many(db, stuck, 0, 5)
    batch = relay.claim()
    relay.settle(batch[0].shard, batch[0].epoch, [refused(batch[0])])
    emit_many(db, stuck, 5, 5)
    db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (other,))
    for _ in range(4):
        batch = relay.claim()
        if any(e.aggregate_id == other for e in batch):
            break
        relay.settle(batch[0].shard, batch[0].epoch, [refused(e) for e in batch[:1]])
    else:
        raise AssertionError(f"{other} waited behind {stuck} for four claims")


def test_a_key_catching_up_a_long_queue_does_not_hold_the_keys_behind_it(db, relay):
    """A key whose head goes through after its queue grew to ten batches: a page of its new
    events is moved past (copied into its queue) rather than held until the queue is out, so
    the next key's event goes out within two claims."""
    key, other = keys_in_shard(db, 3, 2)
    relay.batch_size = 10
    emit_many(db, key, 0, 100)
    for _ in range(2):   # fails, and its retry fails
        batch = relay.claim()
        relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(batch[0], "HTTP 503", retry_after="0")])
    batch = relay.claim()   # the rest of its events queue; its head goes through: it catches up
    relay.settle(batch[0].shard, batch[0].epoch)
    assert len(parked(db)[key]) == 99
    emit_many(db, key, 100, 10)
    db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (other,))
    for claims in range(1, 4):
        batch = relay.claim()
        relay.settle(batch[0].shard, batch[0].epoch)
        if any(e.aggregate_id == other for e in batch):
            break
    assert claims <= 2, f"{other} waited {claims} claims behind {key}'s queue"


def test_a_nack_then_a_lease_running_out_keeps_the_keys_order(db, connect, relay):
    """A relay nacks the second event of a key and dies; once its lease runs out, the next
    claim reads the page again with the key's events in order, as after outbox.release (the
    nacked key's queue was [e1, e2], and e0 came after them)."""
    key = keys_in_shard(db, 3, 1)[0]
    emit_many(db, key, 0, 3)
    dying = Relay(connect(), "sink", lease="1 second")
    batch = dying.claim()
    dying.nack(batch[1], "HTTP 503", retry_after="0")
    time.sleep(1.2)
    first = {}
    for event in relay.drain():
        first.setdefault(event.payload["i"], len(first))
    assert sorted(first, key=first.get) == [0, 1, 2]


def test_a_batch_given_back_and_claimed_again_in_a_smaller_page_sends_each_event_once(db, relay):
    """A parked key's events of a page are copied to its queue when the page is claimed; the
    batch is given back and the next claim reads a smaller page (the worker probes a suspended
    sink with 10 events). Kept, the copies beyond the new page went out from the queue, and
    again when the cursor read them in the log."""
    a, b = keys_in_shard(db, 6, 2)
    emit_many(db, a, 0, 1)
    first = relay.claim()
    relay.settle(first[0].shard, first[0].epoch, [relay.failure(first[0], "HTTP 503", retry_after="0")])
    for i in range(1, 5):
        emit_many(db, a, i, 1)
        emit_many(db, b, i, 1)
    given_back = relay.claim()
    assert parked(db) == {a: [0, 1, 2, 3, 4]}
    relay.release(given_back[0].shard, given_back[0].epoch)
    assert parked(db) == {a: [0]}, "the page's copies go back with the batch"
    relay.batch_size = 2
    out = relay.drain()
    assert sorted((e.aggregate_id, e.payload["i"]) for e in out) == sorted(
        [(a, i) for i in range(5)] + [(b, i) for i in range(1, 5)]), "each event once"
    assert [e.payload["i"] for e in out if e.aggregate_id == a] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("head_rejected", [False, True], ids=["given back", "head rejected, then given back"])
def test_a_batch_given_back_leaves_the_queued_events_of_an_earlier_window(db, connect, relay, head_rejected):
    """A late commit opens a window whose page spans the seqs of events a parked key queued
    from the window before; that batch is given back: only the page's own copies leave the
    queues (by seq range, the key's queued event went too, and was never delivered). Its head
    rejected first, the key's queue holds only that event: it is not a copy of the page, so
    the key stays parked with it (by seq range, the key was unparked and the event dropped)."""
    a, late, c = keys_in_shard(db, 7, 3)
    writer = connect(autocommit=False)
    emit_many(writer, late, 100, 1)            # the lowest seq, committed last
    emit_many(db, a, 0, 2)
    batch = relay.claim()
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(batch[0], "HTTP 503", retry_after="0")])
    assert parked(db) == {a: [0, 1]}
    writer.commit()
    emit_many(db, c, 200, 1)
    given_back = relay.claim()
    assert sorted(e.payload["i"] for e in given_back) == [0, 100, 200], "a's head and the new window"
    if head_rejected:
        head = next(e for e in given_back if e.aggregate_id == a)
        db.execute("SELECT outbox.reject('sink', %s, %s, %s, 'HTTP 422')", (head.shard, head.epoch, head.id))
    relay.release(given_back[0].shard, given_back[0].epoch)
    assert parked(db) == ({a: [1]} if head_rejected else {a: [0, 1]})
    out = relay.drain()
    assert sorted(e.payload["i"] for e in out) == ([1, 100, 200] if head_rejected else [0, 1, 100, 200])
    assert [e.payload["i"] for e in out if e.aggregate_id == a] == ([1] if head_rejected else [0, 1])


@pytest.mark.parametrize("give_back", ["release", "release_owner", "lease"])
@pytest.mark.parametrize("how", ["reject", "nack at max_attempts"])
def test_a_window_event_dead_lettered_then_given_back_comes_again_and_is_not_dead(db, relay, how, give_back):
    """reject (or a nack of the last attempt) dead-letters an event of the window at once; the
    relay then gives the batch back (release, release_owner, or its lease runs out): the page
    is read again and the event comes again with it, so its dead letter goes with the batch.
    Kept, the event was delivered and dead at once, and a replay sent it once more, after its
    key's later events."""
    a, b = keys_in_shard(db, 5, 2)
    if how == "nack at max_attempts":
        db.execute("UPDATE outbox.consumers SET max_attempts = 1 WHERE name = 'sink'")
    relay.owner, relay.lease = "r1", "200 ms" if give_back == "lease" else "30 seconds"
    batch, by_key = emit_batch(db, relay, {a: 2, b: 1})
    if how == "reject":
        db.execute("SELECT outbox.reject('sink', %s, %s, %s, 'HTTP 422')", (batch[0].shard, batch[0].epoch, by_key[a][0].id))
    else:
        relay.nack(by_key[a][0], "HTTP 422")
    assert dead(db) == [(a, 0, "HTTP 422")]
    if give_back == "release":
        relay.release(batch[0].shard, batch[0].epoch)
    elif give_back == "release_owner":
        db.execute("SELECT outbox.release_owner('sink', 'r1')")
    else:
        time.sleep(0.25)    # given back when the next claim takes the shard
    assert dead(db) == ([] if give_back != "lease" else [(a, 0, "HTTP 422")])
    relay.lease = "30 seconds"
    out = relay.drain()
    assert dead(db) == [], "given back: as if never claimed"
    assert [(e.aggregate_id, e.payload["i"]) for e in out] == [(a, 0), (b, 0), (a, 1)], "each once, in order"
    assert db.execute("SELECT outbox.replay('sink')").fetchone()[0] == 0 and relay.drain() == []


def test_a_failure_inside_a_catching_up_keys_queue_counts_against_that_event(db, relay):
    """A key catching up hands out several events of its queue; the third fails: the first two
    went through and leave the queue, the third is the head now with one attempt counted, the
    rest wait behind it; reported final, the third alone is dead-lettered."""
    a, = keys_in_shard(db, 9, 1)
    batch, by_key = emit_batch(db, relay, {a: 6})
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[a][0], "once", retry_after="0")])
    heads = relay.claim()
    relay.settle(heads[0].shard, heads[0].epoch)          # the head alone, and through
    assert [e.payload["i"] for e in heads] == [0] and parked(db) == {a: [1, 2, 3, 4, 5]}
    heads = relay.claim()
    assert [e.payload["i"] for e in heads] == [1, 2, 3, 4, 5], "catching up: the queue, in order"
    assert relay.settle(heads[0].shard, heads[0].epoch, [relay.failure(heads[2], "third", retry_after="0")]) == 3
    assert parked(db) == {a: [3, 4, 5]}
    assert db.execute("SELECT attempts, last_error FROM outbox._parked").fetchone() == (1, "third")
    heads = relay.claim()
    assert [e.payload["i"] for e in heads] == [3], "a failing head is retried alone"
    relay.settle(heads[0].shard, heads[0].epoch)
    heads = relay.claim()
    assert [e.payload["i"] for e in heads] == [4, 5]
    db.execute("SELECT outbox.reject('sink', %s, %s, %s, 'HTTP 422')", (heads[1].shard, heads[1].epoch, heads[1].id))
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        relay.nack(heads[0], "reported after a later one")
    relay.settle(heads[0].shard, heads[0].epoch)
    assert dead(db) == [(a, 5, "HTTP 422")], "the rejected event, not the head before it"
    assert parked(db) == {} and relay.drain() == [], "4 went through; nothing is left"


def catching_up_with_new_events(db, relay) -> tuple[str, str, list]:
    """Key a fails at its first event and its retry goes through: its queue is [1, 2]; then a
    emits 3 and 4 around an event of another key of its shard. Returns the keys and the next
    batch. Queue positions start far above the events' seqs: a rule that compared a head's
    place (pos) with an event's of the page (seq) would show."""
    a, other = keys_in_shard(db, 9, 2)
    db.execute("ALTER TABLE outbox._parked_events ALTER COLUMN pos RESTART WITH 1000000")
    batch, by_key = emit_batch(db, relay, {a: 3})
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[a][0], "once", retry_after="0")])
    heads = relay.claim()
    relay.settle(heads[0].shard, heads[0].epoch)
    assert [e.payload["i"] for e in heads] == [0] and parked(db) == {a: [1, 2]}
    emit_many(db, a, 3, 1)
    db.execute("SELECT outbox.emit('order', %s, 'e', jsonb_build_object('i', 0))", (other,))
    emit_many(db, a, 4, 1)
    return a, other, relay.claim()


def queued_so_far(db) -> int:
    """Events ever copied into a parking queue."""
    db.execute("SELECT pg_stat_force_next_flush()")
    return db.execute("SELECT pg_stat_clear_snapshot(), n_tup_ins FROM pg_stat_user_tables "
                      "WHERE relid = 'outbox._parked_events'::regclass").fetchone()[1]


def test_a_key_catching_up_takes_its_new_events_behind_its_queue_copying_none(db, relay):
    """A key whose whole queue goes out in a batch rides: its new events of the page come in the
    same batch, behind its queue, and when they go through the key is unparked, none of them
    ever copied into its queue (#38: the copies were most of a drain with 5% of its events
    failing)."""
    a, other, batch = catching_up_with_new_events(db, relay)
    copied = queued_so_far(db)
    assert [(e.aggregate_id, e.payload["i"]) for e in batch] == [(a, 1), (a, 2), (a, 3), (other, 0), (a, 4)]
    relay.settle(batch[0].shard, batch[0].epoch)
    assert parked(db) == {} and relay.drain() == []
    assert queued_so_far(db) == copied, "nothing copied"


@pytest.mark.parametrize("failed", ["head", "both", "page", "page rejected"])
def test_a_failure_of_a_riding_key_keeps_its_order_and_counts(db, relay, failed):
    """A riding key (its queue, then its events of the page) fails in that batch: at a head, its
    events of the page join its queue behind the rest of it (also when an event of the page is
    listed failed before the head: the head comes first); at an event of the page, the heads
    went through and that event heads the queue with the attempt counted and its retry_after
    kept (not retried at once, uncounted, as a key parked by a replay is); rejected, that event
    alone is dead."""
    a, other, batch = catching_up_with_new_events(db, relay)
    mine = [e for e in batch if e.aggregate_id == a]
    shard, epoch = batch[0].shard, batch[0].epoch
    if failed in ("head", "both"):
        listed = [mine[2]] * (failed == "both") + [mine[0]]
        assert relay.settle(shard, epoch, [relay.failure(e, "HTTP 503", retry_after="1 hour") for e in listed]) == 4
        assert parked(db) == {a: [1, 2, 3, 4]}
    elif failed == "page":
        assert relay.settle(shard, epoch, [relay.failure(mine[2], "HTTP 503", retry_after="1 hour")]) == 2
        assert parked(db) == {a: [3, 4]}, "the heads before it went through"
    else:
        db.execute("SELECT outbox.reject('sink', %s, %s, %s, 'HTTP 422')", (shard, epoch, mine[2].id))
        relay.ack(shard, epoch)
        assert dead(db) == [(a, 3, "HTTP 422")] and parked(db) == {a: [4]}
        assert [e.payload["i"] for e in relay.drain()] == [4] and parked(db) == {}
        return
    assert db.execute("SELECT attempts, last_error, next_attempt_at > now() + interval '59 minutes' "
                      "FROM outbox._parked").fetchone() == (1, "HTTP 503", True)
    db.execute("UPDATE outbox._parked SET next_attempt_at = now()")
    left = [3, 4] if failed == "page" else [1, 2, 3, 4]
    assert [e.payload["i"] for e in drain_after_backoff(db, relay)] == left and parked(db) == {}


def test_a_riding_key_given_back_after_a_failure_of_its_page_counts_nothing(db, relay):
    """A riding key's new event is nacked (counted at that event, which heads the queue now),
    then the batch is given back: the page comes again, and the heads before the event did not
    fail, so nothing stays counted and the key is due at once; its events come once each, in
    order."""
    a, other, batch = catching_up_with_new_events(db, relay)
    relay.nack([e for e in batch if e.aggregate_id == a][2], "HTTP 503", retry_after="1 hour")
    relay.release(batch[0].shard, batch[0].epoch)
    assert parked(db) == {a: [1, 2]}
    assert db.execute("SELECT attempts, next_attempt_at <= now() FROM outbox._parked").fetchone() == (0, True)
    assert [(e.aggregate_id, e.payload["i"]) for e in relay.drain()] == [(a, 1), (a, 2), (a, 3), (other, 0), (a, 4)]
    assert parked(db) == {}


def test_a_later_head_nacked_then_given_back_charges_nothing_to_the_heads_before_it(db, relay):
    """A key catching up hands out its queue's heads together (only at no attempt counted);
    the third is nacked, then the batch given back: as if never claimed, the key is due at once
    with nothing counted. (The nack's attempt and hour stayed, charged to the first head,
    which had not failed: it went out alone, an attempt from its dead letter.)"""
    (k,) = keys_in_shard(db, 9, 1)
    batch, by_key = emit_batch(db, relay, {k: 4})
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[k][0], "HTTP 503", retry_after="0")])
    head = relay.claim()
    assert [(e.payload["i"], e.attempt) for e in head] == [(0, 2)]
    relay.ack(head[0].shard, head[0].epoch)
    heads = relay.claim()
    assert [e.payload["i"] for e in heads] == [1, 2, 3]
    relay.nack(heads[1], "HTTP 503", retry_after="1 hour")
    relay.release(heads[0].shard, heads[0].epoch)
    assert db.execute("SELECT attempts, next_attempt_at <= now() FROM outbox._parked").fetchone() == (0, True)
    again = relay.claim()
    assert [(e.payload["i"], e.attempt) for e in again] == [(1, 1), (2, 1), (3, 1)]


def test_a_reject_of_a_later_head_nacked_in_its_batch_is_refused(db, relay):
    (k,) = keys_in_shard(db, 9, 1)
    batch, by_key = emit_batch(db, relay, {k: 3})
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[k][0], "HTTP 503", retry_after="0")])
    head = relay.claim()
    relay.ack(head[0].shard, head[0].epoch)
    heads = relay.claim()
    assert [e.payload["i"] for e in heads] == [1, 2]
    relay.nack(heads[1], "HTTP 503")
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        db.execute("SELECT outbox.reject('sink', %s, %s, %s, 'HTTP 422')", (heads[0].shard, heads[0].epoch, heads[1].id))


def test_a_failure_behind_a_replay_into_a_riding_keys_queue_is_not_charged_to_the_replayed_event(db, relay):
    """A key's dead letter is replayed while the key rides in a batch (queued behind its heads),
    then one of its new events fails: once the heads are through, the replayed event heads the
    queue, and it did not fail, so no attempt is counted against it; the failed event waits
    behind it, and all come once each, in the queue's order."""
    a, other = keys_in_shard(db, 9, 2)
    batch, by_key = emit_batch(db, relay, {a: 3})
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[a][0], "HTTP 422", final=True)])
    assert parked(db) == {a: [1, 2]}
    emit_many(db, a, 3, 1)
    db.execute("SELECT outbox.emit('order', %s, 'e', jsonb_build_object('i', 0))", (other,))
    emit_many(db, a, 4, 1)
    batch = relay.claim()
    assert [(e.aggregate_id, e.payload["i"]) for e in batch] == [(a, 1), (a, 2), (a, 3), (other, 0), (a, 4)]
    assert db.execute("SELECT outbox.replay('sink')").fetchone()[0] == 1
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(batch[2], "HTTP 503", retry_after="1 hour")])
    assert parked(db) == {a: [0, 3, 4]}
    assert db.execute("SELECT attempts, next_attempt_at <= now() FROM outbox._parked").fetchone() == (0, True)
    assert [e.payload["i"] for e in drain_after_backoff(db, relay)] == [0, 3, 4] and parked(db) == {}


def test_a_batch_with_hundreds_of_failures_records_them_together(db, relay):
    """The failures of a batch are read, found and recorded set-based: one call of each
    function for 300 failed keys, none per failure (several statements per failed key made a
    drain with 5% of its events failing run at a tenth of the rate of one without), each key
    parked with its attempt counted, the final ones dead-lettered with their later events
    queued."""
    keys = keys_in_shard(db, 11, 300)
    relay.batch_size = 1000
    for i in range(3):
        db.execute("SELECT outbox.emit('order', k, 'e', jsonb_build_object('i', %s::int)) FROM unnest(%s::text[]) k",
                   (i, keys))
    batch = relay.claim()
    assert len(batch) == 900
    firsts = [next(e for e in batch if e.aggregate_id == k) for k in keys]
    failures = [relay.failure(e, "HTTP 503", final=n % 10 == 0) for n, e in enumerate(firsts)]
    counted = ['_failures', '_failures_read', '_check_failure', '_resolve', '_fail_keys', '_keys_failed',
               '_fail_key_or_say_why']
    assert db.execute("SELECT bool_and(to_regproc('outbox_internal.' || f) IS NOT NULL) FROM unnest(%s::text[]) f",
                      (counted,)).fetchone()[0], "each counted function is there: None below is no call"
    with db.transaction():
        db.execute("SET LOCAL track_functions = 'all'")
        assert relay.settle(batch[0].shard, batch[0].epoch, failures) == 900
        calls = dict(db.execute(
            "SELECT f, pg_stat_get_xact_function_calls(to_regproc('outbox_internal.' || f)) "
            "FROM unnest(ARRAY['_failures', '_failures_read', '_check_failure', '_resolve', '_fail_keys', "
            "                  '_keys_failed', '_fail_key_or_say_why']) f").fetchall())
    assert calls == {"_failures": 1, "_failures_read": 1, "_check_failure": None, "_resolve": 1,
                     "_fail_keys": 1, "_keys_failed": 1, "_fail_key_or_say_why": None}
    assert db.execute("SELECT count(*), sum(attempts) FROM outbox._parked").fetchone() == (300, 270)
    assert db.execute("SELECT count(*) FROM outbox._parked_events").fetchone()[0] == 270 * 3 + 30 * 2
    assert sorted(d[0] for d in dead(db)) == sorted(keys[::10])


def test_a_replayed_event_behind_a_catching_up_key_keeps_its_place_in_the_queue(db, relay):
    """replay queues a dead letter behind the key's queue with its old, lower seq: the order of
    a catching-up key's heads is the queue's, so a failure of a later head keeps the replayed
    event behind it, and reporting the replayed one after it changes nothing."""
    a, = keys_in_shard(db, 13, 1)
    batch, by_key = emit_batch(db, relay, {a: 3})
    relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(by_key[a][0], "HTTP 422", final=True)])
    assert parked(db) == {a: [1, 2]} and db.execute("SELECT outbox.replay('sink')").fetchone()[0] == 1
    assert parked(db) == {a: [1, 2, 0]}
    heads = relay.claim()
    assert [e.payload["i"] for e in heads] == [1, 2, 0], "the queue, in its order"
    relay.nack(heads[1], "second failed")
    relay.nack(heads[2], "reported after it: nothing changes")
    relay.ack(heads[0].shard, heads[0].epoch)
    assert parked(db) == {a: [2, 0]}, "only the head before the failure went through"
    time.sleep(0.01)
    assert [e.payload["i"] for e in drain_after_backoff(db, relay)] == [2, 0]


@pytest.mark.parametrize("seed", range(MODEL_SEEDS))
def test_random_claims_settles_nacks_and_releases_deliver_each_event_once_in_key_order(db, seed):
    """Claims of random sizes (one shard or two), each batch settled with random failures (or
    settled with them and the next batch claimed in one call), with one event rejected then
    settled or given back, one nacked then settled or given back, given back outright, left out
    until the relay's batches are all given back (release_owner), or left out (some nacked)
    until their leases run out, while keys keep emitting; then a clean drain. With no relay
    dying mid-delivery, an event that went through is never handed out again, and each key's
    events go through in the order they were emitted, every one of them but the dead letters
    (rejected and settled, or a rejected head given back)."""
    rng = random.Random(seed)
    db.execute("SELECT setseed(%s)", (seed % 1000 / 1000,))   # the shard a claim samples (and, with no list, starts at)
    db.execute("SELECT outbox.create_consumer('model', max_attempts => 1000, backoff_base => '1 ms', "
               "backoff_max => '1 ms')")
    keys = keys_in_shard(db, 4, 3) + keys_in_shard(db, 9, 2)
    emitted = dict.fromkeys(keys, 0)
    through: dict[str, list[int]] = {k: [] for k in keys}
    dead: set[tuple[str, int]] = set()
    relay = Relay(db, "model", owner="model-relay")

    def emit_some():
        for _ in range(rng.randint(0, 6)):
            key = rng.choice(keys)
            emit_many(db, key, emitted[key], 1)
            emitted[key] += 1

    def deliver(batch, failing):
        """A relay's pass over a batch: each key's events until one in failing. Returns what
        went through and the failures to report."""
        failed, ok, failures = set(), [], []
        for e in batch:
            if e.aggregate_id in failed:
                continue
            if e.id in failing:
                failed.add(e.aggregate_id)
                failures.append(relay.failure(e, "HTTP 503", retry_after="0"))
            else:
                ok.append(e)
        return ok, failures

    for _ in range(60):
        emit_some()
        relay.batch_size, relay.shards = rng.choice([1, 2, 3, 5, 10]), rng.choice([1, 2])
        if rng.random() < 0.1:
            # the relay dies: its batches' leases run out, after nacks of some of their events
            relay.lease = "100 ms"
            for batch in Relay.batches(relay.claim()):
                if rng.random() < 0.5:   # (taken after the lease ran out too: no claim took the shard)
                    relay.nack(rng.choice(batch), "HTTP 503", retry_after="0")
            relay.lease = "30 seconds"
            db.execute("SELECT pg_sleep(0.11)")
            continue
        todo = Relay.batches(relay.claim())
        while todo:
            batch = todo.pop(0)
            shard, epoch = batch[0].shard, batch[0].epoch
            what = rng.random()
            if what < 0.05:
                continue  # left out: given back below
            if what < 0.15:
                relay.release(shard, epoch)
                continue
            if what < 0.2:
                rejected = rng.choice(batch)
                head = db.execute("SELECT %s = ANY (l.heads) FROM outbox._cursor_log l JOIN outbox.consumers c "
                                  "ON c.id = l.consumer_id WHERE c.name = 'model' AND l.shard = %s AND l.epoch = %s "
                                  "ORDER BY l.pos DESC LIMIT 1", (rejected.id, shard, epoch)).fetchone()[0]
                db.execute("SELECT outbox.reject('model', %s, %s, %s, 'HTTP 422')", (shard, epoch, rejected.id))
                if rng.random() < 0.3:
                    # given back: an event of the page comes again and is not dead; a head
                    # stays dead (unless the page holds it too: then it comes again)
                    relay.release(shard, epoch)
                    still_dead = db.execute("SELECT EXISTS (SELECT FROM outbox.dead_letters WHERE consumer = 'model' "
                                            "AND event_id = %s)", (rejected.id,)).fetchone()[0]
                    assert head or not still_dead, "a rejected event of the page given back is not dead"
                    if still_dead:
                        dead.add((rejected.aggregate_id, rejected.payload["i"]))
                    continue
                dead.add((rejected.aggregate_id, rejected.payload["i"]))
                relay.settle(shard, epoch)
                done, _ = deliver(batch, {rejected.id})
            elif what < 0.3:
                nacked = rng.choice(batch)
                relay.nack(nacked, "HTTP 503", retry_after="0")
                if rng.random() < 0.5:
                    relay.release(shard, epoch)
                    continue
                relay.settle(shard, epoch)
                done, _ = deliver(batch, {nacked.id})
            else:
                done, failures = deliver(batch, {e.id for e in batch if rng.random() < 0.2})
                if rng.random() < 0.3:
                    todo += Relay.batches(relay.settle_and_claim(shard, epoch, failures))
                else:
                    relay.settle(shard, epoch, failures)
            for e in done:
                through[e.aggregate_id].append(e.payload["i"])
        db.execute("SELECT outbox.release_owner('model', 'model-relay')")
    for _ in range(50):
        db.execute("SELECT pg_sleep(0.002)")
        relay.batch_size, relay.shards = 100, 2
        for e in relay.drain():
            through[e.aggregate_id].append(e.payload["i"])
        if sum(map(len, through.values())) + len(dead) >= sum(emitted.values()):
            break
    assert through == {k: [i for i in range(emitted[k]) if (k, i) not in dead] for k in keys}
    assert sorted(db.execute("SELECT aggregate_id, (payload->>'i')::int FROM outbox.dead_letters "
                             "WHERE consumer = 'model'").fetchall()) == sorted(dead)
    assert parked(db) == {} and relay.drain() == [], "nothing left parked or to hand out"
