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
-- checks the failed keys as a filter, which cannot be planned as a read of every queue.
--
-- A delta: what changed from 0.25.0 to 0.26.0, rerunnable.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.26.0'" to load this file. \quit

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
        PERFORM outbox_internal._record_empty(cur, stale, outbox_internal._newest_seal());
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
        UPDATE outbox._parked p SET attempts = 0, next_attempt_at = now()
         WHERE p.consumer_id = c.id AND p.aggregate_id = ANY (through);
        PERFORM outbox_internal._unpark_emptied(c.id, touched);
    END IF;
    PERFORM outbox_internal._append(outbox_internal._advance(cur, cur.batch_end, cur.exhausted));
END
$$;

