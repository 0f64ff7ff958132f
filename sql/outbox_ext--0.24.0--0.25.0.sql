-- outbox_ext 0.24.0 -> 0.25.0
--
-- Why: a claim of a sparse stream (a few events at a time, the background worker's usual case)
-- tried every shard in turn, locking each and probing it for events, where most had none: about
-- half of each claim. _shards_with_work now lists the shards a claim may find something in,
-- with one probe of the event log for all of them, and the claim tries only those, and none
-- under a live lease (in a backlog, where a shard picked at random is free with a window open,
-- it still tries every shard); a poll whose only work is leased takes no xid and writes
-- nothing. A claim of a shard with parked keys that found nothing to hand out did not record
-- the empty window it read (_claim did; _record_empty now does it for both), so while a key
-- waited out its backoff every poll claimed that shard again, taking an xid. _may_have_work,
-- which answered only yes or no, is gone. _top is inlined into its callers (declared STRICT, it
-- was run as a SQL function, parsed and planned at every call). And outbox.claim and
-- outbox.settle_and_claim take `shards` (default 1): one call hands out the batches of up to
-- that many shards, each with its own epoch, for the cost of one claim and a page per shard;
-- the worker claims as many as it has free delivery slots. The two functions are dropped and
-- made again with the new argument (their grants made again too).
--
-- A delta: what changed from 0.24.0 to 0.25.0, rerunnable.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.25.0'" to load this file. \quit

DROP FUNCTION IF EXISTS outbox.claim(text, int, interval, text);
DROP FUNCTION IF EXISTS outbox.settle_and_claim(text, int, bigint, jsonb, int, interval, text);
DROP FUNCTION IF EXISTS outbox_internal._claim_body(text, int, interval, text);
DROP FUNCTION IF EXISTS outbox_internal._settle_and_claim_body(text, int, bigint, jsonb, int, interval, text);
DROP FUNCTION IF EXISTS outbox_internal._claim(outbox.consumers, int, interval, text, bigint, xid8);
DROP FUNCTION IF EXISTS outbox_internal._check_claim(int, interval, text);
DROP FUNCTION IF EXISTS outbox_internal._may_have_work(int);

CREATE OR REPLACE FUNCTION outbox_internal._top(snap pg_snapshot, x xid8) RETURNS xid8
    LANGUAGE sql IMMUTABLE PARALLEL SAFE  -- not STRICT, so that callers inline it (greatest is not)
    RETURN greatest(pg_catalog.pg_snapshot_xmax(snap), (x::text::bigint + 1)::text::xid8);


CREATE OR REPLACE FUNCTION outbox_internal._shards_with_new_events(shards int[], floors bigint[],
                                                                  since timestamptz, until timestamptz)
RETURNS int[]
    LANGUAGE c STABLE STRICT AS 'MODULE_PATHNAME', 'outbox_shards_with_new_events';


CREATE OR REPLACE FUNCTION outbox_internal._check_claim(batch_size int, lease interval, shards int, func text)
RETURNS void
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
    PERFORM outbox_internal._not_null(shards IS NULL, 'shards', func);
    IF batch_size < 1 OR batch_size > 100000 THEN
        RAISE EXCEPTION 'batch_size % is out of range', batch_size
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass 1 to 100000.';
    END IF;
    IF shards < 1 THEN
        RAISE EXCEPTION 'shards % is out of range', shards
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass 1 or more: the most shards whose batches one call hands out.';
    END IF;
END
$$;


CREATE OR REPLACE FUNCTION outbox_internal._shards_with_work(consumer_id int) RETURNS int[]
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    one    outbox._cursor_log := outbox_internal._cursor(consumer_id, floor(random() * outbox.shard_count())::int);
    newest outbox._seals;
    listed int[];    -- shards with a window open, restored, or behind a seal
    leased int[];    -- shards under a live lease (or a release's wait)
    shards int[];    -- every shard, in order
    floors bigint[]; -- and its floor
    due    int[] := '{}';
BEGIN
    IF (one.hi_snap IS NOT NULL OR one.restored_seq IS NOT NULL) AND coalesce(one.lease_until <= now(), true) THEN
        RETURN NULL;
    END IF;
    newest := outbox_internal._newest_seal();
    -- each shard's newest cursor row read once, into plain arrays (an array of cursor rows,
    -- read again for each question, cost as much as the reads)
    SELECT array_agg(s.shard ORDER BY s.shard)
               FILTER (WHERE (cur.l).hi_snap IS NOT NULL OR (cur.l).restored_seq IS NOT NULL
                          OR outbox_internal._behind_a_seal(cur.l, newest)),
           array_agg(s.shard ORDER BY s.shard) FILTER (WHERE (cur.l).lease_until > now()),
           array_agg(s.shard ORDER BY s.shard),
           array_agg(outbox_internal._pending_floor(cur.l) ORDER BY s.shard)
      INTO listed, leased, shards, floors
      FROM generate_series(0, outbox.shard_count() - 1) AS s(shard)
     CROSS JOIN LATERAL (SELECT l FROM outbox._cursor_log l
                          WHERE l.consumer_id = _shards_with_work.consumer_id AND l.shard = s.shard
                          ORDER BY l.pos DESC LIMIT 1) AS cur(l);
    -- a parked key counts once it is due: one waiting for its backoff gives a claim nothing
    -- to do (its new events, if any, are found with the shard's); each shard probed once, only
    -- when some key is due
    IF EXISTS (SELECT FROM outbox._parked p
                WHERE p.consumer_id = _shards_with_work.consumer_id AND p.next_attempt_at <= now()) THEN
        due := ARRAY(SELECT s FROM unnest(shards) AS s
                      WHERE EXISTS (SELECT FROM outbox._parked p
                                     WHERE p.consumer_id = _shards_with_work.consumer_id AND p.shard = s
                                       AND p.next_attempt_at <= now()));
    END IF;
    -- one since for every shard (the lowest floor's): partitions pruned before they are opened
    RETURN ARRAY(SELECT DISTINCT s
                   FROM unnest(coalesce(listed, '{}') || due
                               || outbox_internal._shards_with_new_events(
                                      shards, floors,
                                      outbox_internal._since((SELECT min(f) FROM unnest(floors) AS f), newest),
                                      outbox_internal._reach())) AS s
                  WHERE s <> ALL (coalesce(leased, '{}'))
                  ORDER BY s);
END
$$;


CREATE OR REPLACE FUNCTION outbox_internal._record_empty(cur outbox._cursor_log, stale boolean, newest outbox._seals)
RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    next outbox._cursor_log := outbox_internal._advance(cur, NULL, true);
BEGIN
    IF outbox_internal._pending_floor(next) > outbox_internal._pending_floor(cur) OR stale
       OR outbox_internal._behind_a_seal(cur, newest) THEN
        PERFORM outbox_internal._append(next);
    END IF;
END
$$;


CREATE OR REPLACE FUNCTION outbox_internal._claim(c outbox.consumers, batch_size int, lease interval,
                                         owner text, seq_mark bigint, x xid8, shards int[], batches int)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    tried  int[] := coalesce(shards, ARRAY(SELECT generate_series(0, outbox.shard_count() - 1)));
    n      int := cardinality(tried);
    start  int := floor(random() * n)::int;
    newest outbox._seals := outbox_internal._newest_seal();  -- read once: see _since
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
            since := outbox_internal._window_since(cur, newest);
            until := outbox_internal._reach();  -- read after the window's snapshot: see _reach
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


CREATE OR REPLACE FUNCTION outbox_internal._claim_parked(c outbox.consumers, cur outbox._cursor_log,
                                                batch_size int, lease interval, owner text,
                                                seq_mark bigint, x xid8)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    stale     boolean := cur.hi_snap IS NOT NULL;  -- as in _claim
    fresh     boolean;
    page      outbox.events[];
    queued    outbox.events[];  -- the page's events of parked keys
    mine      outbox.events[];  -- and the others
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
        -- each event's key looked up once, through _parked's key (a join planned from
        -- statistics taken while nothing was parked compared every event with every parked key)
        SELECT coalesce(array_agg(k.e ORDER BY (k.e).seq) FILTER (WHERE k.parked), '{}'),
               coalesce(array_agg(k.e ORDER BY (k.e).seq) FILTER (WHERE NOT k.parked), '{}')
          INTO queued, mine
          FROM (SELECT e, EXISTS (SELECT FROM outbox._parked p
                                   WHERE p.consumer_id = c.id AND p.aggregate_id = e.aggregate_id) AS parked
                  FROM unnest(page) e) k;
        PERFORM outbox_internal._queue_parked(c.id, queued);
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
        PERFORM outbox_internal._record_empty(cur, stale, outbox_internal._newest_seal());
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


CREATE OR REPLACE FUNCTION outbox_internal._claim_body(
    consumer   text,
    batch_size int,
    lease      interval,
    owner      text,
    shards     int
) RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    rebased boolean := outbox_internal._rebase_if_restored();  -- first: it may write
    c       outbox.consumers := outbox_internal._consumer(consumer);
    working int[];
    b       record;
BEGIN
    IF rebased THEN
        RETURN;  -- this transaction rebased a restored database (it wrote): claim in the next
    END IF;
    PERFORM outbox_internal._check_claim(batch_size, lease, shards, 'outbox.claim');
    working := outbox_internal._shards_with_work(c.id);
    IF cardinality(working) = 0 THEN
        RETURN;  -- nothing to read: no bound taken, nothing written
    END IF;
    b := outbox_internal._claim_bound();
    RETURN QUERY SELECT * FROM outbox_internal._claim(c, batch_size, lease,
                                             coalesce(owner, 'backend ' || pg_backend_pid()), b.seq, b.x,
                                             working, shards);
END
$$;


CREATE OR REPLACE FUNCTION outbox.claim(
    consumer   text,
    batch_size int      DEFAULT 100,
    lease      interval DEFAULT '30 seconds',
    owner      text     DEFAULT NULL,
    shards     int      DEFAULT 1
) RETURNS SETOF outbox.claimed
    LANGUAGE c VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS 'MODULE_PATHNAME', 'outbox_claim';


CREATE OR REPLACE FUNCTION outbox_internal._settle_and_claim_body(
    consumer   text,
    shard      int,
    epoch      bigint,
    failures   jsonb,
    batch_size int,
    lease      interval,
    owner      text,
    shards     int
) RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    rebased boolean := outbox_internal._rebase_if_restored();  -- first: it may write
    c       outbox.consumers := outbox_internal._consumer(consumer);
    list    outbox_internal._failure[];
    working int[];
    b       record;
BEGIN
    PERFORM outbox_internal._not_null(failures IS NULL, 'failures', 'outbox.settle_and_claim');
    list := outbox_internal._failures(failures);
    PERFORM outbox_internal._check_claim(batch_size, lease, shards, 'outbox.settle_and_claim');
    IF NOT rebased THEN
        b := outbox_internal._claim_bound();  -- before settling writes anything
    END IF;
    PERFORM outbox_internal._settle(c, outbox_internal._leased(c.id, shard, epoch), list);
    IF NOT rebased THEN
        working := outbox_internal._shards_with_work(c.id);
        IF working IS NULL OR cardinality(working) > 0 THEN
            RETURN QUERY SELECT * FROM outbox_internal._claim(c, batch_size, lease,
                                                     coalesce(owner, 'backend ' || pg_backend_pid()),
                                                     b.seq, b.x, working, shards);
        END IF;
    END IF;
END
$$;


CREATE OR REPLACE FUNCTION outbox.settle_and_claim(
    consumer   text,
    shard      int,
    epoch      bigint,
    failures   jsonb    DEFAULT '[]',
    batch_size int      DEFAULT 100,
    lease      interval DEFAULT '30 seconds',
    owner      text     DEFAULT NULL,
    shards     int      DEFAULT 1
) RETURNS SETOF outbox.claimed
    LANGUAGE c VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS 'MODULE_PATHNAME', 'outbox_settle_and_claim';

COMMENT ON FUNCTION outbox.claim(text, int, interval, text, int) IS
    'Takes a free shard (at most shards of them) under a lease and returns its next events in '
    'commit order (at most batch_size, plus at most batch_size events of its parked keys due '
    'for retry), each shard a batch with its own epoch; nothing when no shard has work. '
    'Example: SELECT * FROM outbox.claim(''billing-webhook'', 100, ''30 seconds'');';

COMMENT ON FUNCTION outbox.settle_and_claim(text, int, bigint, jsonb, int, interval, text, int) IS
    'settle, then claim, in one call and one transaction: a relay''s loop in one round trip. '
    'Example: SELECT * FROM outbox.settle_and_claim(''hook'', 3, 17, ''[]'', 100);';

REVOKE ALL ON FUNCTION outbox_internal._shards_with_new_events(int[], bigint[], timestamptz, timestamptz),
                       outbox_internal._check_claim(int, interval, int, text),
                       outbox_internal._shards_with_work(int),
                       outbox_internal._record_empty(outbox._cursor_log, boolean, outbox._seals),
                       outbox_internal._claim(outbox.consumers, int, interval, text, bigint, xid8, int[], int),
                       outbox_internal._claim_body(text, int, interval, text, int),
                       outbox_internal._settle_and_claim_body(text, int, bigint, jsonb, int, interval, text, int),
                       outbox.claim(text, int, interval, text, int),
                       outbox.settle_and_claim(text, int, bigint, jsonb, int, interval, text, int)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim(text, int, interval, text, int),
                          outbox.settle_and_claim(text, int, bigint, jsonb, int, interval, text, int)
    TO outbox_relay;
