-- outbox_ext 0.29.0 -> 0.30.0
--
-- Why: a parked key that catches up (its head went through) had every new event of its shard
-- copied into its queue, and out of it again, until the queue emptied: a drain with 5% of its
-- events failing spent most of its time on those copies. A key whose whole queue goes out in
-- a batch now rides: its new events of the page follow its queue in the same batch, and when
-- they go through it is unparked with nothing copied (_riding, _claim_parked). A failure in
-- such a batch keeps the key's order: at a head, its events of the page join the queue behind
-- it; at an event of the page, that event heads the queue with its attempt counted
-- (_fail_keys, _fail_batch, _fail); given back after that, the key is due at once with
-- nothing counted (_unpark_released).

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.30.0'" to load this file. \quit

-- Of the due heads a claim hands out (_due_heads), the keys that ride (a JSON object of them,
-- for ?): each at a first attempt (catching up, or waiting uncounted, so its heads go out with
-- the rest of the batch, not alone: src/sinks/mod.rs) with its whole queue among the heads, so
-- that its events of the page may follow its queue in the same batch. A key probed after a
-- failure does not ride: its probe is one event, and a page's events behind a head failing
-- again would be copied into its queue all the same.
CREATE OR REPLACE FUNCTION outbox_internal._riding(c outbox.consumers, heads outbox.claimed[]) RETURNS jsonb
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (SELECT coalesce(jsonb_object_agg(h.aggregate_id, true), '{}')
              FROM (SELECT k.aggregate_id, count(*) AS n FROM unnest(heads) k
                     GROUP BY k.aggregate_id HAVING max(k.attempt) = 1) h
             WHERE (SELECT count(*) FROM (SELECT FROM outbox._parked_events q
                                           WHERE q.aggregate_id = h.aggregate_id AND q.consumer_id = c.id
                                           LIMIT h.n + 1) q) = h.n);
END
$$;

REVOKE ALL ON FUNCTION outbox_internal._riding(outbox.consumers, outbox.claimed[]) FROM PUBLIC;

