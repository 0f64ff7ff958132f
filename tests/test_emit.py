"""outbox.emit and outbox.emit_many: what they write, and bad input refused with SQLSTATE and
hint while writing nothing."""

import json
import threading

import psycopg
import pytest
from psycopg.types.json import Jsonb

from support.db import count_events

EMIT = "SELECT outbox.emit(%s, %s, %s, %s, %s, %s)"


def test_emit_writes_one_event_with_its_fields(db):
    event_id = db.execute(EMIT, ("order", "42", "order.created", Jsonb({"total": 10}),
                                 Jsonb({"trace": "t1"}), "orders.v1")).fetchone()[0]
    row = db.execute("""SELECT id, topic, aggregate_type, aggregate_id, event_type, payload, headers,
                               txid = pg_current_xact_id() AS same_tx, shard = outbox.shard_of('42'),
                               created_at <= now()
                          FROM outbox.events""").fetchall()
    assert len(row) == 1
    eid, topic, atype, aid, etype, payload, headers, same_tx, shard_ok, time_ok = row[0]
    assert (eid, topic, atype, aid, etype) == (event_id, "orders.v1", "order", "42", "order.created")
    assert payload == {"total": 10} and headers == {"trace": "t1"}
    assert not same_tx and shard_ok and time_ok
    assert event_id.version == 7


def test_ids_and_sequence_follow_emit_order(db):
    ids = [db.execute("SELECT outbox.emit('a', %s, 'e', '{}')", (str(i),)).fetchone()[0] for i in range(50)]
    rows = db.execute("SELECT id FROM outbox.events ORDER BY seq").fetchall()
    assert [r[0] for r in rows] == ids
    assert sorted(ids) == ids  # UUIDv7: time-ordered


def test_emit_many_writes_in_array_order(db):
    keys = [str(i) for i in range(1000)]
    payloads = [Jsonb({"n": i}) for i in range(1000)]
    ids = [r[0] for r in db.execute(
        "SELECT * FROM outbox.emit_many('order', 'order.created', %s, %s::jsonb[], '{\"h\":\"v\"}', 'orders')",
        (keys, payloads)).fetchall()]
    assert len(ids) == len(set(ids)) == 1000
    rows = db.execute("SELECT id, aggregate_id, payload->>'n', headers, topic, shard = outbox.shard_of(aggregate_id) "
                      "FROM outbox.events ORDER BY seq").fetchall()
    assert [r[0] for r in rows] == ids
    assert [r[1] for r in rows] == keys
    assert [int(r[2]) for r in rows] == list(range(1000))
    assert all(r[3] == {"h": "v"} and r[4] == "orders" and r[5] for r in rows)
    assert db.execute("SELECT count(DISTINCT txid) FROM outbox.events").fetchone()[0] == 1


INSERT_MANY = "SELECT outbox_internal._insert_many('order', 'order.created', NULL, 'orders', %s, %s::jsonb[])"


def emit_each(db, keys, payloads) -> list:
    """One outbox.emit per event."""
    return [db.execute("SELECT outbox.emit('order', %s, 'order.created', %s, NULL, 'orders')", (k, p)).fetchone()[0]
            for k, p in zip(keys, payloads)]


def emit_batch(db, keys, payloads) -> list:
    """One outbox.emit_many for all."""
    return [r[0] for r in db.execute("SELECT outbox.emit_many('order', 'order.created', %s, %s::jsonb[], NULL, 'orders')",
                                     (keys, payloads)).fetchall()]


WRITERS = [pytest.param(emit_each, id="emit"), pytest.param(emit_batch, id="emit_many")]


def sql_path_calls(db) -> int:
    """Calls of emit_many's INSERT path (outbox_internal._batch_ids) in this transaction; needs
    track_functions = 'all'."""
    return db.execute("SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions "
                      "WHERE schemaname = 'outbox_internal' AND funcname = '_batch_ids'").fetchone()[0]


