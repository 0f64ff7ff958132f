-- outbox_ext: what pg_dump writes. Of an extension's own tables pg_dump writes only those
-- marked here (their rows; CREATE EXTENSION makes the tables). Each line says why it is, or
-- is not, marked; sql/restore.sql says how a restored state is rebased.
--
-- Partitions: the default partitions belong to the extension and are marked; the dated ones
-- are made by outbox.maintain() (CREATE EXTENSION makes none), belong to no extension, and so
-- are dumped whole, like any table: definition, rows, index. Partitions of both kinds come
-- back attached to their parent.
--
-- Runs only in CREATE EXTENSION and ALTER EXTENSION UPDATE (pg_extension_config_dump refuses
-- anywhere else); marking a table again changes nothing.

SELECT pg_catalog.pg_extension_config_dump('outbox.events_default', '');        -- events no partition covered
SELECT pg_catalog.pg_extension_config_dump('inbox.messages_default', '');       -- inbox ids that are not UUIDv7
SELECT pg_catalog.pg_extension_config_dump('outbox.event_seq', '');             -- seqs go on after the dump's: order across a restore
SELECT pg_catalog.pg_extension_config_dump('outbox.consumers', '');             -- consumers and their retry policies
SELECT pg_catalog.pg_extension_config_dump('outbox.consumers_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox._shards', '');               -- what claims lock, per consumer
SELECT pg_catalog.pg_extension_config_dump('outbox._cursor_log', '');           -- cursors and leases (rebased on restore)
SELECT pg_catalog.pg_extension_config_dump('outbox._cursor_log_pos_seq', '');   -- the newest row is the cursor: positions go on
SELECT pg_catalog.pg_extension_config_dump('outbox._parked', '');               -- parked keys, with their attempts and backoff
SELECT pg_catalog.pg_extension_config_dump('outbox._parked_events', '');        -- their queues, in order
SELECT pg_catalog.pg_extension_config_dump('outbox._parked_events_pos_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.dead_letters', '');          -- dead letters, to replay
SELECT pg_catalog.pg_extension_config_dump('outbox.dead_letters_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.sinks', '');                 -- sinks, secrets included: guard your dumps
SELECT pg_catalog.pg_extension_config_dump('outbox._sink_stats', '');           -- delivered and failed totals go on
SELECT pg_catalog.pg_extension_config_dump('outbox.partition_config', '');      -- widths and retentions (over the defaults)
SELECT pg_catalog.pg_extension_config_dump('outbox._origin', '');               -- restoring it marks a restore
-- Not marked: outbox._marks (floors for transactions in progress, in the dumped cluster's
-- transaction ids: meaningless after a restore, and claims make new ones).
-- Not marked: outbox._seals and outbox._seal_breaks (what this cluster's maintain() saw of
-- open transactions; the restoring cluster's maintain() seals the restored log anew, claims
-- read every partition until then).
-- Not marked: outbox._reach (a restore starts without it: claims then read every partition
-- ahead of now until maintain() records it again).
