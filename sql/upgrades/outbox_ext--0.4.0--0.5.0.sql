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
-- Rerunnable. Each "-- @include" line stands for that file of sql/, expanded when the
-- extension is installed (scripts/lib.sh); freeze this file (expand them) when 0.6.0 changes
-- those files.
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

-- @include emit.sql
-- @include partitions.sql
-- @include grants.sql
