"""A relay in Python over the plain SQL claim API, as any application would write one.

    while True:
        batch = claim(consumer, batch_size, lease)        -- one shard, commit order
        for each event, in order:
            if its key already failed in this batch: skip it (it waits, parked, in order)
            deliver it; on failure nack(shard, epoch, id, error)
        ack(shard, epoch)                                   -- the shard moves on
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import psycopg
from psycopg.rows import dict_row


@dataclass
class Event:
    shard: int
    epoch: int
    id: object
    aggregate_id: str
    event_type: str
    payload: object
    headers: object
    seq: int
    attempt: int
    topic: str | None = None


class Relay:
    def __init__(self, conn: psycopg.Connection, consumer: str, batch_size: int = 100,
                 lease: str = "30 seconds", owner: str | None = None):
        self.conn, self.consumer, self.batch_size, self.lease, self.owner = conn, consumer, batch_size, lease, owner

    def claim(self) -> list[Event]:
        with self.conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(
                "SELECT shard, epoch, id, aggregate_id, event_type, payload, headers, seq, attempt, topic "
                "FROM outbox.claim(%s, %s, %s::interval, %s)",
                (self.consumer, self.batch_size, self.lease, self.owner)).fetchall()
        return [Event(**r) for r in rows]

    def ack(self, shard: int, epoch: int) -> None:
        self.conn.execute("SELECT outbox.ack(%s, %s, %s)", (self.consumer, shard, epoch))

    def nack(self, event: Event, error: str, retry_after: str | None = None) -> None:
        self.conn.execute("SELECT outbox.nack(%s, %s, %s, %s, %s, %s::interval)",
                          (self.consumer, event.shard, event.epoch, event.id, error, retry_after))

    def release(self, shard: int, epoch: int, retry_after: str = "0") -> None:
        self.conn.execute("SELECT outbox.release(%s, %s, %s, %s::interval)",
                          (self.consumer, shard, epoch, retry_after))

    def step(self, deliver: Callable[[Event], bool], retry_after: str | None = None) -> int:
        """Claim one batch, deliver it in order, nack failures, ack. Returns events claimed."""
        batch = self.claim()
        if not batch:
            return 0
        failed_keys: set[str] = set()
        for event in batch:
            if event.aggregate_id in failed_keys:
                continue
            if not deliver(event):
                failed_keys.add(event.aggregate_id)
                self.nack(event, f"delivery of {event.id} failed", retry_after)
        self.ack(batch[0].shard, batch[0].epoch)
        return len(batch)

    def drain(self, deliver: Callable[[Event], bool] | None = None, max_empty: int = 1) -> list[Event]:
        """Step until claims come back empty max_empty times in a row; returns what was delivered."""
        delivered: list[Event] = []

        def record(event: Event) -> bool:
            ok = deliver(event) if deliver else True
            if ok:
                delivered.append(event)
            return ok

        empty = 0
        while empty < max_empty:
            empty = 0 if self.step(record) else empty + 1
        return delivered
