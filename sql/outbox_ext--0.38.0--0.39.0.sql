-- outbox_ext 0.38.0 -> 0.39.0
--
-- Why: HEADER
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.39.0'" to load this file. \quit

-- (a give-back undoes the attempt of a key this batch parked, though a replay keeps it parked)
CREATE OR REPLACE FUNCTION outbox_internal._unpark_released(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    page    outbox.events[];  -- the batch's page: what its claim may have copied into queues
    ids     uuid[];           -- and their ids
    emptied text[];           -- keys whose queues lost events of the page
BEGIN
    IF NOT EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = c.id AND p.shard = cur.shard)
       AND NOT EXISTS (SELECT FROM outbox.dead_letters d WHERE d.consumer = c.name) THEN
        RETURN;  -- nothing to undo (the common case: the page is not read again)
    END IF;
    page := outbox_internal._batch(cur);
    ids := ARRAY(SELECT e.id FROM unnest(page) e);
    UPDATE outbox._parked p
       SET attempts = 0, next_attempt_at = now(), nacked_epoch = NULL, nacked_pos = NULL
     WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch
       AND (p.nacked_pos IS NULL  -- parked by this batch (a window event failed): a replay's
                                  -- event may keep it parked, on no attempt of its own
            OR EXISTS (SELECT FROM outbox._parked_events q
                        WHERE q.aggregate_id = p.aggregate_id AND q.consumer_id = c.id
                          AND q.pos = p.nacked_pos AND q.id = ANY (ids)
                       OFFSET 0));  -- a lookup by the key's queue position, not a semi-join
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
    WITH gone AS (DELETE FROM outbox._parked_events q
                   WHERE q.consumer_id = c.id AND q.id = ANY (ids) RETURNING q.aggregate_id)
    SELECT array_agg(DISTINCT g.aggregate_id) INTO emptied FROM gone g;
    -- a key whose whole queue was of the page (a replay queued its dead letter while the batch
    -- was out) flows with the page again: parked with nothing queued, it would take a due
    -- head's place in claims and hand out nothing
    PERFORM outbox_internal._unpark_emptied(c.id, coalesce(emptied, '{}'));
    DELETE FROM outbox.dead_letters d
     USING unnest(page) e
     WHERE d.consumer = c.name AND d.aggregate_id = e.aggregate_id AND d.event_id = e.id;
END
$$;

-- (a reject of an event nacked in its batch is refused, not ignored)
CREATE OR REPLACE FUNCTION outbox_internal._fail_keys(c outbox.consumers, cur outbox._cursor_log,
                                             batch outbox.events[], firsts outbox_internal._failure[]) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    fresh   outbox_internal._failure[];  -- the keys not failed in this batch before
    early   uuid;
    retried uuid;
    parked  text[];
    riders  text[];  -- keys with heads in this batch whose events of the page failed
    kept    int;
