-- outbox_ext 0.35.0 -> 0.36.0
--
-- Why: settling a batch with failures ran statements for each failure: _failures read the
-- failures argument one failure at a time, with a call per failure to check it, and _resolve
-- found each failed event in its batch with a call of its own; and every settle with failures
-- collected all of the batch's events (payloads included) to look the failed ones up, where
-- only the failed keys' events are used. The failures are now read, checked and found in one
-- statement each (each failure is read alone only to say which one is invalid), and only the
-- failed keys' events are collected. Nothing else changes: what settle, nack and reject do
-- with a failure is as before.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.36.0'" to load this file. \quit

-- (_resolve took one failure at a time; its new form takes them all)
DROP FUNCTION IF EXISTS outbox_internal._resolve(outbox.consumers, outbox._cursor_log, outbox.events[], outbox_internal._failure);
-- (_batch read all of a batch's events; it now reads those of some keys too)
DROP FUNCTION IF EXISTS outbox_internal._batch(outbox._cursor_log);

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
                     ORDER BY r.aggregate_id, r.head DESC, r.seq);  -- a key's heads before its page
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

REVOKE ALL ON FUNCTION outbox_internal._failures_read(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._resolve(outbox.consumers, outbox._cursor_log, outbox.events[],
                                                outbox_internal._failure[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._batch(outbox._cursor_log, outbox.consumers, uuid[]) FROM PUBLIC;
