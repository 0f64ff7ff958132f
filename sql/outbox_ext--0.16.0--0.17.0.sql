-- outbox_ext 0.16.0 -> 0.17.0
--
-- Why: a claim's events were copied once more in every PL/pgSQL function they were returned
-- through (RETURN QUERY in _claim, then in outbox.claim or outbox.settle_and_claim): a
-- quarter of a claim of 1,000. outbox.claim and outbox.settle_and_claim are now native
-- (src/claim/result.rs): their bodies move, unchanged, to _claim_body and
-- _settle_and_claim_body, and _claim_page writes a page's rows straight into the result of the
-- claim in progress and returns how many it handed out. _window reads cur.hi_snap once per
-- read, not once per row.
--
-- A delta: what changed from 0.16.0 to 0.17.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.17.0'" to load this file. \quit

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
            AND pg_catalog.pg_visible_in_snapshot(e.txid, (SELECT cur.hi_snap))  -- once, not per row
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

-- its result type changes: from SETOF outbox.claimed to bigint
DROP FUNCTION IF EXISTS outbox_internal._claim_page(outbox._cursor_log, int, text, interval, timestamptz, timestamptz);

CREATE OR REPLACE FUNCTION outbox_internal._claim_page(cur outbox._cursor_log, lim int, owner text, lease interval,
                                                      since timestamptz, until timestamptz)
RETURNS bigint
    LANGUAGE c VOLATILE STRICT AS 'MODULE_PATHNAME', 'outbox_claim_page';


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


CREATE OR REPLACE FUNCTION outbox.claim(
    consumer   text,
    batch_size int      DEFAULT 100,
    lease      interval DEFAULT '30 seconds',
    owner      text     DEFAULT NULL
) RETURNS SETOF outbox.claimed
    LANGUAGE c VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS 'MODULE_PATHNAME', 'outbox_claim';

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

-- Granted to no role, as every internal function (sql/grants.sql).
REVOKE ALL ON FUNCTION outbox_internal._claim_page(outbox._cursor_log, int, text, interval, timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._claim_body(text, int, interval, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._settle_and_claim_body(text, int, bigint, jsonb, int, interval, text) FROM PUBLIC;
