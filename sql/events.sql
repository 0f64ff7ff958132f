-- outbox_ext: the event log.
--
-- Insert-only on the hot path and partitioned by time: storage is reclaimed by dropping
-- partitions, never by UPDATE or DELETE, so a long transaction holding back vacuum cannot
-- bloat it. Each row carries what a reader needs to read in commit order without gaps:
-- the writing transaction (txid), the emit order (seq) and the shard of its key.
-- Name resolution (sql/grants.sql): shard_of is [parsed]; defaults name pg_catalog's functions.

CREATE SEQUENCE outbox.event_seq AS bigint CACHE 1;
COMMENT ON SEQUENCE outbox.event_seq IS
    'Emit order of events. CACHE 1 on purpose: a per-session cache would break emit order across sessions.';

-- The shard count is fixed (outbox.shard_count(), from Rust, where native emit reads it).
-- shard_of is STRICT and IMMUTABLE so that the planner inlines it, count folded in, into
-- emit_many's INSERT; a call that is not inlined is re-planned on every execution.
COMMENT ON FUNCTION outbox.shard_count() IS 'Number of shards events are spread over (fixed).';

CREATE FUNCTION outbox.shard_of(aggregate_id text) RETURNS int
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN (((pg_catalog.hashtextextended(aggregate_id, 0) % outbox.shard_count())
             + outbox.shard_count()) % outbox.shard_count())::int;
COMMENT ON FUNCTION outbox.shard_of(text) IS
    'Shard of an aggregate id: every event of one key lands in one shard, which keeps its order.';

CREATE TABLE outbox.events (
    id             uuid        NOT NULL,
    topic          text,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb,
    headers        jsonb,
    created_at     timestamptz NOT NULL DEFAULT pg_catalog.now(),
    txid           xid8        NOT NULL DEFAULT pg_catalog.pg_current_xact_id(),
    seq            bigint      NOT NULL DEFAULT pg_catalog.nextval('outbox.event_seq'),
    shard          int         NOT NULL
) PARTITION BY RANGE (created_at);

-- The one index readers need, on every partition (outbox_internal._index_partition, which says why not
-- on this table): (shard, seq, txid), a shard's events in emit order. Claims page through a
-- commit window by seq (linear however large the window); txid is a key column so that window
-- bounds on it are checked in the index, without visiting the heap.

COMMENT ON TABLE outbox.events IS
    'The event log: one row per emitted event, written only by outbox.emit and outbox.emit_many.';
COMMENT ON COLUMN outbox.events.id IS 'Event id, a time-ordered UUID (v7); the idempotency key sinks see.';
COMMENT ON COLUMN outbox.events.topic IS 'Destination topic, or NULL for the sink''s routing default.';
COMMENT ON COLUMN outbox.events.aggregate_id IS 'The key: events of one key are delivered in commit order.';
COMMENT ON COLUMN outbox.events.txid IS 'Writing transaction; readers use it to read in commit order.';
COMMENT ON COLUMN outbox.events.seq IS
    'Emit order; orders events inside one commit window. Taken after the transaction has its xid '
    '(emit assigns it first), which claims rely on: a transaction whose xid is newer than a '
    'snapshot has only events with a seq above the seq read before that snapshot.';
COMMENT ON COLUMN outbox.events.shard IS 'outbox.shard_of(aggregate_id).';
