-- outbox_ext 0.17.0 -> 0.18.0
--
-- Why: a claim's page, the bulk of a claim of 1,000, read its events through _window, whose
-- late part wrapped the page in one more ordered merge and limit even when the cursor had no
-- late range. _window's commit-order part becomes _window_in_order, which _window calls; a
-- page of a cursor with no late range reads only that, with the cursor's fields as parameters
-- of their own (src/claim/pruned.rs): about 20% less per page read. _claim_page names the library's function for this SQL
-- (outbox_claim_page_0_18): 0.17.0's SQL, which has no _window_in_order, keeps reading every
-- page through _window until ALTER EXTENSION UPDATE.
-- _may_have_work reads the reach only where it needs it, not on its way out with a window open.
--
-- A delta: what changed from 0.17.0 to 0.18.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.18.0'" to load this file. \quit

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

CREATE OR REPLACE FUNCTION outbox_internal._claim_page(cur outbox._cursor_log, lim int, owner text, lease interval,
                                                      since timestamptz, until timestamptz)
RETURNS bigint
    LANGUAGE c VOLATILE STRICT AS 'MODULE_PATHNAME', 'outbox_claim_page_0_18';

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

REVOKE ALL ON FUNCTION outbox_internal._window_in_order(int, bigint, bigint, int, xid8, pg_snapshot, timestamptz, timestamptz) FROM PUBLIC;
