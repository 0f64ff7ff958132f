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
-- Events, consumers, cursors, parked keys and dead letters are not touched.
--
-- Rerunnable. Each "-- @include" line stands for that file of sql/, expanded when the
-- extension is installed (scripts/lib.sh); freeze this file (expand them) when a later
-- version changes those files.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.6.0'" to load this file. \quit

-- @include roles.sql

-- As pgrx declares it (src/sinks/check.rs).
CREATE OR REPLACE FUNCTION outbox."_check_sink_settings"(
	"secret" TEXT, /* Option < & str > */
	"http_headers" jsonb, /* Option < JsonB > */
	"tls_ca" TEXT /* Option < & str > */
) RETURNS void
IMMUTABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'check_sink_settings_wrapper';

-- @include sinks.sql
-- @include partitions.sql
-- @include grants.sql

DO $check$
DECLARE
    s outbox.sinks;
BEGIN
    FOR s IN SELECT * FROM outbox.sinks ORDER BY name LOOP
        BEGIN
            PERFORM outbox._check_sink_settings(s.secret, s.http_headers, s.tls_ca);
        EXCEPTION WHEN invalid_parameter_value THEN
            RAISE WARNING 'sink "%": %', s.name, SQLERRM
                USING HINT = 'The worker cannot deliver to it until its row is fixed (UPDATE outbox.sinks).';
        END;
    END LOOP;
END
$check$;