-- _claim for a shard with parked keys: the batch holds the due heads (_due_heads: at most
-- batch_size more), first, then the page. A key whose whole queue is among the heads, at a
-- first attempt (catching up, or waiting uncounted), rides: its events of the page go out
-- behind its queue, in order, and when they all go through the key is unparked with nothing
-- copied (#38: each copy was written, read and deleted again, most of a drain with 5% of its
-- events failing). The page's events of other parked keys join their queues instead of going
-- out (the shard moves past pages that hold only those: one per claim when their keys are all
-- due at their first retry or catching up). A page that holds only events of keys catching up
-- (their last head went through) whose queues two claims empty is left where it is while the
-- queues go out. Nothing (and no claim row) when neither is left; then the empty window is
-- recorded as _claim records it (_record_empty), so that polls while the shard's keys wait out
-- their backoff stay idle.
CREATE OR REPLACE FUNCTION outbox_internal._claim_parked(c outbox.consumers, cur outbox._cursor_log,
                                                batch_size int, lease interval, owner text,
                                                seq_mark bigint, x xid8)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    stale     boolean := cur.hi_snap IS NOT NULL;  -- as in _claim
    keys      jsonb := (SELECT CASE WHEN count(*) <= batch_size  -- see below
                                     THEN coalesce(jsonb_object_agg(t.k, true), '{}') END
                          FROM (SELECT p.aggregate_id FROM outbox._parked p
                                 WHERE p.consumer_id = c.id AND p.shard = cur.shard
                                 LIMIT batch_size + 1) AS t(k));
    fresh     boolean;
    page      outbox.events[];
    queued    outbox.events[];  -- the page's events of parked keys
    mine      outbox.events[];  -- and the others (riding keys' among them)
    heads     outbox.claimed[] := outbox_internal._due_heads(c, cur.shard, batch_size);
    riding    jsonb := outbox_internal._riding(c, heads);
    exhausted boolean;
    all_due     boolean;  -- a page of parked keys' events only: are all their keys due,
    catching_up boolean;  -- and all catching up?
    held        boolean := false;  -- such a page left to read once their queues are out
    share       int;  -- of batch_size, each key catching up gets (as _due_heads gives it)
    since     timestamptz;
    until     timestamptz;
BEGIN
    LOOP
        fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
        IF cur.hi_snap IS NULL THEN
            cur := outbox_internal._open_window(cur, seq_mark, x);
        END IF;
        since := outbox_internal._window_since(cur, outbox_internal._newest_seal());
        until := outbox_internal._reach();  -- after the window's snapshot: see _reach
        page := ARRAY(SELECT w FROM outbox_internal._window_events(cur, NULL, batch_size, since, until) AS w);
        exhausted := cardinality(page) < batch_size;
        -- each event's key looked up among the shard's parked keys, read once into keys (a
        -- JSON object: its keys are sorted, ? searches them) when they are no more than a
        -- page's events; else through _parked's key, once per event (a join planned from
        -- statistics taken while nothing was parked compared every event with every parked
        -- key). A lookup in _parked per event was half of a drain with 5% of its events
        -- failing (#38): every failure leaves versions of _parked that such lookups walk.
        SELECT coalesce(array_agg(k.e ORDER BY (k.e).seq) FILTER (WHERE k.parked), '{}'),
               coalesce(array_agg(k.e ORDER BY (k.e).seq) FILTER (WHERE NOT k.parked), '{}')
          INTO queued, mine
          FROM (SELECT e, CASE WHEN keys IS NULL
                               THEN EXISTS (SELECT FROM outbox._parked p
                                             WHERE p.consumer_id = c.id AND p.aggregate_id = e.aggregate_id)
                               ELSE keys ? e.aggregate_id END AND NOT riding ? e.aggregate_id AS parked
                  FROM unnest(page) e
                OFFSET 0) k;  -- parked worked out once per event, not once per FILTER
        IF cardinality(mine) = 0 AND cardinality(page) > 0 THEN
            -- only parked keys' events here: are all their keys due, at their first retry or
            -- catching up; and are all catching up (due, their last head through) with a queue
            -- that two claims' shares empty (so that keys behind the page wait two claims at
            -- most), none of the page's events queued already (by a claim given back)?
            share := greatest(1, batch_size / greatest(1, (
                         SELECT count(*) FROM (SELECT FROM outbox._parked p
                                                WHERE p.shard = cur.shard AND p.consumer_id = c.id
                                                  AND p.next_attempt_at <= now() LIMIT batch_size) d)));
            SELECT bool_and(p.next_attempt_at <= now() AND (p.attempts = 1 OR p.head_through)),
                   bool_and(p.next_attempt_at <= now() AND p.head_through
                            AND (SELECT count(*) FROM (SELECT FROM outbox._parked_events q
                                                        WHERE q.aggregate_id = p.aggregate_id AND q.consumer_id = c.id
                                                        LIMIT 2 * share + 1) n) BETWEEN 1 AND 2 * share
                            AND NOT EXISTS (SELECT FROM outbox._parked_events q
                                             WHERE q.id = k.first_id AND q.consumer_id = c.id))
              INTO all_due, catching_up
              FROM (SELECT DISTINCT ON (q.aggregate_id) q.aggregate_id, q.id AS first_id
                      FROM unnest(queued) q ORDER BY q.aggregate_id, q.seq) k
             CROSS JOIN LATERAL (SELECT p.* FROM outbox._parked p
                                  WHERE p.aggregate_id = k.aggregate_id AND p.consumer_id = c.id) p;
            IF catching_up THEN
                -- the page waits until their queues, handed out below, are empty and they flow
                -- with the shard again: not copied into the queues and out again (#38: a hot key)
                page := '{}';
                exhausted := false;  -- the window is not read to its end: the page is still to read
                held := true;
                EXIT;
            END IF;
        END IF;
        PERFORM outbox_internal._queue_parked(c.id, queued);
        EXIT WHEN cardinality(mine) > 0;
        IF cardinality(page) > 0 THEN
            -- record that the shard moved past the page; go on to the next, unless its keys
            -- are all due at their first retry or catching up: their heads make this batch,
            -- and the shard moves past a page of them per claim, not all their events at once,
            -- so that a key failing once keeps its backlog in the log (a key failing again, or
            -- refused unjudged, is moved past at once; and not when the page ended the window,
            -- which the batch's claim row must be in)
            cur := outbox_internal._advance(cur, page[cardinality(page)].seq, exhausted);
            PERFORM outbox_internal._append(cur);
            EXIT WHEN all_due AND NOT exhausted;
        ELSIF fresh THEN
            EXIT;  -- nothing new since the last window
        ELSE
            cur := outbox_internal._next_window(cur);
        END IF;
    END LOOP;
    IF cardinality(mine) = 0 AND cardinality(heads) = 0 THEN
        IF NOT held THEN  -- a page held is still to read: the window is not empty
            PERFORM outbox_internal._record_empty(cur, stale, outbox_internal._newest_seal());
        END IF;
        RETURN;
    END IF;
    cur := outbox_internal._claimed(cur, owner, lease,
                           CASE WHEN cardinality(page) > 0 THEN page[cardinality(page)].seq ELSE cur.after_seq END,
                           exhausted, ARRAY(SELECT h.id FROM unnest(heads) h));
    PERFORM outbox_internal._append(cur);
    RETURN QUERY  -- heads first: a riding key's events of the page come after its queue
    SELECT h.shard, cur.epoch, h.id, h.topic, h.aggregate_type, h.aggregate_id, h.event_type,
           h.payload, h.headers, h.created_at, h.seq, h.attempt
      FROM unnest(heads) AS h;
    RETURN QUERY
    SELECT cur.shard, cur.epoch, m.id, m.topic, m.aggregate_type, m.aggregate_id, m.event_type,
           m.payload, m.headers, m.created_at, m.seq, 1
      FROM unnest(mine) AS m ORDER BY m.seq;
END
$$;

-- Record a batch's failures: firsts holds each failing key's first failed event (resolved by
-- _resolve), batch the batch's events of those keys. An event of a parked key's queue (a
-- head) counts a failed attempt of its key; the key's heads before it went through, and leave
-- the queue when the batch settles (heads are ordered by their place in the queue, f.seq being
-- that place: see _resolve), and its events of the page that rode behind its queue
-- (_claim_parked) join the queue. An event of the window parks its key: it and the key's
-- later events of the batch are queued, in order; of a key that rode, it then counts as the
-- head it has become (its heads before it went through). Counting is _keys_failed's.
-- Set-based: the same few statements for one failure or hundreds. Returns how many events of
-- the batch this kept back.
-- A key failed in this batch before (nack, reject) kept its events back from some point on:
-- reported again from there or after, nothing changes; from before it, the events in between
-- would be acked unsent, so that is refused.
CREATE OR REPLACE FUNCTION outbox_internal._fail_keys(c outbox.consumers, cur outbox._cursor_log,
                                             batch outbox.events[], firsts outbox_internal._failure[]) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    fresh  outbox_internal._failure[];  -- the keys not failed in this batch before
    early  uuid;
    parked text[];
    riders text[];  -- keys with heads in this batch whose events of the page failed
    kept   int;
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
           ARRAY(SELECT b.f FROM before b WHERE b.failed_from IS NULL)
      INTO early, fresh;
    IF early IS NOT NULL THEN
        RAISE EXCEPTION 'event % comes before an event of its key already reported failed in this batch', early
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Report a key''s failures in batch order, or all at once with outbox.settle.';
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

-- The hold-back rule, in one place: a key's first failure in batch order fails the key, and its
-- later events in the batch wait behind it whatever the relay said of them. The failures are
-- recorded together (_fail_keys); only if that fails, each on its own (a subtransaction each: kept for the
-- rare case, as many of them slow every snapshot of the cluster). Returns the events kept back.
CREATE OR REPLACE FUNCTION outbox_internal._fail_batch(c outbox.consumers, cur outbox._cursor_log,
                                              failures outbox_internal._failure[]) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    batch  outbox.events[] := outbox_internal._batch(cur);
    firsts outbox_internal._failure[];
    f      outbox_internal._failure;
    kept   int := 0;
BEGIN
    -- Each failure is looked up among the batch's failed events, and each key's events among
    -- the events of failed keys, both taken out of the batch in one pass: not a scan of the
    -- whole batch per failure and per key.
    firsts := ARRAY(SELECT DISTINCT ON (r.aggregate_id) r
                      FROM unnest(failures) AS u,
                           outbox_internal._resolve(c, cur, ARRAY(SELECT b FROM unnest(batch) b
                                                                 WHERE b.id IN (SELECT v.event_id FROM unnest(failures) v)),
                                                    u) AS r
                     WHERE r.aggregate_id IS NOT NULL
                     ORDER BY r.aggregate_id, r.head DESC, r.seq);  -- a key's heads before its page
    batch := ARRAY(SELECT b FROM unnest(batch) b
                    WHERE b.aggregate_id IN (SELECT k.aggregate_id FROM unnest(firsts) k)
                    ORDER BY b.seq);
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

-- nack and reject: one event failed; the batch stays out until settle or ack.
CREATE OR REPLACE FUNCTION outbox_internal._fail(consumer text, shard int, epoch bigint, event_id uuid, error text,
                                        retry_after interval, final boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    c     outbox.consumers := outbox_internal._consumer(consumer);
    cur   outbox._cursor_log;
    batch outbox.events[];
    f     outbox_internal._failure := ROW(event_id, NULL, NULL, NULL, error, retry_after, final, true);
BEGIN
    PERFORM outbox_internal._check_failure(event_id, retry_after);
    cur := outbox_internal._leased(c.id, shard, epoch);
    batch := outbox_internal._batch(cur);  -- a head's too: its key's events of the page may ride behind it
    f := outbox_internal._resolve(c, cur, batch, f);
    IF f.aggregate_id IS NOT NULL THEN
        PERFORM outbox_internal._fail_keys(c, cur, batch, ARRAY[f]);
    END IF;
END
$$;

-- A batch given back (release, release_owner, a lease that ran out, a restore) after nack or
-- reject: the shard reads its page again, so what the batch's failures made of the page's
-- events is undone. A key that this batch parked (its queue holds only copies of this batch's
-- page, none of them a parked head it handed out) is unparked, its queue dropped, as if the
-- batch had never been claimed: kept, its earlier events would be queued behind the failed one.
-- A key parked before (its head handed out and nacked) keeps its queue and the attempt counted,
-- less the copies of this page's events: the next claim may read a smaller page, and a copy
-- beyond it would go out from the queue and again from the log. A key that rode and failed at
-- an event of the page (counted at that event's copy as its head: _fail_keys) is due again at
-- once with nothing counted: the event comes again with the page, and its heads did not fail
-- (it rode at a first attempt, so none was counted before). And an event of the page
-- dead-lettered at once (reject, or a nack of its last attempt) comes again with the page, so
-- its dead letter goes: kept, the event was both delivered and dead, and a replay sent it again
-- after its key's later events. A dead head stays dead: it left its queue, and is not read again
-- (unless the page holds it too: then it comes again with the page). The page is read on every
-- give-back of a consumer that has dead letters; give-backs are rare (a suspended sink's probes
-- are 10 events) and a page is at most a batch.
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
    UPDATE outbox._parked p
       SET attempts = 0, next_attempt_at = now(), nacked_epoch = NULL, nacked_pos = NULL
     WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch
       AND EXISTS (SELECT FROM outbox._parked_events q
                    WHERE q.aggregate_id = p.aggregate_id AND q.consumer_id = c.id
                      AND q.pos = p.nacked_pos AND q.id = ANY (ids)
                   OFFSET 0);  -- a lookup by the key's queue position, not a semi-join
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
