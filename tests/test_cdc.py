"""Reading the event log through logical replication (pgoutput), as Debezium does.

A publication on outbox.events with publish_via_partition_root publishes every event as an
insert into the root table, whatever partition holds it. The tests decode pgoutput's binary
protocol themselves (pg_logical_slot_get_binary_changes), so they see exactly what a
replication client such as Debezium receives.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import pytest

from support.peers import wait_for

PUBLICATION = "outbox_cdc"
SLOT = "outbox_cdc_slot"


@dataclass
class Txn:
    xid: int
    inserts: list[dict[str, str | None]] = field(default_factory=list)
    committed: bool = False


class PgOutput:
    """Decodes pgoutput protocol version 1 messages (one per row of get_binary_changes)."""

    def __init__(self):
        self.relations: dict[int, tuple[str, list[str]]] = {}
        self.txns: list[Txn] = []
        self.other: list[str] = []  # any message kind a publication of inserts must not send

    def feed(self, data: bytes) -> None:
        kind, body = chr(data[0]), memoryview(data)[1:]
        if kind == "B":
            _final_lsn, _ts, xid = struct.unpack_from("!qqI", body)
            self.txns.append(Txn(xid))
        elif kind == "C":
            self.txns[-1].committed = True
        elif kind == "R":
            self._relation(body)
        elif kind == "I":
            relid, marker = struct.unpack_from("!Ic", body)
            assert marker == b"N"
            namespace, columns = self.relations[relid]
            values = self._tuple(body, 5)
            self.txns[-1].inserts.append({"_relation": namespace, **dict(zip(columns, values))})
        elif kind not in "OY":  # origin and type messages carry nothing for these assertions
            self.other.append(kind)

    def _relation(self, body: memoryview) -> None:
        relid, = struct.unpack_from("!I", body)
        at = 4
        namespace, at = _string(body, at)
        name, at = _string(body, at)
        at += 1  # replica identity
        ncols, = struct.unpack_from("!h", body, at)
        at += 2
        columns = []
        for _ in range(ncols):
            at += 1  # flags
            column, at = _string(body, at)
            at += 8  # type oid, typmod
            columns.append(column)
        self.relations[relid] = (f"{namespace}.{name}", columns)

    @staticmethod
    def _tuple(body: memoryview, at: int) -> list[str | None]:
        ncols, = struct.unpack_from("!h", body, at)
        at += 2
        values: list[str | None] = []
        for _ in range(ncols):
            kind = chr(body[at])
            at += 1
            if kind == "n":
                values.append(None)
            elif kind == "t":
                length, = struct.unpack_from("!i", body, at)
                values.append(bytes(body[at + 4:at + 4 + length]).decode())
                at += 4 + length
            else:
                raise AssertionError(f"unexpected column kind {kind!r} (unchanged TOAST or binary)")
        return values


def _string(body: memoryview, at: int) -> tuple[str, int]:
    end = bytes(body[at:]).index(b"\0") + at
    return bytes(body[at:end]).decode(), end + 1


def decode(db) -> PgOutput:
    out = PgOutput()
    for (data,) in db.execute(
            "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL, "
            "'proto_version', '1', 'publication_names', %s)", (SLOT, PUBLICATION)):
        out.feed(bytes(data))
    return out


@pytest.fixture
def slot(db):
    """The documented publication (inserts only, through the root) and a pgoutput slot; the
    slot is dropped before the database is."""
    db.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE outbox.events "
               "WITH (publish = 'insert', publish_via_partition_root = true)")
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
    yield SLOT
    db.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))


def event_columns(db) -> list[str]:
    return [r[0] for r in db.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'outbox.events'::regclass "
        "AND attnum > 0 AND NOT attisdropped ORDER BY attnum")]


def stored_event(db, event_id: str, columns: list[str]) -> dict[str, str | None]:
    select = ", ".join(f"{c}::text" for c in columns)
    row = db.execute(f"SELECT {select} FROM outbox.events WHERE id = %s", (event_id,)).fetchone()
    return dict(zip(columns, row))


def drop_dated_partitions(db) -> None:
    for (part,) in db.execute("SELECT partition::text FROM outbox.partitions "
                              "WHERE parent = 'outbox.events'::regclass AND NOT is_default").fetchall():
        db.execute(f"DROP TABLE {part}")


def emit(conn, key: str) -> str:
    return str(conn.execute("SELECT outbox.emit('order', %s, 'order.created', %s::jsonb, "
                            "'{\"trace\": \"t\"}', 'orders')", (key, f'{{"key": "{key}"}}')).fetchone()[0])


def test_committed_events_are_published_once_as_root_inserts_in_commit_order(db, connect, slot):
    # Only the default partition at first: the events of the first transaction land there,
    # and maintain() then makes the partitions (after the slot) and moves them into one.
    drop_dated_partitions(db)
    expected: list[list[str]] = []
    expected.append([emit(db, "in-default")])
    actions = [r[0] for r in db.execute("SELECT action FROM outbox.maintain()")]
    assert "moved" in actions and "created" in actions

    first, second = connect(autocommit=False), connect(autocommit=False)
    started_first = emit(first, "a")             # begins first...
    committed_first = [emit(second, "b")]        # ...but the second commits first
    second.commit()
    expected.append(committed_first)
    started_first_too = emit(first, "a")
    first.commit()
    expected.append([started_first, started_first_too])

    with connect(autocommit=False) as rolled_back:
        emit(rolled_back, "never")
        rolled_back.rollback()
    with db.transaction():
        kept = emit(db, "c")
        with pytest.raises(RuntimeError), db.transaction():
            emit(db, "never-either")
            raise RuntimeError("roll the subtransaction back")
        many = [str(r[0]) for r in db.execute(
            "SELECT outbox.emit_many('order', 'order.shipped', ARRAY['c', 'd', 'e'], "
            "ARRAY['{\"n\": 1}', NULL, '{\"n\": 3}']::jsonb[])")]
    expected.append([kept, *many])

    out = decode(db)
    assert out.other == []
    assert all(t.committed for t in out.txns)
    published = [[e["id"] for e in t.inserts] for t in out.txns if t.inserts]
    assert published == expected  # once each, in commit order, emit order inside a commit
    columns = event_columns(db)
    for txn in out.txns:
        for insert in txn.inserts:
            assert insert.pop("_relation") == "outbox.events"
            assert list(insert) == columns
            assert insert == stored_event(db, insert["id"], columns)
    # the later events are in a partition that maintain() made after the slot existed
    part = db.execute("SELECT tableoid::regclass::text FROM outbox.events WHERE id = %s",
                      (expected[-1][0],)).fetchone()[0]
    assert part != "outbox.events_default"


def test_a_lagging_slot_still_decodes_events_whose_partition_was_dropped(db, slot):
    # One-second partitions kept no time: maintain() drops a partition as soon as it has
    # passed, and no consumer of outbox_ext holds it (a CDC reader is not one).
    drop_dated_partitions(db)
    db.execute("UPDATE outbox.partition_config SET width = '1 second', ahead = 3, retention = '0' "
               "WHERE parent = 'outbox.events'::regclass")
    db.execute("SELECT * FROM outbox.maintain()")
    event_id = emit(db, "gone")
    part, upper = db.execute("SELECT p.partition::text, p.upper FROM outbox.events e "
                             "JOIN outbox.partitions p ON p.partition = e.tableoid::regclass "
                             "WHERE e.id = %s", (event_id,)).fetchone()
    assert part != "outbox.events_default"
    wait_for(lambda: db.execute("SELECT now() >= %s", (upper,)).fetchone()[0], timeout=10)
    dropped = [r[1] for r in db.execute("SELECT * FROM outbox.maintain()") if r[0] == "dropped"]
    assert part in dropped
    assert db.execute("SELECT count(*) FROM outbox.events WHERE id = %s", (event_id,)).fetchone()[0] == 0

    out = decode(db)
    assert [e["id"] for t in out.txns for e in t.inserts] == [event_id]
    assert out.txns[-1].inserts[0]["aggregate_id"] == "gone"


def test_a_publication_with_a_column_list_leaves_the_internal_columns_out(db):
    columns = ["id", "topic", "aggregate_type", "aggregate_id", "event_type", "payload", "headers", "created_at"]
    db.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE outbox.events ({', '.join(columns)}) "
               "WITH (publish = 'insert', publish_via_partition_root = true)")
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
    try:
        event_id = emit(db, "listed")
        out = decode(db)
        [insert] = [e for t in out.txns for e in t.inserts]
        assert insert.pop("_relation") == "outbox.events"
        assert list(insert) == columns
        assert insert == {k: v for k, v in stored_event(db, event_id, event_columns(db)).items() if k in columns}
    finally:
        db.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))
