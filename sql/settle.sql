-- outbox_ext: settling a batch — what became of each event of a claimed batch.
--
-- settle (ack, nack and reject are its thin forms; settle_and_claim also claims the next batch)
-- owns the hold-back rule: a key's first failure in batch order fails the key, and its later
-- events in the batch wait behind it whatever the relay said of them, so relays only report
-- what failed. Failures park keys (sql/parking.sql); the rest is delivered and the shard's
-- cursor moves past the batch (sql/cursors.sql).
--
-- Name resolution (sql/grants.sql): the API functions are [pinned], helpers (outbox_internal._*) run
-- [inside] them and do not pin search_path themselves: only the SECURITY DEFINER API functions
-- call them, and those pin it. A SET clause on every helper would cost each call a GUC save and
-- restore and a new search path lookup, about 5% of a claim.
--
-- Rerunnable: tables and indexes only where missing, functions replaced. A changed table needs
-- its own ALTER in the upgrade script.

-- A failure's own arguments, checked before the batch is looked at.
CREATE OR REPLACE FUNCTION outbox_internal._check_failure(event_id uuid, retry_after interval) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    PERFORM outbox_internal._not_null(event_id IS NULL, 'event_id', 'settle, nack or reject');
    IF retry_after IS NOT NULL THEN
        PERFORM outbox_internal._check_interval(retry_after, 'retry_after', '30 days', true);
    END IF;
END
$$;

-- settle's failures argument, a JSON array of {"id", "error", "retry_after", "final",
-- "attempted"}: checked, as unresolved failures. retry_after is a number of seconds or an
-- interval's text; attempted (default true) false for an event the sink never judged. All
-- failures are read in one statement (_failures_read); only when that refuses them is each
-- read again on its own, to say which failure is invalid and why.
CREATE OR REPLACE FUNCTION outbox_internal._failures(failures jsonb) RETURNS outbox_internal._failure[]
    LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    i int := 0;
    f jsonb;
BEGIN
    IF jsonb_typeof(failures) IS DISTINCT FROM 'array' THEN
        RAISE EXCEPTION 'failures must be a JSON array'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass ''[]'' when every event was delivered.';
    ELSIF jsonb_array_length(failures) = 0 THEN
        RETURN '{}';  -- the common case, without the subtransaction below
    END IF;
    BEGIN
        RETURN outbox_internal._failures_read(failures);
    EXCEPTION WHEN data_exception THEN  -- a bad uuid, interval or boolean, or _failures_read's checks
        NULL;
    END;
    FOR f IN SELECT jsonb_array_elements(failures) LOOP
        i := i + 1;
        BEGIN
            PERFORM outbox_internal._failures_read(jsonb_build_array(f));
        EXCEPTION WHEN data_exception THEN
            RAISE EXCEPTION 'failure % of failures is invalid: %', i, SQLERRM
                USING ERRCODE = 'invalid_parameter_value',
                      DETAIL = format('It is %s.', f),
                      HINT = 'A failure is {"id": "<event id>", "error": "<text>", "retry_after": '
                             '<seconds or interval text, optional>, "final": <true to dead-letter it now, optional>, '
                             '"attempted": <false when the sink never judged it, optional>}.';
        END;
    END LOOP;
    RAISE EXCEPTION 'failures are invalid' USING ERRCODE = 'invalid_parameter_value';  -- not reached
END
$$;

-- _failures' reading of a JSON array of failures, checked, in one statement (not one per
-- failure: #38). Raises 22xxx for an invalid failure, without saying which (_failures finds it).
CREATE OR REPLACE FUNCTION outbox_internal._failures_read(failures jsonb) RETURNS outbox_internal._failure[]
    LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    list      outbox_internal._failure[];
    misshaped boolean;  -- a failure is not an object with an id and known fields only
