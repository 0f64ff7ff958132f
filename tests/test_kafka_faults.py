"""The native Kafka sink against a real 3-broker Apache Kafka 4.4 cluster (support/kafka_cluster.py:
KRaft, replication factor 3, min.insync.replicas 2, no topic made on use), read back with a
real Kafka client (confluent-kafka). Every everyday fault of a cluster is the sink's, never the
events': a wrong SCRAM password, a CA that does not match, a topic not made yet or denied by an
ACL, two brokers of three down, the whole cluster down or stalled. Each suspends the sink,
dead-letters nothing, and once fixed (an UPDATE of the sink row, the topic made, the ACL
dropped, the brokers back) every event arrives, each key in emit order. A leader killed
mid-stream, a rolling restart of all three, two brokers down and the whole cluster down, the
worker terminated during each, lose nothing and reorder no key, with no more duplicates than
the batches in flight (twice that where the worker is terminated: its batches out, then its
successor's first)."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections import defaultdict

import pytest

from conftest import MAJORS
from support.peers import certificates, wait_for

_topics = itertools.count()
PARTITIONS = 3
FAST = {"request_timeout": "3 s", "max_attempts": 2, "backoff_base": "100 ms", "backoff_max": "200 ms"}


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
    cur = conn.execute("SELECT undelivered, dead_letters, sink_state, sink_state_reason, sink_state_since "
                       "FROM outbox.status WHERE consumer = %s", (sink,))
    return dict(zip([c.name for c in cur.description], cur.fetchone()))


def suspended(conn, sink: str, timeout: float = 30, since=None) -> dict:
    """Waits for the sink to be shown suspended (by a suspension that began after `since`)."""
    return wait_for(lambda: (s := status(conn, sink))["sink_state"] == "suspended"
                    and (since is None or s["sink_state_since"] > since) and s, timeout=timeout)


def delivered_all(conn, sink: str, timeout: float) -> None:
    """Waits until the sink has nothing left to deliver; if it never comes, says what holds
    its shards (leases and parked keys) in the assertion."""
    try:
        wait_for(lambda: status(conn, sink)["undelivered"] == 0, timeout=timeout)
    except AssertionError:
        held = conn.execute(
            "SELECT DISTINCT ON (l.shard) l.shard, l.epoch, l.owner, l.lease_until - now(), l.at "
            "FROM outbox._cursor_log l JOIN outbox.consumers c ON c.id = l.consumer_id "
            "WHERE c.name = %s ORDER BY l.shard, l.pos DESC", (sink,)).fetchall()
        parked = conn.execute(
            "SELECT p.* FROM outbox._parked p JOIN outbox.consumers c ON c.id = p.consumer_id "
            "WHERE c.name = %s", (sink,)).fetchall()
        raise AssertionError(f"undelivered: {status(conn, sink)}\nshards: {held}\nparked: {parked}")


def seconds_to_deliver_all(conn, sink: str, since: float) -> float:
    """How long after `since` (a time.monotonic()) the sink had nothing left to deliver."""
    wait_for(lambda: status(conn, sink)["undelivered"] == 0, timeout=60, every=0.02)
    return time.monotonic() - since


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
    took = seconds_to_deliver_all(conn, sink, since=time.monotonic())
    arrived, _ = first_arrivals(kafka.read(topic, expect=30, timeout=30))
    assert arrived == sent
    assert took < 2, f"delivered {took:.1f} s after the fix"
    assert status(conn, sink)["dead_letters"] == 0


def test_a_ca_that_does_not_match_suspends_the_sink_until_the_row_is_fixed(conn, new_sink, kafka, topic, tmp_path):
    other_ca = certificates(tmp_path)["other_ca"].read_text()
    sink = kafka_sink(new_sink, kafka, "SASL_SSL", tls_ca=other_ca)
    sent = emit_keys(conn, topic, keys=5, per_key=4)
    suspended(conn, sink)
    time.sleep(3)
    assert status(conn, sink)["dead_letters"] == 0
    conn.execute("UPDATE outbox.sinks SET tls_ca = %s WHERE name = %s", (kafka.ca_pem.read_text(), sink))
    took = seconds_to_deliver_all(conn, sink, since=time.monotonic())
    arrived, _ = first_arrivals(kafka.read(topic, expect=20, timeout=30))
    assert arrived == sent and status(conn, sink)["dead_letters"] == 0
    assert took < 2, f"delivered {took:.1f} s after the fix"


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
    took = seconds_to_deliver_all(conn, sink, since=time.monotonic())
    arrived, _ = first_arrivals(kafka.read(missing, expect=20, timeout=60))
    assert arrived == sent and status(conn, sink)["dead_letters"] == 0
    assert took < 3, f"delivered {took:.1f} s after the topic was made"   # the next probe: 2 s away at most


def test_a_topic_the_acls_deny_suspends_the_sink_until_they_allow_it(conn, new_sink, kafka, topic):
    acl = kafka.deny_write(topic)
    try:
        sink = kafka_sink(new_sink, kafka, "SASL_PLAINTEXT")
        sent = emit_keys(conn, topic, keys=5, per_key=4)
        state = suspended(conn, sink, timeout=60)
        assert "authoriz" in state["sink_state_reason"].lower(), state
        time.sleep(3)
        assert status(conn, sink)["dead_letters"] == 0 and status(conn, sink)["undelivered"] == 20
    finally:
        kafka.allow(acl)
    took = seconds_to_deliver_all(conn, sink, since=time.monotonic())
    arrived, _ = first_arrivals(kafka.read(topic, expect=20, timeout=60))
    assert arrived == sent and status(conn, sink)["dead_letters"] == 0
    assert took < 3, f"delivered {took:.1f} s after the ACL was dropped"   # the next probe: 2 s away at most


def test_a_topic_the_acls_deny_holds_only_its_keys_while_the_others_deliver(conn, new_sink, kafka, topic):
    """A sink sends to two topics and the ACLs deny one: the other's records arrive, the denied
    topic's wait (none dead-lettered) and arrive in order once the ACL is dropped."""
    denied = f"denied{next(_topics)}"
    kafka.create_topic(denied, partitions=PARTITIONS)
    acl = kafka.deny_write(denied)
    try:
        sink = kafka_sink(new_sink, kafka, "SASL_PLAINTEXT")
        held = emit_keys(conn, denied, keys=3, per_key=3, prefix="x")
        flowing = emit_keys(conn, topic, keys=3, per_key=3, prefix="y")
        arrived, _ = first_arrivals(kafka.read(topic, expect=9, timeout=30))
        assert arrived == flowing
        more = emit_keys(conn, topic, keys=3, per_key=2, prefix="z")
        arrived, _ = first_arrivals(kafka.read(topic, expect=15, timeout=30))
        assert {k: v for k, v in arrived.items() if k.startswith("z")} == more, "and it goes on delivering"
        time.sleep(3)
        assert (status(conn, sink)["dead_letters"], status(conn, sink)["undelivered"]) == (0, 9)
    finally:
        kafka.allow(acl)
    delivered_all(conn, sink, timeout=30)
    arrived, _ = first_arrivals(kafka.read(denied, expect=9, timeout=60))
    assert arrived == held and status(conn, sink)["dead_letters"] == 0


