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
-- Name resolution (sql/grants.sql): the API functions are [pinned], helpers (outbox_internal._*) run
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
-- Rerunnable: tables and indexes only where missing, functions replaced. A changed table needs
-- its own ALTER in the upgrade script.

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

CREATE TABLE IF NOT EXISTS outbox._parked (
    consumer_id     int         NOT NULL,
    aggregate_id    text        NOT NULL,
    shard           int         NOT NULL,
    attempts        int         NOT NULL DEFAULT 0,  -- failed attempts of the current head
    next_attempt_at timestamptz NOT NULL,
    last_error      text,
    nacked_epoch    bigint,                          -- the batch that last failed the head
    parked_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_id, aggregate_id)  -- no foreign key: see _cursor_log
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
INSERT INTO outbox._reach (upper) VALUES ('infinity');  -- no bound until maintain() records one

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

-- The one NULL check of the API's arguments: 22004, naming the argument and the function.
CREATE OR REPLACE FUNCTION outbox_internal._not_null(is_null boolean, arg text, func text) RETURNS void
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
CREATE OR REPLACE FUNCTION outbox_internal._check_interval(v interval, arg text, max interval, zero_ok boolean)
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

CREATE OR REPLACE FUNCTION outbox_internal._check_shard(shard int) RETURNS void
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

-- The top of a bound taken with snapshot snap after xid x: every xid below it was finished or
-- in progress then, every xid from it on was assigned after the bound's seq was read.
CREATE OR REPLACE FUNCTION outbox_internal._top(snap pg_snapshot, x xid8) RETURNS xid8
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
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
-- given the newest seal (_newest_seal, read once by the caller). Seals are made a minute behind
-- the clock: a clock now behind that went back, and until maintain() has dropped the seals
-- (sql/partitions.sql) none is trusted. A seq at or past the newest seal's needs no lookup.
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
-- The least and greatest of _late_seqs, NULLs when there are none.
CREATE OR REPLACE FUNCTION outbox_internal._late_range(shard int, floor_seq bigint, seq_end bigint, txids xid8[],
                                                      since timestamptz, until timestamptz)
RETURNS bigint[]
    LANGUAGE c STABLE STRICT AS 'MODULE_PATHNAME', 'outbox_late_range';

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

CREATE OR REPLACE FUNCTION outbox_internal._backoff(c outbox.consumers, attempts int) RETURNS interval
    LANGUAGE sql VOLATILE
    RETURN least(c.backoff_max, c.backoff_base * power(2, least(attempts - 1, 30)))
           * (0.5 + random() / 2);

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

-- The head of a parked key was not attempted (the sink throttled, lacked its topic, ran out of
-- time): nothing is counted and nothing dead-lettered; the retry is scheduled as if the
-- current attempt had failed.
CREATE OR REPLACE FUNCTION outbox_internal._head_waits(c outbox.consumers, key text, error text,
                                              retry_after interval, epoch bigint) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    UPDATE outbox._parked p
       SET last_error = error, nacked_epoch = epoch,
           next_attempt_at = now() + coalesce(retry_after, outbox_internal._backoff(c, greatest(p.attempts, 1)))
     WHERE p.consumer_id = c.id AND p.aggregate_id = key;
END
$$;

CREATE OR REPLACE FUNCTION outbox_internal._unpark_if_empty(consumer_id int, key text) RETURNS void
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
END
$$;

-- The bound every window a claim opens closes at: the event seq, then a fresh xid (see the
-- header), taken before the transaction writes anything (_check_claim refused a transaction
-- that had). Once a second it is also recorded as a mark (outbox._marks).
CREATE OR REPLACE FUNCTION outbox_internal._claim_bound(OUT seq bigint, OUT x xid8)
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    seq := coalesce(pg_sequence_last_value('outbox.event_seq'), 0);
    x := pg_current_xact_id();
    IF coalesce((SELECT m.at FROM outbox._marks m ORDER BY m.top DESC LIMIT 1), '-infinity')
       < now() - interval '1 second' THEN
        INSERT INTO outbox._marks (top, seq) VALUES (x, seq) ON CONFLICT DO NOTHING;
    END IF;
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
    RETURN EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = _may_have_work.consumer_id)
        OR outbox_internal._any_events(ARRAY(SELECT c.shard FROM unnest(curs) c ORDER BY c.shard),
                                       ARRAY(SELECT outbox_internal._pending_floor(c) FROM unnest(curs) c
                                              ORDER BY c.shard),
                                       since, outbox_internal._reach());
