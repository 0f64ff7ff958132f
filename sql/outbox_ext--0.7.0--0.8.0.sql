-- outbox_ext 0.7.0 -> 0.8.0
--
-- Why: the worker produces to Kafka brokers itself (sink kind kafka, librdkafka), whole
-- batches in per-key order, instead of only through a REST proxy. outbox.sinks gains the
-- producer's settings (compression, linger, SASL mechanism and user; the password is the
-- sink's secret), create_sink takes them, and the native settings check learns kafka:// URLs.
-- maintain() reads the partitions once per run, not once per step.
--
-- A delta: what changed from 0.7.0 to 0.8.0 (ALTERs, guarded DROPs, changed functions, views
-- and comments, new grants), rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.8.0'" to load this file. \quit

-- a SQL-standard function body depends on the row type it takes (sinks.sql makes it again)
DROP FUNCTION IF EXISTS outbox._routes(outbox.sinks, text, text);
ALTER TABLE outbox.sinks ADD COLUMN IF NOT EXISTS compression text,
                         ADD COLUMN IF NOT EXISTS linger interval NOT NULL DEFAULT '5 milliseconds',
                         ADD COLUMN IF NOT EXISTS sasl_mechanism text,
                         ADD COLUMN IF NOT EXISTS sasl_username text;

DROP FUNCTION IF EXISTS outbox.create_sink(text, text, text, text[], text[], text, int, int, interval, interval, text, jsonb, text, jsonb, text, int, interval, interval, boolean);
DROP FUNCTION IF EXISTS outbox._check_sink_settings(text, jsonb, text);

-- As pgrx declares it (src/sinks/check.rs).
CREATE OR REPLACE FUNCTION outbox."_check_sink_settings"(
	"kind" TEXT, /* Option < & str > */
	"url" TEXT, /* Option < & str > */
	"secret" TEXT, /* Option < & str > */
	"http_headers" jsonb, /* Option < JsonB > */
	"tls_ca" TEXT /* Option < & str > */
) RETURNS void
IMMUTABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'check_sink_settings_of_kind_wrapper';

