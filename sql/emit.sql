-- outbox_ext: emit. Writes events in the caller's transaction: they exist if and only if it
-- commits. Validation and ids come from Rust (src/emit); a bad row raises and the statement
-- writes nothing. Rerunnable.
-- Name resolution (sql/grants.sql): emit is [native], emit_many [pinned].

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
    tx  xid8;
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
    ids := outbox_internal._insert_many(aggregate_type, event_type, headers, topic, aggregate_ids, payloads);
    IF ids IS NULL THEN
        ids := outbox_internal._batch_ids(aggregate_type, event_type, headers, topic, aggregate_ids,
                                 (SELECT max(pg_column_size(p)) FROM unnest(payloads) AS p));
        -- after the checks (a read-only transaction is refused before it takes an xid), before
        -- any seq is taken: see events.seq
        tx := pg_current_xact_id();
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
