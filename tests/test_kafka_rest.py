"""The Kafka REST sink end to end: the worker -> a REST front speaking the Confluent v2/v3
produce contract -> a real 3-node Apache Kafka 4.4 cluster (the `kafka` fixture) -> read back with a real Kafka
consumer. Checked: topic, key = aggregate id, value, headers, every key in one partition and
in order there; per-record failures (partial success) without breaking per-key order; the
variations real proxies show."""

from __future__ import annotations

import base64
import itertools
import json
import time
from collections import Counter, defaultdict

import pytest

from support.peers import KafkaRestFront, wait_for

_topics = itertools.count()


@pytest.fixture
def topic(kafka):
    name = f"orders{next(_topics)}"
    kafka.create_topic(name, partitions=2)
    return name


@pytest.fixture
def front(kafka, topic):
    f = KafkaRestFront(kafka.bootstrap(), {topic})
    yield f
    f.close()



_later = itertools.count()


def emit_many(conn, topic: str, keys: int, per_key: int) -> dict[str, list[dict]]:
    """Emits interleaved events of several keys; returns key -> payloads in order."""
    sent = defaultdict(list)
    for i in range(per_key):
        for k in range(keys):
            payload = {"key": f"k{k}", "i": i}
            conn.execute("SELECT outbox.emit('order', %s, 'order.changed', %s::jsonb, %s::jsonb, %s)",
                         (f"k{k}", json.dumps(payload), json.dumps({"trace": f"t{k}-{i}"}), topic))
            sent[f"k{k}"].append(payload)
    return sent


def check_partitions(records: list[dict], sent: dict[str, list[dict]], decode=json.loads) -> None:
    """Every key in one partition; per key, the first arrival of each event in emit order."""
    partitions = defaultdict(set)
    arrived = defaultdict(list)
    for r in records:
        key = r["key"].decode()
        partitions[key].add(r["partition"])
        value = decode(r["value"])
        if value not in arrived[key]:
            arrived[key].append(value)
    assert all(len(p) == 1 for p in partitions.values()), "a key spans partitions"
    assert dict(arrived) == dict(sent), "lost, phantom or out of order"


@pytest.mark.parametrize("fmt", ["json", "binary"])
def test_v2_delivers_keys_in_order(conn, new_sink, kafka, front, topic, fmt):
    new_sink("kafka_rest_v2", front.url, format=fmt, batch_size=25)
    sent = emit_many(conn, topic, keys=6, per_key=10)
    records = kafka.read(topic, expect=60)
    assert len(records) == 60, "each event once"
    check_partitions(records, sent)
    assert {r["headers"].get("outbox-id") for r in records} == {None}, "v2 carries no headers"


def test_v3_delivers_keys_in_order_with_headers(conn, new_sink, kafka, front, topic):
    new_sink("kafka_rest_v3", front.url, cluster_id=KafkaRestFront.CLUSTER, batch_size=25)
    sent = emit_many(conn, topic, keys=4, per_key=8)
    records = kafka.read(topic, expect=32)
    assert len(records) == 32
    check_partitions(records, sent)
    for r in records:
        value = json.loads(r["value"])
        assert r["headers"]["trace"].decode() == f"t{r['key'].decode()[1:]}-{value['i']}"
        assert r["headers"]["outbox-event-type"] == b"order.changed"
        assert len(r["headers"]["outbox-id"]) == 36


def test_topic_map_renames_topics(conn, new_sink, kafka, topic):
    front = KafkaRestFront(kafka.bootstrap(), {topic})
    try:
        new_sink("kafka_rest_v3", front.url, cluster_id=KafkaRestFront.CLUSTER,
                 topic_map=json.dumps({"internal.orders": topic}))
        sent = emit_many(conn, "internal.orders", keys=2, per_key=3)
        check_partitions(kafka.read(topic, expect=6), sent)
    finally:
        front.close()


@pytest.mark.parametrize("kind,variant", [("kafka_rest_v2", "confluent"), ("kafka_rest_v2", "old"),
                                          ("kafka_rest_v3", "confluent")])
