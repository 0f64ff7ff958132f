"""The native Kafka sink against a real 3-broker Apache Kafka 4.4 cluster (support/kafka_cluster.py:
KRaft, replication factor 3, min.insync.replicas 2, no topic made on use), read back with a
real Kafka client (confluent-kafka). Every everyday fault of a cluster is the sink's, never the
events': a wrong SCRAM password, a CA that does not match, a topic not made yet, two brokers of
three down. Each suspends the sink, dead-letters nothing, and once fixed (an UPDATE of the sink
row, the topic made, the brokers back) every event arrives, each key in emit order. A leader
killed mid-stream loses nothing and reorders no key."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import defaultdict

import pytest

from support.kafka_cluster import KafkaCluster
from support.peers import certificates, wait_for

_topics = itertools.count()
PARTITIONS = 3
FAST = {"request_timeout": "3 s", "max_attempts": 2, "backoff_base": "100 ms", "backoff_max": "200 ms"}


@pytest.fixture(scope="module")
def kafka():
    cluster = KafkaCluster()
    yield cluster
    cluster.close()


@pytest.fixture
def topic(kafka):
    name = f"faults{next(_topics)}"
    kafka.create_topic(name, partitions=PARTITIONS)
    return name


def kafka_sink(new_sink, kafka, listener="PLAINTEXT", password=None, **options) -> str:
    """A native Kafka sink on the cluster's listener (SASL: SCRAM-SHA-512 as its user)."""
    scheme = "kafkas" if listener == "SASL_SSL" else "kafka"
    if listener != "PLAINTEXT":
        options = {"sasl_mechanism": "SCRAM-SHA-512", "sasl_username": kafka.user,
                   "secret": password or kafka.password, **options}
    if listener == "SASL_SSL":
        options.setdefault("tls_ca", kafka.ca_pem.read_text())
    return new_sink("kafka", f"{scheme}://{kafka.bootstrap(listener)}", **{**FAST, **options})


def emit_keys(conn, topic: str, keys: int, per_key: int, prefix: str = "k") -> dict[str, list[int]]:
    sent = defaultdict(list)
    for i in range(per_key):
        with conn.transaction():
            for k in range(keys):
                conn.execute("SELECT outbox.emit('order', %s, 'e', %s::jsonb, NULL, %s)",
                             (f"{prefix}{k}", json.dumps({"i": i}), topic))
                sent[f"{prefix}{k}"].append(i)
    return dict(sent)


def first_arrivals(records: list[dict]) -> tuple[dict[str, list[int]], int]:
    """key -> values at their first arrival (records come per partition, in offset order, and a
    key lives in one partition); and how many records were duplicates."""
    arrived, duplicates = defaultdict(list), 0
    for r in records:
        key, value = r["key"].decode(), json.loads(r["value"])["i"]
        if value in arrived[key]:
            duplicates += 1
        else:
            arrived[key].append(value)
    return dict(arrived), duplicates


def status(conn, sink: str) -> dict:
    cur = conn.execute("SELECT undelivered, dead_letters, sink_state, sink_state_reason "
                       "FROM outbox.status WHERE consumer = %s", (sink,))
    return dict(zip([c.name for c in cur.description], cur.fetchone()))


def suspended(conn, sink: str, timeout: float = 30) -> dict:
    return wait_for(lambda: (s := status(conn, sink))["sink_state"] == "suspended" and s, timeout=timeout)


def test_scram_over_tls_delivers_every_key_in_order(conn, new_sink, kafka, topic):
    kafka_sink(new_sink, kafka, "SASL_SSL", batch_size=50)
    sent = emit_keys(conn, topic, keys=20, per_key=10)
    arrived, duplicates = first_arrivals(kafka.read(topic, expect=200))
    assert arrived == sent and duplicates == 0


@pytest.mark.parametrize("listener", ["SASL_PLAINTEXT", "SASL_SSL"])
def test_a_wrong_password_suspends_the_sink_until_the_row_is_fixed(conn, new_sink, kafka, topic, listener):
    sink = kafka_sink(new_sink, kafka, listener, password="not-the-password")
    sent = emit_keys(conn, topic, keys=10, per_key=3)
    state = suspended(conn, sink)
    assert "auth" in state["sink_state_reason"].lower(), state
    time.sleep(4)                                   # probes fail meanwhile; nothing is blamed
    assert status(conn, sink)["dead_letters"] == 0 and status(conn, sink)["undelivered"] == 30
    conn.execute("UPDATE outbox.sinks SET secret = %s WHERE name = %s", (kafka.password, sink))
    fixed = time.monotonic()
    arrived, _ = first_arrivals(kafka.read(topic, expect=30, timeout=30))
    took = time.monotonic() - fixed
    assert arrived == sent
    assert took < 5, f"delivered {took:.1f} s after the fix"
    assert status(conn, sink)["dead_letters"] == 0


