-- outbox_ext 0.31.0 -> 0.32.0
--
-- Why: a relay whose transactions ran at REPEATABLE READ or SERIALIZABLE (a session, role or
-- database default some teams set) could be handed a batch another relay held under a live
-- lease, with the same epoch: a claim locks a free shard and then reads its cursor, and a
-- snapshot taken before the lock does not show a claim committed just before it. Two relays
-- then delivered the same key at once. Claims, settles, releases and replays now refuse such a
-- transaction with 25000 (_check_read_committed, called by _consumer; drop_consumer's own
-- check is now that one), and the worker pins its session to READ COMMITTED. The worker's
-- library also caps a receiver's Retry-After at 5 minutes for a parked key (it already did for
-- a suspended sink), and retries a give-back that failed as it retries a failed settle.
-- _check_sink and _not_null match patterns without backslashes: in a session with
-- standard_conforming_strings off, '\s' read as 's' refused a sink URL with an s in its path
-- and let one with a line break through.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.32.0'" to load this file. \quit

-- Refuses a transaction at REPEATABLE READ or SERIALIZABLE (25000): what locks a shard (or a
-- consumer's shards) must then read what others committed before it got the lock, which a
-- snapshot taken before the lock does not show. A claim would hand out a batch another relay
-- holds, under the same epoch, and two relays would deliver the same key at once.
CREATE OR REPLACE FUNCTION outbox_internal._check_read_committed(what text) RETURNS void
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF pg_catalog.current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        RAISE EXCEPTION '% must run at READ COMMITTED, not %', what,
                pg_catalog.upper(pg_catalog.current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state',
                  DETAIL = 'It locks shards and then reads what other relays committed, which a '
                           'snapshot taken before the lock does not show.',
                  HINT = 'Call it in a READ COMMITTED transaction (the default isolation level), '
                         'e.g. after SET default_transaction_isolation = ''read committed''.';
    END IF;
END
$$;

REVOKE ALL ON FUNCTION outbox_internal._check_read_committed(text) FROM PUBLIC;

-- A consumer by name, for the API functions that lock its shards: claims, settles,
-- give-backs and replays (at READ COMMITTED only, see _check_read_committed).
CREATE OR REPLACE FUNCTION outbox_internal._consumer(name text) RETURNS outbox.consumers
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    c outbox.consumers;
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'consumer', 'the function');
    PERFORM outbox_internal._check_read_committed('claims, settles, releases and replays');
    PERFORM outbox_internal._rebase_if_restored();
    SELECT * INTO c FROM outbox.consumers WHERE consumers.name = _consumer.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'consumer "%" does not exist', name
            USING ERRCODE = 'undefined_object',
                  HINT = 'Create it with outbox.create_consumer(name).';
    END IF;
    RETURN c;
END
$$;

CREATE OR REPLACE FUNCTION outbox.drop_consumer(name text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c_id int := (SELECT c.id FROM outbox.consumers c WHERE c.name = drop_consumer.name);
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'name', 'outbox.drop_consumer');
    -- The deletes below must see the rows relays commit while the drop waits for their shards:
    -- with a snapshot taken before, those would be left behind.
    PERFORM outbox_internal._check_read_committed('outbox.drop_consumer');
    -- Its shards first, in order, as claims and settles take them before they write a cursor
    -- row: the drop waits for a claim or a settle under way, then deletes what no one holds.
    PERFORM FROM outbox._shards s WHERE s.consumer_id = c_id ORDER BY s.shard FOR UPDATE;
    DELETE FROM outbox._cursor_log l WHERE l.consumer_id = c_id;
    DELETE FROM outbox._parked_events q WHERE q.consumer_id = c_id;
    DELETE FROM outbox._parked p WHERE p.consumer_id = c_id;
    DELETE FROM outbox.dead_letters d WHERE d.consumer = drop_consumer.name;
    DELETE FROM outbox.consumers c WHERE c.id = c_id;         -- and its shards (a cascade)
    RETURN FOUND;
END
$$;

-- The one NULL check of the API's arguments: 22004, naming the argument and the function.
CREATE OR REPLACE FUNCTION outbox_internal._not_null(is_null boolean, arg text, func text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF is_null THEN
        RAISE EXCEPTION '% must not be NULL', arg
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = format('Pass %s to %s; %s describes every argument.', arg, func,
                                CASE WHEN func ~ '^(outbox|inbox)[.][a-z_]+$' THEN 'docs/reference/' || func || '.md'
                                     ELSE 'docs/reference/README.md' END);
    END IF;
END
$$;

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
