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
-- Rerunnable. Frozen: the sql/ files it included (claim.sql, status.sql, partitions.sql,
-- grants.sql) are expanded as they were in 0.7.0.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.7.0'" to load this file. \quit

DROP FUNCTION IF EXISTS outbox._claim_shard(outbox.consumers, int, int, interval, text, bigint, xid8);

-- outbox_ext: consumers and claims — commit-ordered, per-key ordered reading of the event log.
--
-- How a consumer reads a shard without gaps (PgQ's idea, per shard):
--   Its position is a commit window (lo, hi] between two bounds. A bound is taken by a claim
--   that has not written yet: read the event sequence (seq), then take an xid of its own (X),
--   then take a snapshot. Its "top" is max(snapshot xmax, X + 1). Every xid below top was then
--   finished or is in the bound's in-progress list (txids: the snapshot's xip plus
--   [xmax, X], since xmax is only latestCompletedXid + 1); every xid from top on was assigned
--   after seq was read, so its events have a greater seq (emit takes the xid before the seq,
--   see outbox.events.seq). The window holds every event whose transaction hi sees finished
--   and lo did not:
--     (a) transactions with xid >= lo.top: their events have seq > lo.seq;
--     (b) transactions in lo's in-progress list: their events have seq above a "floor"
--         carried for each of them from the bound where it first appeared.
--   Inside a window events go out in seq order (emit order, which is commit order for writers
--   serialized on an aggregate), paged by after_seq through the (shard, seq, txid) index, so
--   a window of millions of events costs no more per page than a small one. A row committed
--   late is never skipped (it falls in a later window) and an uncommitted one is never read.
--
-- How claims stay bloat-free: a shard is taken by locking its row in outbox._shards FOR UPDATE
-- SKIP LOCKED (never updated), and the cursor with its lease is an append-only log: claim, ack,
-- nack and release INSERT a row, the newest row is the state. A transaction that holds back
-- vacuum for minutes leaves nothing dead on the hot path.
--
-- How a failing key blocks only itself: nack parks the key. Its failed event and every later
-- event of the key are copied, in order, into a small side queue (_parked_events) as the shard
-- reads past them, and the shard goes on with other keys. The queue's head is retried with
-- exponential backoff and jitter; after max_attempts it goes to outbox.dead_letters and the key
-- moves on. When the queue is empty the key is unparked and flows with its shard again.
--
-- Name resolution (sql/grants.sql): the API functions are [pinned], helpers (outbox._*) run
-- [inside] them and do not pin search_path themselves: only the SECURITY DEFINER API functions
-- below call them, and those pin it. A SET clause on every helper would cost each call a GUC
-- save and restore and a new search path lookup, about 5% of a claim.
--
-- Plans that do not depend on the moment they were made: the API functions also set
-- enable_seqscan and enable_bitmapscan off, jit off and plan_cache_mode to
-- force_generic_plan, so every statement on the claim path is planned once per session, as
-- an index walk. Planned from statistics instead, a lookup of the newest cursor row or mark
-- made while its table was small stayed a sequential scan (or a bitmap scan and a sort) for
-- the whole session, each claim slower as the table grew; and a custom plan of a window,
-- costed with its actual bounds, would rather sort a whole backlog.
--
-- Rerunnable (upgrade scripts include it): tables and indexes only where missing, functions
-- replaced. A changed table needs its own ALTER in the upgrade script.