def index_is_whole(db) -> None:
    """Every event partition's index is sound and holds an entry for every row: amcheck where
    the server has it; else (the PostgreSQL 16 wheel ships no contrib) the rows an index scan
    finds are the rows a sequential scan finds."""
    parts = db.execute("""SELECT i.indexrelid::regclass::text, p.inhrelid::regclass::text
                            FROM pg_inherits p JOIN pg_index i ON i.indrelid = p.inhrelid
                           WHERE p.inhparent = 'outbox.events'::regclass""").fetchall()
    if db.execute("SELECT EXISTS (SELECT FROM pg_available_extensions WHERE name = 'amcheck')").fetchone()[0]:
        db.execute("CREATE EXTENSION IF NOT EXISTS amcheck")
        for index, _ in parts:
            db.execute("SELECT bt_index_check(%s::regclass, heapallindexed => true)", (index,))
        return
    rows = "SELECT array_agg(seq ORDER BY seq) FROM {} WHERE shard >= 0"
    for index, table in parts:
        with db.transaction():
            db.execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off")
            plan = "\n".join(r[0] for r in db.execute("EXPLAIN " + rows.format(table)))
            assert index.split(".")[-1] in plan, plan
            by_index = db.execute(rows.format(table)).fetchone()[0]
        with db.transaction():
            db.execute("SET LOCAL enable_indexscan = off; SET LOCAL enable_bitmapscan = off; "
                       "SET LOCAL enable_indexonlyscan = off")
            assert db.execute(rows.format(table)).fetchone()[0] == by_index


@pytest.mark.parametrize("write", WRITERS)
def test_native_writes_are_what_a_plain_insert_writes(db, write):
    n = 600                                        # emit_many: several multi-inserts
    keys = [f"k{i % 37}" for i in range(n)]        # keys repeating
    db.execute("SET track_functions = 'all'")
    with db.transaction():
        ids = write(db, keys, [Jsonb({"n": i}) for i in range(n)])
        assert sql_path_calls(db) == 0, "the native path was not taken"
        xid = db.execute("SELECT pg_current_xact_id()").fetchone()[0]
    db.execute("INSERT INTO outbox.events (id, aggregate_type, aggregate_id, event_type, payload, topic, shard) "
               "SELECT outbox.uuid_v7(), 'order', 'plain', 'order.created', '{}', 'orders', outbox.shard_of('plain')")
    rows = db.execute("""SELECT id, aggregate_id, (payload->>'n')::int, topic, txid, shard = outbox.shard_of(aggregate_id),
                                tableoid::regclass::text
                           FROM outbox.events WHERE aggregate_id <> 'plain' ORDER BY seq""").fetchall()
    assert [r[0] for r in rows] == ids and [r[1] for r in rows] == keys
    assert [r[2] for r in rows] == list(range(n))
    assert all(r[3] == "orders" and r[4] == xid and r[5] for r in rows)
    plain = db.execute("SELECT tableoid::regclass::text FROM outbox.events WHERE aggregate_id = 'plain'").fetchone()[0]
    assert {r[6] for r in rows} == {plain}   # the partition a plain INSERT picks
    index_is_whole(db)
    db.execute("SET enable_seqscan = off")
    db.execute("SET enable_bitmapscan = off")
    by_index = db.execute("SELECT count(*) FROM outbox.events WHERE shard = ANY (ARRAY(SELECT generate_series(0, 15))) "
                          "AND seq > 0").fetchone()[0]
    assert by_index == n + 1


@pytest.mark.parametrize("write", WRITERS)
def test_what_a_native_write_cannot_do_is_left_to_a_plain_insert(db, write):
    """A row trigger on the events (which a native write would skip) sends emit and emit_many
    down emit_many's INSERT path: the trigger fires for every event."""
    db.execute("CREATE TABLE fired (id uuid)")
    db.execute("CREATE FUNCTION count_event() RETURNS trigger LANGUAGE plpgsql AS "
               "$$ BEGIN INSERT INTO public.fired VALUES (NEW.id); RETURN NEW; END $$")
    db.execute("CREATE TRIGGER count_event BEFORE INSERT ON outbox.events FOR EACH ROW EXECUTE FUNCTION count_event()")
    assert db.execute(INSERT_MANY, (["a", "b"], [Jsonb({}), Jsonb({})])).fetchone()[0] is None
    assert count_events(db) == 0
    db.execute("SET track_functions = 'all'")
    with db.transaction():
        ids = write(db, ["a", "b", "c"], [Jsonb({}), Jsonb({}), None])
        assert sql_path_calls(db) > 0
    assert db.execute("SELECT array_agg(id ORDER BY seq) FROM outbox.events").fetchone()[0] == ids
    assert sorted(r[0] for r in db.execute("SELECT id FROM fired")) == sorted(ids)


