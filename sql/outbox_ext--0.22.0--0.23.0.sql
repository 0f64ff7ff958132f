-- outbox_ext 0.22.0 -> 0.23.0
--
-- Why: a parked key gave out one event per claim and left the parked state only when its queue
-- was empty, so a key receiving more events per second than its shard was claimed never
-- recovered from one transient failure (2,016 claims for a 4,000-event backlog that takes
-- about ten). A parked key whose head went through now catches up: a claim hands out its queue
-- in order, an equal share of the batch per key catching up (_due_heads), and a failure inside
-- that share counts against the event that failed (_parked.nacked_seq records it; the heads
-- before it leave the queue when the batch settles, _deliver_rest). A failing head is still
-- retried alone. And settle records a batch's failures set-based (_fail_keys, _keys_failed: the
-- same few statements for one failure or hundreds) instead of several statements per failed
-- key; nack and reject take the same path. The failure type moves to sql/parking.sql
-- (unchanged).
-- Outside SQL: when a suspended sink's row is updated, the worker gives back the probes still
-- out with the old settings at once (they could hold their shards until their request timeout),
-- so the fixed settings deliver at once.
--
-- A delta: what changed from 0.22.0 to 0.23.0, rerunnable.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.23.0'" to load this file. \quit

ALTER TABLE outbox._parked ADD COLUMN IF NOT EXISTS nacked_seq bigint;

DROP FUNCTION IF EXISTS outbox_internal._head_failed(outbox.consumers, text, text, interval, bigint, boolean);
DROP FUNCTION IF EXISTS outbox_internal._head_waits(outbox.consumers, text, text, interval, bigint);
DROP FUNCTION IF EXISTS outbox_internal._unpark_if_empty(int, text);
DROP FUNCTION IF EXISTS outbox_internal._fail_key(outbox.consumers, outbox._cursor_log, outbox.events[], outbox_internal._failure);

-- Parked keys failed, each at one event (failures: each key's first failed event of a batch,
-- epoch, resolved by settle): its head, or an event of its queue handed out behind heads that
-- went through (those leave the queue when the batch settles: _deliver_rest reads nacked_seq).
-- Each failure is counted and its retry scheduled; past max_attempts (or at once when the
-- failure is final) the event moves to dead_letters and its key moves on. A failure not
-- attempted (the sink throttled, lacked its topic, ran out of time) counts nothing and kills
-- nothing: its retry is scheduled as if the current attempt had failed. Set-based: the same
-- few statements for one failure or hundreds.
CREATE OR REPLACE FUNCTION outbox_internal._keys_failed(c outbox.consumers, failures outbox_internal._failure[],
                                                        epoch bigint) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    dead_ids      uuid[];
    dead_attempts int[];
    dead_errors   text[];
