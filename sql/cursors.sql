-- outbox_ext: cursors and commit windows — how a consumer reads a shard in commit order, without
-- gaps, and without bloat.
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
-- Owns: outbox._cursor_log, the marks, seals and reach that bound every read of the log, and
-- the reads themselves (windows, pages, what is pending).
--
-- Name resolution (sql/grants.sql): the API functions are [pinned], helpers (outbox_internal._*) run
-- [inside] them and do not pin search_path themselves: only the SECURITY DEFINER API functions
-- call them, and those pin it. A SET clause on every helper would cost each call a GUC save and
-- restore and a new search path lookup, about 5% of a claim.
--
-- Plans that do not depend on the moment they were made: the API functions also set
-- enable_seqscan and enable_bitmapscan off, jit off and plan_cache_mode to
-- force_generic_plan, so every statement on the claim path is planned once per session, as
-- an index walk. Planned from statistics instead, a lookup of the newest cursor row or mark
-- made while its table was small stayed a sequential scan (or a bitmap scan and a sort) for
-- the whole session, each claim slower as the table grew; and a custom plan of a window,
-- costed with its actual bounds, would rather sort a whole backlog.
--
-- Rerunnable: tables and indexes only where missing, functions replaced. A changed table needs
-- its own ALTER in the upgrade script.

-- The cursor of each (consumer, shard) as an append-only log; the newest row is the state.
CREATE TABLE IF NOT EXISTS outbox._cursor_log (
    consumer_id int         NOT NULL,
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
    -- No foreign key, here or on _parked: only a transaction holding the shard's row (a relay,
    -- replay, create_consumer making it, the rebase after a restore) writes these rows, and
    -- outbox.drop_consumer, the one place a consumer's shards go, deletes them. A key check
    -- share-locks the row it finds. On the consumer's row (up to 0.18.0) that was a WAL record
    -- for every claim and settle, and a multixact whenever two relays overlapped (multixact
    -- ids run out too: anti-wraparound vacuums of every table); on the shard's row (0.19.0) it
    -- made a dump of 0.18.0 fail to restore, its tables loaded in an order chosen without it.
);

CREATE INDEX IF NOT EXISTS _cursor_log_consumer_id_shard_pos_idx
    ON outbox._cursor_log (consumer_id, shard, pos DESC);

-- Marks: (seq, then a fresh xid) pairs that claims record at most once a second. A
-- transaction with a greater xid has only events above the mark's seq, which gives every
-- in-progress transaction a recent floor however old the cursor's bounds are. Insert-only;
-- outbox.maintain() trims old marks.
CREATE TABLE IF NOT EXISTS outbox._marks (
    top xid8        PRIMARY KEY,
    seq bigint      NOT NULL,
    at  timestamptz NOT NULL DEFAULT now()
);

-- Seals: what outbox.maintain() learned of the log's past. Every event made before upper (by a
-- transaction that began before it; emit's created_at is that start) has a seq of at most
-- max_seq. So a read of the events above a seq may add "created_at >= the newest seal's upper
-- whose max_seq is at most that seq" (outbox_internal._since), which PostgreSQL uses to skip
-- the older partitions before it opens them: a claim's cost does not grow with the partitions
-- it has read past. maintain() seals only a partition boundary that no open transaction began
-- before, and a minute back from that. A clock stepped back by more can still let an event
-- land behind a seal: it then records a seal break (below). Insert-only; maintain() trims
-- seals below the oldest partition, drops those above a break, and drops them all when the
-- clock is behind the newest. Not dumped, and
-- dropped when a dump is restored (sql/restore.sql): the restored events' seqs and times are
-- the dump's; maintain() seals the restored log once it is rebased.
CREATE TABLE IF NOT EXISTS outbox._seals (
    max_seq bigint      NOT NULL,
    upper   timestamptz NOT NULL,
    made_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (max_seq, upper)
);

-- Seal breaks: the created_at of an event that landed behind a seal, recorded in its own
-- transaction by the trigger outbox_seal (sql/partitions.sql). No seal above a break is
-- trusted (_newest_seal) until maintain() drops both. Insert-only but for maintain(): a
-- delete of the seals there would have made maintain() wait for the event's transaction.
-- Empty but after a clock went back. Not dumped.
CREATE TABLE IF NOT EXISTS outbox._seal_breaks (
    at timestamptz NOT NULL
);
-- (every claim reads the lowest: a clock behind for long may leave a row per transaction)
CREATE INDEX IF NOT EXISTS _seal_breaks_at ON outbox._seal_breaks (at);

