-- outbox_ext 0.30.0 -> 0.31.0
--
-- Why: the background worker could put more batches at risk of a second delivery than the
-- duplicate bound says, a settle that failed stalled its shard until the lease ran out, and a
-- sink dropped and made again under its name could have a late settle of the old sink's batch
-- taken for the new one's (whose events were then lost). A batch back from its delivery
-- thread now keeps its slot until its settle commits (before, the first of several batches
-- back at once claimed a batch for every slot, as if the others were settled already: a crash
-- then sent them all again); a settle that fails is tried again every second while the
-- batch's lease lasts, holding its slot, instead of being left to the lease (5 minutes by
-- default) and sent again; and a batch is settled only while its sink is the consumer it was
-- claimed for. These are in the worker's library; the worker now reads which consumer a sink
-- is (the grant below).

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.31.0'" to load this file. \quit

-- which consumer a batch was claimed for: a sink dropped and made again under its name is
-- another consumer, whose leases a late settle of the old one's batch must not touch
GRANT SELECT (id, name) ON outbox.consumers TO outbox_worker;
