"""What emit accepts can be parked, retried, dead-lettered and replayed: keys and types have a
documented length, checked at emit; the payload limit applies to a payload's real size however
it arrives."""

from __future__ import annotations

import psycopg
import pytest

from support.relay import Relay

KEY = "k" * 1024           # the longest key emit takes (docs/reference/outbox.emit.md)


@pytest.mark.parametrize("call", [
    "SELECT outbox.emit('a', %(key)s, 'e', '{}')",
    "SELECT outbox.emit_many('a', 'e', ARRAY[%(key)s], ARRAY['{}'::jsonb])",
])
def test_a_key_over_1024_bytes_is_refused_at_emit(db, call):
    db.execute(call, {"key": KEY})
    with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
        db.execute(call, {"key": KEY + "x"})
    assert "1024" in e.value.diag.message_hint


@pytest.mark.parametrize("field", ["aggregate_type", "event_type"])
def test_types_over_255_bytes_are_refused(db, field):
    args = {"aggregate_type": "a", "event_type": "e", field: "t" * 256}
    with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
        db.execute("SELECT outbox.emit(%(aggregate_type)s, '1', %(event_type)s, '{}')", args)
    assert e.value.diag.message_hint


def test_the_longest_key_can_be_parked_retried_dead_lettered_and_replayed(db):
    db.execute("SELECT outbox.create_consumer('c', max_attempts => 2, backoff_base => '1 ms', backoff_max => '1 ms')")
    for i in range(3):
        db.execute("SELECT outbox.emit('a', %s, 'e', jsonb_build_object('i', %s::int))", (KEY, i))
    relay = Relay(db, "c")
    batch = relay.claim()
    relay.nack(batch[0], "down")                    # parked, its queue behind it
    relay.ack(batch[0].shard, batch[0].epoch)
    assert db.execute("SELECT parked_keys, parked_events FROM outbox.status").fetchone() == (1, 3)
    db.execute("SELECT pg_sleep(0.01)")
    head = relay.claim()
    db.execute("SELECT outbox.reject('c', %s, %s, %s, 'no')", (head[0].shard, head[0].epoch, head[0].id))
    relay.ack(head[0].shard, head[0].epoch)
    assert db.execute("SELECT count(*) FROM outbox.dead_letters WHERE aggregate_id = %s", (KEY,)).fetchone()[0] == 1
    assert db.execute("SELECT outbox.replay('c', %s)", (KEY,)).fetchone()[0] == 1
    delivered = []
    for _ in range(10):
        delivered += relay.drain()
        db.execute("SELECT pg_sleep(0.01)")
    assert sorted(e.payload["i"] for e in delivered) == [0, 1, 2]


def test_the_payload_limit_applies_to_a_compressed_column(db):
    db.execute("CREATE TABLE bodies (p jsonb)")
    db.execute("INSERT INTO bodies SELECT jsonb_build_object('x', repeat('a', 20 * 1024 * 1024))")
    stored = db.execute("SELECT pg_column_size(p) FROM bodies").fetchone()[0]
    assert stored < 1024 * 1024, "stored compressed, under the limit"
    for call in ["SELECT outbox.emit('a', '1', 'e', p) FROM bodies",
                 "SELECT outbox.emit_many('a', 'e', ARRAY['1'], array_agg(p)) FROM bodies"]:
        with pytest.raises(psycopg.errors.ProgramLimitExceeded):
            db.execute(call)
    assert db.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 0


def test_a_consumer_name_over_128_characters_is_refused(db):
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        db.execute("SELECT outbox.create_consumer(repeat('c', 10000))")
    assert e.value.diag.message_hint