-- Reach: how far ahead of the clock events may lie. Every event has a created_at below the
-- greatest upper here, so reads add "created_at < it" (outbox_internal._reach), and
-- PostgreSQL skips the partitions ahead of now before it opens them. An event lands ahead of
-- the clock only where a clock once ran ahead, and there the trigger outbox_reach, on every
-- partition whose time lies ahead and on the default partition, records its bound in the
-- event's own transaction; outbox.maintain() turns the trigger off as a partition's time nears
-- and records, in the same transaction, a bound above every event it does not cover
-- (sql/partitions.sql). The row 'infinity' stands for "no bound yet" (after CREATE EXTENSION,
-- an upgrade or a restore), until maintain() records one. Insert-only but for maintain(),
-- which keeps the greatest. Not dumped.
CREATE TABLE IF NOT EXISTS outbox._reach (
    upper timestamptz NOT NULL,
    at    timestamptz NOT NULL DEFAULT now()
);

-- not unique: emits that land ahead at once must not wait for each other's row
CREATE INDEX IF NOT EXISTS _reach_upper_idx ON outbox._reach (upper);

-- The newest cursor row of a (consumer, shard).
CREATE OR REPLACE FUNCTION outbox_internal._cursor(consumer_id int, shard int) RETURNS outbox._cursor_log
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

CREATE OR REPLACE FUNCTION outbox_internal._append(cur outbox._cursor_log) RETURNS void
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
CREATE OR REPLACE FUNCTION outbox_internal._in_progress(snap pg_snapshot, x xid8) RETURNS xid8[]
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

-- A bound's snapshot, taken after xid x, its own transaction's: pg_current_snapshot() leaves
-- x out of its in-progress list, so when a later transaction ended before it (xmax above x)
-- it reads x as finished, and x's events as read already by a window that ends there
-- (_pending; part (a) of the window), though x has not committed. In progress it is.
CREATE OR REPLACE FUNCTION outbox_internal._bound_snapshot(x xid8) RETURNS pg_snapshot
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    snap pg_snapshot := pg_current_snapshot();
BEGIN
    IF x >= pg_snapshot_xmax(snap) THEN
        RETURN snap;  -- as in almost every bound: read as in progress already
    END IF;
    RETURN (least(pg_snapshot_xmin(snap), x)::text || ':' || pg_snapshot_xmax(snap)::text || ':'
            || array_to_string(ARRAY(SELECT t FROM pg_snapshot_xip(snap) AS t UNION SELECT x ORDER BY 1), ','))::pg_snapshot;
END
$$;

-- The top of a bound taken with snapshot snap after xid x: every xid below it was finished or
-- in progress then, every xid from it on was assigned after the bound's seq was read.
CREATE OR REPLACE FUNCTION outbox_internal._top(snap pg_snapshot, x xid8) RETURNS xid8
    LANGUAGE sql IMMUTABLE PARALLEL SAFE  -- not STRICT, so that callers inline it (greatest is not)
    RETURN greatest(pg_catalog.pg_snapshot_xmax(snap), (x::text::bigint + 1)::text::xid8);

-- Transactions of lo's in-progress list that the cursor's hi sees finished, with the lowest
-- of their floors: part (b) of the window.
CREATE OR REPLACE FUNCTION outbox_internal._late(cur outbox._cursor_log, OUT txids xid8[], OUT floor_seq bigint)
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
        cur.hi_snap := outbox_internal._bound_snapshot(x);
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

-- The lower bound "every event with a greater seq is still to come, whatever its txid", with
-- no window open: where a cursor goes on after a dump's events (see sql/restore.sql).
CREATE OR REPLACE FUNCTION outbox_internal._lo_after_seq(cur outbox._cursor_log, seq bigint) RETURNS outbox._cursor_log
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

-- What is pending for a consumer: whether the event (txid, seq) of the cursor's shard is still
-- to be delivered. Every such event has a seq above _pending_floor, which bounds index scans.
-- Status and partition maintenance ask this; claims read the same set window by window.
CREATE OR REPLACE FUNCTION outbox_internal._pending(cur outbox._cursor_log, txid xid8, seq bigint) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN seq > cur.restored_seq  -- emitted after a restore (sql/restore.sql): not read yet
        OR (NOT pg_catalog.pg_visible_in_snapshot(txid, cur.lo_snap)
            AND NOT (cur.hi_snap IS NOT NULL AND seq <= coalesce(cur.after_seq, -1)
                     AND pg_catalog.pg_visible_in_snapshot(txid, cur.hi_snap)));