BEGIN
    WITH counted AS (
        UPDATE outbox._parked p
           SET attempts = p.attempts + CASE WHEN f.attempted IS FALSE THEN 0 ELSE 1 END,
               last_error = f.error, nacked_epoch = epoch, nacked_seq = f.seq,
               next_attempt_at = now() + coalesce(f.retry_after, outbox_internal._backoff(c,
                   CASE WHEN f.attempted IS FALSE THEN greatest(p.attempts, 1) ELSE p.attempts + 1 END))
          FROM unnest(failures) f
         WHERE p.consumer_id = c.id AND p.aggregate_id = f.aggregate_id
        RETURNING f.event_id, f.error, f.final, f.attempted, p.attempts)
    SELECT array_agg(k.event_id), array_agg(k.attempts), array_agg(k.error)
      INTO dead_ids, dead_attempts, dead_errors
      FROM counted k
     WHERE k.attempted IS NOT FALSE AND (k.final OR k.attempts >= c.max_attempts);
    IF dead_ids IS NULL THEN
        RETURN;
    END IF;
    WITH dead AS (
        DELETE FROM outbox._parked_events q
         USING unnest(dead_ids, dead_attempts, dead_errors) AS d(id, attempts, error)
         WHERE q.consumer_id = c.id AND q.id = d.id
        RETURNING q.*, d.attempts AS n, d.error AS error)
    INSERT INTO outbox.dead_letters (consumer, event_id, topic, aggregate_type, aggregate_id,
                                     event_type, payload, headers, created_at, seq, attempts, last_error)
    SELECT c.name, d.id, d.topic, d.aggregate_type, d.aggregate_id, d.event_type, d.payload,
           d.headers, d.created_at, d.seq, d.n, d.error
      FROM dead d ORDER BY d.seq;
    -- their keys move on: the next event is due at once, and a key with none is unparked
    UPDATE outbox._parked p SET attempts = 0, next_attempt_at = now()
      FROM unnest(failures) f
     WHERE p.consumer_id = c.id AND p.aggregate_id = f.aggregate_id AND f.event_id = ANY (dead_ids);
    DELETE FROM outbox._parked p
     USING unnest(failures) f
     WHERE p.consumer_id = c.id AND p.aggregate_id = f.aggregate_id AND f.event_id = ANY (dead_ids)
       AND NOT EXISTS (SELECT FROM outbox._parked_events q
                        WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id);
END
$$;

-- The parked keys of a shard that are due, in the order they fell due, and events of their
-- queues from the head on, at most lim in all: one of a key whose head is failing (a retry
-- probes with one event), and an equal share of lim each of a key catching up (its head went
-- through, or it waits uncounted), so that a key alone drains its queue a full batch at a time.
CREATE OR REPLACE FUNCTION outbox_internal._due_heads(c outbox.consumers, shard int, lim int)
RETURNS outbox.claimed[]
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    due   outbox._parked[] := ARRAY(SELECT p FROM outbox._parked p
                                     WHERE p.consumer_id = c.id AND p.shard = _due_heads.shard
                                       AND p.next_attempt_at <= now()
                                     ORDER BY p.next_attempt_at LIMIT lim);
    share int := greatest(1, lim / greatest(cardinality(due), 1));
BEGIN
    RETURN ARRAY(
        SELECT ROW(_due_heads.shard, NULL, q.id, q.topic, q.aggregate_type, q.aggregate_id,
                   q.event_type, q.payload, q.headers, q.created_at, q.seq, p.attempts + 1)::outbox.claimed
          FROM unnest(due) WITH ORDINALITY AS p
         CROSS JOIN LATERAL (SELECT * FROM outbox._parked_events q
                              WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                              ORDER BY q.pos LIMIT CASE WHEN p.attempts > 0 THEN 1 ELSE share END) AS q
         ORDER BY p.ordinality, q.pos);
END
$$;

-- Record a batch's failures: firsts holds each failing key's first failed event (resolved by
-- _resolve), batch the batch's events of those keys. An event of a parked key's queue (a
-- head) counts a failed attempt of its key; the key's heads before it went through, and leave
-- the queue when the batch settles. An event of the window parks its key: it and the key's
-- later events of the batch are queued, in order. Counting is _keys_failed's. Set-based: the
-- same few statements for one failure or hundreds. Returns how many events of the batch this
-- kept back.
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
    kept   int;
