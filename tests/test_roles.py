"""Privileges: a producer can only emit; nothing is granted to PUBLIC; SECURITY DEFINER
functions pin their search_path; the API schemas hold the API, the internal one is usable by
no role."""

import psycopg
import pytest


def test_producer_can_emit(connect, db):
    producer = connect("producer_user")
    producer.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
    producer.execute("SELECT outbox.emit_many('a', 'e', '{2,3}', '{\"{}\",\"{}\"}')")
    assert db.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 3


@pytest.mark.parametrize("sql", [
    "SELECT * FROM outbox.events",
    "SELECT * FROM outbox.events_default",
    "SELECT count(*) FROM outbox.events",
    "INSERT INTO outbox.events (id, aggregate_type, aggregate_id, event_type, shard) "
    "VALUES (gen_random_uuid(), 'a', '1', 'e', 0)",
    "DELETE FROM outbox.events",
    "SELECT nextval('outbox.event_seq')",
    "SELECT * FROM outbox.maintain()",
    "SELECT * FROM outbox.partition_config",
    "SELECT * FROM inbox.messages",
    "SELECT outbox_internal._batch_ids('a', 'e', NULL, NULL, ARRAY['1'], 1)",
    # writes without the executor's permission checks: only emit_many (its owner) may call it
    "SELECT outbox_internal._insert_many('a', 'e', NULL, NULL, ARRAY['1'], ARRAY['{}'::jsonb])",
    # the payload limit is the operator's, not the producer's to raise
    "SET outbox_ext.max_payload_bytes = '1GB'",
])
def test_producer_cannot_read_or_touch_events_or_internals(connect, db, sql):
    db.execute("SELECT outbox.emit('a', '1', 'e', '{\"secret\": 1}')")
    producer = connect("producer_user")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        producer.execute(sql)


@pytest.mark.parametrize("sql", [
    "SELECT outbox.emit('a', '1', 'e', '{}')",
    "SELECT * FROM outbox.events",
    "SELECT outbox.uuid_v7()",
])
def test_a_role_without_grants_gets_nothing(connect, sql):
    nobody = connect("nobody_user")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        nobody.execute(sql)


def test_relay_reads_events_but_cannot_emit(connect, db):
    db.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
    relay = connect("relay_user")
    assert relay.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 1
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        relay.execute("SELECT outbox.emit('a', '1', 'e', '{}')")


def test_admin_can_do_everything(connect):
    admin = connect("admin_user")
    admin.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
    assert admin.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 1


def test_nothing_in_the_extension_is_granted_to_public(db):
    public_grants = db.execute("""
        SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,
               aclexplode(coalesce(c.relacl, acldefault('r', c.relowner))) a
         WHERE n.nspname IN ('outbox', 'inbox', 'outbox_internal') AND a.grantee = 0
        UNION ALL
        SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace,
               aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
         WHERE n.nspname IN ('outbox', 'inbox', 'outbox_internal') AND a.grantee = 0
        UNION ALL
        SELECT n.nspname FROM pg_namespace n, aclexplode(n.nspacl) a
         WHERE n.nspname IN ('outbox', 'inbox', 'outbox_internal') AND a.grantee = 0""").fetchall()
    assert public_grants == []


def test_the_api_schemas_list_only_documented_functions(db):
    functions = db.execute("""
        SELECT p.oid::regprocedure::text, obj_description(p.oid, 'pg_proc')
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname IN ('outbox', 'inbox')""").fetchall()
    assert len(functions) >= 20
    assert [f for f, _ in functions if f.split(".", 1)[1].startswith("_")] == [], "internals in the API"
    assert [f for f, doc in functions if not doc] == [], "undocumented"
    assert db.execute("SELECT count(*) FROM pg_proc WHERE pronamespace = 'outbox_internal'::regnamespace"
                      ).fetchone()[0] >= 50


@pytest.mark.parametrize("user", ["producer_user", "relay_user", "admin_user", "nobody_user"])
def test_no_role_may_call_an_internal_helper_but_the_views_still_read_through_them(connect, db, user):
    db.execute("SELECT outbox.create_consumer('c')")
    db.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
    for role in ["outbox_producer", "outbox_relay", "outbox_admin", "outbox_worker"]:
        assert not db.execute("SELECT has_schema_privilege(%s, 'outbox_internal', 'USAGE')", (role,)).fetchone()[0]
    who = connect(user)
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        who.execute("SELECT outbox_internal._shard_pending(NULL, NULL)")  # the one a view may execute
    if user in ("relay_user", "admin_user"):
        # outbox.status calls outbox_internal._shard_pending for each shard
        assert who.execute("SELECT pending FROM outbox.status WHERE consumer = 'c'").fetchone()[0] == 1


def test_security_definer_functions_pin_search_path(db):
    unpinned = db.execute("""
        SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname IN ('outbox', 'inbox', 'outbox_internal') AND p.prosecdef
           AND NOT coalesce(p.proconfig, '{}') && ARRAY['search_path=pg_catalog, pg_temp']""").fetchall()
    assert unpinned == []
    assert db.execute("""SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                          WHERE n.nspname = 'outbox' AND p.prosecdef""").fetchone()[0] >= 2


@pytest.mark.parametrize("fails", [False, True], ids=["written", "failed"])
def test_emit_writes_as_its_owner_and_gives_the_user_back(connect, db, fails):
    """Native emit is not SECURITY DEFINER: it switches to its owner around the write itself.
    After it returns, or fails inside that switch (a CHECK constraint sends it down emit_many's
    INSERT, which raises), the producer is the producer again, with no privilege left over."""
    db.execute("ALTER TABLE outbox.events ADD CONSTRAINT no_bad_keys CHECK (aggregate_id <> 'bad')")
    producer = connect("producer_user")
    producer.autocommit = False
    producer.execute("SAVEPOINT s")
    if fails:
        with pytest.raises(psycopg.errors.CheckViolation):
            producer.execute("SELECT outbox.emit('a', 'bad', 'e', '{}')")
        producer.execute("ROLLBACK TO SAVEPOINT s")
    else:
        producer.execute("SELECT outbox.emit('a', 'good', 'e', '{}')")
    assert producer.execute("SELECT current_user").fetchone()[0] == "producer_user"
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        producer.execute("SELECT count(*) FROM outbox.events")
    producer.rollback()


def test_a_hostile_search_path_does_not_reach_emit(connect, db):
    """A producer who shadows functions and operators in its own schema still gets a real event."""
    db.execute("CREATE SCHEMA evil; GRANT ALL ON SCHEMA evil TO producer_user")
    producer = connect("producer_user")
    producer.execute("""CREATE FUNCTION evil.nextval(regclass) RETURNS bigint LANGUAGE sql AS 'SELECT -1::bigint';
                        CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE sql AS $$SELECT 'epoch'::timestamptz$$""")
    producer.execute("SET search_path = evil, pg_catalog")
    producer.execute("SELECT outbox.emit('a', '1', 'e', '{}')")
    seq, old = db.execute("SELECT seq, created_at < now() - interval '1 day' FROM outbox.events").fetchone()
    assert seq > 0 and not old
