-- outbox_ext 0.9.0 -> 0.10.0
--
-- Why: \df outbox.* listed some 70 internal helpers beside the API. They move to a schema of
-- their own, outbox_internal, that no role may use (sql/roles.sql, sql/grants.sql); the
-- internal type outbox._failure moves with them. ALTER ... SET SCHEMA keeps each object's
-- grants and everything that depends on it (views, triggers, the event trigger); the functions
-- whose bodies name a helper are then replaced, to name it in its new schema.
--
-- maintain() with nothing to do read every partition's size: outbox.partitions computes it,
-- and a view with a volatile column is not merged into the query that reads it. The ranges
-- are now the internal view outbox_internal.partition_ranges (bounds cut out with split_part,
-- not a regexp), which maintain() and outbox.partitions read; and the partitions ahead are
-- found against one multirange of what exists, not a scan of the partitions per range.
--
-- Claims, settles and status read every partition: maintain() now seals the log's past
-- (outbox._seals, sql/claim.sql), and the reads of a cursor past a seal skip the partitions
-- behind it; _window takes the bound as an argument (the old form is dropped). A claim that
-- starts in a window read to its end records the empty window after it, so that an idle
-- consumer's polls stop reading it again.
--
-- A delta: what changed from 0.9.0 to 0.10.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.10.0'" to load this file. \quit

CREATE SCHEMA IF NOT EXISTS outbox_internal;
REVOKE ALL ON SCHEMA outbox_internal FROM PUBLIC;

-- _window takes the time its events were made after (see below)
DROP FUNCTION IF EXISTS outbox._window(int, outbox._cursor_log, bigint, int);

-- our own helpers only (a user's function of that name stays); a second run finds none left
DO $move$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid FROM pg_catalog.pg_proc p
               JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_proc'::regclass AND d.objid = p.oid
                                          AND d.refclassid = 'pg_catalog.pg_extension'::regclass AND d.deptype = 'e'
               JOIN pg_catalog.pg_extension x ON x.oid = d.refobjid AND x.extname = 'outbox_ext'
              WHERE p.pronamespace = 'outbox'::regnamespace AND p.proname LIKE '\_%'
    LOOP
        EXECUTE pg_catalog.format('ALTER FUNCTION %s SET SCHEMA outbox_internal', f);
    END LOOP;
    IF pg_catalog.to_regtype('outbox._failure') IS NOT NULL THEN
        ALTER TYPE outbox._failure SET SCHEMA outbox_internal;
    END IF;
END
$move$;
-- Internal helpers: usable by no role (sql/grants.sql), called only by the API's functions and
-- views, so that \df outbox.* lists the API alone.
CREATE SCHEMA IF NOT EXISTS outbox_internal;
/* </end connected objects> */

/* <begin connected objects> */
-- src/sinks/check.rs:59
-- outbox_ext::sinks::check::check_sink_settings
-- Skipped due to `#[pgrx(sql = false)]`
/* </end connected objects> */

/* <begin connected objects> */
-- src/emit/mod.rs:71
-- outbox_ext::emit::event_id
-- Skipped due to `#[pgrx(sql = false)]`
/* </end connected objects> */

/* <begin connected objects> */
-- src/roles.rs:13
CREATE SCHEMA IF NOT EXISTS outbox_internal; 
-- Seals: what outbox.maintain() learned of the log's past. Every event made before upper (by a
-- transaction that began before it; emit's created_at is that start) has a seq of at most
-- max_seq. So a read of the events above a seq may add "created_at >= the newest seal's upper
-- whose max_seq is at most that seq" (outbox_internal._since), which PostgreSQL uses to skip
-- the older partitions before it opens them: a claim's cost does not grow with the partitions
-- it has read past. maintain() seals only a partition boundary that no open transaction began
-- before, and a minute back from that: a clock stepped back by more could let an event land
-- behind a seal, unseen by claims (dropping a partition past retention assumes the same of
-- the clock). Insert-only; maintain() trims seals below the oldest partition. Not dumped, and
-- dropped when a dump is restored (sql/restore.sql): the restored events' seqs and times are
-- the dump's; maintain() seals the restored log once it is rebased.
CREATE TABLE IF NOT EXISTS outbox._seals (
    max_seq bigint      NOT NULL,
    upper   timestamptz NOT NULL,
    made_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (max_seq, upper)
);

---------------------------------------------------------------------------------------------
-- Internals
---------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION outbox_internal._consumer(name text) RETURNS outbox.consumers
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    c outbox.consumers;
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'consumer', 'the function');
    PERFORM outbox_internal._rebase_if_restored();
    SELECT * INTO c FROM outbox.consumers WHERE consumers.name = _consumer.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'consumer "%" does not exist', name
            USING ERRCODE = 'undefined_object',
                  HINT = 'Create it with outbox.create_consumer(name).';
    END IF;
    RETURN c;
END
$$;

-- Close the window at a new bound (seq_mark, then xid x, then a snapshot now; see the header).
-- Each in-progress transaction gets a floor: carried over if lo had it in progress too, else
-- lo.seq (it began after lo's mark), raised to the newest mark below it; x itself, seq_mark.
-- Then find, once, the seq range that holds the events of part (b), bounded above by the seq
-- read after the snapshot: pages of the window scan only that range for them.
-- Generic plans: custom ones would plan the scan of every partition again in each of a
-- session's first windows.
CREATE OR REPLACE FUNCTION outbox_internal._open_window(cur outbox._cursor_log, seq_mark bigint, x xid8)
RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    late    record;
    seq_end bigint;
    since   timestamptz;
BEGIN
    IF cur.restored_seq IS NOT NULL THEN
        -- Restored from a dump (sql/restore.sql): the last window in the dump's transaction ids
        -- ends where every event of the dump is committed, as every restored event is.
        cur.hi_seq := cur.restored_seq;
        cur.hi_snap := (cur.restored_top || ':' || cur.restored_top || ':')::pg_snapshot;
        cur.hi_top := cur.restored_top;
        cur.hi_txids := '{}';
        cur.hi_floors := '{}';
        seq_end := cur.restored_seq;
    ELSE
        cur.hi_seq := seq_mark;
        cur.hi_snap := pg_current_snapshot();
        seq_end := coalesce(pg_sequence_last_value('outbox.event_seq'), 0);
        cur.hi_top := outbox_internal._top(cur.hi_snap, x);
        SELECT coalesce(array_agg(t ORDER BY t), '{}'),
               coalesce(array_agg(CASE WHEN t = x THEN seq_mark
                                       ELSE greatest(coalesce(u.f, cur.lo_seq),
                                                     (SELECT m.seq FROM outbox._marks m WHERE m.top < t
                                                       ORDER BY m.top DESC LIMIT 1)) END ORDER BY t), '{}')
          INTO cur.hi_txids, cur.hi_floors
          FROM unnest(outbox_internal._in_progress(cur.hi_snap, x)) AS t
          LEFT JOIN unnest(cur.lo_txids, cur.lo_floors) AS u(id, f) ON u.id = t;
    END IF;
    late := outbox_internal._late(cur);
    cur.late_from := NULL; cur.late_to := NULL;
    IF cardinality(late.txids) > 0 THEN
        since := outbox_internal._since(late.floor_seq);
        -- One pass over the range per transaction (there are few), txid = t checked on the
        -- index entries: only their events' rows are visited. (txid = ANY (array) is checked
        -- on the heap rows instead, and a min/max plan would walk the range twice.)
        SELECT min(e.seq), max(e.seq) INTO cur.late_from, cur.late_to
          FROM unnest(late.txids) AS t
         CROSS JOIN LATERAL (SELECT e.seq FROM outbox.events e
                              WHERE e.shard = cur.shard AND e.seq > late.floor_seq
                                AND e.seq <= seq_end AND e.txid = t AND e.created_at >= since
                             OFFSET 0) AS e;
    END IF;
    cur.after_seq := NULL;
    RETURN cur;
