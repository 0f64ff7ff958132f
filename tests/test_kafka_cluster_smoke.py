"""KafkaCluster (support/kafka_cluster.py) works: a real 3-node Apache Kafka takes idempotent acks=all
writes on every listener and mechanism, refuses a wrong password, and loses nothing when a
node is killed (or stopped) and started again. No PostgreSQL here."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, Producer

from support.kafka_cluster import KafkaCluster


def producer(kafka: KafkaCluster, listener: str = "PLAINTEXT", mechanism: str | None = None,
             password: str | None = None, **settings) -> Producer:
    return Producer({**kafka.client_config(listener, mechanism, password), "acks": "all",
                     "enable.idempotence": True, **settings})


def produce(p: Producer, topic: str, values: range) -> list:
    """Send values (key: value mod 7) and wait for every delivery report; the errors, if any."""
    errors = []
    def report(err, _msg):
        if err is not None:
            errors.append(err)
    for i in values:
        p.produce(topic, key=f"k{i % 7}", value=str(i), headers=[("n", str(i).encode())], on_delivery=report)
        p.poll(0)
    assert p.flush(60) == 0, "deliveries still pending"
    return errors


@pytest.mark.parametrize("listener, mechanism", [
    ("PLAINTEXT", None),
    ("SASL_PLAINTEXT", "SCRAM-SHA-512"),
    ("SASL_SSL", "SCRAM-SHA-512"),
    ("SASL_SSL", "SCRAM-SHA-256"),
    ("SASL_PLAINTEXT", "PLAIN"),
])
def test_produce_and_read_back(kafka, listener, mechanism):
    topic = f"smoke-{listener}-{mechanism}".lower()
    kafka.create_topic(topic, 3)
    assert produce(producer(kafka, listener, mechanism), topic, range(50)) == []
    records = kafka.read(topic, 50)
    assert sorted(int(r["value"]) for r in records) == list(range(50))
    assert all(r["headers"] == {"n": r["value"]} and r["key"] == f"k{int(r['value']) % 7}".encode()
               for r in records)
    kafka.delete_topic(topic)


def test_wrong_password_is_an_authentication_error(kafka):
    kafka.create_topic("smoke-auth", 1)
    errors = []
    p = producer(kafka, "SASL_SSL", password="not-the-password", error_cb=errors.append,
                 **{"message.timeout.ms": 3000})
    delivery = produce(p, "smoke-auth", range(1))
    assert [e.code() for e in delivery] == [KafkaError._MSG_TIMED_OUT]
    assert KafkaError._AUTHENTICATION in {e.code() for e in errors}
    assert kafka.read("smoke-auth", 0, timeout=5) == []


def test_kill_and_restart_loses_nothing(kafka):
    topic = "smoke-failover"
    kafka.create_topic(topic, 3)
    p = producer(kafka)
    assert produce(p, topic, range(0, 300)) == []
    # the leader of partition 0 crashes: its partitions get other leaders while the same
    # producer goes on, with acks=all met by the two nodes left
    victim = kafka.admin().list_topics(topic, timeout=10).topics[topic].partitions[0].leader
    kafka.kill(victim)
    assert produce(p, topic, range(300, 600)) == []
    kafka.start(victim)
    assert produce(p, topic, range(600, 900)) == []
    # the restarted node caught up from its log on disk; then a controlled stop of another
    kafka.wait_in_sync(topic)
    other = victim % 3 + 1
    kafka.stop(other)
    assert produce(p, topic, range(900, 1200)) == []
    kafka.start(other)

    records = kafka.read(topic, 1200)
    values = [int(r["value"]) for r in records]
    assert sorted(values) == list(range(1200)), "lost or duplicated records"
    for key in range(7):   # idempotence keeps each key's order across the failover
        mine = [v for v in values if v % 7 == key]
        assert mine == sorted(mine)
