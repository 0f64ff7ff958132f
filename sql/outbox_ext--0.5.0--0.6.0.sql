-- outbox_ext 0.5.0 -> 0.6.0
--
-- Why: no role may reach a superuser's power through the extension.
-- - The background worker runs as a new role, outbox_worker (NOLOGIN; outbox_ext.worker_role),
--   not as the bootstrap superuser, with search_path pg_catalog, pg_temp.
-- - Grants name exactly what each role needs (never ALL: no TRIGGER, TRUNCATE or REFERENCES
--   on our tables, which let a trigger run inside the worker and the SECURITY DEFINER
--   functions as their owner); partitions, those maintain() made before included, keep no
--   grant at all, and maintain() strips the default privileges new ones would get.
-- - Sink settings are checked as the worker uses them: a secret's key length, header names
--   and values, CA certificates (outbox._check_sink_settings). Sinks saved earlier that fail
--   the check are reported with a WARNING here and left as they are.
-- - Backups: pg_dump brings back everything a running outbox holds (sql/dump.sql marks the
--   extension's tables); a restored state is recognised and rebased onto the restoring
--   cluster's transaction ids (sql/restore.sql: outbox._origin, two new cursor columns). Dated
--   partitions leave the extension (pg_dump then writes them whole), and their index (events)
--   or unique key (inbox) moves from the parent to each partition, so that a restore does not
--   make them twice: the parent's index and key are dropped and each partition's made, which
--   rebuilds them (an UPDATE of a large outbox takes that long).
-- - DROP EXTENSION outbox_ext is refused while events are undelivered (sql/drop_guard.sql).
--   Events, consumers, cursors, parked keys and dead letters are kept as they are.
--
-- A delta: what changed from 0.5.0 to 0.6.0 (ALTERs, guarded DROPs, changed functions, views
-- and comments, new grants), rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.6.0'" to load this file. \quit
CREATE SCHEMA IF NOT EXISTS inbox;

DO $roles$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['outbox_producer', 'outbox_relay', 'outbox_admin', 'outbox_worker'] LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = r) THEN
            EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', r);
        ELSIF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = r AND (rolcanlogin OR rolsuper)) THEN
            -- made by someone else, before us: whoever can log in as it holds its privileges
            RAISE WARNING 'role "%" already exists and can log in or is a superuser', r
                USING HINT = pg_catalog.format('outbox_ext expects it NOLOGIN NOSUPERUSER: ALTER ROLE %I NOLOGIN NOSUPERUSER;', r);
        END IF;
    END LOOP;
END
$roles$;

ALTER TABLE outbox._cursor_log ADD COLUMN IF NOT EXISTS restored_seq bigint,
                               ADD COLUMN IF NOT EXISTS restored_top xid8;