END
$$;

-- The position after delivering through batch_end: the same window further on, or, when the
-- window is exhausted, no window yet after its upper bound.
CREATE OR REPLACE FUNCTION outbox_internal._advance(cur outbox._cursor_log, batch_end bigint, exhausted boolean)
RETURNS outbox._cursor_log
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF exhausted THEN
        cur.lo_snap := cur.hi_snap;   cur.lo_seq := cur.hi_seq;       cur.lo_top := cur.hi_top;
        cur.lo_txids := cur.hi_txids; cur.lo_floors := cur.hi_floors;
        IF cur.lo_top = cur.restored_top THEN
            -- Restored, and the dump's last window is done: every event of the dump is. Go on in
            -- this cluster's transaction ids, with every event after the dump's (a greater seq).
            cur := outbox_internal._lo_after_seq(cur, cur.restored_seq);
            cur.restored_seq := NULL; cur.restored_top := NULL;
        END IF;
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

-- A window done: no window yet after it. Leaving a dump's events (see _advance) is recorded
-- at once, so that later claims do not look through them again.
CREATE OR REPLACE FUNCTION outbox_internal._next_window(cur outbox._cursor_log) RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    restored boolean := cur.restored_seq IS NOT NULL;
BEGIN
    cur := outbox_internal._advance(cur, NULL, true);
    IF restored AND cur.restored_seq IS NULL THEN
        PERFORM outbox_internal._append(cur);
    END IF;
    RETURN cur;
END
$$;

-- The newest seal (NULLs when there is none).
CREATE OR REPLACE FUNCTION outbox_internal._newest_seal() RETURNS outbox._seals
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    newest outbox._seals;
BEGIN
    SELECT * INTO newest FROM outbox._seals s ORDER BY s.max_seq DESC, s.upper DESC LIMIT 1;
    RETURN newest;
END
$$;

-- The earliest created_at an event with a greater seq can have ('-infinity' when no seal says).
-- Seals are made a minute behind the clock: a clock now behind that went back, and until
-- maintain() has dropped the seals (sql/partitions.sql) none is trusted.
CREATE OR REPLACE FUNCTION outbox_internal._since(seq bigint) RETURNS timestamptz
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF now() < (outbox_internal._newest_seal()).upper + interval '1 minute' THEN
        RETURN '-infinity';
    END IF;
    RETURN coalesce((SELECT s.upper FROM outbox._seals s WHERE s.max_seq <= _since.seq
                      ORDER BY s.max_seq DESC, s.upper DESC LIMIT 1), '-infinity');
END
$$;

-- Whether the cursor's floor is behind the newest seal's seq, and the cursor was last written
-- before that seal was made. Until its floor is past the seal, a cursor gains nothing from it,
-- and a shard with no new events keeps its floor (a claim finds nothing to read there); so a
-- claim reads such a shard once and records the empty window (_free_cursor, _claim). Once
-- per seal: a transaction in progress may keep the floor behind a while longer.
CREATE OR REPLACE FUNCTION outbox_internal._behind_a_seal(cur outbox._cursor_log, newest outbox._seals)
RETURNS boolean
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN coalesce(outbox_internal._pending_floor(cur) < newest.max_seq AND cur.at < newest.made_at, false);
END
$$;

-- The earliest created_at of the events _window can read for the cursor: its since argument.
-- Callers pass it as a value (a PL/pgSQL variable): a value prunes partitions before they are
-- opened, where an expression would be evaluated again for every row.
CREATE OR REPLACE FUNCTION outbox_internal._window_since(cur outbox._cursor_log) RETURNS timestamptz
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN outbox_internal._since(least(greatest(cur.after_seq, cur.lo_seq), cur.late_from - 1));
END
$$;

