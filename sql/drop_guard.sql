-- outbox_ext: dropping outbox_ext does not discard undelivered events silently. An event
-- trigger (native, src/backup.rs) refuses a statement that would drop it (DROP EXTENSION, or a
-- cascade or DROP OWNED that takes it along) while a consumer has events pending, parked keys
-- or dead letters, unless outbox_ext.drop_undelivered is on.
--
-- Name resolution (sql/grants.sql): _undelivered is [pinned]; the trigger function is [native]
-- and runs two statements, SELECT outbox_internal._undelivered() and a lookup of outbox_ext's
-- owner in pg_catalog.pg_extension, every name and operator qualified.
--
-- Rerunnable.

-- What would be lost, per consumer, or NULL when nothing would. Found nothing, it reads again
-- with the events table locked, as the drop would lock it: an emit in progress when the
-- statement came would otherwise commit unseen before the drop got its lock, and go with the
-- table. So at READ COMMITTED only (_check_read_committed), where each statement reads what is
-- committed when it starts. (Not locked first: a drop refused anyway would wait behind every
-- reader of the table, a dump say, and queue every emit and claim behind it meanwhile.)
CREATE OR REPLACE FUNCTION outbox_internal._undelivered() RETURNS text
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    lost text;
BEGIN
    FOR pass IN 1 .. 2 LOOP
        SELECT string_agg(format('%s: %s pending, %s parked keys, %s dead letters',
                                 s.consumer, s.pending, s.parked_keys, s.dead_letters), '; '
                          ORDER BY s.consumer)
          INTO lost
          FROM outbox.status s
         WHERE s.pending > 0 OR s.parked_keys > 0 OR s.dead_letters > 0;
        EXIT WHEN lost IS NOT NULL OR pass = 2;
        PERFORM outbox_internal._check_read_committed('a statement that drops outbox_ext');
        LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE;
    END LOOP;
    RETURN lost;
END
$$;

CREATE OR REPLACE FUNCTION outbox_internal._guard_drop() RETURNS event_trigger
    LANGUAGE c AS 'MODULE_PATHNAME', 'outbox_guard_drop';

-- The statements that may drop outbox_ext: DROP EXTENSION, and DROP LANGUAGE plpgsql CASCADE
-- and DROP OWNED BY its owner, which take it along (src/backup.rs says which drop it). Enabled
-- ALWAYS: a session with session_replication_role = replica skips triggers enabled the usual way.
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
