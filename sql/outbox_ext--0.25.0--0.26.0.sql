-- outbox_ext 0.25.0 -> 0.26.0
--
-- Why: a claim of a shard with parked keys looked each event of its page up in _parked, twice
-- (once per list it sorted the page into), and every failure leaves dead versions of _parked
-- rows that such lookups walk past: half of a drain with 5% of its events failing. The claim
-- now reads the shard's parked keys once, when they are no more than a page's events, and
-- looks each event's key up among them; with more, it looks each event up once. And every
-- index of _parked and _parked_events led with consumer_id, so a plan made while they were
-- small could take one index for a lookup meant for another, and read all of a consumer's rows
-- for each row it looked up (in some sessions a drain with 5% of its events failing ran at a
-- sixth of its rate); none leads with it now, and the delete of a settle's delivered heads
-- checks the failed keys as a filter, which cannot be planned as a read of every queue. Those
-- plans were made once per session, often while the tables were empty (to the planner: one
-- row, and any index as good as another); each time a parking table has doubled in pages, its
-- plans are now made again (_replan_when_grown, src/replan.rs). And a hot key failing once had
-- its whole backlog copied into its queue by the next claim, and out again: a claim now moves
-- past at most one page of keys that are all due at their first retry or catching up, and
-- leaves a page of keys catching up (_parked.head_through: their last head went through) in the log
-- until their queues are empty, when two claims empty them. A settle of a batch of heads
-- alone reads nothing of the window (_batch). And a batch whose lease ran out is given back as
-- outbox.release gives it back (_free_cursor): a key its relay nacked before it died was
-- queued with the nacked event first and the page's earlier events of the key after it.
--
-- A delta: what changed from 0.25.0 to 0.26.0, rerunnable.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.26.0'" to load this file. \quit

ALTER TABLE outbox._parked ADD COLUMN IF NOT EXISTS head_through boolean NOT NULL DEFAULT false;

-- the keys of _parked and _parked_events reordered (sql/parking.sql), where they are not yet
DO $keys$
BEGIN
    IF (SELECT a.attname FROM pg_catalog.pg_index i
          JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
         WHERE i.indexrelid = 'outbox._parked_pkey'::pg_catalog.regclass) = 'consumer_id' THEN
        ALTER TABLE outbox._parked DROP CONSTRAINT _parked_pkey;
        ALTER TABLE outbox._parked ADD CONSTRAINT _parked_pkey PRIMARY KEY (aggregate_id, consumer_id);
    END IF;
    DROP INDEX IF EXISTS outbox._parked_consumer_id_shard_next_attempt_at_idx;
    CREATE INDEX IF NOT EXISTS _parked_shard_consumer_id_next_attempt_at_idx
        ON outbox._parked (shard, consumer_id, next_attempt_at);
    IF (SELECT a.attname FROM pg_catalog.pg_index i
          JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
         WHERE i.indexrelid = 'outbox._parked_events_pkey'::pg_catalog.regclass) = 'consumer_id' THEN
        ALTER TABLE outbox._parked_events DROP CONSTRAINT _parked_events_pkey;
        ALTER TABLE outbox._parked_events
            ADD CONSTRAINT _parked_events_pkey PRIMARY KEY (aggregate_id, consumer_id, pos);
    END IF;
    IF pg_catalog.to_regclass('outbox._parked_events_consumer_id_id_key') IS NOT NULL THEN
        ALTER TABLE outbox._parked_events DROP CONSTRAINT _parked_events_consumer_id_id_key;
        ALTER TABLE outbox._parked_events
            ADD CONSTRAINT _parked_events_id_consumer_id_key UNIQUE (id, consumer_id);
    END IF;
END
$keys$;

CREATE OR REPLACE FUNCTION outbox_internal._replan_when_grown(rel regclass) RETURNS void
    LANGUAGE c VOLATILE STRICT AS 'MODULE_PATHNAME', 'outbox_replan_when_grown';
REVOKE ALL ON FUNCTION outbox_internal._replan_when_grown(regclass) FROM PUBLIC;

