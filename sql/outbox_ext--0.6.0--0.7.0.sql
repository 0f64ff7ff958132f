-- outbox_ext 0.6.0 -> 0.7.0
--
-- Why: a relay settles a claimed batch in one call, outbox.settle(consumer, shard, epoch,
-- failures), and the rule that a failed key's later events wait behind it lives there, once,
-- instead of in every relay. If recording one failure fails, the rest of the batch still
-- settles and the key is parked with the reason. ack, nack and reject are thin forms of it;
-- settle_and_claim settles and claims in one round trip.
-- Plans of the claim path no longer depend on the table statistics of the moment they were
-- made (the API functions pin planner settings), an empty shard costs one index probe, and
-- outbox.status costs O(consumers x shards) however long the log (pending counted exactly up
-- to 1,000 per shard, extrapolated beyond). maintain() with nothing to do reads the partitions
-- once, not once per partition ahead.
--
-- A delta: what changed from 0.6.0 to 0.7.0 (ALTERs, guarded DROPs, changed functions, views
-- and comments, new grants), rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.7.0'" to load this file. \quit

DROP FUNCTION IF EXISTS outbox._claim_shard(outbox.consumers, int, int, interval, text, bigint, xid8);
-- Inside a window (after_seq set) every event up to after_seq that hi sees finished is
-- delivered, so a pending one up to there is in progress at hi: above its hi floor.
-- PL/pgSQL without a query, not SQL: its callers are PL/pgSQL, which would run a SQL
-- function's body anew (about 30 µs) on every call.
CREATE OR REPLACE FUNCTION outbox._pending_floor(cur outbox._cursor_log) RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    inside boolean := cur.after_seq IS NOT NULL;
    low    bigint := CASE WHEN inside THEN cur.after_seq ELSE cur.lo_seq END;
    f      bigint;
BEGIN
    FOREACH f IN ARRAY coalesce(CASE WHEN inside THEN cur.hi_floors ELSE cur.lo_floors END, '{}') LOOP
        low := least(low, f);
    END LOOP;
    RETURN least(low, cur.restored_seq);
END
$$;