CREATE TABLE IF NOT EXISTS outbox.consumers (
    id           int         GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name         text        NOT NULL UNIQUE,
    max_attempts int         NOT NULL DEFAULT 10 CHECK (max_attempts >= 1),
    backoff_base interval    NOT NULL DEFAULT '1 second' CHECK (backoff_base > '0'),
    backoff_max  interval    NOT NULL DEFAULT '10 minutes' CHECK (backoff_max > '0'),
    created_at   timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE outbox.consumers IS
    'Named readers of the event log (one per sink); each has its own cursor in every shard.';

-- What claims lock (FOR UPDATE SKIP LOCKED) to take a shard; never updated.
CREATE TABLE IF NOT EXISTS outbox._shards (
    consumer_id int NOT NULL REFERENCES outbox.consumers ON DELETE CASCADE,
    shard       int NOT NULL,
    PRIMARY KEY (consumer_id, shard)
);

-- The cursor of each (consumer, shard) as an append-only log; the newest row is the state.
CREATE TABLE IF NOT EXISTS outbox._cursor_log (
    consumer_id int         NOT NULL REFERENCES outbox.consumers ON DELETE CASCADE,
    shard       int         NOT NULL,
    pos         bigint      GENERATED ALWAYS AS IDENTITY,
    epoch       bigint      NOT NULL,  -- lease generation: +1 on every claim
    owner       text,                  -- who holds the batch out; NULL when none is out
    lease_until timestamptz,           -- claim: lease expiry; release: no claim before this
    lo_snap     pg_snapshot NOT NULL,  -- the window (lo, hi] ...
    lo_seq      bigint      NOT NULL,
    lo_top      xid8        NOT NULL,
    lo_txids    xid8[]      NOT NULL,  -- ... lo's in-progress transactions and their floors
    lo_floors   bigint[]    NOT NULL,
    hi_snap     pg_snapshot,           -- NULL: the next claim opens a new window after lo
    hi_seq      bigint,
    hi_top      xid8,
    hi_txids    xid8[],
    hi_floors   bigint[],
    late_from   bigint,                -- seq range holding the events of (b) in this window
    late_to     bigint,
    after_seq   bigint,                -- delivered through this seq inside the window
    batch_end   bigint,                -- claim rows: seq of the batch's last event
    exhausted   boolean,               -- claim rows: the batch ends the window
    heads       uuid[],                -- claim rows: parked head events handed out
    at          timestamptz NOT NULL DEFAULT now(),
    restored_seq bigint,               -- restored from a dump (sql/restore.sql): events up to
    restored_top xid8                  -- this seq are the dump's, their txids below this top
);
CREATE INDEX IF NOT EXISTS _cursor_log_consumer_id_shard_pos_idx
    ON outbox._cursor_log (consumer_id, shard, pos DESC);

CREATE TABLE IF NOT EXISTS outbox._parked (
    consumer_id     int         NOT NULL REFERENCES outbox.consumers ON DELETE CASCADE,
    aggregate_id    text        NOT NULL,
    shard           int         NOT NULL,
    attempts        int         NOT NULL DEFAULT 0,  -- failed attempts of the current head
    next_attempt_at timestamptz NOT NULL,
    last_error      text,
    nacked_epoch    bigint,                          -- the batch that last failed the head
    parked_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_id, aggregate_id)
);
CREATE INDEX IF NOT EXISTS _parked_consumer_id_shard_next_attempt_at_idx
    ON outbox._parked (consumer_id, shard, next_attempt_at);

CREATE TABLE IF NOT EXISTS outbox._parked_events (
    consumer_id    int         NOT NULL,
    aggregate_id   text        NOT NULL,
    pos            bigint      GENERATED ALWAYS AS IDENTITY,
    id             uuid        NOT NULL,
    topic          text,
    aggregate_type text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb,
    headers        jsonb,
    created_at     timestamptz NOT NULL,
    seq            bigint      NOT NULL,
    PRIMARY KEY (consumer_id, aggregate_id, pos),
    UNIQUE (consumer_id, id),
    FOREIGN KEY (consumer_id, aggregate_id) REFERENCES outbox._parked ON DELETE CASCADE
);

