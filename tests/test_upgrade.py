"""Upgrades: ALTER EXTENSION outbox_ext UPDATE loses nothing and keeps order, and leaves the
same catalog as a fresh install."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import psycopg
import pytest

from support.relay import Relay, first_deliveries
from support.versions import NEW, RELEASED


@pytest.mark.every_release
@pytest.mark.parametrize("old", RELEASED)
def test_update_keeps_pending_events_and_parked_keys_in_order(cluster, new_database, old):
    with cluster.connect(new_database()) as db:
        db.execute(f"CREATE EXTENSION outbox_ext VERSION '{old}'")
        db.execute("SELECT outbox.create_consumer('sink', backoff_base => '10 ms', backoff_max => '20 ms')")
        for i in range(50):
            db.execute("SELECT outbox.emit('order', %s, 'e', %s::jsonb)", (f"k{i % 6}", f'{{"i": {i}}}'))
        # the old SQL on the new library (installed before the UPDATE runs) still emits in bulk
        db.execute("SELECT count(*) FROM outbox.emit_many('order', 'e', %s, %s::jsonb[])",
                   ([f"k{i % 6}" for i in range(50, 60)], [f'{{"i": {i}}}' for i in range(50, 60)]))
        relay = Relay(db, "sink", batch_size=7)
        delivered = []
        # deliver part of it, failing one key so that it is parked with events queued behind it
        batch = relay.claim()
        poisoned = batch[0].aggregate_id
        relay.nack(batch[0], "down")
        delivered += [e for e in batch if e.aggregate_id != poisoned]
        relay.ack(batch[0].shard, batch[0].epoch)
        assert db.execute("SELECT count(*) FROM outbox._parked").fetchone()[0] == 1

        db.execute("ALTER EXTENSION outbox_ext UPDATE")
        assert db.execute("SELECT extversion FROM pg_extension WHERE extname = 'outbox_ext'").fetchone()[0] == NEW

        for i in range(60, 70):   # emitting goes on after the update
            db.execute("SELECT outbox.emit('order', %s, 'e', %s::jsonb)", (f"k{i % 6}", f'{{"i": {i}}}'))
        time.sleep(0.05)
        for _ in range(20):
            delivered += relay.drain()
            time.sleep(0.03)
        per_key = defaultdict(list)
        for e in delivered:
            per_key[e.aggregate_id].append(e.payload["i"])
        assert sorted(i for seq in per_key.values() for i in seq) == list(range(70)), "nothing lost or doubled"
        assert all(seq == sorted(seq) for seq in per_key.values()), "per-key order kept"
        # and what later versions added works on the upgraded database
        assert db.execute("SELECT inbox.claim(outbox.uuid_v7(), 'c')").fetchone()[0] is True
        assert db.execute("SELECT count(*) FROM outbox.maintain() WHERE action = 'skipped'").fetchone()[0] == 0
        db.execute("SELECT outbox.create_sink('hook', 'webhook', 'http://127.0.0.1:1/')")
        assert db.execute("SELECT sink_kind FROM outbox.status WHERE consumer = 'hook'").fetchone()[0] == "webhook"


def test_a_head_nacked_before_the_update_stays_queued_when_its_batch_is_acked_after(cluster, new_database):
    """0.23.0 records which event of a parked key failed (nacked_pos) to let the heads before it
    go; a head nacked under 0.22.0, whose batch is acked after the UPDATE, has none recorded:
    it must stay queued, not count as delivered."""
    with cluster.connect(new_database()) as db:
        db.execute("CREATE EXTENSION outbox_ext VERSION '0.22.0'")
        db.execute("SELECT outbox.create_consumer('sink', backoff_base => '1 ms', backoff_max => '1 ms')")
        relay = Relay(db, "sink")
        db.execute("SELECT outbox.emit('order', 'k', 'e', jsonb_build_object('i', i)) FROM generate_series(0, 2) i")
        batch = relay.claim()
        relay.settle(batch[0].shard, batch[0].epoch, [relay.failure(batch[0], "down")])
        time.sleep(0.01)
        heads = relay.claim()
        assert [e.payload["i"] for e in heads] == [0]
        relay.nack(heads[0], "still down")
        db.execute("ALTER EXTENSION outbox_ext UPDATE")
        relay.ack(heads[0].shard, heads[0].epoch)
        assert db.execute("SELECT array_agg((payload->>'i')::int ORDER BY pos) FROM outbox._parked_events"
                          ).fetchone()[0] == [0, 1, 2]
        time.sleep(0.01)
        assert [e.payload["i"] for e in relay.drain()] == [0, 1, 2]


def test_update_while_relays_claim_and_settle_loses_nothing(cluster, new_database):
    """The newest delta alters tables while two relays claim and settle (the old SQL on the new
    library, as between the restart and the UPDATE). Whoever a deadlock picks (docs/guides/operations.md: the
    UPDATE may have to be run again; a relay's claim or settle is retried, also one that failed
    as the UPDATE replaced the functions it was running) every event is delivered, each key's
    first deliveries in order, and the update lands."""
    name = new_database()
    with cluster.connect(name) as db:
        db.execute(f"CREATE EXTENSION outbox_ext VERSION '{RELEASED[-1]}'")
        db.execute("SELECT outbox.create_consumer('sink')")
        n = 10000
        db.execute("SELECT count(*) FROM outbox.emit_many('order', 'e', %s, %s::jsonb[])",
                   ([f"k{i % 40}" for i in range(n)], [f'{{"i": {i}}}' for i in range(n)]))
        delivered, lock = [], threading.Lock()
        stop = threading.Event()

        def relay_loop():
            with cluster.connect(name) as conn:
                relay = Relay(conn, "sink", batch_size=10, lease="5 seconds")
                while not stop.is_set():
                    try:
                        batch = relay.claim()
                        if batch:
                            with lock:   # "sent" while the batch is held, before its settle
                                delivered.extend(batch)
                            relay.settle(batch[0].shard, batch[0].epoch)
                    except (psycopg.errors.DeadlockDetected, psycopg.errors.ObjectNotInPrerequisiteState,
                            psycopg.errors.UndefinedFunction):
                        # a claim changed nothing; a settle's batch (or a late one's) comes again;
                        # a call under way as the UPDATE replaced its helpers failed (42883,
                        # docs/guides/operations.md) and the next runs the new functions
                        pass

        relays = [threading.Thread(target=relay_loop) for _ in range(2)]
        for r in relays:
            r.start()
        started = time.monotonic()
        while len(delivered) < n // 5:   # under way
            assert time.monotonic() - started < 30 and all(r.is_alive() for r in relays), "relays stalled"
            time.sleep(0.01)
        for attempt in range(10):
            try:
                db.execute("ALTER EXTENSION outbox_ext UPDATE")
                break
            except psycopg.errors.DeadlockDetected:
                assert attempt < 9, "the UPDATE never got through"
        assert db.execute("SELECT extversion FROM pg_extension WHERE extname = 'outbox_ext'").fetchone()[0] == NEW
        deadline = time.monotonic() + 30
        while len({e.id for e in delivered}) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
        for r in relays:
            r.join()
        assert len({e.id for e in delivered}) == n, "every event delivered"
        emitted = {e.id: e.payload["i"] for e in delivered}
        first = [[emitted[i] for i in ids] for ids in first_deliveries((e.id, e.aggregate_id) for e in delivered).values()]
        assert all(order == sorted(order) for order in first), "per-key order kept"


@pytest.mark.every_release
@pytest.mark.parametrize("old", RELEASED)
def test_update_is_rerunnable_and_leaves_the_catalog_of_a_fresh_install(cluster, new_database, old):
    fresh, upgraded = new_database(), new_database()
    with cluster.connect(fresh) as db:
        db.execute("CREATE EXTENSION outbox_ext")
        want = catalog(db)
    with cluster.connect(upgraded) as db:
        db.execute(f"CREATE EXTENSION outbox_ext VERSION '{old}'")
        db.execute("ALTER EXTENSION outbox_ext UPDATE")
        got = catalog(db)
        # the newest script is rerunnable: applying it again changes nothing (outside ALTER
        # EXTENSION PostgreSQL refuses to drop members, so its guarded DROPs are left out here)
        script = db.execute("SELECT pg_read_file(%s)", (upgrade_script_path(db),)).fetchone()[0]
        body = "\n".join(line for line in script.split("\\quit", 1)[1].splitlines()
                         if not line.startswith(("DROP FUNCTION IF EXISTS",
                                                 "SELECT pg_catalog.pg_extension_config_dump")))
        body = body.replace("MODULE_PATHNAME", "$libdir/outbox_ext")  # as the control file says
        db.execute(body)
        assert catalog(db) == got
    assert got == want, sorted(set(got) ^ set(want))


def upgrade_script_path(db) -> str:
    share = db.execute("SELECT setting FROM pg_config WHERE name = 'SHAREDIR'").fetchone()[0]
    return f"{share}/extension/outbox_ext--{RELEASED[-1]}--{NEW}.sql"


def catalog(db) -> list[str]:
    """Every object of the extension, with its definition, privileges and comment (a table's
    with its constraints, indexes and triggers; an event trigger's event, tags and mode)."""
    rows = db.execute("""
        SELECT pg_describe_object(d.classid, d.objid, 0) || ' | ' ||
               coalesce(CASE d.classid
                   WHEN 'pg_proc'::regclass THEN (SELECT pg_get_functiondef(d.objid) || coalesce(p.proacl::text, '')
                                                    FROM pg_proc p WHERE p.oid = d.objid)
                   WHEN 'pg_class'::regclass THEN (SELECT c.relkind::text || coalesce(c.relacl::text, '') ||
                                                          coalesce(pg_get_viewdef(c.oid), '') ||
                                                          (SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod) ||
                                                                             ' ' || a.attnotnull || ' ' || coalesce(pg_get_expr(ad.adbin, ad.adrelid), '') ||
                                                                             ' ' || coalesce(a.attacl::text, ''),
                                                                             ', ' ORDER BY a.attnum)
                                                             FROM pg_attribute a LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
                                                            WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped) ||
                                                          -- what a table's own definition holds beside its columns
                                                          coalesce((SELECT string_agg(co.conname || ' ' || pg_get_constraintdef(co.oid), ', ' ORDER BY co.conname)
                                                                      FROM pg_constraint co WHERE co.conrelid = c.oid), '') ||
                                                          coalesce((SELECT string_agg(pg_get_indexdef(i.indexrelid), ', ' ORDER BY i.indexrelid::regclass::text)
                                                                      FROM pg_index i WHERE i.indrelid = c.oid), '') ||
                                                          coalesce((SELECT string_agg(pg_get_triggerdef(t.oid), ', ' ORDER BY t.tgname)
                                                                      FROM pg_trigger t WHERE t.tgrelid = c.oid AND NOT t.tgisinternal), '')
                                                     FROM pg_class c WHERE c.oid = d.objid)
                   WHEN 'pg_namespace'::regclass THEN (SELECT coalesce(n.nspacl::text, '') FROM pg_namespace n WHERE n.oid = d.objid)
                   WHEN 'pg_event_trigger'::regclass THEN (SELECT e.evtevent || ' ' || e.evtenabled::text || ' ' || coalesce(e.evttags::text, '') ||
                                                                  ' ' || e.evtfoid::regproc::text
                                                             FROM pg_event_trigger e WHERE e.oid = d.objid)
               END, '') || ' | ' || coalesce(obj_description(d.objid, d.classid::regclass::text), '')
          FROM pg_depend d
         WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
           AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'outbox_ext')
           -- partitions are made by date, so their names differ between two installs
           AND NOT (d.classid = 'pg_class'::regclass AND
                    (SELECT c.relispartition AND c.relname ~ '_p[0-9]{8}_' FROM pg_class c WHERE c.oid = d.objid))""").fetchall()
    dumped = db.execute("SELECT extconfig::regclass[]::text[], extcondition FROM pg_extension"
                        " WHERE extname = 'outbox_ext'").fetchone()
    return sorted([r[0] for r in rows] + [f"dumped: {sorted(zip(dumped[0] or [], dumped[1] or []))}"])
