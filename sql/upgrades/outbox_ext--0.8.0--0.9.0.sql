-- outbox_ext 0.8.0 -> 0.9.0
--
-- Why: a claim with nothing to read (an idle relay's poll, the worker's fallback poll) locked
-- every shard, took an xid and wrote a commit record to find that out, at about 2.5 ms.
-- outbox._may_have_work asks every shard at once, read-only, and claim and settle_and_claim
-- stop there when it says no. The "no write before a claim" rule moves into _check_claim, so
-- that it holds whatever the backlog, and _claim_bound loses its argument.
--
-- Rerunnable. Each "-- @include" line stands for that file of sql/, expanded when the
-- extension is installed (scripts/lib.sh); freeze this file (expand them) when a later
-- version changes those files.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.9.0'" to load this file. \quit

DROP FUNCTION IF EXISTS outbox._claim_bound(text);

-- @include claim.sql
-- @include grants.sql
