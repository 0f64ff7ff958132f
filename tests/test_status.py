"""outbox.status and outbox.shard_status tell what is pending, how late, and why."""

from support.relay import Relay


def status(db, consumer="sink"):
    return db.execute("SELECT pending, lag IS NOT NULL, parked_keys, parked_events, dead_letters, "
                      "last_error, shards_leased, events_in_default_partition "
                      "FROM outbox.status WHERE consumer = %s", (consumer,)).fetchone()


def test_pending_lag_parked_and_dead_letters(db):
    db.execute("SELECT outbox.create_consumer('sink', max_attempts => 1)")
    assert status(db) == (0, False, 0, 0, 0, None, 0, 0)
    for i in range(10):
        db.execute("SELECT outbox.emit('order', %s, 'e', '{}')", (f"k{i % 3}",))
    assert status(db)[:2] == (10, True)
    relay = Relay(db, "sink", batch_size=100)
    batch = relay.claim()
    assert status(db)[6] == 1, "one shard leased"
    relay.nack(batch[0], "HTTP 500")          # max_attempts 1: straight to dead letters
    relay.ack(batch[0].shard, batch[0].epoch)
    relay.drain()
    pending, lagging, parked, parked_events, dead, error, leased, default_rows = status(db)
    assert (pending, lagging, parked, dead, leased) == (0, False, 0, 1, 0)
    assert error == "HTTP 500"
    per_shard = db.execute("SELECT sum(pending), count(*) FROM outbox.shard_status WHERE consumer = 'sink'").fetchone()
    assert per_shard == (0, 16)


def test_a_parked_key_shows_with_its_error(db):
    db.execute("SELECT outbox.create_consumer('sink')")
    db.execute("SELECT outbox.emit('order', 'k', 'e', '{}'); SELECT outbox.emit('order', 'k', 'e', '{}')")
    relay = Relay(db, "sink")
    batch = relay.claim()
    relay.nack(batch[0], "timeout", retry_after="1 hour")
    relay.ack(batch[0].shard, batch[0].epoch)
    _, _, parked, parked_events, _, error, _, _ = status(db)
    assert (parked, parked_events, error) == (1, 2, "timeout")


def test_events_in_the_default_partition_are_reported(db):
    db.execute("SELECT outbox.create_consumer('sink')")
    db.execute("""INSERT INTO outbox.events (id, aggregate_type, aggregate_id, event_type, payload, created_at, shard)
                  VALUES (outbox.uuid_v7(), 'order', 'k', 'e', '{}', now() + interval '40 days', outbox.shard_of('k'))""")
    assert status(db)[7] == 1
    db.execute("SELECT * FROM outbox.maintain()")
    assert status(db)[7] == 0


def test_an_event_emitted_before_create_consumer_in_its_transaction_is_pending_until_read(db, connect):
    """The consumer's first bound leaves its own transaction out of the snapshot's in-progress
    list: with a later transaction ended before it (as on any busy primary), the snapshot read
    that transaction as finished, so its own event as read already: claims delivered it, but
    status showed nothing pending, and DROP EXTENSION or maintain() could take it."""
    maker = connect(autocommit=False)
    maker.execute("SELECT outbox.emit('order', 'k', 'e', '{}')")
    connect().execute("SELECT pg_current_xact_id()")     # a later transaction, ended
    maker.execute("SELECT outbox.create_consumer('sink')")
    maker.commit()
    assert status(db)[0] == 1
    assert [e.aggregate_id for e in Relay(db, "sink").drain()] == ["k"]
    assert status(db)[0] == 0
