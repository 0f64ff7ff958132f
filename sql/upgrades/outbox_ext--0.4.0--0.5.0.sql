-- outbox_ext 0.4.0 -> 0.5.0
--
-- Why: outbox.emit becomes native (src/emit/single.rs): a C function instead of PL/pgSQL, not
-- SECURITY DEFINER (it writes as its owner itself, without a GUC save and restore per call),
-- writing its row the way emit_many already did. Its checks and their errors are unchanged;
-- outbox._event_id, which did them for the PL/pgSQL emit, goes. outbox.shard_count() now comes
-- from Rust, where native emit reads the count, and outbox._insert_many no longer takes it.
-- outbox.maintain() keeps a partition whose drop ends in a deadlock, instead of failing whole.
-- Only functions change: events, consumers, cursors, parked keys and dead letters are not
-- touched.
--
-- Rerunnable. Frozen as released: the files of sql/ it included are expanded in place.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.5.0'" to load this file. \quit

-- As pgrx declares it (src/emit/mod.rs).
CREATE OR REPLACE FUNCTION outbox."shard_count"() RETURNS INT
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'shard_count_wrapper';

DROP FUNCTION IF EXISTS outbox._event_id(text, text, text, int, jsonb, text);
DROP FUNCTION IF EXISTS outbox._insert_many(text, text, jsonb, text, text[], anyarray, int);
-- As pgrx declares it (src/emit/insert.rs).
CREATE OR REPLACE FUNCTION outbox."_insert_many"(
    "aggregate_type" TEXT,
    "event_type" TEXT,
    "headers" jsonb,
    "topic" TEXT,
    "aggregate_ids" TEXT[],
    "payloads" anyarray
) RETURNS uuid[]
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'insert_many_wrapper';

-- outbox_ext: emit. Writes events in the caller's transaction: they exist if and only if it
-- commits. Validation and ids come from Rust (src/emit); a bad row raises and the statement
-- writes nothing. Rerunnable (upgrade scripts include it).

COMMENT ON FUNCTION outbox.uuid_v7() IS
    'A new time-ordered UUID (version 7), as emit gives events. Example: SELECT outbox.uuid_v7();';

CREATE OR REPLACE FUNCTION outbox.emit(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL,
    topic          text  DEFAULT NULL
) RETURNS uuid
    LANGUAGE c VOLATILE PARALLEL UNSAFE
    -- Native (src/emit/single.rs), and not SECURITY DEFINER: it writes as its owner itself,
    -- without the GUC save and restore a pinned search_path costs; it names everything by schema.
AS 'MODULE_PATHNAME', 'outbox_emit';
COMMENT ON FUNCTION outbox.emit(text, text, text, jsonb, jsonb, text) IS
    'Writes one event in the caller''s transaction and returns its id. '
    'Example: SELECT outbox.emit(''order'', ''42'', ''order.created'', ''{"total": 10}'');';

CREATE OR REPLACE FUNCTION outbox.emit_many(
    aggregate_type text,
    event_type     text,
    aggregate_ids  text[],
    payloads       jsonb[],
    headers        jsonb DEFAULT NULL,
    topic          text  DEFAULT NULL
) RETURNS SETOF uuid
    LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    ids uuid[];
    tx  xid8 := pg_current_xact_id();  -- before any seq is taken: see events.seq
BEGIN
    IF aggregate_ids IS NULL OR payloads IS NULL THEN
        RAISE EXCEPTION 'aggregate_ids and payloads must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass one aggregate id and one payload per event, as arrays.';
    END IF;
    IF cardinality(aggregate_ids) <> cardinality(payloads) THEN
        RAISE EXCEPTION 'aggregate_ids has % elements but payloads has %',
                cardinality(aggregate_ids), cardinality(payloads)
            USING ERRCODE = 'array_subscript_error',
                  HINT = 'Pass one payload per aggregate id, in the same order.';
    END IF;
    -- Natively, as COPY writes (see src/emit/insert.rs); NULL when the table needs a plain
    -- INSERT (triggers, constraints, no partition for now()).
    ids := outbox._insert_many(aggregate_type, event_type, headers, topic, aggregate_ids, payloads);
    IF ids IS NULL THEN
        ids := outbox._batch_ids(aggregate_type, event_type, headers, topic, aggregate_ids,
                                 (SELECT max(pg_column_size(p)) FROM unnest(payloads) AS p));
        INSERT INTO outbox.events
            (id, topic, aggregate_type, aggregate_id, event_type, payload, headers, txid, shard)
        SELECT u.id, emit_many.topic, emit_many.aggregate_type, u.key, emit_many.event_type,
               u.payload, emit_many.headers, tx, outbox.shard_of(u.key)
        FROM unnest(ids, aggregate_ids, payloads) AS u(id, key, payload);
    END IF;
    RETURN QUERY SELECT unnest(ids);