-- Inside a window (after_seq set) every event up to after_seq that hi sees finished is
-- delivered, so a pending one up to there is in progress at hi: above its hi floor.
-- PL/pgSQL without a query, not SQL: its callers are PL/pgSQL, which would run a SQL
-- function's body anew (about 30 µs) on every call.
CREATE OR REPLACE FUNCTION outbox_internal._pending_floor(cur outbox._cursor_log) RETURNS bigint
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

-- Where a probe for something to read in an idle shard (its lo, no window open) starts: every
-- event still to come has a seq above this. That is lo.seq, or lower for a transaction of lo's
-- in-progress list that snap sees ended: its events (above its floor) come in the next window.
-- One still in progress is left out: its events cannot be read before it ends, and its end
-- shows in a later snapshot. (The pending floor counts them all: with a transaction holding an
-- xid open for minutes, every shard that had an event since it began looked as if it had work,
-- and each idle poll locked them all, took an xid and wrote WAL.)
CREATE OR REPLACE FUNCTION outbox_internal._probe_floor(cur outbox._cursor_log, snap pg_snapshot) RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    low bigint := cur.lo_seq;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(cur.lo_txids), 0) LOOP
        IF cur.lo_floors[i] < low AND pg_catalog.pg_visible_in_snapshot(cur.lo_txids[i], snap) THEN
            low := cur.lo_floors[i];
        END IF;
    END LOOP;
    RETURN least(low, cur.restored_seq);
END
$$;

-- The newest seal (NULLs when there is none).
CREATE OR REPLACE FUNCTION outbox_internal._newest_seal() RETURNS outbox._seals
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    newest outbox._seals;
BEGIN
    SELECT * INTO newest FROM outbox._seals s
     WHERE s.upper <= coalesce((SELECT min(b.at) FROM outbox._seal_breaks b), 'infinity')
     ORDER BY s.max_seq DESC, s.upper DESC LIMIT 1;
    RETURN newest;
END
$$;

