-- outbox_ext 0.21.0 -> 0.22.0
--
-- Why: a sink's own failure (an expired credential, a deploy answering 5xx, a rate limit, a topic
-- not made yet) was blamed on its events, which were dead-lettered; a replay then broke per-key
-- order. The worker now judges failures by evidence (src/worker/health.rs): a failure counts
-- against an event only when the sink is shown healthy for other events; otherwise the batch is
-- given back unattempted and the sink suspended and probed. For that, settle takes failures that
-- were not attempted ("attempted": false: the key waits, no attempt counted); the worker records
-- each sink's state in outbox._sink_stats and outbox.status shows it, with every undelivered
-- event counted (undelivered); admins pause and resume sinks with pause_sink / resume_sink.
-- And a batch given back (release, release_owner) after a nack no longer queues the key's
-- earlier events of the batch behind the failed one: what the batch parked is unparked.
-- outbox.maintain() becomes a short driver over phases (outbox_internal._maint_*), so that a
-- later change to one phase is one CREATE OR REPLACE.
-- Outside SQL: the native Kafka sink's format 'debezium' now produces exactly the records of
-- Debezium's outbox event router as the README configures it (tested against Debezium 3.6.1):
-- the payload as compact JSON, and the event's headers as one outbox-headers header (a null
-- value when it has none) instead of one header each. Consumers of that format that read the
-- event's headers one by one read outbox-headers instead.
--
-- A delta: what changed from 0.21.0 to 0.22.0, rerunnable. Released: never edit it.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.22.0'" to load this file. \quit

DO $type$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid OPERATOR(pg_catalog.=) 'outbox_internal._failure'::pg_catalog.regclass
                      AND a.attname OPERATOR(pg_catalog.=) 'attempted' AND NOT a.attisdropped) THEN
        ALTER TYPE outbox_internal._failure ADD ATTRIBUTE attempted boolean;
    END IF;
END
$type$;

ALTER TABLE outbox._sink_stats
    ADD COLUMN IF NOT EXISTS state         text        NOT NULL DEFAULT 'healthy',
    ADD COLUMN IF NOT EXISTS state_reason  text,
    ADD COLUMN IF NOT EXISTS state_since   timestamptz,
    ADD COLUMN IF NOT EXISTS next_probe_at timestamptz,
    ADD COLUMN IF NOT EXISTS suspensions   bigint      NOT NULL DEFAULT 0;

-- settle's failures argument, a JSON array of {"id", "error", "retry_after", "final",
-- "attempted"}: checked, as unresolved failures. retry_after is a number of seconds or an
-- interval's text; attempted (default true) false for an event the sink never judged.
CREATE OR REPLACE FUNCTION outbox_internal._failures(failures jsonb) RETURNS outbox_internal._failure[]
    LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    i    int := 0;
    f    jsonb;
    one  outbox_internal._failure;
    list outbox_internal._failure[] := '{}';
BEGIN
    IF jsonb_typeof(failures) IS DISTINCT FROM 'array' THEN
        RAISE EXCEPTION 'failures must be a JSON array'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass ''[]'' when every event was delivered.';
    ELSIF jsonb_array_length(failures) = 0 THEN
        RETURN list;  -- the common case, without the subtransaction below
    END IF;
    BEGIN
        FOR f IN SELECT jsonb_array_elements(failures) LOOP
            i := i + 1;
            IF jsonb_typeof(f) <> 'object' OR f ->> 'id' IS NULL
               OR f - ARRAY['id', 'error', 'retry_after', 'final', 'attempted'] <> '{}' THEN
                RAISE EXCEPTION 'not an object with an id and nothing but error, retry_after, final and attempted'
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            one.event_id := (f ->> 'id')::uuid;
            one.error := f ->> 'error';
            one.retry_after := CASE jsonb_typeof(f -> 'retry_after')
                                   WHEN 'number' THEN make_interval(secs => (f ->> 'retry_after')::float8)
                                   ELSE (f ->> 'retry_after')::interval END;
            one.final := coalesce((f -> 'final')::boolean, false);
            one.attempted := coalesce((f -> 'attempted')::boolean, true);
            IF one.final AND NOT one.attempted THEN
                RAISE EXCEPTION 'a failure not attempted cannot be final'
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            PERFORM outbox_internal._check_failure(one.event_id, one.retry_after);
            list := list || one;
        END LOOP;
    EXCEPTION WHEN data_exception THEN  -- a bad uuid, interval or boolean, or the checks above
        RAISE EXCEPTION 'failure % of failures is invalid: %', i, SQLERRM
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = format('It is %s.', f),
                  HINT = 'A failure is {"id": "<event id>", "error": "<text>", "retry_after": '
                         '<seconds or interval text, optional>, "final": <true to dead-letter it now, optional>, '
                         '"attempted": <false when the sink never judged it, optional>}.';
    END;
    RETURN list;
