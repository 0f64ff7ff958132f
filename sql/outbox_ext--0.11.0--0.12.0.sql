-- outbox_ext 0.11.0 -> 0.12.0
--
-- Why: claims opened every partition ahead of now. Nothing told them those were empty, so
-- with one-minute partitions and 199 made ahead, each claim opened and read 199 empty
-- partitions in every statement that reads events (a claim + settle cost 7x as much as with
-- 4 partitions). Now outbox._reach records how far ahead of the clock events may lie: the
-- trigger outbox_reach on outbox.events (so on every partition) records a partition's bound
-- when a row lands there while the trigger is on, and maintain() turns it off as a
-- partition's time nears, recording a bound above everything it then no longer covers.
-- Claims add "created_at < that bound" to what they read (_window, _free_cursor,
-- _may_have_work and status take it), and PostgreSQL skips the partitions beyond it before it
-- opens them.
--
-- The partitions an earlier version made get the trigger turned off here: the bound
-- maintain() records covers every one of them. Until it runs, the bound is 'infinity' and
-- claims read as before.
--
-- A delta: what changed from 0.11.0 to 0.12.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.12.0'" to load this file. \quit

CREATE TABLE IF NOT EXISTS outbox._reach (
    upper timestamptz NOT NULL,
    at    timestamptz NOT NULL DEFAULT now()
);
-- not unique: emits that land ahead at once must not wait for each other's row
CREATE INDEX IF NOT EXISTS _reach_upper_idx ON outbox._reach (upper);
INSERT INTO outbox._reach (upper) VALUES ('infinity');  -- no bound until maintain() records one

-- the forms without the reach (PL/pgSQL callers name them by text: no dependency)
DROP FUNCTION IF EXISTS outbox_internal._window(int, outbox._cursor_log, bigint, int, timestamptz);
DROP FUNCTION IF EXISTS outbox_internal._free_cursor(int, int, outbox._seals);

CREATE OR REPLACE FUNCTION outbox_internal._reach() RETURNS timestamptz
    LANGUAGE plpgsql STABLE  -- its plan cached (a SQL function's body is planned at every call)
AS $$
BEGIN
    RETURN coalesce((SELECT max(r.upper) FROM outbox._reach r), 'infinity');
END
$$;

CREATE OR REPLACE FUNCTION outbox_internal._open_window(cur outbox._cursor_log, seq_mark bigint, x xid8)
RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    late    record;
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
        -- One pass over the range per transaction (there are few), txid = t checked on the
        -- index entries: only their events' rows are visited. (txid = ANY (array) is checked
        -- on the heap rows instead, and a min/max plan would walk the range twice.)
        SELECT min(e.seq), max(e.seq) INTO cur.late_from, cur.late_to
          FROM unnest(late.txids) AS t
         CROSS JOIN LATERAL (SELECT e.seq FROM outbox.events e
                              WHERE e.shard = cur.shard AND e.seq > late.floor_seq
                                AND e.seq <= seq_end AND e.txid = t
                                AND e.created_at >= since AND e.created_at < until
                             OFFSET 0) AS e;
    END IF;
    cur.after_seq := NULL;
    RETURN cur;
END
$$;

CREATE OR REPLACE FUNCTION outbox_internal._window(shard int, cur outbox._cursor_log, upto bigint, lim int,
                                                  since timestamptz, until timestamptz)
RETURNS SETOF outbox.events
    LANGUAGE sql STABLE
