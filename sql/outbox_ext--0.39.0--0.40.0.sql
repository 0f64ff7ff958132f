-- outbox_ext 0.39.0 -> 0.40.0
--
-- Why: maintain() could drop a partition past retention whose events a consumer being made
-- (from the beginning, or with a transaction under way that wrote there) was to read: its
-- cursor is invisible until it commits. A run now waits for consumers being made (a second at
-- most) and holds new ones off until it commits; a session with track_activities off keeps
-- every partition past retention, as it keeps seals.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.40.0'" to load this file. \quit

-- (a consumer being made keeps its partitions; so does a session with track_activities off)
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
    IF EXISTS (SELECT FROM pg_stat_activity a WHERE a.state = 'disabled') THEN
        RETURN 'a session with track_activities off may have a transaction open since before the partition ends';
    END IF;
    IF EXISTS (SELECT FROM pg_locks l WHERE l.relation = part AND l.pid IS DISTINCT FROM pg_backend_pid()) THEN
        RETURN 'an open or prepared transaction has written to it';
    END IF;
    LOCK TABLE outbox.consumers IN SHARE MODE;
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