def test_partial_success_retries_only_the_failed_key_from_its_failure_on(
        conn, new_sink, kafka, front, topic, kind, variant):
    failures = {"left": 2}

    def fail(_topic, key, value):
        # the third event of k1 fails, retriably, the first two times it is sent
        if key == b"k1" and json.loads(value)["i"] == 2 and failures["left"] > 0:
            failures["left"] -= 1
            return 50003
        return None
    front.faults.fail, front.faults.variant = fail, variant
    sink = new_sink(kind, front.url, cluster_id=KafkaRestFront.CLUSTER, batch_size=50)
    sent = emit_many(conn, topic, keys=3, per_key=6)
    records = kafka.read(topic, expect=18)
    check_partitions(records, sent)
    per_key = defaultdict(int)
    for r in records:
        per_key[r["key"].decode()] += 1
    # nothing was sent twice: k1's later events waited for the failed one
    assert dict(per_key) == {"k0": 6, "k1": 6, "k2": 6}
    assert failures["left"] == 0, "the failure was injected"
    assert conn.execute("SELECT count(*) FROM outbox.dead_letters WHERE consumer = %s", (sink,)).fetchone()[0] == 0



def test_a_key_whose_events_go_to_two_topics_keeps_its_order_across_them(conn, new_sink, kafka, topic):
    """One batch, one key: e1 and e3 for one topic, e2 for another, which fails (retriably)
    the first two times. e3 goes out only after e2, though a request per topic would carry it
    with e1."""
    other = f"orders{next(_topics)}"
    kafka.create_topic(other, partitions=2)
    front = KafkaRestFront(kafka.bootstrap(), {topic, other})
    accepted, failures = [], {"left": 2}

    def fail(_topic, _key, value):
        i = json.loads(value)["i"]
        if i == 2 and failures["left"] > 0:
            failures["left"] -= 1
            return 50003
        accepted.append(i)
        return None
    front.faults.fail = fail
    try:
        sink = new_sink("kafka_rest_v2", front.url, batch_size=10)
        with conn.transaction():
            for i, t in ((1, topic), (2, other), (3, topic)):
                conn.execute("SELECT outbox.emit('order', 'x', 'e', %s::jsonb, NULL, %s)", (json.dumps({"i": i}), t))
        wait_for(lambda: len(accepted) >= 3, timeout=60)
        assert failures["left"] == 0, "the failure was injected"
        assert accepted == [1, 2, 3], "the key's events went out in order, once each"
        assert conn.execute("SELECT count(*) FROM outbox.dead_letters WHERE consumer = %s", (sink,)).fetchone()[0] == 0
    finally:
        front.close()

@pytest.mark.parametrize("variant", ["confluent", "old"])
def test_a_fatal_record_error_dead_letters_that_event_only(conn, new_sink, kafka, front, topic, variant):
    """A record refused in a request of its own for a reason that may be its content (50002, the
    old 1) is its fault once its topic has taken another record since it was first refused;
    until then it waits, uncounted (a topic whose limit was lowered refuses every record).
    Then it is dead-lettered, and the key's later event goes on."""
    refusals: list = []
    front.faults.fail = lambda _t, key, value: (
        refusals.append(key) or 50002 if json.loads(value).get("poison") else None)
    front.faults.variant = variant
    sink = new_sink("kafka_rest_v2", front.url, max_attempts=1)
    conn.execute("SELECT outbox.emit('order', 'p1', 'e', '{\"n\": 1}', NULL, %s)", (topic,))
    kafka.read(topic, expect=1)                     # taken before the poison's batch began
    with conn.transaction():
        conn.execute("SELECT outbox.emit('order', 'p1', 'e', '{\"poison\": true}', NULL, %s)", (topic,))
        conn.execute("SELECT outbox.emit('order', 'p1', 'e', '{\"n\": 3}', NULL, %s)", (topic,))
    wait_for(lambda: refusals)
    time.sleep(1)
    dead_letters = "SELECT payload FROM outbox.dead_letters WHERE consumer = %s"
    assert conn.execute(dead_letters, (sink,)).fetchall() == [], "nothing else of its topic went through"
    conn.execute("SELECT outbox.emit('order', 'q1', 'e', '{\"q\": 1}', NULL, %s)", (topic,))
    dead = wait_for(lambda: conn.execute(dead_letters, (sink,)).fetchall())
    assert dead == [({"poison": True},)]
    values = [json.loads(r["value"]) for r in kafka.read(topic, expect=3)]
    assert {"n": 1} in values and {"n": 3} in values and {"q": 1} in values
    assert values.index({"n": 1}) < values.index({"n": 3})


