-- outbox_ext 0.7.0 -> 0.8.0
--
-- Why: the worker produces to Kafka brokers itself (sink kind kafka, librdkafka), whole
-- batches in per-key order, instead of only through a REST proxy. outbox.sinks gains the
-- producer's settings (compression, linger, SASL mechanism and user; the password is the
-- sink's secret), create_sink takes them, and the native settings check learns kafka:// URLs.
-- maintain() reads the partitions once per run, not once per step.
--
-- Rerunnable. Each "-- @include" line stands for that file of sql/, expanded when the
-- extension is installed (scripts/lib.sh); freeze this file (expand them) when a later
-- version changes those files.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.8.0'" to load this file. \quit

-- a SQL-standard function body depends on the row type it takes (sinks.sql makes it again)
DROP FUNCTION IF EXISTS outbox._routes(outbox.sinks, text, text);
ALTER TABLE outbox.sinks ADD COLUMN IF NOT EXISTS compression text,
                         ADD COLUMN IF NOT EXISTS linger interval NOT NULL DEFAULT '5 milliseconds',
                         ADD COLUMN IF NOT EXISTS sasl_mechanism text,
                         ADD COLUMN IF NOT EXISTS sasl_username text;

DROP FUNCTION IF EXISTS outbox.create_sink(text, text, text, text[], text[], text, int, int, interval, interval, text, jsonb, text, jsonb, text, int, interval, interval, boolean);
DROP FUNCTION IF EXISTS outbox._check_sink_settings(text, jsonb, text);

-- As pgrx declares it (src/sinks/check.rs).
CREATE OR REPLACE FUNCTION outbox."_check_sink_settings"(
	"kind" TEXT, /* Option < & str > */
	"url" TEXT, /* Option < & str > */
	"secret" TEXT, /* Option < & str > */
	"http_headers" jsonb, /* Option < JsonB > */
	"tls_ca" TEXT /* Option < & str > */
) RETURNS void
IMMUTABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'check_sink_settings_of_kind_wrapper';

-- @include sinks.sql
-- @include partitions.sql
-- @include grants.sql
