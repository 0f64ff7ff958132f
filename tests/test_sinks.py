"""Sink configuration in SQL: checked with clear errors, admin-only (it holds secrets), visible
to relays only through outbox.status."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest

GOOD = {"name": "hook", "kind": "webhook", "url": "https://hooks.example.com/outbox"}


def create(conn, **options):
    args = ", ".join(f"{k} => %({k})s" for k in options)
    conn.execute(f"SELECT outbox.create_sink({args})", options)


@pytest.mark.parametrize("bad,hint_has", [
    ({"kind": "smtp"}, "webhook, kafka, kafka_rest_v2 or kafka_rest_v3"),
    ({"url": "ftp://example.com"}, "http://"),
    ({"url": "http:/nohost"}, "http://"),
    ({"format": "avro"}, "batch, single"),
    ({"kind": "kafka_rest_v2", "format": "single"}, "json, binary"),
    ({"kind": "kafka_rest_v3"}, "cluster_id"),
    ({"batch_size": 0}, "batch_size is 1 to 10000"),
    ({"concurrency": 65}, "concurrency is 1 to 64"),
    ({"request_timeout": "0 s"}, "request_timeout"),
    ({"secret": "hunter2"}, "whsec_"),
    ({"http_headers": '{"X-N": 1}'}, "Authorization"),
    ({"tls_ca": "not a certificate"}, "PEM"),
    ({"kind": "kafka", "url": "https://broker:9092"}, "kafka://host:port"),
    ({"kind": "kafka", "url": "kafka://broker"}, "kafka://host:port"),
    ({"kind": "kafka", "url": "kafka://a:9092,,b:9092"}, "kafka://host:port"),
    ({"kind": "kafka", "url": "kafka://a:9092", "format": "json"}, "outbox, debezium"),
    ({"kind": "kafka", "url": "kafka://a:9092", "compression": "brotli"}, "lz4 or zstd"),
    ({"kind": "kafka", "url": "kafka://a:9092", "linger": "2 minutes"}, "0 to 1 minute"),
    ({"kind": "kafka", "url": "kafka://a:9092", "sasl_mechanism": "GSSAPI", "sasl_username": "u",
      "secret": "p"}, "SCRAM-SHA-512"),
    ({"kind": "kafka", "url": "kafka://a:9092", "sasl_mechanism": "PLAIN"}, "all three"),
    ({"kind": "kafka", "url": "kafka://a:9092", "secret": "p"}, "all three"),
    ({"kind": "kafka", "url": "kafka://a:9092", "http_headers": '{"X-A": "b"}'}, "leave them NULL"),
    ({"compression": "lz4"}, "NULL for a webhook sink"),
    # settings the kind would ignore: refused, not taken silently
    ({"cluster_id": "c1"}, "leave cluster_id and topic_map NULL"),
    ({"topic_map": '{"orders": "kafka.orders"}'}, "topics or aggregate_types"),
    ({"kind": "kafka_rest_v3", "cluster_id": "c1", "secret": "whsec_" + "A" * 32}, "http_headers"),
])
def test_bad_sinks_are_refused_with_a_hint(db, bad, hint_has):
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        create(db, **{**GOOD, **bad})
    assert hint_has in (e.value.diag.message_hint or "")
    assert db.execute("SELECT count(*) FROM outbox.consumers").fetchone()[0] == 0, "nothing half-made"


def test_urls_are_checked_alike_with_standard_conforming_strings_off(db):
    """A session of an older application may run with standard_conforming_strings off, where
    '\\s' in a pattern reads as 's': a URL with an s in its path was refused, one with a
    line break taken, and every first call warned of a nonstandard escape."""
    notices = []
    db.add_notice_handler(lambda d: notices.append(d.message_primary))
    db.execute("SET standard_conforming_strings = off")
    create(db, **{**GOOD, "url": "https://hooks.example.com/services/hooks"})
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        create(db, **{**GOOD, "name": "split", "url": "https://hooks.example.com/a\nb"})
    with pytest.raises(psycopg.errors.NullValueNotAllowed) as e:
        db.execute("SELECT outbox.create_consumer(NULL)")
    assert "docs/reference/outbox.create_consumer.md" in e.value.diag.message_hint
    assert not [n for n in notices if "escape" in n], notices


def test_a_kafka_sink_takes_brokers_sasl_and_producer_settings(db):
    create(db, name="stream", kind="kafka", url="kafkas://b1.example:9093,b2.example:9093",
           compression="zstd", linger="20 ms", sasl_mechanism="SCRAM-SHA-256", sasl_username="svc",
           secret="s3cret", tls_ca=None)
    row = db.execute("SELECT format, compression, linger, sasl_mechanism, sasl_username, secret "
                     "FROM outbox.sinks").fetchone()
    assert row == ("outbox", "zstd", timedelta(milliseconds=20),
                   "SCRAM-SHA-256", "svc", "s3cret")


def test_defaults_and_drop(db):
    create(db, **GOOD)
    row = db.execute("SELECT format, batch_size, concurrency, enabled FROM outbox.sinks").fetchone()
    assert row == ("batch", 100, 8, True)
    with pytest.raises(psycopg.errors.DuplicateObject):
        create(db, **GOOD)
    assert db.execute("SELECT outbox.drop_sink('hook')").fetchone()[0] is True
    assert db.execute("SELECT count(*) FROM outbox.sinks").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM outbox.consumers").fetchone()[0] == 0
    assert db.execute("SELECT outbox.drop_sink('hook')").fetchone()[0] is False
    # a relay's consumer, no sink: refused, not dropped with its cursors and dead letters
    db.execute("SELECT outbox.create_consumer('relay')")
    with pytest.raises(psycopg.errors.WrongObjectType):
        db.execute("SELECT outbox.drop_sink('relay')")
    assert db.execute("SELECT count(*) FROM outbox.consumers").fetchone()[0] == 1


def test_an_update_is_checked_too(db):
    create(db, **GOOD)
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        db.execute("UPDATE outbox.sinks SET url = 'nope'")


def test_only_admins_see_or_change_sinks(db, connect):
    admin = connect("admin_user")
    create(admin, **GOOD, secret="whsec_" + "B" * 32)
    assert admin.execute("SELECT secret FROM outbox.sinks").fetchone()[0].startswith("whsec_")
    for user in ("relay_user", "producer_user", "nobody_user"):
        conn = connect(user)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM outbox.sinks")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            create(conn, **{**GOOD, "name": f"x_{user}"})
    relay = connect("relay_user")
    status = relay.execute("SELECT * FROM outbox.status WHERE consumer = 'hook'")
    columns = [d.name for d in status.description]
    assert status.fetchone() is not None
    assert not any("secret" in c or "url" in c or "header" in c for c in columns)
