"""A relay in Python over the plain SQL claim API, as any application would write one.

    while True:
        batch = claim(consumer, batch_size, lease)        -- one shard, commit order
        for each event, in order:
            if its key already failed in this batch: skip it (not sent ahead of the failure)
            deliver it; on failure note {"id", "error"}
        settle(shard, epoch, failures)                      -- the shard moves on; a failed
                                                            -- key's later events wait behind it
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb


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


def first_deliveries(deliveries: Iterable[tuple[object, str]]) -> dict[str, list]:
    """deliveries: (event id, key) in delivery order. Per key, the ids of its events in the
    order each first came, redeliveries left out: per-key order is a property of first
    deliveries (an event whose lease ran out may come again after later ones)."""
    seen, first = set(), defaultdict(list)
    for event_id, key in deliveries:
        if event_id not in seen:
            seen.add(event_id)
            first[key].append(event_id)
    return dict(first)


class Relay:
    def __init__(self, conn: psycopg.Connection, consumer: str, batch_size: int = 100,
                 lease: str = "30 seconds", owner: str | None = None, shards: int = 1):
        self.conn, self.consumer, self.batch_size, self.lease, self.owner = conn, consumer, batch_size, lease, owner
        self.shards = shards   # more than 1: claims take that many shards' batches at most

    def claim(self) -> list[Event]:
        """The next batch; with shards > 1, the batches of several shards, one after the other
        (split them with `batches`)."""
        shards = ", shards => %s" if self.shards != 1 else ""   # as any version takes it
        with self.conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(
                "SELECT shard, epoch, id, aggregate_id, event_type, payload, headers, seq, attempt, topic "
                f"FROM outbox.claim(%s, %s, %s::interval, %s{shards})",
                (self.consumer, self.batch_size, self.lease, self.owner)
                + ((self.shards,) if shards else ())).fetchall()
        return [Event(**r) for r in rows]

    @staticmethod
    def batches(events: list[Event]) -> list[list[Event]]:
        """A claim's rows as its batches, one per (shard, epoch), in the order they came."""
        split: list[list[Event]] = []
        for e in events:
            if not split or (split[-1][0].shard, split[-1][0].epoch) != (e.shard, e.epoch):
                split.append([])
            split[-1].append(e)
        return split

    def settle(self, shard: int, epoch: int, failures: list[dict] | None = None) -> int:
        """Settles the batch; failures: {"id", "error", "retry_after", "final"}. Returns how many
        events were kept back."""
        return self.conn.execute("SELECT outbox.settle(%s, %s, %s, %s)",
                                 (self.consumer, shard, epoch, Jsonb(failures or []))).fetchone()[0]

    def settle_and_claim(self, shard: int, epoch: int, failures: list[dict] | None = None) -> list[Event]:
        """Settles the batch and claims the next one, in one call."""
        with self.conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(
                "SELECT shard, epoch, id, aggregate_id, event_type, payload, headers, seq, attempt, topic "
                "FROM outbox.settle_and_claim(%s, %s, %s, %s, %s, %s::interval, %s)",
                (self.consumer, shard, epoch, Jsonb(failures or []), self.batch_size, self.lease,
                 self.owner)).fetchall()
        return [Event(**r) for r in rows]

    @staticmethod
    def failure(event: Event, error: str, retry_after: str | None = None, final: bool = False) -> dict:
        return {"id": str(event.id), "error": error, "retry_after": retry_after, "final": final}

    def ack(self, shard: int, epoch: int) -> None:
        self.conn.execute("SELECT outbox.ack(%s, %s, %s)", (self.consumer, shard, epoch))

    def nack(self, event: Event, error: str, retry_after: str | None = None) -> None:
        self.conn.execute("SELECT outbox.nack(%s, %s, %s, %s, %s, %s::interval)",
                          (self.consumer, event.shard, event.epoch, event.id, error, retry_after))

    def release(self, shard: int, epoch: int, retry_after: str = "0") -> None:
        self.conn.execute("SELECT outbox.release(%s, %s, %s, %s::interval)",
                          (self.consumer, shard, epoch, retry_after))

    def step(self, deliver: Callable[[Event], bool], retry_after: str | None = None) -> int:
        """Claim one batch (or, with shards > 1, several), deliver each in order, settle each.
        Returns events claimed."""
        claimed = self.claim()
        for batch in self.batches(claimed):
            failures, failed_keys = [], set()
            for event in batch:
                if event.aggregate_id in failed_keys:
                    continue   # never sent ahead of its key's failed event; settle keeps it back
                if not deliver(event):
                    failed_keys.add(event.aggregate_id)
                    failures.append(self.failure(event, f"delivery of {event.id} failed", retry_after))
            self.settle(batch[0].shard, batch[0].epoch, failures)
        return len(claimed)

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