CREATE TABLE IF NOT EXISTS outbox.dead_letters (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer       text        NOT NULL,
    event_id       uuid        NOT NULL,
    topic          text,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb,
    headers        jsonb,
    created_at     timestamptz NOT NULL,
    seq            bigint      NOT NULL,
    attempts       int         NOT NULL,
    last_error     text,
    dead_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS dead_letters_consumer_aggregate_id_id_idx
    ON outbox.dead_letters (consumer, aggregate_id, id);
COMMENT ON TABLE outbox.dead_letters IS
    'Events a consumer gave up on after max_attempts, with the last error; outbox.replay re-queues them.';

-- Marks: (seq, then a fresh xid) pairs that claims record at most once a second. A
-- transaction with a greater xid has only events above the mark's seq, which gives every
-- in-progress transaction a recent floor however old the cursor's bounds are. Insert-only;
-- outbox.maintain() trims old marks.
CREATE TABLE IF NOT EXISTS outbox._marks (
    top xid8        PRIMARY KEY,
    seq bigint      NOT NULL,
    at  timestamptz NOT NULL DEFAULT now()
);

-- One row of a claimed batch.
DO $type$
BEGIN
    CREATE TYPE outbox.claimed AS (
        shard          int,
        epoch          bigint,
        id             uuid,
        topic          text,
        aggregate_type text,
        aggregate_id   text,
        event_type     text,
        payload        jsonb,
        headers        jsonb,
        created_at     timestamptz,
        seq            bigint,
        attempt        int
    );
EXCEPTION WHEN duplicate_object THEN NULL;  -- rerun: the type is there
END
$type$;
COMMENT ON TYPE outbox.claimed IS
    'A claimed event: ack or nack it with (shard, epoch); attempt is 1 + its earlier failures.';

---------------------------------------------------------------------------------------------
-- Internals
---------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION outbox._consumer(name text) RETURNS outbox.consumers
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    c outbox.consumers;
BEGIN
    PERFORM outbox._not_null(name IS NULL, 'consumer', 'the function');
    PERFORM outbox._rebase_if_restored();
    SELECT * INTO c FROM outbox.consumers WHERE consumers.name = _consumer.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'consumer "%" does not exist', name
            USING ERRCODE = 'undefined_object',
                  HINT = 'Create it with outbox.create_consumer(name).';
    END IF;
    RETURN c;
END
$$;

-- The one NULL check of the API's arguments: 22004, naming the argument and the function.
CREATE OR REPLACE FUNCTION outbox._not_null(is_null boolean, arg text, func text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF is_null THEN
        RAISE EXCEPTION '% must not be NULL', arg
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = format('Pass %s to %s; the README lists every argument.', arg, func);
    END IF;
END
$$;

-- An interval argument: positive (or zero, if zero_ok) and at most max, else 22023.
CREATE OR REPLACE FUNCTION outbox._check_interval(v interval, arg text, max interval, zero_ok boolean)
RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF v < '0' OR (v = '0' AND NOT zero_ok) OR v > max THEN
        RAISE EXCEPTION '% % is out of range', arg, v
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = format('%s is %s to %s.', arg, CASE WHEN zero_ok THEN '0' ELSE 'more than 0' END, max);
    END IF;
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
         after_seq, batch_end, exhausted, heads, restored_seq, restored_top)
    VALUES
        (cur.consumer_id, cur.shard, cur.epoch, cur.owner, cur.lease_until, cur.lo_snap,
         cur.lo_seq, cur.lo_top, cur.lo_txids, cur.lo_floors, cur.hi_snap, cur.hi_seq,
         cur.hi_top, cur.hi_txids, cur.hi_floors, cur.late_from, cur.late_to, cur.after_seq,
         cur.batch_end, cur.exhausted, cur.heads, cur.restored_seq, cur.restored_top);
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

-- The top of a bound taken with snapshot snap after xid x: every xid below it was finished or
-- in progress then, every xid from it on was assigned after the bound's seq was read.
CREATE OR REPLACE FUNCTION outbox._top(snap pg_snapshot, x xid8) RETURNS xid8
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN greatest(pg_catalog.pg_snapshot_xmax(snap), (x::text::bigint + 1)::text::xid8);

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
        cur.hi_top := outbox._top(cur.hi_snap, x);
        SELECT coalesce(array_agg(t ORDER BY t), '{}'),
               coalesce(array_agg(CASE WHEN t = x THEN seq_mark
                                       ELSE greatest(coalesce(u.f, cur.lo_seq),
                                                     (SELECT m.seq FROM outbox._marks m WHERE m.top < t
                                                       ORDER BY m.top DESC LIMIT 1)) END ORDER BY t), '{}')
          INTO cur.hi_txids, cur.hi_floors
          FROM unnest(outbox._in_progress(cur.hi_snap, x)) AS t
          LEFT JOIN unnest(cur.lo_txids, cur.lo_floors) AS u(id, f) ON u.id = t;
    END IF;
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
        IF cur.lo_top = cur.restored_top THEN
            -- Restored, and the dump's last window is done: every event of the dump is. Go on in
            -- this cluster's transaction ids, with every event after the dump's (a greater seq).
            cur := outbox._lo_after_seq(cur, cur.restored_seq);
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

-- The lower bound "every event with a greater seq is still to come, whatever its txid", with
-- no window open: where a cursor goes on after a dump's events (see sql/restore.sql).
CREATE OR REPLACE FUNCTION outbox._lo_after_seq(cur outbox._cursor_log, seq bigint) RETURNS outbox._cursor_log
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    cur.lo_snap := '1:1:'; cur.lo_seq := seq; cur.lo_top := '1'; cur.lo_txids := '{}'; cur.lo_floors := '{}';
    cur.hi_snap := NULL; cur.hi_seq := NULL; cur.hi_top := NULL; cur.hi_txids := NULL;
    cur.hi_floors := NULL; cur.late_from := NULL; cur.late_to := NULL; cur.after_seq := NULL;
    RETURN cur;
END
$$;

-- A window done: no window yet after it. Leaving a dump's events (see _advance) is recorded
-- at once, so that later claims do not look through them again.
CREATE OR REPLACE FUNCTION outbox._next_window(cur outbox._cursor_log) RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    restored boolean := cur.restored_seq IS NOT NULL;
BEGIN
    cur := outbox._advance(cur, NULL, true);
    IF restored AND cur.restored_seq IS NULL THEN
        PERFORM outbox._append(cur);
    END IF;
    RETURN cur;
END
$$;

-- What is pending for a consumer: whether the event (txid, seq) of the cursor's shard is still
-- to be delivered. Every such event has a seq above _pending_floor, which bounds index scans.
-- Status and partition maintenance ask this; claims read the same set window by window.
CREATE OR REPLACE FUNCTION outbox._pending(cur outbox._cursor_log, txid xid8, seq bigint) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN seq > cur.restored_seq  -- emitted after a restore (sql/restore.sql): not read yet
        OR (NOT pg_catalog.pg_visible_in_snapshot(txid, cur.lo_snap)
            AND NOT (cur.hi_snap IS NOT NULL AND seq <= coalesce(cur.after_seq, -1)
                     AND pg_catalog.pg_visible_in_snapshot(txid, cur.hi_snap)));
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

-- Lock a shard for ack/nack/release and return its cursor, refusing a stale epoch.
CREATE OR REPLACE FUNCTION outbox._leased(consumer_id int, shard int, epoch bigint) RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    cur outbox._cursor_log;
BEGIN
    PERFORM outbox._not_null(shard IS NULL, 'shard', 'the function (the shard a claimed row came with)');
    PERFORM outbox._not_null(epoch IS NULL, 'epoch', 'the function (the epoch a claimed row came with)');
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

CREATE OR REPLACE FUNCTION outbox._backoff(c outbox.consumers, attempts int) RETURNS interval
    LANGUAGE sql VOLATILE
    RETURN least(c.backoff_max, c.backoff_base * power(2, least(attempts - 1, 30)))
           * (0.5 + random() / 2);

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
COMMENT ON FUNCTION outbox.create_consumer(text, boolean, int, interval, interval) IS
    'Creates a consumer that reads events committed from now on (or all, from_beginning). '
    'Example: SELECT outbox.create_consumer(''billing-webhook'', max_attempts => 5);';

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
COMMENT ON FUNCTION outbox.drop_consumer(text) IS
    'Drops a consumer with its cursors, parked keys and dead letters; false if there was none.';

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
COMMENT ON FUNCTION outbox.claim(text, int, interval, text) IS
    'Takes one free shard under a lease and returns its next events in commit order (at most '
    'batch_size, plus parked keys due for retry); nothing when no shard has work. '
    'Example: SELECT * FROM outbox.claim(''billing-webhook'', 100, ''30 seconds'');';

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
COMMENT ON FUNCTION outbox.release(text, int, bigint, interval) IS
    'Gives a claimed batch back undelivered (e.g. the sink is down): the shard stays where it was '
    'and is not claimed again before retry_after. Example: SELECT outbox.release(''hook'', 3, 17, ''5 s'');';

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
COMMENT ON FUNCTION outbox.release_owner(text, text) IS
    'Gives back every batch a relay (by its claim owner name) holds for the consumer, e.g. after '
    'the relay died; its late acks are refused. Returns how many. '
    'Example: SELECT outbox.release_owner(''hook'', ''relay-7'');';

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
COMMENT ON FUNCTION outbox.replay(text, text) IS
    'Re-queues a consumer''s dead letters (all, or of one key), in the order they died, behind '
    'anything already queued for their keys; returns how many. Example: SELECT outbox.replay(''hook'');';
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

CREATE OR REPLACE VIEW outbox.status AS
SELECT s.consumer,
       sum(s.pending)::bigint AS pending,
       min(s.oldest_pending_at) AS oldest_pending_at,
       now() - min(s.oldest_pending_at) AS lag,
       sum(s.parked_keys)::bigint AS parked_keys,
       (SELECT count(*) FROM outbox._parked_events q JOIN outbox.consumers c ON c.id = q.consumer_id
         WHERE c.name = s.consumer) AS parked_events,
       (SELECT count(*) FROM outbox.dead_letters d WHERE d.consumer = s.consumer) AS dead_letters,
       coalesce((SELECT p.last_error FROM outbox._parked p JOIN outbox.consumers c ON c.id = p.consumer_id
                  WHERE c.name = s.consumer ORDER BY p.parked_at DESC LIMIT 1),
                (SELECT d.last_error FROM outbox.dead_letters d WHERE d.consumer = s.consumer
                  ORDER BY d.id DESC LIMIT 1)) AS last_error,
       count(s.leased_by) AS shards_leased,
       max(s.last_activity) AS last_activity,
       (SELECT count(*) FROM outbox.events_default) AS events_in_default_partition,
       k.kind AS sink_kind,
       k.enabled AS sink_enabled,
       -- the worker's figures (outbox._sink_stats), written every two seconds while it runs
       CASE WHEN st.updated_at > now() - interval '10 seconds' THEN st.per_second ELSE 0 END
           AS delivered_per_second,
       st.delivered AS delivered_total,
       st.failed AS failed_total,
       st.last_delivered_at,
       st.last_error AS last_sink_error,
       st.last_error_at AS last_sink_error_at
  FROM outbox.shard_status s
  LEFT JOIN outbox.sinks k ON k.name = s.consumer
  LEFT JOIN outbox._sink_stats st ON st.sink = s.consumer
 GROUP BY s.consumer, k.name, st.sink;
COMMENT ON VIEW outbox.status IS
    'One row per consumer (a sink is one): pending events and lag, parked keys and events, dead '
    'letters, the last error, leased shards, events waiting in the default partition '
    '(outbox.maintain() moves them), and for a sink the worker''s delivery rate and last error. '
    'Example: SELECT consumer, pending, lag, dead_letters, last_error FROM outbox.status;';
-- outbox_ext: partitions of the event log and the inbox, and their maintenance.
--
-- outbox.events is partitioned by created_at, inbox.messages by message_id (UUIDv7, so by
-- time too). outbox.maintain() keeps both: it creates partitions ahead, drops (or detaches)
-- those past their retention — for events only once every consumer has read past all of their
-- events — and moves rows that landed in a default partition into partitions of their own.
-- Partitions are named <parent>_pYYYYMMDD_HH24MISS after their lower bound in UTC.
--
-- Rerunnable: the 0.1.0 -> 0.2.0 upgrade script includes this file.
-- Name resolution (sql/grants.sql): maintain() is [pinned]; the helpers that run dynamic SQL
-- (_create_partition, _partition_pending, _revoke_all, _index_partition) pin search_path too,
-- the others are [parsed]; the view is [parsed].

CREATE TABLE IF NOT EXISTS outbox.partition_config (
    parent    regclass PRIMARY KEY,
    width     interval NOT NULL CHECK (width > '0'),
    ahead     int      NOT NULL DEFAULT 2 CHECK (ahead >= 0),
    retention interval NOT NULL CHECK (retention >= '0'),
    detach    boolean  NOT NULL DEFAULT false
);
COMMENT ON TABLE outbox.partition_config IS
    'How outbox.maintain() partitions each table: width of a partition, how many to create ahead, '
    'how long to keep them (for events: after every consumer has read them), and whether to detach '
    'instead of drop. Example: UPDATE outbox.partition_config SET retention = ''3 days'' WHERE parent = ''outbox.events''::regclass;';
INSERT INTO outbox.partition_config (parent, width, ahead, retention) VALUES
    ('outbox.events', '1 day', 2, '2 days'),
    ('inbox.messages', '1 day', 2, '7 days')
ON CONFLICT (parent) DO NOTHING;

CREATE OR REPLACE FUNCTION outbox._partition_name(parent text, lo_at timestamptz) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN parent || '_p' || pg_catalog.to_char(lo_at AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS');

-- The partition key column of a table, and its value at a moment, as a literal (the inbox's
-- key is a UUIDv7).
CREATE OR REPLACE FUNCTION outbox._key_column(parent regclass) RETURNS text
    LANGUAGE sql IMMUTABLE
    RETURN CASE WHEN parent = 'inbox.messages'::regclass THEN 'message_id' ELSE 'created_at' END;
-- The time of a row's partition key, as an SQL expression.
CREATE OR REPLACE FUNCTION outbox._key_time(parent regclass) RETURNS text
    LANGUAGE sql IMMUTABLE
    RETURN CASE WHEN parent = 'inbox.messages'::regclass THEN 'inbox.uuid_time(message_id)' ELSE 'created_at' END;
CREATE OR REPLACE FUNCTION outbox._bound(parent regclass, at timestamptz) RETURNS text
    LANGUAGE sql STABLE
    RETURN CASE WHEN parent = 'inbox.messages'::regclass THEN inbox.uuid_at(at)::text ELSE at::text END;

-- Every partition of the two tables with its time range (NULLs for a default partition).
CREATE OR REPLACE VIEW outbox.partitions AS
SELECT i.inhparent::regclass AS parent,
       c.oid::regclass AS partition,
       CASE WHEN i.inhparent = 'inbox.messages'::regclass THEN inbox.uuid_time(b[1]::uuid) ELSE b[1]::timestamptz END AS lower,
       CASE WHEN i.inhparent = 'inbox.messages'::regclass THEN inbox.uuid_time(b[2]::uuid) ELSE b[2]::timestamptz END AS upper,
       b IS NULL AS is_default,
       pg_total_relation_size(c.oid) AS bytes
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
  LEFT JOIN LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']*)''\) TO \(''([^'']*)''\)') AS b ON true
 WHERE i.inhparent IN ('outbox.events'::regclass, 'inbox.messages'::regclass);
COMMENT ON VIEW outbox.partitions IS 'Partitions of outbox.events and inbox.messages with their time ranges.';

CREATE OR REPLACE FUNCTION outbox._floor_time(at timestamptz, width interval) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN to_timestamp(floor(extract(epoch FROM at) / extract(epoch FROM width)) * extract(epoch FROM width));

-- The index a partition of parent needs: events, (shard, seq, txid), which claims read; the
-- inbox, unique (message_id, consumer), which dedups (message_id decides the partition, so a
-- key unique in each partition is unique in the table). Made on each partition, never on the
-- parent: pg_dump restores the partitions maintain() made as tables of their own, attached to
-- the parent CREATE EXTENSION made; an index of the parent would be copied onto each at
-- ATTACH, and the dump's own CREATE INDEX for it would then fail.
CREATE OR REPLACE FUNCTION outbox._index_partition(parent regclass, part regclass) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    name text := (SELECT c.relname FROM pg_class c WHERE c.oid = part);
BEGIN
    IF parent = 'inbox.messages'::regclass THEN
        EXECUTE format('CREATE UNIQUE INDEX IF NOT EXISTS %I ON %s (message_id, consumer)',
                       name || '_key', part);
    ELSE
        EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON %s (shard, seq, txid)', name || '_read', part);
    END IF;
END
$$;

-- Take every privilege on rel from every role but its owner. A new partition gets its
-- owner's default privileges (ALTER DEFAULT PRIVILEGES); partitions need no grant at all
-- (rows are reached through the parent), and a TRIGGER or TRUNCATE grant on one would let its
-- holder run code inside the worker and the SECURITY DEFINER functions (see sql/grants.sql).
CREATE OR REPLACE FUNCTION outbox._revoke_all(rel regclass) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    grantee oid;
BEGIN
    FOR grantee IN SELECT DISTINCT a.grantee FROM pg_class c, aclexplode(c.relacl) a
                    WHERE c.oid = rel AND a.grantee <> c.relowner LOOP
        EXECUTE format('REVOKE ALL ON TABLE %s FROM %s', rel,
                       CASE WHEN grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(grantee)) END);
    END LOOP;
