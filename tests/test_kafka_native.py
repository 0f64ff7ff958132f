"""The native Kafka sink end to end: the worker produces with librdkafka to a real 3-node Apache
Kafka 4.4 cluster (support/kafka_cluster.py, the `kafka` fixture), and the records are read
back with a real Kafka consumer (confluent-kafka). Checked: topic, partition (the one a Java
producer, i.e. confluent-kafka with partitioner=murmur2_random, picks for the key), key, value,
tombstones, headers, order within each key; the Debezium-compatible format; an unknown topic;
a record over the size limit; the worker terminated mid-stream. The cluster's own faults
(credentials, TLS, brokers down or stalled, restarts) are in tests/test_kafka_faults.py."""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict

import pytest

from support.peers import wait_for

_topics = itertools.count()
PARTITIONS = 4


@pytest.fixture
def topic(kafka):
    name = f"native{next(_topics)}"
    kafka.create_topic(name, partitions=PARTITIONS)
    return name


def emit_keys(conn, topic: str | None, keys: int, per_key: int, first: int = 0) -> dict:
    """Emits interleaved events of `keys` keys, numbered from `first`, in one transaction
    each; key -> payloads."""
    sent = defaultdict(list)
    for i in range(first, first + per_key):
        for k in range(keys):
            payload = {"key": f"k{k}", "i": i}
            conn.execute("SELECT outbox.emit('order', %s, 'order.changed', %s::jsonb, %s::jsonb, %s)",
                         (f"k{k}", json.dumps(payload),
                          json.dumps({"trace": f"t{k}-{i}"}), topic))
            sent[f"k{k}"].append(payload)
    return sent


def first_arrivals(records: list[dict]) -> dict:
    """key -> decoded values, each at its first arrival, in partition order."""
    arrived = defaultdict(list)
    for r in records:
        value = json.loads(r["value"])
        if value not in arrived[r["key"].decode()]:
            arrived[r["key"].decode()].append(value)
    return dict(arrived)


def java_partitions(kafka, keys) -> dict[str, int]:
    """The partition a confluent-kafka producer with partitioner=murmur2_random (the Java
    client's default) picks for each key, found by producing to a probe topic."""
    from confluent_kafka import Producer
    probe = f"probe{next(_topics)}"
    kafka.create_topic(probe, partitions=PARTITIONS)
    producer = Producer({**kafka.client_config(), "partitioner": "murmur2_random"})
    picked = {}
    for key in keys:
        producer.produce(probe, key=key.encode(), value=b"x",
                         on_delivery=lambda err, msg: picked.__setitem__(msg.key().decode(), msg.partition()))
    assert producer.flush(30) == 0
    return picked


def delivered(conn, sink: str) -> int:
    return conn.execute("SELECT coalesce(delivered_total, 0) FROM outbox.status WHERE consumer = %s",
                        (sink,)).fetchone()[0]


def sink_error(conn, sink: str) -> str | None:
    """What status says went wrong last: a parked key's error, else the sink's own."""
    return conn.execute("SELECT coalesce(last_error, last_sink_error) FROM outbox.status WHERE consumer = %s",
                        (sink,)).fetchone()[0]


def test_records_carry_key_value_headers_in_the_java_partition_in_order(conn, new_sink, kafka, topic):
    new_sink("kafka", f"kafka://{kafka.bootstrap()}", batch_size=50)
    sent = emit_keys(conn, topic, keys=8, per_key=10)
    records = kafka.read(topic, expect=80)
    assert len(records) == 80, "each event once"
    assert first_arrivals(records) == dict(sent), "lost, phantom or out of order"
    java = java_partitions(kafka, sent)
    for r in records:
        key = r["key"].decode()
        assert r["partition"] == java[key], f"key {key} is not where a Java producer puts it"
        value = json.loads(r["value"])
        assert r["headers"]["trace"].decode() == f"t{key[1:]}-{value['i']}"
        assert r["headers"]["outbox-event-type"] == b"order.changed"
        assert len(r["headers"]["outbox-id"]) == 36


