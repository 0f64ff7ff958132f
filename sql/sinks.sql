-- outbox_ext: sinks — where the background worker delivers events. A sink is a row here plus
-- a consumer of the same name (its cursors, retry policy, parked keys and dead letters).
-- Only outbox_admin can read or change this table: it holds secrets. The worker rereads it
-- every second, so changes apply without a restart.
--
-- Rerunnable: tables only where missing, functions replaced.
-- Name resolution (sql/grants.sql): the trigger function is [pinned], create_sink, drop_sink,
-- pause_sink and resume_sink are [caller], outbox_internal._check_sink_settings is [native], _check_kafka_settings is [pinned],
-- _is_string_map is [parsed].

CREATE TABLE IF NOT EXISTS outbox.sinks (
    name            text        PRIMARY KEY REFERENCES outbox.consumers (name)
                                ON UPDATE CASCADE ON DELETE CASCADE,
    kind            text        NOT NULL,   -- webhook | kafka | kafka_rest_v2 | kafka_rest_v3
    url             text        NOT NULL,   -- webhook: the endpoint; kafka: kafka(s)://brokers;
                                            -- Kafka REST: the proxy's base URL
    enabled         boolean     NOT NULL DEFAULT true,
    topics          text[],                 -- routing: only events of these topics (NULL: all)
    aggregate_types text[],                 -- routing: only these aggregate types (NULL: all)
    format          text,                   -- webhook: batch | single; kafka: outbox | debezium;
                                            -- v2: json | binary; v3: json | binary | string
                                            -- (NULL: the first)
    batch_size      int         NOT NULL DEFAULT 100,
    concurrency     int         NOT NULL DEFAULT 8,   -- shards (requests) in flight at once
    connect_timeout interval    NOT NULL DEFAULT '5 seconds',
    request_timeout interval    NOT NULL DEFAULT '30 seconds',
    secret          text,                   -- webhook: Standard Webhooks key, whsec_<base64>;
                                            -- kafka: the SASL password
    http_headers    jsonb,                  -- extra request headers, e.g. Authorization
    tls_ca          text,                   -- PEM CA certificates trusted instead of the public roots
    topic_map       jsonb,                  -- Kafka: {"event topic": "Kafka topic"}
    cluster_id      text,                   -- Kafka v3: the cluster in the URL path
    updated_at      timestamptz NOT NULL DEFAULT now(),
    compression     text,                   -- kafka: none | gzip | snappy | lz4 | zstd (NULL: none)
    linger          interval    NOT NULL DEFAULT '5 milliseconds', -- kafka: the producer's linger
    sasl_mechanism  text,                   -- kafka: PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
    sasl_username   text                    -- kafka: with sasl_mechanism; the password is secret
);

COMMENT ON TABLE outbox.sinks IS
    'Where the background worker delivers events (admins only: holds secrets). Add one with '
    'outbox.create_sink; change it with UPDATE (applies within a second); retry policy is in '
    'outbox.consumers under the same name.';

-- What the worker reports per sink (a few UPDATEs a second at most, HOT).
CREATE TABLE IF NOT EXISTS outbox._sink_stats (
    sink              text        PRIMARY KEY REFERENCES outbox.sinks ON UPDATE CASCADE ON DELETE CASCADE,
    delivered         bigint      NOT NULL DEFAULT 0,
    failed            bigint      NOT NULL DEFAULT 0,
    per_second        float8      NOT NULL DEFAULT 0,
    last_delivered_at timestamptz,
    last_error        text,
    last_error_at     timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    -- the sink's health (src/worker/health.rs): healthy, or suspended since state_since for
    -- state_reason, probed next at next_probe_at; suspensions counts them
    state             text        NOT NULL DEFAULT 'healthy',
    state_reason      text,
    state_since       timestamptz,
    next_probe_at     timestamptz,
    suspensions       bigint      NOT NULL DEFAULT 0
);