@pytest.mark.parametrize("write", WRITERS)
def test_emit_routes_as_postgres_does(db, write):
    """With no partition for now() events go to the default partition (through the INSERT
    path: a concurrent ATTACH may be narrowing it); with no default either, emit fails as an
    INSERT does and writes nothing."""
    today = db.execute("SELECT partition::text FROM outbox.partitions WHERE parent = 'outbox.events'::regclass "
                       "AND lower <= now() AND now() < upper").fetchone()[0]
    db.execute(f"ALTER TABLE outbox.events DETACH PARTITION {today}")
    assert db.execute(INSERT_MANY, (["1"], [Jsonb({})])).fetchone()[0] is None
    write(db, ["1", "2"], [Jsonb({}), Jsonb({})])
    assert db.execute("SELECT array_agg(DISTINCT tableoid::regclass::text) FROM outbox.events").fetchone()[0] == \
        ["outbox.events_default"]
    index_is_whole(db)
    db.execute("ALTER TABLE outbox.events DETACH PARTITION outbox.events_default")
    with pytest.raises(psycopg.errors.CheckViolation):
        write(db, ["3"], [Jsonb({})])
    assert count_events(db) == 0


def test_ids_are_unique_across_backends_emitting_at_once(connect, db):
    """Ids take their random bits from a per-process generator: backends forked from one
    postmaster must not share its state."""
    writers = [connect() for _ in range(4)]
    keys, payloads = [str(i) for i in range(2000)], [Jsonb({})] * 2000

    def write(conn):
        for _ in range(5):
            conn.execute("SELECT count(*) FROM outbox.emit_many('a', 'e', %s, %s::jsonb[])", (keys, payloads))

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert db.execute("SELECT count(*), count(DISTINCT id) FROM outbox.events").fetchone() == (40000, 40000)


def test_shards_are_stable_and_spread(db):
    shards = db.execute("SELECT outbox.shard_of(i::text) FROM generate_series(1, 10000) i").fetchall()
    counts = {}
    for (s,) in shards:
        counts[s] = counts.get(s, 0) + 1
    n = db.execute("SELECT outbox.shard_count()").fetchone()[0]
    assert set(counts) == set(range(n))
    assert min(counts.values()) > 10000 / n * 0.7
    # fixed function of the key: the same on every call and every server
    assert db.execute("SELECT outbox.shard_of('order-1'), outbox.shard_of('order-1')").fetchone() == (
        db.execute("SELECT outbox.shard_of('order-1')").fetchone()[0],) * 2


BAD_INPUT = [
    # (aggregate_type, aggregate_id, event_type, payload, headers, topic) -> sqlstate, words in message
    (("order", None, "e", {}, None, None), "22004", "aggregate_id must not be NULL"),
    (("order", "", "e", {}, None, None), "22023", "aggregate_id must not be empty"),
    (("order", "1", None, {}, None, None), "22004", "event_type must not be NULL"),
    (("order", "1", "", {}, None, None), "22023", "event_type must not be empty"),
    ((None, "1", "e", {}, None, None), "22004", "aggregate_type must not be NULL"),
    (("order", "1", "e", {}, [], None), "22023", "invalid headers"),
    (("order", "1", "e", {}, {"a": 1}, None), "22023", "invalid headers"),
    (("order", "1", "e", {}, {"a": None}, None), "22023", "invalid headers"),
    (("order", "1", "e", {}, "x", None), "22023", "invalid headers"),
    (("order", "1", "e", {}, None, "a b"), "42602", "invalid topic"),
    (("order", "1", "e", {}, None, ""), "42602", "invalid topic"),
    (("order", "1", "e", {}, None, ".."), "42602", "invalid topic"),
    (("order", "1", "e", {}, None, "x" * 250), "42602", "invalid topic"),
    (("order", "1", "e", {"big": "x" * (1024 * 1024)}, None, None), "54000", "over the limit of 1048576"),
]


@pytest.mark.parametrize("args,sqlstate,words", BAD_INPUT, ids=[b[2] for b in BAD_INPUT])
def test_bad_input_is_refused_and_writes_nothing(db, args, sqlstate, words):
    atype, aid, etype, payload, headers, topic = args
    params = (atype, aid, etype, Jsonb(payload), None if headers is None else Jsonb(headers), topic)
    db.execute("SELECT outbox.emit('order', 'before', 'e', '{}')")
    with pytest.raises(psycopg.Error) as err:
        db.execute(EMIT, params)
    assert err.value.sqlstate == sqlstate
    assert words in err.value.diag.message_primary
    assert err.value.diag.message_hint, "every user error carries a hint"
    assert count_events(db) == 1


def test_payload_limit_follows_the_guc(db):
    db.execute("SET outbox_ext.max_payload_bytes = '1kB'")
    db.execute(EMIT, ("a", "1", "e", Jsonb({"x": "y" * 900}), None, None))
    with pytest.raises(psycopg.errors.ProgramLimitExceeded):
        db.execute(EMIT, ("a", "1", "e", Jsonb({"x": "y" * 1100}), None, None))
    assert count_events(db) == 1


