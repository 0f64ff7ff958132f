-- outbox_ext 0.39.0 -> 0.40.0
--
-- Why: CREATE EXTENSION applied the installing role's default privileges to the extension's
-- objects: a role granted ALL on tables by them held TRIGGER on tables the SECURITY DEFINER
-- functions write as the owner (those the objects were made with are taken back now; grants
-- made since stay). outbox_admin could write partition and retry settings that stopped
-- maintain() or failed every settle of a failure (the tables' checks bound them now).
-- maintain() could drop a partition past retention whose events a consumer being made (from
-- the beginning, or with a transaction under way that wrote there) was to read: its cursor is
-- invisible until it commits. A partition about to go is kept while one is being made, and the
-- run holds new ones off until it commits (it trims cursor rows first); a session with
-- track_activities off keeps every partition past retention, as it keeps seals. A consumer
-- made after an emit in the same transaction took that transaction for finished once a later
-- one had ended (a snapshot leaves its own transaction out): claims delivered the event, but
-- status showed nothing pending, and DROP EXTENSION or maintain() could take it. Every bound's
-- snapshot now holds its own transaction in progress. A later head of a catching-up key
-- nacked, then its batch given back, left the nack's attempt and backoff on the first head,
-- which had not failed; and a settle listing an event final after a reject and a replay of its
-- key was refused when the key had a later event in the batch. A second maintain() read the
-- partitions' bounds before its lock and waited for a first that held the default partition.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.40.0'" to load this file. \quit

-- (a consumer being made keeps its partitions; so does a session with track_activities off)
CREATE OR REPLACE FUNCTION outbox_internal._partition_pending(part regclass, upper timestamptz) RETURNS text
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pending boolean;
    pid     int;
    again   boolean;
BEGIN
    SELECT a.pid INTO pid FROM pg_stat_activity a
     WHERE a.xact_start < _partition_pending.upper ORDER BY a.xact_start LIMIT 1;
    IF FOUND THEN
        RETURN format('transaction of backend %s, open since before the partition ends, may still write to it', pid);
    END IF;
    IF EXISTS (SELECT FROM pg_stat_activity a WHERE a.state = 'disabled' AND a.pid <> pg_backend_pid()) THEN
        RETURN 'a session with track_activities off may have a transaction open since before the partition ends';
    END IF;
    IF EXISTS (SELECT FROM pg_locks l WHERE l.relation = part AND l.pid IS DISTINCT FROM pg_backend_pid()) THEN
        RETURN 'an open or prepared transaction has written to it';
    END IF;
    FOREACH again IN ARRAY ARRAY[false, true] LOOP
        IF again THEN
            LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE;
            LOCK TABLE outbox.consumers IN SHARE MODE NOWAIT;
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
        IF pending THEN
            RETURN 'a consumer has not read all its events';
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- (a bound's snapshot holds its own transaction in progress)
CREATE OR REPLACE FUNCTION outbox_internal._bound_snapshot(x xid8) RETURNS pg_snapshot
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    snap pg_snapshot := pg_current_snapshot();
BEGIN
    IF x >= pg_snapshot_xmax(snap) THEN
        RETURN snap;  -- as in almost every bound: read as in progress already
    END IF;
    RETURN (least(pg_snapshot_xmin(snap), x)::text || ':' || pg_snapshot_xmax(snap)::text || ':'
            || array_to_string(ARRAY(SELECT t FROM pg_snapshot_xip(snap) AS t UNION SELECT x ORDER BY 1), ','))::pg_snapshot;
END
$$;

-- (its upper bound with _bound_snapshot)
CREATE OR REPLACE FUNCTION outbox_internal._open_window(cur outbox._cursor_log, seq_mark bigint, x xid8)
RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    late    record;
    seqs    bigint[];
    seq_end bigint;
    since   timestamptz;
    until   timestamptz;
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
        cur.hi_snap := outbox_internal._bound_snapshot(x);
        seq_end := coalesce(pg_sequence_last_value('outbox.event_seq'), 0);
        cur.hi_top := outbox_internal._top(cur.hi_snap, x);
        SELECT coalesce(array_agg(t ORDER BY t), '{}'),
               coalesce(array_agg(CASE WHEN t = x THEN seq_mark
                                       ELSE greatest(coalesce(u.f, cur.lo_seq),
                                                     (SELECT m.seq FROM outbox._marks m WHERE m.top < t
                                                       ORDER BY m.top DESC LIMIT 1)) END ORDER BY t), '{}')
          INTO cur.hi_txids, cur.hi_floors
          FROM unnest(outbox_internal._in_progress(cur.hi_snap, x)) AS t
          LEFT JOIN unnest(cur.lo_txids, cur.lo_floors) AS u(id, f) ON u.id = t;
    END IF;
    late := outbox_internal._late(cur);
    cur.late_from := NULL; cur.late_to := NULL;
    IF cardinality(late.txids) > 0 THEN
        since := outbox_internal._since(late.floor_seq, outbox_internal._newest_seal());
        until := outbox_internal._reach();
        seqs := outbox_internal._late_range(cur.shard, late.floor_seq, seq_end, late.txids, since, until);
        cur.late_from := seqs[1]; cur.late_to := seqs[2];
    END IF;
    cur.after_seq := NULL;
    RETURN cur;
END
$$;

-- (its first bound with _bound_snapshot)
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
    lo     pg_snapshot := outbox_internal._bound_snapshot(x);
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
REVOKE ALL ON FUNCTION outbox_internal._bound_snapshot(xid8) FROM PUBLIC;

-- (a later head nacked then given back charges nothing to the heads before it)
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
       AND (p.nacked_pos IS NULL  -- parked by this batch (a window event failed): a replay's
                                  -- event may keep it parked, on no attempt of its own
            OR EXISTS (SELECT FROM outbox._parked_events q
                        WHERE q.aggregate_id = p.aggregate_id AND q.consumer_id = c.id
                          AND q.pos = p.nacked_pos AND q.id = ANY (ids)
                       OFFSET 0)  -- a lookup by the key's queue position, not a semi-join
            -- or a head of the batch came before the one that failed: heads go out together
            -- only at no attempt counted, and the first did not fail
            OR EXISTS (SELECT FROM outbox._parked_events q
                        WHERE q.aggregate_id = p.aggregate_id AND q.consumer_id = c.id
                          AND q.pos < p.nacked_pos AND q.id = ANY (cur.heads)
                       OFFSET 0));
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

-- (a replayed copy queued behind the reject's is no nack's retry)
CREATE OR REPLACE FUNCTION outbox_internal._fail_keys(c outbox.consumers, cur outbox._cursor_log,
                                             batch outbox.events[], firsts outbox_internal._failure[]) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    fresh   outbox_internal._failure[];  -- the keys not failed in this batch before
    early   uuid;
    retried uuid;
    parked  text[];
    riders  text[];  -- keys with heads in this batch whose events of the page failed
    kept    int;
BEGIN
    -- where each key failed in this batch before, if it did: a head's key by its record, a
    -- window event's key by its events of the batch already queued or dead-lettered
    WITH before AS (
        SELECT f, CASE WHEN f.head THEN
                   (SELECT p.nacked_pos FROM outbox._parked p
                     WHERE p.consumer_id = c.id AND p.aggregate_id = f.aggregate_id
                       AND p.nacked_epoch = cur.epoch)
               ELSE (SELECT min(x.seq) FROM unnest(batch) b
                      CROSS JOIN LATERAL (
                          SELECT q.seq FROM outbox._parked_events q
                           WHERE q.consumer_id = c.id AND q.id = b.id
                          UNION ALL
                          SELECT d.seq FROM outbox.dead_letters d
                           WHERE d.consumer = c.name AND d.aggregate_id = b.aggregate_id AND d.event_id = b.id) x
                      WHERE b.aggregate_id = f.aggregate_id)
               END AS failed_from
          FROM unnest(firsts) f)
    SELECT (SELECT (b.f).event_id FROM before b WHERE (b.f).seq < b.failed_from LIMIT 1),
           -- a reject of the very event a nack of this batch queued for a retry: it would
           -- change nothing (not one a replay queued again after a reject: that one is dead)
           (SELECT (b.f).event_id FROM before b
             WHERE (b.f).final AND (b.f).seq = b.failed_from
               AND EXISTS (SELECT FROM outbox._parked_events q
                             JOIN outbox._parked p
                               ON p.consumer_id = c.id AND p.aggregate_id = q.aggregate_id
                              AND p.nacked_epoch = cur.epoch
                            WHERE q.consumer_id = c.id AND q.id = (b.f).event_id
                              -- the copy the nack queued: a head's (or rider's) is the one
                              -- it names; a window event's, the first of the batch's events in
                              -- its queue (a replay queues one behind those a reject queued)
                              AND (q.pos = p.nacked_pos
                                   OR (p.nacked_pos IS NULL
                                       AND NOT EXISTS (SELECT FROM outbox._parked_events o
                                                        WHERE o.consumer_id = c.id AND o.aggregate_id = q.aggregate_id
                                                          AND o.pos < q.pos
                                                          AND o.id IN (SELECT e.id FROM unnest(batch) e)))))
             LIMIT 1),
           ARRAY(SELECT b.f FROM before b WHERE b.failed_from IS NULL)
      INTO early, retried, fresh;
    IF early IS NOT NULL THEN
        RAISE EXCEPTION 'event % comes before an event of its key already reported failed in this batch', early
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Report a key''s failures in batch order, or all at once with outbox.settle.';
    ELSIF retried IS NOT NULL THEN
        RAISE EXCEPTION 'event % was reported failed in this batch already, to be retried', retried
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Report an event''s failure once per claim: reject it the first time, or '
                         'when it is claimed again.';
    END IF;
    -- the window's events kept back: from a failed one on, or all that rode behind a failed head
    kept := (SELECT count(*) FROM unnest(batch) b JOIN unnest(fresh) f ON f.aggregate_id = b.aggregate_id
              WHERE CASE WHEN f.head THEN NOT EXISTS (SELECT FROM outbox._parked_events q
                                                       WHERE q.consumer_id = c.id AND q.id = b.id)
                         ELSE b.seq >= f.seq END);
    IF EXISTS (SELECT FROM unnest(fresh) f WHERE f.head) THEN
        -- the heads from each failed one on, each head looked up by its id (see _deliver_rest)
        kept := kept + (SELECT count(*) FROM unnest(cur.heads) AS out(id)
                         WHERE EXISTS (SELECT FROM outbox._parked_events h JOIN unnest(fresh) f
                                           ON f.head AND f.aggregate_id = h.aggregate_id AND h.pos >= f.seq
                                        WHERE h.consumer_id = c.id AND h.id = out.id OFFSET 0));
    END IF;
    -- window events park their keys; a key parked meanwhile (a replay) keeps its record: its
    -- events wait behind its queue, nothing counted
    WITH made AS (
        INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
        SELECT c.id, f.aggregate_id, cur.shard, now() FROM unnest(fresh) f WHERE NOT f.head
        ON CONFLICT DO NOTHING
        RETURNING aggregate_id)
    SELECT array_agg(m.aggregate_id) INTO parked FROM made m;
    IF parked IS NOT NULL THEN
        PERFORM outbox_internal._replan_when_grown('outbox._parked');
    END IF;
    IF cardinality(cur.heads) > 0 AND EXISTS (SELECT FROM unnest(fresh) f WHERE NOT f.head) THEN
        -- (not a key whose queue a replay lengthened while the batch was out: the replayed
        -- event heads it once the heads are through, and did not fail). Each failed key's
        -- queue is looked up on its own (OFFSET 0: a semi- or anti-join planned while the
        -- queues were tiny could read all of them); most are empty, the key not parked.
        riders := ARRAY(SELECT f.aggregate_id FROM unnest(fresh) f
                         WHERE NOT f.head
                           AND EXISTS (SELECT FROM outbox._parked_events q
                                        WHERE q.aggregate_id = f.aggregate_id AND q.consumer_id = c.id
                                          AND q.id = ANY (cur.heads) OFFSET 0)
                           AND NOT EXISTS (SELECT FROM outbox._parked_events q
                                            WHERE q.aggregate_id = f.aggregate_id AND q.consumer_id = c.id
                                              AND q.id <> ALL (cur.heads) OFFSET 0));
    END IF;
    -- (a head's key: its events of the page that were copied when the claim read them, as a key
    -- that did not ride has, are there already: ON CONFLICT)
    PERFORM outbox_internal._queue_parked(c.id, ARRAY(
        SELECT b FROM unnest(batch) b JOIN unnest(fresh) f ON f.aggregate_id = b.aggregate_id
         WHERE f.head OR b.seq >= f.seq ORDER BY b.seq));
    IF cardinality(riders) > 0 THEN
        fresh := ARRAY(SELECT CASE WHEN f.head OR f.aggregate_id <> ALL (riders) THEN f
                              ELSE ROW(f.event_id, f.aggregate_id,
                                       (SELECT q.pos FROM outbox._parked_events q
                                         WHERE q.consumer_id = c.id AND q.id = f.event_id),
                                       true, f.error, f.retry_after, f.final, f.attempted)::outbox_internal._failure
                              END
                         FROM unnest(fresh) f);
    END IF;
    PERFORM outbox_internal._keys_failed(c, ARRAY(SELECT f FROM unnest(fresh) f
                                                   WHERE f.head OR f.aggregate_id = ANY (parked)),
                                         cur.epoch);
    RETURN kept;
END
$$;

-- (the installer's default privileges reach no object of the extension)
CREATE OR REPLACE FUNCTION outbox_internal._revoke_strangers(made_only boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    statement text;
BEGIN
    FOR statement IN
        WITH ours AS (SELECT n.oid FROM pg_namespace n WHERE n.nspname IN ('outbox', 'inbox', 'outbox_internal')),
             objects (catalog, id, kind, name, owner, acl) AS (
                 SELECT 'pg_class'::regclass, c.oid, CASE c.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END,
                        c.oid::regclass::text, c.relowner, c.relacl
                   FROM pg_class c WHERE c.relnamespace IN (SELECT o.oid FROM ours o)
                 UNION ALL
                 SELECT 'pg_proc'::regclass, p.oid, 'ROUTINE', p.oid::regprocedure::text, p.proowner, p.proacl
                   FROM pg_proc p WHERE p.pronamespace IN (SELECT o.oid FROM ours o)
                 UNION ALL
                 SELECT 'pg_type'::regclass, t.oid, 'TYPE', t.oid::regtype::text, t.typowner, t.typacl
                   FROM pg_type t WHERE t.typnamespace IN (SELECT o.oid FROM ours o) AND t.typcategory <> 'A'
                 UNION ALL
                 SELECT 'pg_namespace'::regclass, n.oid, 'SCHEMA', quote_ident(n.nspname), n.nspowner, n.nspacl
                   FROM pg_namespace n WHERE n.oid IN (SELECT o.oid FROM ours o))
        SELECT DISTINCT format('REVOKE ALL ON %s %s FROM %s', o.kind, o.name,
                               CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END)
          FROM objects o, aclexplode(o.acl) a
         WHERE a.grantee <> o.owner
           AND NOT (o.kind = 'TYPE' AND a.grantee = 0)  -- PUBLIC's by default, as for any type
           AND a.grantee NOT IN (SELECT r.oid FROM pg_roles r
                                  WHERE r.rolname IN ('outbox_producer', 'outbox_relay', 'outbox_admin', 'outbox_worker'))
           AND (NOT made_only
                OR EXISTS (SELECT FROM pg_init_privs i, aclexplode(i.initprivs) m
                            WHERE i.classoid = o.catalog AND i.objoid = o.id AND i.objsubid = 0
                              AND m.grantee = a.grantee))
    LOOP
        IF made_only THEN
            RAISE WARNING 'outbox_ext: %, which the installing role''s default privileges gave', statement
                USING HINT = 'Grant a role of outbox_ext (outbox_producer, outbox_relay, outbox_admin) instead.';
        END IF;
        EXECUTE statement;
    END LOOP;
END
$$;

-- (settings an admin may write are bounded, as create_consumer and the docs bound them: none
-- may make maintain() or a settle fail or run without end; values beyond them are brought
-- within first: a width with months becomes the days maintain() took it for)
UPDATE outbox.partition_config
   SET width = least(justify_hours(make_interval(secs => extract(epoch FROM width))), interval '366 days'),
       ahead = least(ahead, 100000),
       retention = least(retention, interval '100 years')
 WHERE width > interval '366 days' OR date_part('month', width) <> 0 OR date_part('year', width) <> 0
    OR ahead > 100000 OR retention > interval '100 years';
ALTER TABLE outbox.partition_config
    DROP CONSTRAINT partition_config_width_check,
    DROP CONSTRAINT partition_config_ahead_check,
    DROP CONSTRAINT partition_config_retention_check,
    ADD CONSTRAINT partition_config_width_check CHECK (width > '0' AND width <= '366 days'
                                       AND date_part('month', width) = 0 AND date_part('year', width) = 0),
    ADD CONSTRAINT partition_config_ahead_check CHECK (ahead >= 0 AND ahead <= 100000),
    ADD CONSTRAINT partition_config_retention_check CHECK (retention >= '0' AND retention <= '100 years');
UPDATE outbox.consumers
   SET backoff_max = least(backoff_max, interval '30 days'),
       backoff_base = least(backoff_base, backoff_max, interval '30 days')
 WHERE backoff_max > interval '30 days' OR backoff_base > least(backoff_max, interval '30 days');
ALTER TABLE outbox.consumers
    DROP CONSTRAINT consumers_backoff_base_check,
    DROP CONSTRAINT consumers_backoff_max_check,
    DROP CONSTRAINT IF EXISTS consumers_backoff_check,
    ADD CONSTRAINT consumers_backoff_base_check CHECK (backoff_base > '0' AND backoff_base <= '30 days'),
    ADD CONSTRAINT consumers_backoff_max_check CHECK (backoff_max > '0' AND backoff_max <= '30 days'),
    ADD CONSTRAINT consumers_backoff_check CHECK (backoff_base <= backoff_max);

-- (the run trims before it drops)
CREATE OR REPLACE FUNCTION outbox.maintain()
RETURNS TABLE (action text, relation text, detail text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    per_run CONSTANT int := 100;
    budget  int := per_run;
    -- the partitions, read once (reading outbox.partitions deparses every partition's bounds:
    -- about 0.1 ms each), read again only after a phase changed them; read after the lock
    -- (deparsing a bound opens its partition: a run that attaches one holds the default
    -- partition, and a second run would wait for it instead of skipping)
    parts   outbox.partitions[];
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
    parts := outbox_internal._partition_list();
    RETURN QUERY SELECT * FROM outbox_internal._maint_rebase();
    -- (before the drops: a drop_consumer waiting on the run's lock of outbox.consumers has
    -- deleted cursor rows this trim would wait for)
    RETURN QUERY SELECT * FROM outbox_internal._maint_trim();
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
END
$$;

-- (last: every object of this script made first)
SELECT outbox_internal._revoke_strangers(true);
REVOKE ALL ON FUNCTION outbox_internal._revoke_strangers(boolean) FROM PUBLIC;
