-- outbox_ext 0.8.0 -> 0.9.0
--
-- Why: a claim with nothing to read (an idle relay's poll, the worker's fallback poll) locked
-- every shard, took an xid and wrote a commit record to find that out, at about 2.5 ms.
-- outbox._may_have_work asks every shard at once, read-only, and claim and settle_and_claim
-- stop there when it says no. The "no write before a claim" rule moves into _check_claim, so
-- that it holds whatever the backlog, and _claim_bound loses its argument.
--
-- A delta: what changed from 0.8.0 to 0.9.0 (ALTERs, guarded DROPs, changed functions, views
-- and comments, new grants), rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.9.0'" to load this file. \quit

DROP FUNCTION IF EXISTS outbox._claim_bound(text);

-- The bound every window a claim opens closes at: the event seq, then a fresh xid (see the
-- header), taken before the transaction writes anything (_check_claim refused a transaction
-- that had). Once a second it is also recorded as a mark (outbox._marks).
CREATE OR REPLACE FUNCTION outbox._claim_bound(OUT seq bigint, OUT x xid8)
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
CREATE OR REPLACE FUNCTION outbox._check_claim(batch_size int, lease interval, func text) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION '% must come before any write in its transaction', func
            USING ERRCODE = 'active_sql_transaction',
                  HINT = 'Call it in a transaction of its own (autocommit is fine).';
    END IF;
    PERFORM outbox._not_null(batch_size IS NULL, 'batch_size', func);
    PERFORM outbox._not_null(lease IS NULL, 'lease', func);
    PERFORM outbox._check_interval(lease, 'lease', '1 day', false);
    IF batch_size < 1 OR batch_size > 100000 THEN
        RAISE EXCEPTION 'batch_size % is out of range', batch_size
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass 1 to 100000.';
    END IF;
END
$$;

-- Whether a claim could find anything for the consumer: a shard with parked keys, a window
-- open, a restored cursor, or an event above its floor — what _free_cursor asks of each shard,
-- asked of all of them in one read-only statement, without locking a shard or taking an xid.
-- False means every shard's _free_cursor would find nothing to read, so a claim with nothing to
-- do (an idle relay's poll) stops here and writes nothing: no row lock, no mark, no commit
-- record. True may still find nothing (a lease, a lock, events not yet committed).
CREATE OR REPLACE FUNCTION outbox._may_have_work(consumer_id int) RETURNS boolean
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN EXISTS (
        SELECT FROM generate_series(0, outbox.shard_count() - 1) AS s(shard)
         CROSS JOIN LATERAL (SELECT l FROM outbox._cursor_log l
                              WHERE l.consumer_id = _may_have_work.consumer_id AND l.shard = s.shard
                              ORDER BY l.pos DESC LIMIT 1) AS cur
         WHERE (cur.l).hi_snap IS NOT NULL OR (cur.l).restored_seq IS NOT NULL
            OR EXISTS (SELECT FROM outbox._parked p
                        WHERE p.consumer_id = _may_have_work.consumer_id AND p.shard = s.shard)
            OR EXISTS (SELECT FROM outbox.events e
                        WHERE e.shard = s.shard AND e.seq > outbox._pending_floor(cur.l)));
END
$$;

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
    IF NOT outbox._may_have_work(c.id) THEN
        RETURN;  -- nothing to read: no bound taken, nothing written
    END IF;
    b := outbox._claim_bound();
    RETURN QUERY SELECT * FROM outbox._claim(c, batch_size, lease,
                                             coalesce(owner, 'backend ' || pg_backend_pid()), b.seq, b.x);
END
$$;

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
        b := outbox._claim_bound();  -- before settling writes anything
    END IF;
    PERFORM outbox._settle(c, outbox._leased(c.id, shard, epoch), list);
    IF NOT rebased AND outbox._may_have_work(c.id) THEN
        RETURN QUERY SELECT * FROM outbox._claim(c, batch_size, lease,
                                                 coalesce(owner, 'backend ' || pg_backend_pid()), b.seq, b.x);
    END IF;
END
$$;

-- nothing new is PUBLIC
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox, inbox FROM PUBLIC;
