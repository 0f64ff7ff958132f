-- outbox_ext 0.1.0 -> 0.2.0
--
-- Why: 0.2.0 adds the inbox (inbox.claim: dedup for idempotent consumers) and partition
-- maintenance (outbox.maintain, outbox.partition_config, outbox.partitions), which replaces
-- outbox._ensure_partitions, and the outbox.status and outbox.shard_status views. Claims skip
-- work they did for nothing (two planner settings set on every page, a DELETE on every ack).
-- Events, consumers, cursors, parked keys and dead letters are not touched: pending events
-- stay pending, in order.
--
-- A delta: what changed from 0.1.0 to 0.2.0 (ALTERs, guarded DROPs, changed functions, views
-- and comments, new grants), rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.2.0'" to load this file. \quit

DROP FUNCTION IF EXISTS outbox._ensure_partitions(regclass, interval, int);
DROP FUNCTION IF EXISTS outbox._partition_name(text, timestamptz);  -- a parameter was renamed

-- outbox_ext: emit. Writes events in the caller's transaction: they exist if and only if it
-- commits. Validation and ids come from outbox._event_id (Rust); a bad row raises and the
-- statement writes nothing. Rerunnable.

COMMENT ON FUNCTION outbox.uuid_v7() IS
    'A new time-ordered UUID (version 7), as emit gives events. Example: SELECT outbox.uuid_v7();';

CREATE OR REPLACE FUNCTION outbox.emit(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL,
    topic          text  DEFAULT NULL
) RETURNS uuid
    LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    new_id uuid := outbox._event_id(aggregate_type, aggregate_id, event_type,
                                    pg_column_size(payload), headers, topic);
    -- The xid first, then the seq (the column default, evaluated by the INSERT): see events.seq.
    tx xid8 := pg_current_xact_id();
BEGIN
    INSERT INTO outbox.events
        (id, topic, aggregate_type, aggregate_id, event_type, payload, headers, txid, shard)
    VALUES
        (new_id, topic, aggregate_type, aggregate_id, event_type, payload, headers, tx,
         outbox.shard_of(aggregate_id));
    RETURN new_id;
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
    ids := outbox._batch_ids(aggregate_type, event_type, headers, topic, aggregate_ids,
                             (SELECT max(pg_column_size(p)) FROM unnest(payloads) AS p));
    INSERT INTO outbox.events
        (id, topic, aggregate_type, aggregate_id, event_type, payload, headers, txid, shard)
    SELECT u.id, emit_many.topic, emit_many.aggregate_type, u.key, emit_many.event_type,
           u.payload, emit_many.headers, tx, outbox.shard_of(u.key)
    FROM unnest(ids, aggregate_ids, payloads) AS u(id, key, payload);
    RETURN QUERY SELECT unnest(ids);
END
$$;
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
-- Rerunnable: tables and indexes only where missing, functions
-- replaced. A changed table needs its own ALTER in the upgrade script.

CREATE TABLE IF NOT EXISTS outbox.consumers (
    id           int         GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name         text        NOT NULL UNIQUE,
    max_attempts int         NOT NULL DEFAULT 10 CHECK (max_attempts >= 1),
    backoff_base interval    NOT NULL DEFAULT '1 second' CHECK (backoff_base > '0'),
    backoff_max  interval    NOT NULL DEFAULT '10 minutes' CHECK (backoff_max > '0'),
    created_at   timestamptz NOT NULL DEFAULT now()
);

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
    at          timestamptz NOT NULL DEFAULT now()
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

---------------------------------------------------------------------------------------------
-- Internals
---------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION outbox._consumer(name text) RETURNS outbox.consumers
    LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp
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
    LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
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
    LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp
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
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
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
    LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
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
    LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
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
CREATE OR REPLACE FUNCTION outbox._open_window(cur outbox._cursor_log, seq_mark bigint, x xid8)
RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
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
        SELECT min(e.seq), max(e.seq) INTO cur.late_from, cur.late_to
          FROM outbox.events e
         WHERE e.shard = cur.shard AND e.seq > late.floor_seq AND e.seq <= seq_end
           AND e.txid = ANY (late.txids);
    END IF;
    cur.after_seq := NULL;
    RETURN cur;
END
$$;

-- The position after delivering through batch_end: the same window further on, or, when the
-- window is exhausted, no window yet after its upper bound.
CREATE OR REPLACE FUNCTION outbox._advance(cur outbox._cursor_log, batch_end bigint, exhausted boolean)
RETURNS outbox._cursor_log
    LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
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
    SET search_path = pg_catalog, pg_temp
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
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
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