BEGIN
    -- where each key failed in this batch before, if it did: a head's key by its record, a
    -- window event's key by its events of the batch already queued or dead-lettered
    WITH before AS (
        SELECT f, CASE WHEN f.head THEN
                   (SELECT p.nacked_pos FROM outbox._parked p
                     WHERE p.consumer_id = c.id AND p.aggregate_id = f.aggregate_id
                       AND p.nacked_epoch = cur.epoch)
               ELSE (SELECT min(x.seq) FROM unnest(batch) b
                      CROSS JOIN LATERAL (
                          SELECT q.seq FROM outbox._parked_events q
                           WHERE q.consumer_id = c.id AND q.id = b.id
                          UNION ALL
                          SELECT d.seq FROM outbox.dead_letters d
                           WHERE d.consumer = c.name AND d.aggregate_id = b.aggregate_id AND d.event_id = b.id) x
                      WHERE b.aggregate_id = f.aggregate_id)
               END AS failed_from
          FROM unnest(firsts) f)
    SELECT (SELECT (b.f).event_id FROM before b WHERE (b.f).seq < b.failed_from LIMIT 1),
           -- a reject of the very event a nack queued for a retry: it would change nothing
           (SELECT (b.f).event_id FROM before b
             WHERE (b.f).final AND (b.f).seq = b.failed_from
               AND EXISTS (SELECT FROM outbox._parked_events q
                            WHERE q.consumer_id = c.id AND q.id = (b.f).event_id)
             LIMIT 1),
           ARRAY(SELECT b.f FROM before b WHERE b.failed_from IS NULL)
      INTO early, retried, fresh;
    IF early IS NOT NULL THEN
        RAISE EXCEPTION 'event % comes before an event of its key already reported failed in this batch', early
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Report a key''s failures in batch order, or all at once with outbox.settle.';
    ELSIF retried IS NOT NULL THEN
        RAISE EXCEPTION 'event % was reported failed in this batch already, to be retried', retried
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Report an event''s failure once per claim: reject it the first time, or '
                         'when it is claimed again.';
    END IF;
    -- the window's events kept back: from a failed one on, or all that rode behind a failed head
    kept := (SELECT count(*) FROM unnest(batch) b JOIN unnest(fresh) f ON f.aggregate_id = b.aggregate_id
              WHERE CASE WHEN f.head THEN NOT EXISTS (SELECT FROM outbox._parked_events q
                                                       WHERE q.consumer_id = c.id AND q.id = b.id)
                         ELSE b.seq >= f.seq END);
    IF EXISTS (SELECT FROM unnest(fresh) f WHERE f.head) THEN
        -- the heads from each failed one on, each head looked up by its id (see _deliver_rest)
        kept := kept + (SELECT count(*) FROM unnest(cur.heads) AS out(id)
                         WHERE EXISTS (SELECT FROM outbox._parked_events h JOIN unnest(fresh) f
                                           ON f.head AND f.aggregate_id = h.aggregate_id AND h.pos >= f.seq
                                        WHERE h.consumer_id = c.id AND h.id = out.id OFFSET 0));
    END IF;
    -- window events park their keys; a key parked meanwhile (a replay) keeps its record: its
    -- events wait behind its queue, nothing counted
    WITH made AS (
        INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
        SELECT c.id, f.aggregate_id, cur.shard, now() FROM unnest(fresh) f WHERE NOT f.head
        ON CONFLICT DO NOTHING
        RETURNING aggregate_id)
    SELECT array_agg(m.aggregate_id) INTO parked FROM made m;
    IF parked IS NOT NULL THEN
        PERFORM outbox_internal._replan_when_grown('outbox._parked');
    END IF;
    IF cardinality(cur.heads) > 0 AND EXISTS (SELECT FROM unnest(fresh) f WHERE NOT f.head) THEN
        -- (not a key whose queue a replay lengthened while the batch was out: the replayed
        -- event heads it once the heads are through, and did not fail). Each failed key's
        -- queue is looked up on its own (OFFSET 0: a semi- or anti-join planned while the
        -- queues were tiny could read all of them); most are empty, the key not parked.
        riders := ARRAY(SELECT f.aggregate_id FROM unnest(fresh) f
                         WHERE NOT f.head
                           AND EXISTS (SELECT FROM outbox._parked_events q
                                        WHERE q.aggregate_id = f.aggregate_id AND q.consumer_id = c.id
                                          AND q.id = ANY (cur.heads) OFFSET 0)
                           AND NOT EXISTS (SELECT FROM outbox._parked_events q
                                            WHERE q.aggregate_id = f.aggregate_id AND q.consumer_id = c.id
                                              AND q.id <> ALL (cur.heads) OFFSET 0));
    END IF;
    -- (a head's key: its events of the page that were copied when the claim read them, as a key
    -- that did not ride has, are there already: ON CONFLICT)
    PERFORM outbox_internal._queue_parked(c.id, ARRAY(
        SELECT b FROM unnest(batch) b JOIN unnest(fresh) f ON f.aggregate_id = b.aggregate_id
         WHERE f.head OR b.seq >= f.seq ORDER BY b.seq));
    IF cardinality(riders) > 0 THEN
        fresh := ARRAY(SELECT CASE WHEN f.head OR f.aggregate_id <> ALL (riders) THEN f
                              ELSE ROW(f.event_id, f.aggregate_id,
                                       (SELECT q.pos FROM outbox._parked_events q
                                         WHERE q.consumer_id = c.id AND q.id = f.event_id),
                                       true, f.error, f.retry_after, f.final, f.attempted)::outbox_internal._failure
                              END
                         FROM unnest(fresh) f);
    END IF;
    PERFORM outbox_internal._keys_failed(c, ARRAY(SELECT f FROM unnest(fresh) f
                                                   WHERE f.head OR f.aggregate_id = ANY (parked)),
                                         cur.epoch);
    RETURN kept;
END
$$;

-- (an event listed twice: its final listing counts)
CREATE OR REPLACE FUNCTION outbox_internal._fail_batch(c outbox.consumers, cur outbox._cursor_log,
                                              failures outbox_internal._failure[]) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    batch  outbox.events[] := outbox_internal._batch(cur, c, ARRAY(SELECT f.event_id FROM unnest(failures) f));
    firsts outbox_internal._failure[];
    f      outbox_internal._failure;
    kept   int := 0;
BEGIN
    firsts := ARRAY(SELECT DISTINCT ON (r.aggregate_id) r
                      FROM unnest(outbox_internal._resolve(c, cur, batch, failures)) AS r
                     -- a key's heads before its page; an event listed twice, final first
                     ORDER BY r.aggregate_id, r.head DESC, r.seq, r.final DESC);
    BEGIN
        kept := outbox_internal._fail_keys(c, cur, batch, firsts);
    EXCEPTION WHEN OTHERS THEN
        kept := 0;
        FOREACH f IN ARRAY firsts LOOP
            kept := kept + outbox_internal._fail_key_or_say_why(c, cur, batch, f);
        END LOOP;
    END;
    RETURN kept;
END
$$;