END
$$;

-- The head of a parked key was not attempted (the sink throttled, lacked its topic, ran out of
-- time): nothing is counted and nothing dead-lettered; the retry is scheduled as if the
-- current attempt had failed.
CREATE OR REPLACE FUNCTION outbox_internal._head_waits(c outbox.consumers, key text, error text,
                                              retry_after interval, epoch bigint) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    UPDATE outbox._parked p
       SET last_error = error, nacked_epoch = epoch,
           next_attempt_at = now() + coalesce(retry_after, outbox_internal._backoff(c, greatest(p.attempts, 1)))
     WHERE p.consumer_id = c.id AND p.aggregate_id = key;
END
$$;

-- Record a key's failure, f being its first failed event in the batch. A head counts a failed
-- attempt of its queue (not when f was not attempted: then it only waits). An event of the
-- window parks its key: it and the key's later events of the batch are queued, in order.
-- Returns how many events of the batch this kept back.
-- A failure of the key reported earlier for this batch (nack, reject) already queued or
-- dead-lettered its events from some point on: reported again from there or after, nothing
-- changes; from before it, the events in between would be acked unsent, so that is refused.
CREATE OR REPLACE FUNCTION outbox_internal._fail_key(c outbox.consumers, cur outbox._cursor_log,
                                            batch outbox.events[], f outbox_internal._failure) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    later       outbox.events[];
    parked      int;
    key_events  uuid[];
    failed_from bigint;
BEGIN
    IF NOT f.head THEN
        key_events := ARRAY(SELECT b.id FROM unnest(batch) b WHERE b.aggregate_id = f.aggregate_id);
        failed_from := least(
            (SELECT min(q.seq) FROM outbox._parked_events q
              WHERE q.consumer_id = c.id AND q.aggregate_id = f.aggregate_id AND q.id = ANY (key_events)),
            (SELECT min(d.seq) FROM outbox.dead_letters d
              WHERE d.consumer = c.name AND d.aggregate_id = f.aggregate_id AND d.event_id = ANY (key_events)));
        IF f.seq < failed_from THEN
            RAISE EXCEPTION 'event % comes before an event of its key already reported failed in this batch',
                    f.event_id
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Report a key''s failures in batch order, or all at once with outbox.settle.';
        ELSIF failed_from IS NOT NULL THEN
            RETURN 0;  -- the key failed in this batch already, from this event or before it
        END IF;
        INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
        VALUES (c.id, f.aggregate_id, cur.shard, now())
        ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS parked = ROW_COUNT;
        later := ARRAY(SELECT b FROM unnest(batch) b
                        WHERE b.aggregate_id = f.aggregate_id AND b.seq >= f.seq ORDER BY b.seq);
        PERFORM outbox_internal._queue_parked(c.id, later);
        IF parked = 0 THEN
            RETURN cardinality(later);  -- parked meanwhile (a replay): they wait behind its queue
        END IF;
    END IF;
    IF f.attempted IS FALSE THEN
        PERFORM outbox_internal._head_waits(c, f.aggregate_id, f.error, f.retry_after, cur.epoch);
    ELSE
        PERFORM outbox_internal._head_failed(c, f.aggregate_id, f.error, f.retry_after, cur.epoch, f.final);
    END IF;
    RETURN CASE WHEN f.head THEN 1 ELSE cardinality(later) END;
END
$$;