def test_a_ca_that_does_not_match_suspends_the_sink_until_the_row_is_fixed(conn, new_sink, kafka, topic, tmp_path):
    other_ca = certificates(tmp_path)["other_ca"].read_text()
    sink = kafka_sink(new_sink, kafka, "SASL_SSL", tls_ca=other_ca)
    sent = emit_keys(conn, topic, keys=5, per_key=4)
    suspended(conn, sink)
    time.sleep(3)
    assert status(conn, sink)["dead_letters"] == 0
    conn.execute("UPDATE outbox.sinks SET tls_ca = %s WHERE name = %s", (kafka.ca_pem.read_text(), sink))
    arrived, _ = first_arrivals(kafka.read(topic, expect=20, timeout=30))
    assert arrived == sent and status(conn, sink)["dead_letters"] == 0


def test_a_topic_not_made_yet_suspends_the_sink_until_it_is_made(conn, new_sink, kafka):
    missing = f"later{next(_topics)}"
    sink = kafka_sink(new_sink, kafka)
    sent = emit_keys(conn, missing, keys=5, per_key=4)
    state = suspended(conn, sink, timeout=60)
    assert "topic" in state["sink_state_reason"].lower() or "partition" in state["sink_state_reason"].lower(), state
    assert state["undelivered"] == 20, "what waits is counted"
    time.sleep(3)
    assert status(conn, sink)["dead_letters"] == 0
    kafka.create_topic(missing, partitions=PARTITIONS)
    made = time.monotonic()
    arrived, _ = first_arrivals(kafka.read(missing, expect=20, timeout=60))
    took = time.monotonic() - made
    assert arrived == sent and status(conn, sink)["dead_letters"] == 0
    assert took < 10, f"delivered {took:.1f} s after the topic was made"


def test_two_brokers_of_three_down_the_sink_waits_and_resumes(conn, new_sink, kafka, topic):
    sink = kafka_sink(new_sink, kafka)
    before = emit_keys(conn, topic, keys=5, per_key=2, prefix="a")
    kafka.read(topic, expect=10)
    kafka.stop(2)
    kafka.stop(3)                                   # NOT_ENOUGH_REPLICAS for acks=all
    try:
        during = emit_keys(conn, topic, keys=5, per_key=3, prefix="b")
        suspended(conn, sink, timeout=60)
        time.sleep(3)
        assert status(conn, sink)["dead_letters"] == 0
    finally:
        kafka.start(2)
        kafka.start(3)
    arrived, _ = first_arrivals(kafka.read(topic, expect=25, timeout=90))
    assert arrived == {**before, **during}
    wait_for(lambda: status(conn, sink)["undelivered"] == 0, timeout=30)
    assert status(conn, sink)["dead_letters"] == 0


def test_the_leader_killed_mid_stream_loses_nothing_and_reorders_no_key(conn, cluster, deliver_db, new_sink,
                                                                         kafka, topic):
    sink = kafka_sink(new_sink, kafka, batch_size=50, concurrency=4)
    sent: dict[str, list[int]] = defaultdict(list)
    stop = threading.Event()

    def stream():
        with cluster.connect(deliver_db) as c:
            for i in itertools.count():
                if stop.is_set():
                    return
                with c.transaction():
                    for k in range(10):
                        c.execute("SELECT outbox.emit('order', %s, 'e', %s::jsonb, NULL, %s)",
                                  (f"s{k}", json.dumps({"i": i}), topic))
                        sent[f"s{k}"].append(i)
                time.sleep(0.01)
    emitter = threading.Thread(target=stream)
    emitter.start()
    try:
        time.sleep(2)
        leader = kafka.leader(topic, 0)
        kafka.kill(leader)
        time.sleep(3)
        kafka.start(leader)
        time.sleep(2)
    finally:
        stop.set()
        emitter.join()
    total = sum(len(v) for v in sent.values())
    wait_for(lambda: status(conn, sink)["undelivered"] == 0, timeout=90)
    records = kafka.read(topic, expect=total, timeout=60)
    arrived, duplicates = first_arrivals(records)
    assert arrived == dict(sent), "nothing lost, each key in emit order"
    assert duplicates <= 4 * 50, f"{duplicates} duplicates: at most the batches in flight"
    assert status(conn, sink)["dead_letters"] == 0
