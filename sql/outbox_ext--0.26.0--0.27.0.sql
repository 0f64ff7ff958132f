-- outbox_ext 0.26.0 -> 0.27.0
--
-- Why: a batch given back (outbox.release, outbox.release_owner, or a lease that ran out) kept
-- the copies of its page's events in the queues of keys parked before it; the next claim could
-- read a smaller page (the worker probes a suspended sink with 10 events), and a copy beyond it
-- went out from the queue and again when the shard read it in the log. They go back with the
-- batch now, found by id (a queue may hold events of an earlier window whose seqs fall inside
-- the page's range: those stay). The step that unparks keys the batch parked told the page by
-- seq range too: a key whose head the batch rejected, its queue left with an event of an earlier
-- window, was unparked and that event lost. And a restore gave back the batch out at dump time
-- without any of this: a key its relay had nacked kept the queue the nack made, and the key's
-- earlier events of the batch, read again, were queued behind the nacked one.

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

-- Every cursor: its batch out at dump time (lease, parked heads) comes again, given back as
-- outbox.release gives it back (a key its relay had nacked is read again from the batch's page,
-- in order), and it reads the dump's events in the dump's ids, then the rest (see the header).
-- Marks go: their xids are the dump's, and claims make new ones. Seals go too (one made while
-- the dump loaded knew nothing of its events); maintain() seals the rebased log.
CREATE OR REPLACE FUNCTION outbox_internal._rebase() RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    n   bigint;
    top xid8;
    sh  outbox._shards;
    cur outbox._cursor_log;
BEGIN
    SELECT greatest(max(e.seq), coalesce(pg_sequence_last_value('outbox.event_seq'), 0)), max(e.txid)
      INTO n, top FROM outbox.events e;
    SELECT greatest(top, max(greatest(l.lo_top, l.hi_top, pg_snapshot_xmax(l.lo_snap),
                                      pg_snapshot_xmax(l.hi_snap))))
      INTO top FROM outbox._cursor_log l;
    top := (coalesce(top::text::bigint, 2) + 1)::text::xid8;
    FOR sh IN SELECT * FROM outbox._shards s ORDER BY s.consumer_id, s.shard FOR UPDATE LOOP
        cur := outbox_internal._cursor(sh.consumer_id, sh.shard);
        IF cur.owner IS NOT NULL THEN
            PERFORM outbox_internal._unpark_released(c, cur)
               FROM outbox.consumers c WHERE c.id = sh.consumer_id;
        END IF;
        IF cur.restored_seq IS NOT NULL THEN
            -- restored again before it read an earlier dump's events: all of them from its
            -- floor on come again (the ids of two dumps cannot be told apart)
            cur := outbox_internal._lo_after_seq(cur, outbox_internal._pending_floor(cur));
        END IF;
        cur.owner := NULL; cur.lease_until := NULL;
        cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
        cur.restored_seq := n; cur.restored_top := top;
        PERFORM outbox_internal._append(cur);
    END LOOP;
    DELETE FROM outbox._marks;
    DELETE FROM outbox._seals;
    UPDATE outbox._origin
       SET restore_pending = false, restored_seq = n, restored_top = top, made_in = outbox_internal._here();
    RAISE NOTICE 'outbox_ext: rebased the outbox restored from a dump (events up to seq %, txids below %)', n, top;
END
$$;