END
$$;
COMMENT ON FUNCTION outbox.emit_many(text, text, text[], jsonb[], jsonb, text) IS
    'Writes one event per (aggregate id, payload) pair in one statement, in array order, and '
    'returns their ids. Example: SELECT outbox.emit_many(''order'', ''order.created'', '
    'ARRAY[''1'',''2''], ARRAY[''{}''::jsonb, ''{}'']);';
-- outbox_ext: partitions of the event log and the inbox, and their maintenance.
--
-- outbox.events is partitioned by created_at, inbox.messages by message_id (UUIDv7, so by
-- time too). outbox.maintain() keeps both: it creates partitions ahead, drops (or detaches)
-- those past their retention — for events only once every consumer has read past all of their
-- events — and moves rows that landed in a default partition into partitions of their own.
-- Partitions are named <parent>_pYYYYMMDD_HH24MISS after their lower bound in UTC.
--
-- Rerunnable: the 0.1.0 -> 0.2.0 upgrade script includes this file.

CREATE TABLE IF NOT EXISTS outbox.partition_config (
    parent    regclass PRIMARY KEY,
    width     interval NOT NULL CHECK (width > '0'),
    ahead     int      NOT NULL DEFAULT 2 CHECK (ahead >= 0),
    retention interval NOT NULL CHECK (retention >= '0'),
    detach    boolean  NOT NULL DEFAULT false
);
COMMENT ON TABLE outbox.partition_config IS
    'How outbox.maintain() partitions each table: width of a partition, how many to create ahead, '
    'how long to keep them (for events: after every consumer has read them), and whether to detach '
    'instead of drop. Example: UPDATE outbox.partition_config SET retention = ''3 days'' WHERE parent = ''outbox.events''::regclass;';
INSERT INTO outbox.partition_config (parent, width, ahead, retention) VALUES
    ('outbox.events', '1 day', 2, '2 days'),
    ('inbox.messages', '1 day', 2, '7 days')
ON CONFLICT (parent) DO NOTHING;

CREATE OR REPLACE FUNCTION outbox._partition_name(parent text, lo_at timestamptz) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN parent || '_p' || pg_catalog.to_char(lo_at AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS');

-- The partition key column of a table, and its value at a moment, as a literal (the inbox's
-- key is a UUIDv7).
CREATE OR REPLACE FUNCTION outbox._key_column(parent regclass) RETURNS text
    LANGUAGE sql IMMUTABLE
    RETURN CASE WHEN parent = 'inbox.messages'::regclass THEN 'message_id' ELSE 'created_at' END;
-- The time of a row's partition key, as an SQL expression.
CREATE OR REPLACE FUNCTION outbox._key_time(parent regclass) RETURNS text
    LANGUAGE sql IMMUTABLE
    RETURN CASE WHEN parent = 'inbox.messages'::regclass THEN 'inbox.uuid_time(message_id)' ELSE 'created_at' END;
CREATE OR REPLACE FUNCTION outbox._bound(parent regclass, at timestamptz) RETURNS text
    LANGUAGE sql STABLE
    RETURN CASE WHEN parent = 'inbox.messages'::regclass THEN inbox.uuid_at(at)::text ELSE at::text END;

-- Every partition of the two tables with its time range (NULLs for a default partition).
CREATE OR REPLACE VIEW outbox.partitions AS
SELECT i.inhparent::regclass AS parent,
       c.oid::regclass AS partition,
       CASE WHEN i.inhparent = 'inbox.messages'::regclass THEN inbox.uuid_time(b[1]::uuid) ELSE b[1]::timestamptz END AS lower,
       CASE WHEN i.inhparent = 'inbox.messages'::regclass THEN inbox.uuid_time(b[2]::uuid) ELSE b[2]::timestamptz END AS upper,
       b IS NULL AS is_default,
       pg_total_relation_size(c.oid) AS bytes
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
  LEFT JOIN LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']*)''\) TO \(''([^'']*)''\)') AS b ON true
 WHERE i.inhparent IN ('outbox.events'::regclass, 'inbox.messages'::regclass);
COMMENT ON VIEW outbox.partitions IS 'Partitions of outbox.events and inbox.messages with their time ranges.';

CREATE OR REPLACE FUNCTION outbox._floor_time(at timestamptz, width interval) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN to_timestamp(floor(extract(epoch FROM at) / extract(epoch FROM width)) * extract(epoch FROM width));

