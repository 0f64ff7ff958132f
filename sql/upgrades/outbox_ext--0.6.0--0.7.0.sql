-- outbox_ext 0.6.0 -> 0.7.0
--
-- Why: a relay settles a claimed batch in one call, outbox.settle(consumer, shard, epoch,
-- failures), and the rule that a failed key's later events wait behind it lives there, once,
-- instead of in every relay. If recording one failure fails, the rest of the batch still
-- settles and the key is parked with the reason. ack, nack and reject are thin forms of it.
--
-- Rerunnable. Each "-- @include" line stands for that file of sql/, expanded when the
-- extension is installed (scripts/lib.sh); freeze this file (expand them) when a later
-- version changes those files.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.7.0'" to load this file. \quit

-- @include claim.sql
-- @include grants.sql