END
$$;

-- Create the partition [lo_at, lo_at + width) of parent, clipped to the gap between existing
-- partitions; rows for that range waiting in the default partition move into it first.
-- Returns the partition created, or NULL if the range is already covered.
CREATE OR REPLACE FUNCTION outbox._create_partition(parent regclass, lo_at timestamptz, width interval)
RETURNS regclass
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    hi_at timestamptz := lo_at + width;
    nsp   text;
    rel   text;
    part  text;
    dflt  regclass;
BEGIN
    SELECT greatest(lo_at, max(p.upper)) INTO lo_at FROM outbox.partitions p
     WHERE p.parent = _create_partition.parent AND NOT p.is_default AND p.upper > lo_at AND p.lower <= lo_at;
    SELECT least(hi_at, min(p.lower)) INTO hi_at FROM outbox.partitions p
     WHERE p.parent = _create_partition.parent AND NOT p.is_default AND p.lower >= lo_at AND p.lower < hi_at;
    IF lo_at >= hi_at THEN
        RETURN NULL;
    END IF;
    SELECT n.nspname, c.relname INTO nsp, rel
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = parent;
    part := outbox._partition_name(rel, lo_at);
    SELECT p.partition INTO dflt FROM outbox.partitions p
     WHERE p.parent = _create_partition.parent AND p.is_default;
    -- Standalone first, then the default partition's rows of the range, then attach: a
    -- default partition holding rows of the range would make a plain CREATE ... PARTITION OF fail.
    EXECUTE format('CREATE TABLE %I.%I (LIKE %I.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                   nsp, part, nsp, rel);
    IF dflt IS NOT NULL THEN
        EXECUTE format('WITH moved AS (DELETE FROM %s d WHERE %I >= %L AND %I < %L RETURNING d.*) '
                       'INSERT INTO %I.%I SELECT * FROM moved',
                       dflt, outbox._key_column(parent), outbox._bound(parent, lo_at),
                       outbox._key_column(parent), outbox._bound(parent, hi_at), nsp, part);
    END IF;
    PERFORM outbox._index_partition(parent, format('%I.%I', nsp, part)::regclass);
    EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                   nsp, rel, nsp, part, outbox._bound(parent, lo_at), outbox._bound(parent, hi_at));
    PERFORM outbox._revoke_all(format('%I.%I', nsp, part)::regclass);
    RETURN format('%I.%I', nsp, part)::regclass;