BEGIN
    -- where each key failed in this batch before, if it did: a head's key by its record, a
    -- window event's key by its events of the batch already queued or dead-lettered
    WITH before AS (
        SELECT f, CASE WHEN f.head THEN
                   (SELECT p.nacked_seq FROM outbox._parked p
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
    kept := (SELECT count(*) FROM unnest(batch) b JOIN unnest(fresh) f ON f.aggregate_id = b.aggregate_id
              WHERE NOT f.head AND b.seq >= f.seq)
          + (SELECT count(*) FROM unnest(fresh) f JOIN outbox._parked_events q
                ON q.consumer_id = c.id AND q.aggregate_id = f.aggregate_id
              WHERE f.head AND q.id = ANY (cur.heads) AND q.seq >= f.seq);
    -- window events park their keys; a key parked meanwhile (a replay) keeps its record: its
    -- events wait behind its queue, nothing counted
    WITH made AS (
        INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
        SELECT c.id, f.aggregate_id, cur.shard, now() FROM unnest(fresh) f WHERE NOT f.head
        ON CONFLICT DO NOTHING
        RETURNING aggregate_id)
    SELECT array_agg(m.aggregate_id) INTO parked FROM made m;
    PERFORM outbox_internal._queue_parked(c.id, ARRAY(
        SELECT b FROM unnest(batch) b JOIN unnest(fresh) f ON f.aggregate_id = b.aggregate_id
         WHERE NOT f.head AND b.seq >= f.seq ORDER BY b.seq));
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
                     ORDER BY r.aggregate_id, r.seq);
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

-- The rest of a settled batch is delivered: parked keys' heads handed out and not failed in
-- this batch (those before the key's failure, if it failed) leave their queues, and the shard
-- moves past the batch.
CREATE OR REPLACE FUNCTION outbox_internal._deliver_rest(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    through text[];  -- keys whose heads all went through: their next heads are due at once
    touched text[];  -- keys that lost heads: unparked if their queues are now empty
BEGIN
    IF cardinality(cur.heads) > 0 THEN
        -- set-based (a batch may hold hundreds of heads)
        WITH delivered AS (
            DELETE FROM outbox._parked_events q
             USING outbox._parked p
             WHERE q.consumer_id = c.id AND q.id = ANY (cur.heads)
               AND p.consumer_id = q.consumer_id AND p.aggregate_id = q.aggregate_id
               AND (p.nacked_epoch IS DISTINCT FROM cur.epoch OR q.seq < p.nacked_seq)
            RETURNING q.aggregate_id, p.nacked_epoch IS NOT DISTINCT FROM cur.epoch AS failed)
        SELECT array_agg(DISTINCT d.aggregate_id) FILTER (WHERE NOT d.failed), array_agg(DISTINCT d.aggregate_id)
          INTO through, touched
          FROM delivered d;
        UPDATE outbox._parked p SET attempts = 0, next_attempt_at = now()
         WHERE p.consumer_id = c.id AND p.aggregate_id = ANY (through);
        DELETE FROM outbox._parked p
         WHERE p.consumer_id = c.id AND p.aggregate_id = ANY (touched)
           AND NOT EXISTS (SELECT FROM outbox._parked_events q
                            WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id);
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
    batch outbox.events[];
    f     outbox_internal._failure := ROW(event_id, NULL, NULL, NULL, error, retry_after, final, true);
BEGIN
    PERFORM outbox_internal._check_failure(event_id, retry_after);
    cur := outbox_internal._leased(c.id, shard, epoch);
    batch := CASE WHEN event_id = ANY (cur.heads) THEN '{}' ELSE outbox_internal._batch(cur) END;
    f := outbox_internal._resolve(c, cur, batch, f);
    IF f.aggregate_id IS NOT NULL THEN
        PERFORM outbox_internal._fail_keys(c, cur, batch, ARRAY[f]);
    END IF;
END
$$;

COMMENT ON FUNCTION outbox.claim(text, int, interval, text) IS
    'Takes one free shard under a lease and returns its next events in commit order (at most '
    'batch_size, plus at most batch_size events of its parked keys due for retry); nothing when '
    'no shard has work. '
    'Example: SELECT * FROM outbox.claim(''billing-webhook'', 100, ''30 seconds'');';

REVOKE ALL ON FUNCTION outbox_internal._keys_failed(outbox.consumers, outbox_internal._failure[], bigint),
                       outbox_internal._fail_keys(outbox.consumers, outbox._cursor_log, outbox.events[],
                                                  outbox_internal._failure[]) FROM PUBLIC;