DROP INDEX IF EXISTS outbox.events_read_idx;                -- with the partitions' copies
ALTER TABLE inbox.messages DROP CONSTRAINT IF EXISTS messages_pkey;

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
CREATE OR REPLACE FUNCTION outbox._pending_floor(cur outbox._cursor_log) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN least(cur.lo_seq, (SELECT min(f) FROM pg_catalog.unnest(cur.lo_floors) AS f));

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
    -- restored: only the dump's events, whose txids are the dump's (sql/restore.sql)
    last_seq bigint := least(coalesce(upto, 9223372036854775807), cur.restored_seq);
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
            fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
            IF cur.hi_snap IS NULL THEN
                cur := outbox._open_window(cur, seq_mark, x);
            END IF;
            RETURN QUERY
            WITH page AS MATERIALIZED (
                     SELECT * FROM outbox._window(_claim_shard.shard, cur, NULL, batch_size)),
                 claim_row AS (
                     INSERT INTO outbox._cursor_log
                         (consumer_id, shard, epoch, owner, lease_until, lo_snap, lo_seq, lo_top,
                          lo_txids, lo_floors, hi_snap, hi_seq, hi_top, hi_txids, hi_floors,
                          late_from, late_to, after_seq, batch_end, exhausted, heads,
                          restored_seq, restored_top)
                     SELECT cur.consumer_id, cur.shard, cur.epoch + 1, _claim_shard.owner,
                            now() + lease, cur.lo_snap, cur.lo_seq, cur.lo_top, cur.lo_txids,
                            cur.lo_floors, cur.hi_snap, cur.hi_seq, cur.hi_top, cur.hi_txids,
                            cur.hi_floors, cur.late_from, cur.late_to, cur.after_seq, max(p.seq),
                            count(*) < batch_size, '{}', cur.restored_seq, cur.restored_top
                       FROM page p HAVING count(*) > 0)
            SELECT _claim_shard.shard, cur.epoch + 1, p.id, p.topic, p.aggregate_type,
                   p.aggregate_id, p.event_type, p.payload, p.headers, p.created_at, p.seq, 1
              FROM page p ORDER BY p.seq;
            GET DIAGNOSTICS n = ROW_COUNT;
            EXIT WHEN n > 0 OR fresh;  -- a batch, or nothing new since the last window
            cur := outbox._next_window(cur);
        END LOOP;
        RETURN;
    END IF;
    LOOP
        fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
        IF cur.hi_snap IS NULL THEN
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
            cur := outbox._next_window(cur);
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
AS $$
DECLARE
    rebased boolean := outbox._rebase_if_restored();  -- first: it may write
    c     outbox.consumers := outbox._consumer(consumer);
    n     int := outbox.shard_count();
    start int := floor(random() * n)::int;
    s     int;
    seq_mark bigint;
    x     xid8;
BEGIN
    -- The bound of any window this claim opens: the seq, then a fresh xid (see the header).
    IF rebased THEN
        RETURN;  -- this transaction rebased a restored database (it wrote): claim in the next
    END IF;
    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION 'outbox.claim must come before any write in its transaction'
            USING ERRCODE = 'active_sql_transaction',
                  HINT = 'Call claim in a transaction of its own (autocommit is fine), and ack or '
                         'nack in the next ones.';
    END IF;
    PERFORM outbox._not_null(batch_size IS NULL, 'batch_size', 'outbox.claim');
    PERFORM outbox._not_null(lease IS NULL, 'lease', 'outbox.claim');
    PERFORM outbox._check_interval(lease, 'lease', '1 day', false);
    IF batch_size < 1 OR batch_size > 100000 THEN
        RAISE EXCEPTION 'batch_size % is out of range', batch_size
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass 1 to 100000.';
    END IF;
    seq_mark := coalesce(pg_sequence_last_value('outbox.event_seq'), 0);
    x := pg_current_xact_id();
    IF coalesce((SELECT m.at FROM outbox._marks m ORDER BY m.top DESC LIMIT 1), '-infinity')
       < now() - interval '1 second' THEN
        INSERT INTO outbox._marks (top, seq) VALUES (x, seq_mark) ON CONFLICT DO NOTHING;
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