AS $$
    SELECT w.* FROM (
        (SELECT e.* FROM outbox.events e
          WHERE e.shard = _window.shard
            AND e.seq > greatest(cur.after_seq, cur.lo_seq)
            AND e.seq <= least(coalesce(upto, 9223372036854775807), cur.restored_seq)
            AND e.created_at >= since AND e.created_at < until
            AND e.txid >= cur.lo_top AND e.txid < pg_catalog.pg_snapshot_xmax(cur.hi_snap)
            AND pg_catalog.pg_visible_in_snapshot(e.txid, cur.hi_snap)
          ORDER BY e.seq LIMIT lim)
        UNION ALL
        (SELECT e.* FROM outbox.events e
          WHERE cur.late_from IS NOT NULL
            AND e.shard = _window.shard
            AND e.seq >= cur.late_from AND e.seq > coalesce(cur.after_seq, -1)
            AND e.seq <= least(cur.late_to, coalesce(upto, 9223372036854775807), cur.restored_seq)
            AND e.created_at >= since AND e.created_at < until
            AND e.txid = ANY ((SELECT (outbox_internal._late(cur)).txids)::xid8[])  -- once, not per row
          ORDER BY e.seq LIMIT lim)
    ) AS w ORDER BY w.seq LIMIT lim
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
        IF NOT EXISTS (SELECT FROM outbox.events e
                        WHERE e.shard = _free_cursor.shard AND e.seq > floor_seq
                          AND e.created_at >= since AND e.created_at < until)
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
    RETURN EXISTS (
        SELECT FROM unnest(curs) AS c
         WHERE EXISTS (SELECT FROM outbox._parked p
                        WHERE p.consumer_id = _may_have_work.consumer_id AND p.shard = c.shard)
            OR EXISTS (SELECT FROM outbox.events e
                        WHERE e.shard = c.shard AND e.seq > outbox_internal._pending_floor(c)
                          AND e.created_at >= since AND e.created_at < until));
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
            RETURN QUERY
            WITH page AS MATERIALIZED (SELECT * FROM outbox_internal._window(cur.shard, cur, NULL, batch_size, since, until)),
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
    until     timestamptz;
BEGIN
    LOOP
        fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
        IF cur.hi_snap IS NULL THEN
            cur := outbox_internal._open_window(cur, seq_mark, x);
        END IF;
        since := outbox_internal._window_since(cur, outbox_internal._newest_seal());
        until := outbox_internal._reach();  -- after the window's snapshot: see _reach
        page := ARRAY(SELECT w FROM outbox_internal._window(cur.shard, cur, NULL, batch_size, since, until) AS w
                       ORDER BY w.seq);
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
    RETURN ARRAY(SELECT w FROM outbox_internal._window(cur.shard, cur, cur.batch_end, NULL, since, until) w
                  ORDER BY w.seq);
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
    until     timestamptz := outbox_internal._reach();
    first_seq bigint;
    last_seq  bigint;
BEGIN
    SELECT count(*), min(p.created_at), min(p.seq), max(p.seq) INTO events, oldest, first_seq, last_seq
      FROM (SELECT e.created_at, e.seq FROM outbox.events e
             WHERE e.shard = cur.shard AND e.seq > floor_seq AND e.created_at >= since AND e.created_at < until
               AND outbox_internal._pending(cur, e.txid, e.seq)
               AND (sink.name IS NULL OR outbox_internal._routes(sink, e.topic, e.aggregate_type))
             ORDER BY e.seq LIMIT cap) AS p;
    IF events = cap THEN
        events := events + (coalesce(pg_sequence_last_value('outbox.event_seq'), last_seq) - last_seq)
                           * cap / greatest(last_seq - first_seq + 1, cap);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox_internal._note_reach() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT isfinite(NEW.created_at) THEN  -- no read could bound it
        RAISE EXCEPTION 'outbox_ext: an event''s created_at must be finite, not %', NEW.created_at
            USING ERRCODE = 'invalid_datetime_format', HINT = 'outbox.emit writes the transaction''s start.';
    END IF;
    IF NOT EXISTS (SELECT FROM outbox._reach r WHERE r.upper > NEW.created_at AND r.upper < 'infinity') THEN
        INSERT INTO outbox._reach (upper)
        VALUES (coalesce((SELECT p.upper FROM outbox_internal.partition_ranges p
                           WHERE p.partition = TG_RELID AND NOT p.is_default AND p.upper > NEW.created_at),
                         date_trunc('hour', NEW.created_at, 'UTC') + interval '1 hour'));
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION outbox_internal._advance_reach(parts outbox.partitions[]) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    width interval := (SELECT c.width FROM outbox.partition_config c WHERE c.parent = 'outbox.events'::regclass);
    p     outbox.partitions;
    bound timestamptz;
    old_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    -- ALWAYS again where a data-only restore's ENABLE TRIGGER ALL made it fire in origin mode only
    IF EXISTS (SELECT FROM pg_trigger t WHERE t.tgname = 'outbox_reach' AND t.tgenabled <> 'A'
                  AND t.tgrelid IN ('outbox.events'::regclass, 'outbox.events_default'::regclass)) THEN
        BEGIN
            ALTER TABLE ONLY outbox.events ENABLE ALWAYS TRIGGER outbox_reach;
            ALTER TABLE outbox.events_default ENABLE ALWAYS TRIGGER outbox_reach;
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;  -- next run
        END;
    END IF;
    FOR p IN SELECT x.* FROM unnest(parts) x
               JOIN pg_trigger t ON t.tgrelid = x.partition AND t.tgname = 'outbox_reach' AND t.tgenabled = 'A'
              WHERE x.parent = 'outbox.events'::regclass AND NOT x.is_default AND x.lower < now() + width LOOP
        BEGIN
            EXECUTE format('ALTER TABLE %s DISABLE TRIGGER outbox_reach', p.partition);
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;  -- emits write there already: it stays on until the next run
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', old_timeout, true);
    SELECT max(x.upper) INTO bound FROM unnest(parts) x
     WHERE x.parent = 'outbox.events'::regclass AND NOT x.is_default
       AND NOT EXISTS (SELECT FROM pg_trigger t  -- on: always
                        WHERE t.tgrelid = x.partition AND t.tgname = 'outbox_reach' AND t.tgenabled = 'A');
    bound := greatest(bound, (SELECT date_trunc('hour', max(e.created_at), 'UTC') + interval '1 hour'
                                FROM outbox.events e WHERE e.created_at >= coalesce(bound, '-infinity')));
    IF bound IS NULL THEN
        RETURN;  -- no partition and no event: nothing to bound yet
    END IF;
    INSERT INTO outbox._reach (upper) SELECT bound
     WHERE NOT EXISTS (SELECT FROM outbox._reach r WHERE r.upper >= bound AND r.upper < 'infinity');
    DELETE FROM outbox._reach r
     WHERE r.upper = 'infinity'
        OR r.upper < (SELECT max(s.upper) FROM outbox._reach s WHERE s.upper < 'infinity');