def test_a_topic_size_limit_lowered_by_mistake_suspends_the_sink_until_raised(conn, new_sink, kafka):
    """A topic's max.message.bytes set far too low refuses every record as too large: the
    brokers say it is about the records, but as no record goes through it is the sink's
    fault. (Each was dead-lettered at once, a refusal for size taken as beyond doubt.)"""
    topic = f"limited{next(_topics)}"
    kafka.create_topic(topic, partitions=PARTITIONS, config={"max.message.bytes": "40"})
    sink = kafka_sink(new_sink, kafka)
    sent = emit_keys(conn, topic, keys=5, per_key=4)
    suspended(conn, sink, timeout=60)
    # the probes' refusals name the cause (the first batch's may be what the refusal cost its
    # neighbours: records purged with the producer it ended)
    wait_for(lambda: "large" in (status(conn, sink)["sink_state_reason"] or "").lower(), timeout=10)
    time.sleep(3)
    assert (status(conn, sink)["dead_letters"], status(conn, sink)["undelivered"]) == (0, 20)
    kafka.set_topic_config(topic, "max.message.bytes", "1048588")
    took = seconds_to_deliver_all(conn, sink, since=time.monotonic())
    arrived, _ = first_arrivals(kafka.read(topic, expect=20, timeout=60))
    assert arrived == sent and status(conn, sink)["dead_letters"] == 0
    assert took < 5, f"delivered {took:.1f} s after the limit was raised"