END
$$;

-- The claim row of a batch: the cursor, leased to owner, with the batch's last seq, whether
-- it ends the window, and the parked heads handed out with it. Written by _append alone.
CREATE OR REPLACE FUNCTION outbox_internal._claimed(cur outbox._cursor_log, owner text, lease interval,
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
-- order, handed out by _claim_page, which also writes the claim row; or, when the shard has
-- parked keys, the rows of _claim_parked, returned. Nothing when no shard has work.
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
            got := outbox_internal._claim_page(cur, batch_size, owner, lease, since, until);
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

-- The parked keys of a shard that are due: their heads, in the order they fell due.
CREATE OR REPLACE FUNCTION outbox_internal._due_heads(c outbox.consumers, shard int, lim int)
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

-- Settling a batch (outbox.settle; ack, nack and reject are its thin forms). A failure a relay
-- reports, resolved against its batch: the event, its key and seq, and whether it is a parked
-- key's head (handed out from the key's queue) or an event read from the shard's window.
DO $type$
BEGIN
    CREATE TYPE outbox_internal._failure AS (
        event_id     uuid,
        aggregate_id text,
        seq          bigint,
        head         boolean,
        error        text,
        retry_after  interval,
        final        boolean,
        attempted    boolean   -- false: not sent (the sink's doing): the key waits, uncounted
    );
EXCEPTION WHEN duplicate_object THEN NULL;  -- rerun: the type is there
END
$type$;

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

-- settle's failures argument, a JSON array of {"id", "error", "retry_after", "final",
-- "attempted"}: checked, as unresolved failures. retry_after is a number of seconds or an
-- interval's text; attempted (default true) false for an event the sink never judged.
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
               OR f - ARRAY['id', 'error', 'retry_after', 'final', 'attempted'] <> '{}' THEN
                RAISE EXCEPTION 'not an object with an id and nothing but error, retry_after, final and attempted'
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            one.event_id := (f ->> 'id')::uuid;
            one.error := f ->> 'error';
            one.retry_after := CASE jsonb_typeof(f -> 'retry_after')
                                   WHEN 'number' THEN make_interval(secs => (f ->> 'retry_after')::float8)
                                   ELSE (f ->> 'retry_after')::interval END;
            one.final := coalesce((f -> 'final')::boolean, false);
            one.attempted := coalesce((f -> 'attempted')::boolean, true);
            IF one.final AND NOT one.attempted THEN
                RAISE EXCEPTION 'a failure not attempted cannot be final'
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            PERFORM outbox_internal._check_failure(one.event_id, one.retry_after);
            list := list || one;
        END LOOP;
    EXCEPTION WHEN data_exception THEN  -- a bad uuid, interval or boolean, or the checks above
        RAISE EXCEPTION 'failure % of failures is invalid: %', i, SQLERRM
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = format('It is %s.', f),
                  HINT = 'A failure is {"id": "<event id>", "error": "<text>", "retry_after": '
                         '<seconds or interval text, optional>, "final": <true to dead-letter it now, optional>, '
                         '"attempted": <false when the sink never judged it, optional>}.';
    END;
    RETURN list;
END
$$;