END
$$;

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
                changed := true;
                RETURN QUERY SELECT 'created', created::text, NULL::text;
            END IF;
        END LOOP;
    END LOOP;
    -- 4. seal the past and record how far ahead events may be: claims then skip the partitions
    --    they have read past and those ahead of now
    IF changed THEN  -- the loop above made partitions
        parts := outbox_internal._partition_list();
    END IF;
    PERFORM outbox_internal._seal(parts);
    PERFORM outbox_internal._advance_reach(parts);
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

CREATE OR REPLACE FUNCTION outbox_internal._restored() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM outbox._origin) THEN
        RETURN NEW;  -- CREATE EXTENSION's own row
    END IF;
    DELETE FROM outbox._seals;  -- made before the dump's events arrived: not about them
    -- no bound until maintain() has seen the dump's events (outbox._reach)
    INSERT INTO outbox._reach (upper) VALUES ('infinity');
    UPDATE outbox._origin
       SET restore_pending = true, restored_at = now(), restorer = pg_backend_pid(),
           restorer_since = (SELECT a.backend_start FROM pg_stat_activity a WHERE a.pid = pg_backend_pid());
    CREATE OR REPLACE TRIGGER rebase_before_emit BEFORE INSERT ON outbox.events
        FOR EACH STATEMENT EXECUTE FUNCTION outbox_internal._rebase_before_emit();
    RETURN NULL;
END
$$;

COMMENT ON FUNCTION outbox.maintain() IS
    'Creates partitions ahead, drops (or detaches) those past retention once every consumer has '
    'read them, moves rows out of default partitions, seals the past and records how far ahead '
    'events may lie (claims then skip the partitions they need not read), trims cursor history; '
    'returns what it did. '
    'Safe to run concurrently (one runs, the other skips) and from pg_cron: '
    'SELECT cron.schedule(''outbox-maintain'', ''* * * * *'', ''SELECT * FROM outbox.maintain()'');';

CREATE OR REPLACE TRIGGER outbox_reach BEFORE INSERT ON outbox.events
    FOR EACH ROW EXECUTE FUNCTION outbox_internal._note_reach();
ALTER TABLE outbox.events ENABLE ALWAYS TRIGGER outbox_reach;
-- off on the partitions made before: they are covered as a whole (see above)
DO $reach$
DECLARE
    p regclass;
BEGIN
    FOR p IN SELECT r.partition FROM outbox_internal.partition_ranges r
              WHERE r.parent = 'outbox.events'::regclass AND NOT r.is_default LOOP
        EXECUTE format('ALTER TABLE %s DISABLE TRIGGER outbox_reach', p);
    END LOOP;
END
$reach$;

REVOKE ALL ON outbox._reach FROM PUBLIC;
GRANT SELECT ON outbox._reach TO outbox_admin;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox_internal FROM PUBLIC;