CREATE OR REPLACE FUNCTION outbox._backoff(c outbox.consumers, attempts int) RETURNS interval
    LANGUAGE sql VOLATILE
    RETURN least(c.backoff_max, c.backoff_base * power(2, least(attempts - 1, 30)))
           * (0.5 + random() / 2);

-- The head of a parked key failed: count it, schedule the retry; past max_attempts move the
-- head to dead_letters and let the key move on.
CREATE OR REPLACE FUNCTION outbox._head_failed(c outbox.consumers, key text, error text,
                                    retry_after interval, epoch bigint) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n int;
BEGIN
    UPDATE outbox._parked p
       SET attempts = p.attempts + 1, last_error = error, nacked_epoch = epoch,
           next_attempt_at = now() + coalesce(retry_after, outbox._backoff(c, p.attempts + 1))
     WHERE p.consumer_id = c.id AND p.aggregate_id = key
    RETURNING p.attempts INTO n;
    IF n < c.max_attempts THEN
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
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
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
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
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
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
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
BEGIN
    IF cur.lease_until > now() THEN
        RETURN;  -- a batch is out under a live lease, or a release asked to wait
    END IF;
    any_parked := EXISTS (SELECT FROM outbox._parked p
                           WHERE p.consumer_id = c.id AND p.shard = _claim_shard.shard);
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
AS $$
DECLARE
    c_id   int;
    -- The first bound, taken as claims take theirs (see the header); if this transaction has
    -- written already, its xid may be older than the seq, so start the seq bound at 0.
    lo_seq bigint := CASE WHEN pg_current_xact_id_if_assigned() IS NULL
                          THEN coalesce(pg_sequence_last_value('outbox.event_seq'), 0) ELSE 0 END;
    x      xid8 := pg_current_xact_id();
    lo     pg_snapshot := pg_current_snapshot();
    lo_top xid8 := outbox._top(lo, x);
BEGIN
    IF name IS NULL OR name = '' THEN
        RAISE EXCEPTION 'consumer name must not be empty'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Name the consumer after its sink.';
    END IF;
    IF max_attempts IS NULL OR max_attempts < 1 OR backoff_base IS NULL OR backoff_base <= '0'
       OR backoff_max IS NULL OR backoff_max < backoff_base THEN
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
    INSERT INTO outbox._cursor_log (consumer_id, shard, epoch, lo_snap, lo_seq, lo_top, lo_txids, lo_floors)
    SELECT c_id, s, 0, b.snap, b.seq, b.top, b.txids,
           ARRAY(SELECT CASE WHEN t = x THEN lo_seq ELSE 0 END FROM unnest(b.txids) AS t)
      FROM generate_series(0, outbox.shard_count() - 1) AS s,
           (SELECT '1:1:'::pg_snapshot AS snap, 0::bigint AS seq, '1'::xid8 AS top, '{}'::xid8[] AS txids
             WHERE from_beginning
            UNION ALL
            SELECT lo, lo_seq, lo_top, outbox._in_progress(lo, x) WHERE NOT from_beginning) AS b;
END
$$;