-- A claimed event failed (nack), or failed for good (reject, final): park its key, count the
-- failure of the key's head.
CREATE OR REPLACE FUNCTION outbox._fail(consumer text, shard int, epoch bigint, event_id uuid, error text,
                             retry_after interval, final boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    c   outbox.consumers := outbox._consumer(consumer);
    cur outbox._cursor_log;
    ev  outbox.events;
    key text;
BEGIN
    PERFORM outbox._not_null(event_id IS NULL, 'event_id', 'nack or reject');
    IF retry_after IS NOT NULL THEN
        PERFORM outbox._check_interval(retry_after, 'retry_after', '30 days', true);
    END IF;
    cur := outbox._leased(c.id, shard, epoch);
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

CREATE OR REPLACE FUNCTION outbox.release(consumer text, shard int, epoch bigint,
                               retry_after interval DEFAULT '0') RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
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

-- As pgrx declares it (src/sinks/check.rs).
CREATE OR REPLACE FUNCTION outbox."_check_sink_settings"(
	"secret" TEXT, /* Option < & str > */
	"http_headers" jsonb, /* Option < JsonB > */
	"tls_ca" TEXT /* Option < & str > */
) RETURNS void
IMMUTABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'check_sink_settings_wrapper';

CREATE OR REPLACE FUNCTION inbox.claim(message_id uuid, consumer text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF message_id IS NULL OR consumer IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', CASE WHEN message_id IS NULL THEN 'message_id' ELSE 'consumer' END
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the event id you received and your consumer''s name.';
    END IF;
    IF consumer = '' THEN
        RAISE EXCEPTION 'consumer must not be empty'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass your consumer''s name.';
    END IF;
    INSERT INTO inbox.messages (message_id, consumer) VALUES (claim.message_id, claim.consumer)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$$;

-- Every check a sink row must pass, with the fix in the hint; also stamps updated_at (the
-- worker rebuilds a sink's client when it changes). SECURITY DEFINER: it calls internal
-- helpers that admins cannot execute directly.
CREATE OR REPLACE FUNCTION outbox._check_sink() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    topic   text;
    formats text[] := CASE NEW.kind WHEN 'webhook' THEN ARRAY['batch', 'single']
                                    WHEN 'kafka_rest_v2' THEN ARRAY['json', 'binary']
                                    WHEN 'kafka_rest_v3' THEN ARRAY['json', 'binary', 'string'] END;
BEGIN
    PERFORM outbox._not_null(NEW.kind IS NULL, 'kind', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.url IS NULL, 'url', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.batch_size IS NULL, 'batch_size', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.concurrency IS NULL, 'concurrency', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.connect_timeout IS NULL, 'connect_timeout', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.request_timeout IS NULL, 'request_timeout', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.enabled IS NULL, 'enabled', 'outbox.sinks');
    IF cardinality(NEW.topics) = 0 OR cardinality(NEW.aggregate_types) = 0
       OR array_position(NEW.topics, NULL) IS NOT NULL
       OR array_position(NEW.aggregate_types, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'topics and aggregate_types must be NULL (all) or lists of names'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'An empty list or a NULL in one would match nothing: pass NULL for all.';
    END IF;
    IF formats IS NULL THEN
        RAISE EXCEPTION 'unknown sink kind "%"', NEW.kind USING ERRCODE = 'invalid_parameter_value',
            HINT = 'kind is webhook, kafka_rest_v2 or kafka_rest_v3.';
    END IF;
    NEW.format := coalesce(NEW.format, formats[1]);
    IF NOT NEW.format = ANY (formats) THEN
        RAISE EXCEPTION 'format "%" does not fit a % sink', NEW.format, NEW.kind
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = format('Use one of %s, or NULL for %s.', array_to_string(formats, ', '), formats[1]);
    END IF;
    IF NEW.url !~ '^https?://[^/?#\s]+[^\s]*$' THEN
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
    IF NOT outbox._is_string_map(NEW.http_headers) OR NOT outbox._is_string_map(NEW.topic_map) THEN
        RAISE EXCEPTION 'http_headers and topic_map must be JSON objects of strings'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'E.g. ''{"Authorization": "Bearer t0ken"}''.';
    END IF;
    IF EXISTS (SELECT FROM jsonb_each_text(NEW.topic_map) AS m(k, v)
                WHERE v !~ '^[A-Za-z0-9._-]{1,249}$' OR v IN ('.', '..')) THEN
        RAISE EXCEPTION 'topic_map renames to a name that is not a Kafka topic name'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Kafka topics are 1 to 249 of [A-Za-z0-9._-], not "." or "..".';
    END IF;
    -- the secret's key, each header, each CA certificate: as the worker will use them (Rust)
    PERFORM outbox._check_sink_settings(NEW.secret, NEW.http_headers, NEW.tls_ca);
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

-- Whether a sink delivers an event (src/sinks/mod.rs, Config::routes, applies the same rule):
-- topics match the event's topic, the one it was emitted with or else its aggregate type (the
-- topic it goes to, before topic_map renames it); aggregate_types its aggregate type.
CREATE OR REPLACE FUNCTION outbox._routes(sink outbox.sinks, topic text, aggregate_type text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN (sink.topics IS NULL OR coalesce(topic, aggregate_type) = ANY (sink.topics))
       AND (sink.aggregate_types IS NULL OR aggregate_type = ANY (sink.aggregate_types));
INSERT INTO outbox.partition_config (parent, width, ahead, retention) VALUES
    ('outbox.events', '1 day', 2, '2 days'),
    ('inbox.messages', '1 day', 2, '7 days')
ON CONFLICT (parent) DO NOTHING;

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
-- outbox_ext: restoring a dump (pg_restore, psql) — how a restored state is recognised and
-- rebased onto the transaction ids of the cluster it lands in.
--
-- A dump holds events with their txids and cursors whose windows are snapshots, all in the
-- transaction ids of the dumped cluster; the cluster it is restored into counts its own
-- (far below, far above or overlapping). What the restore makes true, and what the rebase
-- builds on:
--   - every restored event is committed (pg_dump reads only committed rows);
--   - a restored event has a seq at most the restored event_seq, every event emitted after the
--     restore a greater one (the sequence goes on from there).
-- So a cursor is rebased into two steps (see _advance and _open_window in sql/claim.sql): it
-- first finishes reading the dump's events in the dump's own ids — its windows as dumped, then
-- one last window up to restored_top, a txid above every txid of the dump, under which every
-- restored event is committed — pure comparisons between restored values; then it goes on
-- with every event of a greater seq than restored_seq, in this cluster's ids. What a consumer
-- had acknowledged is not delivered again; what it had not, is, in order; a batch that was out
-- at dump time comes again.
--
-- Recognised: outbox._origin holds one row, made by CREATE EXTENSION. A dump carries it too,
-- and restoring the dump inserts the dump's row over the one CREATE EXTENSION just made: that
-- is a restore. It marks the state pending, and makes emits (a statement trigger on
-- outbox.events) and every API call on cursors (outbox._consumer, claim, create_consumer)
-- rebase first, once, before any event of this cluster gets a seq. outbox.maintain() then
-- removes the trigger. pg_upgrade and physical copies (base backups, standbys) keep the
-- transaction ids, copy no rows through SQL and need nothing of this.
--
-- Name resolution (sql/grants.sql): the trigger functions are [pinned]; _rebase and
-- _rebase_if_restored run [inside] pinned functions.
--
-- Rerunnable.

CREATE TABLE IF NOT EXISTS outbox._origin (
    one             boolean     PRIMARY KEY DEFAULT true CHECK (one),  -- a single row
    made_in         text        NOT NULL,  -- system identifier / database oid, for a look
    made_at         timestamptz NOT NULL DEFAULT now(),
    restore_pending boolean     NOT NULL DEFAULT false,  -- restored, not rebased yet
    restored_at     timestamptz,           -- the last restore
    restored_seq    bigint,                -- the last restore's events: seq at most this,
    restored_top    xid8,                  -- txids below this (for consumers made later)
    restorer        int,                   -- the backend restoring, and since when: nothing is
    restorer_since  timestamptz            -- rebased while it runs (it has not loaded all yet)
);
COMMENT ON TABLE outbox._origin IS
    'Where this outbox state was made, and its last restore from a dump (see sql/restore.sql).';

CREATE OR REPLACE FUNCTION outbox._here() RETURNS text
    LANGUAGE sql STABLE
    RETURN (SELECT c.system_identifier FROM pg_catalog.pg_control_system() c)::text || '/'
        || (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database())::text;

-- The dump's row arriving over ours: a restore.
CREATE OR REPLACE FUNCTION outbox._restored() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM outbox._origin) THEN
        RETURN NEW;  -- CREATE EXTENSION's own row
    END IF;
    UPDATE outbox._origin
       SET restore_pending = true, restored_at = now(), restorer = pg_backend_pid(),
           restorer_since = (SELECT a.backend_start FROM pg_stat_activity a WHERE a.pid = pg_backend_pid());
    CREATE OR REPLACE TRIGGER rebase_before_emit BEFORE INSERT ON outbox.events
        FOR EACH STATEMENT EXECUTE FUNCTION outbox._rebase_before_emit();
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER restored BEFORE INSERT ON outbox._origin
    FOR EACH ROW EXECUTE FUNCTION outbox._restored();
-- (not ON CONFLICT: the trigger, which fires first, would take a second insert for a restore)
INSERT INTO outbox._origin (made_in) SELECT outbox._here() WHERE NOT EXISTS (SELECT FROM outbox._origin);

-- Before the first event of this cluster takes a seq. (Native emit takes the plain INSERT
-- path while a table has a trigger, so this fires for every kind of emit.)
CREATE OR REPLACE FUNCTION outbox._rebase_before_emit() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._rebase_if_restored();
    RETURN NULL;
END
$$;

-- Rebases a restored state if it is one, once the restore is over. True when the state is
-- not ready for claims in this transaction: it was just rebased (the transaction has written),
-- or the restore is still running.
CREATE OR REPLACE FUNCTION outbox._rebase_if_restored() RETURNS boolean
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF NOT coalesce((SELECT o.restore_pending FROM outbox._origin o), false) THEN
        RETURN false;
    END IF;
    IF outbox._restore_running() THEN
        RETURN true;
    END IF;
    LOCK TABLE outbox._origin IN EXCLUSIVE MODE;  -- one rebase; the others wait, then see it done
    IF NOT (SELECT o.restore_pending FROM outbox._origin o) THEN
        RETURN false;
    END IF;
    PERFORM outbox._rebase();
    RETURN true;
END
$$;

-- Whether the backend that restored the dump's _origin row still runs (a restore not made in
-- one transaction goes on loading after it), or a pg_restore is connected to this database.
CREATE OR REPLACE FUNCTION outbox._restore_running() RETURNS boolean
    LANGUAGE sql STABLE
    RETURN EXISTS (SELECT FROM pg_catalog.pg_stat_activity a, outbox._origin o
                    WHERE a.pid = o.restorer AND a.backend_start = o.restorer_since
                      AND a.pid <> pg_catalog.pg_backend_pid())
        OR EXISTS (SELECT FROM pg_catalog.pg_stat_activity a
                    WHERE a.datname = pg_catalog.current_database() AND a.application_name = 'pg_restore'
                      AND a.pid <> pg_catalog.pg_backend_pid());

-- Every cursor: its batch out at dump time (lease, parked heads) comes again, and it reads the
-- dump's events in the dump's ids, then the rest (see the header). Marks go: their xids are the
-- dump's, and claims make new ones.
CREATE OR REPLACE FUNCTION outbox._rebase() RETURNS void
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
        cur := outbox._cursor(sh.consumer_id, sh.shard);
        IF cur.restored_seq IS NOT NULL THEN
            -- restored again before it read an earlier dump's events: all of them from its
            -- floor on come again (the ids of two dumps cannot be told apart)
            cur := outbox._lo_after_seq(cur, outbox._pending_floor(cur));
        END IF;
        cur.owner := NULL; cur.lease_until := NULL;
        cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
        cur.restored_seq := n; cur.restored_top := top;
        PERFORM outbox._append(cur);
    END LOOP;
    DELETE FROM outbox._marks;
    UPDATE outbox._origin
       SET restore_pending = false, restored_seq = n, restored_top = top, made_in = outbox._here();
    RAISE NOTICE 'outbox_ext: rebased the outbox restored from a dump (events up to seq %, txids below %)', n, top;
END
$$;
-- outbox_ext: what is left to deliver, per consumer and per shard, and why.
--
-- What is pending is outbox._pending's answer (sql/claim.sql), for the events above
-- outbox._pending_floor, which bounds the index scan.
--
-- Name resolution (sql/grants.sql): both views are [parsed] and run as their owner.

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
 CROSS JOIN LATERAL (
        SELECT count(*) AS events, min(e.created_at) AS oldest
          FROM outbox.events e
         WHERE e.shard = cur.shard AND e.seq > outbox._pending_floor(cur)
           AND outbox._pending(cur, e.txid, e.seq)
           AND (k.name IS NULL OR outbox._routes(k, e.topic, e.aggregate_type))) AS pend;  -- a sink's own
-- outbox_ext: DROP EXTENSION outbox_ext does not discard undelivered events silently. An event
-- trigger (native, src/backup.rs) refuses the DROP while a consumer has events pending, parked
-- keys or dead letters, unless outbox_ext.drop_undelivered is on.
--
-- Name resolution (sql/grants.sql): _undelivered is [pinned]; the trigger function is [native]
-- and runs one statement, SELECT outbox._undelivered().
--
-- Rerunnable.

-- What would be lost, per consumer, or NULL when nothing would.
CREATE OR REPLACE FUNCTION outbox._undelivered() RETURNS text
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT string_agg(format('%s: %s pending, %s parked keys, %s dead letters',
                             s.consumer, s.pending, s.parked_keys, s.dead_letters), '; '
                      ORDER BY s.consumer)
      FROM outbox.status s
     WHERE s.pending > 0 OR s.parked_keys > 0 OR s.dead_letters > 0;
END;

CREATE OR REPLACE FUNCTION outbox._guard_drop() RETURNS event_trigger
    LANGUAGE c AS 'MODULE_PATHNAME', 'outbox_guard_drop';

DO $guard$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_event_trigger WHERE evtname = 'outbox_ext_guard_drop') THEN
        CREATE EVENT TRIGGER outbox_ext_guard_drop ON ddl_command_start
            WHEN TAG IN ('DROP EXTENSION') EXECUTE FUNCTION outbox._guard_drop();
    END IF;
END
$guard$;

-- Every partition gets its own index or key; dated ones leave the extension.
DO $partitions$
DECLARE
    p record;
BEGIN
    FOR p IN SELECT i.inhparent::regclass AS parent, i.inhrelid::regclass AS part,
                    EXISTS (SELECT FROM pg_catalog.pg_depend d
                             WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                               AND d.objid = i.inhrelid AND d.deptype = 'e') AS member
               FROM pg_catalog.pg_inherits i
              WHERE i.inhparent IN ('outbox.events'::pg_catalog.regclass, 'inbox.messages'::pg_catalog.regclass)
                AND i.inhrelid NOT IN ('outbox.events_default'::pg_catalog.regclass,
                                       'inbox.messages_default'::pg_catalog.regclass) LOOP
        IF p.member THEN
            EXECUTE pg_catalog.format('ALTER EXTENSION outbox_ext DROP TABLE %s', p.part);
        END IF;
        PERFORM outbox._index_partition(p.parent, p.part);
    END LOOP;
END
$partitions$;

-- outbox_ext: what pg_dump writes. Of an extension's own tables pg_dump writes only those
-- marked here (their rows; CREATE EXTENSION makes the tables). Each line says why it is, or
-- is not, marked; sql/restore.sql says how a restored state is rebased.
--
-- Partitions: the default partitions belong to the extension and are marked; the dated ones
-- are made by outbox.maintain() (CREATE EXTENSION makes none), belong to no extension, and so
-- are dumped whole, like any table: definition, rows, index. Partitions of both kinds come
-- back attached to their parent.
--
-- Runs only in CREATE EXTENSION and ALTER EXTENSION UPDATE (pg_extension_config_dump refuses
-- anywhere else); marking a table again changes nothing.

SELECT pg_catalog.pg_extension_config_dump('outbox.events_default', '');        -- events no partition covered
SELECT pg_catalog.pg_extension_config_dump('inbox.messages_default', '');       -- inbox ids that are not UUIDv7
SELECT pg_catalog.pg_extension_config_dump('outbox.event_seq', '');             -- seqs go on after the dump's: order across a restore
SELECT pg_catalog.pg_extension_config_dump('outbox.consumers', '');             -- consumers and their retry policies
SELECT pg_catalog.pg_extension_config_dump('outbox.consumers_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._shards', '');               -- what claims lock, per consumer
SELECT pg_catalog.pg_extension_config_dump('outbox._cursor_log', '');           -- cursors and leases (rebased on restore)
SELECT pg_catalog.pg_extension_config_dump('outbox._cursor_log_pos_seq', '');   -- the newest row is the cursor: positions go on
SELECT pg_catalog.pg_extension_config_dump('outbox._parked', '');               -- parked keys, with their attempts and backoff
SELECT pg_catalog.pg_extension_config_dump('outbox._parked_events', '');        -- their queues, in order
SELECT pg_catalog.pg_extension_config_dump('outbox._parked_events_pos_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.dead_letters', '');          -- dead letters, to replay
SELECT pg_catalog.pg_extension_config_dump('outbox.dead_letters_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.sinks', '');                 -- sinks, secrets included: guard your dumps
SELECT pg_catalog.pg_extension_config_dump('outbox._sink_stats', '');           -- delivered and failed totals go on
SELECT pg_catalog.pg_extension_config_dump('outbox.partition_config', '');      -- widths and retentions (over the defaults)
SELECT pg_catalog.pg_extension_config_dump('outbox._origin', '');               -- restoring it marks a restore
-- Not marked: outbox._marks (floors for transactions in progress, in the dumped cluster's
-- transaction ids: meaningless after a restore, and claims make new ones).
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
--            functions, whose search_path they inherit. (Three pure [parsed] ones, _pending,
--            _pending_floor and _routes, are granted to outbox_relay: the status views call them.)
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
--            (src/worker/session.rs, deliver.rs, mod.rs).
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
-- what the status views ask of each event (pure functions, inlined into the views' plans;
-- functions a view calls are checked against whoever reads it)
GRANT EXECUTE ON FUNCTION outbox._pending(outbox._cursor_log, xid8, bigint),
                          outbox._pending_floor(outbox._cursor_log),
                          outbox._routes(outbox.sinks, text, text) TO outbox_relay;
GRANT EXECUTE ON FUNCTION
    outbox.claim(text, int, interval, text),
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

-- Sink rows the new checks refuse: the worker could not deliver with them, and a dump of them
-- could not be restored (the checks run on every row written). Each such sink is disabled
-- and the refused settings cleared, with a WARNING to set them anew.
DO $check$
DECLARE
    s       outbox.sinks;
    cleared text[];
BEGIN
    ALTER TABLE outbox.sinks DISABLE TRIGGER check_sink;
    FOR s IN SELECT * FROM outbox.sinks ORDER BY name LOOP
        cleared := '{}';
        BEGIN
            PERFORM outbox._check_sink_settings(s.secret, NULL, NULL);
        EXCEPTION WHEN invalid_parameter_value THEN
            s.secret := NULL; cleared := cleared || 'secret'::text;
        END;
        BEGIN
            PERFORM outbox._check_sink_settings(NULL, s.http_headers, NULL);
        EXCEPTION WHEN invalid_parameter_value THEN
            s.http_headers := NULL; cleared := cleared || 'http_headers'::text;
        END;
        BEGIN
            PERFORM outbox._check_sink_settings(NULL, NULL, s.tls_ca);
        EXCEPTION WHEN invalid_parameter_value THEN
            s.tls_ca := NULL; cleared := cleared || 'tls_ca'::text;
        END;
        IF EXISTS (SELECT FROM jsonb_each_text(s.topic_map) AS m(k, v)
                    WHERE v !~ '^[A-Za-z0-9._-]{1,249}$' OR v IN ('.', '..')) THEN
            s.topic_map := NULL; cleared := cleared || 'topic_map'::text;
        END IF;
        IF cardinality(s.topics) = 0 OR array_position(s.topics, NULL) IS NOT NULL THEN
            s.topics := NULL; cleared := cleared || 'topics'::text;
        END IF;
        IF cardinality(s.aggregate_types) = 0 OR array_position(s.aggregate_types, NULL) IS NOT NULL THEN
            s.aggregate_types := NULL; cleared := cleared || 'aggregate_types'::text;
        END IF;
        CONTINUE WHEN cardinality(cleared) = 0;
        UPDATE outbox.sinks k
           SET enabled = false, secret = s.secret, http_headers = s.http_headers, tls_ca = s.tls_ca,
               topic_map = s.topic_map, topics = s.topics, aggregate_types = s.aggregate_types,
               updated_at = now()
         WHERE k.name = s.name;
        RAISE WARNING 'sink "%" is disabled: its % did not pass the checks of 0.6.0 and were cleared',
                s.name, array_to_string(cleared, ', ')
            USING HINT = 'Set them anew and enable it: UPDATE outbox.sinks SET ..., enabled = true WHERE name = ...;';
    END LOOP;
    ALTER TABLE outbox.sinks ENABLE TRIGGER check_sink;
END
$check$;