CREATE OR REPLACE FUNCTION outbox_internal._queue_parked(consumer_id int, events outbox.events[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
BEGIN
    INSERT INTO outbox._parked_events AS q (consumer_id, aggregate_id, id, topic, aggregate_type,
                                            event_type, payload, headers, created_at, seq)
    SELECT _queue_parked.consumer_id, e.aggregate_id, e.id, e.topic, e.aggregate_type,
           e.event_type, e.payload, e.headers, e.created_at, e.seq
      FROM unnest(events) AS e
     ORDER BY e.seq
    ON CONFLICT (consumer_id, id) DO NOTHING;
    IF FOUND THEN
        PERFORM outbox_internal._replan_when_grown('outbox._parked_events');
    END IF;
END
$$;


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
               head_through = false,
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


CREATE OR REPLACE FUNCTION outbox_internal._batch(cur outbox._cursor_log) RETURNS outbox.events[]
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    since timestamptz := outbox_internal._window_since(cur, outbox_internal._newest_seal());
    until timestamptz := outbox_internal._reach();
BEGIN
    IF cur.batch_end IS NOT DISTINCT FROM cur.after_seq THEN
        RETURN '{}';  -- heads alone: the claim handed out nothing of the window (_claim_parked)
    END IF;
    RETURN ARRAY(SELECT w FROM outbox_internal._window_events(cur, cur.batch_end, NULL, since, until) w);
END
$$;


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
    IF parked IS NOT NULL THEN
        PERFORM outbox_internal._replan_when_grown('outbox._parked');
    END IF;
    PERFORM outbox_internal._queue_parked(c.id, ARRAY(
        SELECT b FROM unnest(batch) b JOIN unnest(fresh) f ON f.aggregate_id = b.aggregate_id
         WHERE NOT f.head AND b.seq >= f.seq ORDER BY b.seq));
    PERFORM outbox_internal._keys_failed(c, ARRAY(SELECT f FROM unnest(fresh) f
                                                   WHERE f.head OR f.aggregate_id = ANY (parked)),
                                         cur.epoch);
    RETURN kept;
END
$$;


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


CREATE OR REPLACE FUNCTION outbox_internal._free_cursor(consumer_id int, shard int, newest outbox._seals,
                                               until timestamptz, OUT cur outbox._cursor_log, OUT parked boolean)
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    floor_seq bigint;
    since     timestamptz;
BEGIN
    PERFORM FROM outbox._shards s
     WHERE s.consumer_id = _free_cursor.consumer_id AND s.shard = _free_cursor.shard
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;  -- another claim is taking this shard right now
    END IF;
    cur := outbox_internal._cursor(consumer_id, shard);
    IF cur.lease_until > now() THEN
        cur := NULL;  -- a batch is out under a live lease, or a release asked to wait
        RETURN;
    ELSIF cur.owner IS NOT NULL THEN
        -- a batch whose lease ran out: given back as outbox.release gives it back, so that a
        -- key its relay nacked before it died is read again from the page, in order
        PERFORM outbox_internal._unpark_released(c, cur)
           FROM outbox.consumers c WHERE c.id = _free_cursor.consumer_id;
    END IF;
    parked := EXISTS (SELECT FROM outbox._parked p
                       WHERE p.consumer_id = _free_cursor.consumer_id AND p.shard = _free_cursor.shard);
    IF NOT parked AND cur.hi_snap IS NULL AND cur.restored_seq IS NULL THEN
        floor_seq := outbox_internal._pending_floor(cur);  -- a value: the probe's index bound
        since := outbox_internal._since(floor_seq, newest);
        IF NOT outbox_internal._any_events(ARRAY[shard], ARRAY[floor_seq], since, until)
           AND NOT outbox_internal._behind_a_seal(cur, newest) THEN
            cur := NULL;
        END IF;
    END IF;
END
$$;


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
    mine      outbox.events[];  -- and the others
    heads     outbox.claimed[];
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
                               ELSE keys ? e.aggregate_id END AS parked
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
    heads := outbox_internal._due_heads(c, cur.shard, batch_size);
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


CREATE OR REPLACE FUNCTION outbox.replay(consumer text, aggregate_id text DEFAULT NULL) RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c outbox.consumers := outbox_internal._consumer(consumer);
    n int;
BEGIN
    -- Hold every shard of the consumer so no ack unparks a key while we queue into it.
    PERFORM FROM outbox._shards s WHERE s.consumer_id = c.id ORDER BY s.shard FOR UPDATE;
    IF NOT FOUND THEN  -- dropped while we waited: its name's dead letters may be another's now
        RAISE EXCEPTION 'consumer "%" does not exist', consumer
            USING ERRCODE = 'undefined_object',
                  HINT = 'It was dropped while outbox.replay waited for its shards.';
    END IF;
    INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
    SELECT DISTINCT c.id, d.aggregate_id, outbox.shard_of(d.aggregate_id), now()
      FROM outbox.dead_letters d
     WHERE d.consumer = c.name AND (replay.aggregate_id IS NULL OR d.aggregate_id = replay.aggregate_id)
    ON CONFLICT DO NOTHING;
    WITH moved AS (
        DELETE FROM outbox.dead_letters d
         WHERE d.consumer = c.name AND (replay.aggregate_id IS NULL OR d.aggregate_id = replay.aggregate_id)
        RETURNING d.*)
    INSERT INTO outbox._parked_events (consumer_id, aggregate_id, id, topic, aggregate_type,
                                       event_type, payload, headers, created_at, seq)
    SELECT c.id, m.aggregate_id, m.event_id, m.topic, m.aggregate_type, m.event_type, m.payload,
           m.headers, m.created_at, m.seq
      FROM moved m ORDER BY m.id
    ON CONFLICT (consumer_id, id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        PERFORM outbox_internal._replan_when_grown('outbox._parked');
        PERFORM outbox_internal._replan_when_grown('outbox._parked_events');
    END IF;
    RETURN n;
END
$$;

