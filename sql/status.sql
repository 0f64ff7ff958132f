-- outbox_ext: what is left to deliver, per consumer and per shard, and why.
--
-- What is pending is outbox_internal._pending's answer (sql/cursors.sql), for the events above
-- outbox_internal._pending_floor, which bounds the index scan. A view of it costs O(consumers x shards),
-- however many events the log holds: each shard's pending events are counted exactly up to
-- 500 and extrapolated beyond (outbox_internal._shard_pending).
--
-- Name resolution (sql/grants.sql): both views are [parsed] and run as their owner;
-- _shard_pending is [pinned] (the views call it as whoever reads them).

-- A consumer's pending events in one shard (for a sink, those its routing delivers), read in
-- seq order from the cursor's floor: counted up to cap; when there are more, the rest is
-- estimated from their density in seq over the seq range still ahead. oldest: the oldest
-- pending event's created_at (of the first cap, which start at the oldest seq).
CREATE OR REPLACE FUNCTION outbox_internal._shard_pending(cur outbox._cursor_log, sink outbox.sinks,
                                                 OUT events bigint, OUT oldest timestamptz)
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    cap       constant int := 500;   -- 16 shards: 8,000 rows a consumer at most
    floor_seq bigint := outbox_internal._pending_floor(cur);
    since     timestamptz := outbox_internal._since(floor_seq, outbox_internal._newest_seal());
    until     timestamptz := outbox_internal._reach();
    first_seq bigint;
    last_seq  bigint;
BEGIN
    SELECT count(*), min(p.created_at), min(p.seq), max(p.seq) INTO events, oldest, first_seq, last_seq
      FROM (SELECT e.created_at, e.seq FROM outbox.events e
             WHERE e.shard = cur.shard AND e.seq > floor_seq AND e.created_at >= since AND e.created_at < until
               AND outbox_internal._pending(cur, e.txid, e.seq)
               AND (sink.name IS NULL OR outbox_internal._routes(sink, e.topic, e.aggregate_type))
             ORDER BY e.seq LIMIT cap) AS p;
    IF events = cap THEN
        events := events + (coalesce(pg_sequence_last_value('outbox.event_seq'), last_seq) - last_seq)
                           * cap / greatest(last_seq - first_seq + 1, cap);
    END IF;
END
$$;

CREATE OR REPLACE VIEW outbox.shard_status AS
SELECT c.name AS consumer,
       cur.shard,
       pend.events AS pending,
       pend.oldest AS oldest_pending_at,
       now() - pend.oldest AS lag,
       (SELECT count(*) FROM outbox._parked p WHERE p.consumer_id = c.id AND p.shard = cur.shard) AS parked_keys,
       CASE WHEN cur.owner IS NOT NULL AND cur.lease_until > now() THEN cur.owner END AS leased_by,
       cur.at AS last_activity
  FROM outbox.consumers c
  LEFT JOIN outbox.sinks k ON k.name = c.name
 CROSS JOIN generate_series(0, outbox.shard_count() - 1) AS s(shard)
 CROSS JOIN LATERAL (SELECT * FROM outbox._cursor_log l
                      WHERE l.consumer_id = c.id AND l.shard = s.shard
                      ORDER BY l.pos DESC LIMIT 1) AS cur
 CROSS JOIN LATERAL outbox_internal._shard_pending(cur, k) AS pend;  -- a sink's: only what it routes
COMMENT ON VIEW outbox.shard_status IS
    'Per consumer and shard: pending events (exact up to 500, estimated beyond), the oldest one '
    'and its age, parked keys, who holds the lease.';

CREATE OR REPLACE VIEW outbox.status AS
SELECT s.consumer,
       sum(s.pending)::bigint AS pending,
       min(s.oldest_pending_at) AS oldest_pending_at,
       now() - min(s.oldest_pending_at) AS lag,
       sum(s.parked_keys)::bigint AS parked_keys,
       (SELECT count(*) FROM outbox._parked_events q JOIN outbox.consumers c ON c.id = q.consumer_id
         WHERE c.name = s.consumer) AS parked_events,
       (SELECT count(*) FROM outbox.dead_letters d WHERE d.consumer = s.consumer) AS dead_letters,
       coalesce((SELECT p.last_error FROM outbox._parked p JOIN outbox.consumers c ON c.id = p.consumer_id
                  WHERE c.name = s.consumer ORDER BY p.parked_at DESC LIMIT 1),
                (SELECT d.last_error FROM outbox.dead_letters d WHERE d.consumer = s.consumer
                  ORDER BY d.id DESC LIMIT 1)) AS last_error,
       count(s.leased_by) AS shards_leased,
       max(s.last_activity) AS last_activity,
       (SELECT count(*) FROM outbox.events_default) AS events_in_default_partition,
       k.kind AS sink_kind,
       k.enabled AS sink_enabled,
       -- the worker's figures (outbox._sink_stats), written every two seconds while it runs
       CASE WHEN st.updated_at > now() - interval '10 seconds' THEN st.per_second ELSE 0 END
           AS delivered_per_second,
       st.delivered AS delivered_total,
       st.failed AS failed_total,
       st.last_delivered_at,
       st.last_error AS last_sink_error,
       st.last_error_at AS last_sink_error_at,
       -- every event not yet delivered: pending in the log, and waiting behind parked keys
       sum(s.pending)::bigint
           + (SELECT count(*) FROM outbox._parked_events q JOIN outbox.consumers c ON c.id = q.consumer_id
               WHERE c.name = s.consumer) AS undelivered,
       -- the sink's health (src/worker/health.rs), as the worker last wrote it
       CASE WHEN k.name IS NULL THEN NULL
            WHEN NOT k.enabled THEN 'disabled'
            ELSE coalesce(st.state, 'healthy') END AS sink_state,
       CASE WHEN k.enabled THEN st.state_reason END AS sink_state_reason,
       CASE WHEN k.enabled THEN st.state_since END AS sink_state_since,
       CASE WHEN k.enabled THEN st.next_probe_at END AS sink_next_probe_at,
       st.suspensions AS sink_suspensions
  FROM outbox.shard_status s
  LEFT JOIN outbox.sinks k ON k.name = s.consumer
  LEFT JOIN outbox._sink_stats st ON st.sink = s.consumer
 GROUP BY s.consumer, k.name, st.sink;
COMMENT ON VIEW outbox.status IS
    'One row per consumer (a sink is one): pending events and lag, parked keys and events, dead '
    'letters, the last error, leased shards, events waiting in the default partition '
    '(outbox.maintain() moves them), for a sink the worker''s delivery rate and last error, '
    'every event not yet delivered (undelivered: watch this one), and the sink''s state '
    '(healthy, suspended with its reason, since and next probe, or disabled). '
    'Example: SELECT consumer, undelivered, lag, dead_letters, sink_state, sink_state_reason FROM outbox.status;';
