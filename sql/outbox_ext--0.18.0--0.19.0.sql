-- outbox_ext 0.18.0 -> 0.19.0
--
-- Why: _cursor_log and _parked referenced outbox.consumers, so every row a claim, settle or
-- release wrote share-locked the consumer's row: a WAL record each time, and a multixact
-- whenever two relays of one consumer overlapped (2 relays draining 100,000 events made 616),
-- which brings anti-wraparound vacuums of every table nearer. They now reference the shard's
-- row in outbox._shards, which every writer of theirs holds locked already; dropping a
-- consumer still cascades through its shards to both.
--
-- A delta: what changed from 0.18.0 to 0.19.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.19.0'" to load this file. \quit

ALTER TABLE outbox._cursor_log
    DROP CONSTRAINT IF EXISTS _cursor_log_consumer_id_fkey,
    DROP CONSTRAINT IF EXISTS _cursor_log_consumer_id_shard_fkey,
    ADD CONSTRAINT _cursor_log_consumer_id_shard_fkey
        FOREIGN KEY (consumer_id, shard) REFERENCES outbox._shards ON DELETE CASCADE;

ALTER TABLE outbox._parked
    DROP CONSTRAINT IF EXISTS _parked_consumer_id_fkey,
    DROP CONSTRAINT IF EXISTS _parked_consumer_id_shard_fkey,
    ADD CONSTRAINT _parked_consumer_id_shard_fkey
        FOREIGN KEY (consumer_id, shard) REFERENCES outbox._shards ON DELETE CASCADE;

CREATE OR REPLACE FUNCTION outbox.drop_consumer(name text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'name', 'outbox.drop_consumer');
    -- Its shards first, in order, as claims and acks take them before they write a cursor row:
    -- the drop waits for a claim or an ack under way, then deletes (through the consumer's
    -- cascade) shards no one holds.
    PERFORM FROM outbox._shards s JOIN outbox.consumers c ON c.id = s.consumer_id
     WHERE c.name = drop_consumer.name ORDER BY s.shard FOR UPDATE OF s;
    DELETE FROM outbox.dead_letters d WHERE d.consumer = drop_consumer.name;
    DELETE FROM outbox.consumers c WHERE c.name = drop_consumer.name;
    RETURN FOUND;
END
$$;
