-- outbox_ext 0.10.0 -> 0.11.0
--
-- Why: a claim of 1,000 events wrote its claim row in a subquery that the plan evaluated again
-- for every event it handed out (a nested loop over the one-row aggregate); it is now
-- evaluated once, before the first row (_claim). A claim asks whether any shard may have work
-- (_may_have_work) by reading every shard's cursor; it now reads one shard's first, which in a
-- backlog has a window open and answers alone. And the newest seal was looked up twice in
-- every _since call and again by its callers: it is read once per claim (or status row) and
-- passed down, and a seq at or past it needs no further lookup. _since, _window_since and
-- _free_cursor take it as an argument (the old forms are dropped); their callers are replaced.
--
-- outbox.status took over 20 ms with 2,000,000 events pending: it counted up to 1,000 pending
-- events exactly in each of the 16 shards. It counts up to 500 now, and estimates beyond.
--
-- A settle with failures scanned the whole batch once per failure and twice per failed key
-- (_resolve, _fail_key); _fail_batch now takes the failed events and the failed keys' events
-- out of the batch once, and those scans read only them.
--
-- A delta: what changed from 0.10.0 to 0.11.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.11.0'" to load this file. \quit

-- the forms without the newest seal (PL/pgSQL callers name them by text: no dependency)
DROP FUNCTION IF EXISTS outbox_internal._since(bigint);
DROP FUNCTION IF EXISTS outbox_internal._window_since(outbox._cursor_log);
DROP FUNCTION IF EXISTS outbox_internal._free_cursor(int, int);

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
        since := outbox_internal._since(late.floor_seq, outbox_internal._newest_seal());
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

CREATE OR REPLACE FUNCTION outbox_internal._since(seq bigint, newest outbox._seals) RETURNS timestamptz
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF now() < newest.upper + interval '1 minute' THEN
        RETURN '-infinity';
    ELSIF seq >= newest.max_seq THEN
        RETURN newest.upper;
    END IF;
    RETURN coalesce((SELECT s.upper FROM outbox._seals s WHERE s.max_seq <= _since.seq
                      ORDER BY s.max_seq DESC, s.upper DESC LIMIT 1), '-infinity');
END
$$;

CREATE OR REPLACE FUNCTION outbox_internal._window_since(cur outbox._cursor_log, newest outbox._seals)
RETURNS timestamptz
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN outbox_internal._since(least(greatest(cur.after_seq, cur.lo_seq), cur.late_from - 1), newest);
END
$$;

CREATE OR REPLACE FUNCTION outbox_internal._free_cursor(consumer_id int, shard int, newest outbox._seals,
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
        since := outbox_internal._since(floor_seq, newest);
        IF NOT EXISTS (SELECT FROM outbox.events e
                        WHERE e.shard = _free_cursor.shard AND e.seq > floor_seq AND e.created_at >= since)
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
    RETURN EXISTS (
        SELECT FROM unnest(curs) AS c
         WHERE EXISTS (SELECT FROM outbox._parked p
                        WHERE p.consumer_id = _may_have_work.consumer_id AND p.shard = c.shard)
            OR EXISTS (SELECT FROM outbox.events e
                        WHERE e.shard = c.shard AND e.seq > outbox_internal._pending_floor(c)
                          AND e.created_at >= since));
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
    free   record;
    cur    outbox._cursor_log;
    next   outbox._cursor_log;
    fresh  boolean;
    stale  boolean;
    since  timestamptz;
    got    bigint := 0;
BEGIN
    FOR i IN 0 .. n - 1 LOOP
        free := outbox_internal._free_cursor(c.id, (start + i) % n, newest);
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
            RETURN QUERY
            WITH page AS MATERIALIZED (SELECT * FROM outbox_internal._window(cur.shard, cur, NULL, batch_size, since)),
                 written AS MATERIALIZED (
                     SELECT outbox_internal._append(outbox_internal._claimed(cur, owner, lease, max(p.seq),
                                                           count(*) < batch_size, '{}'))
                       FROM page p HAVING count(*) > 0)
            SELECT cur.shard, cur.epoch + 1, p.id, p.topic, p.aggregate_type, p.aggregate_id,
                   p.event_type, p.payload, p.headers, p.created_at, p.seq, 1
              FROM page p
             WHERE (SELECT count(*) FROM written) >= 0  -- once, before the first row: the claim row is written
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
BEGIN
    LOOP
        fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
        IF cur.hi_snap IS NULL THEN
            cur := outbox_internal._open_window(cur, seq_mark, x);
        END IF;
        since := outbox_internal._window_since(cur, outbox_internal._newest_seal());
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

CREATE OR REPLACE FUNCTION outbox_internal._batch(cur outbox._cursor_log) RETURNS outbox.events[]
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    since timestamptz := outbox_internal._window_since(cur, outbox_internal._newest_seal());
BEGIN
    RETURN ARRAY(SELECT w FROM outbox_internal._window(cur.shard, cur, cur.batch_end, NULL, since) w ORDER BY w.seq);
END
$$;

CREATE OR REPLACE FUNCTION outbox_internal._shard_pending(cur outbox._cursor_log, sink outbox.sinks,
                                                 OUT events bigint, OUT oldest timestamptz)
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    cap       constant int := 500;   -- 16 shards: 8,000 rows a consumer at most
    floor_seq bigint := outbox_internal._pending_floor(cur);
    since     timestamptz := outbox_internal._since(floor_seq, outbox_internal._newest_seal());
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

COMMENT ON VIEW outbox.shard_status IS
    'Per consumer and shard: pending events (exact up to 500, estimated beyond), the oldest one '
    'and its age, parked keys, who holds the lease.';

-- nothing new is PUBLIC
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox_internal FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_internal._shard_pending(outbox._cursor_log, outbox.sinks)
    TO outbox_relay, outbox_admin;