def test_one_topic_refusing_every_record_as_too_large_loses_none_while_the_others_deliver(conn, new_sink,
                                                                                          kafka, topic):
    """A sink sends to two topics; one of them has its max.message.bytes lowered far too far.
    The other topic takes its records, so the sink is healthy, but the refusals are the topic's
    setting, not the records': none is dead-lettered, they wait, and arrive in order once the
    limit is raised. (The other topic's deliveries made each refusal look like the record's.)"""
    limited = f"limited{next(_topics)}"
    kafka.create_topic(limited, partitions=PARTITIONS, config={"max.message.bytes": "40"})
    sink = kafka_sink(new_sink, kafka)
    held = emit_keys(conn, limited, keys=3, per_key=3, prefix="x")
    flowing = emit_keys(conn, topic, keys=3, per_key=3, prefix="y")
    arrived, _ = first_arrivals(kafka.read(topic, expect=9, timeout=30))
    assert arrived == flowing
    time.sleep(3)
    assert (status(conn, sink)["dead_letters"], status(conn, sink)["undelivered"]) == (0, 9)
    kafka.set_topic_config(limited, "max.message.bytes", "1048588")
    delivered_all(conn, sink, timeout=30)
    arrived, _ = first_arrivals(kafka.read(limited, expect=9, timeout=60))
    assert arrived == held and status(conn, sink)["dead_letters"] == 0


def test_two_brokers_of_three_down_the_sink_waits_and_resumes(conn, cluster, deliver_db, new_sink, kafka, topic):
    """The worker is terminated while the sink waits: its successor waits too."""
    sink = kafka_sink(new_sink, kafka)
    before = emit_keys(conn, topic, keys=5, per_key=2, prefix="a")
    kafka.read(topic, expect=10)
    kafka.stop(2)
    kafka.stop(3)                                   # NOT_ENOUGH_REPLICAS for acks=all
    try:
        during = emit_keys(conn, topic, keys=5, per_key=3, prefix="b")
        suspended(conn, sink, timeout=60)
        terminated_at = conn.execute("SELECT now()").fetchone()[0]
        cluster.restart_worker(deliver_db)
        suspended(conn, sink, timeout=60, since=terminated_at)   # the successor's own judgement
        time.sleep(3)
        assert status(conn, sink)["dead_letters"] == 0
    finally:
        kafka.start(2, 3)
    delivered_all(conn, sink, timeout=90)   # resumed
    arrived, _ = first_arrivals(kafka.read(topic, expect=25, timeout=60))
    assert arrived == {**before, **during}
    assert status(conn, sink)["dead_letters"] == 0


@contextlib.contextmanager
def streaming(cluster, deliver_db, topic: str, keys: int = 10):
    """Emits, from a thread, one event of each of `keys` keys per transaction, about 100
    transactions a second, until the block ends; yields key -> values emitted so far."""
    sent: dict[str, list[int]] = defaultdict(list)
    stop = threading.Event()

    def stream():
        with cluster.connect(deliver_db) as c:
            for i in itertools.count():
                if stop.is_set():
                    return
                with c.transaction():
                    for k in range(keys):
                        c.execute("SELECT outbox.emit('order', %s, 'e', %s::jsonb, NULL, %s)",
                                  (f"s{k}", json.dumps({"i": i}), topic))
                        sent[f"s{k}"].append(i)
                time.sleep(0.01)
    emitter = threading.Thread(target=stream)
    emitter.start()
    try:
        yield sent
    finally:
        stop.set()
        emitter.join()