@pytest.mark.parametrize("kind", ["kafka_rest_v2", "kafka_rest_v3"])
def test_a_record_over_the_topics_size_limit_takes_no_batch_mate_with_it(conn, new_sink, kafka, topic, kind):
    """A broker refuses a whole record batch for one record over the topic's max.message.bytes,
    and a proxy whose producer does not split it (librdkafka's, as this front's) reports the
    refusal (50002) for every record of it. Counted, its batch-mates of other keys were
    dead-lettered with it (max_attempts 1; the batch's record for another topic went through,
    so the sink was shown healthy). They are now sent again, in halves down to single records,
    before anything is counted: only the oversized record is dead-lettered; the others arrive,
    in order."""
    limited = f"rest-limited{next(_later)}"
    kafka.create_topic(limited, partitions=1, config={"max.message.bytes": "4000"})
    front = KafkaRestFront(kafka.bootstrap(), {topic, limited})
    try:
        sink = new_sink(kind, front.url, cluster_id=KafkaRestFront.CLUSTER, max_attempts=1, batch_size=50)
        shard = conn.execute("SELECT outbox.shard_of('big')").fetchone()[0]
        keys = [k for (k,) in conn.execute(
            "SELECT k FROM (SELECT 'k' || i AS k FROM generate_series(1, 5000) i) s"
            " WHERE outbox.shard_of(k) = %s LIMIT 5", (shard,))]   # one shard: one batch
        other, mates = keys[0], keys[1:]
        emit = "SELECT outbox.emit('order', %s, 'e', %s::jsonb, NULL, %s)"
        with conn.transaction():
            conn.execute(emit, (other, json.dumps({"key": other}), topic))
            for k in mates[:3]:
                conn.execute(emit, (k, json.dumps({"key": k, "i": 0}), limited))
            conn.execute(emit, ("big", json.dumps({"pad": "x" * 10_000}), limited))
            for k in mates:
                conn.execute(emit, (k, json.dumps({"key": k, "i": 1}), limited))
        sent = {k: [{"key": k, "i": i} for i in (range(2) if k in mates[:3] else [1])] for k in mates}
        assert len(kafka.read(topic, expect=1, timeout=60)) == 1
        records = kafka.read(limited, expect=7, timeout=60)
        dead = wait_for(lambda: conn.execute("SELECT aggregate_id FROM outbox.dead_letters WHERE consumer = %s",
                                             (sink,)).fetchall())
        assert dead == [("big",)], "only the oversized record is dead-lettered"
        check_partitions(records, sent)
        assert {key.decode() for t, key, code in front.faults.refused if code == 50002} - {"big"}, \
            "the brokers refused batch-mates with the oversized record (what this test is about)"
    finally:
        front.close()