BEGIN
    WITH read AS (
        SELECT x.i, x.f, jsonb_typeof(x.f) = 'object' AND x.f ->> 'id' IS NOT NULL
                         AND CASE WHEN jsonb_typeof(x.f) = 'object'  -- (- raises on a scalar)
                                  THEN x.f - ARRAY['id', 'error', 'retry_after', 'final', 'attempted'] = '{}' END
                         AS shaped
          FROM jsonb_array_elements(failures) WITH ORDINALITY AS x(f, i))
    SELECT (SELECT array_agg(ROW((r.f ->> 'id')::uuid, NULL, NULL, NULL, r.f ->> 'error',
                                 CASE jsonb_typeof(r.f -> 'retry_after')
                                     WHEN 'number' THEN make_interval(secs => (r.f ->> 'retry_after')::float8)
                                     ELSE (r.f ->> 'retry_after')::interval END,
                                 coalesce((r.f -> 'final')::boolean, false),
                                 coalesce((r.f -> 'attempted')::boolean, true))::outbox_internal._failure
                             ORDER BY r.i)
              FROM read r WHERE r.shaped),  -- a value is read only from a failure of the right shape
           (SELECT bool_or(NOT r.shaped) FROM read r)
      INTO list, misshaped;
    IF misshaped THEN
        RAISE EXCEPTION 'not an object with an id and nothing but error, retry_after, final and attempted'
            USING ERRCODE = 'invalid_parameter_value';
    ELSIF EXISTS (SELECT FROM unnest(list) k WHERE k.final AND NOT k.attempted) THEN
        RAISE EXCEPTION 'a failure not attempted cannot be final' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM outbox_internal._check_interval(k.retry_after, 'retry_after', '30 days', true)
       FROM unnest(list) k WHERE k.retry_after IS NOT NULL;
    RETURN list;
END
$$;

-- Find each failed event in its batch (batch: the window's events the claim handed out, those
-- of the failed keys at least), with its place in its key's order (seq; a head's, pos): in
-- one statement, not one per failure. Left out: a head that is settled already (a reject of
-- this batch dead-lettered it).
CREATE OR REPLACE FUNCTION outbox_internal._resolve(c outbox.consumers, cur outbox._cursor_log,
                                                    batch outbox.events[], failures outbox_internal._failure[])
RETURNS outbox_internal._failure[]
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    resolved outbox_internal._failure[];
    unknown  uuid;
BEGIN
    WITH found AS (
        SELECT u.ordinality, u.event_id, u.error, u.retry_after, u.final, u.attempted, h.head,
               coalesce(q.aggregate_id, b.aggregate_id) AS aggregate_id,
               -- a head's place in its key's order is its place in the queue (pos): a
               -- replayed event is queued behind events with higher seqs
               coalesce(q.pos, b.seq) AS seq
          FROM unnest(failures) WITH ORDINALITY AS u
         CROSS JOIN LATERAL (SELECT coalesce(u.event_id = ANY (cur.heads), false) AS head) h
          LEFT JOIN LATERAL (SELECT q.aggregate_id, q.pos FROM outbox._parked_events q
                              WHERE h.head AND q.consumer_id = c.id AND q.id = u.event_id
                             OFFSET 0) q ON true  -- a lookup per head, not a join of all queues
          LEFT JOIN unnest(batch) b ON NOT h.head AND b.id = u.event_id)  -- ids are unique in a batch
    SELECT (SELECT f.event_id FROM found f WHERE NOT f.head AND f.aggregate_id IS NULL
             ORDER BY f.ordinality LIMIT 1),
           ARRAY(SELECT ROW(f.event_id, f.aggregate_id, f.seq, f.head, f.error, f.retry_after, f.final,
                            f.attempted)::outbox_internal._failure
                   FROM found f WHERE f.aggregate_id IS NOT NULL ORDER BY f.ordinality)
      INTO unknown, resolved;
    IF unknown IS NOT NULL THEN
        RAISE EXCEPTION 'event % is not in the batch of shard % with epoch %', unknown, cur.shard, cur.epoch
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Report only events that this claim returned.';
    END IF;
    RETURN resolved;
END
$$;

-- The events of the batch a cursor holds out, read from its window, in seq order: all of them,
-- or (ids given: failed events of the batch, or parked heads it handed out) those of the keys
-- of ids, what recording those failures reads (collecting all of a batch's events with their
-- payloads cost more than reading them).
CREATE OR REPLACE FUNCTION outbox_internal._batch(cur outbox._cursor_log, c outbox.consumers DEFAULT NULL,
                                                  ids uuid[] DEFAULT NULL) RETURNS outbox.events[]
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    since timestamptz := outbox_internal._window_since(cur, outbox_internal._newest_seal());
    until timestamptz := outbox_internal._reach();