def all_arrive_in_order(conn, kafka, sink: str, topic: str, sent: dict, max_duplicates: int) -> None:
    """Every event emitted arrives, each key in emit order, with no more duplicates than the
    batches that can be in flight at a fault; nothing is dead-lettered."""
    total = sum(len(v) for v in sent.values())
    delivered_all(conn, sink, timeout=120)
    arrived, duplicates = first_arrivals(kafka.read(topic, expect=total, timeout=60))
    assert arrived == dict(sent), "nothing lost, each key in emit order"
    assert duplicates <= max_duplicates, f"{duplicates} duplicates, more than the {max_duplicates} in flight"
    assert status(conn, sink)["dead_letters"] == 0


def on_oldest_and_newest_major(cluster) -> None:
    """The cluster's long faults do not depend on the PostgreSQL major: they run on the oldest
    and the newest tested (15 and 18), not on each, to keep CI within its time."""
    if cluster.major not in (min(MAJORS, key=int), max(MAJORS, key=int)):
        pytest.skip("a long Kafka fault: run on the oldest and newest majors only")


def test_the_leader_killed_mid_stream_loses_nothing_and_reorders_no_key(conn, cluster, deliver_db, new_sink,
                                                                         kafka, topic):
    """The worker is terminated while the leader is down, batches in flight."""
    sink = kafka_sink(new_sink, kafka, batch_size=50, concurrency=4)
    with streaming(cluster, deliver_db, topic) as sent:
        time.sleep(2)
        leader = kafka.leader(topic, 0)
        kafka.kill(leader)
        time.sleep(1)
        cluster.restart_worker(deliver_db)
        time.sleep(2)
        kafka.start(leader)
        time.sleep(2)
    all_arrive_in_order(conn, kafka, sink, topic, sent, max_duplicates=2 * 4 * 50)


def test_a_rolling_restart_with_the_worker_terminated_midway_loses_nothing(conn, cluster, deliver_db, new_sink,
                                                                       kafka, topic):
    """Each node stopped (a controlled shutdown) and started again in turn, as an upgrade
    does, while events stream; the worker is terminated while the second node is down."""
    on_oldest_and_newest_major(cluster)
    sink = kafka_sink(new_sink, kafka, batch_size=50, concurrency=4)
    with streaming(cluster, deliver_db, topic) as sent:
        for node in kafka.nodes:
            time.sleep(1)
            kafka.wait_in_sync(topic)
            kafka.stop(node)
            if node == 2:
                cluster.restart_worker(deliver_db)
            time.sleep(1)
            kafka.start(node)
        time.sleep(1)
    all_arrive_in_order(conn, kafka, sink, topic, sent, max_duplicates=2 * 4 * 50)


def test_the_whole_cluster_down_for_a_minute_suspends_the_sink_and_loses_nothing(conn, cluster, deliver_db,
                                                                                 new_sink, kafka, topic):
    """Every node SIGKILLed; a minute later they start on their logs. Meanwhile the worker is
    terminated too. The sink is suspended, nothing is counted against the events, and once the
    cluster is back it delivers every event, each key in order."""
    on_oldest_and_newest_major(cluster)
    sink = kafka_sink(new_sink, kafka, batch_size=50, concurrency=4)
    with streaming(cluster, deliver_db, topic) as sent:
        time.sleep(2)
        for node in kafka.nodes:
            kafka.kill(node)
        try:
            suspended(conn, sink, timeout=60)
            cluster.restart_worker(deliver_db)
            time.sleep(60 - 5)
            assert status(conn, sink)["dead_letters"] == 0
        finally:
            kafka.start(*kafka.nodes, timeout=120)
        back = time.monotonic()
        wait_for(lambda: status(conn, sink)["sink_state"] == "healthy", timeout=60)
        took = time.monotonic() - back
        time.sleep(1)
    assert took < 10, f"delivering again {took:.1f} s after the cluster was back"
    all_arrive_in_order(conn, kafka, sink, topic, sent, max_duplicates=2 * 4 * 50)


