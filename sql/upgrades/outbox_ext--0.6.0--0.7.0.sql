-- outbox_ext 0.6.0 -> 0.7.0
--
-- Why: a relay settles a claimed batch in one call, outbox.settle(consumer, shard, epoch,
-- failures), and the rule that a failed key's later events wait behind it lives there, once,
-- instead of in every relay. If recording one failure fails, the rest of the batch still
-- settles and the key is parked with the reason. ack, nack and reject are thin forms of it;
-- settle_and_claim settles and claims in one round trip.
-- Plans of the claim path no longer depend on the table statistics of the moment they were
-- made (the API functions pin planner settings), an empty shard costs one index probe, and
-- outbox.status costs O(consumers x shards) however long the log (pending counted exactly up
-- to 1,000 per shard, extrapolated beyond). maintain() with nothing to do reads the partitions
-- once, not once per partition ahead.
--
-- Rerunnable. Each "-- @include" line stands for that file of sql/, expanded when the
-- extension is installed (scripts/lib.sh); freeze this file (expand them) when a later
-- version changes those files.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.7.0'" to load this file. \quit

DROP FUNCTION IF EXISTS outbox._claim_shard(outbox.consumers, int, int, interval, text, bigint, xid8);

-- @include claim.sql
-- @include status.sql
-- @include partitions.sql
-- @include grants.sql
