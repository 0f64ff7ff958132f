-- outbox_ext 0.32.0 -> 0.33.0
--
-- Why: two checks that an event is delivered before it is dropped read with a snapshot taken
-- too early, and could drop an event committed just before the drop.
-- - The drop guard read what was undelivered before DROP EXTENSION locked the events table: an
--   emit in progress when the statement came committed unseen, and went with the table.
--   _undelivered, having found nothing, now locks outbox.events and reads again.
-- - maintain() read a partition's events with its caller's snapshot, taken before it looked
--   for transactions that may still write there: one that ended in between was neither seen
--   open nor its events read. _partition_pending is now VOLATILE, so that read takes a
--   snapshot of its own, after.
-- Both hold only at READ COMMITTED: maintain() and a statement that drops outbox_ext now
-- refuse REPEATABLE READ and SERIALIZABLE with 25000 (_check_read_committed, whose detail now
-- says what it says for all its callers).

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.33.0'" to load this file. \quit

-- Refuses a transaction at REPEATABLE READ or SERIALIZABLE (25000): what locks a shard (or a
-- consumer's shards, or what emits write to) must then read what others committed before it
-- got the lock, which a snapshot taken before the lock does not show. A claim would hand out a
-- batch another relay holds, under the same epoch, and two relays would deliver the same key
-- at once; maintain() and the drop guard would take an event committed since for delivered,
-- and drop it.
CREATE OR REPLACE FUNCTION outbox_internal._check_read_committed(what text) RETURNS void
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF pg_catalog.current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        RAISE EXCEPTION '% must run at READ COMMITTED, not %', what,
                pg_catalog.upper(pg_catalog.current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state',
                  DETAIL = 'It locks what others write and then reads what they committed, which '
                           'a snapshot taken before the lock does not show.',
                  HINT = 'Call it in a READ COMMITTED transaction (the default isolation level), '
                         'e.g. after SET default_transaction_isolation = ''read committed''.';
    END IF;
END
$$;

-- Why an event partition past its retention must stay, or NULL when it may go. Rows of open
-- transactions are invisible, so first: no open transaction started before the partition's
-- upper bound (emit's created_at is the transaction's start, so it may still write there),
-- and no transaction, prepared ones included, holds a lock on it (it has written there).
-- Then no consumer may have an event of it pending (outbox_internal._pending, sql/cursors.sql).
-- VOLATILE, so that this last read takes its snapshot after the first two: a STABLE function
-- reads with its caller's, taken before them, which does not show the events of a transaction
-- that ended in between (and that the first two then no longer show either).
CREATE OR REPLACE FUNCTION outbox_internal._partition_pending(part regclass, upper timestamptz) RETURNS text
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
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
                                          AND e.seq > outbox_internal._pending_floor(cur.l)
                                          AND outbox_internal._pending(cur.l, e.txid, e.seq)))', part)
        INTO pending;
    RETURN CASE WHEN pending THEN 'a consumer has not read all its events' END;
END
$$;

-- The driver: each phase a function of its own, so that a change to one is one CREATE OR
-- REPLACE in an upgrade script. A run drops, detaches, moves rows into or creates at most
-- per_run partitions in all (oldest past retention first, nearest to now ahead; the partitions
-- of now and the next width are made whatever is left): its locks stay bounded whatever the
-- settings ask (ahead = 100000, a retention cut from a year to a day, rows of thousands of days
-- in a default partition), where all at once would fail every run (out of shared memory). The
-- rest waits for the next run, which the worker starts at once.
CREATE OR REPLACE FUNCTION outbox.maintain()
RETURNS TABLE (action text, relation text, detail text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    per_run CONSTANT int := 100;
    budget  int := per_run;
    -- the partitions, read once (reading outbox.partitions deparses every partition's bounds:
    -- about 0.1 ms each), read again only after a phase changed them
    parts   outbox.partitions[] := outbox_internal._partition_list();
    cfg     outbox.partition_config;
    step    outbox_internal._maint_step;
    skipped text;
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN;  -- a replica follows its primary's maintenance
    END IF;
    -- a partition's events are read before it is dropped: at READ COMMITTED, with a snapshot
    -- taken after the transactions that may write there are known to have ended
    PERFORM outbox_internal._check_read_committed('outbox.maintain()');
    skipped := outbox_internal._maint_lock();
    IF skipped IS NOT NULL THEN
        RETURN QUERY SELECT 'skipped', NULL::text, skipped;
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM outbox_internal._maint_rebase();
    step := outbox_internal._maint_retire(parts, budget);
    RETURN QUERY SELECT * FROM unnest(step.rows);
    budget := budget - step.used;
    FOR cfg IN SELECT * FROM outbox.partition_config LOOP
        IF step.changed THEN
            parts := outbox_internal._partition_list();
        END IF;
        step := outbox_internal._maint_move_default(cfg, parts, budget);
        RETURN QUERY SELECT * FROM unnest(step.rows);
        budget := budget - step.used;
        IF step.changed THEN
            parts := outbox_internal._partition_list();
        END IF;
        step := outbox_internal._maint_create_ahead(cfg, parts, budget);
        RETURN QUERY SELECT * FROM unnest(step.rows);
        budget := budget - step.used;
    END LOOP;
    IF step.changed THEN
        parts := outbox_internal._partition_list();
    END IF;
    PERFORM outbox_internal._maint_seal(parts);
    RETURN QUERY SELECT * FROM outbox_internal._maint_trim();
END
$$;
COMMENT ON FUNCTION outbox.maintain() IS
    'Creates partitions ahead, drops (or detaches) those past retention once every consumer has '
    'read them, moves rows out of default partitions, seals the past and records how far ahead '
    'events may lie (claims then skip the partitions they need not read), trims cursor history; '
    'returns what it did. '
    'Safe to run concurrently (one runs, the other skips) and from pg_cron: '
    'SELECT cron.schedule(''outbox-maintain'', ''* * * * *'', ''SELECT * FROM outbox.maintain()'');';

-- What would be lost, per consumer, or NULL when nothing would. Found nothing, it reads again
-- with the events table locked, as the drop would lock it: an emit in progress when the
-- statement came would otherwise commit unseen before the drop got its lock, and go with the
-- table. So at READ COMMITTED only (_check_read_committed), where each statement reads what is
-- committed when it starts. (Not locked first: a drop refused anyway would wait behind every
-- reader of the table, a dump say, and queue every emit and claim behind it meanwhile.)
CREATE OR REPLACE FUNCTION outbox_internal._undelivered() RETURNS text
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    lost text;
BEGIN
    FOR pass IN 1 .. 2 LOOP
        SELECT string_agg(format('%s: %s pending, %s parked keys, %s dead letters',
                                 s.consumer, s.pending, s.parked_keys, s.dead_letters), '; '
                          ORDER BY s.consumer)
          INTO lost
          FROM outbox.status s
         WHERE s.pending > 0 OR s.parked_keys > 0 OR s.dead_letters > 0;
        EXIT WHEN lost IS NOT NULL OR pass = 2;
        PERFORM outbox_internal._check_read_committed('a statement that drops outbox_ext');
        LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE;
    END LOOP;
    RETURN lost;
END
$$;
