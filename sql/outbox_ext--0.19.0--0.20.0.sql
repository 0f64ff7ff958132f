-- outbox_ext 0.19.0 -> 0.20.0
--
-- Why: 0.19.0 made _cursor_log and _parked reference (consumer_id, shard) in outbox._shards.
-- A dump made at 0.18.0 or before knows nothing of those keys, so pg_dump orders their rows
-- before the shards' rows, and restoring it where 0.19.0 is installed failed: table by table
-- (pg_restore) the cursors and parked keys were not restored; in one transaction nothing was.
-- Neither table has a foreign key now: only a transaction holding the shard's row writes them,
-- and outbox.drop_consumer, the one place a consumer's shards go, deletes them itself (at
-- READ COMMITTED only, so that it sees what relays commit while it waits). Relays still lock
-- nothing but the shards they take. outbox.replay refuses a consumer dropped while it waited
-- for the shards (the foreign key refused its rows before).
--
-- A delta: what changed from 0.19.0 to 0.20.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.20.0'" to load this file. \quit

-- Taken in one statement before the ALTERs. A relay that settles holds its shard's row before
-- it touches these tables, so it finishes first; a claim reads the cursor log before it locks
-- a shard, so an UPDATE run while relays claim may end in "deadlock detected" and change
-- nothing: run it again.
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
    -- The deletes below must see the rows relays commit while the drop waits for their shards:
    -- with a snapshot taken before, those would be left behind.
    IF pg_catalog.current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        RAISE EXCEPTION 'outbox.drop_consumer must run at READ COMMITTED, not %',
                pg_catalog.upper(pg_catalog.current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'Call it in a READ COMMITTED transaction (the default isolation level).';
    END IF;
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

CREATE OR REPLACE FUNCTION outbox.replay(consumer text, aggregate_id text DEFAULT NULL) RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c outbox.consumers := outbox_internal._consumer(consumer);
    n int;
BEGIN
    -- Hold every shard of the consumer so no ack unparks a key while we queue into it.
    PERFORM FROM outbox._shards s WHERE s.consumer_id = c.id ORDER BY s.shard FOR UPDATE;
    IF NOT FOUND THEN  -- dropped while we waited: its name's dead letters may be another's now
        RAISE EXCEPTION 'consumer "%" does not exist', consumer
            USING ERRCODE = 'undefined_object',
                  HINT = 'It was dropped while outbox.replay waited for its shards.';
    END IF;
    INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
    SELECT DISTINCT c.id, d.aggregate_id, outbox.shard_of(d.aggregate_id), now()
      FROM outbox.dead_letters d
     WHERE d.consumer = c.name AND (replay.aggregate_id IS NULL OR d.aggregate_id = replay.aggregate_id)
    ON CONFLICT DO NOTHING;
    WITH moved AS (
        DELETE FROM outbox.dead_letters d
         WHERE d.consumer = c.name AND (replay.aggregate_id IS NULL OR d.aggregate_id = replay.aggregate_id)
        RETURNING d.*)
    INSERT INTO outbox._parked_events (consumer_id, aggregate_id, id, topic, aggregate_type,
                                       event_type, payload, headers, created_at, seq)
    SELECT c.id, m.aggregate_id, m.event_id, m.topic, m.aggregate_type, m.event_type, m.payload,
           m.headers, m.created_at, m.seq
      FROM moved m ORDER BY m.id
    ON CONFLICT (consumer_id, id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;
