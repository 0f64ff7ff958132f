"""Emitting events as an application does, for the tests: emit (one key), emit_keys (several
keys in rounds of one transaction each)."""

from __future__ import annotations

import json
from collections import defaultdict


def emit(conn, key: str, n: int = 1, topic: str | None = None, payload: dict | None = None) -> list[str]:
    return [conn.execute("SELECT outbox.emit('order', %s, 'order.changed', %s::jsonb, NULL, %s)::text",
                         (key, json.dumps(payload or {"i": i}), topic)).fetchone()[0] for i in range(n)]


def emit_keys(conn, keys: int, per_key: int, prefix: str = "k") -> dict[str, list[str]]:
    """per_key rounds of one transaction each, one event per key; returns key -> ids in order."""
    emitted = defaultdict(list)
    for i in range(per_key):
        with conn.transaction():
            for k in range(keys):
                key = f"{prefix}{k}"
                emitted[key].append(conn.execute(
                    "SELECT outbox.emit('order', %s, 'e', jsonb_build_object('i', %s::int))::text",
                    (key, i)).fetchone()[0])
    return emitted
