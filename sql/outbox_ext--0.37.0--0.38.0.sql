-- outbox_ext 0.37.0 -> 0.38.0
--
-- Why: an event made behind a seal of the event log was never delivered. A clock stepped back
-- by more than a minute lets a transaction begin before a seal's upper bound and take its seq
-- after the seal was made; its event lands in a partition whose time is over. Claims trusted
-- the seal again once the clock was past it, and when that happened before maintain() had
-- noticed the clock going back, they skipped that partition for good: outbox.status showed
-- nothing pending. Now the trigger outbox_seal, on where events land only from such a clock
-- (the partitions whose time is over, and the default one), records a seal break in the
-- event's own transaction; no seal above a break is trusted, and a claim reads the seals after
-- its window's snapshot, so that one that sees the event sees its break. maintain() drops the
-- broken seals, turns the trigger on before it seals (the seals made before 0.38.0 are dropped
-- here: the next run makes them again) and off where emits write. A consumer made again under
-- a dropped one's name took the same epochs from 0, so a relay of the dropped one, back late,
-- could settle the new one's batch of a shard as its own (its events taken for delivered while
-- the new relay was still sending them): each consumer's epochs now begin at (id - 1) * 2^32.
-- A lease ran from the claim's transaction's start, so a relay polling in one transaction took
-- a lease run out already and another relay the same batch: it runs from the call now. A dead
-- letter replayed while its batch was out, then the batch given back, left its key parked with
-- nothing queued, where it took a due key's place in claims, which then handed out nothing and
-- moved the shard past the rest of its window: such a key is unparked (the page brings its
-- event again), and a claim that moved past a page records no empty window. A session with
-- session_replication_role = replica skipped the rebase of a restored dump before its emit.
-- maintain() waited without a timeout for the default partition when it attached a partition
-- made ahead: a reader holding it (a pg_dump over midnight) held maintain() up, and every claim
-- queued behind its request; it waits a second at most now, and the next run goes on. In a
-- session whose DateStyle prints zone abbreviations, partition bounds were read back in
-- another zone ('CST' of Asia/Shanghai as US Central): they are printed in ISO form now.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.38.0'" to load this file. \quit

-- (sql/cursors.sql)
CREATE TABLE IF NOT EXISTS outbox._seal_breaks (
    at timestamptz NOT NULL
);
REVOKE ALL ON outbox._seal_breaks FROM PUBLIC;
GRANT SELECT ON outbox._seal_breaks TO outbox_admin;

-- (sql/cursors.sql)
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

-- (sql/cursors.sql: its comment)
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

-- (sql/partitions.sql)
CREATE OR REPLACE FUNCTION outbox_internal._break_seals() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF EXISTS (SELECT FROM outbox._seals s WHERE s.upper > NEW.created_at)
       AND NOT EXISTS (SELECT FROM outbox._seal_breaks b WHERE b.at <= NEW.created_at) THEN
        INSERT INTO outbox._seal_breaks (at) VALUES (NEW.created_at);
    END IF;
    RETURN NEW;
END
$$;

-- (sql/partitions.sql)
CREATE OR REPLACE FUNCTION outbox_internal._arm_seals(parts outbox.partitions[], before timestamptz)
RETURNS timestamptz
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    p           record;
    unarmed     timestamptz;
    old_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    FOR p IN SELECT x.partition, x.lower, x.is_default OR x.upper <= before AS over
               FROM unnest(parts) x JOIN pg_trigger t ON t.tgrelid = x.partition AND t.tgname = 'outbox_seal'
              WHERE x.parent = 'outbox.events'::regclass
                AND ((x.is_default OR x.upper <= before) AND t.tgenabled <> 'A'
                     OR NOT x.is_default AND x.upper > now() AND t.tgenabled <> 'D')
              ORDER BY x.lower NULLS FIRST LOOP
        BEGIN
            EXECUTE format('ALTER TABLE %s %s TRIGGER outbox_seal', p.partition,
                           CASE WHEN p.over THEN 'ENABLE ALWAYS' ELSE 'DISABLE' END);
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            IF p.over THEN
                unarmed := least(unarmed, coalesce(p.lower, '-infinity'));
            END IF;
        END;
    END LOOP;
    IF EXISTS (SELECT FROM pg_trigger t WHERE t.tgrelid = 'outbox.events'::regclass
                  AND t.tgname = 'outbox_seal' AND t.tgenabled <> 'D') THEN
        BEGIN
            ALTER TABLE ONLY outbox.events DISABLE TRIGGER outbox_seal;
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;  -- next run: a partition made meanwhile is turned off by it
        END;
    END IF;
    PERFORM set_config('lock_timeout', old_timeout, true);
    RETURN unarmed;
