-- outbox_ext 0.3.0 -> 0.4.0
--
-- Why: 0.4.0 makes claims and bulk emit cheaper. Opening a commit window looks for the events
-- of late transactions one transaction at a time, on index entries (it read the heap of the
-- whole backlog before); the internal claim helpers no longer set search_path on every call
-- (the SECURITY DEFINER API functions that call them pin it). outbox.emit_many writes through
-- outbox._insert_many (Rust, new), as COPY does, and falls back to its INSERT. outbox.maintain()
-- drops old partitions before it creates new ones, each drop waiting at most a second for its
-- lock (a deadlock with readers was possible). Only functions change: events, consumers,
-- cursors, parked keys and dead letters are not touched.
--
-- A delta: what changed from 0.3.0 to 0.4.0 (ALTERs, guarded DROPs, changed functions, views
-- and comments, new grants), rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.4.0'" to load this file. \quit

-- As pgrx declares it (src/emit/insert.rs).
CREATE OR REPLACE FUNCTION outbox."_insert_many"(
    "aggregate_type" TEXT,
    "event_type" TEXT,
    "headers" jsonb,
    "topic" TEXT,
    "aggregate_ids" TEXT[],
    "payloads" anyarray,
    "shard_count" INT
) RETURNS uuid[]
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'insert_many_wrapper';

CREATE OR REPLACE FUNCTION outbox.emit_many(
    aggregate_type text,
    event_type     text,
    aggregate_ids  text[],
    payloads       jsonb[],
    headers        jsonb DEFAULT NULL,
    topic          text  DEFAULT NULL
) RETURNS SETOF uuid
    LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    ids uuid[];
    tx  xid8 := pg_current_xact_id();  -- before any seq is taken: see events.seq
BEGIN
    IF aggregate_ids IS NULL OR payloads IS NULL THEN
        RAISE EXCEPTION 'aggregate_ids and payloads must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass one aggregate id and one payload per event, as arrays.';
    END IF;
    IF cardinality(aggregate_ids) <> cardinality(payloads) THEN
        RAISE EXCEPTION 'aggregate_ids has % elements but payloads has %',
                cardinality(aggregate_ids), cardinality(payloads)
            USING ERRCODE = 'array_subscript_error',
                  HINT = 'Pass one payload per aggregate id, in the same order.';
    END IF;
    -- Natively, as COPY writes (see src/emit/insert.rs); NULL when the table needs a plain
    -- INSERT (triggers, constraints, no partition for now()).
    ids := outbox._insert_many(aggregate_type, event_type, headers, topic, aggregate_ids, payloads,
                               outbox.shard_count());
    IF ids IS NULL THEN
        ids := outbox._batch_ids(aggregate_type, event_type, headers, topic, aggregate_ids,
                                 (SELECT max(pg_column_size(p)) FROM unnest(payloads) AS p));
        INSERT INTO outbox.events
            (id, topic, aggregate_type, aggregate_id, event_type, payload, headers, txid, shard)
        SELECT u.id, emit_many.topic, emit_many.aggregate_type, u.key, emit_many.event_type,
               u.payload, emit_many.headers, tx, outbox.shard_of(u.key)
        FROM unnest(ids, aggregate_ids, payloads) AS u(id, key, payload);
    END IF;
    RETURN QUERY SELECT unnest(ids);
END
$$;

---------------------------------------------------------------------------------------------
-- Internals
---------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION outbox._consumer(name text) RETURNS outbox.consumers
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    c outbox.consumers;
BEGIN
    SELECT * INTO c FROM outbox.consumers WHERE consumers.name = _consumer.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'consumer "%" does not exist', name
            USING ERRCODE = 'undefined_object',
                  HINT = 'Create it with outbox.create_consumer(name).';
    END IF;
    RETURN c;
END
$$;

CREATE OR REPLACE FUNCTION outbox._check_shard(shard int) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF shard IS NULL OR shard < 0 OR shard >= outbox.shard_count() THEN
        RAISE EXCEPTION 'shard % does not exist', shard
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = format('Shards are 0 to %s; pass the shard a claimed row came with.',
                                outbox.shard_count() - 1);
    END IF;
END
$$;