def test_a_cluster_stalled_past_the_request_timeout_keeps_each_key_in_order(conn, cluster, deliver_db, new_sink,
                                                                            kafka, topic):
    """SIGSTOP holds every request in flight past the sink's request timeout: the batches go
    back unsent and are claimed again once the cluster answers, so copies may arrive twice,
    never ahead of an earlier event."""
    on_oldest_and_newest_major(cluster)
    sink = kafka_sink(new_sink, kafka, batch_size=50, concurrency=4)
    with streaming(cluster, deliver_db, topic) as sent:
        time.sleep(2)
        kafka.pause(*kafka.nodes)
        try:
            suspended(conn, sink, timeout=30)
            time.sleep(2)
        finally:
            kafka.resume(*kafka.nodes)
        kafka.wait_ready()
        time.sleep(2)
    all_arrive_in_order(conn, kafka, sink, topic, sent, max_duplicates=4 * 50)


def test_a_partition_away_for_long_gets_each_record_once_while_the_others_deliver(conn, cluster, deliver_db,
                                                                                   new_sink, kafka, topic):
    """A partition without a leader (the node of its only replica stopped) while the rest of
    the cluster takes records: its key goes back unsent at every request timeout and is tried
    again, its records still queued in the client. A retry waits for the queued record instead
    of queueing a copy: once the partition is back each record arrives once, not once per
    retry, and the client's queue does not fill with copies (which would stop every partition).
    A key of the partition and a key that delivers share a shard, so that every batch of it
    delivers something (a batch with nothing through replaces the producer, dropping what it
    holds)."""
    on_oldest_and_newest_major(cluster)
    away = f"away{next(_topics)}"
    kafka.create_topic(away, partitions=1, rf=1)
    node = kafka.leader(away, 0)
    shard = conn.execute("SELECT outbox.shard_of('away')").fetchone()[0]
    flowing = next(k for k in (f"flow{i}" for i in range(1000))
                   if conn.execute("SELECT outbox.shard_of(%s)", (k,)).fetchone()[0] == shard)
    sink = kafka_sink(new_sink, kafka, batch_size=50, concurrency=4)
    sent: dict[str, list[int]] = {"away": [], flowing: []}

    def emit(key: str, i: int, to: str):
        conn.execute("SELECT outbox.emit('order', %s, 'e', %s::jsonb, NULL, %s)", (key, json.dumps({"i": i}), to))
        sent[key].append(i)
    kafka.stop(node)
    try:
        with conn.transaction():
            for i in range(3):
                emit("away", i, away)
            emit(flowing, 0, topic)
        end = time.monotonic() + 13          # four request timeouts and more
        for i in itertools.count(1):
            if time.monotonic() > end:
                break
            emit(flowing, i, topic)
            time.sleep(0.05)
        assert status(conn, sink)["undelivered"] >= 3, "the partition's records waited"
    finally:
        kafka.start(node)
    kafka.wait_ready()
    wait_for(lambda: status(conn, sink)["undelivered"] == 0, timeout=120)
    away_arrived, away_duplicates = first_arrivals(kafka.read(away, expect=3, timeout=60))
    assert away_arrived == {"away": [0, 1, 2]}, "nothing lost, in emit order"
    assert away_duplicates == 0, f"{away_duplicates} copies of the partition's records arrived"
    flowing_arrived, _ = first_arrivals([r for r in kafka.read(topic, expect=len(sent[flowing]), timeout=60)])
    assert flowing_arrived == {flowing: sent[flowing]}
    assert status(conn, sink)["dead_letters"] == 0
