-- outbox_ext 0.14.0 -> 0.15.0
--
-- Why: maintain() did everything the settings asked in one transaction. An `ahead` of
-- thousands, a retention cut far back, or rows of thousands of days in a default partition made
-- every run take more locks than the server has (out of shared memory): no partition was made
-- or dropped again. Now a run does at most 100 partitions in all (the partitions of now and
-- the next width always), nearest to now first, and says "deferred"; the next run goes on
-- (the worker runs it again at once). A retention that is negative in some months (it passes
-- the CHECK) no longer drops the partition of now.
-- And maintain() took its one-run-at-a-time lock with NOWAIT: statements any role may try
-- take that lock for an instant before they are refused (CREATE STATISTICS), so a role
-- repeating one made runs skip. It now waits up to 100 ms.
--
-- A delta: what changed from 0.14.0 to 0.15.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.15.0'" to load this file. \quit

CREATE OR REPLACE FUNCTION outbox.maintain()
RETURNS TABLE (action text, relation text, detail text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg     outbox.partition_config;
    p       outbox.partitions;
    -- the partitions, read once (reading outbox.partitions deparses every partition's bounds:
    -- about 0.1 ms each), read again only after this run changed them
    parts   outbox.partitions[] := outbox_internal._partition_list();
    changed boolean := false;
    created regclass;
    lo_at   timestamptz;
    n       bigint;
    why     text;
    part    text;
    old_timeout text;
    rebased boolean;
    -- A run drops, detaches, moves rows into or creates at most per_run partitions in all
    -- (oldest past retention first, nearest to now ahead; the partitions of now and the next
    -- width are made whatever is left), and looks at most at twice that many past retention (a
    -- kept one is locked too): its locks stay bounded whatever the settings ask (ahead =
    -- 100000, a retention cut from a year to a day, rows of thousands of days in a default
    -- partition), where all at once would fail every run (out of shared memory). The rest
    -- waits for the next run, which the worker starts at once.
    per_run CONSTANT int := 100;
    budget  int := per_run;
    looks   int := 2 * per_run;
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN;  -- a replica follows its primary's maintenance
    END IF;
    -- One run at a time, under a lock that no other role can hold (any role can hold an
    -- advisory lock, or a weaker table lock: a statement it may PREPARE takes one). Waited for
    -- briefly, not NOWAIT: a statement any role may try takes this lock for an instant before
    -- the check that refuses it (CREATE STATISTICS, COMMENT ON), and repeated, it would make
    -- every run that came in that instant skip. Another run holds it far longer.
    old_timeout := current_setting('lock_timeout');
    BEGIN
        PERFORM set_config('lock_timeout', '100ms', true);
        LOCK TABLE outbox.partition_config IN SHARE UPDATE EXCLUSIVE MODE;
        PERFORM set_config('lock_timeout', old_timeout, true);
    EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
        RETURN QUERY SELECT 'skipped', NULL::text, 'another outbox.maintain() is running';
        RETURN;
    END;
    IF outbox_internal._restore_running() THEN  -- its partitions would collide with the dump's
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
    rebased := outbox_internal._rebase_if_restored();
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
        -- (never one that ends after now, whatever the retention: an interval such as
        -- '-1 mon +30 days' passes its CHECK and is still a day ahead in some months)
        FOR p IN SELECT * FROM unnest(parts) x
                  WHERE x.parent = cfg.parent AND NOT x.is_default
                    AND x.upper <= least(now() - cfg.retention, now())
                  ORDER BY x.lower LOOP
            IF budget = 0 OR looks = 0 THEN
                RETURN QUERY SELECT 'deferred', cfg.parent::text,
                    'more partitions past retention than one run takes: the next run goes on';
                EXIT;
            END IF;
            looks := looks - 1;
            part := p.partition::text;  -- named while it exists
            BEGIN
                IF cfg.parent = 'outbox.events'::regclass THEN
                    why := outbox_internal._partition_pending(p.partition, p.upper);
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
                changed := true;
                budget := budget - 1;
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
        IF changed THEN
            parts := outbox_internal._partition_list();
            changed := false;
        END IF;
        -- 2. rows that landed in the default partition: report them, move them into partitions
        FOR lo_at IN EXECUTE format(
                'SELECT DISTINCT outbox_internal._floor_time(%s, %L) FROM %s %s ORDER BY 1 LIMIT %s',
                outbox_internal._key_time(cfg.parent), cfg.width,
                (SELECT d.partition FROM unnest(parts) d WHERE d.parent = cfg.parent AND d.is_default),
                CASE WHEN cfg.parent = 'inbox.messages'::regclass
                     THEN outbox_internal._inbox_ids_to_move(cfg) ELSE '' END,
                budget + 1)
        LOOP
            IF budget = 0 THEN
                RETURN QUERY SELECT 'deferred', cfg.parent::text,
                    'rows of more partitions in the default partition than one run takes: the next run goes on';
                EXIT;
            END IF;
            budget := budget - 1;
            created := outbox_internal._create_partition(cfg.parent, lo_at, cfg.width);
            IF created IS NOT NULL THEN
                changed := true;
                RAISE WARNING 'outbox.maintain: rows of % were in its default partition; moved them to %',
                    cfg.parent, created;
                RETURN QUERY SELECT 'moved', created::text, 'rows from the default partition';
            END IF;
        END LOOP;
        -- 3. partitions ahead: the ranges no partition covers yet, found in one pass over the
        --    partitions (each _create_partition call reads them all again)
        IF changed THEN
            parts := outbox_internal._partition_list();
        END IF;
        FOR lo_at IN
            WITH existing AS (  -- what the partitions cover, as one value (not a scan per range)
                     SELECT coalesce(range_agg(tstzrange(x.lower, x.upper)), '{}') AS covered
                       FROM unnest(parts) x
                      WHERE x.parent = cfg.parent AND NOT x.is_default
                        AND x.upper > outbox_internal._floor_time(now(), cfg.width))
            SELECT g FROM existing,
                          generate_series(outbox_internal._floor_time(now(), cfg.width),
                                          outbox_internal._floor_time(now(), cfg.width) + cfg.width * cfg.ahead,
                                          cfg.width) AS g
             WHERE NOT existing.covered @> tstzrange(g, g + cfg.width)
             ORDER BY g LIMIT budget + 3
        LOOP
            IF budget = 0 AND lo_at > outbox_internal._floor_time(now(), cfg.width) + cfg.width THEN
                RETURN QUERY SELECT 'deferred', cfg.parent::text,
                    'more partitions to create than one run takes: the next run goes on';
                EXIT;
            END IF;
            budget := greatest(budget - 1, 0);
            created := outbox_internal._create_partition(cfg.parent, lo_at, cfg.width);
            IF created IS NOT NULL THEN
                changed := true;
                RETURN QUERY SELECT 'created', created::text, NULL::text;
            END IF;
        END LOOP;
    END LOOP;
    -- 4. seal the past and record how far ahead events may be: claims then skip the partitions
    --    they have read past and those ahead of now
    IF changed THEN  -- the loop above made partitions
        parts := outbox_internal._partition_list();
    END IF;
    PERFORM outbox_internal._seal(parts);
    PERFORM outbox_internal._advance_reach(parts);
    DELETE FROM inbox.messages_default m
     WHERE m.received_at < now() - (SELECT c.retention FROM outbox.partition_config c
                                     WHERE c.parent = 'inbox.messages'::regclass);
    -- 5. cursor history (a minute of it is kept, for a look at what happened) and marks
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
