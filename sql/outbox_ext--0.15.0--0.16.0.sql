-- outbox_ext 0.15.0 -> 0.16.0
--
-- Why: a claim's statements on outbox.events were planned once per session, with their time
-- bounds as values, so every execution locked every partition and set up its pruning; with
-- 200 partitions that was a third of a claim. The reads of the event log on a claim's way
-- (the page of a window, the parked path's and settle's reads of it, the probe for events
-- above a floor, the late transactions' range at a window's opening) are now native
-- (src/claim/pruned.rs): they run the same SQL with the bounds of the partitions around
-- their time range as constants, so only those partitions are planned and locked. A page
-- also goes into the claim's result without a CTE's copy.
--
-- A delta: what changed from 0.15.0 to 0.16.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.16.0'" to load this file. \quit

CREATE OR REPLACE FUNCTION outbox_internal._shards_with_events(shards int[], floors bigint[],
                                                              since timestamptz, until timestamptz)
RETURNS SETOF int
    LANGUAGE sql STABLE
AS $$
    SELECT s.shard FROM unnest(shards, floors) AS s(shard, floor_seq)
     WHERE EXISTS (SELECT FROM outbox.events e
                    WHERE e.shard = s.shard AND e.seq > s.floor_seq
                      AND e.created_at >= since AND e.created_at < until)
$$;


CREATE OR REPLACE FUNCTION outbox_internal._late_seqs(shard int, floor_seq bigint, seq_end bigint, txids xid8[],
                                                     since timestamptz, until timestamptz)
RETURNS SETOF bigint
    LANGUAGE sql STABLE
AS $$
    SELECT e.seq FROM unnest(txids) AS t
     CROSS JOIN LATERAL (SELECT e.seq FROM outbox.events e
                          WHERE e.shard = _late_seqs.shard AND e.seq > floor_seq
                            AND e.seq <= seq_end AND e.txid = t
                            AND e.created_at >= since AND e.created_at < until
                         OFFSET 0) AS e
$$;


CREATE OR REPLACE FUNCTION outbox_internal._claim_page(cur outbox._cursor_log, lim int, owner text, lease interval,
                                                      since timestamptz, until timestamptz)
RETURNS SETOF outbox.claimed
    LANGUAGE c VOLATILE STRICT AS 'MODULE_PATHNAME', 'outbox_claim_page';


CREATE OR REPLACE FUNCTION outbox_internal._window_events(cur outbox._cursor_log, upto bigint, lim int,
                                                         since timestamptz, until timestamptz)
RETURNS SETOF outbox.events
    LANGUAGE c STABLE AS 'MODULE_PATHNAME', 'outbox_window_events';


CREATE OR REPLACE FUNCTION outbox_internal._any_events(shards int[], floors bigint[],
                                                      since timestamptz, until timestamptz)
RETURNS boolean
    LANGUAGE c STABLE STRICT AS 'MODULE_PATHNAME', 'outbox_any_events';


CREATE OR REPLACE FUNCTION outbox_internal._late_range(shard int, floor_seq bigint, seq_end bigint, txids xid8[],
                                                      since timestamptz, until timestamptz)
RETURNS bigint[]
    LANGUAGE c STABLE STRICT AS 'MODULE_PATHNAME', 'outbox_late_range';


CREATE OR REPLACE FUNCTION outbox_internal._open_window(cur outbox._cursor_log, seq_mark bigint, x xid8)
RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    late    record;
    seqs    bigint[];
    seq_end bigint;
    since   timestamptz;
    until   timestamptz;
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
        since := outbox_internal._since(late.floor_seq, outbox_internal._newest_seal());
        until := outbox_internal._reach();
        seqs := outbox_internal._late_range(cur.shard, late.floor_seq, seq_end, late.txids, since, until);
        cur.late_from := seqs[1]; cur.late_to := seqs[2];
    END IF;
    cur.after_seq := NULL;
    RETURN cur;
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