-- Events of a shard in the cursor's window, after its position and up to seq upto, in seq
-- order, at most lim (NULL: all). Both parts walk the (shard, seq, txid) index in order and
-- stop at the limit. A SQL function that the planner inlines into the statement calling it:
-- rows are read once, not copied through a function's result first. The callers' plans are
-- generic (see the API's SET clause): a custom plan, costed with the actual bounds, would
-- rather sort a whole backlog. A restored cursor reads only the dump's events, whose txids
-- are the dump's (sql/restore.sql).
CREATE OR REPLACE FUNCTION outbox._window(shard int, cur outbox._cursor_log, upto bigint, lim int)
RETURNS SETOF outbox.events
    LANGUAGE sql STABLE
AS $$
    SELECT w.* FROM (
        (SELECT e.* FROM outbox.events e
          WHERE e.shard = _window.shard
            AND e.seq > greatest(cur.after_seq, cur.lo_seq)
            AND e.seq <= least(coalesce(upto, 9223372036854775807), cur.restored_seq)
            AND e.txid >= cur.lo_top AND e.txid < pg_catalog.pg_snapshot_xmax(cur.hi_snap)
            AND pg_catalog.pg_visible_in_snapshot(e.txid, cur.hi_snap)
          ORDER BY e.seq LIMIT lim)
        UNION ALL
        (SELECT e.* FROM outbox.events e
          WHERE cur.late_from IS NOT NULL
            AND e.shard = _window.shard
            AND e.seq >= cur.late_from AND e.seq > coalesce(cur.after_seq, -1)
            AND e.seq <= least(cur.late_to, coalesce(upto, 9223372036854775807), cur.restored_seq)
            AND e.txid = ANY ((SELECT (outbox._late(cur)).txids)::xid8[])  -- once, not per row
          ORDER BY e.seq LIMIT lim)
    ) AS w ORDER BY w.seq LIMIT lim
$$;

-- The bound every window a claim opens closes at: the event seq, then a fresh xid (see the
-- header), taken before the transaction writes anything. Once a second it is also recorded as
-- a mark (outbox._marks).
CREATE OR REPLACE FUNCTION outbox._claim_bound(func text, OUT seq bigint, OUT x xid8)
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION '% must come before any write in its transaction', func
            USING ERRCODE = 'active_sql_transaction',
                  HINT = 'Call it in a transaction of its own (autocommit is fine).';
    END IF;
    seq := coalesce(pg_sequence_last_value('outbox.event_seq'), 0);
    x := pg_current_xact_id();
    IF coalesce((SELECT m.at FROM outbox._marks m ORDER BY m.top DESC LIMIT 1), '-infinity')
       < now() - interval '1 second' THEN
        INSERT INTO outbox._marks (top, seq) VALUES (x, seq) ON CONFLICT DO NOTHING;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox._check_claim(batch_size int, lease interval, func text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    PERFORM outbox._not_null(batch_size IS NULL, 'batch_size', func);
    PERFORM outbox._not_null(lease IS NULL, 'lease', func);
    PERFORM outbox._check_interval(lease, 'lease', '1 day', false);
    IF batch_size < 1 OR batch_size > 100000 THEN
        RAISE EXCEPTION 'batch_size % is out of range', batch_size
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass 1 to 100000.';
    END IF;
END
$$;

-- A shard's cursor if a claim may take the shard now: it locks the shard (SKIP LOCKED), which
-- then has no batch out under a live lease, and has something to read: parked keys (parked),
-- a window open, or an event above its floor (one index probe; no window is opened for
-- nothing). Otherwise no cursor.
CREATE OR REPLACE FUNCTION outbox._free_cursor(consumer_id int, shard int,
                                               OUT cur outbox._cursor_log, OUT parked boolean)
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    floor_seq bigint;
BEGIN
    PERFORM FROM outbox._shards s
     WHERE s.consumer_id = _free_cursor.consumer_id AND s.shard = _free_cursor.shard
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;  -- another claim is taking this shard right now
    END IF;
    cur := outbox._cursor(consumer_id, shard);
    IF cur.lease_until > now() THEN
        cur := NULL;  -- a batch is out under a live lease, or a release asked to wait
        RETURN;
    END IF;
    parked := EXISTS (SELECT FROM outbox._parked p
                       WHERE p.consumer_id = _free_cursor.consumer_id AND p.shard = _free_cursor.shard);
    IF NOT parked AND cur.hi_snap IS NULL AND cur.restored_seq IS NULL THEN
        floor_seq := outbox._pending_floor(cur);  -- a value: the probe's index bound
        IF NOT EXISTS (SELECT FROM outbox.events e
                        WHERE e.shard = _free_cursor.shard AND e.seq > floor_seq) THEN
            cur := NULL;
        END IF;
    END IF;
END
$$;

-- The claim row of a batch: the cursor, leased to owner, with the batch's last seq, whether
-- it ends the window, and the parked heads handed out with it. Written by _append alone.
CREATE OR REPLACE FUNCTION outbox._claimed(cur outbox._cursor_log, owner text, lease interval,
                                           batch_end bigint, exhausted boolean, heads uuid[])
RETURNS outbox._cursor_log
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    cur.epoch := cur.epoch + 1;
    cur.owner := owner;
    cur.lease_until := now() + lease;
    cur.batch_end := batch_end;
    cur.exhausted := exhausted;
    cur.heads := heads;
    RETURN cur;
END
$$;

-- Claim one free shard's next batch (shards tried from a random one on): its events in commit
-- order, read and handed out in one statement that also writes the claim row; or, when the
-- shard has parked keys, through _claim_parked. Nothing when no shard has work.
CREATE OR REPLACE FUNCTION outbox._claim(c outbox.consumers, batch_size int, lease interval,
                                         owner text, seq_mark bigint, x xid8)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    n      int := outbox.shard_count();
    start  int := floor(random() * n)::int;
    free   record;
    cur    outbox._cursor_log;
    next   outbox._cursor_log;
    fresh  boolean;
    got    bigint := 0;
BEGIN
    FOR i IN 0 .. n - 1 LOOP
        free := outbox._free_cursor(c.id, (start + i) % n);
        CONTINUE WHEN free.cur IS NULL;
        cur := free.cur;
        IF free.parked THEN
            RETURN QUERY SELECT * FROM outbox._claim_parked(c, cur, batch_size, lease, owner, seq_mark, x);
            GET DIAGNOSTICS got = ROW_COUNT;
        ELSE LOOP
            fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
            IF cur.hi_snap IS NULL THEN
                cur := outbox._open_window(cur, seq_mark, x);
            END IF;
            RETURN QUERY
            WITH page AS MATERIALIZED (SELECT * FROM outbox._window(cur.shard, cur, NULL, batch_size)),
                 written AS MATERIALIZED (
                     SELECT outbox._append(outbox._claimed(cur, owner, lease, max(p.seq),
                                                           count(*) < batch_size, '{}'))
                       FROM page p HAVING count(*) > 0)
            SELECT cur.shard, cur.epoch + 1, p.id, p.topic, p.aggregate_type, p.aggregate_id,
                   p.event_type, p.payload, p.headers, p.created_at, p.seq, 1
              FROM page p CROSS JOIN (SELECT count(*) FROM written) AS w  -- w: the row is written
             ORDER BY p.seq;
            GET DIAGNOSTICS got = ROW_COUNT;
            EXIT WHEN got > 0;
            IF fresh THEN
                -- nothing new since the last window: record the empty window as read when
                -- that raises the floor, so the next claim's probe starts above it
                next := outbox._advance(cur, NULL, true);
                IF outbox._pending_floor(next) > outbox._pending_floor(cur) THEN
                    PERFORM outbox._append(next);
                END IF;
                EXIT;
            END IF;
            cur := outbox._next_window(cur);
        END LOOP; END IF;
        EXIT WHEN got > 0;
    END LOOP;
END
$$;

-- The parked keys of a shard that are due: their heads, in the order they fell due.
CREATE OR REPLACE FUNCTION outbox._due_heads(c outbox.consumers, shard int, lim int)
RETURNS outbox.claimed[]
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN ARRAY(
        SELECT ROW(_due_heads.shard, NULL, q.id, q.topic, q.aggregate_type, q.aggregate_id,
                   q.event_type, q.payload, q.headers, q.created_at, q.seq, p.attempts + 1)::outbox.claimed
          FROM (SELECT * FROM outbox._parked p
                 WHERE p.consumer_id = c.id AND p.shard = _due_heads.shard AND p.next_attempt_at <= now()
                 ORDER BY p.next_attempt_at LIMIT lim) AS p
         CROSS JOIN LATERAL (SELECT * FROM outbox._parked_events q
                              WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                              ORDER BY q.pos LIMIT 1) AS q
         ORDER BY p.next_attempt_at);
END
$$;

-- _claim for a shard with parked keys: the page's events of parked keys join their queues
-- instead of going out (the shard moves past pages that hold only those), and the batch also
-- holds the due heads. Nothing (and no claim row) when neither is left.
CREATE OR REPLACE FUNCTION outbox._claim_parked(c outbox.consumers, cur outbox._cursor_log,
                                                batch_size int, lease interval, owner text,
                                                seq_mark bigint, x xid8)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    fresh     boolean;
    page      outbox.events[];
    mine      outbox.events[];
    heads     outbox.claimed[];
    exhausted boolean;
BEGIN
    LOOP
        fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
        IF cur.hi_snap IS NULL THEN
            cur := outbox._open_window(cur, seq_mark, x);
        END IF;
        page := ARRAY(SELECT w FROM outbox._window(cur.shard, cur, NULL, batch_size) AS w ORDER BY w.seq);
        exhausted := cardinality(page) < batch_size;
        PERFORM outbox._queue_parked(c.id, ARRAY(
            SELECT e FROM unnest(page) e
             WHERE EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = c.id AND p.aggregate_id = e.aggregate_id)));
        mine := ARRAY(SELECT e FROM unnest(page) e
                       WHERE NOT EXISTS (SELECT FROM outbox._parked p
                                          WHERE p.consumer_id = c.id AND p.aggregate_id = e.aggregate_id)
                       ORDER BY e.seq);  -- in seq order: an anti-join need not keep the page's
        EXIT WHEN cardinality(mine) > 0;
        IF cardinality(page) > 0 THEN
            -- only parked keys' events here: record that the shard moved past them, go on
            cur := outbox._advance(cur, page[cardinality(page)].seq, exhausted);
            PERFORM outbox._append(cur);
        ELSIF fresh THEN
            EXIT;  -- nothing new since the last window
        ELSE
            cur := outbox._next_window(cur);
        END IF;
    END LOOP;
    heads := outbox._due_heads(c, cur.shard, batch_size);
    IF cardinality(mine) = 0 AND cardinality(heads) = 0 THEN
        RETURN;
    END IF;
    cur := outbox._claimed(cur, owner, lease,
                           CASE WHEN cardinality(page) > 0 THEN page[cardinality(page)].seq ELSE cur.after_seq END,
                           exhausted, ARRAY(SELECT h.id FROM unnest(heads) h));
    PERFORM outbox._append(cur);
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

-- Settling a batch (outbox.settle; ack, nack and reject are its thin forms). A failure a relay
-- reports, resolved against its batch: the event, its key and seq, and whether it is a parked
-- key's head (handed out from the key's queue) or an event read from the shard's window.
DO $type$
BEGIN
    CREATE TYPE outbox._failure AS (
        event_id     uuid,
        aggregate_id text,
        seq          bigint,
        head         boolean,
        error        text,
        retry_after  interval,
        final        boolean
    );