@pytest.mark.parametrize("call", [
    "SELECT outbox.emit('a', '1', 'e', '{}')",
    "SELECT count(*) FROM outbox.emit_many('a', 'e', ARRAY['1', '2'], ARRAY['{}', '{}']::jsonb[])"])
def test_a_read_only_transaction_cannot_emit(db, call):
    """emit writes its row itself, not through the executor: it must refuse a read-only
    transaction as an INSERT would (a standby's is one too, tests/test_faults.py), before it
    takes a transaction id (a standby has none to give)."""
    with db.transaction():
        db.execute("SET TRANSACTION READ ONLY")
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction) as err:
            with db.transaction():                                  # a savepoint
                db.execute(call)
        # an xid taken inside the savepoint would have given the transaction one too
        assert db.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0] is None
    assert err.value.diag.message_hint
    assert count_events(db) == 0


def test_null_payload_is_allowed_as_a_tombstone(db):
    db.execute("SELECT outbox.emit('a', '1', 'deleted', NULL)")
    assert db.execute("SELECT payload IS NULL FROM outbox.events").fetchone()[0]


def test_emit_many_refuses_a_whole_batch_with_one_bad_row(db):
    keys = ["1", "2", "", "4"]
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        db.execute("SELECT outbox.emit_many('a', 'e', %s, %s::jsonb[])", (keys, [Jsonb({})] * 4))
    assert count_events(db) == 0


@pytest.mark.parametrize("keys,payloads,sqlstate", [
    (["1", "2"], [{}], "2202E"),
    (["1"], [{}, {}], "2202E"),
    (None, [{}], "22004"),
    (["1"], None, "22004"),
])
def test_emit_many_checks_its_arrays(db, keys, payloads, sqlstate):
    with pytest.raises(psycopg.Error) as err:
        db.execute("SELECT outbox.emit_many('a', 'e', %s::text[], %s::jsonb[])",
                   (keys, None if payloads is None else [Jsonb(p) for p in payloads]))
    assert err.value.sqlstate == sqlstate and err.value.diag.message_hint
    assert count_events(db) == 0


def test_emit_many_of_nothing_writes_nothing(db):
    assert db.execute("SELECT count(*) FROM outbox.emit_many('a', 'e', '{}', '{}')").fetchone()[0] == 0


def test_create_extension_made_partitions_covering_now(db):
    parts = db.execute("""
        SELECT c.relname, pg_get_expr(c.relpartbound, c.oid)
          FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'outbox.events'::regclass ORDER BY 1""").fetchall()
    names = [p[0] for p in parts]
    assert "events_default" in names
    assert len(names) >= 3
    db.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
    assert db.execute("SELECT tableoid::regclass::text FROM outbox.events").fetchone()[0] != "outbox.events_default"


def test_payload_round_trips_unchanged(db):
    payload = {"s": "ünïcødé ✓", "n": 1.5, "nested": {"list": [1, None, True]}, "empty": {}}
    db.execute(EMIT, ("a", "1", "e", Jsonb(payload), None, None))
    assert db.execute("SELECT payload FROM outbox.events").fetchone()[0] == payload
    assert json.loads(db.execute("SELECT payload::text FROM outbox.events").fetchone()[0]) == payload


def test_a_payload_read_from_a_table_is_stored_whole(db):
    """A jsonb argument read from a table may be a pointer into that table's TOAST data: the
    event must hold the value itself, also after the source row is gone."""
    db.execute("CREATE TABLE source (p jsonb)")
    db.execute("""INSERT INTO source SELECT jsonb_build_object('blob', string_agg(md5(i::text), ''))
                    FROM generate_series(1, 4000) i""")   # ~128 KB, incompressible: stored out of line
    want = db.execute("SELECT md5(p::text) FROM source").fetchone()[0]
    db.execute("SELECT outbox.emit('a', '1', 'e', p) FROM source")
    db.execute("DROP TABLE source")
    assert db.execute("SELECT md5(payload::text) FROM outbox.events").fetchone()[0] == want


def test_shard_of_is_inlined_into_emit(db):
    """A shard_of that the planner cannot inline is re-planned on every emit (4x slower)."""
    plan = db.execute("EXPLAIN VERBOSE SELECT outbox.shard_of(k) FROM (VALUES ('a'), ('b')) v(k)").fetchall()
    text = "\n".join(r[0] for r in plan)
    assert "hashtextextended" in text and "shard_of" not in text
    assert "% '16'" in text and "shard_count" not in text   # the count folded in
