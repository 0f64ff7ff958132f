-- outbox_ext: DROP EXTENSION outbox_ext does not discard undelivered events silently. An event
-- trigger (native, src/backup.rs) refuses the DROP while a consumer has events pending, parked
-- keys or dead letters, unless outbox_ext.drop_undelivered is on.
--
-- Name resolution (sql/grants.sql): _undelivered is [pinned]; the trigger function is [native]
-- and runs one statement, SELECT outbox_internal._undelivered().
--
-- Rerunnable.

-- What would be lost, per consumer, or NULL when nothing would.
CREATE OR REPLACE FUNCTION outbox_internal._undelivered() RETURNS text
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT string_agg(format('%s: %s pending, %s parked keys, %s dead letters',
                             s.consumer, s.pending, s.parked_keys, s.dead_letters), '; '
                      ORDER BY s.consumer)
      FROM outbox.status s
     WHERE s.pending > 0 OR s.parked_keys > 0 OR s.dead_letters > 0;
END;

CREATE OR REPLACE FUNCTION outbox_internal._guard_drop() RETURNS event_trigger
    LANGUAGE c AS 'MODULE_PATHNAME', 'outbox_guard_drop';

DO $guard$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_event_trigger WHERE evtname = 'outbox_ext_guard_drop') THEN
        CREATE EVENT TRIGGER outbox_ext_guard_drop ON ddl_command_start
            WHEN TAG IN ('DROP EXTENSION') EXECUTE FUNCTION outbox_internal._guard_drop();
    END IF;
END
$guard$;
