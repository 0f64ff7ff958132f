-- outbox_ext 0.30.0 -> 0.31.0
--
-- Why: the background worker could put more batches at risk of a second delivery than the
-- duplicate bound says, and a settle that failed stalled its shard until the lease ran out.
-- A batch back from its delivery thread now keeps its slot until its settle commits (before,
-- the first of several batches back at once claimed a batch for every slot, as if the others
-- were settled already: a crash then sent them all again), and a settle that fails is tried
-- again every second while the batch's lease lasts, holding its slot, instead of being left
-- to the lease (5 minutes by default) and sent again. Both are in the worker's library; this
-- script changes no SQL object.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.31.0'" to load this file. \quit