EXCEPTION WHEN duplicate_object THEN NULL;  -- rerun: the type is there
END
$type$;

-- A failure's own arguments, checked before the batch is looked at.
CREATE OR REPLACE FUNCTION outbox._check_failure(event_id uuid, retry_after interval) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    PERFORM outbox._not_null(event_id IS NULL, 'event_id', 'settle, nack or reject');
    IF retry_after IS NOT NULL THEN
        PERFORM outbox._check_interval(retry_after, 'retry_after', '30 days', true);
    END IF;
END
$$;

-- settle's failures argument, a JSON array of {"id", "error", "retry_after", "final"}: checked,
-- as unresolved failures. retry_after is a number of seconds or an interval's text.
CREATE OR REPLACE FUNCTION outbox._failures(failures jsonb) RETURNS outbox._failure[]
    LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    i    int := 0;
    f    jsonb;
    one  outbox._failure;
    list outbox._failure[] := '{}';
BEGIN
    IF jsonb_typeof(failures) IS DISTINCT FROM 'array' THEN
        RAISE EXCEPTION 'failures must be a JSON array'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass ''[]'' when every event was delivered.';
    ELSIF jsonb_array_length(failures) = 0 THEN
        RETURN list;  -- the common case, without the subtransaction below
    END IF;
    BEGIN
        FOR f IN SELECT jsonb_array_elements(failures) LOOP
            i := i + 1;
            IF jsonb_typeof(f) <> 'object' OR f ->> 'id' IS NULL
               OR f - ARRAY['id', 'error', 'retry_after', 'final'] <> '{}' THEN
                RAISE EXCEPTION 'not an object with an id and nothing but error, retry_after and final'
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            one.event_id := (f ->> 'id')::uuid;
            one.error := f ->> 'error';
            one.retry_after := CASE jsonb_typeof(f -> 'retry_after')
                                   WHEN 'number' THEN make_interval(secs => (f ->> 'retry_after')::float8)
                                   ELSE (f ->> 'retry_after')::interval END;
            one.final := coalesce((f -> 'final')::boolean, false);
            PERFORM outbox._check_failure(one.event_id, one.retry_after);
            list := list || one;
        END LOOP;
    EXCEPTION WHEN data_exception THEN  -- a bad uuid, interval or boolean, or the checks above
        RAISE EXCEPTION 'failure % of failures is invalid: %', i, SQLERRM
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = format('It is %s.', f),
                  HINT = 'A failure is {"id": "<event id>", "error": "<text>", "retry_after": '
                         '<seconds or interval text, optional>, "final": <true to dead-letter it now, optional>}.';
    END;
    RETURN list;
END
$$;