CREATE OR REPLACE FUNCTION outbox.drop_consumer(name text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
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
AS $$
DECLARE
    c     outbox.consumers := outbox._consumer(consumer);
    n     int := outbox.shard_count();
    start int := floor(random() * n)::int;
    s     int;
    seq_mark bigint;
    x     xid8;
BEGIN
    -- The bound of any window this claim opens: the seq, then a fresh xid (see the header).
    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION 'outbox.claim must come before any write in its transaction'
            USING ERRCODE = 'active_sql_transaction',
                  HINT = 'Call claim in a transaction of its own (autocommit is fine), and ack or '
                         'nack in the next ones.';
    END IF;
    seq_mark := coalesce(pg_sequence_last_value('outbox.event_seq'), 0);
    x := pg_current_xact_id();
    IF coalesce((SELECT m.at FROM outbox._marks m ORDER BY m.top DESC LIMIT 1), '-infinity')
       < now() - interval '1 second' THEN
        INSERT INTO outbox._marks (top, seq) VALUES (x, seq_mark) ON CONFLICT DO NOTHING;
    END IF;
    IF batch_size IS NULL OR batch_size < 1 OR batch_size > 100000 THEN
        RAISE EXCEPTION 'batch_size % is out of range', batch_size
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass 1 to 100000.';
    END IF;
    IF lease IS NULL OR lease <= '0' THEN
        RAISE EXCEPTION 'lease % is not positive', lease
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass a lease longer than a delivery takes, e.g. ''30 seconds''.';
    END IF;
    FOR i IN 0 .. n - 1 LOOP
        s := (start + i) % n;
        PERFORM FROM outbox._shards sh WHERE sh.consumer_id = c.id AND sh.shard = s
            FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;  -- another claim is taking this shard right now
        RETURN QUERY SELECT * FROM outbox._claim_shard(c, s, batch_size, lease,
                                                       coalesce(owner, 'backend ' || pg_backend_pid()),
                                                       seq_mark, x);
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION outbox.ack(consumer text, shard int, epoch bigint) RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c   outbox.consumers := outbox._consumer(consumer);
    cur outbox._cursor_log := outbox._leased(c.id, shard, epoch);
    key text;
BEGIN
    -- parked heads that went out in this batch and were not nacked: delivered
    IF cardinality(cur.heads) > 0 THEN
        FOR key IN
            DELETE FROM outbox._parked_events q
             USING outbox._parked p
             WHERE q.consumer_id = c.id AND q.id = ANY (cur.heads)
               AND p.consumer_id = q.consumer_id AND p.aggregate_id = q.aggregate_id
               AND p.nacked_epoch IS DISTINCT FROM ack.epoch
            RETURNING q.aggregate_id
        LOOP
            UPDATE outbox._parked p SET attempts = 0, next_attempt_at = now()
             WHERE p.consumer_id = c.id AND p.aggregate_id = key;
            PERFORM outbox._unpark_if_empty(c.id, key);
        END LOOP;
    END IF;
    PERFORM outbox._append(outbox._advance(cur, cur.batch_end, cur.exhausted));
END
$$;

CREATE OR REPLACE FUNCTION outbox.nack(consumer text, shard int, epoch bigint, event_id uuid, error text,
                            retry_after interval DEFAULT NULL) RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c   outbox.consumers := outbox._consumer(consumer);
    cur outbox._cursor_log := outbox._leased(c.id, shard, epoch);
    ev  outbox.events;
    key text;
BEGIN
    IF event_id = ANY (cur.heads) THEN
        SELECT q.aggregate_id INTO key FROM outbox._parked_events q
         WHERE q.consumer_id = c.id AND q.id = nack.event_id;
    ELSE
        SELECT * INTO ev FROM outbox._window(shard, cur, cur.batch_end, NULL) w WHERE w.id = event_id;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'event % is not in the batch of shard % with epoch %', event_id, shard, epoch
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Nack only events that this claim returned.';
        END IF;
        key := ev.aggregate_id;
        IF EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = c.id AND p.aggregate_id = key
                                                    AND p.nacked_epoch = nack.epoch) THEN
            RETURN;  -- the key already failed in this batch; later events of it wait anyway
        END IF;
        -- park the key: this event and the key's later events of the batch queue up, in order
        INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
        VALUES (c.id, key, shard, now());
        PERFORM outbox._queue_parked(c.id, ARRAY(
            SELECT w FROM outbox._window(shard, cur, cur.batch_end, NULL) w
             WHERE w.aggregate_id = key AND w.seq >= ev.seq));
    END IF;
    PERFORM outbox._head_failed(c, key, error, retry_after, epoch);
END
$$;

CREATE OR REPLACE FUNCTION outbox.release(consumer text, shard int, epoch bigint,
                               retry_after interval DEFAULT '0') RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c   outbox.consumers := outbox._consumer(consumer);
    cur outbox._cursor_log := outbox._leased(c.id, shard, epoch);
BEGIN
    cur.owner := NULL;
    cur.lease_until := CASE WHEN retry_after > '0' THEN now() + retry_after END;
    cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
    PERFORM outbox._append(cur);
END
$$;

CREATE OR REPLACE FUNCTION outbox.replay(consumer text, aggregate_id text DEFAULT NULL) RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
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
-- outbox_ext: the inbox — dedup for idempotent consumers.
--
-- inbox.claim(message_id, consumer) inserts (message_id, consumer) with ON CONFLICT DO NOTHING,
-- in the caller's transaction, next to the effect it guards. The table is partitioned by
-- message_id: outbox event ids are UUIDv7, whose leading 48 bits are the Unix time in ms, so
-- id ranges are time ranges, the primary key holds across partitions, and the dedup window
-- (retention) is enforced by dropping old partitions. Ids that are not UUIDv7 dedup all the
-- same in the default partition.
--
-- Rerunnable: the 0.1.0 -> 0.2.0 upgrade script includes this file.