-- The newest cursor row of a (consumer, shard).
CREATE OR REPLACE FUNCTION outbox._cursor(consumer_id int, shard int) RETURNS outbox._cursor_log
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    cur outbox._cursor_log;
BEGIN
    SELECT * INTO cur FROM outbox._cursor_log l
     WHERE l.consumer_id = _cursor.consumer_id AND l.shard = _cursor.shard
     ORDER BY l.pos DESC LIMIT 1;
    RETURN cur;
END
$$;

CREATE OR REPLACE FUNCTION outbox._append(cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    INSERT INTO outbox._cursor_log
        (consumer_id, shard, epoch, owner, lease_until, lo_snap, lo_seq, lo_top, lo_txids,
         lo_floors, hi_snap, hi_seq, hi_top, hi_txids, hi_floors, late_from, late_to,
         after_seq, batch_end, exhausted, heads)
    VALUES
        (cur.consumer_id, cur.shard, cur.epoch, cur.owner, cur.lease_until, cur.lo_snap,
         cur.lo_seq, cur.lo_top, cur.lo_txids, cur.lo_floors, cur.hi_snap, cur.hi_seq,
         cur.hi_top, cur.hi_txids, cur.hi_floors, cur.late_from, cur.late_to, cur.after_seq,
         cur.batch_end, cur.exhausted, cur.heads);
END
$$;

-- The in-progress list of a bound: the snapshot's xip, every xid from its xmax to x, and x.
-- (Helpers on the claim path are plpgsql, not SQL: plpgsql keeps their plans for the session,
-- while a SQL function called from plpgsql is planned again in every transaction.)
CREATE OR REPLACE FUNCTION outbox._in_progress(snap pg_snapshot, x xid8) RETURNS xid8[]
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    RETURN ARRAY(SELECT t FROM pg_snapshot_xip(snap) AS t
                 UNION
                 SELECT g::text::xid8
                   FROM generate_series(least(pg_snapshot_xmax(snap), x)::text::bigint,
                                        x::text::bigint) AS g
                 ORDER BY 1);
END
$$;

-- Transactions of lo's in-progress list that the cursor's hi sees finished, with the lowest
-- of their floors: part (b) of the window.
CREATE OR REPLACE FUNCTION outbox._late(cur outbox._cursor_log, OUT txids xid8[], OUT floor_seq bigint)
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    SELECT coalesce(array_agg(u.t), '{}'), min(u.f) INTO txids, floor_seq
      FROM unnest(cur.lo_txids, cur.lo_floors) AS u(t, f)
     WHERE pg_visible_in_snapshot(u.t, cur.hi_snap);
END
$$;

-- Close the window at a new bound (seq_mark, then xid x, then a snapshot now; see the header).
-- Each in-progress transaction gets a floor: carried over if lo had it in progress too, else
-- lo.seq (it began after lo's mark), raised to the newest mark below it; x itself, seq_mark.
-- Then find, once, the seq range that holds the events of part (b), bounded above by the seq
-- read after the snapshot: pages of the window scan only that range for them.
-- Generic plans: custom ones would plan the scan of every partition again in each of a
-- session's first windows.
CREATE OR REPLACE FUNCTION outbox._open_window(cur outbox._cursor_log, seq_mark bigint, x xid8)
RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    late    record;
    seq_end bigint;
BEGIN
    cur.hi_seq := seq_mark;
    cur.hi_snap := pg_current_snapshot();
    seq_end := coalesce(pg_sequence_last_value('outbox.event_seq'), 0);
    cur.hi_top := outbox._top(cur.hi_snap, x);
    SELECT coalesce(array_agg(t ORDER BY t), '{}'),
           coalesce(array_agg(CASE WHEN t = x THEN seq_mark
                                   ELSE greatest(coalesce(u.f, cur.lo_seq),
                                                 (SELECT m.seq FROM outbox._marks m WHERE m.top < t
                                                   ORDER BY m.top DESC LIMIT 1)) END ORDER BY t), '{}')
      INTO cur.hi_txids, cur.hi_floors
      FROM unnest(outbox._in_progress(cur.hi_snap, x)) AS t
      LEFT JOIN unnest(cur.lo_txids, cur.lo_floors) AS u(id, f) ON u.id = t;
    late := outbox._late(cur);
    cur.late_from := NULL; cur.late_to := NULL;
    IF cardinality(late.txids) > 0 THEN
        -- One pass over the range per transaction (there are few), txid = t checked on the
        -- index entries: only their events' rows are visited. (txid = ANY (array) is checked
        -- on the heap rows instead, and a min/max plan would walk the range twice.)
        SELECT min(e.seq), max(e.seq) INTO cur.late_from, cur.late_to
          FROM unnest(late.txids) AS t
         CROSS JOIN LATERAL (SELECT e.seq FROM outbox.events e
                              WHERE e.shard = cur.shard AND e.seq > late.floor_seq
                                AND e.seq <= seq_end AND e.txid = t
                             OFFSET 0) AS e;
    END IF;
    cur.after_seq := NULL;
    RETURN cur;
END
$$;

-- The position after delivering through batch_end: the same window further on, or, when the
-- window is exhausted, no window yet after its upper bound.
CREATE OR REPLACE FUNCTION outbox._advance(cur outbox._cursor_log, batch_end bigint, exhausted boolean)
RETURNS outbox._cursor_log
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF exhausted THEN
        cur.lo_snap := cur.hi_snap;   cur.lo_seq := cur.hi_seq;       cur.lo_top := cur.hi_top;
        cur.lo_txids := cur.hi_txids; cur.lo_floors := cur.hi_floors;
        cur.hi_snap := NULL; cur.hi_seq := NULL; cur.hi_top := NULL;
        cur.hi_txids := NULL; cur.hi_floors := NULL; cur.late_from := NULL; cur.late_to := NULL;
        cur.after_seq := NULL;
    ELSE
        cur.after_seq := batch_end;
    END IF;
    cur.owner := NULL; cur.lease_until := NULL;
    cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
    RETURN cur;
END
$$;

-- Events of a shard in the cursor's window, after its position and up to seq upto, in seq
-- order, at most lim (NULL: all). Both parts walk the (shard, seq, txid) index in order and
-- stop at the limit. A custom plan, costed with the actual bounds, would rather sort a whole
-- backlog; the generic plan (kept for the session) walks the index.
CREATE OR REPLACE FUNCTION outbox._window(shard int, cur outbox._cursor_log, upto bigint, lim int)
RETURNS SETOF outbox.events
    LANGUAGE plpgsql STABLE
    SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    late     xid8[] := (outbox._late(cur)).txids;
    last_seq bigint := coalesce(upto, 9223372036854775807);
BEGIN
    RETURN QUERY
    SELECT w.* FROM (
        (SELECT e.* FROM outbox.events e
          WHERE e.shard = _window.shard
            AND e.seq > greatest(cur.after_seq, cur.lo_seq) AND e.seq <= last_seq
            AND e.txid >= cur.lo_top AND e.txid < pg_snapshot_xmax(cur.hi_snap)
            AND pg_visible_in_snapshot(e.txid, cur.hi_snap)
          ORDER BY e.seq LIMIT lim)
        UNION ALL
        (SELECT e.* FROM outbox.events e
          WHERE cur.late_from IS NOT NULL
            AND e.shard = _window.shard
            AND e.seq >= cur.late_from AND e.seq > coalesce(cur.after_seq, -1)
            AND e.seq <= least(cur.late_to, last_seq)
            AND e.txid = ANY (late)
          ORDER BY e.seq LIMIT lim)
    ) AS w ORDER BY w.seq LIMIT lim;
END
$$;

-- Lock a shard for ack/nack/release and return its cursor, refusing a stale epoch.
CREATE OR REPLACE FUNCTION outbox._leased(consumer_id int, shard int, epoch bigint) RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    cur outbox._cursor_log;
BEGIN
    PERFORM outbox._check_shard(shard);
    PERFORM FROM outbox._shards s
     WHERE s.consumer_id = _leased.consumer_id AND s.shard = _leased.shard FOR UPDATE;
    cur := outbox._cursor(consumer_id, shard);
    IF cur.epoch IS DISTINCT FROM epoch OR cur.owner IS NULL THEN
        RAISE EXCEPTION 'the batch of shard % with epoch % is no longer held', shard, epoch
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = format('The shard is at epoch %s%s.', cur.epoch,
                                  CASE WHEN cur.owner IS NULL THEN ', with no batch out' ELSE
                                  format(', held by %s', cur.owner) END),
                  HINT = 'Its lease expired and another claim took the shard, or it was already '
                         'acked or released; drop the batch and claim again.';
    END IF;
    RETURN cur;
END
$$;

-- The head of a parked key failed: count it, schedule the retry; past max_attempts (or at once
-- when the failure is final) move the head to dead_letters and let the key move on.
CREATE OR REPLACE FUNCTION outbox._head_failed(c outbox.consumers, key text, error text,
                                    retry_after interval, epoch bigint, final boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    n int;
BEGIN
    UPDATE outbox._parked p
       SET attempts = p.attempts + 1, last_error = error, nacked_epoch = epoch,
           next_attempt_at = now() + coalesce(retry_after, outbox._backoff(c, p.attempts + 1))
     WHERE p.consumer_id = c.id AND p.aggregate_id = key
    RETURNING p.attempts INTO n;
    IF n < c.max_attempts AND NOT final THEN
        RETURN;
    END IF;
    WITH head AS (
        DELETE FROM outbox._parked_events q
         WHERE (q.consumer_id, q.aggregate_id, q.pos) =
               (SELECT h.consumer_id, h.aggregate_id, h.pos FROM outbox._parked_events h
                 WHERE h.consumer_id = c.id AND h.aggregate_id = key ORDER BY h.pos LIMIT 1)
        RETURNING q.*)
    INSERT INTO outbox.dead_letters (consumer, event_id, topic, aggregate_type, aggregate_id,
                                     event_type, payload, headers, created_at, seq, attempts, last_error)
    SELECT c.name, h.id, h.topic, h.aggregate_type, h.aggregate_id, h.event_type, h.payload,
           h.headers, h.created_at, h.seq, n, error
      FROM head h;
    UPDATE outbox._parked p SET attempts = 0, next_attempt_at = now()
     WHERE p.consumer_id = c.id AND p.aggregate_id = key;
    PERFORM outbox._unpark_if_empty(c.id, key);
END
$$;

CREATE OR REPLACE FUNCTION outbox._unpark_if_empty(consumer_id int, key text) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    DELETE FROM outbox._parked p
     WHERE p.consumer_id = _unpark_if_empty.consumer_id AND p.aggregate_id = _unpark_if_empty.key
       AND NOT EXISTS (SELECT FROM outbox._parked_events q
                        WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id);
END
$$;

-- Copy events of parked keys into their queues (idempotent: a re-claim copies nothing twice).
CREATE OR REPLACE FUNCTION outbox._queue_parked(consumer_id int, events outbox.events[]) RETURNS void
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
END
$$;

-- Take one shard if it is free and has work: returns its batch (and writes the claim row), or
-- nothing (and writes nothing, unless it had to move past events of parked keys).
CREATE OR REPLACE FUNCTION outbox._claim_shard(c outbox.consumers, shard int, batch_size int,
                                    lease interval, owner text, seq_mark bigint, x xid8)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    cur       outbox._cursor_log := outbox._cursor(c.id, shard);
    fresh     boolean;
    batch     outbox.events[];
    parked    text[];
    mine      outbox.events[];
    heads     outbox.claimed[];
    exhausted boolean;
    any_parked boolean;
    n         bigint;
BEGIN
    IF cur.lease_until > now() THEN
        RETURN;  -- a batch is out under a live lease, or a release asked to wait
    END IF;
    any_parked := EXISTS (SELECT FROM outbox._parked p
                           WHERE p.consumer_id = c.id AND p.shard = _claim_shard.shard);
    IF NOT any_parked THEN
        -- The common case: the whole page goes out. It is read once, into the result and into
        -- the claim row (the bounds, as _append writes them; no row when the page is empty).
        LOOP
            fresh := cur.hi_snap IS NULL;
            IF fresh THEN
                cur := outbox._open_window(cur, seq_mark, x);
            END IF;
            RETURN QUERY
            WITH page AS MATERIALIZED (
                     SELECT * FROM outbox._window(_claim_shard.shard, cur, NULL, batch_size)),
                 claim_row AS (
                     INSERT INTO outbox._cursor_log
                         (consumer_id, shard, epoch, owner, lease_until, lo_snap, lo_seq, lo_top,
                          lo_txids, lo_floors, hi_snap, hi_seq, hi_top, hi_txids, hi_floors,
                          late_from, late_to, after_seq, batch_end, exhausted, heads)
                     SELECT cur.consumer_id, cur.shard, cur.epoch + 1, _claim_shard.owner,
                            now() + lease, cur.lo_snap, cur.lo_seq, cur.lo_top, cur.lo_txids,
                            cur.lo_floors, cur.hi_snap, cur.hi_seq, cur.hi_top, cur.hi_txids,
                            cur.hi_floors, cur.late_from, cur.late_to, cur.after_seq, max(p.seq),
                            count(*) < batch_size, '{}'
                       FROM page p HAVING count(*) > 0)
            SELECT _claim_shard.shard, cur.epoch + 1, p.id, p.topic, p.aggregate_type,
                   p.aggregate_id, p.event_type, p.payload, p.headers, p.created_at, p.seq, 1
              FROM page p ORDER BY p.seq;
            GET DIAGNOSTICS n = ROW_COUNT;
            EXIT WHEN n > 0 OR fresh;  -- a batch, or nothing new since the last window
            cur := outbox._advance(cur, NULL, true);  -- window done; open the next one
        END LOOP;
        RETURN;
    END IF;
    LOOP
        fresh := cur.hi_snap IS NULL;
        IF fresh THEN
            cur := outbox._open_window(cur, seq_mark, x);
        END IF;
        batch := ARRAY(SELECT w FROM outbox._window(shard, cur, NULL, batch_size) AS w);
        exhausted := cardinality(batch) < batch_size;
        -- keys parked for this consumer do not go out with the shard: they queue behind their head
        parked := CASE WHEN any_parked THEN
                      ARRAY(SELECT DISTINCT p.aggregate_id FROM outbox._parked p
                             WHERE p.consumer_id = c.id AND p.shard = _claim_shard.shard
                               AND p.aggregate_id IN (SELECT b.aggregate_id FROM unnest(batch) b))
                  ELSE '{}' END;
        IF cardinality(parked) > 0 THEN
            PERFORM outbox._queue_parked(c.id, ARRAY(SELECT b FROM unnest(batch) b
                                                      WHERE b.aggregate_id = ANY (parked)));
            mine := ARRAY(SELECT b FROM unnest(batch) b WHERE b.aggregate_id <> ALL (parked));
        ELSE
            mine := batch;
        END IF;
        EXIT WHEN cardinality(mine) > 0;
        IF cardinality(batch) > 0 THEN
            -- only parked keys' events here: record that the shard moved past them, go on
            cur := outbox._advance(cur, batch[cardinality(batch)].seq, exhausted);
            PERFORM outbox._append(cur);
        ELSIF fresh THEN
            EXIT;  -- nothing new since the last window
        ELSE
            cur := outbox._advance(cur, NULL, true);  -- window done; open the next one
        END IF;
    END LOOP;

    -- parked keys of this shard that are due: their heads, in the order they fell due
    heads := CASE WHEN NOT any_parked THEN '{}' ELSE ARRAY(
        SELECT ROW(_claim_shard.shard, NULL, q.id, q.topic, q.aggregate_type, q.aggregate_id,
                   q.event_type, q.payload, q.headers, q.created_at, q.seq, p.attempts + 1)::outbox.claimed
          FROM (SELECT * FROM outbox._parked p
                 WHERE p.consumer_id = c.id AND p.shard = _claim_shard.shard
                   AND p.next_attempt_at <= now()
                 ORDER BY p.next_attempt_at LIMIT batch_size) AS p
         CROSS JOIN LATERAL (SELECT * FROM outbox._parked_events q
                              WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                              ORDER BY q.pos LIMIT 1) AS q
         ORDER BY p.next_attempt_at) END;
    IF cardinality(mine) = 0 AND cardinality(heads) = 0 THEN
        RETURN;
    END IF;

    cur.epoch := cur.epoch + 1;
    cur.owner := owner;
    cur.lease_until := now() + lease;
    cur.batch_end := CASE WHEN cardinality(batch) > 0 THEN batch[cardinality(batch)].seq
                          ELSE cur.after_seq END;
    cur.exhausted := exhausted;
    cur.heads := ARRAY(SELECT h.id FROM unnest(heads) h);
    PERFORM outbox._append(cur);

    RETURN QUERY
    SELECT _claim_shard.shard, cur.epoch, m.id, m.topic, m.aggregate_type, m.aggregate_id,
           m.event_type, m.payload, m.headers, m.created_at, m.seq, 1
      FROM unnest(mine) AS m;
    RETURN QUERY
    SELECT h.shard, cur.epoch, h.id, h.topic, h.aggregate_type, h.aggregate_id, h.event_type,
           h.payload, h.headers, h.created_at, h.seq, h.attempt
      FROM unnest(heads) AS h;
END
$$;

-- A claimed event failed (nack), or failed for good (reject, final): park its key, count the
-- failure of the key's head.
CREATE OR REPLACE FUNCTION outbox._fail(consumer text, shard int, epoch bigint, event_id uuid, error text,
                             retry_after interval, final boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    c   outbox.consumers := outbox._consumer(consumer);
    cur outbox._cursor_log := outbox._leased(c.id, shard, epoch);
    ev  outbox.events;
    key text;
BEGIN
    IF event_id = ANY (cur.heads) THEN
        SELECT q.aggregate_id INTO key FROM outbox._parked_events q
         WHERE q.consumer_id = c.id AND q.id = _fail.event_id;
    ELSE
        SELECT * INTO ev FROM outbox._window(shard, cur, cur.batch_end, NULL) w WHERE w.id = event_id;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'event % is not in the batch of shard % with epoch %', event_id, shard, epoch
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Nack only events that this claim returned.';
        END IF;
        key := ev.aggregate_id;
        IF EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = c.id AND p.aggregate_id = key
                                                    AND p.nacked_epoch = _fail.epoch) THEN
            RETURN;  -- the key already failed in this batch; later events of it wait anyway
        END IF;
        -- park the key: this event and the key's later events of the batch queue up, in order
        INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
        VALUES (c.id, key, shard, now());
        PERFORM outbox._queue_parked(c.id, ARRAY(
            SELECT w FROM outbox._window(shard, cur, cur.batch_end, NULL) w
             WHERE w.aggregate_id = key AND w.seq >= ev.seq));
    END IF;
    PERFORM outbox._head_failed(c, key, error, retry_after, epoch, final);
END
$$;
INSERT INTO outbox.partition_config (parent, width, ahead, retention) VALUES
    ('outbox.events', '1 day', 2, '2 days'),
    ('inbox.messages', '1 day', 2, '7 days')
ON CONFLICT (parent) DO NOTHING;

CREATE OR REPLACE FUNCTION outbox.maintain()
RETURNS TABLE (action text, relation text, detail text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg     outbox.partition_config;
    p       outbox.partitions;
    created regclass;
    lo_at   timestamptz;
    n       bigint;
    why     text;
    part    text;
    old_timeout text;
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN;  -- a replica follows its primary's maintenance
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtext('outbox.maintain')) THEN
        RETURN QUERY SELECT 'skipped', NULL::text, 'another outbox.maintain() is running';
        RETURN;
    END IF;
    -- 1. Partitions past retention first: drop or detach, never with undelivered events. A drop
    --    needs the parent's ACCESS EXCLUSIVE lock; waited for after creating a partition (which
    --    locks the default partition) it could deadlock with a reader that holds the parent and
    --    goes on to the default partition. Each waits at most a second: a long reader must not
    --    queue every emit behind the drop; the next run tries again.
    old_timeout := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', '1s', true);
    FOR cfg IN SELECT * FROM outbox.partition_config LOOP
        FOR p IN SELECT * FROM outbox.partitions x
                  WHERE x.parent = cfg.parent AND NOT x.is_default AND x.upper <= now() - cfg.retention
                  ORDER BY x.lower LOOP
            part := p.partition::text;  -- named while it exists
            BEGIN
                IF cfg.parent = 'outbox.events'::regclass THEN
                    why := outbox._partition_pending(p.partition, p.upper);
                    IF why IS NOT NULL THEN
                        RETURN QUERY SELECT 'kept', part, 'past retention, but ' || why;
                        CONTINUE;
                    END IF;
                END IF;
                -- Partitions made by CREATE EXTENSION belong to the extension, which would refuse
                -- to let them go (and would drop a detached one with itself): release them first.
                IF EXISTS (SELECT FROM pg_depend d
                            WHERE d.classid = 'pg_class'::regclass AND d.objid = p.partition
                              AND d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e') THEN
                    EXECUTE format('ALTER EXTENSION outbox_ext DROP TABLE %s', part);
                END IF;
                IF cfg.detach THEN
                    EXECUTE format('ALTER TABLE %s DETACH PARTITION %s', cfg.parent, part);
                    RETURN QUERY SELECT 'detached', part, NULL::text;
                ELSE
                    EXECUTE format('DROP TABLE %s', part);
                    RETURN QUERY SELECT 'dropped', part, NULL::text;
                END IF;
            EXCEPTION WHEN lock_not_available THEN
                RETURN QUERY SELECT 'kept', part, 'past retention, but in use (lock timeout): next run';
            END;
        END LOOP;
    END LOOP;
    PERFORM set_config('lock_timeout', old_timeout, true);
    FOR cfg IN SELECT * FROM outbox.partition_config LOOP
        -- 2. rows that landed in the default partition: report them, move them into partitions
        --    (inbox ids that are not UUIDv7 carry no time: they stay, and age out by received_at)
        FOR lo_at IN EXECUTE format(
                'SELECT DISTINCT outbox._floor_time(%s, %L) FROM %s %s',
                outbox._key_time(cfg.parent), cfg.width,
                (SELECT d.partition FROM outbox.partitions d WHERE d.parent = cfg.parent AND d.is_default),
                CASE WHEN cfg.parent = 'inbox.messages'::regclass
                     THEN 'WHERE substr(message_id::text, 15, 1) = ''7''' ELSE '' END)
        LOOP
            created := outbox._create_partition(cfg.parent, lo_at, cfg.width);
            IF created IS NOT NULL THEN
                RAISE WARNING 'outbox.maintain: rows of % were in its default partition; moved them to %',
                    cfg.parent, created;
                RETURN QUERY SELECT 'moved', created::text, 'rows from the default partition';
            END IF;
        END LOOP;
        -- 3. partitions ahead
        lo_at := outbox._floor_time(now(), cfg.width);
        FOR i IN 0 .. cfg.ahead LOOP
            created := outbox._create_partition(cfg.parent, lo_at + cfg.width * i, cfg.width);
            IF created IS NOT NULL THEN
                RETURN QUERY SELECT 'created', created::text, NULL::text;
            END IF;
        END LOOP;
    END LOOP;
    DELETE FROM inbox.messages_default m
     WHERE m.received_at < now() - (SELECT c.retention FROM outbox.partition_config c
                                     WHERE c.parent = 'inbox.messages'::regclass);
    -- 4. cursor history (a minute of it is kept, for a look at what happened) and marks
    DELETE FROM outbox._cursor_log l
     WHERE l.at < now() - interval '1 minute'
       AND l.pos < (SELECT max(m.pos) FROM outbox._cursor_log m
                     WHERE m.consumer_id = l.consumer_id AND m.shard = l.shard);
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        RETURN QUERY SELECT 'trimmed', 'outbox._cursor_log', n || ' old cursor rows';
    END IF;
    DELETE FROM outbox._marks m
     WHERE m.at < now() - interval '1 hour' AND m.top < (SELECT max(k.top) FROM outbox._marks k);
END
$$;
SELECT count(*) FROM outbox.maintain();
-- outbox_ext: privileges, all in one place. Runs last (finalize); rerunnable (upgrade
-- scripts include it).
--
-- Nothing is granted to PUBLIC. Producers reach the event log only through the SECURITY
-- DEFINER emit functions (which pin search_path); they cannot read events or configuration.
-- outbox.sinks holds secrets: only outbox_admin (and superusers, like the worker) can read it;
-- relays see a sink's health through outbox.status, which shows no URL or secret.

REVOKE ALL ON SCHEMA outbox, inbox FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;
GRANT ALL ON ALL TABLES IN SCHEMA outbox TO outbox_admin;

REVOKE ALL ON ALL TABLES IN SCHEMA inbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA inbox FROM PUBLIC;
GRANT ALL ON ALL TABLES IN SCHEMA inbox TO outbox_admin;