-- Find a failed event in its batch (batch: the window's events the claim handed out). NULL for a
-- head that is settled already (a reject of this batch dead-lettered it).
CREATE OR REPLACE FUNCTION outbox._resolve(c outbox.consumers, cur outbox._cursor_log,
                                           batch outbox.events[], f outbox._failure)
RETURNS outbox._failure
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    f.head := coalesce(f.event_id = ANY (cur.heads), false);
    IF f.head THEN
        SELECT q.aggregate_id, q.seq INTO f.aggregate_id, f.seq FROM outbox._parked_events q
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

-- The events of the batch a cursor holds out, read from its window.
CREATE OR REPLACE FUNCTION outbox._batch(cur outbox._cursor_log) RETURNS outbox.events[]
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN ARRAY(SELECT w FROM outbox._window(cur.shard, cur, cur.batch_end, NULL) w ORDER BY w.seq);
END
$$;

-- Record a key's failure, f being its first failed event in the batch. A head counts a failed
-- attempt of its queue. An event of the window parks its key: it and the key's later events of
-- the batch are queued, in order. Returns how many events of the batch this kept back.
-- A failure of the key reported earlier for this batch (nack, reject) already queued or
-- dead-lettered its events from some point on: reported again from there or after, nothing
-- changes; from before it, the events in between would be acked unsent, so that is refused.
CREATE OR REPLACE FUNCTION outbox._fail_key(c outbox.consumers, cur outbox._cursor_log,
                                            batch outbox.events[], f outbox._failure) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    later       outbox.events[];
    parked      int;
    key_events  uuid[];
    failed_from bigint;
BEGIN
    IF NOT f.head THEN
        key_events := ARRAY(SELECT b.id FROM unnest(batch) b WHERE b.aggregate_id = f.aggregate_id);
        failed_from := least(
            (SELECT min(q.seq) FROM outbox._parked_events q
              WHERE q.consumer_id = c.id AND q.aggregate_id = f.aggregate_id AND q.id = ANY (key_events)),
            (SELECT min(d.seq) FROM outbox.dead_letters d
              WHERE d.consumer = c.name AND d.aggregate_id = f.aggregate_id AND d.event_id = ANY (key_events)));
        IF f.seq < failed_from THEN
            RAISE EXCEPTION 'event % comes before an event of its key already reported failed in this batch',
                    f.event_id
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Report a key''s failures in batch order, or all at once with outbox.settle.';
        ELSIF failed_from IS NOT NULL THEN
            RETURN 0;  -- the key failed in this batch already, from this event or before it
        END IF;
        INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
        VALUES (c.id, f.aggregate_id, cur.shard, now())
        ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS parked = ROW_COUNT;
        later := ARRAY(SELECT b FROM unnest(batch) b
                        WHERE b.aggregate_id = f.aggregate_id AND b.seq >= f.seq ORDER BY b.seq);
        PERFORM outbox._queue_parked(c.id, later);
        IF parked = 0 THEN
            RETURN cardinality(later);  -- parked meanwhile (a replay): they wait behind its queue
        END IF;
    END IF;
    PERFORM outbox._head_failed(c, f.aggregate_id, f.error, f.retry_after, cur.epoch, f.final);
    RETURN CASE WHEN f.head THEN 1 ELSE cardinality(later) END;
END
$$;

-- _fail_key, and if recording the failure itself fails, the key parked with that reason in
-- place of the relay's error and retried: the rest of the batch still settles, and the reason
-- shows in outbox.status.last_error.
CREATE OR REPLACE FUNCTION outbox._fail_key_or_say_why(c outbox.consumers, cur outbox._cursor_log,
                                                       batch outbox.events[], f outbox._failure) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN outbox._fail_key(c, cur, batch, f);
EXCEPTION WHEN OTHERS THEN
    f.error := format('settling this failure failed: %s (the relay said: %s)', SQLERRM, left(f.error, 1000));
    f.retry_after := NULL;
    f.final := false;
    RETURN outbox._fail_key(c, cur, batch, f);
END
$$;

-- The hold-back rule, in one place: a key's first failure in batch order fails the key, and its
-- later events in the batch wait behind it whatever the relay said of them. The failures are
-- recorded together; only if that fails, each on its own (a subtransaction each: kept for the
-- rare case, as many of them slow every snapshot of the cluster). Returns the events kept back.
CREATE OR REPLACE FUNCTION outbox._fail_batch(c outbox.consumers, cur outbox._cursor_log,
                                              failures outbox._failure[]) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    batch  outbox.events[] := outbox._batch(cur);
    firsts outbox._failure[];
    f      outbox._failure;
    kept   int := 0;
BEGIN
    firsts := ARRAY(SELECT DISTINCT ON (r.aggregate_id) r
                      FROM unnest(failures) AS u, outbox._resolve(c, cur, batch, u) AS r
                     WHERE r.aggregate_id IS NOT NULL
                     ORDER BY r.aggregate_id, r.seq);
    BEGIN
        FOREACH f IN ARRAY firsts LOOP
            kept := kept + outbox._fail_key(c, cur, batch, f);
        END LOOP;
    EXCEPTION WHEN OTHERS THEN
        kept := 0;
        FOREACH f IN ARRAY firsts LOOP
            kept := kept + outbox._fail_key_or_say_why(c, cur, batch, f);
        END LOOP;
    END;
    RETURN kept;
END
$$;

-- The rest of a settled batch is delivered: parked heads handed out and not failed in this
-- batch leave their queues, and the shard moves past the batch.
CREATE OR REPLACE FUNCTION outbox._deliver_rest(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    keys text[];
BEGIN
    IF cardinality(cur.heads) > 0 THEN
        -- set-based (a batch may hold hundreds of heads): out of their queues, their keys'
        -- next heads due at once, and the keys whose queues are now empty unparked
        WITH delivered AS (
            DELETE FROM outbox._parked_events q
             USING outbox._parked p
             WHERE q.consumer_id = c.id AND q.id = ANY (cur.heads)
               AND p.consumer_id = q.consumer_id AND p.aggregate_id = q.aggregate_id
               AND p.nacked_epoch IS DISTINCT FROM cur.epoch
            RETURNING q.aggregate_id)
        SELECT array_agg(d.aggregate_id) INTO keys FROM delivered d;
        UPDATE outbox._parked p SET attempts = 0, next_attempt_at = now()
         WHERE p.consumer_id = c.id AND p.aggregate_id = ANY (keys);
        DELETE FROM outbox._parked p
         WHERE p.consumer_id = c.id AND p.aggregate_id = ANY (keys)
           AND NOT EXISTS (SELECT FROM outbox._parked_events q
                            WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id);
    END IF;
    PERFORM outbox._append(outbox._advance(cur, cur.batch_end, cur.exhausted));
END
$$;

-- nack and reject: one event failed; the batch stays out until settle or ack.
CREATE OR REPLACE FUNCTION outbox._fail(consumer text, shard int, epoch bigint, event_id uuid, error text,
                                        retry_after interval, final boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    c     outbox.consumers := outbox._consumer(consumer);
    cur   outbox._cursor_log;
    batch outbox.events[];
    f     outbox._failure := ROW(event_id, NULL, NULL, NULL, error, retry_after, final);
BEGIN
    PERFORM outbox._check_failure(event_id, retry_after);
    cur := outbox._leased(c.id, shard, epoch);
    batch := CASE WHEN event_id = ANY (cur.heads) THEN '{}' ELSE outbox._batch(cur) END;
    f := outbox._resolve(c, cur, batch, f);
    IF f.aggregate_id IS NOT NULL THEN
        PERFORM outbox._fail_key(c, cur, batch, f);
    END IF;
END
$$;

---------------------------------------------------------------------------------------------
-- API
---------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION outbox.create_consumer(
    name          text,
    from_beginning boolean  DEFAULT false,
    max_attempts  int      DEFAULT 10,
    backoff_base  interval DEFAULT '1 second',
    backoff_max   interval DEFAULT '10 minutes'
) RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    rebased boolean := outbox._rebase_if_restored();  -- first: it may write
    c_id   int;
    -- The first bound, taken as claims take theirs (see the header); if this transaction has
    -- written already, its xid may be older than the seq, so start the seq bound at 0.
    -- (never below a restored dump's events: their txids are not this cluster's)
    restored bigint := coalesce((SELECT o.restored_seq FROM outbox._origin o), 0);
    lo_seq bigint := CASE WHEN pg_current_xact_id_if_assigned() IS NULL
                          THEN coalesce(pg_sequence_last_value('outbox.event_seq'), 0) ELSE restored END;
    x      xid8 := pg_current_xact_id();
    lo     pg_snapshot := pg_current_snapshot();
    lo_top xid8 := outbox._top(lo, x);
BEGIN
    PERFORM outbox._not_null(name IS NULL, 'name', 'outbox.create_consumer');
    PERFORM outbox._not_null(from_beginning IS NULL, 'from_beginning', 'outbox.create_consumer');
    PERFORM outbox._not_null(max_attempts IS NULL, 'max_attempts', 'outbox.create_consumer');
    PERFORM outbox._not_null(backoff_base IS NULL, 'backoff_base', 'outbox.create_consumer');
    PERFORM outbox._not_null(backoff_max IS NULL, 'backoff_max', 'outbox.create_consumer');
    IF name = '' OR length(name) > 128 THEN
        RAISE EXCEPTION 'consumer name must be 1 to 128 characters'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Name the consumer after its sink.';
    END IF;
    PERFORM outbox._check_interval(backoff_base, 'backoff_base', '30 days', false);
    PERFORM outbox._check_interval(backoff_max, 'backoff_max', '30 days', false);
    IF max_attempts < 1 OR backoff_max < backoff_base THEN
        RAISE EXCEPTION 'invalid retry policy (max_attempts %, backoff % to %)',
                max_attempts, backoff_base, backoff_max
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'max_attempts >= 1 and 0 < backoff_base <= backoff_max.';
    END IF;
    INSERT INTO outbox.consumers (name, max_attempts, backoff_base, backoff_max)
    VALUES (create_consumer.name, create_consumer.max_attempts, create_consumer.backoff_base,
            create_consumer.backoff_max)
    ON CONFLICT ON CONSTRAINT consumers_name_key DO NOTHING
    RETURNING id INTO c_id;
    IF c_id IS NULL THEN
        RAISE EXCEPTION 'consumer "%" already exists', name
            USING ERRCODE = 'duplicate_object',
                  HINT = 'Pick another name, or outbox.drop_consumer it first.';
    END IF;
    INSERT INTO outbox._shards SELECT c_id, s FROM generate_series(0, outbox.shard_count() - 1) s;
    -- Transactions in progress now get floor 0: their events may be older than anything; this
    -- transaction's own, lo_seq.
    -- From the beginning in a database restored from a dump: the dump's events first, in its
    -- transaction ids (sql/restore.sql).
    INSERT INTO outbox._cursor_log (consumer_id, shard, epoch, lo_snap, lo_seq, lo_top, lo_txids,
                                    lo_floors, restored_seq, restored_top)
    SELECT c_id, s, 0, b.snap, b.seq, b.top, b.txids,
           ARRAY(SELECT CASE WHEN t = x THEN lo_seq ELSE restored END FROM unnest(b.txids) AS t),
           o.restored_seq, o.restored_top
      FROM generate_series(0, outbox.shard_count() - 1) AS s
      LEFT JOIN outbox._origin o ON from_beginning,
           (SELECT '1:1:'::pg_snapshot AS snap, 0::bigint AS seq, '1'::xid8 AS top, '{}'::xid8[] AS txids
             WHERE from_beginning
            UNION ALL
            SELECT lo, lo_seq, lo_top, outbox._in_progress(lo, x) WHERE NOT from_beginning) AS b;
END
$$;

CREATE OR REPLACE FUNCTION outbox.drop_consumer(name text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM outbox._not_null(name IS NULL, 'name', 'outbox.drop_consumer');
    -- Its shards first, in order, as claims and acks take them before they write a cursor row
    -- (whose key check waits for the consumer row): deleting the consumer first would deadlock
    -- with an ack under way.
    PERFORM FROM outbox._shards s JOIN outbox.consumers c ON c.id = s.consumer_id
     WHERE c.name = drop_consumer.name ORDER BY s.shard FOR UPDATE OF s;
    DELETE FROM outbox.dead_letters d WHERE d.consumer = drop_consumer.name;
    DELETE FROM outbox.consumers c WHERE c.name = drop_consumer.name;
    RETURN FOUND;
END
$$;

CREATE OR REPLACE FUNCTION outbox.claim(
    consumer   text,
    batch_size int      DEFAULT 100,
    lease      interval DEFAULT '30 seconds',
    owner      text     DEFAULT NULL
) RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    rebased boolean := outbox._rebase_if_restored();  -- first: it may write
    c       outbox.consumers := outbox._consumer(consumer);
    b       record;
BEGIN
    IF rebased THEN
        RETURN;  -- this transaction rebased a restored database (it wrote): claim in the next
    END IF;
    PERFORM outbox._check_claim(batch_size, lease, 'outbox.claim');
    b := outbox._claim_bound('outbox.claim');
    RETURN QUERY SELECT * FROM outbox._claim(c, batch_size, lease,
                                             coalesce(owner, 'backend ' || pg_backend_pid()), b.seq, b.x);
END
$$;

-- What settle, ack and settle_and_claim share: the leased batch's failures, then the rest.
CREATE OR REPLACE FUNCTION outbox._settle(c outbox.consumers, cur outbox._cursor_log,
                                          failures outbox._failure[]) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    kept int := 0;
BEGIN
    IF cardinality(failures) > 0 THEN
        kept := outbox._fail_batch(c, cur, failures);
    END IF;
    PERFORM outbox._deliver_rest(c, cur);
    RETURN kept;
END
$$;

CREATE OR REPLACE FUNCTION outbox.settle(consumer text, shard int, epoch bigint,
                                         failures jsonb DEFAULT '[]') RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c    outbox.consumers := outbox._consumer(consumer);
    list outbox._failure[];
BEGIN
    PERFORM outbox._not_null(failures IS NULL, 'failures', 'outbox.settle');
    list := outbox._failures(failures);
    RETURN outbox._settle(c, outbox._leased(c.id, shard, epoch), list);
END
$$;
COMMENT ON FUNCTION outbox.settle(text, int, bigint, jsonb) IS
    'Finishes a claimed batch in one call. failures lists the events that failed, as a JSON array '
    'of {"id", "error", "retry_after" (seconds or interval text, optional), "final" (true: '
    'dead-letter now)}; a failed key''s later events in the batch wait behind it, in order, '
    'whatever was said of them; every other event counts as delivered and the shard moves on. '
    'Returns how many events were kept back. Example: SELECT outbox.settle(''hook'', 3, 17, '
    '''[{"id": "0190...", "error": "HTTP 503", "retry_after": 30}]'');';

CREATE OR REPLACE FUNCTION outbox.settle_and_claim(
    consumer   text,
    shard      int,
    epoch      bigint,
    failures   jsonb    DEFAULT '[]',
    batch_size int      DEFAULT 100,
    lease      interval DEFAULT '30 seconds',
    owner      text     DEFAULT NULL
) RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    rebased boolean := outbox._rebase_if_restored();  -- first: it may write
    c       outbox.consumers := outbox._consumer(consumer);
    list    outbox._failure[];
    b       record;
BEGIN
    PERFORM outbox._not_null(failures IS NULL, 'failures', 'outbox.settle_and_claim');
    list := outbox._failures(failures);
    PERFORM outbox._check_claim(batch_size, lease, 'outbox.settle_and_claim');
    IF NOT rebased THEN
        b := outbox._claim_bound('outbox.settle_and_claim');  -- before settling writes anything
    END IF;
    PERFORM outbox._settle(c, outbox._leased(c.id, shard, epoch), list);
    IF NOT rebased THEN
        RETURN QUERY SELECT * FROM outbox._claim(c, batch_size, lease,
                                                 coalesce(owner, 'backend ' || pg_backend_pid()), b.seq, b.x);
    END IF;
END
$$;
COMMENT ON FUNCTION outbox.settle_and_claim(text, int, bigint, jsonb, int, interval, text) IS
    'settle, then claim, in one call and one transaction: a relay''s loop in one round trip. '
    'Example: SELECT * FROM outbox.settle_and_claim(''hook'', 3, 17, ''[]'', 100);';

CREATE OR REPLACE FUNCTION outbox.ack(consumer text, shard int, epoch bigint) RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c outbox.consumers := outbox._consumer(consumer);
BEGIN
    PERFORM outbox._settle(c, outbox._leased(c.id, shard, epoch), '{}');
END
$$;
COMMENT ON FUNCTION outbox.ack(text, int, bigint) IS
    'settle with no failures: every event not nacked or rejected counts as delivered and the '
    'shard moves on. Example: SELECT outbox.ack(''billing-webhook'', 3, 17);';

CREATE OR REPLACE FUNCTION outbox.nack(consumer text, shard int, epoch bigint, event_id uuid, error text,
                            retry_after interval DEFAULT NULL) RETURNS void
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
    RETURN outbox._fail(consumer, shard, epoch, event_id, error, retry_after, false);
COMMENT ON FUNCTION outbox.nack(text, int, bigint, uuid, text, interval) IS
    'One failure of settle, reported on its own: the event''s key is parked (the shard goes on '
    'without it) and retried with backoff, or after retry_after; call ack (or settle) afterwards '
    'for the rest of the batch. '
    'Example: SELECT outbox.nack(''billing-webhook'', 3, 17, ''0190...''::uuid, ''HTTP 500'');';

CREATE OR REPLACE FUNCTION outbox.reject(consumer text, shard int, epoch bigint, event_id uuid, error text)
RETURNS void
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
    RETURN outbox._fail(consumer, shard, epoch, event_id, error, NULL, true);
COMMENT ON FUNCTION outbox.reject(text, int, bigint, uuid, text) IS
    'A final failure of settle, reported on its own (e.g. HTTP 400): the event goes to '
    'outbox.dead_letters at once and its key moves on; call ack (or settle) afterwards for the '
    'rest of the batch. '
    'Example: SELECT outbox.reject(''billing-webhook'', 3, 17, ''0190...''::uuid, ''HTTP 422'');';

CREATE OR REPLACE FUNCTION outbox.release(consumer text, shard int, epoch bigint,
                               retry_after interval DEFAULT '0') RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c   outbox.consumers := outbox._consumer(consumer);
    cur outbox._cursor_log;
BEGIN
    PERFORM outbox._not_null(retry_after IS NULL, 'retry_after', 'outbox.release');
    PERFORM outbox._check_interval(retry_after, 'retry_after', '30 days', true);
    cur := outbox._leased(c.id, shard, epoch);
    cur.owner := NULL;
    cur.lease_until := CASE WHEN retry_after > '0' THEN now() + retry_after END;
    cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
    PERFORM outbox._append(cur);
END
$$;

CREATE OR REPLACE FUNCTION outbox.release_owner(consumer text, owner text) RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c   outbox.consumers := outbox._consumer(consumer);
    s   int;
    cur outbox._cursor_log;
    n   int := 0;
BEGIN
    PERFORM outbox._not_null(owner IS NULL, 'owner', 'outbox.release_owner');
    FOR s IN SELECT sh.shard FROM outbox._shards sh WHERE sh.consumer_id = c.id
              ORDER BY sh.shard FOR UPDATE LOOP
        cur := outbox._cursor(c.id, s);
        CONTINUE WHEN cur.owner IS DISTINCT FROM release_owner.owner OR cur.lease_until <= now();
        cur.owner := NULL; cur.lease_until := NULL;
        cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
        PERFORM outbox._append(cur);
        n := n + 1;
    END LOOP;
    RETURN n;
END
$$;

CREATE OR REPLACE FUNCTION outbox.replay(consumer text, aggregate_id text DEFAULT NULL) RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c outbox.consumers := outbox._consumer(consumer);
    n int;
BEGIN
    -- Hold every shard of the consumer so no ack unparks a key while we queue into it.
    PERFORM FROM outbox._shards s WHERE s.consumer_id = c.id ORDER BY s.shard FOR UPDATE;
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
    RETURN n;
END
$$;
-- outbox_ext: what is left to deliver, per consumer and per shard, and why.
--
-- What is pending is outbox._pending's answer (sql/claim.sql), for the events above
-- outbox._pending_floor, which bounds the index scan. A view of it costs O(consumers x shards),
-- however many events the log holds: each shard's pending events are counted exactly up to
-- 1,000 and extrapolated beyond (outbox._shard_pending).
--
-- Name resolution (sql/grants.sql): both views are [parsed] and run as their owner;
-- _shard_pending is [pinned] (the views call it as whoever reads them).

-- A consumer's pending events in one shard (for a sink, those its routing delivers), read in
-- seq order from the cursor's floor: counted up to cap; when there are more, the rest is
-- estimated from their density in seq over the seq range still ahead. oldest: the oldest
-- pending event's created_at (of the first cap, which start at the oldest seq).
CREATE OR REPLACE FUNCTION outbox._shard_pending(cur outbox._cursor_log, sink outbox.sinks,
                                                 OUT events bigint, OUT oldest timestamptz)
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    cap       constant int := 1000;
    floor_seq bigint := outbox._pending_floor(cur);
    first_seq bigint;
    last_seq  bigint;
BEGIN
    SELECT count(*), min(p.created_at), min(p.seq), max(p.seq) INTO events, oldest, first_seq, last_seq
      FROM (SELECT e.created_at, e.seq FROM outbox.events e
             WHERE e.shard = cur.shard AND e.seq > floor_seq AND outbox._pending(cur, e.txid, e.seq)
               AND (sink.name IS NULL OR outbox._routes(sink, e.topic, e.aggregate_type))
             ORDER BY e.seq LIMIT cap) AS p;
    IF events = cap THEN
        events := events + (coalesce(pg_sequence_last_value('outbox.event_seq'), last_seq) - last_seq)
                           * cap / greatest(last_seq - first_seq + 1, cap);
    END IF;
END
$$;

CREATE OR REPLACE VIEW outbox.shard_status AS
SELECT c.name AS consumer,
       cur.shard,
       pend.events AS pending,
       pend.oldest AS oldest_pending_at,
       now() - pend.oldest AS lag,
       (SELECT count(*) FROM outbox._parked p WHERE p.consumer_id = c.id AND p.shard = cur.shard) AS parked_keys,
       CASE WHEN cur.owner IS NOT NULL AND cur.lease_until > now() THEN cur.owner END AS leased_by,
       cur.at AS last_activity
  FROM outbox.consumers c
  LEFT JOIN outbox.sinks k ON k.name = c.name
 CROSS JOIN generate_series(0, outbox.shard_count() - 1) AS s(shard)
 CROSS JOIN LATERAL (SELECT * FROM outbox._cursor_log l
                      WHERE l.consumer_id = c.id AND l.shard = s.shard
                      ORDER BY l.pos DESC LIMIT 1) AS cur
 CROSS JOIN LATERAL outbox._shard_pending(cur, k) AS pend;  -- a sink's: only what it routes
COMMENT ON VIEW outbox.shard_status IS
    'Per consumer and shard: pending events (exact up to 1,000, estimated beyond), the oldest one '
    'and its age, parked keys, who holds the lease.';
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
    rebased boolean;
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN;  -- a replica follows its primary's maintenance
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtext('outbox.maintain')) THEN
        RETURN QUERY SELECT 'skipped', NULL::text, 'another outbox.maintain() is running';
        RETURN;
    END IF;
    IF outbox._restore_running() THEN  -- its partitions would collide with the dump's
        RETURN QUERY SELECT 'skipped', NULL::text, 'a restore into this database is running';
        RETURN;
    END IF;
    -- 1. Partitions past retention first: drop or detach, never with undelivered events. A drop
    --    needs the parent's ACCESS EXCLUSIVE lock; waited for after creating a partition (which
    --    locks the default partition) it could deadlock with a reader that holds the parent and
    --    goes on to the default partition. Each waits at most a second: a long reader must not
    --    queue every emit behind the drop; the next run tries again.
    -- a database restored from a dump (sql/restore.sql); the guard on emits goes in a later
    -- run, once the rebase is committed (dropping it here would wait for emits that wait for us)
    rebased := outbox._rebase_if_restored();
    old_timeout := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', '1s', true);
    IF NOT rebased AND EXISTS (SELECT FROM pg_trigger t WHERE t.tgrelid = 'outbox.events'::regclass
                                                        AND t.tgname = 'rebase_before_emit')
       AND NOT (SELECT o.restore_pending FROM outbox._origin o) THEN
        BEGIN  -- rebased: emits need not stop by any more, and write natively again
            DROP TRIGGER rebase_before_emit ON outbox.events;
            RETURN QUERY SELECT 'rebased', 'outbox.events', 'restored from a dump; rebased'::text;
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;  -- in use: the next run
        END;
    END IF;
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
            EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
                -- A deadlock: a transaction that holds the inbox and waits for the events table
                -- (inbox.claim, then emit) while this run, having dropped an events partition,
                -- waits for the inbox. This run gives way; the transaction goes on once it ends.
                RETURN QUERY SELECT 'kept', part, 'past retention, but in use ('
                    || CASE SQLSTATE WHEN '40P01' THEN 'deadlock' ELSE 'lock timeout' END || '): next run';
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
        -- 3. partitions ahead: the ranges no partition covers yet, found in one pass over the
        --    partitions (each _create_partition call reads them all again)
        FOR lo_at IN
            WITH existing AS MATERIALIZED (
                     SELECT x.lower, x.upper FROM outbox.partitions x
                      WHERE x.parent = cfg.parent AND NOT x.is_default
                        AND x.upper > outbox._floor_time(now(), cfg.width))
            SELECT g FROM generate_series(outbox._floor_time(now(), cfg.width),
                                          outbox._floor_time(now(), cfg.width) + cfg.width * cfg.ahead,
                                          cfg.width) AS g
             WHERE NOT EXISTS (SELECT FROM existing e WHERE e.lower <= g AND e.upper >= g + cfg.width)
             ORDER BY g
        LOOP
            created := outbox._create_partition(cfg.parent, lo_at, cfg.width);
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
SELECT outbox._index_partition('outbox.events', 'outbox.events_default');
SELECT outbox._index_partition('inbox.messages', 'inbox.messages_default');

-- nothing new is PUBLIC
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox, inbox FROM PUBLIC;
-- no longer granted
REVOKE EXECUTE ON FUNCTION outbox._pending(outbox._cursor_log, xid8, bigint), outbox._pending_floor(outbox._cursor_log), outbox._routes(outbox.sinks, text, text) FROM outbox_relay;
-- what the status views ask of each shard (functions a view calls are checked against
-- whoever reads it)
GRANT EXECUTE ON FUNCTION outbox._shard_pending(outbox._cursor_log, outbox.sinks)
    TO outbox_relay, outbox_admin;
GRANT EXECUTE ON FUNCTION
    outbox.claim(text, int, interval, text),
    outbox.settle(text, int, bigint, jsonb),
    outbox.settle_and_claim(text, int, bigint, jsonb, int, interval, text),
    outbox.ack(text, int, bigint),
    outbox.nack(text, int, bigint, uuid, text, interval),
    outbox.reject(text, int, bigint, uuid, text),
    outbox.release(text, int, bigint, interval),
    outbox.release_owner(text, text),
    outbox.shard_count(),
    outbox.shard_of(text)
TO outbox_relay;