CREATE TABLE IF NOT EXISTS inbox.messages (
    message_id  uuid        NOT NULL,
    consumer    text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (message_id, consumer)
) PARTITION BY RANGE (message_id);
COMMENT ON TABLE inbox.messages IS
    'Messages consumers have processed, for dedup; partitioned by message_id (UUIDv7 time).';

-- The smallest UUIDv7 of a moment, and the moment of a UUIDv7: partition bounds of the inbox.
CREATE OR REPLACE FUNCTION inbox.uuid_at(ts timestamptz) RETURNS uuid
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN (lpad(to_hex(floor(extract(epoch FROM ts) * 1000)::bigint), 12, '0') || '70008000000000000000')::uuid;
COMMENT ON FUNCTION inbox.uuid_at(timestamptz) IS 'The smallest UUIDv7 made at a moment.';
CREATE OR REPLACE FUNCTION inbox.uuid_time(id uuid) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN to_timestamp(('x' || lpad(left(replace(id::text, '-', ''), 12), 16, '0'))::bit(64)::bigint / 1000.0);
COMMENT ON FUNCTION inbox.uuid_time(uuid) IS 'The time a UUIDv7 was made (meaningless for other UUIDs).';

CREATE OR REPLACE FUNCTION inbox.claim(message_id uuid, consumer text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF message_id IS NULL OR consumer IS NULL OR consumer = '' THEN
        RAISE EXCEPTION 'message_id and consumer must not be NULL or empty'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the event id you received and your consumer''s name.';
    END IF;
    INSERT INTO inbox.messages (message_id, consumer) VALUES (claim.message_id, claim.consumer)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION inbox.claim(uuid, text) IS
    'True if the caller''s transaction is the first to process this message for this consumer. '
    'A racing duplicate waits for the first transaction: false if it commits, true if it rolls back. '
    'Example: IF inbox.claim(event_id, ''billing'') THEN <apply the effect> END IF;';
-- outbox_ext: partitions of the event log and the inbox, and their maintenance.
--
-- outbox.events is partitioned by created_at, inbox.messages by message_id (UUIDv7, so by
-- time too). outbox.maintain() keeps both: it creates partitions ahead, drops (or detaches)
-- those past their retention — for events only once every consumer has read past all of their
-- events — and moves rows that landed in a default partition into partitions of their own.
-- Partitions are named <parent>_pYYYYMMDD_HH24MISS after their lower bound in UTC.
--
-- Rerunnable: the 0.1.0 -> 0.2.0 upgrade script includes this file.

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
    EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                   nsp, rel, nsp, part, outbox._bound(parent, lo_at), outbox._bound(parent, hi_at));
    RETURN format('%I.%I', nsp, part)::regclass;
END
$$;