END
$$;

-- (sql/partitions.sql)
CREATE OR REPLACE FUNCTION outbox_internal._seal(parts outbox.partitions[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    before  timestamptz := least(now(), (SELECT min(a.xact_start) FROM pg_stat_activity a)) - interval '1 minute';
    bound   timestamptz;
    unarmed timestamptz;
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
    -- the breaks it sees, and the seals above them, in one snapshot (a break committed later
    -- lies above every seal made now)
    WITH gone AS (DELETE FROM outbox._seal_breaks b RETURNING b.at)
    DELETE FROM outbox._seals s WHERE s.upper > (SELECT min(g.at) FROM gone g);
    unarmed := outbox_internal._arm_seals(parts, before);
    IF unarmed IS NOT NULL THEN  -- an emit writes behind it: its trigger is off, so no seal above
        DELETE FROM outbox._seals s WHERE s.upper > unarmed;
    END IF;
    SELECT max(x.upper) INTO bound FROM unnest(parts) x
     WHERE x.parent = 'outbox.events'::regclass AND NOT x.is_default AND x.upper <= before
       AND x.upper <= coalesce(unarmed, 'infinity');
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

-- (sql/claim.sql)
CREATE OR REPLACE FUNCTION outbox_internal._claim(c outbox.consumers, batch_size int, lease interval,
                                         owner text, seq_mark bigint, x xid8, shards int[], batches int)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    tried  int[] := coalesce(shards, ARRAY(SELECT generate_series(0, outbox.shard_count() - 1)));
    n      int := cardinality(tried);
    start  int := CASE WHEN shards IS NULL THEN floor(random() * n)::int ELSE 0 END;
    newest outbox._seals := outbox_internal._newest_seal();  -- for the probes: see _since
    until  timestamptz := outbox_internal._reach();  -- for the probes; a window reads it again
    free   record;
    cur    outbox._cursor_log;
    fresh  boolean;
    stale  boolean;
    since  timestamptz;
    got    bigint;
    taken  int := 0;
BEGIN
    FOR i IN 0 .. n - 1 LOOP
        free := outbox_internal._free_cursor(c.id, tried[(start + i) % n + 1], newest, until);
        CONTINUE WHEN free.cur IS NULL;
        got := 0;
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
            -- both read after the window's snapshot: an event it sees committed has broken
            -- the seals it lies behind (_break_seals), or recorded its reach (_reach)
            since := outbox_internal._window_since(cur, outbox_internal._newest_seal());
            until := outbox_internal._reach();
            got := outbox_internal._claim_page(cur, batch_size, owner, lease, since, until);
            EXIT WHEN got > 0;
            IF fresh THEN
                PERFORM outbox_internal._record_empty(cur, stale, newest);
                EXIT;
            END IF;
            cur := outbox_internal._next_window(cur);
        END LOOP; END IF;
        IF got > 0 THEN
            taken := taken + 1;
            EXIT WHEN taken >= batches;
        END IF;
    END LOOP;
END
$$;

-- (sql/claim.sql: a comment)
CREATE OR REPLACE FUNCTION outbox_internal._claim_parked(c outbox.consumers, cur outbox._cursor_log,
                                                batch_size int, lease interval, owner text,
                                                seq_mark bigint, x xid8)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    stale     boolean := cur.hi_snap IS NOT NULL;  -- as in _claim
    keys      jsonb := (SELECT CASE WHEN count(*) <= batch_size  -- see below
                                     THEN coalesce(jsonb_object_agg(t.k, true), '{}') END
                          FROM (SELECT p.aggregate_id FROM outbox._parked p
                                 WHERE p.consumer_id = c.id AND p.shard = cur.shard
                                 LIMIT batch_size + 1) AS t(k));
    fresh     boolean;
    page      outbox.events[];
    queued    outbox.events[];  -- the page's events of parked keys
    mine      outbox.events[];  -- and the others (riding keys' among them)
    heads     outbox.claimed[] := outbox_internal._due_heads(c, cur.shard, batch_size);
    riding    jsonb := outbox_internal._riding(c, heads);
    exhausted boolean;
    all_due     boolean;  -- a page of parked keys' events only: are all their keys due,
    catching_up boolean;  -- and all catching up?
    held        boolean := false;  -- such a page left to read once their queues are out
    share       int;  -- of batch_size, each key catching up gets (as _due_heads gives it)
    since     timestamptz;
    until     timestamptz;
BEGIN
    LOOP
        fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
        IF cur.hi_snap IS NULL THEN
            cur := outbox_internal._open_window(cur, seq_mark, x);
        END IF;
        since := outbox_internal._window_since(cur, outbox_internal._newest_seal());
        until := outbox_internal._reach();  -- both after the window's snapshot: see _claim
        page := ARRAY(SELECT w FROM outbox_internal._window_events(cur, NULL, batch_size, since, until) AS w);
        exhausted := cardinality(page) < batch_size;
        -- each event's key looked up among the shard's parked keys, read once into keys (a
        -- JSON object: its keys are sorted, ? searches them) when they are no more than a
        -- page's events; else through _parked's key, once per event (a join planned from
        -- statistics taken while nothing was parked compared every event with every parked
        -- key). A lookup in _parked per event was half of a drain with 5% of its events
        -- failing (#38): every failure leaves versions of _parked that such lookups walk.
        SELECT coalesce(array_agg(k.e ORDER BY (k.e).seq) FILTER (WHERE k.parked), '{}'),
               coalesce(array_agg(k.e ORDER BY (k.e).seq) FILTER (WHERE NOT k.parked), '{}')
          INTO queued, mine
          FROM (SELECT e, CASE WHEN keys IS NULL
                               THEN EXISTS (SELECT FROM outbox._parked p
                                             WHERE p.consumer_id = c.id AND p.aggregate_id = e.aggregate_id)
                               ELSE keys ? e.aggregate_id END AND NOT riding ? e.aggregate_id AS parked
                  FROM unnest(page) e
                OFFSET 0) k;  -- parked worked out once per event, not once per FILTER
        IF cardinality(mine) = 0 AND cardinality(page) > 0 THEN
            -- only parked keys' events here: are all their keys due, at their first retry or
            -- catching up; and are all catching up (due, their last head through) with a queue
            -- that two claims' shares empty (so that keys behind the page wait two claims at
            -- most), none of the page's events queued already (by a claim given back)?
            share := greatest(1, batch_size / greatest(1, (
                         SELECT count(*) FROM (SELECT FROM outbox._parked p
                                                WHERE p.shard = cur.shard AND p.consumer_id = c.id
                                                  AND p.next_attempt_at <= now() LIMIT batch_size) d)));
            SELECT bool_and(p.next_attempt_at <= now() AND (p.attempts = 1 OR p.head_through)),
                   bool_and(p.next_attempt_at <= now() AND p.head_through
                            AND (SELECT count(*) FROM (SELECT FROM outbox._parked_events q
                                                        WHERE q.aggregate_id = p.aggregate_id AND q.consumer_id = c.id
                                                        LIMIT 2 * share + 1) n) BETWEEN 1 AND 2 * share
                            AND NOT EXISTS (SELECT FROM outbox._parked_events q
                                             WHERE q.id = k.first_id AND q.consumer_id = c.id))
              INTO all_due, catching_up
              FROM (SELECT DISTINCT ON (q.aggregate_id) q.aggregate_id, q.id AS first_id
                      FROM unnest(queued) q ORDER BY q.aggregate_id, q.seq) k
             CROSS JOIN LATERAL (SELECT p.* FROM outbox._parked p
                                  WHERE p.aggregate_id = k.aggregate_id AND p.consumer_id = c.id) p;
            IF catching_up THEN
                -- the page waits until their queues, handed out below, are empty and they flow
                -- with the shard again: not copied into the queues and out again (#38: a hot key)
                page := '{}';
                exhausted := false;  -- the window is not read to its end: the page is still to read
                held := true;
                EXIT;
            END IF;
        END IF;
        PERFORM outbox_internal._queue_parked(c.id, queued);
        EXIT WHEN cardinality(mine) > 0;
        IF cardinality(page) > 0 THEN
            -- record that the shard moved past the page; go on to the next, unless its keys
            -- are all due at their first retry or catching up: their heads make this batch,
            -- and the shard moves past a page of them per claim, not all their events at once,
            -- so that a key failing once keeps its backlog in the log (a key failing again, or
            -- refused unjudged, is moved past at once; and not when the page ended the window,
            -- which the batch's claim row must be in)
            cur := outbox_internal._advance(cur, page[cardinality(page)].seq, exhausted);
            PERFORM outbox_internal._append(cur);
            EXIT WHEN all_due AND NOT exhausted;
        ELSIF fresh THEN
            EXIT;  -- nothing new since the last window
        ELSE
            cur := outbox_internal._next_window(cur);
        END IF;
    END LOOP;
    IF cardinality(mine) = 0 AND cardinality(heads) = 0 THEN
        -- only a window found empty is recorded so: a page held is still to read, and one the
        -- shard moved past is recorded already, with the rest of its window still to read
        IF NOT held AND cardinality(page) = 0 THEN
            PERFORM outbox_internal._record_empty(cur, stale, outbox_internal._newest_seal());
        END IF;
        RETURN;
    END IF;
    cur := outbox_internal._claimed(cur, owner, lease,
                           CASE WHEN cardinality(page) > 0 THEN page[cardinality(page)].seq ELSE cur.after_seq END,
                           exhausted, ARRAY(SELECT h.id FROM unnest(heads) h));
    PERFORM outbox_internal._append(cur);
    RETURN QUERY  -- heads first: a riding key's events of the page come after its queue
    SELECT h.shard, cur.epoch, h.id, h.topic, h.aggregate_type, h.aggregate_id, h.event_type,
           h.payload, h.headers, h.created_at, h.seq, h.attempt
      FROM unnest(heads) AS h;
    RETURN QUERY
    SELECT cur.shard, cur.epoch, m.id, m.topic, m.aggregate_type, m.aggregate_id, m.event_type,
           m.payload, m.headers, m.created_at, m.seq, 1
      FROM unnest(mine) AS m ORDER BY m.seq;
END
$$;

CREATE OR REPLACE TRIGGER outbox_seal BEFORE INSERT ON outbox.events
    FOR EACH ROW EXECUTE FUNCTION outbox_internal._break_seals();
ALTER TABLE ONLY outbox.events DISABLE TRIGGER outbox_seal;
ALTER TABLE outbox.events_default ENABLE ALWAYS TRIGGER outbox_seal;
-- off on the partitions made before (maintain() turns it on where their time is over), and
-- no seal above a partition where it is off
DO $seal$
DECLARE
    p regclass;
BEGIN
    FOR p IN SELECT r.partition FROM outbox_internal.partition_ranges r
              WHERE r.parent = 'outbox.events'::regclass AND NOT r.is_default LOOP
        EXECUTE format('ALTER TABLE %s DISABLE TRIGGER outbox_seal', p);
    END LOOP;
END
$seal$;
DELETE FROM outbox._seals;

REVOKE ALL ON FUNCTION outbox_internal._break_seals() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._arm_seals(outbox.partitions[], timestamptz) FROM PUBLIC;

-- (sql/consumers.sql)
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
    -- transaction ids (sql/restore.sql). Epochs from (id - 1) * 2^32 on: a consumer made again
    -- under a dropped one's name does not take the same epochs, so a relay of the dropped one,
    -- back late, cannot settle its batches (the first consumer's still begin at 0).
    INSERT INTO outbox._cursor_log (consumer_id, shard, epoch, lo_snap, lo_seq, lo_top, lo_txids,
                                    lo_floors, restored_seq, restored_top)
    SELECT c_id, s, (c_id - 1)::bigint << 32, b.snap, b.seq, b.top, b.txids,
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

-- (sql/claim.sql)
CREATE OR REPLACE FUNCTION outbox_internal._claimed(cur outbox._cursor_log, owner text, lease interval,
                                           batch_end bigint, exhausted boolean, heads uuid[])
RETURNS outbox._cursor_log
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    cur.epoch := cur.epoch + 1;
    cur.owner := owner;
    -- from the call, not the transaction's start: a relay that polls in one transaction (a
    -- driver out of autocommit) would take a lease run out already, and another relay the batch
    cur.lease_until := statement_timestamp() + lease;
    cur.batch_end := batch_end;
    cur.exhausted := exhausted;
    cur.heads := heads;
    RETURN cur;
END
$$;

-- (sql/claim.sql)
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
    cur.lease_until := CASE WHEN retry_after > '0' THEN statement_timestamp() + retry_after END;
    cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
    PERFORM outbox_internal._append(cur);
END
$$;

-- (sql/parking.sql)
CREATE OR REPLACE FUNCTION outbox_internal._unpark_released(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    page    outbox.events[];  -- the batch's page: what its claim may have copied into queues
    ids     uuid[];           -- and their ids
    emptied text[];           -- keys whose queues lost events of the page
BEGIN
    IF NOT EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = c.id AND p.shard = cur.shard)
       AND NOT EXISTS (SELECT FROM outbox.dead_letters d WHERE d.consumer = c.name) THEN
        RETURN;  -- nothing to undo (the common case: the page is not read again)
    END IF;
    page := outbox_internal._batch(cur);
    ids := ARRAY(SELECT e.id FROM unnest(page) e);
    UPDATE outbox._parked p
       SET attempts = 0, next_attempt_at = now(), nacked_epoch = NULL, nacked_pos = NULL
     WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch
       AND EXISTS (SELECT FROM outbox._parked_events q
                    WHERE q.aggregate_id = p.aggregate_id AND q.consumer_id = c.id
                      AND q.pos = p.nacked_pos AND q.id = ANY (ids)
                   OFFSET 0);  -- a lookup by the key's queue position, not a semi-join
    WITH unparked AS (
        DELETE FROM outbox._parked p
         WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch
           AND NOT EXISTS (SELECT FROM outbox._parked_events q
                            WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                              AND (q.id = ANY (cur.heads) OR q.id <> ALL (ids)))
        RETURNING p.aggregate_id)
    DELETE FROM outbox._parked_events q
     USING unparked u
     WHERE q.consumer_id = c.id AND q.aggregate_id = u.aggregate_id;
    WITH gone AS (DELETE FROM outbox._parked_events q
                   WHERE q.consumer_id = c.id AND q.id = ANY (ids) RETURNING q.aggregate_id)
    SELECT array_agg(DISTINCT g.aggregate_id) INTO emptied FROM gone g;
    -- a key whose whole queue was of the page (a replay queued its dead letter while the batch
    -- was out) flows with the page again: parked with nothing queued, it would take a due
    -- head's place in claims and hand out nothing
    PERFORM outbox_internal._unpark_emptied(c.id, coalesce(emptied, '{}'));
    DELETE FROM outbox.dead_letters d
     USING unnest(page) e
     WHERE d.consumer = c.name AND d.aggregate_id = e.aggregate_id AND d.event_id = e.id;
END
$$;

-- (sql/restore.sql)
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
    -- a session with session_replication_role = replica emits too (and takes seqs)
    ALTER TABLE outbox.events ENABLE ALWAYS TRIGGER rebase_before_emit;
    RETURN NULL;
END
$$;

-- a restored dump waiting for its rebase: its trigger fires in replica mode too
DO $rebase$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_trigger t WHERE t.tgname = 'rebase_before_emit'
                  AND t.tgrelid = 'outbox.events'::regclass) THEN
        ALTER TABLE outbox.events ENABLE ALWAYS TRIGGER rebase_before_emit;
    END IF;
END
$rebase$;

-- (sql/partitions.sql)
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
    SELECT n.nspname, c.relname INTO nsp, rel
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = parent;
    part := outbox_internal._partition_name(rel, lo_at);
    SELECT p.partition INTO dflt FROM outbox_internal.partition_ranges p
     WHERE p.parent = _create_partition.parent AND p.is_default;
    -- Every lock waited for at most a second; the next run tries again. The ATTACH takes the
    -- default partition in ACCESS EXCLUSIVE mode: waiting on a reader that holds it for long (a
    -- pg_dump over midnight, a session idle in a transaction), its queued request would block
    -- every claim, which reads the default partition, and the worker's loop with this run.
    PERFORM set_config('lock_timeout', '1s', true);
    BEGIN
        IF lo_at <= clock_timestamp() + interval '1 minute' THEN
            -- A range writers may be writing to now: hold them off until the partition is
            -- attached. A row routed to the default partition just before the ATTACH would
            -- fail on the default's narrowed constraint, which PostgreSQL checks after waiting
            -- for its lock (an emit racing the first maintain() after CREATE EXTENSION).
            EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', parent);
        END IF;
        -- Standalone first, then the default partition's rows of the range, then attach: a
        -- default partition holding rows of the range would make a plain CREATE ... PARTITION
        -- OF fail.
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
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', old_timeout, true);
        RETURN NULL;  -- all of it undone: the moved rows are back in the default partition
    END;
    PERFORM set_config('lock_timeout', old_timeout, true);
    PERFORM outbox_internal._revoke_all(format('%I.%I', nsp, part)::regclass);
    RETURN format('%I.%I', nsp, part)::regclass;
END
$$;

-- (sql/partitions.sql)
CREATE OR REPLACE FUNCTION outbox_internal._bound(parent regclass, at timestamptz) RETURNS text
    LANGUAGE sql STABLE
    RETURN CASE WHEN parent = 'inbox.messages'::regclass THEN inbox.uuid_at(at)::text
                ELSE to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US') || '+00' END;

-- A partition's bound clause, printed in ISO form (see _bound).
CREATE OR REPLACE FUNCTION outbox_internal._bound_clause(bound pg_node_tree, rel oid) RETURNS text
    LANGUAGE sql STABLE SET datestyle = 'ISO, YMD'
    RETURN pg_get_expr(bound, rel);

-- Every partition of the two tables with its time range (NULLs for a default partition).
CREATE OR REPLACE VIEW outbox_internal.partition_ranges AS
SELECT i.inhparent::regclass AS parent,
       c.oid::regclass AS partition,
       CASE WHEN i.inhparent = 'inbox.messages'::regclass THEN inbox.uuid_time(b[1]::uuid) ELSE b[1]::timestamptz END AS lower,
       CASE WHEN i.inhparent = 'inbox.messages'::regclass THEN inbox.uuid_time(b[2]::uuid) ELSE b[2]::timestamptz END AS upper,
       b IS NULL AS is_default
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
  CROSS JOIN LATERAL outbox_internal._bound_clause(c.relpartbound, c.oid) AS e
  -- FOR VALUES FROM ('lower') TO ('upper'): the quoted values, cut out without a regexp
  CROSS JOIN LATERAL (SELECT CASE WHEN e LIKE 'FOR VALUES FROM (''%'') TO (''%'')'
                                  THEN ARRAY[split_part(e, '''', 2), split_part(e, '''', 4)] END) AS x(b)
 WHERE i.inhparent IN ('outbox.events'::regclass, 'inbox.messages'::regclass);
REVOKE ALL ON FUNCTION outbox_internal._bound_clause(pg_node_tree, oid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_internal._bound_clause(pg_node_tree, oid) TO outbox_admin;
