-- outbox_ext: the inbox — dedup for idempotent consumers.
--
-- inbox.claim(message_id, consumer) inserts (message_id, consumer) with ON CONFLICT DO NOTHING,
-- in the caller's transaction, next to the effect it guards. The table is partitioned by
-- message_id: outbox event ids are UUIDv7, whose leading 48 bits are the Unix time in ms, so
-- id ranges are time ranges, the primary key holds across partitions, and the dedup window
-- (retention) is enforced by dropping old partitions. Ids that are not UUIDv7 dedup all the
-- same in the default partition.
--
-- Rerunnable: the 0.1.0 -> 0.2.0 upgrade script includes this file.
-- Name resolution (sql/grants.sql): inbox.claim is [pinned], uuid_at and uuid_time [parsed].

CREATE TABLE IF NOT EXISTS inbox.messages (
    message_id  uuid        NOT NULL,
    consumer    text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
) PARTITION BY RANGE (message_id);  -- each partition has its unique key (sql/partitions.sql)
COMMENT ON TABLE inbox.messages IS
    'Messages consumers have processed, for dedup; partitioned by message_id (UUIDv7 time).';

-- The smallest UUIDv7 of a moment, and the moment of a UUIDv7: partition bounds of the inbox.
CREATE OR REPLACE FUNCTION inbox.uuid_at(ts timestamptz) RETURNS uuid
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    -- held to the 48 bits of a UUIDv7's time: before 1970 the least UUIDv7, after 10889 the greatest
    RETURN (lpad(to_hex(greatest(0, least(281474976710655, floor(extract(epoch FROM ts) * 1000)))::bigint), 12, '0')
            || '70008000000000000000')::uuid;
COMMENT ON FUNCTION inbox.uuid_at(timestamptz) IS 'The smallest UUIDv7 made at a moment.';
CREATE OR REPLACE FUNCTION inbox.uuid_time(id uuid) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN to_timestamp(('x' || lpad(left(replace(id::text, '-', ''), 12), 16, '0'))::bit(64)::bigint / 1000.0);
COMMENT ON FUNCTION inbox.uuid_time(uuid) IS 'The time a UUIDv7 was made (meaningless for other UUIDs).';

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
COMMENT ON FUNCTION inbox.claim(uuid, text) IS
    'True if the caller''s transaction is the first to process this message for this consumer. '
    'A racing duplicate waits for the first transaction: false if it commits, true if it rolls back. '
    'Example: IF inbox.claim(event_id, ''billing'') THEN <apply the effect> END IF;';
