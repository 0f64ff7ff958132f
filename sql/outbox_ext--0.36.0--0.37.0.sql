-- outbox_ext 0.36.0 -> 0.37.0
--
-- Why: a dead letter replayed while the batch that killed it was still out was lost. A relay
-- rejected a parked key's only queued event (or nacked its last attempt), which emptied the
-- key's queue and unparked it; outbox.replay then queued the event again; the relay's ack of
-- the batch delivered the batch's heads by id and took the queued copy for one: the event was
-- neither queued nor dead any more, and the log was past it. Now a dead letter whose event is a
-- head of a batch still out stays dead until that batch is settled or given back (replay says
-- so in a NOTICE). A retry policy whose backoff_base doubled past an interval's range (a base
-- of hours, 31 attempts) made every settle of the failure raise 22008, so the key was never
-- counted on or dead-lettered and its shard's batch came again and again: the backoff is
-- now doubled in seconds and capped before it becomes an interval. settle_and_claim, called
-- first thing after a restore, raised 25001 ("must come before any write") for the rebase it
-- had just made itself; it now checks that before the rebase. drop_sink of a consumer that is
-- no sink (a relay's) dropped it with its cursors and dead letters; it is refused now (42809).
-- inbox.claim refuses a consumer name over 128 characters (22023; it failed on the dedup
-- index's row size, 54000), and inbox.uuid_at holds any moment to a UUIDv7's 48 bits of time
-- (before 1970 it gave the greatest UUIDv7, and infinity raised 0A000). A sink refuses a
-- setting its kind would ignore: cluster_id or topic_map on a webhook, a secret on a Kafka
-- REST sink (it signed nothing; the proxy's credentials go in http_headers).
--
-- In the worker's library: an event only throttled no longer counts as having failed when
-- the sink's health is judged later; one event that failed before no longer makes its
-- batch-mates' first failures theirs; failures after a batch's last delivery, of two keys or
-- more (a receiver that starts refusing everything mid-batch), are not counted; a 503 without
-- Retry-After (an instance shutting down in a rolling deploy) is never counted. A receiver's
-- Retry-After given as an HTTP date in RFC 850 or asctime form (the obsolete forms RFC 9110
-- still has recipients accept) was ignored; all three forms are read now, with the httpdate
-- crate. A Kafka REST v3 reply cut short mid-stream was not understood at all and every
-- record of its request went again; now the reports before the cut count. A Kafka REST report
-- with neither error_code nor offset no longer counts as a record published.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.37.0'" to load this file. \quit

-- (replay: a dead letter whose event is a head of a batch still out stays dead for now)
CREATE OR REPLACE FUNCTION outbox.replay(consumer text, aggregate_id text DEFAULT NULL) RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c       outbox.consumers := outbox_internal._consumer(consumer);
    n       int;
    out     uuid[];  -- heads of batches still out: their dead letters wait (see the header)
    waiting int;
BEGIN
    -- Hold every shard of the consumer so no ack unparks a key while we queue into it.
    PERFORM FROM outbox._shards s WHERE s.consumer_id = c.id ORDER BY s.shard FOR UPDATE;
    IF NOT FOUND THEN  -- dropped while we waited: its name's dead letters may be another's now
        RAISE EXCEPTION 'consumer "%" does not exist', consumer
            USING ERRCODE = 'undefined_object',
                  HINT = 'It was dropped while outbox.replay waited for its shards.';
    END IF;
    out := ARRAY(SELECT h.id
                   FROM generate_series(0, outbox.shard_count() - 1) AS s(shard)
                  CROSS JOIN LATERAL outbox_internal._cursor(c.id, s.shard) AS cur
                  CROSS JOIN LATERAL unnest(cur.heads) AS h(id)
                  WHERE cur.owner IS NOT NULL);
    INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
    SELECT DISTINCT c.id, d.aggregate_id, outbox.shard_of(d.aggregate_id), now()
      FROM outbox.dead_letters d
     WHERE d.consumer = c.name AND (replay.aggregate_id IS NULL OR d.aggregate_id = replay.aggregate_id)
       AND d.event_id <> ALL (out)
    ON CONFLICT DO NOTHING;
    WITH moved AS (
        DELETE FROM outbox.dead_letters d
         WHERE d.consumer = c.name AND (replay.aggregate_id IS NULL OR d.aggregate_id = replay.aggregate_id)
           AND d.event_id <> ALL (out)
        RETURNING d.*)
    INSERT INTO outbox._parked_events (consumer_id, aggregate_id, id, topic, aggregate_type,
                                       event_type, payload, headers, created_at, seq)
    SELECT c.id, m.aggregate_id, m.event_id, m.topic, m.aggregate_type, m.event_type, m.payload,
           m.headers, m.created_at, m.seq
      FROM moved m ORDER BY m.id
    ON CONFLICT (consumer_id, id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    waiting := (SELECT count(*) FROM outbox.dead_letters d
                 WHERE d.consumer = c.name AND (replay.aggregate_id IS NULL OR d.aggregate_id = replay.aggregate_id)
                   AND d.event_id = ANY (out));
    IF waiting > 0 THEN
        RAISE NOTICE '% dead letter(s) of consumer "%" stay dead for now: their batch is still out', waiting, c.name
            USING DETAIL = 'A relay rejected them (or nacked their last attempt) and has not settled that batch yet.',
                  HINT = 'Replay again once the batch is settled, given back, or its lease has run out and a claim took the shard.';
    END IF;
    IF n > 0 THEN
        PERFORM outbox_internal._replan_when_grown('outbox._parked');
        PERFORM outbox_internal._replan_when_grown('outbox._parked_events');
    END IF;
    RETURN n;
END
$$;

-- (_backoff: doubled in seconds and capped, no interval out of range)
CREATE OR REPLACE FUNCTION outbox_internal._backoff(c outbox.consumers, attempts int) RETURNS interval
    LANGUAGE sql VOLATILE
    RETURN make_interval(secs => least(extract(epoch FROM c.backoff_max),
                                       extract(epoch FROM c.backoff_base) * power(2, least(attempts - 1, 30))))
           * (0.5 + random() / 2);

-- (settle_and_claim: its checks before a rebase that may write)
CREATE OR REPLACE FUNCTION outbox_internal._settle_and_claim_body(
    consumer   text,
    shard      int,
    epoch      bigint,
    failures   jsonb,
    batch_size int,
    lease      interval,
    owner      text,
    shards     int
) RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    c       outbox.consumers;
    list    outbox_internal._failure[];
    rebased boolean;
    working int[];
    b       record;
BEGIN
    PERFORM outbox_internal._not_null(failures IS NULL, 'failures', 'outbox.settle_and_claim');
    list := outbox_internal._failures(failures);
    -- before the rebase, which may write: the check is that the caller wrote nothing
    PERFORM outbox_internal._check_claim(batch_size, lease, shards, 'outbox.settle_and_claim');
    rebased := outbox_internal._rebase_if_restored();
    c := outbox_internal._consumer(consumer);
    IF NOT rebased THEN
        b := outbox_internal._claim_bound();  -- before settling writes anything
    END IF;
    PERFORM outbox_internal._settle(c, outbox_internal._leased(c.id, shard, epoch), list);
    IF NOT rebased THEN
        working := outbox_internal._shards_with_work(c.id);
        IF working IS NULL OR cardinality(working) > 0 THEN
            RETURN QUERY SELECT * FROM outbox_internal._claim(c, batch_size, lease,
                                                     coalesce(owner, 'backend ' || pg_backend_pid()),
                                                     b.seq, b.x, working, shards);
        END IF;
    END IF;
END
$$;

-- (drop_sink: a consumer that is no sink is refused, not dropped)
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

-- (inbox.claim: a consumer name of 1 to 128 characters)
CREATE OR REPLACE FUNCTION inbox.claim(message_id uuid, consumer text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF message_id IS NULL OR consumer IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', CASE WHEN message_id IS NULL THEN 'message_id' ELSE 'consumer' END
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the event id you received and your consumer''s name.';
    END IF;
    IF consumer = '' OR length(consumer) > 128 THEN
        RAISE EXCEPTION 'consumer must be 1 to 128 characters long'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass your consumer''s name (a longer one would not fit the dedup index).';
    END IF;
    INSERT INTO inbox.messages (message_id, consumer) VALUES (claim.message_id, claim.consumer)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$$;

-- (uuid_at: any moment held to a UUIDv7's 48 bits of time)
CREATE OR REPLACE FUNCTION inbox.uuid_at(ts timestamptz) RETURNS uuid
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    -- held to the 48 bits of a UUIDv7's time: before 1970 the least UUIDv7, after 10889 the greatest
    RETURN (lpad(to_hex(greatest(0, least(281474976710655, floor(extract(epoch FROM ts) * 1000)))::bigint), 12, '0')
            || '70008000000000000000')::uuid;

-- (create_sink: a setting the kind would ignore is refused)
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
