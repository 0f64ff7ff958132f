-- outbox_ext 0.26.0 -> 0.27.0
--
-- Why: a batch given back (outbox.release, outbox.release_owner, or a lease that ran out) kept
-- the copies of its page's events in the queues of keys parked before it; the next claim could
-- read a smaller page (the worker probes a suspended sink with 10 events), and a copy beyond it
-- went out from the queue and again when the shard read it in the log. They go back with the
-- batch now, found by id (a queue may hold events of an earlier window whose seqs fall inside
-- the page's range: those stay).

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.27.0'" to load this file. \quit

-- A batch given back (release) after nack parked keys of it: a key that this batch parked
-- (its queue holds only copies of this batch's page, none of them a parked head it handed out)
-- is unparked, its queue dropped, as if the batch had never been claimed. The shard reads the
-- page again, so the key's events come back in order: kept, the earlier ones would be queued
-- behind the failed one. A key parked before (its head handed out and nacked) keeps its queue
-- and the attempt counted, less the copies of this page's events: the next claim may read a
-- smaller page, and a copy beyond it would go out from the queue and again from the log.
-- The page's events are known by id, not by seq range: a queue may hold an event of an earlier
-- window whose seq falls inside this page's range.
CREATE OR REPLACE FUNCTION outbox_internal._unpark_released(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    page uuid[];  -- the ids of the batch's page: what its claim may have copied into queues
BEGIN
    IF NOT EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = c.id AND p.shard = cur.shard) THEN
        RETURN;  -- no queue to clean (the common case: the page is not read again)
    END IF;
    page := ARRAY(SELECT e.id FROM unnest(outbox_internal._batch(cur)) e);
    WITH unparked AS (
        DELETE FROM outbox._parked p
         WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch
           AND NOT EXISTS (SELECT FROM outbox._parked_events q
                            WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                              AND (q.id = ANY (cur.heads) OR q.id <> ALL (page)))
        RETURNING p.aggregate_id)
    DELETE FROM outbox._parked_events q
     USING unparked u
     WHERE q.consumer_id = c.id AND q.aggregate_id = u.aggregate_id;
    DELETE FROM outbox._parked_events q
     WHERE q.consumer_id = c.id AND q.id = ANY (page);
END
$$;
