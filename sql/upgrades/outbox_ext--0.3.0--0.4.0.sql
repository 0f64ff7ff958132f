-- outbox_ext 0.3.0 -> 0.4.0
--
-- Why: 0.4.0 makes claims and bulk emit cheaper. Opening a commit window looks for the events
-- of late transactions one transaction at a time, on index entries (it read the heap of the
-- whole backlog before); the internal claim helpers no longer set search_path on every call
-- (the SECURITY DEFINER API functions that call them pin it). outbox.emit_many writes through
-- outbox._insert_many (Rust, new), as COPY does, and falls back to its INSERT. outbox.maintain()
-- drops old partitions before it creates new ones, each drop waiting at most a second for its
-- lock (a deadlock with readers was possible). Only functions change: events, consumers,
-- cursors, parked keys and dead letters are not touched.
--
-- Rerunnable. Each "-- @include" line stands for that file of sql/, expanded when the
-- extension is installed (scripts/lib.sh); freeze this file (expand them) when 0.5.0 changes
-- those files.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.4.0'" to load this file. \quit

-- As pgrx declares it (src/emit/insert.rs).
CREATE OR REPLACE FUNCTION outbox."_insert_many"(
    "aggregate_type" TEXT,
    "event_type" TEXT,
    "headers" jsonb,
    "topic" TEXT,
    "aggregate_ids" TEXT[],
    "payloads" anyarray,
    "shard_count" INT
) RETURNS uuid[]
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'insert_many_wrapper';

-- @include emit.sql
-- @include claim.sql
-- @include partitions.sql
-- @include grants.sql