BEGIN
    IF cur.batch_end IS NOT DISTINCT FROM cur.after_seq THEN
        RETURN '{}';  -- heads alone: the claim handed out nothing of the window (_claim_parked)
    END IF;
    RETURN ARRAY(
        WITH page AS MATERIALIZED (
            SELECT w FROM outbox_internal._window_events(cur, cur.batch_end, NULL, since, until) w),
        keys AS (
            SELECT (p.w).aggregate_id FROM page p WHERE (p.w).id IN (SELECT unnest(ids))
            UNION
            SELECT q.aggregate_id FROM unnest(ids) AS x(id)
             CROSS JOIN LATERAL (SELECT q.aggregate_id FROM outbox._parked_events q
                                  WHERE q.consumer_id = c.id AND q.id = x.id
                                 OFFSET 0) q  -- each head looked up, not a scan of all queues
             WHERE x.id = ANY (cur.heads))
        SELECT p.w FROM page p
         WHERE ids IS NULL OR (p.w).aggregate_id IN (SELECT k.aggregate_id FROM keys k)
         ORDER BY (p.w).seq);
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
-- would be acked unsent, so that is refused; and so is a reject of the very event queued for a
-- retry, which would change nothing either (the relay would take it for dead-lettered).
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
           -- a reject of the very event a nack of this batch queued for a retry: it would
           -- change nothing (not one a replay queued again after a reject: that one is dead)
           (SELECT (b.f).event_id FROM before b
             WHERE (b.f).final AND (b.f).seq = b.failed_from
               AND EXISTS (SELECT FROM outbox._parked_events q
                             JOIN outbox._parked p
                               ON p.consumer_id = c.id AND p.aggregate_id = q.aggregate_id
                              AND p.nacked_epoch = cur.epoch
                            WHERE q.consumer_id = c.id AND q.id = (b.f).event_id
                              -- the copy the nack queued: a head's (or rider's) is the one
                              -- it names; a window event's, the first of the batch's events in
                              -- its queue (a replay queues one behind those a reject queued)
                              AND (q.pos = p.nacked_pos
                                   OR (p.nacked_pos IS NULL
                                       AND NOT EXISTS (SELECT FROM outbox._parked_events o
                                                        WHERE o.consumer_id = c.id AND o.aggregate_id = q.aggregate_id
                                                          AND o.pos < q.pos
                                                          AND o.id IN (SELECT e.id FROM unnest(batch) e)))))
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

-- _fail_keys for one key, and if recording the failure itself fails, the key parked with that
-- reason in place of the relay's error and retried: the rest of the batch still settles, and
-- the reason shows in outbox.status.last_error.
CREATE OR REPLACE FUNCTION outbox_internal._fail_key_or_say_why(c outbox.consumers, cur outbox._cursor_log,
                                                       batch outbox.events[], f outbox_internal._failure) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN outbox_internal._fail_keys(c, cur, batch, ARRAY[f]);
EXCEPTION WHEN OTHERS THEN
    f.error := format('settling this failure failed: %s (the relay said: %s)', SQLERRM, left(f.error, 1000));
    f.retry_after := NULL;
    f.final := false;
    RETURN outbox_internal._fail_keys(c, cur, batch, ARRAY[f]);
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
    EXCEPTION WHEN invalid_parameter_value THEN
        RAISE;  -- a report _fail_keys refuses (out of order, a reject after a nack): the relay's to mend
    WHEN OTHERS THEN
        kept := 0;
        FOREACH f IN ARRAY firsts LOOP
            kept := kept + outbox_internal._fail_key_or_say_why(c, cur, batch, f);
        END LOOP;
    END;
    RETURN kept;
END
$$;