CREATE OR REPLACE FUNCTION outbox_internal._may_have_work(consumer_id int) RETURNS boolean
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    one    outbox._cursor_log := outbox_internal._cursor(consumer_id, floor(random() * outbox.shard_count())::int);
    curs   outbox._cursor_log[];
    newest outbox._seals;
    since  timestamptz;
    until  timestamptz := outbox_internal._reach();
BEGIN
    -- first one shard, at random: in a backlog most have a window open (a claim opened it and
    -- has not read it to its end), and one cursor is cheaper to read than all
    IF one.hi_snap IS NOT NULL OR one.restored_seq IS NOT NULL THEN
        RETURN true;
    END IF;
    curs := ARRAY(SELECT cur.l FROM generate_series(0, outbox.shard_count() - 1) AS s(shard)
                   CROSS JOIN LATERAL (SELECT l FROM outbox._cursor_log l
                                        WHERE l.consumer_id = _may_have_work.consumer_id AND l.shard = s.shard
                                        ORDER BY l.pos DESC LIMIT 1) AS cur);
    newest := outbox_internal._newest_seal();
    IF EXISTS (SELECT FROM unnest(curs) c
                WHERE c.hi_snap IS NOT NULL OR c.restored_seq IS NOT NULL
                   OR outbox_internal._behind_a_seal(c, newest)) THEN
        RETURN true;
    END IF;
    -- one value for every shard (the lowest floor's): partitions pruned before they are opened
    since := outbox_internal._since((SELECT min(outbox_internal._pending_floor(c)) FROM unnest(curs) c), newest);
    RETURN EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = _may_have_work.consumer_id)
        OR outbox_internal._any_events(ARRAY(SELECT c.shard FROM unnest(curs) c ORDER BY c.shard),
                                       ARRAY(SELECT outbox_internal._pending_floor(c) FROM unnest(curs) c
                                              ORDER BY c.shard),
                                       since, until);
END
$$;


CREATE OR REPLACE FUNCTION outbox_internal._claim(c outbox.consumers, batch_size int, lease interval,
                                         owner text, seq_mark bigint, x xid8)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    n      int := outbox.shard_count();
    start  int := floor(random() * n)::int;
    newest outbox._seals := outbox_internal._newest_seal();  -- read once: see _since
    until  timestamptz := outbox_internal._reach();  -- for the probes; a window reads it again
    free   record;
    cur    outbox._cursor_log;
    next   outbox._cursor_log;
    fresh  boolean;
    stale  boolean;
    since  timestamptz;
    got    bigint := 0;
BEGIN
    FOR i IN 0 .. n - 1 LOOP
        free := outbox_internal._free_cursor(c.id, (start + i) % n, newest, until);
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
            since := outbox_internal._window_since(cur, newest);
            until := outbox_internal._reach();  -- read after the window's snapshot: see _reach
            RETURN QUERY SELECT * FROM outbox_internal._claim_page(cur, batch_size, owner, lease, since, until);
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
                   OR outbox_internal._behind_a_seal(cur, newest) THEN
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


CREATE OR REPLACE FUNCTION outbox_internal._batch(cur outbox._cursor_log) RETURNS outbox.events[]
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    since timestamptz := outbox_internal._window_since(cur, outbox_internal._newest_seal());
    until timestamptz := outbox_internal._reach();
BEGIN
    RETURN ARRAY(SELECT w FROM outbox_internal._window_events(cur, cur.batch_end, NULL, since, until) w);
END
$$;


-- Granted to no role, as every internal function (sql/grants.sql).
REVOKE ALL ON FUNCTION outbox_internal._shards_with_events(int[], bigint[], timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._late_seqs(int, bigint, bigint, xid8[], timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._claim_page(outbox._cursor_log, int, text, interval, timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._window_events(outbox._cursor_log, bigint, int, timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._any_events(int[], bigint[], timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._late_range(int, bigint, bigint, xid8[], timestamptz, timestamptz) FROM PUBLIC;
