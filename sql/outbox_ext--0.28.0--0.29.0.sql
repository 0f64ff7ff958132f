-- outbox_ext 0.28.0 -> 0.29.0
--
-- Why: a batch given back (release, release_owner, a lease that ran out, a restore) after
-- reject, or after a nack of an event's last attempt, left the event in outbox.dead_letters
-- while the page was read again and the event delivered: it was both dead and delivered, and
-- a replay sent it once more, after its key's later events. The dead letters of the page's
-- events now go back with the batch, as its parked keys and queued copies already did.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.29.0'" to load this file. \quit

-- A batch given back (release, release_owner, a lease that ran out, a restore) after nack or
-- reject: the shard reads its page again, so what the batch's failures made of the page's
-- events is undone. A key that this batch parked (its queue holds only copies of this batch's
-- page, none of them a parked head it handed out) is unparked, its queue dropped, as if the
-- batch had never been claimed: kept, its earlier events would be queued behind the failed one.
-- A key parked before (its head handed out and nacked) keeps its queue and the attempt counted,
-- less the copies of this page's events: the next claim may read a smaller page, and a copy
-- beyond it would go out from the queue and again from the log. And an event of the page
-- dead-lettered at once (reject, or a nack of its last attempt) comes again with the page, so
-- its dead letter goes: kept, the event was both delivered and dead, and a replay sent it again
-- after its key's later events. A dead head stays dead: it left its queue, and is not read again.
-- The page's events are known by id, not by seq range: a queue may hold an event of an earlier
-- window whose seq falls inside this page's range.
CREATE OR REPLACE FUNCTION outbox_internal._unpark_released(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    page outbox.events[];  -- the batch's page: what its claim may have copied into queues
    ids  uuid[];           -- and their ids
BEGIN
    IF NOT EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = c.id AND p.shard = cur.shard)
       AND NOT EXISTS (SELECT FROM outbox.dead_letters d WHERE d.consumer = c.name) THEN
        RETURN;  -- nothing to undo (the common case: the page is not read again)
    END IF;
    page := outbox_internal._batch(cur);
    ids := ARRAY(SELECT e.id FROM unnest(page) e);
    WITH unparked AS (
        DELETE FROM outbox._parked p
         WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch
           AND NOT EXISTS (SELECT FROM outbox._parked_events q
                            WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                              AND (q.id = ANY (cur.heads) OR q.id <> ALL (ids)))
        RETURNING p.aggregate_id)
    DELETE FROM outbox._parked_events q
     USING unparked u
     WHERE q.consumer_id = c.id AND q.aggregate_id = u.aggregate_id;
    DELETE FROM outbox._parked_events q
     WHERE q.consumer_id = c.id AND q.id = ANY (ids);
    DELETE FROM outbox.dead_letters d
     USING unnest(page) e
     WHERE d.consumer = c.name AND d.aggregate_id = e.aggregate_id AND d.event_id = e.id;
END
$$;