END
$$;

-- Why an event partition past its retention must stay, or NULL when it may go. Rows of open
-- transactions are invisible, so first: no open transaction started before the partition's
-- upper bound (emit's created_at is the transaction's start, so it may still write there),
-- and no transaction, prepared ones included, holds a lock on it (it has written there).
-- Then no consumer may have an event of it pending (outbox._pending, sql/claim.sql).
CREATE OR REPLACE FUNCTION outbox._partition_pending(part regclass, upper timestamptz) RETURNS text
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
                                          AND e.seq > outbox._pending_floor(cur.l)
                                          AND outbox._pending(cur.l, e.txid, e.seq)))', part)
        INTO pending;
    RETURN CASE WHEN pending THEN 'a consumer has not read all its events' END;
END
$$;

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
COMMENT ON FUNCTION outbox.maintain() IS
    'Creates partitions ahead, drops (or detaches) those past retention once every consumer has '
    'read them, moves rows out of default partitions, trims cursor history; returns what it did. '
    'Safe to run concurrently (one runs, the other skips) and from pg_cron: '
    'SELECT cron.schedule(''outbox-maintain'', ''* * * * *'', ''SELECT * FROM outbox.maintain()'');';

-- The default partitions belong to the extension; dated partitions do not: CREATE EXTENSION
-- makes none (the first outbox.maintain() does, which the worker runs soon after), so that a
-- restore, which runs CREATE EXTENSION first, does not make partitions its dump brings too.
CREATE TABLE IF NOT EXISTS outbox.events_default PARTITION OF outbox.events DEFAULT;
CREATE TABLE IF NOT EXISTS inbox.messages_default PARTITION OF inbox.messages DEFAULT;
SELECT outbox._index_partition('outbox.events', 'outbox.events_default');
SELECT outbox._index_partition('inbox.messages', 'inbox.messages_default');

