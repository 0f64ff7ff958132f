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
-- A delta: what changed from 0.4.0 to 0.5.0 (ALTERs, guarded DROPs, changed functions, views
-- and comments, new grants), rerunnable. Released: never edit it.
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
INSERT INTO outbox.partition_config (parent, width, ahead, retention) VALUES
    ('outbox.events', '1 day', 2, '2 days'),
    ('inbox.messages', '1 day', 2, '7 days')
ON CONFLICT (parent) DO NOTHING;

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
GRANT ALL ON ALL TABLES IN SCHEMA outbox TO outbox_admin;

REVOKE ALL ON ALL TABLES IN SCHEMA inbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA inbox FROM PUBLIC;
GRANT ALL ON ALL TABLES IN SCHEMA inbox TO outbox_admin;
