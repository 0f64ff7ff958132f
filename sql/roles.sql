-- outbox_ext: schemas and roles. Runs first (bootstrap).
--
-- Roles are cluster-wide, so they are created only where missing: CREATE EXTENSION in a
-- second database, or after DROP EXTENSION, must not fail on them.
--   outbox_producer  emits events, nothing else (cannot read events or configuration)
--   outbox_relay     claims, acks and nacks events; reads the event log
--   outbox_admin     everything: sinks, maintenance, dead letters (member of both above)

CREATE SCHEMA outbox;
CREATE SCHEMA inbox;

DO $roles$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['outbox_producer', 'outbox_relay', 'outbox_admin'] LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = r) THEN
            EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', r);
        END IF;
    END LOOP;
END
$roles$;
