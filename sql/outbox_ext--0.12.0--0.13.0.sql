-- outbox_ext 0.12.0 -> 0.13.0
--
-- Why: a claim sorted its page a second time. _claim reads the page once into a CTE (in seq
-- order, from _window) and then handed it out with ORDER BY seq, which before PostgreSQL 17
-- sorted a copy of every row again: about 7% of a claim of 1,000 events. The CTE scan
-- returns the rows in the order the CTE made them; the ORDER BY is gone.
--
-- A delta: what changed from 0.12.0 to 0.13.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.13.0'" to load this file. \quit

-- Claim one free shard's next batch (shards tried from a random one on): its events in commit
-- order, read and handed out in one statement that also writes the claim row; or, when the
-- shard has parked keys, through _claim_parked. Nothing when no shard has work.
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
             WHERE (SELECT count(*) FROM written) >= 0;  -- once, before the first row: the claim row is written
            -- No ORDER BY: a CTE scan returns the rows in the order the CTE made them, here
            -- _window's seq order (PostgreSQL 17 on plans on that; before 17, ORDER BY p.seq
            -- sorted the page again, a copy of every row: 7% of a claim of 1,000).
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
