-- outbox_ext 0.33.0 -> 0.34.0
--
-- Why: a request that found a sink down (refused, reset, a 502) on a sink shown healthy for
-- other events counted an attempt for every event of its batch, also for the events it never
-- carried: a parked key's head that was to go alone after it, and events routed away from the
-- sink. A receiver that drops a request now and then while it delivers others so spent the
-- attempts of heads that were never sent, and could dead-letter them. Now only the events
-- that request carried are counted; the rest wait, uncounted, and events routed away are
-- skipped. This is in the worker's library; nothing in SQL changes.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.34.0'" to load this file. \quit
