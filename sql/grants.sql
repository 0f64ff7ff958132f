-- outbox_ext: privileges, all in one place. Runs last (finalize); rerunnable: it first takes
-- back every privilege our roles and PUBLIC hold on our objects, then grants exactly what each
-- role needs. (An upgrade script grants only what its version adds; see README, Development.)
--
-- Rules:
-- - Nothing is granted to PUBLIC.
-- - No role gets ALL on a table: never TRIGGER, TRUNCATE or REFERENCES, because a trigger or
--   rule on our tables would run inside the worker and the SECURITY DEFINER functions, as their
--   owner. (Rules and policies need ownership, which only the extension's owner has.)
-- - Partitions get no grant at all: rows are reached through their parent, whose privileges
--   apply; outbox.maintain() strips any grant a new partition would get by default.
-- - Writes to state go through the SECURITY DEFINER API (which pins search_path and names
--   every object by schema); a role writes a table directly only where that is its job
--   (admins: sink and retry settings, partition settings, dead letters; the worker: sink
--   figures), and then only the columns it may change.
--
-- What runs with more privilege than its caller resolves names only in pg_catalog and our
-- schemas; each SQL file's header says which of these rules covers what it defines:
-- [pinned]   SECURITY DEFINER functions SET search_path = pg_catalog, pg_temp (functions and
--            operators are never looked up in pg_temp) and name our objects by schema.
--            tests/test_roles.py checks that every one of them pins it.
-- [inside]   Internal helpers (outbox_internal._*: no role may use that schema) run only
--            inside [pinned] functions, whose search_path they inherit. (One [pinned] one,
--            _shard_pending, may be executed by outbox_relay and outbox_admin, because the
--            status views call it; without USAGE on the schema they cannot call it by name.)
-- [parsed]   Views and SQL-standard bodies (LANGUAGE sql ... RETURN) are parsed once, by
--            CREATE EXTENSION or ALTER EXTENSION UPDATE, whose search_path is pg_catalog,
--            pg_temp (the control file's schema is pg_catalog).
-- [caller]   Not SECURITY DEFINER (create_sink, drop_sink): runs with the caller's rights;
--            its search_path is pinned all the same.
-- [native]   C functions (src/emit, src/sinks/check.rs, src/claim) look objects up in the
--            catalog by schema; emit's one SPI statement names outbox.emit_many with exactly
--            typed arguments; outbox.claim and outbox.settle_and_claim are also [pinned], and
--            run their [inside] bodies with exactly typed arguments; the claim's reads are
--            [inside] functions; every statement of theirs names every object and function
--            by schema (src/claim/statements.rs).
-- [worker]   The worker's session has search_path pg_catalog, pg_temp, and its statements
--            name everything by schema, operators as OPERATOR(pg_catalog.x)
--            (src/worker/session.rs, queries.rs, mod.rs).
-- Dynamic SQL quotes identifiers with %I or a regclass's text and values with %L.
--
-- Producers reach the event log only through the SECURITY DEFINER emit_many and the native
-- emit (which writes as its owner); they cannot read events or configuration. outbox.sinks
-- holds secrets: only outbox_admin and outbox_worker (which delivers with them) read it;
-- relays see a sink's health through outbox.status, which shows no URL or secret.

-- Take every privilege on the extension's objects from every role but their owner and our four
-- (whose privileges the rest of this file sets). CREATE EXTENSION applies the installing
-- role's default privileges (ALTER DEFAULT PRIVILEGES, in any schema) to every object its
-- script makes: ALL on tables for an application role, a common set-up, gave that role TRIGGER
-- on tables the SECURITY DEFINER functions write as the owner, whose trigger then ran as the
-- owner. Partitions made later are stripped as they are made (_revoke_all). An upgrade
-- (made_only) takes back only what the objects were made with (pg_init_privs): a grant an
-- operator made since (SELECT on outbox.status to a dashboard's role) stays.
CREATE OR REPLACE FUNCTION outbox_internal._revoke_strangers(made_only boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    statement text;
BEGIN
    FOR statement IN
        WITH ours AS (SELECT n.oid FROM pg_namespace n WHERE n.nspname IN ('outbox', 'inbox', 'outbox_internal')),
             objects (catalog, id, kind, name, owner, acl) AS (
                 SELECT 'pg_class'::regclass, c.oid, CASE c.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END,
                        c.oid::regclass::text, c.relowner, c.relacl
                   FROM pg_class c WHERE c.relnamespace IN (SELECT o.oid FROM ours o)
                 UNION ALL
                 SELECT 'pg_proc'::regclass, p.oid, 'ROUTINE', p.oid::regprocedure::text, p.proowner, p.proacl
                   FROM pg_proc p WHERE p.pronamespace IN (SELECT o.oid FROM ours o)
                 UNION ALL
                 SELECT 'pg_type'::regclass, t.oid, 'TYPE', t.oid::regtype::text, t.typowner, t.typacl
                   FROM pg_type t WHERE t.typnamespace IN (SELECT o.oid FROM ours o) AND t.typcategory <> 'A'
                 UNION ALL
                 SELECT 'pg_namespace'::regclass, n.oid, 'SCHEMA', quote_ident(n.nspname), n.nspowner, n.nspacl
                   FROM pg_namespace n WHERE n.oid IN (SELECT o.oid FROM ours o))
        SELECT DISTINCT format('REVOKE ALL ON %s %s FROM %s', o.kind, o.name,
                               CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END)
          FROM objects o, aclexplode(o.acl) a
         WHERE a.grantee <> o.owner
           AND NOT (o.kind = 'TYPE' AND a.grantee = 0)  -- PUBLIC's by default, as for any type
           AND a.grantee NOT IN (SELECT r.oid FROM pg_roles r
                                  WHERE r.rolname IN ('outbox_producer', 'outbox_relay', 'outbox_admin', 'outbox_worker'))
           AND (NOT made_only
                OR EXISTS (SELECT FROM pg_init_privs i, aclexplode(i.initprivs) m
                            WHERE i.classoid = o.catalog AND i.objoid = o.id AND i.objsubid = 0
                              AND m.grantee = a.grantee))
    LOOP
        IF made_only THEN
            RAISE WARNING 'outbox_ext: %, which the installing role''s default privileges gave', statement
                USING HINT = 'Grant a role of outbox_ext (outbox_producer, outbox_relay, outbox_admin) instead.';
        END IF;
        EXECUTE statement;
    END LOOP;
END
$$;
SELECT outbox_internal._revoke_strangers(false);

REVOKE ALL ON SCHEMA outbox, inbox, outbox_internal
    FROM PUBLIC, outbox_producer, outbox_relay, outbox_admin, outbox_worker;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox, inbox, outbox_internal
    FROM PUBLIC, outbox_producer, outbox_relay, outbox_admin, outbox_worker;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox, inbox
    FROM PUBLIC, outbox_producer, outbox_relay, outbox_admin, outbox_worker;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox, inbox, outbox_internal
    FROM PUBLIC, outbox_producer, outbox_relay, outbox_admin, outbox_worker;

GRANT outbox_producer, outbox_relay TO outbox_admin;
GRANT outbox_relay TO outbox_worker;
GRANT USAGE ON SCHEMA outbox, inbox TO outbox_producer, outbox_relay, outbox_admin, outbox_worker;

-- outbox_producer: emit, nothing else
GRANT EXECUTE ON FUNCTION
    outbox.emit(text, text, text, jsonb, jsonb, text),
    outbox.emit_many(text, text, text[], jsonb[], jsonb, text),
    outbox.uuid_v7(),
    outbox.shard_count(),
    outbox.shard_of(text)
TO outbox_producer;

-- outbox_relay: read the log, claim and settle
GRANT SELECT ON outbox.events, outbox.status, outbox.shard_status TO outbox_relay;
-- what the status views ask of each shard (functions a view calls are checked against
-- whoever reads it)
GRANT EXECUTE ON FUNCTION outbox_internal._shard_pending(outbox._cursor_log, outbox.sinks)
    TO outbox_relay, outbox_admin;
-- and what outbox.partitions asks of each partition (outbox_admin reads it)
GRANT EXECUTE ON FUNCTION outbox_internal._bound_clause(pg_node_tree, oid) TO outbox_admin;
GRANT EXECUTE ON FUNCTION
    outbox.claim(text, int, interval, text, int),
    outbox.settle(text, int, bigint, jsonb),
    outbox.settle_and_claim(text, int, bigint, jsonb, int, interval, text, int),
    outbox.ack(text, int, bigint),
    outbox.nack(text, int, bigint, uuid, text, interval),
    outbox.reject(text, int, bigint, uuid, text),
    outbox.release(text, int, bigint, interval),
    outbox.release_owner(text, text),
    outbox.shard_count(),
    outbox.shard_of(text)
TO outbox_relay;

GRANT EXECUTE ON FUNCTION inbox.claim(uuid, text), inbox.uuid_time(uuid), inbox.uuid_at(timestamptz)
    TO outbox_producer, outbox_relay;

-- outbox_admin: consumers, sinks, dead letters, maintenance; reads everything
GRANT EXECUTE ON FUNCTION
    outbox.create_consumer(text, boolean, int, interval, interval),
    outbox.drop_consumer(text),
    outbox.replay(text, text),
    outbox.create_sink(text, text, text, text[], text[], text, int, int, interval, interval, text,
                       jsonb, text, jsonb, text, text, interval, text, text, int, interval,
                       interval, boolean),
    outbox.drop_sink(text),
    outbox.pause_sink(text),
    outbox.resume_sink(text),
    outbox.maintain()
TO outbox_admin;
GRANT SELECT ON outbox.events, outbox.consumers, outbox.sinks, outbox._sink_stats,
    outbox.dead_letters, outbox.partition_config, outbox.partitions, outbox.status,
    outbox.shard_status, outbox._shards, outbox._cursor_log, outbox._parked,
    outbox._parked_events, outbox._marks, outbox._seals, outbox._seal_breaks, outbox._reach, outbox._origin, inbox.messages
TO outbox_admin;
GRANT INSERT, UPDATE, DELETE ON outbox.sinks TO outbox_admin;   -- checked by its trigger
GRANT UPDATE (max_attempts, backoff_base, backoff_max) ON outbox.consumers TO outbox_admin;
GRANT UPDATE (width, ahead, retention, detach) ON outbox.partition_config TO outbox_admin;
GRANT DELETE ON outbox.dead_letters, inbox.messages TO outbox_admin;

-- outbox_worker: relays (outbox_relay), delivers with the sinks' settings, records their
-- figures, runs maintenance. It connects as this role (outbox_ext.worker_role).
GRANT SELECT ON outbox.sinks TO outbox_worker;
-- which consumer a batch was claimed for: a sink dropped and made again under its name is
-- another consumer, whose leases a late settle of the old one's batch must not touch
GRANT SELECT (id, name) ON outbox.consumers TO outbox_worker;
GRANT SELECT, INSERT, UPDATE ON outbox._sink_stats TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox.maintain() TO outbox_worker;