-- When the transaction commits, the database's worker rereads outbox.sinks at once instead of
-- on its next reload, a second later at most (src/wake.rs): a fixed credential is tried at once.
CREATE OR REPLACE FUNCTION outbox_internal._reload_sinks_at_commit() RETURNS void
    LANGUAGE c VOLATILE AS 'MODULE_PATHNAME', 'outbox_reload_sinks_at_commit';

-- Every check a sink row must pass, with the fix in the hint; also stamps updated_at (the
-- worker rebuilds a sink's client when it changes) and has the worker reread the sinks when
-- the transaction commits. SECURITY DEFINER: it calls internal helpers that admins cannot
-- execute directly.
CREATE OR REPLACE FUNCTION outbox_internal._check_sink() RETURNS trigger
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
    PERFORM outbox_internal._not_null(NEW.kind IS NULL, 'kind', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.url IS NULL, 'url', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.batch_size IS NULL, 'batch_size', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.concurrency IS NULL, 'concurrency', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.connect_timeout IS NULL, 'connect_timeout', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.request_timeout IS NULL, 'request_timeout', 'outbox.create_sink');
    PERFORM outbox_internal._not_null(NEW.enabled IS NULL, 'enabled', 'outbox.sinks');
    PERFORM outbox_internal._not_null(NEW.linger IS NULL, 'linger', 'outbox.create_sink');
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
    -- (no backslash in a pattern: a session with standard_conforming_strings off reads '\s' as 's')
    IF NOT kafka AND NEW.url !~ '^https?://[^/?#[:space:]]+[^[:space:]]*$' THEN
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
    IF NOT outbox_internal._is_string_map(NEW.http_headers) OR NOT outbox_internal._is_string_map(NEW.topic_map) THEN
        RAISE EXCEPTION 'http_headers and topic_map must be JSON objects of strings'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'E.g. ''{"Authorization": "Bearer t0ken"}''.';
    END IF;
    IF EXISTS (SELECT FROM jsonb_each_text(NEW.topic_map) AS m(k, v)
                WHERE v !~ '^[A-Za-z0-9._-]{1,249}$' OR v IN ('.', '..')) THEN
        RAISE EXCEPTION 'topic_map renames to a name that is not a Kafka topic name'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Kafka topics are 1 to 249 of [A-Za-z0-9._-], not "." or "..".';
    END IF;
    PERFORM outbox_internal._check_kafka_settings(NEW);
    -- the URL of a kafka sink, the secret's key, each header, each CA certificate: as the
    -- worker will use them (Rust)
    PERFORM outbox_internal._check_sink_settings(NEW.kind, NEW.url, NEW.secret, NEW.http_headers, NEW.tls_ca);
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
    PERFORM outbox_internal._reload_sinks_at_commit();
    RETURN NEW;
END
$$;

-- The settings of the native Kafka producer, and those that apply only to some kinds: one the
-- sink's kind would ignore is refused, not taken silently (a secret given to a Kafka REST sink
-- would sign nothing).
CREATE OR REPLACE FUNCTION outbox_internal._check_kafka_settings(s outbox.sinks) RETURNS void
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
        IF num_nonnulls(s.cluster_id, s.topic_map) > 0 AND s.kind = 'webhook' THEN
            RAISE EXCEPTION 'cluster_id and topic_map apply only to the Kafka sinks'
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'A webhook sends every event it takes to its url: choose them with topics '
                             'or aggregate_types, and leave cluster_id and topic_map NULL.';
        END IF;
        IF s.secret IS NOT NULL AND s.kind <> 'webhook' THEN
            RAISE EXCEPTION 'secret does not apply to a % sink', s.kind
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'A Kafka REST proxy takes credentials in http_headers, e.g. '
                             '{"Authorization": "Basic ..."}; secret is a webhook''s signing key '
                             'or a kafka sink''s SASL password.';
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
CREATE OR REPLACE FUNCTION outbox_internal._routes(sink outbox.sinks, topic text, aggregate_type text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN (sink.topics IS NULL OR coalesce(topic, aggregate_type) = ANY (sink.topics))
       AND (sink.aggregate_types IS NULL OR aggregate_type = ANY (sink.aggregate_types));

CREATE OR REPLACE FUNCTION outbox_internal._is_string_map(j jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE
    RETURN j IS NULL OR (jsonb_typeof(j) = 'object' AND
                         NOT jsonb_path_exists(j, '$.* ? (@.type() != "string")'));

CREATE OR REPLACE TRIGGER check_sink BEFORE INSERT OR UPDATE ON outbox.sinks
    FOR EACH ROW EXECUTE FUNCTION outbox_internal._check_sink();

CREATE OR REPLACE FUNCTION outbox.create_sink(
    name            text,
    kind            text,
    url             text,
    topics          text[]   DEFAULT NULL,
    aggregate_types text[]   DEFAULT NULL,
    format          text     DEFAULT NULL,
    batch_size      int      DEFAULT 100,
    concurrency     int      DEFAULT 8,
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

-- A consumer that is no sink (a relay's) is refused, not dropped: dropping it takes its
-- cursors, parked keys and dead letters, which a name mistyped must not cost.
CREATE OR REPLACE FUNCTION outbox.drop_sink(name text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM outbox.sinks s WHERE s.name = drop_sink.name)
       AND EXISTS (SELECT FROM outbox.consumers c WHERE c.name = drop_sink.name) THEN
        RAISE EXCEPTION 'consumer "%" is not a sink', name
            USING ERRCODE = 'wrong_object_type',
                  HINT = 'It has no row in outbox.sinks: a relay reads it. To drop it with its '
                         'cursors, parked keys and dead letters, use outbox.drop_consumer.';
    END IF;
    RETURN outbox.drop_consumer(name);
END
$$;
COMMENT ON FUNCTION outbox.drop_sink(text) IS
    'Drops a sink with its consumer, parked keys and dead letters; false if there was none. '
    'Example: SELECT outbox.drop_sink(''billing'');';

-- By hand: an admin stops a sink's deliveries (enabled = false: the worker lets go of it; batches
-- out are settled as they come back) and starts them again. Resuming also ends a suspension at
-- once: the worker starts afresh with a changed row (updated_at), without waiting for a probe.
-- With the caller's rights, like create_sink: the UPDATE needs outbox_admin's.
CREATE OR REPLACE FUNCTION outbox.pause_sink(name text) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'name must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass name to outbox.pause_sink; docs/reference/outbox.pause_sink.md describes it.';
    END IF;
    UPDATE outbox.sinks s SET enabled = false WHERE s.name OPERATOR(pg_catalog.=) pause_sink.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'sink "%" does not exist', name
            USING ERRCODE = 'undefined_object', HINT = 'SELECT name FROM outbox.sinks lists them.';
    END IF;
END
$$;
COMMENT ON FUNCTION outbox.pause_sink(text) IS
    'Stops the worker delivering to the sink (its events wait; outbox.status shows it '
    'disabled) until outbox.resume_sink. Example: SELECT outbox.pause_sink(''billing'');';

CREATE OR REPLACE FUNCTION outbox.resume_sink(name text) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'name must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass name to outbox.resume_sink; docs/reference/outbox.resume_sink.md describes it.';
    END IF;
    -- always an update, enabled or not: a new updated_at makes the worker start afresh
    UPDATE outbox.sinks s SET enabled = true WHERE s.name OPERATOR(pg_catalog.=) resume_sink.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'sink "%" does not exist', name
            USING ERRCODE = 'undefined_object', HINT = 'SELECT name FROM outbox.sinks lists them.';
    END IF;
END
$$;
COMMENT ON FUNCTION outbox.resume_sink(text) IS
    'Starts delivering to a paused sink again; on a suspended sink, ends the suspension and '
    'delivers at once (e.g. after fixing what made every request fail). '
    'Example: SELECT outbox.resume_sink(''billing'');';