-- What every event's created_at is below (outbox._reach): 'infinity' when nothing says.
-- Callers pass it as a value, like since (see _window_since). A window's read takes it after
-- the window's snapshot: an event that snapshot sees committed with its reach row, which the
-- read then sees too. (Read before, it could miss both, and the cursor would pass the event.)
CREATE OR REPLACE FUNCTION outbox_internal._reach() RETURNS timestamptz
    LANGUAGE plpgsql STABLE  -- its plan cached (a SQL function's body is planned at every call)
AS $$
BEGIN
    RETURN coalesce((SELECT max(r.upper) FROM outbox._reach r), 'infinity');
END
$$;

-- The earliest created_at an event with a greater seq can have ('-infinity' when no seal says),
-- given the newest seal (_newest_seal, read by the caller after the snapshot it reads events
-- by: an event behind a seal broke it in its own transaction, _break_seals). Seals are made a
-- minute behind the clock: a clock now behind that went back, and until maintain() has dropped
-- the seals none is trusted; nor is one above the newest (a seal break lies below it). A seq at
-- or past the newest seal's needs no lookup.
CREATE OR REPLACE FUNCTION outbox_internal._since(seq bigint, newest outbox._seals) RETURNS timestamptz
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF newest.upper IS NULL OR now() < newest.upper + interval '1 minute' THEN
        RETURN '-infinity';
    ELSIF seq >= newest.max_seq THEN
        RETURN newest.upper;
    END IF;
    RETURN coalesce((SELECT s.upper FROM outbox._seals s
                      WHERE s.max_seq <= _since.seq AND s.upper <= newest.upper  -- none above a break
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
CREATE OR REPLACE FUNCTION outbox_internal._window_since(cur outbox._cursor_log, newest outbox._seals)
RETURNS timestamptz
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN outbox_internal._since(least(greatest(cur.after_seq, cur.lo_seq), cur.late_from - 1), newest);
END
$$;

-- A window's events in commit order, the bulk of every window: a shard's events after seq
-- after_seq and up to seq upto that the window's snapshot hi_snap sees committed and the
-- window's start (lo_top) had not, in seq order, at most lim; none made before since
-- (_window_since) or after until (_reach). It walks the (shard, seq, txid) index in order and
-- stops at the limit. hi_snap is read once, in a subquery: passed as a field of a cursor
-- (_window) and read for each row, it took about a sixth of a page of 1,000. A SQL function
-- that the planner inlines into the statement calling it: rows are read once, not copied
-- through a function's result first. The callers' plans are generic (see the API's SET
-- clause): a custom plan, costed with the actual bounds, would rather sort a whole backlog.
-- A page of a cursor with no late range reads only this (src/claim/pruned.rs).
CREATE OR REPLACE FUNCTION outbox_internal._window_in_order(shard int, after_seq bigint, upto bigint, lim int,
                                                           lo_top xid8, hi_snap pg_snapshot,
                                                           since timestamptz, until timestamptz)
RETURNS SETOF outbox.events
    LANGUAGE sql STABLE
AS $$
    SELECT e.* FROM outbox.events e
     WHERE e.shard = _window_in_order.shard
       AND e.seq > after_seq AND e.seq <= upto
       AND e.created_at >= since AND e.created_at < until
       AND e.txid >= lo_top AND e.txid < pg_catalog.pg_snapshot_xmax(hi_snap)
       AND pg_catalog.pg_visible_in_snapshot(e.txid, (SELECT hi_snap))  -- once, not per row
     ORDER BY e.seq LIMIT lim
$$;

-- Events of a shard in the cursor's window, after its position and up to seq upto, in seq
-- order, at most lim (NULL: all): its events in commit order (_window_in_order), and the
-- late transactions' events of its late range (see _open_window); none made before since or
-- after until. Inlined like _window_in_order. A restored cursor reads only the dump's events,
-- whose txids are the dump's (sql/restore.sql).
CREATE OR REPLACE FUNCTION outbox_internal._window(shard int, cur outbox._cursor_log, upto bigint, lim int,
                                                  since timestamptz, until timestamptz)
RETURNS SETOF outbox.events
    LANGUAGE sql STABLE
AS $$
    SELECT w.* FROM (
        (SELECT * FROM outbox_internal._window_in_order(
                           shard, greatest(cur.after_seq, cur.lo_seq),
                           least(coalesce(upto, 9223372036854775807), cur.restored_seq), lim,
                           cur.lo_top, cur.hi_snap, since, until))
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

-- The shards among shards that have an event above their floor (floors, in the same order),
-- made in [since, until): one index probe each. Inlined into the statement of _any_events.
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

-- The seqs of a shard's events of the transactions txids in (floor_seq, seq_end], made in
-- [since, until): one pass over the range per transaction (there are few), txid = t checked on
-- the index entries, so only their events' rows are visited. (txid = ANY (array) is checked on
-- the heap rows instead.) Inlined into the statement of _late_range.
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

-- The reads of the event log on a claim's way, native (src/claim/pruned.rs): each runs
-- its SQL function above with the bounds of the partitions around [since, until) as
-- constants, so that only those partitions are planned and locked. (Planned once per session
-- with since and until as values, a statement locks every partition at every execution.)
-- The next page of a window: hands out at most lim events after the cursor's position, in seq
-- order, as claimed rows of the next epoch, into the result of the claim in progress (see
-- outbox.claim), and, when there are any, writes the claim row leasing them to owner. Returns
-- how many it handed out.
CREATE OR REPLACE FUNCTION outbox_internal._claim_page(cur outbox._cursor_log, lim int, owner text, lease interval,
                                                      since timestamptz, until timestamptz)
RETURNS bigint
    LANGUAGE c VOLATILE STRICT AS 'MODULE_PATHNAME', 'outbox_claim_page_0_18';

-- _window's events of the cursor's window (in seq order, up to upto, at most lim; NULLs: no
-- bound), for the parked path and settle. A scan of a function's result keeps the order the
-- function made its rows in, so ARRAY(SELECT ... FROM it) needs no ORDER BY.
CREATE OR REPLACE FUNCTION outbox_internal._window_events(cur outbox._cursor_log, upto bigint, lim int,
                                                         since timestamptz, until timestamptz)
RETURNS SETOF outbox.events
    LANGUAGE c STABLE AS 'MODULE_PATHNAME', 'outbox_window_events';

-- Whether any of the shards has an event above its floor (_shards_with_events).
CREATE OR REPLACE FUNCTION outbox_internal._any_events(shards int[], floors bigint[],
                                                      since timestamptz, until timestamptz)
RETURNS boolean
    LANGUAGE c STABLE STRICT AS 'MODULE_PATHNAME', 'outbox_any_events';

-- The shards among shards that have an event above their floor (_shards_with_events), in
-- order; NULL when none has.
CREATE OR REPLACE FUNCTION outbox_internal._shards_with_new_events(shards int[], floors bigint[],
                                                                  since timestamptz, until timestamptz)
RETURNS int[]
    LANGUAGE c STABLE STRICT AS 'MODULE_PATHNAME', 'outbox_shards_with_new_events';

-- The least and greatest of _late_seqs, NULLs when there are none.
CREATE OR REPLACE FUNCTION outbox_internal._late_range(shard int, floor_seq bigint, seq_end bigint, txids xid8[],
                                                      since timestamptz, until timestamptz)
RETURNS bigint[]
    LANGUAGE c STABLE STRICT AS 'MODULE_PATHNAME', 'outbox_late_range';
