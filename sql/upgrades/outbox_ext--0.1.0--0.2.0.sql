-- outbox_ext 0.1.0 -> 0.2.0
--
-- Why: 0.2.0 adds the inbox (inbox.claim: dedup for idempotent consumers) and partition
-- maintenance (outbox.maintain, outbox.partition_config, outbox.partitions), which replaces
-- outbox._ensure_partitions, and the outbox.status and outbox.shard_status views. Claims skip
-- work they did for nothing (two planner settings set on every page, a DELETE on every ack).
-- Events, consumers, cursors, parked keys and dead letters are not touched: pending events
-- stay pending, in order.
--
-- Rerunnable. Each "-- @include" line stands for that file of sql/, expanded when the
-- extension is installed (scripts/lib.sh); freeze this file (expand them) when 0.3.0 changes
-- those files.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.2.0'" to load this file. \quit

DROP FUNCTION IF EXISTS outbox._ensure_partitions(regclass, interval, int);
DROP FUNCTION IF EXISTS outbox._partition_name(text, timestamptz);  -- a parameter was renamed

-- @include emit.sql
-- @include claim.sql
-- @include inbox.sql
-- @include partitions.sql
-- @include status.sql
-- @include grants.sql