-- The rest of a settled batch is delivered: parked keys' heads handed out and not failed in
-- this batch (those before the key's failure, if it failed) leave their queues, and the shard
-- moves past the batch. Each head is looked up by its id, one by one, and the failed keys by
-- the shard's: a join planned from statistics taken while nothing was parked read every queued
-- event per head.
CREATE OR REPLACE FUNCTION outbox_internal._deliver_rest(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    failed    text[];    -- keys failed in this batch
    failed_at bigint[];  -- and the queue position each failed at
    through   text[];    -- keys whose heads all went through: their next heads are due at once
    touched   text[];    -- keys that lost heads: unparked if their queues are now empty
BEGIN
    IF cardinality(cur.heads) > 0 THEN
        SELECT array_agg(p.aggregate_id), array_agg(p.nacked_pos) INTO failed, failed_at
          FROM outbox._parked p
         WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch;
        WITH delivered AS (
            DELETE FROM outbox._parked_events q
             WHERE q.ctid = ANY (ARRAY(SELECT (SELECT h.ctid FROM outbox._parked_events h
                                                WHERE h.consumer_id = c.id AND h.id = out.id)
                                         FROM unnest(cur.heads) AS out(id)))
               AND NOT EXISTS (SELECT FROM unnest(failed, failed_at) f(key, pos)  -- pos unknown:
                                WHERE f.key = q.aggregate_id AND q.pos >= coalesce(f.pos, 0)  -- nacked before 0.23.0
                               OFFSET 0)  -- a filter: as a join, it could read the queues in key order
            RETURNING q.aggregate_id)
        SELECT array_agg(DISTINCT d.aggregate_id) FILTER (WHERE d.aggregate_id <> ALL (coalesce(failed, '{}'))),
               array_agg(DISTINCT d.aggregate_id)
          INTO through, touched
          FROM delivered d;
        UPDATE outbox._parked p SET attempts = 0, next_attempt_at = now(), head_through = true
         WHERE p.consumer_id = c.id AND p.aggregate_id = ANY (through);
        PERFORM outbox_internal._unpark_emptied(c.id, touched);
    END IF;
    PERFORM outbox_internal._append(outbox_internal._advance(cur, cur.batch_end, cur.exhausted));
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
    batch    outbox.events[];
    f        outbox_internal._failure := ROW(event_id, NULL, NULL, NULL, error, retry_after, final, true);
    resolved outbox_internal._failure[];
BEGIN
    PERFORM outbox_internal._check_failure(event_id, retry_after);
    cur := outbox_internal._leased(c.id, shard, epoch);
    -- a head's key's events of the page too: they may ride behind it
    batch := outbox_internal._batch(cur, c, ARRAY[event_id]);
    resolved := outbox_internal._resolve(c, cur, batch, ARRAY[f]);
    IF cardinality(resolved) > 0 THEN
        PERFORM outbox_internal._fail_keys(c, cur, batch, resolved);
    END IF;
END
$$;

-- What settle, ack and settle_and_claim share: the leased batch's failures, then the rest.
CREATE OR REPLACE FUNCTION outbox_internal._settle(c outbox.consumers, cur outbox._cursor_log,
                                          failures outbox_internal._failure[]) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    kept int := 0;
BEGIN
    IF cardinality(failures) > 0 THEN
        kept := outbox_internal._fail_batch(c, cur, failures);
    END IF;
    PERFORM outbox_internal._deliver_rest(c, cur);
    RETURN kept;
END
$$;

CREATE OR REPLACE FUNCTION outbox.settle(consumer text, shard int, epoch bigint,
                                         failures jsonb DEFAULT '[]') RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c    outbox.consumers := outbox_internal._consumer(consumer);
    list outbox_internal._failure[];
BEGIN
    PERFORM outbox_internal._not_null(failures IS NULL, 'failures', 'outbox.settle');
    list := outbox_internal._failures(failures);
    RETURN outbox_internal._settle(c, outbox_internal._leased(c.id, shard, epoch), list);
END
$$;

COMMENT ON FUNCTION outbox.settle(text, int, bigint, jsonb) IS
    'Finishes a claimed batch in one call. failures lists the events that failed, as a JSON array '
    'of {"id", "error", "retry_after" (seconds or interval text, optional), "final" (true: '
    'dead-letter now), "attempted" (false: not sent, e.g. the sink throttled; no attempt is '
    'counted)}; a failed key''s later events in the batch wait behind it, in order, '
    'whatever was said of them; every other event counts as delivered and the shard moves on. '
    'Returns how many events were kept back. Example: SELECT outbox.settle(''hook'', 3, 17, '
    '''[{"id": "0190...", "error": "HTTP 503", "retry_after": 30}]'');';

-- outbox.settle_and_claim's body: what it returns, the page's rows aside (see outbox.claim).
CREATE OR REPLACE FUNCTION outbox_internal._settle_and_claim_body(
    consumer   text,
    shard      int,
    epoch      bigint,
    failures   jsonb,
    batch_size int,
    lease      interval,
    owner      text,
    shards     int
) RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    c       outbox.consumers;
    list    outbox_internal._failure[];
    rebased boolean;
    working int[];
    b       record;
BEGIN
    PERFORM outbox_internal._not_null(failures IS NULL, 'failures', 'outbox.settle_and_claim');
    list := outbox_internal._failures(failures);
    -- before the rebase, which may write: the check is that the caller wrote nothing
    PERFORM outbox_internal._check_claim(batch_size, lease, shards, 'outbox.settle_and_claim');
    rebased := outbox_internal._rebase_if_restored();
    c := outbox_internal._consumer(consumer);
    IF NOT rebased THEN
        b := outbox_internal._claim_bound();  -- before settling writes anything
    END IF;
    PERFORM outbox_internal._settle(c, outbox_internal._leased(c.id, shard, epoch), list);
    IF NOT rebased THEN
        working := outbox_internal._shards_with_work(c.id);
        IF working IS NULL OR cardinality(working) > 0 THEN
            RETURN QUERY SELECT * FROM outbox_internal._claim(c, batch_size, lease,
                                                     coalesce(owner, 'backend ' || pg_backend_pid()),
                                                     b.seq, b.x, working, shards);
        END IF;
    END IF;
END
$$;

-- Made natively, as outbox.claim is.
CREATE OR REPLACE FUNCTION outbox.settle_and_claim(
    consumer   text,
    shard      int,
    epoch      bigint,
    failures   jsonb    DEFAULT '[]',
    batch_size int      DEFAULT 100,
    lease      interval DEFAULT '30 seconds',
    owner      text     DEFAULT NULL,
    shards     int      DEFAULT 1
) RETURNS SETOF outbox.claimed
    LANGUAGE c VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS 'MODULE_PATHNAME', 'outbox_settle_and_claim';

COMMENT ON FUNCTION outbox.settle_and_claim(text, int, bigint, jsonb, int, interval, text, int) IS
    'settle, then claim, in one call and one transaction: a relay''s loop in one round trip. '
    'Example: SELECT * FROM outbox.settle_and_claim(''hook'', 3, 17, ''[]'', 100);';

CREATE OR REPLACE FUNCTION outbox.ack(consumer text, shard int, epoch bigint) RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c outbox.consumers := outbox_internal._consumer(consumer);
BEGIN
    PERFORM outbox_internal._settle(c, outbox_internal._leased(c.id, shard, epoch), '{}');
END
$$;

COMMENT ON FUNCTION outbox.ack(text, int, bigint) IS
    'settle with no failures: every event not nacked or rejected counts as delivered and the '
    'shard moves on. Example: SELECT outbox.ack(''billing-webhook'', 3, 17);';

CREATE OR REPLACE FUNCTION outbox.nack(consumer text, shard int, epoch bigint, event_id uuid, error text,
                            retry_after interval DEFAULT NULL) RETURNS void
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
    RETURN outbox_internal._fail(consumer, shard, epoch, event_id, error, retry_after, false);

COMMENT ON FUNCTION outbox.nack(text, int, bigint, uuid, text, interval) IS
    'One failure of settle, reported on its own: the event''s key is parked (the shard goes on '
    'without it) and retried with backoff, or after retry_after; call ack (or settle) afterwards '
    'for the rest of the batch. '
    'Example: SELECT outbox.nack(''billing-webhook'', 3, 17, ''0190...''::uuid, ''HTTP 500'');';

CREATE OR REPLACE FUNCTION outbox.reject(consumer text, shard int, epoch bigint, event_id uuid, error text)
RETURNS void
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
    RETURN outbox_internal._fail(consumer, shard, epoch, event_id, error, NULL, true);

COMMENT ON FUNCTION outbox.reject(text, int, bigint, uuid, text) IS
    'A final failure of settle, reported on its own (e.g. HTTP 400): the event goes to '
    'outbox.dead_letters at once and its key moves on; call ack (or settle) afterwards for the '
    'rest of the batch. '
    'Example: SELECT outbox.reject(''billing-webhook'', 3, 17, ''0190...''::uuid, ''HTTP 422'');';