-- Find a failed event in its batch (batch: the window's events the claim handed out). NULL for a
-- head that is settled already (a reject of this batch dead-lettered it).
CREATE OR REPLACE FUNCTION outbox_internal._resolve(c outbox.consumers, cur outbox._cursor_log,
                                           batch outbox.events[], f outbox_internal._failure)
RETURNS outbox_internal._failure
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

-- Record a key's failure, f being its first failed event in the batch. A head counts a failed
-- attempt of its queue (not when f was not attempted: then it only waits). An event of the
-- window parks its key: it and the key's later events of the batch are queued, in order.
-- Returns how many events of the batch this kept back.
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
    IF f.attempted IS FALSE THEN
        PERFORM outbox_internal._head_waits(c, f.aggregate_id, f.error, f.retry_after, cur.epoch);
    ELSE
        PERFORM outbox_internal._head_failed(c, f.aggregate_id, f.error, f.retry_after, cur.epoch, f.final);
    END IF;
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

-- A batch given back (release) after nack parked keys of it: a key that this batch parked
-- (its queue holds only events of this batch's page, none of them a parked head it handed out)
-- is unparked, its queue dropped, as if the batch had never been claimed. The shard reads the
-- page again, so the key's events come back in order: kept, the earlier ones would be queued
-- behind the failed one. A key parked before (its head handed out and nacked) keeps its queue
-- and the attempt counted.
CREATE OR REPLACE FUNCTION outbox_internal._unpark_released(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    DELETE FROM outbox._parked p
     WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch
       AND NOT EXISTS (SELECT FROM outbox._parked_events q
                        WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                          AND (q.id = ANY (cur.heads) OR q.seq <= coalesce(cur.after_seq, 0)
                               OR q.seq > coalesce(cur.batch_end, 0)));
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
    f     outbox_internal._failure := ROW(event_id, NULL, NULL, NULL, error, retry_after, final, true);
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
COMMENT ON FUNCTION outbox.create_consumer(text, boolean, int, interval, interval) IS
    'Creates a consumer that reads events committed from now on (or all, from_beginning). '
    'Example: SELECT outbox.create_consumer(''billing-webhook'', max_attempts => 5);';

CREATE OR REPLACE FUNCTION outbox.drop_consumer(name text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c_id int := (SELECT c.id FROM outbox.consumers c WHERE c.name = drop_consumer.name);
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'name', 'outbox.drop_consumer');
    -- The deletes below must see the rows relays commit while the drop waits for their shards:
    -- with a snapshot taken before, those would be left behind.
    IF pg_catalog.current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        RAISE EXCEPTION 'outbox.drop_consumer must run at READ COMMITTED, not %',
                pg_catalog.upper(pg_catalog.current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'Call it in a READ COMMITTED transaction (the default isolation level).';
    END IF;
    -- Its shards first, in order, as claims and settles take them before they write a cursor
    -- row: the drop waits for a claim or a settle under way, then deletes what no one holds.
    PERFORM FROM outbox._shards s WHERE s.consumer_id = c_id ORDER BY s.shard FOR UPDATE;
    DELETE FROM outbox._cursor_log l WHERE l.consumer_id = c_id;
    DELETE FROM outbox._parked p WHERE p.consumer_id = c_id;  -- and their queues (a cascade)
    DELETE FROM outbox.dead_letters d WHERE d.consumer = drop_consumer.name;
    DELETE FROM outbox.consumers c WHERE c.id = c_id;         -- and its shards (a cascade)
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION outbox.drop_consumer(text) IS
    'Drops a consumer with its cursors, parked keys and dead letters; false if there was none.';

-- outbox.claim's body: what it returns, the page's rows aside (see outbox.claim).
CREATE OR REPLACE FUNCTION outbox_internal._claim_body(
    consumer   text,
    batch_size int,
    lease      interval,
    owner      text
) RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
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
-- A claim's result is made natively (src/claim/result.rs): the events of its page go from the
-- executor into it once, where RETURN QUERY would copy them again in every function on the
-- way. The body runs in PL/pgSQL (_claim_body), with the settings and the rights of the call.
CREATE OR REPLACE FUNCTION outbox.claim(
    consumer   text,
    batch_size int      DEFAULT 100,
    lease      interval DEFAULT '30 seconds',
    owner      text     DEFAULT NULL
) RETURNS SETOF outbox.claimed
    LANGUAGE c VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS 'MODULE_PATHNAME', 'outbox_claim';
COMMENT ON FUNCTION outbox.claim(text, int, interval, text) IS
    'Takes one free shard under a lease and returns its next events in commit order (at most '
    'batch_size, plus parked keys due for retry); nothing when no shard has work. '
    'Example: SELECT * FROM outbox.claim(''billing-webhook'', 100, ''30 seconds'');';

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
COMMENT ON FUNCTION outbox.settle(text, int, bigint, jsonb) IS
    'Finishes a claimed batch in one call. failures lists the events that failed, as a JSON array '
    'of {"id", "error", "retry_after" (seconds or interval text, optional), "final" (true: '
    'dead-letter now), "attempted" (false: not sent, e.g. the sink throttled; no attempt is '
    'counted)}; a failed key''s later events in the batch wait behind it, in order, '
    'whatever was said of them; every other event counts as delivered and the shard moves on. '
    'Returns how many events were kept back. Example: SELECT outbox.settle(''hook'', 3, 17, '
    '''[{"id": "0190...", "error": "HTTP 503", "retry_after": 30}]'');';

-- outbox.settle_and_claim's body: what it returns, the page's rows aside (see outbox.claim).
CREATE OR REPLACE FUNCTION outbox_internal._settle_and_claim_body(
    consumer   text,
    shard      int,
    epoch      bigint,
    failures   jsonb,
    batch_size int,
    lease      interval,
    owner      text
) RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
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
-- Made natively, as outbox.claim is.
CREATE OR REPLACE FUNCTION outbox.settle_and_claim(
    consumer   text,
    shard      int,
    epoch      bigint,
    failures   jsonb    DEFAULT '[]',
    batch_size int      DEFAULT 100,
    lease      interval DEFAULT '30 seconds',
    owner      text     DEFAULT NULL
) RETURNS SETOF outbox.claimed
    LANGUAGE c VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS 'MODULE_PATHNAME', 'outbox_settle_and_claim';
COMMENT ON FUNCTION outbox.settle_and_claim(text, int, bigint, jsonb, int, interval, text) IS
    'settle, then claim, in one call and one transaction: a relay''s loop in one round trip. '
    'Example: SELECT * FROM outbox.settle_and_claim(''hook'', 3, 17, ''[]'', 100);';

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
COMMENT ON FUNCTION outbox.ack(text, int, bigint) IS
    'settle with no failures: every event not nacked or rejected counts as delivered and the '
    'shard moves on. Example: SELECT outbox.ack(''billing-webhook'', 3, 17);';

CREATE OR REPLACE FUNCTION outbox.nack(consumer text, shard int, epoch bigint, event_id uuid, error text,
                            retry_after interval DEFAULT NULL) RETURNS void
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
    RETURN outbox_internal._fail(consumer, shard, epoch, event_id, error, retry_after, false);
COMMENT ON FUNCTION outbox.nack(text, int, bigint, uuid, text, interval) IS
    'One failure of settle, reported on its own: the event''s key is parked (the shard goes on '
    'without it) and retried with backoff, or after retry_after; call ack (or settle) afterwards '
    'for the rest of the batch. '
    'Example: SELECT outbox.nack(''billing-webhook'', 3, 17, ''0190...''::uuid, ''HTTP 500'');';

CREATE OR REPLACE FUNCTION outbox.reject(consumer text, shard int, epoch bigint, event_id uuid, error text)
RETURNS void
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
    RETURN outbox_internal._fail(consumer, shard, epoch, event_id, error, NULL, true);
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
    c   outbox.consumers := outbox_internal._consumer(consumer);
    cur outbox._cursor_log;
BEGIN
    PERFORM outbox_internal._not_null(retry_after IS NULL, 'retry_after', 'outbox.release');
    PERFORM outbox_internal._check_interval(retry_after, 'retry_after', '30 days', true);
    cur := outbox_internal._leased(c.id, shard, epoch);
    PERFORM outbox_internal._unpark_released(c, cur);
    cur.owner := NULL;
    cur.lease_until := CASE WHEN retry_after > '0' THEN now() + retry_after END;
    cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
    PERFORM outbox_internal._append(cur);
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
        PERFORM outbox_internal._unpark_released(c, cur);
        cur.owner := NULL; cur.lease_until := NULL;
        cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
        PERFORM outbox_internal._append(cur);
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
    RETURN n;
END
$$;
COMMENT ON FUNCTION outbox.replay(text, text) IS
    'Re-queues a consumer''s dead letters (all, or of one key), in the order they died, behind '
    'anything already queued for their keys; returns how many. Example: SELECT outbox.replay(''hook'');';