-- Events of a shard in the cursor's window, after its position and up to seq upto, in seq
-- order, at most lim (NULL: all); none made before since (_window_since). Both parts walk the (shard, seq, txid) index in order and
-- stop at the limit. A SQL function that the planner inlines into the statement calling it:
-- rows are read once, not copied through a function's result first. The callers' plans are
-- generic (see the API's SET clause): a custom plan, costed with the actual bounds, would
-- rather sort a whole backlog. A restored cursor reads only the dump's events, whose txids
-- are the dump's (sql/restore.sql).
CREATE OR REPLACE FUNCTION outbox_internal._window(shard int, cur outbox._cursor_log, upto bigint, lim int,
                                                  since timestamptz)
RETURNS SETOF outbox.events
    LANGUAGE sql STABLE
AS $$
    SELECT w.* FROM (
        (SELECT e.* FROM outbox.events e
          WHERE e.shard = _window.shard
            AND e.seq > greatest(cur.after_seq, cur.lo_seq)
            AND e.seq <= least(coalesce(upto, 9223372036854775807), cur.restored_seq)
            AND e.created_at >= since
            AND e.txid >= cur.lo_top AND e.txid < pg_catalog.pg_snapshot_xmax(cur.hi_snap)
            AND pg_catalog.pg_visible_in_snapshot(e.txid, cur.hi_snap)
          ORDER BY e.seq LIMIT lim)
        UNION ALL
        (SELECT e.* FROM outbox.events e
          WHERE cur.late_from IS NOT NULL
            AND e.shard = _window.shard
            AND e.seq >= cur.late_from AND e.seq > coalesce(cur.after_seq, -1)
            AND e.seq <= least(cur.late_to, coalesce(upto, 9223372036854775807), cur.restored_seq)
            AND e.created_at >= since
            AND e.txid = ANY ((SELECT (outbox_internal._late(cur)).txids)::xid8[])  -- once, not per row
          ORDER BY e.seq LIMIT lim)
    ) AS w ORDER BY w.seq LIMIT lim
$$;

-- Lock a shard for ack/nack/release and return its cursor, refusing a stale epoch.
CREATE OR REPLACE FUNCTION outbox_internal._leased(consumer_id int, shard int, epoch bigint) RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    cur outbox._cursor_log;
BEGIN
    PERFORM outbox_internal._not_null(shard IS NULL, 'shard', 'the function (the shard a claimed row came with)');
    PERFORM outbox_internal._not_null(epoch IS NULL, 'epoch', 'the function (the epoch a claimed row came with)');
    PERFORM outbox_internal._check_shard(shard);
    PERFORM FROM outbox._shards s
     WHERE s.consumer_id = _leased.consumer_id AND s.shard = _leased.shard FOR UPDATE;
    cur := outbox_internal._cursor(consumer_id, shard);
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
CREATE OR REPLACE FUNCTION outbox_internal._head_failed(c outbox.consumers, key text, error text,
                                    retry_after interval, epoch bigint, final boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    n int;
BEGIN
    UPDATE outbox._parked p
       SET attempts = p.attempts + 1, last_error = error, nacked_epoch = epoch,
           next_attempt_at = now() + coalesce(retry_after, outbox_internal._backoff(c, p.attempts + 1))
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
    PERFORM outbox_internal._unpark_if_empty(c.id, key);
END
$$;

-- A claim's arguments, and that its transaction has not written yet (its bound must come first,
-- even when it finds nothing: the rule does not depend on the backlog).
CREATE OR REPLACE FUNCTION outbox_internal._check_claim(batch_size int, lease interval, func text) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION '% must come before any write in its transaction', func
            USING ERRCODE = 'active_sql_transaction',
                  HINT = 'Call it in a transaction of its own (autocommit is fine).';
    END IF;
    PERFORM outbox_internal._not_null(batch_size IS NULL, 'batch_size', func);
    PERFORM outbox_internal._not_null(lease IS NULL, 'lease', func);
    PERFORM outbox_internal._check_interval(lease, 'lease', '1 day', false);
    IF batch_size < 1 OR batch_size > 100000 THEN
        RAISE EXCEPTION 'batch_size % is out of range', batch_size
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass 1 to 100000.';
    END IF;
END
$$;

-- A shard's cursor if a claim may take the shard now: it locks the shard (SKIP LOCKED), which
-- then has no batch out under a live lease, and has something to read: parked keys (parked),
-- a window open, or an event above its floor (one index probe; no window is opened for
-- nothing), or a floor behind the newest seal (an empty window read once moves it past).
-- Otherwise no cursor.
CREATE OR REPLACE FUNCTION outbox_internal._free_cursor(consumer_id int, shard int,
                                               OUT cur outbox._cursor_log, OUT parked boolean)
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
    END IF;
    parked := EXISTS (SELECT FROM outbox._parked p
                       WHERE p.consumer_id = _free_cursor.consumer_id AND p.shard = _free_cursor.shard);
    IF NOT parked AND cur.hi_snap IS NULL AND cur.restored_seq IS NULL THEN
        floor_seq := outbox_internal._pending_floor(cur);  -- a value: the probe's index bound
        since := outbox_internal._since(floor_seq);
        IF NOT EXISTS (SELECT FROM outbox.events e
                        WHERE e.shard = _free_cursor.shard AND e.seq > floor_seq AND e.created_at >= since)
           AND NOT outbox_internal._behind_a_seal(cur, outbox_internal._newest_seal()) THEN
            cur := NULL;
        END IF;
    END IF;
END
$$;

-- Whether a claim could find anything for the consumer: a shard with parked keys, a window
-- open, a restored cursor, a floor behind a seal, or an event above its floor — what
-- _free_cursor asks of each shard, asked of all of them read-only, without locking a shard or
-- taking an xid. False means every shard's _free_cursor would find nothing to read, so a claim with nothing to
-- do (an idle relay's poll) stops here and writes nothing: no row lock, no mark, no commit
-- record. True may still find nothing (a lease, a lock, events not yet committed).
CREATE OR REPLACE FUNCTION outbox_internal._may_have_work(consumer_id int) RETURNS boolean
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    curs  outbox._cursor_log[] := ARRAY(
              SELECT cur.l FROM generate_series(0, outbox.shard_count() - 1) AS s(shard)
               CROSS JOIN LATERAL (SELECT l FROM outbox._cursor_log l
                                    WHERE l.consumer_id = _may_have_work.consumer_id AND l.shard = s.shard
                                    ORDER BY l.pos DESC LIMIT 1) AS cur);
    newest outbox._seals := outbox_internal._newest_seal();
    since  timestamptz;
BEGIN
    IF EXISTS (SELECT FROM unnest(curs) c
                WHERE c.hi_snap IS NOT NULL OR c.restored_seq IS NOT NULL
                   OR outbox_internal._behind_a_seal(c, newest)) THEN
        RETURN true;
    END IF;
    -- one value for every shard (the lowest floor's): partitions pruned before they are opened
    since := outbox_internal._since((SELECT min(outbox_internal._pending_floor(c)) FROM unnest(curs) c));
    RETURN EXISTS (
        SELECT FROM unnest(curs) AS c
         WHERE EXISTS (SELECT FROM outbox._parked p
                        WHERE p.consumer_id = _may_have_work.consumer_id AND p.shard = c.shard)
            OR EXISTS (SELECT FROM outbox.events e
                        WHERE e.shard = c.shard AND e.seq > outbox_internal._pending_floor(c)
                          AND e.created_at >= since));
END
$$;

-- Claim one free shard's next batch (shards tried from a random one on): its events in commit
-- order, read and handed out in one statement that also writes the claim row; or, when the
-- shard has parked keys, through _claim_parked. Nothing when no shard has work.
CREATE OR REPLACE FUNCTION outbox_internal._claim(c outbox.consumers, batch_size int, lease interval,
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
    stale  boolean;
    since  timestamptz;
    got    bigint := 0;
BEGIN
    FOR i IN 0 .. n - 1 LOOP
        free := outbox_internal._free_cursor(c.id, (start + i) % n);
        CONTINUE WHEN free.cur IS NULL;
        cur := free.cur;
        stale := cur.hi_snap IS NOT NULL;  -- a window open, perhaps read to its end already
        IF free.parked THEN
            RETURN QUERY SELECT * FROM outbox_internal._claim_parked(c, cur, batch_size, lease, owner, seq_mark, x);
            GET DIAGNOSTICS got = ROW_COUNT;
        ELSE LOOP
            fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
            IF cur.hi_snap IS NULL THEN
                cur := outbox_internal._open_window(cur, seq_mark, x);
            END IF;
            since := outbox_internal._window_since(cur);
            RETURN QUERY
            WITH page AS MATERIALIZED (SELECT * FROM outbox_internal._window(cur.shard, cur, NULL, batch_size, since)),
                 written AS MATERIALIZED (
                     SELECT outbox_internal._append(outbox_internal._claimed(cur, owner, lease, max(p.seq),
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
                -- that raises the floor, so the next claim's probe starts above it; when the
                -- claim began in a window that held nothing more (else every poll would read
                -- it to its end again, and _may_have_work would never say no); or when the
                -- shard was read for a seal (once per seal)
                next := outbox_internal._advance(cur, NULL, true);
                IF outbox_internal._pending_floor(next) > outbox_internal._pending_floor(cur) OR stale
                   OR outbox_internal._behind_a_seal(cur, outbox_internal._newest_seal()) THEN
                    PERFORM outbox_internal._append(next);
                END IF;
                EXIT;
            END IF;
            cur := outbox_internal._next_window(cur);
        END LOOP; END IF;
        EXIT WHEN got > 0;
    END LOOP;
END
$$;

-- _claim for a shard with parked keys: the page's events of parked keys join their queues
-- instead of going out (the shard moves past pages that hold only those), and the batch also
-- holds the due heads. Nothing (and no claim row) when neither is left.
CREATE OR REPLACE FUNCTION outbox_internal._claim_parked(c outbox.consumers, cur outbox._cursor_log,
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
    since     timestamptz;
BEGIN
    LOOP
        fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
        IF cur.hi_snap IS NULL THEN
            cur := outbox_internal._open_window(cur, seq_mark, x);
        END IF;
        since := outbox_internal._window_since(cur);
        page := ARRAY(SELECT w FROM outbox_internal._window(cur.shard, cur, NULL, batch_size, since) AS w ORDER BY w.seq);
        exhausted := cardinality(page) < batch_size;
        PERFORM outbox_internal._queue_parked(c.id, ARRAY(
            SELECT e FROM unnest(page) e
             WHERE EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = c.id AND p.aggregate_id = e.aggregate_id)));
        mine := ARRAY(SELECT e FROM unnest(page) e
                       WHERE NOT EXISTS (SELECT FROM outbox._parked p
                                          WHERE p.consumer_id = c.id AND p.aggregate_id = e.aggregate_id)
                       ORDER BY e.seq);  -- in seq order: an anti-join need not keep the page's
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

-- settle's failures argument, a JSON array of {"id", "error", "retry_after", "final"}: checked,
-- as unresolved failures. retry_after is a number of seconds or an interval's text.
CREATE OR REPLACE FUNCTION outbox_internal._failures(failures jsonb) RETURNS outbox_internal._failure[]
    LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    i    int := 0;
    f    jsonb;
    one  outbox_internal._failure;
    list outbox_internal._failure[] := '{}';
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
            PERFORM outbox_internal._check_failure(one.event_id, one.retry_after);
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

-- The events of the batch a cursor holds out, read from its window.
CREATE OR REPLACE FUNCTION outbox_internal._batch(cur outbox._cursor_log) RETURNS outbox.events[]
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    since timestamptz := outbox_internal._window_since(cur);
BEGIN
    RETURN ARRAY(SELECT w FROM outbox_internal._window(cur.shard, cur, cur.batch_end, NULL, since) w ORDER BY w.seq);
END
$$;

-- Record a key's failure, f being its first failed event in the batch. A head counts a failed
-- attempt of its queue. An event of the window parks its key: it and the key's later events of
-- the batch are queued, in order. Returns how many events of the batch this kept back.
-- A failure of the key reported earlier for this batch (nack, reject) already queued or
-- dead-lettered its events from some point on: reported again from there or after, nothing
-- changes; from before it, the events in between would be acked unsent, so that is refused.
CREATE OR REPLACE FUNCTION outbox_internal._fail_key(c outbox.consumers, cur outbox._cursor_log,
                                            batch outbox.events[], f outbox_internal._failure) RETURNS int
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
        PERFORM outbox_internal._queue_parked(c.id, later);
        IF parked = 0 THEN
            RETURN cardinality(later);  -- parked meanwhile (a replay): they wait behind its queue
        END IF;
    END IF;
    PERFORM outbox_internal._head_failed(c, f.aggregate_id, f.error, f.retry_after, cur.epoch, f.final);
    RETURN CASE WHEN f.head THEN 1 ELSE cardinality(later) END;
END
$$;

-- _fail_key, and if recording the failure itself fails, the key parked with that reason in
-- place of the relay's error and retried: the rest of the batch still settles, and the reason
-- shows in outbox.status.last_error.
CREATE OR REPLACE FUNCTION outbox_internal._fail_key_or_say_why(c outbox.consumers, cur outbox._cursor_log,
                                                       batch outbox.events[], f outbox_internal._failure) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN outbox_internal._fail_key(c, cur, batch, f);
EXCEPTION WHEN OTHERS THEN
    f.error := format('settling this failure failed: %s (the relay said: %s)', SQLERRM, left(f.error, 1000));
    f.retry_after := NULL;
    f.final := false;
    RETURN outbox_internal._fail_key(c, cur, batch, f);
END
$$;

-- The hold-back rule, in one place: a key's first failure in batch order fails the key, and its
-- later events in the batch wait behind it whatever the relay said of them. The failures are
-- recorded together; only if that fails, each on its own (a subtransaction each: kept for the
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
    firsts := ARRAY(SELECT DISTINCT ON (r.aggregate_id) r
                      FROM unnest(failures) AS u, outbox_internal._resolve(c, cur, batch, u) AS r
                     WHERE r.aggregate_id IS NOT NULL
                     ORDER BY r.aggregate_id, r.seq);
    BEGIN
        FOREACH f IN ARRAY firsts LOOP
            kept := kept + outbox_internal._fail_key(c, cur, batch, f);
        END LOOP;
    EXCEPTION WHEN OTHERS THEN
        kept := 0;
        FOREACH f IN ARRAY firsts LOOP
            kept := kept + outbox_internal._fail_key_or_say_why(c, cur, batch, f);
        END LOOP;
    END;
    RETURN kept;
END
$$;

-- The rest of a settled batch is delivered: parked heads handed out and not failed in this
-- batch leave their queues, and the shard moves past the batch.
CREATE OR REPLACE FUNCTION outbox_internal._deliver_rest(c outbox.consumers, cur outbox._cursor_log) RETURNS void
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
    f     outbox_internal._failure := ROW(event_id, NULL, NULL, NULL, error, retry_after, final);
BEGIN
    PERFORM outbox_internal._check_failure(event_id, retry_after);
    cur := outbox_internal._leased(c.id, shard, epoch);
    batch := CASE WHEN event_id = ANY (cur.heads) THEN '{}' ELSE outbox_internal._batch(cur) END;
    f := outbox_internal._resolve(c, cur, batch, f);
    IF f.aggregate_id IS NOT NULL THEN
        PERFORM outbox_internal._fail_key(c, cur, batch, f);
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
    rebased boolean := outbox_internal._rebase_if_restored();  -- first: it may write
    c_id   int;
    -- The first bound, taken as claims take theirs (see the header); if this transaction has
    -- written already, its xid may be older than the seq, so start the seq bound at 0.
    -- (never below a restored dump's events: their txids are not this cluster's)
    restored bigint := coalesce((SELECT o.restored_seq FROM outbox._origin o), 0);
    lo_seq bigint := CASE WHEN pg_current_xact_id_if_assigned() IS NULL
                          THEN coalesce(pg_sequence_last_value('outbox.event_seq'), 0) ELSE restored END;
    x      xid8 := pg_current_xact_id();
    lo     pg_snapshot := pg_current_snapshot();
    lo_top xid8 := outbox_internal._top(lo, x);
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'name', 'outbox.create_consumer');
    PERFORM outbox_internal._not_null(from_beginning IS NULL, 'from_beginning', 'outbox.create_consumer');
    PERFORM outbox_internal._not_null(max_attempts IS NULL, 'max_attempts', 'outbox.create_consumer');
    PERFORM outbox_internal._not_null(backoff_base IS NULL, 'backoff_base', 'outbox.create_consumer');
    PERFORM outbox_internal._not_null(backoff_max IS NULL, 'backoff_max', 'outbox.create_consumer');
    IF name = '' OR length(name) > 128 THEN
        RAISE EXCEPTION 'consumer name must be 1 to 128 characters'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Name the consumer after its sink.';
    END IF;
    PERFORM outbox_internal._check_interval(backoff_base, 'backoff_base', '30 days', false);
    PERFORM outbox_internal._check_interval(backoff_max, 'backoff_max', '30 days', false);
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
            SELECT lo, lo_seq, lo_top, outbox_internal._in_progress(lo, x) WHERE NOT from_beginning) AS b;
END
$$;

CREATE OR REPLACE FUNCTION outbox.drop_consumer(name text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'name', 'outbox.drop_consumer');
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
    rebased boolean := outbox_internal._rebase_if_restored();  -- first: it may write
    c       outbox.consumers := outbox_internal._consumer(consumer);
    b       record;
BEGIN
    IF rebased THEN
        RETURN;  -- this transaction rebased a restored database (it wrote): claim in the next
    END IF;
    PERFORM outbox_internal._check_claim(batch_size, lease, 'outbox.claim');
    IF NOT outbox_internal._may_have_work(c.id) THEN
        RETURN;  -- nothing to read: no bound taken, nothing written
    END IF;
    b := outbox_internal._claim_bound();
    RETURN QUERY SELECT * FROM outbox_internal._claim(c, batch_size, lease,
                                             coalesce(owner, 'backend ' || pg_backend_pid()), b.seq, b.x);
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
    rebased boolean := outbox_internal._rebase_if_restored();  -- first: it may write
    c       outbox.consumers := outbox_internal._consumer(consumer);
    list    outbox_internal._failure[];
    b       record;
BEGIN
    PERFORM outbox_internal._not_null(failures IS NULL, 'failures', 'outbox.settle_and_claim');
    list := outbox_internal._failures(failures);
    PERFORM outbox_internal._check_claim(batch_size, lease, 'outbox.settle_and_claim');
    IF NOT rebased THEN
        b := outbox_internal._claim_bound();  -- before settling writes anything
    END IF;
    PERFORM outbox_internal._settle(c, outbox_internal._leased(c.id, shard, epoch), list);
    IF NOT rebased AND outbox_internal._may_have_work(c.id) THEN
        RETURN QUERY SELECT * FROM outbox_internal._claim(c, batch_size, lease,
                                                 coalesce(owner, 'backend ' || pg_backend_pid()), b.seq, b.x);
    END IF;
END
$$;

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

CREATE OR REPLACE FUNCTION outbox.release(consumer text, shard int, epoch bigint,
                               retry_after interval DEFAULT '0') RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c   outbox.consumers := outbox_internal._consumer(consumer);
    cur outbox._cursor_log;
BEGIN
    PERFORM outbox_internal._not_null(retry_after IS NULL, 'retry_after', 'outbox.release');
    PERFORM outbox_internal._check_interval(retry_after, 'retry_after', '30 days', true);
    cur := outbox_internal._leased(c.id, shard, epoch);
    cur.owner := NULL;
    cur.lease_until := CASE WHEN retry_after > '0' THEN now() + retry_after END;
    cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
    PERFORM outbox_internal._append(cur);
END
$$;

CREATE OR REPLACE FUNCTION outbox.release_owner(consumer text, owner text) RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c   outbox.consumers := outbox_internal._consumer(consumer);
    s   int;
    cur outbox._cursor_log;
    n   int := 0;
BEGIN
    PERFORM outbox_internal._not_null(owner IS NULL, 'owner', 'outbox.release_owner');
    FOR s IN SELECT sh.shard FROM outbox._shards sh WHERE sh.consumer_id = c.id
              ORDER BY sh.shard FOR UPDATE LOOP
        cur := outbox_internal._cursor(c.id, s);
        CONTINUE WHEN cur.owner IS DISTINCT FROM release_owner.owner OR cur.lease_until <= now();
        cur.owner := NULL; cur.lease_until := NULL;
        cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
        PERFORM outbox_internal._append(cur);
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
    c outbox.consumers := outbox_internal._consumer(consumer);
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

-- Every check a sink row must pass, with the fix in the hint; also stamps updated_at (the
-- worker rebuilds a sink's client when it changes). SECURITY DEFINER: it calls internal
-- helpers that admins cannot execute directly.
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
    RETURN NEW;
END
$$;
INSERT INTO outbox.partition_config (parent, width, ahead, retention) VALUES
    ('outbox.events', '1 day', 2, '2 days'),
    ('inbox.messages', '1 day', 2, '7 days')
ON CONFLICT (parent) DO NOTHING;

-- Every partition of the two tables with its time range (NULLs for a default partition).
CREATE OR REPLACE VIEW outbox_internal.partition_ranges AS
SELECT i.inhparent::regclass AS parent,
       c.oid::regclass AS partition,
       CASE WHEN i.inhparent = 'inbox.messages'::regclass THEN inbox.uuid_time(b[1]::uuid) ELSE b[1]::timestamptz END AS lower,
       CASE WHEN i.inhparent = 'inbox.messages'::regclass THEN inbox.uuid_time(b[2]::uuid) ELSE b[2]::timestamptz END AS upper,
       b IS NULL AS is_default
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
  CROSS JOIN LATERAL pg_get_expr(c.relpartbound, c.oid) AS e
  -- FOR VALUES FROM ('lower') TO ('upper'): the quoted values, cut out without a regexp
  CROSS JOIN LATERAL (SELECT CASE WHEN e LIKE 'FOR VALUES FROM (''%'') TO (''%'')'
                                  THEN ARRAY[split_part(e, '''', 2), split_part(e, '''', 4)] END) AS x(b)
 WHERE i.inhparent IN ('outbox.events'::regclass, 'inbox.messages'::regclass);

-- The same with each partition's size on disk. (pg_total_relation_size is volatile, which
-- keeps a view that computes it from being merged into a query: maintain() reads the ranges.)
CREATE OR REPLACE VIEW outbox.partitions AS
SELECT r.parent, r.partition, r.lower, r.upper, r.is_default, pg_total_relation_size(r.partition) AS bytes
  FROM outbox_internal.partition_ranges r;

-- outbox.partitions as a value, without the sizes (each a stat of every file of a partition).
CREATE OR REPLACE FUNCTION outbox_internal._partition_list() RETURNS outbox.partitions[]
    LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
AS $$
    SELECT ARRAY(SELECT ROW(x.parent, x.partition, x.lower, x.upper, x.is_default, NULL)::outbox.partitions
                   FROM outbox_internal.partition_ranges x)
$$;

-- Create the partition [lo_at, lo_at + width) of parent, clipped to the gap between existing
-- partitions; rows for that range waiting in the default partition move into it first.
-- Returns the partition created, or NULL if the range is already covered.
CREATE OR REPLACE FUNCTION outbox_internal._create_partition(parent regclass, lo_at timestamptz, width interval)
RETURNS regclass
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    hi_at timestamptz := lo_at + width;
    nsp   text;
    rel   text;
    part  text;
    dflt  regclass;
    old_timeout text := current_setting('lock_timeout');
BEGIN
    SELECT greatest(lo_at, max(p.upper)) INTO lo_at FROM outbox_internal.partition_ranges p
     WHERE p.parent = _create_partition.parent AND NOT p.is_default AND p.upper > lo_at AND p.lower <= lo_at;
    SELECT least(hi_at, min(p.lower)) INTO hi_at FROM outbox_internal.partition_ranges p
     WHERE p.parent = _create_partition.parent AND NOT p.is_default AND p.lower >= lo_at AND p.lower < hi_at;
    IF lo_at >= hi_at THEN
        RETURN NULL;
    END IF;
    IF lo_at <= clock_timestamp() + interval '1 minute' THEN
        -- A range writers may be writing to now: hold them off until the partition is attached.
        -- A row routed to the default partition just before the ATTACH would fail on the
        -- default's narrowed constraint, which PostgreSQL checks after waiting for its lock
        -- (an emit racing the first maintain() after CREATE EXTENSION). At most a second's
        -- wait for transactions that wrote there; the next run tries again.
        BEGIN
            PERFORM set_config('lock_timeout', '1s', true);
            EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', parent);
            PERFORM set_config('lock_timeout', old_timeout, true);
        EXCEPTION WHEN lock_not_available THEN
            RETURN NULL;
        END;
    END IF;
    SELECT n.nspname, c.relname INTO nsp, rel
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = parent;
    part := outbox_internal._partition_name(rel, lo_at);
    SELECT p.partition INTO dflt FROM outbox_internal.partition_ranges p
     WHERE p.parent = _create_partition.parent AND p.is_default;
    -- Standalone first, then the default partition's rows of the range, then attach: a
    -- default partition holding rows of the range would make a plain CREATE ... PARTITION OF fail.
    EXECUTE format('CREATE TABLE %I.%I (LIKE %I.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                   nsp, part, nsp, rel);
    IF dflt IS NOT NULL THEN
        EXECUTE format('WITH moved AS (DELETE FROM %s d WHERE %I >= %L AND %I < %L RETURNING d.*) '
                       'INSERT INTO %I.%I SELECT * FROM moved',
                       dflt, outbox_internal._key_column(parent), outbox_internal._bound(parent, lo_at),
                       outbox_internal._key_column(parent), outbox_internal._bound(parent, hi_at), nsp, part);
    END IF;
    PERFORM outbox_internal._index_partition(parent, format('%I.%I', nsp, part)::regclass);
    EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                   nsp, rel, nsp, part, outbox_internal._bound(parent, lo_at), outbox_internal._bound(parent, hi_at));
    PERFORM outbox_internal._revoke_all(format('%I.%I', nsp, part)::regclass);
    RETURN format('%I.%I', nsp, part)::regclass;
END
$$;

-- Why an event partition past its retention must stay, or NULL when it may go. Rows of open
-- transactions are invisible, so first: no open transaction started before the partition's
-- upper bound (emit's created_at is the transaction's start, so it may still write there),
-- and no transaction, prepared ones included, holds a lock on it (it has written there).
-- Then no consumer may have an event of it pending (outbox_internal._pending, sql/claim.sql).
CREATE OR REPLACE FUNCTION outbox_internal._partition_pending(part regclass, upper timestamptz) RETURNS text
    LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pending boolean;
    pid     int;
BEGIN
    SELECT a.pid INTO pid FROM pg_stat_activity a
     WHERE a.xact_start < _partition_pending.upper ORDER BY a.xact_start LIMIT 1;
    IF FOUND THEN
        RETURN format('transaction of backend %s, open since before the partition ends, may still write to it', pid);
    END IF;
    IF EXISTS (SELECT FROM pg_locks l WHERE l.relation = part AND l.pid IS DISTINCT FROM pg_backend_pid()) THEN
        RETURN 'an open or prepared transaction has written to it';
    END IF;
    EXECUTE format(
        'SELECT EXISTS (SELECT FROM outbox._shards s
                          CROSS JOIN LATERAL (SELECT l FROM outbox._cursor_log l
                                               WHERE l.consumer_id = s.consumer_id AND l.shard = s.shard
                                               ORDER BY l.pos DESC LIMIT 1) AS cur
                         WHERE EXISTS (SELECT FROM %s e WHERE e.shard = s.shard
                                          AND e.seq > outbox_internal._pending_floor(cur.l)
                                          AND outbox_internal._pending(cur.l, e.txid, e.seq)))', part)
        INTO pending;
    RETURN CASE WHEN pending THEN 'a consumer has not read all its events' END;
END
$$;

-- Seal the event log's past (outbox._seals, sql/claim.sql) at the newest upper bound of an
-- events partition that no open transaction, in any database, began before, a minute back:
-- every transaction that began before it has ended or is prepared, so its events already have
-- their seqs, all at most the sequence's value read after. Seals below the oldest partition
-- skip nothing and go (the newest stays). No seal while a restored dump is not yet rebased,
-- nor while a session does not report its transactions (track_activities off: its
-- xact_start is hidden).
CREATE OR REPLACE FUNCTION outbox_internal._seal(parts outbox.partitions[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    before timestamptz := least(now(), (SELECT min(a.xact_start) FROM pg_stat_activity a)) - interval '1 minute';
    bound  timestamptz;
BEGIN
    IF (SELECT o.restore_pending FROM outbox._origin o)
       OR EXISTS (SELECT FROM pg_stat_activity a WHERE a.state = 'disabled') THEN
        RETURN;
    END IF;
    IF clock_timestamp() < (SELECT max(s.upper) FROM outbox._seals s) + interval '1 minute' THEN
        -- the clock went back: a transaction begun since may make events behind a seal
        DELETE FROM outbox._seals;
        RAISE WARNING 'outbox.maintain: the clock is behind the newest seal of the event log; dropped the seals'
            USING HINT = 'Claims read every partition until maintain() seals again, once the clock is past them.';
        RETURN;
    END IF;
    SELECT max(x.upper) INTO bound FROM unnest(parts) x
     WHERE x.parent = 'outbox.events'::regclass AND NOT x.is_default AND x.upper <= before;
    IF bound > coalesce((SELECT max(s.upper) FROM outbox._seals s), '-infinity') THEN
        INSERT INTO outbox._seals (max_seq, upper)
        VALUES (coalesce(pg_sequence_last_value('outbox.event_seq'), 0), bound);
    END IF;
    DELETE FROM outbox._seals s
     WHERE s.upper < (SELECT max(t.upper) FROM outbox._seals t)
       AND s.upper <= (SELECT min(x.lower) FROM unnest(parts) x
                        WHERE x.parent = 'outbox.events'::regclass AND NOT x.is_default);
END
$$;

CREATE OR REPLACE FUNCTION outbox.maintain()
RETURNS TABLE (action text, relation text, detail text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg     outbox.partition_config;
    p       outbox.partitions;
    -- the partitions, read once (reading outbox.partitions deparses every partition's bounds:
    -- about 0.1 ms each), read again only after this run changed them
    parts   outbox.partitions[] := outbox_internal._partition_list();
    changed boolean := false;
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
    IF outbox_internal._restore_running() THEN  -- its partitions would collide with the dump's
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
    rebased := outbox_internal._rebase_if_restored();
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
        FOR p IN SELECT * FROM unnest(parts) x
                  WHERE x.parent = cfg.parent AND NOT x.is_default AND x.upper <= now() - cfg.retention
                  ORDER BY x.lower LOOP
            part := p.partition::text;  -- named while it exists
            BEGIN
                IF cfg.parent = 'outbox.events'::regclass THEN
                    why := outbox_internal._partition_pending(p.partition, p.upper);
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
                changed := true;
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
        IF changed THEN
            parts := outbox_internal._partition_list();
            changed := false;
        END IF;
        -- 2. rows that landed in the default partition: report them, move them into partitions
        --    (inbox ids that are not UUIDv7 carry no time: they stay, and age out by received_at)
        FOR lo_at IN EXECUTE format(
                'SELECT DISTINCT outbox_internal._floor_time(%s, %L) FROM %s %s',
                outbox_internal._key_time(cfg.parent), cfg.width,
                (SELECT d.partition FROM unnest(parts) d WHERE d.parent = cfg.parent AND d.is_default),
                CASE WHEN cfg.parent = 'inbox.messages'::regclass
                     THEN 'WHERE substr(message_id::text, 15, 1) = ''7''' ELSE '' END)
        LOOP
            created := outbox_internal._create_partition(cfg.parent, lo_at, cfg.width);
            IF created IS NOT NULL THEN
                changed := true;
                RAISE WARNING 'outbox.maintain: rows of % were in its default partition; moved them to %',
                    cfg.parent, created;
                RETURN QUERY SELECT 'moved', created::text, 'rows from the default partition';
            END IF;
        END LOOP;
        -- 3. partitions ahead: the ranges no partition covers yet, found in one pass over the
        --    partitions (each _create_partition call reads them all again)
        IF changed THEN
            parts := outbox_internal._partition_list();
        END IF;
        FOR lo_at IN
            WITH existing AS (  -- what the partitions cover, as one value (not a scan per range)
                     SELECT coalesce(range_agg(tstzrange(x.lower, x.upper)), '{}') AS covered
                       FROM unnest(parts) x
                      WHERE x.parent = cfg.parent AND NOT x.is_default
                        AND x.upper > outbox_internal._floor_time(now(), cfg.width))
            SELECT g FROM existing,
                          generate_series(outbox_internal._floor_time(now(), cfg.width),
                                          outbox_internal._floor_time(now(), cfg.width) + cfg.width * cfg.ahead,
                                          cfg.width) AS g
             WHERE NOT existing.covered @> tstzrange(g, g + cfg.width)
             ORDER BY g
        LOOP
            created := outbox_internal._create_partition(cfg.parent, lo_at, cfg.width);
            IF created IS NOT NULL THEN
                RETURN QUERY SELECT 'created', created::text, NULL::text;
            END IF;
        END LOOP;
    END LOOP;
    -- 4. seal the past: claims then skip the partitions they have read past
    PERFORM outbox_internal._seal(parts);
    DELETE FROM inbox.messages_default m
     WHERE m.received_at < now() - (SELECT c.retention FROM outbox.partition_config c
                                     WHERE c.parent = 'inbox.messages'::regclass);
    -- 5. cursor history (a minute of it is kept, for a look at what happened) and marks
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
/* </end connected objects> */

/* <begin connected objects> */
-- src/status.rs:5
-- requires:
--   claim
--   partitions
--   sinks

-- outbox_ext: what is left to deliver, per consumer and per shard, and why.
--
-- What is pending is outbox_internal._pending's answer (sql/claim.sql), for the events above
-- outbox_internal._pending_floor, which bounds the index scan. A view of it costs O(consumers x shards),
-- however many events the log holds: each shard's pending events are counted exactly up to
-- 1,000 and extrapolated beyond (outbox_internal._shard_pending).
--
-- Name resolution (sql/grants.sql): both views are [parsed] and run as their owner;
-- _shard_pending is [pinned] (the views call it as whoever reads them).

-- A consumer's pending events in one shard (for a sink, those its routing delivers), read in
-- seq order from the cursor's floor: counted up to cap; when there are more, the rest is
-- estimated from their density in seq over the seq range still ahead. oldest: the oldest
-- pending event's created_at (of the first cap, which start at the oldest seq).
CREATE OR REPLACE FUNCTION outbox_internal._shard_pending(cur outbox._cursor_log, sink outbox.sinks,
                                                 OUT events bigint, OUT oldest timestamptz)
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    cap       constant int := 1000;
    floor_seq bigint := outbox_internal._pending_floor(cur);
    since     timestamptz := outbox_internal._since(floor_seq);
    first_seq bigint;
    last_seq  bigint;
BEGIN
    SELECT count(*), min(p.created_at), min(p.seq), max(p.seq) INTO events, oldest, first_seq, last_seq
      FROM (SELECT e.created_at, e.seq FROM outbox.events e
             WHERE e.shard = cur.shard AND e.seq > floor_seq AND e.created_at >= since
               AND outbox_internal._pending(cur, e.txid, e.seq)
               AND (sink.name IS NULL OR outbox_internal._routes(sink, e.topic, e.aggregate_type))
             ORDER BY e.seq LIMIT cap) AS p;
    IF events = cap THEN
        events := events + (coalesce(pg_sequence_last_value('outbox.event_seq'), last_seq) - last_seq)
                           * cap / greatest(last_seq - first_seq + 1, cap);
    END IF;
END
$$;

-- The dump's row arriving over ours: a restore.
CREATE OR REPLACE FUNCTION outbox_internal._restored() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM outbox._origin) THEN
        RETURN NEW;  -- CREATE EXTENSION's own row
    END IF;
    DELETE FROM outbox._seals;  -- made before the dump's events arrived: not about them
    UPDATE outbox._origin
       SET restore_pending = true, restored_at = now(), restorer = pg_backend_pid(),
           restorer_since = (SELECT a.backend_start FROM pg_stat_activity a WHERE a.pid = pg_backend_pid());
    CREATE OR REPLACE TRIGGER rebase_before_emit BEFORE INSERT ON outbox.events
        FOR EACH STATEMENT EXECUTE FUNCTION outbox_internal._rebase_before_emit();
    RETURN NULL;
END
$$;
-- (not ON CONFLICT: the trigger, which fires first, would take a second insert for a restore)
INSERT INTO outbox._origin (made_in) SELECT outbox_internal._here() WHERE NOT EXISTS (SELECT FROM outbox._origin);

-- Before the first event of this cluster takes a seq. (Native emit takes the plain INSERT
-- path while a table has a trigger, so this fires for every kind of emit.)
CREATE OR REPLACE FUNCTION outbox_internal._rebase_before_emit() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox_internal._rebase_if_restored();
    RETURN NULL;
END
$$;

-- Rebases a restored state if it is one, once the restore is over. True when the state is
-- not ready for claims in this transaction: it was just rebased (the transaction has written),
-- or the restore is still running.
CREATE OR REPLACE FUNCTION outbox_internal._rebase_if_restored() RETURNS boolean
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF NOT coalesce((SELECT o.restore_pending FROM outbox._origin o), false) THEN
        RETURN false;
    END IF;
    IF outbox_internal._restore_running() THEN
        RETURN true;
    END IF;
    LOCK TABLE outbox._origin IN EXCLUSIVE MODE;  -- one rebase; the others wait, then see it done
    IF NOT (SELECT o.restore_pending FROM outbox._origin o) THEN
        RETURN false;
    END IF;
    PERFORM outbox_internal._rebase();
    RETURN true;
END
$$;

-- Every cursor: its batch out at dump time (lease, parked heads) comes again, and it reads the
-- dump's events in the dump's ids, then the rest (see the header). Marks go: their xids are the
-- dump's, and claims make new ones. Seals go too (one made while the dump loaded knew nothing
-- of its events); maintain() seals the rebased log.
CREATE OR REPLACE FUNCTION outbox_internal._rebase() RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    n   bigint;
    top xid8;
    sh  outbox._shards;
    cur outbox._cursor_log;
BEGIN
    SELECT greatest(max(e.seq), coalesce(pg_sequence_last_value('outbox.event_seq'), 0)), max(e.txid)
      INTO n, top FROM outbox.events e;
    SELECT greatest(top, max(greatest(l.lo_top, l.hi_top, pg_snapshot_xmax(l.lo_snap),
                                      pg_snapshot_xmax(l.hi_snap))))
      INTO top FROM outbox._cursor_log l;
    top := (coalesce(top::text::bigint, 2) + 1)::text::xid8;
    FOR sh IN SELECT * FROM outbox._shards s ORDER BY s.consumer_id, s.shard FOR UPDATE LOOP
        cur := outbox_internal._cursor(sh.consumer_id, sh.shard);
        IF cur.restored_seq IS NOT NULL THEN
            -- restored again before it read an earlier dump's events: all of them from its
            -- floor on come again (the ids of two dumps cannot be told apart)
            cur := outbox_internal._lo_after_seq(cur, outbox_internal._pending_floor(cur));
        END IF;
        cur.owner := NULL; cur.lease_until := NULL;
        cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
        cur.restored_seq := n; cur.restored_top := top;
        PERFORM outbox_internal._append(cur);
    END LOOP;
    DELETE FROM outbox._marks;
    DELETE FROM outbox._seals;
    UPDATE outbox._origin
       SET restore_pending = false, restored_seq = n, restored_top = top, made_in = outbox_internal._here();
    RAISE NOTICE 'outbox_ext: rebased the outbox restored from a dump (events up to seq %, txids below %)', n, top;
END
$$;

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
    ids := outbox_internal._insert_many(aggregate_type, event_type, headers, topic, aggregate_ids, payloads);
    IF ids IS NULL THEN
        ids := outbox_internal._batch_ids(aggregate_type, event_type, headers, topic, aggregate_ids,
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
GRANT SELECT ON outbox.events, outbox.consumers, outbox.sinks, outbox._sink_stats,
    outbox.dead_letters, outbox.partition_config, outbox.partitions, outbox.status,
    outbox.shard_status, outbox._shards, outbox._cursor_log, outbox._parked,
    outbox._parked_events, outbox._marks, outbox._seals, outbox._origin, inbox.messages
TO outbox_admin;

-- nothing new is PUBLIC
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox, inbox, outbox_internal FROM PUBLIC;
REVOKE ALL ON outbox._seals, outbox_internal.partition_ranges FROM PUBLIC;
GRANT SELECT ON outbox._seals TO outbox_admin;