-- Create the partition [lo_at, lo_at + width) of parent, clipped to the gap between existing
-- partitions; rows for that range waiting in the default partition move into it first.
-- Returns the partition created, or NULL if the range is already covered.
CREATE OR REPLACE FUNCTION outbox._create_partition(parent regclass, lo_at timestamptz, width interval)
RETURNS regclass
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    hi_at timestamptz := lo_at + width;
    nsp   text;
    rel   text;
    part  text;
    dflt  regclass;
BEGIN
    SELECT greatest(lo_at, max(p.upper)) INTO lo_at FROM outbox.partitions p
     WHERE p.parent = _create_partition.parent AND NOT p.is_default AND p.upper > lo_at AND p.lower <= lo_at;
    SELECT least(hi_at, min(p.lower)) INTO hi_at FROM outbox.partitions p
     WHERE p.parent = _create_partition.parent AND NOT p.is_default AND p.lower >= lo_at AND p.lower < hi_at;
    IF lo_at >= hi_at THEN
        RETURN NULL;
    END IF;
    SELECT n.nspname, c.relname INTO nsp, rel
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = parent;
    part := outbox._partition_name(rel, lo_at);
    SELECT p.partition INTO dflt FROM outbox.partitions p
     WHERE p.parent = _create_partition.parent AND p.is_default;
    -- Standalone first, then the default partition's rows of the range, then attach: a
    -- default partition holding rows of the range would make a plain CREATE ... PARTITION OF fail.
    EXECUTE format('CREATE TABLE %I.%I (LIKE %I.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                   nsp, part, nsp, rel);
    IF dflt IS NOT NULL THEN
        EXECUTE format('WITH moved AS (DELETE FROM %s d WHERE %I >= %L AND %I < %L RETURNING d.*) '
                       'INSERT INTO %I.%I SELECT * FROM moved',
                       dflt, outbox._key_column(parent), outbox._bound(parent, lo_at),
                       outbox._key_column(parent), outbox._bound(parent, hi_at), nsp, part);
    END IF;
    EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                   nsp, rel, nsp, part, outbox._bound(parent, lo_at), outbox._bound(parent, hi_at));
    RETURN format('%I.%I', nsp, part)::regclass;
END
$$;

-- Why an event partition past its retention must stay, or NULL when it may go. Rows of open
-- transactions are invisible, so first: no open transaction started before the partition's
-- upper bound (emit's created_at is the transaction's start, so it may still write there),
-- and no transaction, prepared ones included, holds a lock on it (it has written there).
-- Then every consumer must have read past every event: each event's transaction is visible
-- in the lower bound of its shard's current window.
CREATE OR REPLACE FUNCTION outbox._partition_pending(part regclass, upper timestamptz) RETURNS text
    LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp
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
                          CROSS JOIN LATERAL (SELECT l.lo_snap FROM outbox._cursor_log l
                                               WHERE l.consumer_id = s.consumer_id AND l.shard = s.shard
                                               ORDER BY l.pos DESC LIMIT 1) AS cur
                         WHERE EXISTS (SELECT FROM %s e WHERE e.shard = s.shard
                                          AND NOT pg_visible_in_snapshot(e.txid, cur.lo_snap)))', part)
        INTO pending;
    RETURN CASE WHEN pending THEN 'a consumer has not read all its events' END;
END
$$;