def test_a_null_payload_is_a_tombstone(conn, new_sink, kafka, topic):
    new_sink("kafka", f"kafka://{kafka.bootstrap()}")
    conn.execute("SELECT outbox.emit('order', 'gone', 'order.deleted', NULL, NULL, %s)", (topic,))
    conn.execute("SELECT outbox.emit('order', 'gone', 'order.probe', '{}', NULL, %s)", (topic,))
    records = kafka.read(topic, expect=2)
    assert [(r["key"], r["value"]) for r in records] == [(b"gone", None), (b"gone", b"{}")]


def test_debezium_format_names_topics_and_headers_as_the_outbox_event_router(conn, new_sink, kafka):
    aggregate_type = f"invoice{next(_topics)}"
    kafka.create_topic(f"outbox.event.{aggregate_type}", partitions=PARTITIONS)
    new_sink("kafka", f"kafka://{kafka.bootstrap()}", format="debezium")
    conn.execute("SELECT outbox.emit(%s, 'i7', 'invoice.paid', '{\"n\": 1}')", (aggregate_type,))
    [record] = kafka.read(f"outbox.event.{aggregate_type}", expect=1)
    assert record["key"] == b"i7" and json.loads(record["value"]) == {"n": 1}
    assert len(record["headers"]["id"]) == 36
    assert record["headers"]["eventType"] == b"invoice.paid"
    assert "outbox-id" not in record["headers"]


def test_a_record_over_the_size_limit_is_dead_lettered_and_its_key_goes_on(conn, new_sink, kafka, topic):
    sink = new_sink("kafka", f"kafka://{kafka.bootstrap()}")
    big = json.dumps({"blob": "x" * 1_020_000})   # under emit's 1 MiB, over Kafka's 1,000,000 bytes
    conn.execute("SELECT outbox.emit('order', 'b', 'e', '{\"i\": 0}', NULL, %s)", (topic,))
    conn.execute("SELECT outbox.emit('order', 'b', 'e', %s::jsonb, NULL, %s)", (big, topic))
    conn.execute("SELECT outbox.emit('order', 'b', 'e', '{\"i\": 2}', NULL, %s)", (topic,))
    dead = wait_for(lambda: conn.execute(
        "SELECT last_error FROM outbox.dead_letters WHERE consumer = %s", (sink,)).fetchall())
    assert len(dead) == 1 and "size" in dead[0][0].lower(), dead
    records = kafka.read(topic, expect=2)
    assert [json.loads(r["value"]) for r in records] == [{"i": 0}, {"i": 2}]


def test_a_record_over_the_topics_size_limit_is_dead_lettered_once_others_go_through(conn, new_sink, kafka):
    """The brokers refuse one record as too large for the topic while they take the others:
    that record is dead-lettered, and its key goes on in order."""
    topic = f"native{next(_topics)}"
    kafka.create_topic(topic, partitions=PARTITIONS, config={"max.message.bytes": "4000"})
    sink = new_sink("kafka", f"kafka://{kafka.bootstrap()}")
    conn.execute("SELECT outbox.emit('order', 'b', 'e', '{\"i\": 0}', NULL, %s)", (topic,))
    conn.execute("SELECT outbox.emit('order', 'b', 'e', %s::jsonb, NULL, %s)",
                 (json.dumps({"blob": "x" * 10_000}), topic))
    conn.execute("SELECT outbox.emit('order', 'b', 'e', '{\"i\": 2}', NULL, %s)", (topic,))
    sent = emit_keys(conn, topic, keys=4, per_key=3)
    time.sleep(2)                       # the topic goes on taking others' records: the evidence
    for key, payloads in emit_keys(conn, topic, keys=4, per_key=2, first=3).items():
        sent[key] += payloads
    dead = wait_for(lambda: conn.execute(
        "SELECT last_error, aggregate_id, length(payload::text) FROM outbox.dead_letters WHERE consumer = %s",
        (sink,)).fetchall())
    time.sleep(1)
    dead = conn.execute("SELECT last_error, aggregate_id, length(payload::text) FROM outbox.dead_letters "
                        "WHERE consumer = %s", (sink,)).fetchall()
    assert len(dead) == 1 and "large" in dead[0][0].lower() and dead[0][1] == "b", dead
    wait_for(lambda: conn.execute("SELECT undelivered FROM outbox.status WHERE consumer = %s",
                                  (sink,)).fetchone()[0] == 0)
    records = kafka.read(topic, expect=2 + 20)
    assert first_arrivals(records) == {**sent, "b": [{"i": 0}, {"i": 2}]}


