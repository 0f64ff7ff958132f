-- outbox_ext 0.2.0 -> 0.3.0
--
-- Why: 0.3.0 delivers. It adds sinks (outbox.sinks, outbox.create_sink, outbox.drop_sink) for
-- the background worker, outbox.reject (dead-letter an event at once, e.g. after an HTTP 4xx)
-- and outbox.release_owner (give back a dead relay's batches), and delivery figures in
-- outbox.status. outbox._head_failed gains a parameter (whether the failure is final).
-- Events, consumers, cursors, parked keys and dead letters are not touched.
--
-- Rerunnable. Each "-- @include" line stands for that file of sql/, expanded when the
-- extension is installed (scripts/lib.sh); freeze this file (expand them) when 0.4.0 changes
-- those files.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.3.0'" to load this file. \quit

DROP FUNCTION IF EXISTS outbox._head_failed(outbox.consumers, text, text, interval, bigint);

-- @include claim.sql
-- @include sinks.sql
-- @include status.sql
-- @include grants.sql
