-- outbox_ext 0.19.0 -> 0.20.0
--
-- Why: 0.19.0 made _cursor_log and _parked reference (consumer_id, shard) in outbox._shards.
-- A dump made at 0.18.0 or before knows nothing of those keys, so pg_dump orders their rows
-- before the shards' rows, and restoring it where 0.19.0 is installed failed: table by table
-- (pg_restore) the cursors and parked keys were not restored; in one transaction nothing was.
-- Neither table has a foreign key now: only a relay holding the shard's row writes them, and
-- outbox.drop_consumer, the one place a consumer's shards go, deletes them itself. Relays
-- still lock nothing but the shards they take.
--
-- A delta: what changed from 0.19.0 to 0.20.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.20.0'" to load this file. \quit

-- Taken as relays take them (a shard's row, then the tables it writes), so that a relay
-- under way finishes first instead of deadlocking with the ALTERs.
LOCK TABLE outbox._shards, outbox._cursor_log, outbox._parked IN ACCESS EXCLUSIVE MODE;

ALTER TABLE outbox._cursor_log DROP CONSTRAINT IF EXISTS _cursor_log_consumer_id_shard_fkey;
ALTER TABLE outbox._parked DROP CONSTRAINT IF EXISTS _parked_consumer_id_shard_fkey;

CREATE OR REPLACE FUNCTION outbox.drop_consumer(name text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c_id int := (SELECT c.id FROM outbox.consumers c WHERE c.name = drop_consumer.name);
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'name', 'outbox.drop_consumer');
    -- Its shards first, in order, as claims and settles take them before they write a cursor
    -- row: the drop waits for a claim or a settle under way, then deletes what no one holds.
    PERFORM FROM outbox._shards s WHERE s.consumer_id = c_id ORDER BY s.shard FOR UPDATE;
    DELETE FROM outbox._cursor_log l WHERE l.consumer_id = c_id;
    DELETE FROM outbox._parked p WHERE p.consumer_id = c_id;  -- and their queues (a cascade)
    DELETE FROM outbox.dead_letters d WHERE d.consumer = drop_consumer.name;
    DELETE FROM outbox.consumers c WHERE c.id = c_id;         -- and its shards (a cascade)
    RETURN FOUND;
END
$$;