-- Restoring a dump puts its partition_config rows over those CREATE EXTENSION made (a plain
-- COPY would collide with them); see sql/dump.sql.
CREATE OR REPLACE FUNCTION outbox._restore_partition_config() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE outbox.partition_config c
       SET width = NEW.width, ahead = NEW.ahead, retention = NEW.retention, detach = NEW.detach
     WHERE c.parent = NEW.parent;
    RETURN CASE WHEN FOUND THEN NULL ELSE NEW END;
END
$$;
CREATE OR REPLACE TRIGGER restore_partition_config BEFORE INSERT ON outbox.partition_config
    FOR EACH ROW EXECUTE FUNCTION outbox._restore_partition_config();
-- outbox_ext: privileges, all in one place. Runs last (finalize); rerunnable (upgrade
-- scripts include it): it first takes back every privilege our roles and PUBLIC hold on our
-- objects, then grants exactly what each role needs.
--
-- Rules:
-- - Nothing is granted to PUBLIC.
-- - No role gets ALL on a table: never TRIGGER, TRUNCATE or REFERENCES, because a trigger or
--   rule on our tables would run inside the worker and the SECURITY DEFINER functions, as their
--   owner. (Rules and policies need ownership, which only the extension's owner has.)
-- - Partitions get no grant at all: rows are reached through their parent, whose privileges
--   apply; outbox.maintain() strips any grant a new partition would get by default.
-- - Writes to state go through the SECURITY DEFINER API (which pins search_path and names
--   every object by schema); a role writes a table directly only where that is its job
--   (admins: sink and retry settings, partition settings, dead letters; the worker: sink
--   figures), and then only the columns it may change.
--
-- What runs with more privilege than its caller resolves names only in pg_catalog and our
-- schemas; each SQL file's header says which of these rules covers what it defines:
-- [pinned]   SECURITY DEFINER functions SET search_path = pg_catalog, pg_temp (functions and
--            operators are never looked up in pg_temp) and name our objects by schema.
--            tests/test_roles.py checks that every one of them pins it.
-- [inside]   Internal helpers (outbox._*, granted to no role) run only inside [pinned]
--            functions, whose search_path they inherit. (One [pinned] one, _shard_pending, is
--            granted to outbox_relay and outbox_admin: the status views call it.)
-- [parsed]   Views and SQL-standard bodies (LANGUAGE sql ... RETURN) are parsed once, by
--            CREATE EXTENSION or ALTER EXTENSION UPDATE, whose search_path is pg_catalog,
--            pg_temp (the control file's schema is pg_catalog).
-- [caller]   Not SECURITY DEFINER (create_sink, drop_sink): runs with the caller's rights;
--            its search_path is pinned all the same.
-- [native]   C functions (src/emit, src/sinks/check.rs) look objects up in the catalog by
--            schema; emit's one SPI statement names outbox.emit_many with exactly typed
--            arguments.
-- [worker]   The worker's session has search_path pg_catalog, pg_temp, and its statements
--            name everything by schema, operators as OPERATOR(pg_catalog.x)
--            (src/worker/session.rs, queries.rs, mod.rs).
-- Dynamic SQL quotes identifiers with %I or a regclass's text and values with %L.
--
-- Producers reach the event log only through the SECURITY DEFINER emit_many and the native
-- emit (which writes as its owner); they cannot read events or configuration. outbox.sinks
-- holds secrets: only outbox_admin and outbox_worker (which delivers with them) read it;
-- relays see a sink's health through outbox.status, which shows no URL or secret.

REVOKE ALL ON SCHEMA outbox, inbox FROM PUBLIC, outbox_producer, outbox_relay, outbox_admin, outbox_worker;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox, inbox
    FROM PUBLIC, outbox_producer, outbox_relay, outbox_admin, outbox_worker;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox, inbox
    FROM PUBLIC, outbox_producer, outbox_relay, outbox_admin, outbox_worker;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox, inbox
    FROM PUBLIC, outbox_producer, outbox_relay, outbox_admin, outbox_worker;

GRANT outbox_producer, outbox_relay TO outbox_admin;
GRANT outbox_relay TO outbox_worker;
GRANT USAGE ON SCHEMA outbox, inbox TO outbox_producer, outbox_relay, outbox_admin, outbox_worker;

-- outbox_producer: emit, nothing else
GRANT EXECUTE ON FUNCTION
    outbox.emit(text, text, text, jsonb, jsonb, text),
    outbox.emit_many(text, text, text[], jsonb[], jsonb, text),
    outbox.uuid_v7(),
    outbox.shard_count(),
    outbox.shard_of(text)
TO outbox_producer;

-- outbox_relay: read the log, claim and settle
GRANT SELECT ON outbox.events, outbox.status, outbox.shard_status TO outbox_relay;
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

GRANT EXECUTE ON FUNCTION inbox.claim(uuid, text), inbox.uuid_time(uuid), inbox.uuid_at(timestamptz)
    TO outbox_producer, outbox_relay;

-- outbox_admin: consumers, sinks, dead letters, maintenance; reads everything
GRANT EXECUTE ON FUNCTION
    outbox.create_consumer(text, boolean, int, interval, interval),
    outbox.drop_consumer(text),
    outbox.replay(text, text),
    outbox.create_sink(text, text, text, text[], text[], text, int, int, interval, interval, text,
                       jsonb, text, jsonb, text, int, interval, interval, boolean),
    outbox.drop_sink(text),
    outbox.maintain()
TO outbox_admin;
GRANT SELECT ON outbox.events, outbox.consumers, outbox.sinks, outbox._sink_stats,
    outbox.dead_letters, outbox.partition_config, outbox.partitions, outbox.status,
    outbox.shard_status, outbox._shards, outbox._cursor_log, outbox._parked,
    outbox._parked_events, outbox._marks, outbox._origin, inbox.messages
TO outbox_admin;
GRANT INSERT, UPDATE, DELETE ON outbox.sinks TO outbox_admin;   -- checked by its trigger
GRANT UPDATE (max_attempts, backoff_base, backoff_max) ON outbox.consumers TO outbox_admin;
GRANT UPDATE (width, ahead, retention, detach) ON outbox.partition_config TO outbox_admin;
GRANT DELETE ON outbox.dead_letters, inbox.messages TO outbox_admin;

-- outbox_worker: relays (outbox_relay), delivers with the sinks' settings, records their
-- figures, runs maintenance. It connects as this role (outbox_ext.worker_role).
GRANT SELECT ON outbox.sinks TO outbox_worker;
GRANT SELECT, INSERT, UPDATE ON outbox._sink_stats TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox.maintain() TO outbox_worker;
