"""Every argument of every API function, generated from the catalog: a NULL where a value is
required gets 22004 with a hint, never a constraint, datetime or "does not exist" error, and
never a silently broken object; out-of-range values get 22023 with a hint (docs/reference/README.md: Errors)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parent.parent

EVENT = str(uuid.uuid4())
# A valid call of each API function (the tests NULL one argument at a time); a function missing
# here fails test_every_api_function_is_covered.
VALID = {
    "outbox.emit": {"aggregate_type": "a", "aggregate_id": "1", "event_type": "e", "payload": "{}",
                    "headers": None, "topic": None},
    "outbox.emit_many": {"aggregate_type": "a", "event_type": "e", "aggregate_ids": ["1"],
                         "payloads": ["{}"], "headers": None, "topic": None},
    "outbox.claim": {"consumer": "c", "batch_size": 10, "lease": "30 s", "owner": "me", "shards": 2},
    "outbox.settle": {"consumer": "c", "shard": 0, "epoch": 1, "failures": "[]"},
    "outbox.settle_and_claim": {"consumer": "c", "shard": 0, "epoch": 1, "failures": "[]", "batch_size": 10,
                                "lease": "30 s", "owner": "me", "shards": 2},
    "outbox.ack": {"consumer": "c", "shard": 0, "epoch": 1},
    "outbox.nack": {"consumer": "c", "shard": 0, "epoch": 1, "event_id": EVENT, "error": "x",
                    "retry_after": None},
    "outbox.reject": {"consumer": "c", "shard": 0, "epoch": 1, "event_id": EVENT, "error": "x"},
    "outbox.release": {"consumer": "c", "shard": 0, "epoch": 1, "retry_after": "0"},
    "outbox.release_owner": {"consumer": "c", "owner": "me"},
    "outbox.replay": {"consumer": "c", "aggregate_id": None},
    "outbox.create_consumer": {"name": "new", "from_beginning": False, "max_attempts": 10,
                               "backoff_base": "1 s", "backoff_max": "10 min"},
    "outbox.drop_consumer": {"name": "c"},
    "outbox.create_sink": {"name": "s", "kind": "webhook", "url": "http://127.0.0.1:9/", "topics": None,
                           "aggregate_types": None, "format": None, "batch_size": 100, "concurrency": 8,
                           "connect_timeout": "5 s", "request_timeout": "30 s", "secret": None,
                           "http_headers": None, "tls_ca": None, "topic_map": None, "cluster_id": None,
                           "compression": None, "linger": "5 ms", "sasl_mechanism": None,
                           "sasl_username": None, "max_attempts": 10, "backoff_base": "1 s", "backoff_max": "10 min",
                           "from_beginning": False},
    "outbox.drop_sink": {"name": "c"},
    "outbox.pause_sink": {"name": "c"},
    "outbox.resume_sink": {"name": "c"},
    "outbox.maintain": {},
    "outbox.shard_of": {"aggregate_id": "k"},
    "outbox.shard_count": {},
    "outbox.uuid_v7": {},
    "inbox.claim": {"message_id": EVENT, "consumer": "c"},
    "inbox.uuid_at": {"ts": "2026-01-01"},
    "inbox.uuid_time": {"id": EVENT},
}
# Arguments documented as optional: NULL is a meaning of its own (docs/reference).
NULL_OK = {
    ("outbox.emit", "payload"), ("outbox.emit", "headers"), ("outbox.emit", "topic"),
    ("outbox.emit_many", "headers"), ("outbox.emit_many", "topic"),
    ("outbox.claim", "owner"), ("outbox.settle_and_claim", "owner"), ("outbox.nack", "error"), ("outbox.nack", "retry_after"),
    ("outbox.reject", "error"), ("outbox.replay", "aggregate_id"),
    *{("outbox.create_sink", a) for a in ("topics", "aggregate_types", "format", "secret", "http_headers",
                                          "tls_ca", "topic_map", "cluster_id", "compression",
                                          "sasl_mechanism", "sasl_username")},
    # immutable functions of a value: NULL in, NULL out
    ("outbox.shard_of", "aggregate_id"), ("inbox.uuid_at", "ts"), ("inbox.uuid_time", "id"),
}
OUT_OF_RANGE = [
    ("outbox.emit", {"aggregate_id": ""}), ("outbox.emit", {"event_type": ""}),
    ("outbox.claim", {"batch_size": 0}), ("outbox.claim", {"lease": "178000000 years"}),
    ("outbox.claim", {"lease": "0 s"}), ("outbox.claim", {"shards": 0}), ("outbox.ack", {"shard": 99}),
    ("outbox.settle", {"failures": "{}"}), ("outbox.settle", {"failures": '[{"id": "x"}]'}),
    ("outbox.settle_and_claim", {"failures": "[1]"}), ("outbox.settle_and_claim", {"batch_size": 0}),
    ("outbox.settle_and_claim", {"shards": -1}),
    ("outbox.nack", {"retry_after": "-1 s"}), ("outbox.release", {"retry_after": "100 years"}),
    ("outbox.create_consumer", {"name": "c" * 10000}), ("outbox.create_consumer", {"name": ""}),
    ("outbox.create_consumer", {"max_attempts": 0}), ("outbox.create_consumer", {"backoff_max": "100 years"}),
    ("outbox.create_consumer", {"backoff_base": "0 s"}),
    ("outbox.create_sink", {"batch_size": 0}), ("outbox.create_sink", {"concurrency": 65}),
    ("outbox.create_sink", {"request_timeout": "0 s"}), ("outbox.create_sink", {"connect_timeout": "2 hours"}),
    ("outbox.create_sink", {"topics": []}), ("outbox.create_sink", {"kind": "smtp"}),
    ("outbox.create_sink", {"url": "ftp://x"}), ("outbox.create_sink", {"linger": "-1 s"}),
    ("inbox.claim", {"consumer": ""}),
]


def api_functions(db) -> dict[str, list[tuple[str, str]]]:
    """Every documented function of outbox and inbox, with its arguments and their types."""
    rows = db.execute("""
        SELECT n.nspname || '.' || p.proname, coalesce(p.proargnames, '{}'),
               coalesce(p.proargtypes::regtype[]::text[], '{}')
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname IN ('outbox', 'inbox') AND p.proname !~ '^_'""").fetchall()
    return {name: list(zip(names, types)) for name, names, types in rows}


def call(db, function: str, args: dict, types: dict):
    named = ", ".join(f"{a} => %({a})s::{types[a]}" for a in args)
    with db.transaction(force_rollback=True):   # each call on its own, leaving nothing behind
        return db.execute(f"SELECT * FROM {function}({named})", args).fetchall()


@pytest.fixture
def api(db):
    db.execute("SELECT outbox.create_consumer('c')")
    return api_functions(db)


def test_every_api_function_is_covered(api):
    assert set(api) == set(VALID), "add the new function to VALID (and NULL_OK, OUT_OF_RANGE)"
    for function, args in api.items():
        assert [a for a, _ in args] == list(VALID[function]), function


def test_a_null_where_a_value_is_required_is_22004_with_a_hint(db, api):
    checked = 0
    for function, args in api.items():
        types = dict(args)
        for arg, _ in args:
            values = {**VALID[function], arg: None}
            if (function, arg) in NULL_OK:
                try:
                    call(db, function, values, types)
                except psycopg.Error as e:
                    assert e.sqlstate[:2] not in ("23", "22"), f"{function}({arg} => NULL): {e.sqlstate} {e}"
                continue
            with pytest.raises(psycopg.errors.NullValueNotAllowed) as e:
                call(db, function, values, types)
            assert e.value.diag.message_hint, f"{function}({arg} => NULL) has no hint"
            for page in re.findall(r"docs/reference/.*?\.md", e.value.diag.message_hint):
                assert (ROOT / page).exists(), f"{function}({arg} => NULL): the hint names {page}, which is missing"
            assert arg in e.value.diag.message_primary, f"{function}({arg} => NULL) does not name it"
            checked += 1
    assert checked >= 40
    # nothing was made half-way: no consumer without cursors, no sink without its checks
    assert db.execute("SELECT count(*) FROM outbox.consumers").fetchone()[0] == 1
    assert db.execute("SELECT count(*) FROM outbox.sinks").fetchone()[0] == 0


@pytest.mark.parametrize("function,bad", OUT_OF_RANGE, ids=[f"{f}-{next(iter(b))}" for f, b in OUT_OF_RANGE])
def test_an_out_of_range_value_is_22023_with_a_hint(db, api, function, bad):
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        call(db, function, {**VALID[function], **bad}, dict(api[function]))
    assert e.value.diag.message_hint