-- nack and reject: one event failed; the batch stays out until settle or ack.
CREATE OR REPLACE FUNCTION outbox_internal._fail(consumer text, shard int, epoch bigint, event_id uuid, error text,
                                        retry_after interval, final boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    c     outbox.consumers := outbox_internal._consumer(consumer);
    cur   outbox._cursor_log;
    batch outbox.events[];
    f     outbox_internal._failure := ROW(event_id, NULL, NULL, NULL, error, retry_after, final, true);
BEGIN
    PERFORM outbox_internal._check_failure(event_id, retry_after);
    cur := outbox_internal._leased(c.id, shard, epoch);
    batch := CASE WHEN event_id = ANY (cur.heads) THEN '{}' ELSE outbox_internal._batch(cur) END;
    f := outbox_internal._resolve(c, cur, batch, f);
    IF f.aggregate_id IS NOT NULL THEN
        PERFORM outbox_internal._fail_key(c, cur, batch, f);
    END IF;
END
$$;

COMMENT ON FUNCTION outbox.settle(text, int, bigint, jsonb) IS
    'Finishes a claimed batch in one call. failures lists the events that failed, as a JSON array '
    'of {"id", "error", "retry_after" (seconds or interval text, optional), "final" (true: '
    'dead-letter now), "attempted" (false: not sent, e.g. the sink throttled; no attempt is '
    'counted)}; a failed key''s later events in the batch wait behind it, in order, '
    'whatever was said of them; every other event counts as delivered and the shard moves on. '
    'Returns how many events were kept back. Example: SELECT outbox.settle(''hook'', 3, 17, '
    '''[{"id": "0190...", "error": "HTTP 503", "retry_after": 30}]'');';

-- By hand: an admin stops a sink's deliveries (enabled = false: the worker lets go of it; batches
-- out are settled as they come back) and starts them again. Resuming also ends a suspension at
-- once: the worker starts afresh with a changed row (updated_at), without waiting for a probe.
-- With the caller's rights, like create_sink: the UPDATE needs outbox_admin's.
CREATE OR REPLACE FUNCTION outbox.pause_sink(name text) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'name must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass name to outbox.pause_sink; the README lists every argument.';
    END IF;
    UPDATE outbox.sinks s SET enabled = false WHERE s.name OPERATOR(pg_catalog.=) pause_sink.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'sink "%" does not exist', name
            USING ERRCODE = 'undefined_object', HINT = 'SELECT name FROM outbox.sinks lists them.';
    END IF;
END
$$;
COMMENT ON FUNCTION outbox.pause_sink(text) IS
    'Stops the worker delivering to the sink (its events wait; outbox.status shows it '
    'disabled) until outbox.resume_sink. Example: SELECT outbox.pause_sink(''billing'');';

CREATE OR REPLACE FUNCTION outbox.resume_sink(name text) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'name must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass name to outbox.resume_sink; the README lists every argument.';
    END IF;
    -- always an update, enabled or not: a new updated_at makes the worker start afresh
    UPDATE outbox.sinks s SET enabled = true WHERE s.name OPERATOR(pg_catalog.=) resume_sink.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'sink "%" does not exist', name
            USING ERRCODE = 'undefined_object', HINT = 'SELECT name FROM outbox.sinks lists them.';
    END IF;
END
$$;
COMMENT ON FUNCTION outbox.resume_sink(text) IS
    'Starts delivering to a paused sink again; on a suspended sink, ends the suspension and '
    'delivers at once (e.g. after fixing what made every request fail). '
    'Example: SELECT outbox.resume_sink(''billing'');';

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

-- A batch given back (release) after nack parked keys of it: a key that this batch parked
-- (its queue holds only events of this batch's page, none of them a parked head it handed out)
-- is unparked, its queue dropped, as if the batch had never been claimed. The shard reads the
-- page again, so the key's events come back in order: kept, the earlier ones would be queued
-- behind the failed one. A key parked before (its head handed out and nacked) keeps its queue
-- and the attempt counted.
CREATE OR REPLACE FUNCTION outbox_internal._unpark_released(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    DELETE FROM outbox._parked p
     WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch
       AND NOT EXISTS (SELECT FROM outbox._parked_events q
                        WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                          AND (q.id = ANY (cur.heads) OR q.seq <= coalesce(cur.after_seq, 0)
                               OR q.seq > coalesce(cur.batch_end, 0)));
END
$$;

CREATE OR REPLACE FUNCTION outbox.release(consumer text, shard int, epoch bigint,
                               retry_after interval DEFAULT '0') RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c   outbox.consumers := outbox_internal._consumer(consumer);
    cur outbox._cursor_log;
BEGIN
    PERFORM outbox_internal._not_null(retry_after IS NULL, 'retry_after', 'outbox.release');
    PERFORM outbox_internal._check_interval(retry_after, 'retry_after', '30 days', true);
    cur := outbox_internal._leased(c.id, shard, epoch);
    PERFORM outbox_internal._unpark_released(c, cur);
    cur.owner := NULL;
    cur.lease_until := CASE WHEN retry_after > '0' THEN now() + retry_after END;
    cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
    PERFORM outbox_internal._append(cur);
END
$$;
COMMENT ON FUNCTION outbox.release(text, int, bigint, interval) IS
    'Gives a claimed batch back undelivered (e.g. the sink is down): the shard stays where it was '
    'and is not claimed again before retry_after. Example: SELECT outbox.release(''hook'', 3, 17, ''5 s'');';

CREATE OR REPLACE FUNCTION outbox.release_owner(consumer text, owner text) RETURNS int
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c   outbox.consumers := outbox_internal._consumer(consumer);
    s   int;
    cur outbox._cursor_log;
    n   int := 0;
BEGIN
    PERFORM outbox_internal._not_null(owner IS NULL, 'owner', 'outbox.release_owner');
    FOR s IN SELECT sh.shard FROM outbox._shards sh WHERE sh.consumer_id = c.id
              ORDER BY sh.shard FOR UPDATE LOOP
        cur := outbox_internal._cursor(c.id, s);
        CONTINUE WHEN cur.owner IS DISTINCT FROM release_owner.owner OR cur.lease_until <= now();
        PERFORM outbox_internal._unpark_released(c, cur);
        cur.owner := NULL; cur.lease_until := NULL;
        cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
        PERFORM outbox_internal._append(cur);
        n := n + 1;
    END LOOP;
    RETURN n;
END
$$;
COMMENT ON FUNCTION outbox.release_owner(text, text) IS
    'Gives back every batch a relay (by its claim owner name) holds for the consumer, e.g. after '
    'the relay died; its late acks are refused. Returns how many. '
    'Example: SELECT outbox.release_owner(''hook'', ''relay-7'');';

-- outbox.maintain() as a driver over phases, one function each
-- What maintain() reports, one row per action; and what a phase that spends the run's budget
-- returns: its rows, how much of the budget it used, whether it changed the partitions.
DO $type$
BEGIN
    CREATE TYPE outbox_internal._maint_row AS (action text, relation text, detail text);
EXCEPTION WHEN duplicate_object THEN NULL;  -- rerun: the type is there
END
$type$;
DO $type$
BEGIN
    CREATE TYPE outbox_internal._maint_step AS (rows outbox_internal._maint_row[], used int, changed boolean);
EXCEPTION WHEN duplicate_object THEN NULL;  -- rerun: the type is there
END
$type$;

-- Phase 0: one run at a time, under a lock that no other role can hold (any role can hold an
-- advisory lock, or a weaker table lock: a statement it may PREPARE takes one). Waited for
-- briefly, not NOWAIT: a statement any role may try takes this lock for an instant before the
-- check that refuses it (CREATE STATISTICS, COMMENT ON), and repeated, it would make every run
-- that came in that instant skip. Another run holds it far longer. Returns why the run is
-- skipped, or NULL (the lock is then held to the end of the transaction).
CREATE OR REPLACE FUNCTION outbox_internal._maint_lock() RETURNS text
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    old_timeout text := current_setting('lock_timeout');
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', '100ms', true);
        LOCK TABLE outbox.partition_config IN SHARE UPDATE EXCLUSIVE MODE;
        PERFORM set_config('lock_timeout', old_timeout, true);
    EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
        RETURN 'another outbox.maintain() is running';
    END;
    IF outbox_internal._restore_running() THEN  -- its partitions would collide with the dump's
        RETURN 'a restore into this database is running';
    END IF;
    RETURN NULL;
END
$$;

-- Phase 1: a database restored from a dump (sql/restore.sql) is rebased; the guard on emits goes
-- in a later run, once the rebase is committed (dropping it here would wait for emits that wait
-- for us). Waits at most a second for the events table.
CREATE OR REPLACE FUNCTION outbox_internal._maint_rebase() RETURNS SETOF outbox_internal._maint_row
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    rebased     boolean := outbox_internal._rebase_if_restored();
    old_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    IF NOT rebased AND EXISTS (SELECT FROM pg_trigger t WHERE t.tgrelid = 'outbox.events'::regclass
                                                        AND t.tgname = 'rebase_before_emit')
       AND NOT (SELECT o.restore_pending FROM outbox._origin o) THEN
        BEGIN  -- rebased: emits need not stop by any more, and write natively again
            DROP TRIGGER rebase_before_emit ON outbox.events;
            RETURN NEXT ROW('rebased', 'outbox.events', 'restored from a dump; rebased')::outbox_internal._maint_row;
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;  -- in use: the next run
        END;
    END IF;
    PERFORM set_config('lock_timeout', old_timeout, true);
END
$$;

-- Phase 2: partitions past retention, oldest first: dropped or detached, never with undelivered
-- events. A drop needs the parent's ACCESS EXCLUSIVE lock; waited for after creating a
-- partition (which locks the default partition) it could deadlock with a reader that holds the
-- parent and goes on to the default partition, so this phase comes first. Each waits at most a
-- second: a long reader must not queue every emit behind the drop; the next run tries again.
-- Looks at most at twice budget partitions (a kept one is locked too).
CREATE OR REPLACE FUNCTION outbox_internal._maint_retire(parts outbox.partitions[], budget int)
RETURNS outbox_internal._maint_step
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    cfg         outbox.partition_config;
    p           outbox.partitions;
    step        outbox_internal._maint_step := ROW('{}', 0, false);
    looks       int := 2 * budget;
    why         text;
    part        text;
    old_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    FOR cfg IN SELECT * FROM outbox.partition_config LOOP
        -- (never one that ends after now, whatever the retention: an interval such as
        -- '-1 mon +30 days' passes its CHECK and is still a day ahead in some months)
        FOR p IN SELECT * FROM unnest(parts) x
                  WHERE x.parent = cfg.parent AND NOT x.is_default
                    AND x.upper <= least(now() - cfg.retention, now())
                  ORDER BY x.lower LOOP
            IF step.used = budget OR looks = 0 THEN
                step.rows := step.rows || ROW('deferred', cfg.parent::text,
                    'more partitions past retention than one run takes: the next run goes on')::outbox_internal._maint_row;
                EXIT;
            END IF;
            looks := looks - 1;
            part := p.partition::text;  -- named while it exists
            BEGIN
                IF cfg.parent = 'outbox.events'::regclass THEN
                    why := outbox_internal._partition_pending(p.partition, p.upper);
                    IF why IS NOT NULL THEN
                        step.rows := step.rows || ROW('kept', part, 'past retention, but ' || why)::outbox_internal._maint_row;
                        CONTINUE;
                    END IF;
                END IF;
                -- Partitions made by CREATE EXTENSION belong to the extension, which would refuse
                -- to let them go (and would drop a detached one with itself): release them first.
                IF EXISTS (SELECT FROM pg_depend d
                            WHERE d.classid = 'pg_class'::regclass AND d.objid = p.partition
                              AND d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e') THEN
                    EXECUTE format('ALTER EXTENSION outbox_ext DROP TABLE %s', part);
                END IF;
                IF cfg.detach THEN
                    EXECUTE format('ALTER TABLE %s DETACH PARTITION %s', cfg.parent, part);
                    step.rows := step.rows || ROW('detached', part, NULL)::outbox_internal._maint_row;
                ELSE
                    EXECUTE format('DROP TABLE %s', part);
                    step.rows := step.rows || ROW('dropped', part, NULL)::outbox_internal._maint_row;
                END IF;
                step.changed := true;
                step.used := step.used + 1;
            EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
                -- A deadlock: a transaction that holds the inbox and waits for the events table
                -- (inbox.claim, then emit) while this run, having dropped an events partition,
                -- waits for the inbox. This run gives way; the transaction goes on once it ends.
                step.rows := step.rows || ROW('kept', part, 'past retention, but in use ('
                    || CASE SQLSTATE WHEN '40P01' THEN 'deadlock' ELSE 'lock timeout' END || '): next run')::outbox_internal._maint_row;
            END;
        END LOOP;
    END LOOP;
    PERFORM set_config('lock_timeout', old_timeout, true);
    RETURN step;
END
$$;

-- Phase 3: rows of a parent that landed in its default partition: reported (a WARNING) and moved
-- into partitions made for them, at most budget partitions.
CREATE OR REPLACE FUNCTION outbox_internal._maint_move_default(cfg outbox.partition_config,
                                                        parts outbox.partitions[], budget int)
RETURNS outbox_internal._maint_step
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    step    outbox_internal._maint_step := ROW('{}', 0, false);
    lo_at   timestamptz;
    created regclass;
BEGIN
    FOR lo_at IN EXECUTE format(
            'SELECT DISTINCT outbox_internal._floor_time(%s, %L) FROM %s %s ORDER BY 1 LIMIT %s',
            outbox_internal._key_time(cfg.parent), cfg.width,
            (SELECT d.partition FROM unnest(parts) d WHERE d.parent = cfg.parent AND d.is_default),
            CASE WHEN cfg.parent = 'inbox.messages'::regclass
                 THEN outbox_internal._inbox_ids_to_move(cfg) ELSE '' END,
            budget + 1)
    LOOP
        IF step.used = budget THEN
            step.rows := step.rows || ROW('deferred', cfg.parent::text,
                'rows of more partitions in the default partition than one run takes: the next run goes on')::outbox_internal._maint_row;
            EXIT;
        END IF;
        step.used := step.used + 1;
        created := outbox_internal._create_partition(cfg.parent, lo_at, cfg.width);
        IF created IS NOT NULL THEN
            step.changed := true;
            RAISE WARNING 'outbox.maintain: rows of % were in its default partition; moved them to %',
                cfg.parent, created;
            step.rows := step.rows || ROW('moved', created::text, 'rows from the default partition')::outbox_internal._maint_row;
        END IF;
    END LOOP;
    RETURN step;
END
$$;

-- Phase 4: partitions ahead: the ranges no partition of the parent covers yet, found in one pass
-- over the partitions (each _create_partition call reads them all again). The partitions of now
-- and the next width are made whatever is left of the budget.
CREATE OR REPLACE FUNCTION outbox_internal._maint_create_ahead(cfg outbox.partition_config,
                                                        parts outbox.partitions[], budget int)
RETURNS outbox_internal._maint_step
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    step    outbox_internal._maint_step := ROW('{}', 0, false);
    lo_at   timestamptz;
    created regclass;
BEGIN
    FOR lo_at IN
        WITH existing AS (  -- what the partitions cover, as one value (not a scan per range)
                 SELECT coalesce(range_agg(tstzrange(x.lower, x.upper)), '{}') AS covered
                   FROM unnest(parts) x
                  WHERE x.parent = cfg.parent AND NOT x.is_default
                    AND x.upper > outbox_internal._floor_time(now(), cfg.width))
        SELECT g FROM existing,
                      generate_series(outbox_internal._floor_time(now(), cfg.width),
                                      outbox_internal._floor_time(now(), cfg.width) + cfg.width * cfg.ahead,
                                      cfg.width) AS g
         WHERE NOT existing.covered @> tstzrange(g, g + cfg.width)
         ORDER BY g LIMIT budget + 3
    LOOP
        IF step.used >= budget AND lo_at > outbox_internal._floor_time(now(), cfg.width) + cfg.width THEN
            step.rows := step.rows || ROW('deferred', cfg.parent::text,
                'more partitions to create than one run takes: the next run goes on')::outbox_internal._maint_row;
            EXIT;
        END IF;
        step.used := least(step.used + 1, budget);
        created := outbox_internal._create_partition(cfg.parent, lo_at, cfg.width);
        IF created IS NOT NULL THEN
            step.changed := true;
            step.rows := step.rows || ROW('created', created::text, NULL)::outbox_internal._maint_row;
        END IF;
    END LOOP;
    RETURN step;
END
$$;

-- Phase 5: seal the past and record how far ahead events may be, so that claims skip the
-- partitions they have read past and those ahead of now; forget inbox rows of the default
-- partition past retention.
CREATE OR REPLACE FUNCTION outbox_internal._maint_seal(parts outbox.partitions[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM outbox_internal._seal(parts);
    PERFORM outbox_internal._advance_reach(parts);
    DELETE FROM inbox.messages_default m
     WHERE m.received_at < now() - (SELECT c.retention FROM outbox.partition_config c
                                     WHERE c.parent = 'inbox.messages'::regclass);
END
$$;

-- Phase 6: cursor history (a minute of it is kept, for a look at what happened) and old marks.
CREATE OR REPLACE FUNCTION outbox_internal._maint_trim() RETURNS SETOF outbox_internal._maint_row
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    n bigint;
BEGIN
    DELETE FROM outbox._cursor_log l
     WHERE l.at < now() - interval '1 minute'
       AND l.pos < (SELECT max(m.pos) FROM outbox._cursor_log m
                     WHERE m.consumer_id = l.consumer_id AND m.shard = l.shard);
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        RETURN NEXT ROW('trimmed', 'outbox._cursor_log', n || ' old cursor rows')::outbox_internal._maint_row;
    END IF;
    DELETE FROM outbox._marks m
     WHERE m.at < now() - interval '1 hour' AND m.top < (SELECT max(k.top) FROM outbox._marks k);
END
$$;

-- The driver: each phase a function of its own, so that a change to one is one CREATE OR
-- REPLACE in an upgrade script. A run drops, detaches, moves rows into or creates at most
-- per_run partitions in all (oldest past retention first, nearest to now ahead; the partitions
-- of now and the next width are made whatever is left): its locks stay bounded whatever the
-- settings ask (ahead = 100000, a retention cut from a year to a day, rows of thousands of days
-- in a default partition), where all at once would fail every run (out of shared memory). The
-- rest waits for the next run, which the worker starts at once.
CREATE OR REPLACE FUNCTION outbox.maintain()
RETURNS TABLE (action text, relation text, detail text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    per_run CONSTANT int := 100;
    budget  int := per_run;
    -- the partitions, read once (reading outbox.partitions deparses every partition's bounds:
    -- about 0.1 ms each), read again only after a phase changed them
    parts   outbox.partitions[] := outbox_internal._partition_list();
    cfg     outbox.partition_config;
    step    outbox_internal._maint_step;
    skipped text;
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN;  -- a replica follows its primary's maintenance
    END IF;
    skipped := outbox_internal._maint_lock();
    IF skipped IS NOT NULL THEN
        RETURN QUERY SELECT 'skipped', NULL::text, skipped;
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM outbox_internal._maint_rebase();
    step := outbox_internal._maint_retire(parts, budget);
    RETURN QUERY SELECT * FROM unnest(step.rows);
    budget := budget - step.used;
    FOR cfg IN SELECT * FROM outbox.partition_config LOOP
        IF step.changed THEN
            parts := outbox_internal._partition_list();
        END IF;
        step := outbox_internal._maint_move_default(cfg, parts, budget);
        RETURN QUERY SELECT * FROM unnest(step.rows);
        budget := budget - step.used;
        IF step.changed THEN
            parts := outbox_internal._partition_list();
        END IF;
        step := outbox_internal._maint_create_ahead(cfg, parts, budget);
        RETURN QUERY SELECT * FROM unnest(step.rows);
        budget := budget - step.used;
    END LOOP;
    IF step.changed THEN
        parts := outbox_internal._partition_list();
    END IF;
    PERFORM outbox_internal._maint_seal(parts);
    RETURN QUERY SELECT * FROM outbox_internal._maint_trim();
END
$$;

REVOKE ALL ON FUNCTION outbox_internal._maint_lock(), outbox_internal._maint_rebase(),
    outbox_internal._maint_retire(outbox.partitions[], int),
    outbox_internal._maint_move_default(outbox.partition_config, outbox.partitions[], int),
    outbox_internal._maint_create_ahead(outbox.partition_config, outbox.partitions[], int),
    outbox_internal._maint_seal(outbox.partitions[]), outbox_internal._maint_trim() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._unpark_released(outbox.consumers, outbox._cursor_log) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_internal._head_waits(outbox.consumers, text, text, interval, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.pause_sink(text), outbox.resume_sink(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.pause_sink(text), outbox.resume_sink(text) TO outbox_admin;
