-- outbox_ext 0.36.0 -> 0.37.0
--
-- Why: a receiver's Retry-After given as an HTTP date in RFC 850 or asctime form (the obsolete
-- forms RFC 9110 still has recipients accept) was ignored, so its keys or the sink were tried
-- again on the backoff instead of when the receiver asked. The worker now reads all three
-- forms with the httpdate crate. A Kafka REST v3 reply cut short mid-stream was not understood
-- at all and every record of its request went again; now the reports before the cut count.
-- This is in the worker's library; nothing in SQL changes.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.37.0'" to load this file. \quit
