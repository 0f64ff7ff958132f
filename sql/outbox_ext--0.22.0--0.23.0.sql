-- outbox_ext 0.22.0 -> 0.23.0
--
-- Why: a parked key gave out one event per claim and left the parked state only when its queue
-- was empty, so a key receiving more events per second than its shard was claimed never
-- recovered from one transient failure (2,016 claims for a 4,000-event backlog that takes
-- about ten). A parked key whose head went through now catches up: a claim hands out its queue
-- in order, an equal share of the batch per key catching up (_due_heads), and a failure inside
-- that share counts against the event that failed (_parked.nacked_pos records it; the heads
-- before it leave the queue when the batch settles, _deliver_rest). A failing head is still
-- retried alone. And settle records a batch's failures set-based (_fail_keys, _keys_failed: the
-- same few statements for one failure or hundreds) instead of several statements per failed
-- key; nack and reject take the same path. The statements on parked keys look keys and heads
-- up one by one through their indexes: joins planned from statistics taken while nothing was
-- parked compared every event with every parked key. _parked_events loses its foreign key to
-- _parked (its check cost each queued event more than queueing it): whatever deletes a parked
-- key deletes its queue (drop_consumer, _unpark_released). The failure type moves to
-- sql/parking.sql (unchanged).
-- A change of outbox.sinks has the worker reread the sinks when it commits
-- (_reload_sinks_at_commit, called by the sinks trigger) instead of up to a second later; and
-- when a suspended sink's row changes, the worker gives back the probes still out with the old
-- settings (they could hold their shards until their request timeout): a fixed credential
-- delivers at once.
--
-- A delta: what changed from 0.22.0 to 0.23.0, rerunnable.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.23.0'" to load this file. \quit

ALTER TABLE outbox._parked ADD COLUMN IF NOT EXISTS nacked_pos bigint;
ALTER TABLE outbox._parked_events DROP CONSTRAINT IF EXISTS _parked_events_consumer_id_aggregate_id_fkey;

DROP FUNCTION IF EXISTS outbox_internal._head_failed(outbox.consumers, text, text, interval, bigint, boolean);
DROP FUNCTION IF EXISTS outbox_internal._head_waits(outbox.consumers, text, text, interval, bigint);
DROP FUNCTION IF EXISTS outbox_internal._unpark_if_empty(int, text);
DROP FUNCTION IF EXISTS outbox_internal._fail_key(outbox.consumers, outbox._cursor_log, outbox.events[], outbox_internal._failure);

-- Parked keys failed, each at one event (failures: each key's first failed event of a batch,
-- epoch, resolved by settle): its head, or an event of its queue handed out behind heads that
-- went through (those leave the queue when the batch settles: _deliver_rest reads nacked_pos),
-- or an event of the window, which parked it.
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
               last_error = f.error, nacked_epoch = epoch, nacked_pos = CASE WHEN f.head THEN f.seq END,
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
    PERFORM outbox_internal._unpark_emptied(c.id, ARRAY(SELECT f.aggregate_id FROM unnest(failures) f
                                                         WHERE f.event_id = ANY (dead_ids)));
END
$$;