-- Every check a sink row must pass, with the fix in the hint; also stamps updated_at (the
-- worker rebuilds a sink's client when it changes). SECURITY DEFINER: it calls internal
-- helpers that admins cannot execute directly.
CREATE OR REPLACE FUNCTION outbox._check_sink() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    topic   text;
    kafka   boolean := NEW.kind = 'kafka';
    formats text[] := CASE NEW.kind WHEN 'webhook' THEN ARRAY['batch', 'single']
                                    WHEN 'kafka' THEN ARRAY['outbox', 'debezium']
                                    WHEN 'kafka_rest_v2' THEN ARRAY['json', 'binary']
                                    WHEN 'kafka_rest_v3' THEN ARRAY['json', 'binary', 'string'] END;
BEGIN
    PERFORM outbox._not_null(NEW.kind IS NULL, 'kind', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.url IS NULL, 'url', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.batch_size IS NULL, 'batch_size', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.concurrency IS NULL, 'concurrency', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.connect_timeout IS NULL, 'connect_timeout', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.request_timeout IS NULL, 'request_timeout', 'outbox.create_sink');
    PERFORM outbox._not_null(NEW.enabled IS NULL, 'enabled', 'outbox.sinks');
    PERFORM outbox._not_null(NEW.linger IS NULL, 'linger', 'outbox.create_sink');
    IF cardinality(NEW.topics) = 0 OR cardinality(NEW.aggregate_types) = 0
       OR array_position(NEW.topics, NULL) IS NOT NULL
       OR array_position(NEW.aggregate_types, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'topics and aggregate_types must be NULL (all) or lists of names'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'An empty list or a NULL in one would match nothing: pass NULL for all.';
    END IF;
    IF formats IS NULL THEN
        RAISE EXCEPTION 'unknown sink kind "%"', NEW.kind USING ERRCODE = 'invalid_parameter_value',
            HINT = 'kind is webhook, kafka, kafka_rest_v2 or kafka_rest_v3.';
    END IF;
    NEW.format := coalesce(NEW.format, formats[1]);
    IF NOT NEW.format = ANY (formats) THEN
        RAISE EXCEPTION 'format "%" does not fit a % sink', NEW.format, NEW.kind
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = format('Use one of %s, or NULL for %s.', array_to_string(formats, ', '), formats[1]);
    END IF;
    IF NOT kafka AND NEW.url !~ '^https?://[^/?#\s]+[^\s]*$' THEN
        RAISE EXCEPTION 'invalid sink URL "%"', NEW.url USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give an absolute http:// or https:// URL, e.g. https://hooks.example.com/outbox.';
    END IF;
    IF NEW.batch_size NOT BETWEEN 1 AND 10000 OR NEW.concurrency NOT BETWEEN 1 AND 64 THEN
        RAISE EXCEPTION 'batch_size % or concurrency % is out of range', NEW.batch_size, NEW.concurrency
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'batch_size is 1 to 10000; concurrency is 1 to 64.';
    END IF;
    IF NOT (NEW.connect_timeout > '0' AND NEW.request_timeout > '0'
            AND NEW.connect_timeout <= '1 hour' AND NEW.request_timeout <= '1 hour') THEN
        RAISE EXCEPTION 'timeouts must be positive and at most an hour'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'E.g. connect_timeout => ''5 s'', request_timeout => ''30 s''.';
    END IF;
    IF NOT outbox._is_string_map(NEW.http_headers) OR NOT outbox._is_string_map(NEW.topic_map) THEN
        RAISE EXCEPTION 'http_headers and topic_map must be JSON objects of strings'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'E.g. ''{"Authorization": "Bearer t0ken"}''.';
    END IF;
    IF EXISTS (SELECT FROM jsonb_each_text(NEW.topic_map) AS m(k, v)
                WHERE v !~ '^[A-Za-z0-9._-]{1,249}$' OR v IN ('.', '..')) THEN
        RAISE EXCEPTION 'topic_map renames to a name that is not a Kafka topic name'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Kafka topics are 1 to 249 of [A-Za-z0-9._-], not "." or "..".';
    END IF;
    PERFORM outbox._check_kafka_settings(NEW);
    -- the URL of a kafka sink, the secret's key, each header, each CA certificate: as the
    -- worker will use them (Rust)
    PERFORM outbox._check_sink_settings(NEW.kind, NEW.url, NEW.secret, NEW.http_headers, NEW.tls_ca);
    -- topics filter event topics; a name that topic_map only renames to is a Kafka topic
    FOR topic IN SELECT t FROM unnest(NEW.topics) AS t
                  WHERE NEW.topic_map IS NOT NULL AND NOT NEW.topic_map ? t
                    AND t IN (SELECT v FROM jsonb_each_text(NEW.topic_map) AS m(k, v)) LOOP
        RAISE NOTICE 'sink "%": topics lists "%", a Kafka topic that topic_map renames to; events are matched by their own topic', NEW.name, topic
            USING HINT = format('List the event topics instead (%s), or drop topic_map.',
                                (SELECT string_agg(k, ', ') FROM jsonb_each_text(NEW.topic_map) AS m(k, v) WHERE v = topic));
    END LOOP;
    IF NEW.kind = 'kafka_rest_v3' AND coalesce(NEW.cluster_id, '') = '' THEN
        RAISE EXCEPTION 'a kafka_rest_v3 sink needs its cluster_id' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass cluster_id => ''...''; GET /v3/clusters on the proxy lists it.';
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END
$$;

-- The settings of the native Kafka producer, and those that apply only to it.
CREATE OR REPLACE FUNCTION outbox._check_kafka_settings(s outbox.sinks) RETURNS void
    LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT (s.linger >= '0' AND s.linger <= '1 minute') THEN
        RAISE EXCEPTION 'linger % is out of range', s.linger USING ERRCODE = 'invalid_parameter_value',
            HINT = 'linger is 0 to 1 minute, e.g. ''5 ms''.';
    END IF;
    IF s.kind <> 'kafka' THEN
        IF num_nonnulls(s.compression, s.sasl_mechanism, s.sasl_username) > 0 THEN
            RAISE EXCEPTION 'compression, sasl_mechanism and sasl_username apply only to a kafka sink'
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = format('Leave them NULL for a %s sink.', s.kind);
        END IF;
        RETURN;
    END IF;
    IF num_nonnulls(s.http_headers, s.cluster_id) > 0 THEN
        RAISE EXCEPTION 'http_headers and cluster_id do not apply to a kafka sink'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'A kafka sink speaks the Kafka protocol: leave them NULL (SASL takes credentials).';
    END IF;
    IF s.compression IS NOT NULL AND NOT s.compression = ANY ('{none,gzip,snappy,lz4,zstd}') THEN
        RAISE EXCEPTION 'unknown compression "%"', s.compression USING ERRCODE = 'invalid_parameter_value',
            HINT = 'compression is none, gzip, snappy, lz4 or zstd.';
    END IF;
    IF s.sasl_mechanism IS NOT NULL AND NOT s.sasl_mechanism = ANY ('{PLAIN,SCRAM-SHA-256,SCRAM-SHA-512}') THEN
        RAISE EXCEPTION 'unknown SASL mechanism "%"', s.sasl_mechanism USING ERRCODE = 'invalid_parameter_value',
            HINT = 'sasl_mechanism is PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.';
    END IF;
    IF (s.sasl_mechanism IS NULL) <> (s.sasl_username IS NULL) OR (s.sasl_mechanism IS NULL) <> (s.secret IS NULL) THEN
        RAISE EXCEPTION 'a kafka sink takes sasl_mechanism, sasl_username and secret (the password) together'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass all three for SASL, or none for a broker without authentication.';
    END IF;
END
$$;

-- Whether a sink delivers an event (src/sinks/mod.rs, Config::routes, applies the same rule):
-- topics match the event's topic, the one it was emitted with or else its aggregate type (the
-- topic it goes to, before topic_map renames it); aggregate_types its aggregate type.
CREATE OR REPLACE FUNCTION outbox._routes(sink outbox.sinks, topic text, aggregate_type text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN (sink.topics IS NULL OR coalesce(topic, aggregate_type) = ANY (sink.topics))
       AND (sink.aggregate_types IS NULL OR aggregate_type = ANY (sink.aggregate_types));

CREATE OR REPLACE FUNCTION outbox.create_sink(
    name            text,
    kind            text,
    url             text,
    topics          text[]   DEFAULT NULL,
    aggregate_types text[]   DEFAULT NULL,
    format          text     DEFAULT NULL,
    batch_size      int      DEFAULT 100,
    concurrency     int      DEFAULT 4,
    connect_timeout interval DEFAULT '5 seconds',
    request_timeout interval DEFAULT '30 seconds',
    secret          text     DEFAULT NULL,
    http_headers    jsonb    DEFAULT NULL,
    tls_ca          text     DEFAULT NULL,
    topic_map       jsonb    DEFAULT NULL,
    cluster_id      text     DEFAULT NULL,
    compression     text     DEFAULT NULL,
    linger          interval DEFAULT '5 milliseconds',
    sasl_mechanism  text     DEFAULT NULL,
    sasl_username   text     DEFAULT NULL,
    max_attempts    int      DEFAULT 10,
    backoff_base    interval DEFAULT '1 second',
    backoff_max     interval DEFAULT '10 minutes',
    from_beginning  boolean  DEFAULT false
) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.create_consumer(name, from_beginning, max_attempts, backoff_base, backoff_max);
    INSERT INTO outbox.sinks (name, kind, url, topics, aggregate_types, format, batch_size,
                              concurrency, connect_timeout, request_timeout, secret, http_headers,
                              tls_ca, topic_map, cluster_id, compression, linger, sasl_mechanism,
                              sasl_username)
    VALUES (name, kind, url, topics, aggregate_types, format, batch_size, concurrency,
            connect_timeout, request_timeout, secret, http_headers, tls_ca, topic_map, cluster_id,
            compression, linger, sasl_mechanism, sasl_username);
END
$$;
COMMENT ON FUNCTION outbox.create_sink(text, text, text, text[], text[], text, int, int, interval,
                                       interval, text, jsonb, text, jsonb, text, text, interval,
                                       text, text, int, interval, interval, boolean) IS
    'Adds a sink and its consumer; the worker delivers to it within a second, events committed '
    'from now on (or all, from_beginning). Examples: SELECT outbox.create_sink(''billing'', '
    '''webhook'', ''https://billing.example.com/hooks'', secret => ''whsec_...''); SELECT '
    'outbox.create_sink(''stream'', ''kafka'', ''kafka://broker1:9092,broker2:9092'', '
    'compression => ''lz4'');';
INSERT INTO outbox.partition_config (parent, width, ahead, retention) VALUES
    ('outbox.events', '1 day', 2, '2 days'),
    ('inbox.messages', '1 day', 2, '7 days')
ON CONFLICT (parent) DO NOTHING;

-- outbox.partitions as a value, without the sizes (each a stat of every file of a partition).
CREATE OR REPLACE FUNCTION outbox._partition_list() RETURNS outbox.partitions[]
    LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
AS $$
    SELECT ARRAY(SELECT ROW(x.parent, x.partition, x.lower, x.upper, x.is_default, NULL)::outbox.partitions
                   FROM outbox.partitions x)
$$;

CREATE OR REPLACE FUNCTION outbox.maintain()
RETURNS TABLE (action text, relation text, detail text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg     outbox.partition_config;
    p       outbox.partitions;
    -- the partitions, read once (reading outbox.partitions deparses every partition's bounds:
    -- about 0.1 ms each), read again only after this run changed them
    parts   outbox.partitions[] := outbox._partition_list();
    changed boolean := false;
    created regclass;
    lo_at   timestamptz;
    n       bigint;
    why     text;
    part    text;
    old_timeout text;
    rebased boolean;
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN;  -- a replica follows its primary's maintenance
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtext('outbox.maintain')) THEN
        RETURN QUERY SELECT 'skipped', NULL::text, 'another outbox.maintain() is running';
        RETURN;
    END IF;
    IF outbox._restore_running() THEN  -- its partitions would collide with the dump's
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
    rebased := outbox._rebase_if_restored();
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
        FOR p IN SELECT * FROM unnest(parts) x
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
                changed := true;
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
            parts := outbox._partition_list();
            changed := false;
        END IF;
        -- 2. rows that landed in the default partition: report them, move them into partitions
        --    (inbox ids that are not UUIDv7 carry no time: they stay, and age out by received_at)
        FOR lo_at IN EXECUTE format(
                'SELECT DISTINCT outbox._floor_time(%s, %L) FROM %s %s',
                outbox._key_time(cfg.parent), cfg.width,
                (SELECT d.partition FROM unnest(parts) d WHERE d.parent = cfg.parent AND d.is_default),
                CASE WHEN cfg.parent = 'inbox.messages'::regclass
                     THEN 'WHERE substr(message_id::text, 15, 1) = ''7''' ELSE '' END)
        LOOP
            created := outbox._create_partition(cfg.parent, lo_at, cfg.width);
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
            parts := outbox._partition_list();
        END IF;
        FOR lo_at IN
            WITH existing AS MATERIALIZED (
                     SELECT x.lower, x.upper FROM unnest(parts) x
                      WHERE x.parent = cfg.parent AND NOT x.is_default
                        AND x.upper > outbox._floor_time(now(), cfg.width))
            SELECT g FROM generate_series(outbox._floor_time(now(), cfg.width),
                                          outbox._floor_time(now(), cfg.width) + cfg.width * cfg.ahead,
                                          cfg.width) AS g
             WHERE NOT EXISTS (SELECT FROM existing e WHERE e.lower <= g AND e.upper >= g + cfg.width)
             ORDER BY g
        LOOP
            created := outbox._create_partition(cfg.parent, lo_at, cfg.width);
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
SELECT outbox._index_partition('outbox.events', 'outbox.events_default');
SELECT outbox._index_partition('inbox.messages', 'inbox.messages_default');

-- nothing new is PUBLIC
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox, inbox FROM PUBLIC;

-- outbox_admin: consumers, sinks, dead letters, maintenance; reads everything
GRANT EXECUTE ON FUNCTION
    outbox.create_consumer(text, boolean, int, interval, interval),
    outbox.drop_consumer(text),
    outbox.replay(text, text),
    outbox.create_sink(text, text, text, text[], text[], text, int, int, interval, interval, text,
                       jsonb, text, jsonb, text, text, interval, text, text, int, interval,
                       interval, boolean),
    outbox.drop_sink(text),
    outbox.maintain()
TO outbox_admin;
