-- outbox_ext 0.20.0 -> 0.21.0
--
-- Why: the event trigger that refuses to drop outbox_ext while events are undelivered fired only
-- on DROP EXTENSION naming it, and only where session_replication_role was not replica. DROP
-- EXTENSION plpgsql CASCADE, DROP LANGUAGE plpgsql CASCADE and DROP OWNED BY its owner took it
-- along with every event, and so did DROP EXTENSION outbox_ext in a replica-role session. The
-- trigger now fires on DROP EXTENSION, DROP LANGUAGE and DROP OWNED, enabled ALWAYS; the native
-- function (src/backup.rs) tells which of those statements drop outbox_ext.
--
-- A delta: what changed from 0.20.0 to 0.21.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.21.0'" to load this file. \quit

DO $guard$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_event_trigger t
                    WHERE t.evtname OPERATOR(pg_catalog.=) 'outbox_ext_guard_drop'
                      AND t.evttags OPERATOR(pg_catalog.=) ARRAY['DROP EXTENSION', 'DROP LANGUAGE', 'DROP OWNED']) THEN
        DROP EVENT TRIGGER IF EXISTS outbox_ext_guard_drop;
        CREATE EVENT TRIGGER outbox_ext_guard_drop ON ddl_command_start
            WHEN TAG IN ('DROP EXTENSION', 'DROP LANGUAGE', 'DROP OWNED')
            EXECUTE FUNCTION outbox_internal._guard_drop();
    END IF;
END
$guard$;
ALTER EVENT TRIGGER outbox_ext_guard_drop ENABLE ALWAYS;