-- Of keys whose queues lost events, those with none left are unparked: they flow with their
-- shard again. Each key's queue is looked up on its own (OFFSET 0 keeps it a lookup): an
-- anti-join planned while nothing was parked would read every queued event per key.
CREATE OR REPLACE FUNCTION outbox_internal._unpark_emptied(consumer_id int, keys text[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    DELETE FROM outbox._parked p
     WHERE p.consumer_id = _unpark_emptied.consumer_id AND p.aggregate_id = ANY (keys)
       AND NOT EXISTS (SELECT FROM outbox._parked_events q
                        WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                       OFFSET 0);
END
$$;

-- A batch given back (release) after nack parked keys of it: a key that this batch parked
-- (its queue holds only events of this batch's page, none of them a parked head it handed out)
-- is unparked, its queue dropped, as if the batch had never been claimed. The shard reads the
-- page again, so the key's events come back in order: kept, the earlier ones would be queued
-- behind the failed one. A key parked before (its head handed out and nacked) keeps its queue
-- and the attempt counted.
CREATE OR REPLACE FUNCTION outbox_internal._unpark_released(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    WITH unparked AS (
        DELETE FROM outbox._parked p
         WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch
           AND NOT EXISTS (SELECT FROM outbox._parked_events q
                            WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                              AND (q.id = ANY (cur.heads) OR q.seq <= coalesce(cur.after_seq, 0)
                                   OR q.seq > coalesce(cur.batch_end, 0)))
        RETURNING p.aggregate_id)
    DELETE FROM outbox._parked_events q
     USING unparked u
     WHERE q.consumer_id = c.id AND q.aggregate_id = u.aggregate_id;
END
$$;

CREATE OR REPLACE FUNCTION outbox.drop_consumer(name text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c_id int := (SELECT c.id FROM outbox.consumers c WHERE c.name = drop_consumer.name);
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'name', 'outbox.drop_consumer');
    -- The deletes below must see the rows relays commit while the drop waits for their shards:
    -- with a snapshot taken before, those would be left behind.
    IF pg_catalog.current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        RAISE EXCEPTION 'outbox.drop_consumer must run at READ COMMITTED, not %',
                pg_catalog.upper(pg_catalog.current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'Call it in a READ COMMITTED transaction (the default isolation level).';
    END IF;
    -- Its shards first, in order, as claims and settles take them before they write a cursor
    -- row: the drop waits for a claim or a settle under way, then deletes what no one holds.
    PERFORM FROM outbox._shards s WHERE s.consumer_id = c_id ORDER BY s.shard FOR UPDATE;
    DELETE FROM outbox._cursor_log l WHERE l.consumer_id = c_id;
    DELETE FROM outbox._parked_events q WHERE q.consumer_id = c_id;
    DELETE FROM outbox._parked p WHERE p.consumer_id = c_id;
    DELETE FROM outbox.dead_letters d WHERE d.consumer = drop_consumer.name;
    DELETE FROM outbox.consumers c WHERE c.id = c_id;         -- and its shards (a cascade)
    RETURN FOUND;
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

-- _claim for a shard with parked keys: the page's events of parked keys join their queues
-- instead of going out (the shard moves past pages that hold only those), and the batch also
-- holds the due heads (_due_heads: at most batch_size more). Nothing (and no claim row) when
-- neither is left.
CREATE OR REPLACE FUNCTION outbox_internal._claim_parked(c outbox.consumers, cur outbox._cursor_log,
                                                batch_size int, lease interval, owner text,
                                                seq_mark bigint, x xid8)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    fresh     boolean;
    page      outbox.events[];
    queued    outbox.events[];  -- the page's events of parked keys
    mine      outbox.events[];  -- and the others
    heads     outbox.claimed[];
    exhausted boolean;
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
        -- each event's key looked up once, through _parked's key (a join planned from
        -- statistics taken while nothing was parked compared every event with every parked key)
        SELECT coalesce(array_agg(k.e ORDER BY (k.e).seq) FILTER (WHERE k.parked), '{}'),
               coalesce(array_agg(k.e ORDER BY (k.e).seq) FILTER (WHERE NOT k.parked), '{}')
          INTO queued, mine
          FROM (SELECT e, EXISTS (SELECT FROM outbox._parked p
                                   WHERE p.consumer_id = c.id AND p.aggregate_id = e.aggregate_id) AS parked
                  FROM unnest(page) e) k;
        PERFORM outbox_internal._queue_parked(c.id, queued);
        EXIT WHEN cardinality(mine) > 0;
        IF cardinality(page) > 0 THEN
            -- only parked keys' events here: record that the shard moved past them, go on
            cur := outbox_internal._advance(cur, page[cardinality(page)].seq, exhausted);
            PERFORM outbox_internal._append(cur);
        ELSIF fresh THEN
            EXIT;  -- nothing new since the last window
        ELSE
            cur := outbox_internal._next_window(cur);
        END IF;
    END LOOP;
    heads := outbox_internal._due_heads(c, cur.shard, batch_size);
    IF cardinality(mine) = 0 AND cardinality(heads) = 0 THEN
        RETURN;
    END IF;
    cur := outbox_internal._claimed(cur, owner, lease,
                           CASE WHEN cardinality(page) > 0 THEN page[cardinality(page)].seq ELSE cur.after_seq END,
                           exhausted, ARRAY(SELECT h.id FROM unnest(heads) h));
    PERFORM outbox_internal._append(cur);
    RETURN QUERY
    SELECT cur.shard, cur.epoch, m.id, m.topic, m.aggregate_type, m.aggregate_id, m.event_type,
           m.payload, m.headers, m.created_at, m.seq, 1
      FROM unnest(mine) AS m ORDER BY m.seq;
    RETURN QUERY
    SELECT h.shard, cur.epoch, h.id, h.topic, h.aggregate_type, h.aggregate_id, h.event_type,
           h.payload, h.headers, h.created_at, h.seq, h.attempt
      FROM unnest(heads) AS h;
END
$$;

-- Find a failed event in its batch (batch: the window's events the claim handed out), with its
-- place in its key's order (seq; a head's, pos). NULL for a head that is settled already (a
-- reject of this batch dead-lettered it).
CREATE OR REPLACE FUNCTION outbox_internal._resolve(c outbox.consumers, cur outbox._cursor_log,
                                           batch outbox.events[], f outbox_internal._failure)
RETURNS outbox_internal._failure
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    f.head := coalesce(f.event_id = ANY (cur.heads), false);
    IF f.head THEN
        -- a head's place in its key's order is its place in the queue (pos): a replayed event
        -- is queued behind events with higher seqs
        SELECT q.aggregate_id, q.pos INTO f.aggregate_id, f.seq FROM outbox._parked_events q
         WHERE q.consumer_id = c.id AND q.id = f.event_id;
        RETURN CASE WHEN FOUND THEN f END;
    END IF;
    SELECT b.aggregate_id, b.seq INTO f.aggregate_id, f.seq FROM unnest(batch) b WHERE b.id = f.event_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'event % is not in the batch of shard % with epoch %', f.event_id, cur.shard, cur.epoch
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Report only events that this claim returned.';
    END IF;
    RETURN f;
END
$$;

-- Record a batch's failures: firsts holds each failing key's first failed event (resolved by
-- _resolve), batch the batch's events of those keys. An event of a parked key's queue (a
-- head) counts a failed attempt of its key; the key's heads before it went through, and leave
-- the queue when the batch settles (heads are ordered by their place in the queue, f.seq being
-- that place: see _resolve). An event of the window parks its key: it and the key's
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
    kept := (SELECT count(*) FROM unnest(batch) b JOIN unnest(fresh) f ON f.aggregate_id = b.aggregate_id
              WHERE NOT f.head AND b.seq >= f.seq);
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
                                WHERE f.key = q.aggregate_id AND q.pos >= coalesce(f.pos, 0))  -- nacked before 0.23.0
            RETURNING q.aggregate_id)
        SELECT array_agg(DISTINCT d.aggregate_id) FILTER (WHERE d.aggregate_id <> ALL (coalesce(failed, '{}'))),
               array_agg(DISTINCT d.aggregate_id)
          INTO through, touched
          FROM delivered d;
        UPDATE outbox._parked p SET attempts = 0, next_attempt_at = now()
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

-- When the transaction commits, the database's worker rereads outbox.sinks at once instead of
-- on its next reload, a second later at most (src/wake.rs): a fixed credential is tried at once.
CREATE OR REPLACE FUNCTION outbox_internal._reload_sinks_at_commit() RETURNS void
    LANGUAGE c VOLATILE AS 'MODULE_PATHNAME', 'outbox_reload_sinks_at_commit';

-- Every check a sink row must pass, with the fix in the hint; also stamps updated_at (the
-- worker rebuilds a sink's client when it changes) and has the worker reread the sinks when
-- the transaction commits. SECURITY DEFINER: it calls internal helpers that admins cannot
-- execute directly.
CREATE OR REPLACE FUNCTION outbox_internal._check_sink() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    topic   text;
    kafka   boolean := NEW.kind = 'kafka';
    formats text[] := CASE NEW.kind WHEN 'webhook' THEN ARRAY['batch', 'single']
                                    WHEN 'kafka' THEN ARRAY['outbox', 'debezium']
                                    WHEN 'kafka_rest_v2' THEN ARRAY['json', 'binary']
                                    WHEN 'kafka_rest_v3' THEN ARRAY['json', 'binary', 'string'] END;
BEGIN
    PERFORM outbox_internal._not_null(NEW.kind IS NULL, 'kind', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.url IS NULL, 'url', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.batch_size IS NULL, 'batch_size', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.concurrency IS NULL, 'concurrency', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.connect_timeout IS NULL, 'connect_timeout', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.request_timeout IS NULL, 'request_timeout', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.enabled IS NULL, 'enabled', 'outbox.sinks');
    PERFORM outbox_internal._not_null(NEW.linger IS NULL, 'linger', 'outbox.create_sink');
    IF cardinality(NEW.topics) = 0 OR cardinality(NEW.aggregate_types) = 0
       OR array_position(NEW.topics, NULL) IS NOT NULL
       OR array_position(NEW.aggregate_types, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'topics and aggregate_types must be NULL (all) or lists of names'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'An empty list or a NULL in one would match nothing: pass NULL for all.';
    END IF;
    IF formats IS NULL THEN
        RAISE EXCEPTION 'unknown sink kind "%"', NEW.kind USING ERRCODE = 'invalid_parameter_value',
            HINT = 'kind is webhook, kafka, kafka_rest_v2 or kafka_rest_v3.';
    END IF;
    NEW.format := coalesce(NEW.format, formats[1]);
    IF NOT NEW.format = ANY (formats) THEN
        RAISE EXCEPTION 'format "%" does not fit a % sink', NEW.format, NEW.kind
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = format('Use one of %s, or NULL for %s.', array_to_string(formats, ', '), formats[1]);
    END IF;
    IF NOT kafka AND NEW.url !~ '^https?://[^/?#\s]+[^\s]*$' THEN
        RAISE EXCEPTION 'invalid sink URL "%"', NEW.url USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give an absolute http:// or https:// URL, e.g. https://hooks.example.com/outbox.';
    END IF;
    IF NEW.batch_size NOT BETWEEN 1 AND 10000 OR NEW.concurrency NOT BETWEEN 1 AND 64 THEN
        RAISE EXCEPTION 'batch_size % or concurrency % is out of range', NEW.batch_size, NEW.concurrency
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'batch_size is 1 to 10000; concurrency is 1 to 64.';
    END IF;
    IF NOT (NEW.connect_timeout > '0' AND NEW.request_timeout > '0'
            AND NEW.connect_timeout <= '1 hour' AND NEW.request_timeout <= '1 hour') THEN
        RAISE EXCEPTION 'timeouts must be positive and at most an hour'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'E.g. connect_timeout => ''5 s'', request_timeout => ''30 s''.';
    END IF;
    IF NOT outbox_internal._is_string_map(NEW.http_headers) OR NOT outbox_internal._is_string_map(NEW.topic_map) THEN
        RAISE EXCEPTION 'http_headers and topic_map must be JSON objects of strings'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'E.g. ''{"Authorization": "Bearer t0ken"}''.';
    END IF;
    IF EXISTS (SELECT FROM jsonb_each_text(NEW.topic_map) AS m(k, v)
                WHERE v !~ '^[A-Za-z0-9._-]{1,249}$' OR v IN ('.', '..')) THEN
        RAISE EXCEPTION 'topic_map renames to a name that is not a Kafka topic name'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Kafka topics are 1 to 249 of [A-Za-z0-9._-], not "." or "..".';
    END IF;
    PERFORM outbox_internal._check_kafka_settings(NEW);
    -- the URL of a kafka sink, the secret's key, each header, each CA certificate: as the
    -- worker will use them (Rust)
    PERFORM outbox_internal._check_sink_settings(NEW.kind, NEW.url, NEW.secret, NEW.http_headers, NEW.tls_ca);
    -- topics filter event topics; a name that topic_map only renames to is a Kafka topic
    FOR topic IN SELECT t FROM unnest(NEW.topics) AS t
                  WHERE NEW.topic_map IS NOT NULL AND NOT NEW.topic_map ? t
                    AND t IN (SELECT v FROM jsonb_each_text(NEW.topic_map) AS m(k, v)) LOOP
        RAISE NOTICE 'sink "%": topics lists "%", a Kafka topic that topic_map renames to; events are matched by their own topic', NEW.name, topic
            USING HINT = format('List the event topics instead (%s), or drop topic_map.',
                                (SELECT string_agg(k, ', ') FROM jsonb_each_text(NEW.topic_map) AS m(k, v) WHERE v = topic));
    END LOOP;
    IF NEW.kind = 'kafka_rest_v3' AND coalesce(NEW.cluster_id, '') = '' THEN
        RAISE EXCEPTION 'a kafka_rest_v3 sink needs its cluster_id' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass cluster_id => ''...''; GET /v3/clusters on the proxy lists it.';
    END IF;
    NEW.updated_at := now();
    PERFORM outbox_internal._reload_sinks_at_commit();
    RETURN NEW;
END
$$;


REVOKE ALL ON FUNCTION outbox_internal._keys_failed(outbox.consumers, outbox_internal._failure[], bigint),
                       outbox_internal._fail_keys(outbox.consumers, outbox._cursor_log, outbox.events[],
                                                  outbox_internal._failure[]),
                       outbox_internal._unpark_emptied(int, text[]),
                       outbox_internal._reload_sinks_at_commit() FROM PUBLIC;