def test_an_unknown_topic_holds_its_key_until_the_topic_is_made(conn, new_sink, kafka, topic):
    sink = new_sink("kafka", f"kafka://{kafka.bootstrap()}", request_timeout="3 s")
    missing = f"missing{next(_topics)}"
    conn.execute("SELECT outbox.emit('order', 'u', 'e', '{\"i\": 1}', NULL, %s)", (missing,))
    conn.execute("SELECT outbox.emit('order', 'v', 'e', '{\"i\": 1}', NULL, %s)", (topic,))
    assert [json.loads(r["value"]) for r in kafka.read(topic, expect=1)] == [{"i": 1}]
    error = wait_for(lambda: sink_error(conn, sink), timeout=40)
    assert "topic" in error.lower(), error
    conn.execute("SELECT outbox.emit('order', 'u', 'e', '{\"i\": 2}', NULL, %s)", (missing,))
    kafka.create_topic(missing, partitions=PARTITIONS)
    records = kafka.read(missing, expect=2, timeout=60)
    assert [json.loads(r["value"]) for r in records] == [{"i": 1}, {"i": 2}], "the key kept its order"
    assert conn.execute("SELECT count(*) FROM outbox.dead_letters WHERE consumer = %s", (sink,)).fetchone()[0] == 0


def test_a_key_whose_events_go_to_two_topics_keeps_its_order_across_them(conn, new_sink, kafka, topic):
    """Two topics are two partitions, which the producer does not order with each other: a
    key's record for one waits for its earlier record for the other."""
    sink = new_sink("kafka", f"kafka://{kafka.bootstrap()}", request_timeout="3 s")
    missing = f"missing{next(_topics)}"
    with conn.transaction():   # one batch: e1 -> topic, e2 -> missing (parks), e3 -> topic
        for i, t in ((1, topic), (2, missing), (3, topic)):
            conn.execute("SELECT outbox.emit('order', 'x', 'e', %s::jsonb, NULL, %s)", (json.dumps({"i": i}), t))
    wait_for(lambda: "topic" in (sink_error(conn, sink) or "").lower(), timeout=40)
    time.sleep(1)
    assert [json.loads(r["value"]) for r in kafka.read(topic, expect=1)] == [{"i": 1}], \
        "e3 was published while e2, earlier, was not"
    kafka.create_topic(missing, partitions=PARTITIONS)
    assert [json.loads(r["value"]) for r in kafka.read(missing, expect=1, timeout=60)] == [{"i": 2}]
    assert [json.loads(r["value"]) for r in kafka.read(topic, expect=2)] == [{"i": 1}, {"i": 3}]


def test_a_worker_terminated_mid_stream_resumes_each_key_in_order(conn, cluster, deliver_db, new_sink,
                                                                  kafka, topic):
    sink = new_sink("kafka", f"kafka://{kafka.bootstrap()}", batch_size=10, linger="20 ms")
    with conn.transaction():   # one commit: a backlog the worker is in the middle of
        sent = emit_keys(conn, topic, keys=10, per_key=300)
    wait_for(lambda: conn.execute("SELECT pending FROM outbox.status WHERE consumer = %s",
                                  (sink,)).fetchone()[0] < 2900, every=0.01)
    first = cluster.worker_pid(deliver_db)
    conn.execute("SELECT pg_terminate_backend(%s)", (first,))
    left = conn.execute("SELECT pending FROM outbox.status WHERE consumer = %s", (sink,)).fetchone()[0]
    assert left > 0, "the worker was stopped mid-stream"
    wait_for(lambda: cluster.worker_pid(deliver_db) not in (None, first), timeout=30)
    wait_for(lambda: conn.execute("SELECT pending FROM outbox.status WHERE consumer = %s",
                                  (sink,)).fetchone()[0] == 0, timeout=60)
    records = kafka.read(topic, expect=3000)
    assert first_arrivals(records) == dict(sent), "lost or out of order"