@pytest.mark.parametrize("kind", ["kafka_rest_v2", "kafka_rest_v3"])
def test_one_topic_refusing_every_record_as_too_large_loses_none_while_the_others_deliver(
        conn, new_sink, kafka, topic, kind):
    """A REST sink sends to two topics; one has its max.message.bytes lowered far too far. The
    other takes its records, so the sink is shown healthy, and each refusal looked like its
    record's: counted, all were dead-lettered (max_attempts 2). The refusals are the topic's
    setting: none is dead-lettered, they wait, and arrive in order once the limit is raised."""
    limited = f"rest-limited{next(_later)}"
    kafka.create_topic(limited, partitions=1, config={"max.message.bytes": "40"})
    front = KafkaRestFront(kafka.bootstrap(), {topic, limited})
    try:
        sink = new_sink(kind, front.url, cluster_id=KafkaRestFront.CLUSTER, max_attempts=2)
        emit = "SELECT outbox.emit('order', %s, 'e', %s::jsonb, NULL, %s)"
        held, flowing = defaultdict(list), defaultdict(list)
        for i in range(3):
            for k in range(3):
                for sent, prefix, to in ((held, "x", limited), (flowing, "y", topic)):
                    payload = {"key": f"{prefix}{k}", "i": i}
                    conn.execute(emit, (f"{prefix}{k}", json.dumps(payload), to))
                    sent[f"{prefix}{k}"].append(payload)
        check_partitions(kafka.read(topic, expect=9, timeout=60), flowing)
        for n in range(15):                             # the other topic goes on taking records
            conn.execute(emit, (f"z{n}", json.dumps({"z": n}), topic))
            time.sleep(0.2)
        kafka.read(topic, expect=24, timeout=60)
        refused = Counter(key.decode() for t, key, _ in front.faults.refused if t == limited)
        assert all(refused[f"x{k}"] >= 2 for k in range(3)), f"each key tried max_attempts times: {refused}"
        row = conn.execute("SELECT undelivered, dead_letters FROM outbox.status WHERE consumer = %s",
                           (sink,)).fetchone()
        assert row == (9, 0), "waiting, none dead-lettered"
        kafka.set_topic_config(limited, "max.message.bytes", "1048588")
        check_partitions(kafka.read(limited, expect=9, timeout=60), held)
        assert conn.execute("SELECT count(*) FROM outbox.dead_letters WHERE consumer = %s",
                            (sink,)).fetchone()[0] == 0
    finally:
        front.close()


@pytest.mark.parametrize("kind,answer", [("kafka_rest_v2", (500, 50001)), ("kafka_rest_v3", (500, 50001)),
                                         ("kafka_rest_v2", (408, 40801))])
def test_a_proxy_failing_whole_requests_to_one_topic_counts_nothing_while_the_others_deliver(
        conn, new_sink, kafka, topic, kind, answer):
    """The proxy answers every request to one topic with a 500 (its producer failing) or a 408
    (a wait on the brokers timed out), with no report of any record, while the other topic's
    requests deliver: a request-level answer of the proxy says nothing of its records. (Each
    was a retry on a sink shown healthy: counted, then dead-lettered at max_attempts.)"""
    failing = f"rest-failing{next(_later)}"
    kafka.create_topic(failing, partitions=1)
    front = KafkaRestFront(kafka.bootstrap(), {topic, failing})
    front.faults.whole = lambda t: answer if t == failing else None
    try:
        sink = new_sink(kind, front.url, cluster_id=KafkaRestFront.CLUSTER, max_attempts=2,
                        backoff_base="100 ms", backoff_max="200 ms")
        emit = "SELECT outbox.emit('order', %s, 'e', %s::jsonb, NULL, %s)"
        held = defaultdict(list)
        for i in range(3):
            for k in range(3):
                payload = {"key": f"x{k}", "i": i}
                conn.execute(emit, (f"x{k}", json.dumps(payload), failing))
                held[f"x{k}"].append(payload)
        for n in range(15):                             # the other topic goes on taking records
            conn.execute(emit, (f"z{n}", json.dumps({"z": n}), topic))
            time.sleep(0.2)
        kafka.read(topic, expect=15, timeout=60)
        row = lambda: conn.execute("SELECT undelivered, dead_letters, coalesce(failed_total, 0) "   # noqa: E731
                                   "FROM outbox.status WHERE consumer = %s", (sink,)).fetchone()
        wait_for(lambda: row()[0] == 9, timeout=10)     # the last batch of the other topic settled
        time.sleep(2.5)                                 # the worker writes its failure counts every 2 s
        assert row() == (9, 0, 0), "waiting, nothing counted"
        front.faults.whole = lambda t: None
        check_partitions(kafka.read(failing, expect=9, timeout=60), held)
        assert conn.execute("SELECT count(*) FROM outbox.dead_letters WHERE consumer = %s",
                            (sink,)).fetchone()[0] == 0
    finally:
        front.close()


