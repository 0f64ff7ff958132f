-- outbox_ext 0.5.0 -> 0.6.0
--
-- Why: no role may reach a superuser's power through the extension.
-- - The background worker runs as a new role, outbox_worker (NOLOGIN; outbox_ext.worker_role),
--   not as the bootstrap superuser, with search_path pg_catalog, pg_temp.
-- - Grants name exactly what each role needs (never ALL: no TRIGGER, TRUNCATE or REFERENCES
--   on our tables, which let a trigger run inside the worker and the SECURITY DEFINER
--   functions as their owner); partitions, those maintain() made before included, keep no
--   grant at all, and maintain() strips the default privileges new ones would get.
-- - Sink settings are checked as the worker uses them: a secret's key length, header names
--   and values, CA certificates (outbox._check_sink_settings). Sinks saved earlier that fail
--   the check are reported with a WARNING here and left as they are.
-- - Backups: pg_dump brings back everything a running outbox holds (sql/dump.sql marks the
--   extension's tables); a restored state is recognised and rebased onto the restoring
--   cluster's transaction ids (sql/restore.sql: outbox._origin, two new cursor columns). Dated
--   partitions leave the extension (pg_dump then writes them whole), and their index (events)
--   or unique key (inbox) moves from the parent to each partition, so that a restore does not
--   make them twice: the parent's index and key are dropped and each partition's made, which
--   rebuilds them (an UPDATE of a large outbox takes that long).
-- - DROP EXTENSION outbox_ext is refused while events are undelivered (sql/drop_guard.sql).
--   Events, consumers, cursors, parked keys and dead letters are kept as they are.
--
-- Rerunnable. Each "-- @include" line stands for that file of sql/, expanded when the
-- extension is installed (scripts/lib.sh); freeze this file (expand them) when a later
-- version changes those files.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.6.0'" to load this file. \quit

-- @include roles.sql

ALTER TABLE outbox._cursor_log ADD COLUMN IF NOT EXISTS restored_seq bigint,
                               ADD COLUMN IF NOT EXISTS restored_top xid8;
DROP INDEX IF EXISTS outbox.events_read_idx;                -- with the partitions' copies
ALTER TABLE inbox.messages DROP CONSTRAINT IF EXISTS messages_pkey;

-- @include claim.sql

-- As pgrx declares it (src/sinks/check.rs).
CREATE OR REPLACE FUNCTION outbox."_check_sink_settings"(
	"secret" TEXT, /* Option < & str > */
	"http_headers" jsonb, /* Option < JsonB > */
	"tls_ca" TEXT /* Option < & str > */
) RETURNS void
IMMUTABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'check_sink_settings_wrapper';

-- @include inbox.sql
-- @include sinks.sql
-- @include partitions.sql
-- @include restore.sql
-- @include status.sql
-- @include drop_guard.sql

-- Every partition gets its own index or key; dated ones leave the extension.
DO $partitions$
DECLARE
    p record;
BEGIN
    FOR p IN SELECT i.inhparent::regclass AS parent, i.inhrelid::regclass AS part,
                    EXISTS (SELECT FROM pg_catalog.pg_depend d
                             WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                               AND d.objid = i.inhrelid AND d.deptype = 'e') AS member
               FROM pg_catalog.pg_inherits i
              WHERE i.inhparent IN ('outbox.events'::pg_catalog.regclass, 'inbox.messages'::pg_catalog.regclass)
                AND i.inhrelid NOT IN ('outbox.events_default'::pg_catalog.regclass,
                                       'inbox.messages_default'::pg_catalog.regclass) LOOP
        IF p.member THEN
            EXECUTE pg_catalog.format('ALTER EXTENSION outbox_ext DROP TABLE %s', p.part);
        END IF;
        PERFORM outbox._index_partition(p.parent, p.part);
    END LOOP;
END
$partitions$;

-- @include dump.sql
-- @include grants.sql

-- Sink rows the new checks refuse: the worker could not deliver with them, and a dump of them
-- could not be restored (the checks run on every row written). Each such sink is disabled
-- and the refused settings cleared, with a WARNING to set them anew.
DO $check$
DECLARE
    s       outbox.sinks;
    cleared text[];
BEGIN
    ALTER TABLE outbox.sinks DISABLE TRIGGER check_sink;
    FOR s IN SELECT * FROM outbox.sinks ORDER BY name LOOP
        cleared := '{}';
        BEGIN
            PERFORM outbox._check_sink_settings(s.secret, NULL, NULL);
        EXCEPTION WHEN invalid_parameter_value THEN
            s.secret := NULL; cleared := cleared || 'secret'::text;
        END;
        BEGIN
            PERFORM outbox._check_sink_settings(NULL, s.http_headers, NULL);
        EXCEPTION WHEN invalid_parameter_value THEN
            s.http_headers := NULL; cleared := cleared || 'http_headers'::text;
        END;
        BEGIN
            PERFORM outbox._check_sink_settings(NULL, NULL, s.tls_ca);
        EXCEPTION WHEN invalid_parameter_value THEN
            s.tls_ca := NULL; cleared := cleared || 'tls_ca'::text;
        END;
        IF EXISTS (SELECT FROM jsonb_each_text(s.topic_map) AS m(k, v)
                    WHERE v !~ '^[A-Za-z0-9._-]{1,249}$' OR v IN ('.', '..')) THEN
            s.topic_map := NULL; cleared := cleared || 'topic_map'::text;
        END IF;
        IF cardinality(s.topics) = 0 OR array_position(s.topics, NULL) IS NOT NULL THEN
            s.topics := NULL; cleared := cleared || 'topics'::text;
        END IF;
        IF cardinality(s.aggregate_types) = 0 OR array_position(s.aggregate_types, NULL) IS NOT NULL THEN
            s.aggregate_types := NULL; cleared := cleared || 'aggregate_types'::text;
        END IF;
        CONTINUE WHEN cardinality(cleared) = 0;
        UPDATE outbox.sinks k
           SET enabled = false, secret = s.secret, http_headers = s.http_headers, tls_ca = s.tls_ca,
               topic_map = s.topic_map, topics = s.topics, aggregate_types = s.aggregate_types,
               updated_at = now()
         WHERE k.name = s.name;
        RAISE WARNING 'sink "%" is disabled: its % did not pass the checks of 0.6.0 and were cleared',
                s.name, array_to_string(cleared, ', ')
            USING HINT = 'Set them anew and enable it: UPDATE outbox.sinks SET ..., enabled = true WHERE name = ...;';
    END LOOP;
    ALTER TABLE outbox.sinks ENABLE TRIGGER check_sink;
END
$check$;
