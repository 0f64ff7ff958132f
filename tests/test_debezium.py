"""The native sink's `format => 'debezium'` against Debezium itself: Debezium 3.6.1's embedded
engine with the outbox event router, configured exactly as the Kafka guide (docs/guides/kafka.md) shows
(support/debezium.py), reads the same events from the WAL and produces them to the same real
Kafka cluster as a Connect worker would; both streams are read back with a real Kafka client
and compared record by record: partition, key bytes, value bytes and headers, each key's
records in order. Where Debezium cannot carry a payload as it is, the Kafka guide lists the
difference, and so does this test."""

from __future__ import annotations

import itertools
import json

import pytest

from support.debezium import guide_slot, run_outbox_router
from support.peers import wait_for

_types = itertools.count()
PARTITIONS = 4
PREFIX = "dbz."   # Debezium's topics, beside the sink's
# What Debezium carries as it is: objects of every JSON kind, escapes, unicode, key order
SAME = [
    {"total": 10, "customer": {"name": "Ana", "tags": ["a", "b"]}},
    {"price": 12.5, "ratio": 0.1, "big": 12345678901234, "neg": -3, "t": True, "f": False},
    {"text": "line\nbreak \"quoted\" back\\slash tab\t ünïcödé 日本 🎉 \u0001 \u001f \u007f /"},
    {},
    {"nested": {"deeper": {"deepest": [1, 2, 3]}, "empty": {}}},
    {"ordered": 1, "a": 2, "bb": 3, "ccc": {"z": 1, "y": 2}},
]
KEYS = ["order-1", "ключ-2", "键3", "🎉4", "with space 5"]
# What it does not: payload (as jsonb text) -> the value Debezium produces, as the Kafka guide says.
# (A top-level array, or an integer beyond 64 bits, stops the connector: not run here.)
DIFFERENT = {
    '{"n": null, "e": [], "k": 1}': b'{"k":1}',                            # null and [] fields dropped
    '{"d": 1.50, "tiny": 1e-30}': b'{"d":1.5,"tiny":1.0E-30}',           # numbers as Java doubles
    '{"mixed": [1, "a"]}': json.dumps('{"mixed": [1, "a"]}').encode(),   # not expanded: a string
    '"just text"': json.dumps('"just text"').encode(),
}


@pytest.fixture
def cdc(conn):
    with guide_slot(conn):
        yield


def emit_every_kind(conn, aggregate_type: str) -> int:
    """SAME's payloads with and without headers, a NULL payload, unicode keys, one by one and
    in bulk; how many events."""
    n = 0
    for i, payload in enumerate(SAME):
        for headers in (None, {"trace-id": f"t{i}", "tenant": "ünï"}):
            conn.execute("SELECT outbox.emit(%s, %s, 'order.changed', %s::jsonb, %s::jsonb)",
                         (aggregate_type, KEYS[i % len(KEYS)], json.dumps(payload),
                          headers and json.dumps(headers)))
            n += 1
    conn.execute("SELECT outbox.emit(%s, %s, 'order.deleted', NULL)", (aggregate_type, KEYS[0]))
    conn.execute("SELECT count(*) FROM outbox.emit_many(%s, 'order.created', %s, %s::jsonb[], %s::jsonb)",
                 (aggregate_type, KEYS, [json.dumps({"bulk": i}) for i in range(len(KEYS))],
                  json.dumps({"source": "bulk"})))
    return n + 1 + len(KEYS)


def per_key(records: list[dict]) -> list[dict]:
    """partition, key, value and headers in order, each key's records in their order (records
    of different keys share a partition in any order)."""
    fields = [{"partition": r["partition"], "key": r["key"], "value": r["value"], "headers": r["header_list"]}
              for r in records]
    return sorted(fields, key=lambda r: r["key"])   # stable: a key's records stay in order


def test_the_sink_and_debezium_produce_the_same_records(cluster, conn, deliver_db, new_sink, kafka, cdc):
    same, different = f"cdc{next(_types)}", f"cdc{next(_types)}"
    for aggregate_type in (same, different):
        for prefix in ("", PREFIX):
            kafka.create_topic(f"{prefix}outbox.event.{aggregate_type}", partitions=PARTITIONS)
    sink = new_sink("kafka", f"kafka://{kafka.bootstrap()}", format="debezium")
    n = emit_every_kind(conn, same)
    for i, payload in enumerate(DIFFERENT):
        conn.execute("SELECT outbox.emit(%s, %s, 'order.changed', %s::jsonb)", (different, f"d{i}", payload))
    run_outbox_router(cluster.port, deliver_db, kafka.bootstrap(), expect=n + len(DIFFERENT), topic_prefix=PREFIX)

    ours = kafka.read(f"outbox.event.{same}", expect=n)
    theirs = kafka.read(f"{PREFIX}outbox.event.{same}", expect=n)
    assert len(ours) == len(theirs) == n
    differences = [(a, b) for a, b in zip(per_key(ours), per_key(theirs)) if a != b]
    assert not differences, "\n".join(f"sink:     {a}\ndebezium: {b}" for a, b in differences)

    ours = {r["key"]: r["value"] for r in kafka.read(f"outbox.event.{different}", expect=len(DIFFERENT))}
    theirs = {r["key"]: r["value"] for r in kafka.read(f"{PREFIX}outbox.event.{different}", expect=len(DIFFERENT))}
    for i, (payload, debezium_value) in enumerate(DIFFERENT.items()):
        key = f"d{i}".encode()
        assert theirs[key] == debezium_value, f"Debezium no longer does what the Kafka guide says of {payload}"
        assert json.loads(ours[key]) == json.loads(payload), "the sink carries the payload as it is"
    wait_for(lambda: conn.execute("SELECT undelivered FROM outbox.status WHERE consumer = %s",
                                  (sink,)).fetchone()[0] == 0)