def test_an_unknown_topic_suspends_the_sink_dead_letters_nothing_and_resumes_once_made(conn, new_sink, kafka, front):
    sink = new_sink("kafka_rest_v2", front.url, max_attempts=2)
    missing = f"rest-later{next(_later)}"
    conn.execute("SELECT outbox.emit('order', 'u1', 'e', '{\"i\": 1}', NULL, %s)", (missing,))
    state = wait_for(lambda: (row := conn.execute(
        "SELECT sink_state, sink_state_reason, undelivered FROM outbox.status WHERE consumer = %s",
        (sink,)).fetchone()) and row[0] == "suspended" and row)
    assert "404" in state[1] and state[2] == 1, state
    time.sleep(3)                                   # probes fail meanwhile; nothing is blamed
    assert conn.execute("SELECT count(*) FROM outbox.dead_letters WHERE consumer = %s", (sink,)).fetchone()[0] == 0
    kafka.create_topic(missing, partitions=2)
    front.topics.add(missing)                       # the proxy sees the new topic
    (record,) = kafka.read(missing, expect=1, timeout=60)
    assert json.loads(record["value"]) == {"i": 1}
    assert conn.execute("SELECT count(*) FROM outbox.dead_letters WHERE consumer = %s", (sink,)).fetchone()[0] == 0


def test_binary_values_are_the_payload_bytes(conn, new_sink, kafka, front, topic):
    new_sink("kafka_rest_v3", front.url, cluster_id=KafkaRestFront.CLUSTER, format="binary")
    conn.execute("SELECT outbox.emit('order', 'b1', 'e', '{\"x\": [1, \"é\"]}', NULL, %s)", (topic,))
    (record,) = kafka.read(topic, expect=1)
    assert json.loads(record["value"].decode()) == {"x": [1, "é"]}
    assert base64.b64encode(record["key"]) == base64.b64encode(b"b1")


@pytest.mark.parametrize("kind", ["kafka_rest_v2", "kafka_rest_v3"])
def test_a_request_too_large_is_split(conn, new_sink, kafka, front, topic, kind):
    front.faults.max_records = 4
    sink = new_sink(kind, front.url, cluster_id=KafkaRestFront.CLUSTER, batch_size=50)
    sent = emit_many(conn, topic, keys=12, per_key=2)
    records = kafka.read(topic, expect=24)
    assert len(records) == 24
    check_partitions(records, sent)
    assert conn.execute("SELECT count(*) FROM outbox.dead_letters WHERE consumer = %s", (sink,)).fetchone()[0] == 0


@pytest.mark.parametrize("kind,fmt", [("kafka_rest_v2", "json"), ("kafka_rest_v2", "binary"),
                                      ("kafka_rest_v3", "json"), ("kafka_rest_v3", "binary")])
def test_a_null_payload_is_a_tombstone_and_keys_are_their_raw_bytes(conn, new_sink, kafka, front, topic, kind, fmt):
    options = {"cluster_id": KafkaRestFront.CLUSTER} if kind == "kafka_rest_v3" else {}
    new_sink(kind, front.url, format=fmt, **options)
    conn.execute("SELECT outbox.emit('order', 'k\u00e9-1', 'order.deleted', NULL, NULL, %s)", (topic,))
    conn.execute("SELECT outbox.emit('order', 'k\u00e9-1', 'order.created', '{\"a\": 1}', NULL, %s)", (topic,))
    records = kafka.read(topic, expect=2)
    assert [r["key"] for r in records] == ["k\u00e9-1".encode()] * 2, "the aggregate id's bytes, no quotes"
    assert records[0]["value"] is None, "a NULL payload is a Kafka null value"
    assert json.loads(records[1]["value"]) == {"a": 1}


def test_a_derived_topic_that_is_no_kafka_topic_dead_letters_the_event(conn, new_sink, front):
    sink = new_sink("kafka_rest_v2", front.url)
    conn.execute("SELECT outbox.emit('..', 'k1', 'e', '{}')")   # no topic: its aggregate type
    error = wait_for(lambda: conn.execute(
        "SELECT last_error FROM outbox.dead_letters WHERE consumer = %s", (sink,)).fetchone())[0]
    assert "not a valid Kafka topic name" in error
