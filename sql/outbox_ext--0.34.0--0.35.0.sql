-- outbox_ext 0.34.0 -> 0.35.0
--
-- Why: a sink that failed some requests for reasons of its own while it delivered others
-- counted those failures against their events: one instance of a receiver's several with an
-- old signing secret (401), an address that refused connections or a TLS certificate that
-- failed on one of them, a Kafka REST proxy timing out while a partition lacked in-sync
-- replicas. Such failures cannot come from what a request carries, so they now never count an
-- attempt: the events wait, in order, and go out when the request does. And a record a Kafka
-- REST v3 proxy refuses as too large (error code 413) is held back until its topic is shown to
-- take records, as one refused with Kafka's own code is, not dead-lettered at once. This is in
-- the worker's library; nothing in SQL changes.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.35.0'" to load this file. \quit
