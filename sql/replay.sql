-- outbox_ext: replay — dead letters back in their keys' queues.
--
-- Keeps: replayed events go behind anything already queued for their keys, in the order they
-- died; the consumer's shards are held meanwhile, so no ack unparks a key being queued into.
-- A dead letter whose event is a head of a batch still out (a relay rejected it, or nacked its
-- last attempt, and has not settled the batch) stays dead until the batch is settled or given
-- back: settling it delivers its heads by id, and would take the copy queued again for one.
--
-- Name resolution (sql/grants.sql): the API functions are [pinned], helpers (outbox_internal._*) run
-- [inside] them and do not pin search_path themselves: only the SECURITY DEFINER API functions
-- call them, and those pin it. A SET clause on every helper would cost each call a GUC save and
-- restore and a new search path lookup, about 5% of a claim.

CREATE OR REPLACE FUNCTION outbox.replay(consumer text, aggregate_id text DEFAULT NULL) RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c       outbox.consumers := outbox_internal._consumer(consumer);
    n       int;
    out     uuid[];  -- heads of batches still out: their dead letters wait (see the header)
    waiting int;
BEGIN
    -- Hold every shard of the consumer so no ack unparks a key while we queue into it.
    PERFORM FROM outbox._shards s WHERE s.consumer_id = c.id ORDER BY s.shard FOR UPDATE;
    IF NOT FOUND THEN  -- dropped while we waited: its name's dead letters may be another's now
        RAISE EXCEPTION 'consumer "%" does not exist', consumer
            USING ERRCODE = 'undefined_object',
                  HINT = 'It was dropped while outbox.replay waited for its shards.';
    END IF;
    out := ARRAY(SELECT h.id
                   FROM generate_series(0, outbox.shard_count() - 1) AS s(shard)
                  CROSS JOIN LATERAL outbox_internal._cursor(c.id, s.shard) AS cur
                  CROSS JOIN LATERAL unnest(cur.heads) AS h(id)
                  WHERE cur.owner IS NOT NULL);
    INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
    SELECT DISTINCT c.id, d.aggregate_id, outbox.shard_of(d.aggregate_id), now()
      FROM outbox.dead_letters d
     WHERE d.consumer = c.name AND (replay.aggregate_id IS NULL OR d.aggregate_id = replay.aggregate_id)
       AND d.event_id <> ALL (out)
    ON CONFLICT DO NOTHING;
    WITH moved AS (
        DELETE FROM outbox.dead_letters d
         WHERE d.consumer = c.name AND (replay.aggregate_id IS NULL OR d.aggregate_id = replay.aggregate_id)
           AND d.event_id <> ALL (out)
        RETURNING d.*)
    INSERT INTO outbox._parked_events (consumer_id, aggregate_id, id, topic, aggregate_type,
                                       event_type, payload, headers, created_at, seq)
    SELECT c.id, m.aggregate_id, m.event_id, m.topic, m.aggregate_type, m.event_type, m.payload,
           m.headers, m.created_at, m.seq
      FROM moved m ORDER BY m.id
    ON CONFLICT (consumer_id, id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    waiting := (SELECT count(*) FROM outbox.dead_letters d
                 WHERE d.consumer = c.name AND (replay.aggregate_id IS NULL OR d.aggregate_id = replay.aggregate_id)
                   AND d.event_id = ANY (out));
    IF waiting > 0 THEN
        RAISE NOTICE '% dead letter(s) of consumer "%" stay dead for now: their batch is still out', waiting, c.name
            USING DETAIL = 'A relay rejected them (or nacked their last attempt) and has not settled that batch yet.',
                  HINT = 'Replay again once the batch is settled, given back, or its lease has run out and a claim took the shard.';
    END IF;
    IF n > 0 THEN
        PERFORM outbox_internal._replan_when_grown('outbox._parked');
        PERFORM outbox_internal._replan_when_grown('outbox._parked_events');
    END IF;
    RETURN n;
END
$$;

COMMENT ON FUNCTION outbox.replay(text, text) IS
    'Re-queues a consumer''s dead letters (all, or of one key), in the order they died, behind '
    'anything already queued for their keys; returns how many. Example: SELECT outbox.replay(''hook'');';
