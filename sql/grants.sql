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