-- Why an event partition past its retention must stay, or NULL when it may go. Rows of open
-- transactions are invisible, so first: no open transaction started before the partition's
-- upper bound (emit's created_at is the transaction's start, so it may still write there),
-- and no transaction, prepared ones included, holds a lock on it (it has written there).
-- Then every consumer must have read past every event: each event's transaction is visible
-- in the lower bound of its shard's current window.
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
                          CROSS JOIN LATERAL (SELECT l.lo_snap FROM outbox._cursor_log l
                                               WHERE l.consumer_id = s.consumer_id AND l.shard = s.shard
                                               ORDER BY l.pos DESC LIMIT 1) AS cur
                         WHERE EXISTS (SELECT FROM %s e WHERE e.shard = s.shard
                                          AND NOT pg_visible_in_snapshot(e.txid, cur.lo_snap)))', part)
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
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN;  -- a replica follows its primary's maintenance
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtext('outbox.maintain')) THEN
        RETURN QUERY SELECT 'skipped', NULL::text, 'another outbox.maintain() is running';
        RETURN;
    END IF;
    FOR cfg IN SELECT * FROM outbox.partition_config LOOP
        -- 1. rows that landed in the default partition: report them, move them into partitions
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
        -- 2. partitions ahead
        lo_at := outbox._floor_time(now(), cfg.width);
        FOR i IN 0 .. cfg.ahead LOOP
            created := outbox._create_partition(cfg.parent, lo_at + cfg.width * i, cfg.width);
            IF created IS NOT NULL THEN
                RETURN QUERY SELECT 'created', created::text, NULL::text;
            END IF;
        END LOOP;
        -- 3. partitions past retention: drop or detach, never with undelivered events
        FOR p IN SELECT * FROM outbox.partitions x
                  WHERE x.parent = cfg.parent AND NOT x.is_default AND x.upper <= now() - cfg.retention
                  ORDER BY x.lower LOOP
            IF cfg.parent = 'outbox.events'::regclass THEN
                why := outbox._partition_pending(p.partition, p.upper);
                IF why IS NOT NULL THEN
                    RETURN QUERY SELECT 'kept', p.partition::text, 'past retention, but ' || why;
                    CONTINUE;
                END IF;
            END IF;
            -- Partitions made by CREATE EXTENSION belong to the extension, which would refuse
            -- to let them go (and would drop a detached one with itself): release them first.
            IF EXISTS (SELECT FROM pg_depend d
                        WHERE d.classid = 'pg_class'::regclass AND d.objid = p.partition
                          AND d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e') THEN
                EXECUTE format('ALTER EXTENSION outbox_ext DROP TABLE %s', p.partition);
            END IF;
            IF cfg.detach THEN
                EXECUTE format('ALTER TABLE %s DETACH PARTITION %s', cfg.parent, p.partition);
                RETURN QUERY SELECT 'detached', p.partition::text, NULL::text;
            ELSE
                RETURN QUERY SELECT 'dropped', p.partition::text, NULL::text;  -- named while it exists
                EXECUTE format('DROP TABLE %s', p.partition);
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

CREATE TABLE IF NOT EXISTS outbox.events_default PARTITION OF outbox.events DEFAULT;
CREATE TABLE IF NOT EXISTS inbox.messages_default PARTITION OF inbox.messages DEFAULT;
SELECT count(*) FROM outbox.maintain();
-- outbox_ext: what is left to deliver, per consumer and per shard, and why.
--
-- An event is pending for a consumer while its transaction is not visible in the lower bound
-- of its shard's current window (minus what the window has already delivered). Every such
-- event has a seq above the window's floors, which bounds the index scan.

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
 CROSS JOIN generate_series(0, outbox.shard_count() - 1) AS s(shard)
 CROSS JOIN LATERAL (SELECT * FROM outbox._cursor_log l
                      WHERE l.consumer_id = c.id AND l.shard = s.shard
                      ORDER BY l.pos DESC LIMIT 1) AS cur
 CROSS JOIN LATERAL (
        SELECT count(*) AS events, min(e.created_at) AS oldest
          FROM outbox.events e
         WHERE e.shard = cur.shard
           AND e.seq > least(cur.lo_seq, (SELECT min(f) FROM unnest(cur.lo_floors) AS f))
           AND NOT pg_visible_in_snapshot(e.txid, cur.lo_snap)
           AND NOT (cur.hi_snap IS NOT NULL AND e.seq <= coalesce(cur.after_seq, -1)
                    AND pg_visible_in_snapshot(e.txid, cur.hi_snap))) AS pend;
COMMENT ON VIEW outbox.shard_status IS
    'Per consumer and shard: pending events, the oldest one and its age, parked keys, who holds the lease.';

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
       (SELECT count(*) FROM outbox.events_default) AS events_in_default_partition
  FROM outbox.shard_status s
 GROUP BY s.consumer;
COMMENT ON VIEW outbox.status IS
    'One row per consumer: pending events and lag, parked keys and events, dead letters, the last '
    'error, leased shards, and events waiting in the default partition (outbox.maintain() moves them). '
    'Example: SELECT consumer, pending, lag, dead_letters, last_error FROM outbox.status;';
-- outbox_ext: privileges, all in one place. Runs last (finalize); rerunnable (upgrade
-- scripts include it).
--
-- Nothing is granted to PUBLIC. Producers reach the event log only through the SECURITY
-- DEFINER emit functions (which pin search_path); they cannot read events or configuration.

REVOKE ALL ON SCHEMA outbox, inbox FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;
GRANT ALL ON ALL TABLES IN SCHEMA outbox TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.maintain() TO outbox_admin;
GRANT SELECT ON outbox.status, outbox.shard_status TO outbox_relay;

REVOKE ALL ON ALL TABLES IN SCHEMA inbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA inbox FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.claim(uuid, text), inbox.uuid_time(uuid), inbox.uuid_at(timestamptz)
    TO outbox_producer, outbox_relay;
GRANT ALL ON ALL TABLES IN SCHEMA inbox TO outbox_admin;