CREATE OR REPLACE FUNCTION outbox.maintain()
RETURNS TABLE (action text, relation text, detail text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg     outbox.partition_config;
    p       outbox.partitions;
    created regclass;
    lo_at   timestamptz;
    n       bigint;
    why     text;
    part    text;
    old_timeout text;
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN;  -- a replica follows its primary's maintenance
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtext('outbox.maintain')) THEN
        RETURN QUERY SELECT 'skipped', NULL::text, 'another outbox.maintain() is running';
        RETURN;
    END IF;
    -- 1. Partitions past retention first: drop or detach, never with undelivered events. A drop
    --    needs the parent's ACCESS EXCLUSIVE lock; waited for after creating a partition (which
    --    locks the default partition) it could deadlock with a reader that holds the parent and
    --    goes on to the default partition. Each waits at most a second: a long reader must not
    --    queue every emit behind the drop; the next run tries again.
    old_timeout := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', '1s', true);
    FOR cfg IN SELECT * FROM outbox.partition_config LOOP
        FOR p IN SELECT * FROM outbox.partitions x
                  WHERE x.parent = cfg.parent AND NOT x.is_default AND x.upper <= now() - cfg.retention
                  ORDER BY x.lower LOOP
            part := p.partition::text;  -- named while it exists
            BEGIN
                IF cfg.parent = 'outbox.events'::regclass THEN
                    why := outbox._partition_pending(p.partition, p.upper);
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
        -- 2. rows that landed in the default partition: report them, move them into partitions
        --    (inbox ids that are not UUIDv7 carry no time: they stay, and age out by received_at)
        FOR lo_at IN EXECUTE format(
                'SELECT DISTINCT outbox._floor_time(%s, %L) FROM %s %s',
                outbox._key_time(cfg.parent), cfg.width,
                (SELECT d.partition FROM outbox.partitions d WHERE d.parent = cfg.parent AND d.is_default),
                CASE WHEN cfg.parent = 'inbox.messages'::regclass
                     THEN 'WHERE substr(message_id::text, 15, 1) = ''7''' ELSE '' END)
        LOOP
            created := outbox._create_partition(cfg.parent, lo_at, cfg.width);
            IF created IS NOT NULL THEN
                RAISE WARNING 'outbox.maintain: rows of % were in its default partition; moved them to %',
                    cfg.parent, created;
                RETURN QUERY SELECT 'moved', created::text, 'rows from the default partition';
            END IF;
        END LOOP;
        -- 3. partitions ahead
        lo_at := outbox._floor_time(now(), cfg.width);
        FOR i IN 0 .. cfg.ahead LOOP
            created := outbox._create_partition(cfg.parent, lo_at + cfg.width * i, cfg.width);
            IF created IS NOT NULL THEN
                RETURN QUERY SELECT 'created', created::text, NULL::text;
            END IF;
        END LOOP;
    END LOOP;
    DELETE FROM inbox.messages_default m
     WHERE m.received_at < now() - (SELECT c.retention FROM outbox.partition_config c
                                     WHERE c.parent = 'inbox.messages'::regclass);
    -- 4. cursor history (a minute of it is kept, for a look at what happened) and marks
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
COMMENT ON FUNCTION outbox.maintain() IS
    'Creates partitions ahead, drops (or detaches) those past retention once every consumer has '
    'read them, moves rows out of default partitions, trims cursor history; returns what it did. '
    'Safe to run concurrently (one runs, the other skips) and from pg_cron: '
    'SELECT cron.schedule(''outbox-maintain'', ''* * * * *'', ''SELECT * FROM outbox.maintain()'');';

CREATE TABLE IF NOT EXISTS outbox.events_default PARTITION OF outbox.events DEFAULT;
CREATE TABLE IF NOT EXISTS inbox.messages_default PARTITION OF inbox.messages DEFAULT;
SELECT count(*) FROM outbox.maintain();
-- outbox_ext: privileges, all in one place. Runs last (finalize); rerunnable (upgrade
-- scripts include it).
--
-- Nothing is granted to PUBLIC. Producers reach the event log only through the SECURITY
-- DEFINER emit_many (which pins search_path) and the native emit (which writes as its owner);
-- they cannot read events or configuration.
-- outbox.sinks holds secrets: only outbox_admin (and superusers, like the worker) can read it;
-- relays see a sink's health through outbox.status, which shows no URL or secret.

REVOKE ALL ON SCHEMA outbox, inbox FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;

GRANT outbox_producer, outbox_relay TO outbox_admin;
GRANT USAGE ON SCHEMA outbox, inbox TO outbox_producer, outbox_relay, outbox_admin;

GRANT EXECUTE ON FUNCTION
    outbox.emit(text, text, text, jsonb, jsonb, text),
    outbox.emit_many(text, text, text[], jsonb[], jsonb, text),
    outbox.uuid_v7(),
    outbox.shard_count(),
    outbox.shard_of(text)
TO outbox_producer;

GRANT SELECT ON outbox.events TO outbox_relay;
GRANT EXECUTE ON FUNCTION
    outbox.claim(text, int, interval, text),
    outbox.ack(text, int, bigint),
    outbox.nack(text, int, bigint, uuid, text, interval),
    outbox.reject(text, int, bigint, uuid, text),
    outbox.release(text, int, bigint, interval),
    outbox.release_owner(text, text),
    outbox.shard_count(),
    outbox.shard_of(text)
TO outbox_relay;
GRANT EXECUTE ON FUNCTION
    outbox.create_consumer(text, boolean, int, interval, interval),
    outbox.drop_consumer(text),
    outbox.replay(text, text),
    outbox.create_sink(text, text, text, text[], text[], text, int, int, interval, interval, text,
                       jsonb, text, jsonb, text, int, interval, interval, boolean),
    outbox.drop_sink(text)
TO outbox_admin;
GRANT ALL ON ALL TABLES IN SCHEMA outbox TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.maintain() TO outbox_admin;
GRANT SELECT ON outbox.status, outbox.shard_status TO outbox_relay;

REVOKE ALL ON ALL TABLES IN SCHEMA inbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA inbox FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.claim(uuid, text), inbox.uuid_time(uuid), inbox.uuid_at(timestamptz)
    TO outbox_producer, outbox_relay;
GRANT ALL ON ALL TABLES IN SCHEMA inbox TO outbox_admin;
