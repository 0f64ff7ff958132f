-- outbox_ext 0.2.0 -> 0.3.0
--
-- Why: 0.3.0 delivers. It adds sinks (outbox.sinks, outbox.create_sink, outbox.drop_sink) for
-- the background worker, outbox.reject (dead-letter an event at once, e.g. after an HTTP 4xx)
-- and outbox.release_owner (give back a dead relay's batches), and delivery figures in
-- outbox.status. outbox._head_failed gains a parameter (whether the failure is final).
-- Events, consumers, cursors, parked keys and dead letters are not touched.
--
-- A delta: what changed from 0.2.0 to 0.3.0 (ALTERs, guarded DROPs, changed functions, views
-- and comments, new grants), rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.3.0'" to load this file. \quit

DROP FUNCTION IF EXISTS outbox._head_failed(outbox.consumers, text, text, interval, bigint);

-- The head of a parked key failed: count it, schedule the retry; past max_attempts (or at once
-- when the failure is final) move the head to dead_letters and let the key move on.
CREATE OR REPLACE FUNCTION outbox._head_failed(c outbox.consumers, key text, error text,
                                    retry_after interval, epoch bigint, final boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n int;
BEGIN
    UPDATE outbox._parked p
       SET attempts = p.attempts + 1, last_error = error, nacked_epoch = epoch,
           next_attempt_at = now() + coalesce(retry_after, outbox._backoff(c, p.attempts + 1))
     WHERE p.consumer_id = c.id AND p.aggregate_id = key
    RETURNING p.attempts INTO n;
    IF n < c.max_attempts AND NOT final THEN
        RETURN;
    END IF;
    WITH head AS (
        DELETE FROM outbox._parked_events q
         WHERE (q.consumer_id, q.aggregate_id, q.pos) =
               (SELECT h.consumer_id, h.aggregate_id, h.pos FROM outbox._parked_events h
                 WHERE h.consumer_id = c.id AND h.aggregate_id = key ORDER BY h.pos LIMIT 1)
        RETURNING q.*)
    INSERT INTO outbox.dead_letters (consumer, event_id, topic, aggregate_type, aggregate_id,
                                     event_type, payload, headers, created_at, seq, attempts, last_error)
    SELECT c.name, h.id, h.topic, h.aggregate_type, h.aggregate_id, h.event_type, h.payload,
           h.headers, h.created_at, h.seq, n, error
      FROM head h;
    UPDATE outbox._parked p SET attempts = 0, next_attempt_at = now()
     WHERE p.consumer_id = c.id AND p.aggregate_id = key;
    PERFORM outbox._unpark_if_empty(c.id, key);
END
$$;

-- A claimed event failed (nack), or failed for good (reject, final): park its key, count the
-- failure of the key's head.
CREATE OR REPLACE FUNCTION outbox._fail(consumer text, shard int, epoch bigint, event_id uuid, error text,
                             retry_after interval, final boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c   outbox.consumers := outbox._consumer(consumer);
    cur outbox._cursor_log := outbox._leased(c.id, shard, epoch);
    ev  outbox.events;
    key text;
BEGIN
    IF event_id = ANY (cur.heads) THEN
        SELECT q.aggregate_id INTO key FROM outbox._parked_events q
         WHERE q.consumer_id = c.id AND q.id = _fail.event_id;
    ELSE
        SELECT * INTO ev FROM outbox._window(shard, cur, cur.batch_end, NULL) w WHERE w.id = event_id;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'event % is not in the batch of shard % with epoch %', event_id, shard, epoch
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Nack only events that this claim returned.';
        END IF;
        key := ev.aggregate_id;
        IF EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = c.id AND p.aggregate_id = key
                                                    AND p.nacked_epoch = _fail.epoch) THEN
            RETURN;  -- the key already failed in this batch; later events of it wait anyway
        END IF;
        -- park the key: this event and the key's later events of the batch queue up, in order
        INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
        VALUES (c.id, key, shard, now());
        PERFORM outbox._queue_parked(c.id, ARRAY(
            SELECT w FROM outbox._window(shard, cur, cur.batch_end, NULL) w
             WHERE w.aggregate_id = key AND w.seq >= ev.seq));
    END IF;
    PERFORM outbox._head_failed(c, key, error, retry_after, epoch, final);
END
$$;

CREATE OR REPLACE FUNCTION outbox.nack(consumer text, shard int, epoch bigint, event_id uuid, error text,
                            retry_after interval DEFAULT NULL) RETURNS void
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    RETURN outbox._fail(consumer, shard, epoch, event_id, error, retry_after, false);

CREATE OR REPLACE FUNCTION outbox.reject(consumer text, shard int, epoch bigint, event_id uuid, error text)
RETURNS void
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    RETURN outbox._fail(consumer, shard, epoch, event_id, error, NULL, true);
COMMENT ON FUNCTION outbox.reject(text, int, bigint, uuid, text) IS
    'Reports that one claimed event can never be delivered (e.g. HTTP 400): it goes to '
    'outbox.dead_letters at once and its key moves on; call ack afterwards for the rest of the batch. '
    'Example: SELECT outbox.reject(''billing-webhook'', 3, 17, ''0190...''::uuid, ''HTTP 422'');';

CREATE OR REPLACE FUNCTION outbox.release_owner(consumer text, owner text) RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c   outbox.consumers := outbox._consumer(consumer);
    s   int;
    cur outbox._cursor_log;
    n   int := 0;
BEGIN
    FOR s IN SELECT sh.shard FROM outbox._shards sh WHERE sh.consumer_id = c.id
              ORDER BY sh.shard FOR UPDATE LOOP
        cur := outbox._cursor(c.id, s);
        CONTINUE WHEN cur.owner IS DISTINCT FROM release_owner.owner OR cur.lease_until <= now();
        cur.owner := NULL; cur.lease_until := NULL;
        cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
        PERFORM outbox._append(cur);
        n := n + 1;
    END LOOP;
    RETURN n;
END
$$;
COMMENT ON FUNCTION outbox.release_owner(text, text) IS
    'Gives back every batch a relay (by its claim owner name) holds for the consumer, e.g. after '
    'the relay died; its late acks are refused. Returns how many. '
    'Example: SELECT outbox.release_owner(''hook'', ''relay-7'');';
-- outbox_ext: sinks — where the background worker delivers events. A sink is a row here plus
-- a consumer of the same name (its cursors, retry policy, parked keys and dead letters).
-- Only outbox_admin can read or change this table: it holds secrets. The worker rereads it
-- every second, so changes apply without a restart.
--
-- Rerunnable: tables only where missing, functions replaced.

CREATE TABLE IF NOT EXISTS outbox.sinks (
    name            text        PRIMARY KEY REFERENCES outbox.consumers (name)
                                ON UPDATE CASCADE ON DELETE CASCADE,
    kind            text        NOT NULL,   -- webhook | kafka_rest_v2 | kafka_rest_v3
    url             text        NOT NULL,   -- webhook: the endpoint; Kafka: the proxy's base URL
    enabled         boolean     NOT NULL DEFAULT true,
    topics          text[],                 -- routing: only events of these topics (NULL: all)
    aggregate_types text[],                 -- routing: only these aggregate types (NULL: all)
    format          text,                   -- webhook: batch | single; v2: json | binary;
                                            -- v3: json | binary | string (NULL: the first)
    batch_size      int         NOT NULL DEFAULT 100,
    concurrency     int         NOT NULL DEFAULT 4,   -- shards (requests) in flight at once
    connect_timeout interval    NOT NULL DEFAULT '5 seconds',
    request_timeout interval    NOT NULL DEFAULT '30 seconds',
    secret          text,                   -- webhook: Standard Webhooks key, whsec_<base64>
    http_headers    jsonb,                  -- extra request headers, e.g. Authorization
    tls_ca          text,                   -- PEM CA certificates trusted instead of the public roots
    topic_map       jsonb,                  -- Kafka: {"event topic": "Kafka topic"}
    cluster_id      text,                   -- Kafka v3: the cluster in the URL path
    updated_at      timestamptz NOT NULL DEFAULT now()
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
    updated_at        timestamptz NOT NULL DEFAULT now()
);

-- Every check a sink row must pass, with the fix in the hint; also stamps updated_at (the
-- worker rebuilds a sink's client when it changes). SECURITY DEFINER: it calls internal
-- helpers that admins cannot execute directly.
CREATE OR REPLACE FUNCTION outbox._check_sink() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    formats text[] := CASE NEW.kind WHEN 'webhook' THEN ARRAY['batch', 'single']
                                    WHEN 'kafka_rest_v2' THEN ARRAY['json', 'binary']
                                    WHEN 'kafka_rest_v3' THEN ARRAY['json', 'binary', 'string'] END;
BEGIN
    IF formats IS NULL THEN
        RAISE EXCEPTION 'unknown sink kind "%"', NEW.kind USING ERRCODE = 'invalid_parameter_value',
            HINT = 'kind is webhook, kafka_rest_v2 or kafka_rest_v3.';
    END IF;
    NEW.format := coalesce(NEW.format, formats[1]);
    IF NOT NEW.format = ANY (formats) THEN
        RAISE EXCEPTION 'format "%" does not fit a % sink', NEW.format, NEW.kind
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = format('Use one of %s, or NULL for %s.', array_to_string(formats, ', '), formats[1]);
    END IF;
    IF NEW.url !~ '^https?://[^/?#\s]+[^\s]*$' THEN
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
    IF NEW.secret IS NOT NULL AND NEW.secret !~ '^(whsec_)?[A-Za-z0-9+/]{16,}={0,2}$' THEN
        RAISE EXCEPTION 'the secret is not a Standard Webhooks key'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Give whsec_ and the base64 of 24 to 64 random bytes, e.g. '
                         '''whsec_'' || encode(sha256(gen_random_uuid()::text::bytea), ''base64'').';
    END IF;
    IF NOT outbox._is_string_map(NEW.http_headers) OR NOT outbox._is_string_map(NEW.topic_map) THEN
        RAISE EXCEPTION 'http_headers and topic_map must be JSON objects of strings'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'E.g. ''{"Authorization": "Bearer t0ken"}''.';
    END IF;
    IF NEW.tls_ca IS NOT NULL AND position('-----BEGIN CERTIFICATE-----' IN NEW.tls_ca) = 0 THEN
        RAISE EXCEPTION 'tls_ca holds no PEM certificate' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Paste the CA certificate(s) in PEM form, or NULL to trust the public roots.';
    END IF;
    IF NEW.kind = 'kafka_rest_v3' AND coalesce(NEW.cluster_id, '') = '' THEN
        RAISE EXCEPTION 'a kafka_rest_v3 sink needs its cluster_id' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass cluster_id => ''...''; GET /v3/clusters on the proxy lists it.';
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION outbox._is_string_map(j jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE
    RETURN j IS NULL OR (jsonb_typeof(j) = 'object' AND
                         NOT jsonb_path_exists(j, '$.* ? (@.type() != "string")'));

CREATE OR REPLACE TRIGGER check_sink BEFORE INSERT OR UPDATE ON outbox.sinks
    FOR EACH ROW EXECUTE FUNCTION outbox._check_sink();

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
                              tls_ca, topic_map, cluster_id)
    VALUES (name, kind, url, topics, aggregate_types, format, batch_size, concurrency,
            connect_timeout, request_timeout, secret, http_headers, tls_ca, topic_map, cluster_id);
END
$$;
COMMENT ON FUNCTION outbox.create_sink(text, text, text, text[], text[], text, int, int, interval,
                                       interval, text, jsonb, text, jsonb, text, int, interval,
                                       interval, boolean) IS
    'Adds a sink and its consumer; the worker delivers to it within a second, events committed '
    'from now on (or all, from_beginning). Example: SELECT outbox.create_sink(''billing'', '
    '''webhook'', ''https://billing.example.com/hooks'', secret => ''whsec_...'');';

CREATE OR REPLACE FUNCTION outbox.drop_sink(name text) RETURNS boolean
    LANGUAGE sql VOLATILE SET search_path = pg_catalog, pg_temp
    RETURN outbox.drop_consumer(name);
COMMENT ON FUNCTION outbox.drop_sink(text) IS
    'Drops a sink with its consumer, parked keys and dead letters; false if there was none. '
    'Example: SELECT outbox.drop_sink(''billing'');';

CREATE OR REPLACE VIEW outbox.status AS
SELECT s.consumer,
       sum(s.pending)::bigint AS pending,
       min(s.oldest_pending_at) AS oldest_pending_at,
       now() - min(s.oldest_pending_at) AS lag,
       sum(s.parked_keys)::bigint AS parked_keys,
       (SELECT count(*) FROM outbox._parked_events q JOIN outbox.consumers c ON c.id = q.consumer_id
         WHERE c.name = s.consumer) AS parked_events,
       (SELECT count(*) FROM outbox.dead_letters d WHERE d.consumer = s.consumer) AS dead_letters,
       coalesce((SELECT p.last_error FROM outbox._parked p JOIN outbox.consumers c ON c.id = p.consumer_id
                  WHERE c.name = s.consumer ORDER BY p.parked_at DESC LIMIT 1),
                (SELECT d.last_error FROM outbox.dead_letters d WHERE d.consumer = s.consumer
                  ORDER BY d.id DESC LIMIT 1)) AS last_error,
       count(s.leased_by) AS shards_leased,
       max(s.last_activity) AS last_activity,
       (SELECT count(*) FROM outbox.events_default) AS events_in_default_partition,
       k.kind AS sink_kind,
       k.enabled AS sink_enabled,
       -- the worker's figures (outbox._sink_stats), written every two seconds while it runs
       CASE WHEN st.updated_at > now() - interval '10 seconds' THEN st.per_second ELSE 0 END
           AS delivered_per_second,
       st.delivered AS delivered_total,
       st.failed AS failed_total,
       st.last_delivered_at,
       st.last_error AS last_sink_error,
       st.last_error_at AS last_sink_error_at
  FROM outbox.shard_status s
  LEFT JOIN outbox.sinks k ON k.name = s.consumer
  LEFT JOIN outbox._sink_stats st ON st.sink = s.consumer
 GROUP BY s.consumer, k.name, st.sink;
COMMENT ON VIEW outbox.status IS
    'One row per consumer (a sink is one): pending events and lag, parked keys and events, dead '
    'letters, the last error, leased shards, events waiting in the default partition '
    '(outbox.maintain() moves them), and for a sink the worker''s delivery rate and last error. '
    'Example: SELECT consumer, pending, lag, dead_letters, last_error FROM outbox.status;';
-- outbox_ext: privileges, all in one place. Runs last (finalize); rerunnable (upgrade
-- scripts include it).
--
-- Nothing is granted to PUBLIC. Producers reach the event log only through the SECURITY
-- DEFINER emit functions (which pin search_path); they cannot read events or configuration.
-- outbox.sinks holds secrets: only outbox_admin (and superusers, like the worker) can read it;
-- relays see a sink's health through outbox.status, which shows no URL or secret.

REVOKE ALL ON SCHEMA outbox, inbox FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;
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

REVOKE ALL ON ALL TABLES IN SCHEMA inbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA inbox FROM PUBLIC;
GRANT ALL ON ALL TABLES IN SCHEMA inbox TO outbox_admin;
