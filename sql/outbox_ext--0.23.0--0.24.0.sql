-- outbox_ext 0.23.0 -> 0.24.0
--
-- Why: the documentation moved out of the README into docs/ (a page per function in
-- docs/reference), so the hints of the NULL-argument errors point there instead of at the
-- README (or at the reference index, where the caller is not one function). emit and emit_many
-- now refuse a read-only transaction (and a standby) with 25006 and a hint before they take an
-- xid; the check is in the library, and emit_many takes its xid only where it inserts with SQL,
-- after the checks (it took it first: a read-only transaction was refused only after an xid,
-- and a standby with PostgreSQL's own 25006, no hint, before ours). A claim with nothing to do
-- while a key is parked but not yet due (waiting for its backoff) is an idle poll again: no
-- xid, no lock, nothing written (_may_have_work counted every parked key as work). And the
-- worker claims for a sink only while its row is as the worker last read it (enabled, the same
-- updated_at), in the claim's own transaction: a pause committed just after the worker read the
-- rows no longer lets it claim the events emitted after the pause (library only).
--
-- A delta: what changed from 0.23.0 to 0.24.0, rerunnable.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.24.0'" to load this file. \quit

CREATE OR REPLACE FUNCTION outbox_internal._not_null(is_null boolean, arg text, func text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF is_null THEN
        RAISE EXCEPTION '% must not be NULL', arg
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = format('Pass %s to %s; %s describes every argument.', arg, func,
                                CASE WHEN func ~ '^(outbox|inbox)\.[a-z_]+$' THEN 'docs/reference/' || func || '.md'
                                     ELSE 'docs/reference/README.md' END);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox.pause_sink(name text) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'name must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass name to outbox.pause_sink; docs/reference/outbox.pause_sink.md describes it.';
    END IF;
    UPDATE outbox.sinks s SET enabled = false WHERE s.name OPERATOR(pg_catalog.=) pause_sink.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'sink "%" does not exist', name
            USING ERRCODE = 'undefined_object', HINT = 'SELECT name FROM outbox.sinks lists them.';
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox.resume_sink(name text) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'name must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass name to outbox.resume_sink; docs/reference/outbox.resume_sink.md describes it.';
    END IF;
    -- always an update, enabled or not: a new updated_at makes the worker start afresh
    UPDATE outbox.sinks s SET enabled = true WHERE s.name OPERATOR(pg_catalog.=) resume_sink.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'sink "%" does not exist', name
            USING ERRCODE = 'undefined_object', HINT = 'SELECT name FROM outbox.sinks lists them.';
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox_internal._may_have_work(consumer_id int) RETURNS boolean
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    one    outbox._cursor_log := outbox_internal._cursor(consumer_id, floor(random() * outbox.shard_count())::int);
    curs   outbox._cursor_log[];
    newest outbox._seals;
    since  timestamptz;
BEGIN
    -- first one shard, at random: in a backlog most have a window open (a claim opened it and
    -- has not read it to its end), and one cursor is cheaper to read than all
    IF one.hi_snap IS NOT NULL OR one.restored_seq IS NOT NULL THEN
        RETURN true;
    END IF;
    curs := ARRAY(SELECT cur.l FROM generate_series(0, outbox.shard_count() - 1) AS s(shard)
                   CROSS JOIN LATERAL (SELECT l FROM outbox._cursor_log l
                                        WHERE l.consumer_id = _may_have_work.consumer_id AND l.shard = s.shard
                                        ORDER BY l.pos DESC LIMIT 1) AS cur);
    newest := outbox_internal._newest_seal();
    IF EXISTS (SELECT FROM unnest(curs) c
                WHERE c.hi_snap IS NOT NULL OR c.restored_seq IS NOT NULL
                   OR outbox_internal._behind_a_seal(c, newest)) THEN
        RETURN true;
    END IF;
    -- one value for every shard (the lowest floor's): partitions pruned before they are opened
    since := outbox_internal._since((SELECT min(outbox_internal._pending_floor(c)) FROM unnest(curs) c), newest);
    -- a parked key counts once it is due: one waiting for its backoff gives a claim nothing
    -- to do (its new events, if any, are found by _any_events)
    RETURN EXISTS (SELECT FROM outbox._parked p
                    WHERE p.consumer_id = _may_have_work.consumer_id AND p.next_attempt_at <= now())
        OR outbox_internal._any_events(ARRAY(SELECT c.shard FROM unnest(curs) c ORDER BY c.shard),
                                       ARRAY(SELECT outbox_internal._pending_floor(c) FROM unnest(curs) c
                                              ORDER BY c.shard),
                                       since, outbox_internal._reach());
END
$$;

CREATE OR REPLACE FUNCTION outbox.emit_many(
    aggregate_type text,
    event_type     text,
    aggregate_ids  text[],
    payloads       jsonb[],
    headers        jsonb DEFAULT NULL,
    topic          text  DEFAULT NULL
) RETURNS SETOF uuid
    LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    ids uuid[];
    tx  xid8;
BEGIN
    IF aggregate_ids IS NULL OR payloads IS NULL THEN
        RAISE EXCEPTION 'aggregate_ids and payloads must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass one aggregate id and one payload per event, as arrays.';
    END IF;
    IF cardinality(aggregate_ids) <> cardinality(payloads) THEN
        RAISE EXCEPTION 'aggregate_ids has % elements but payloads has %',
                cardinality(aggregate_ids), cardinality(payloads)
            USING ERRCODE = 'array_subscript_error',
                  HINT = 'Pass one payload per aggregate id, in the same order.';
    END IF;
    -- Natively, as COPY writes (see src/emit/insert.rs); NULL when the table needs a plain
    -- INSERT (triggers, constraints, no partition for now()).
    ids := outbox_internal._insert_many(aggregate_type, event_type, headers, topic, aggregate_ids, payloads);
    IF ids IS NULL THEN
        ids := outbox_internal._batch_ids(aggregate_type, event_type, headers, topic, aggregate_ids,
                                 (SELECT max(pg_column_size(p)) FROM unnest(payloads) AS p));
        -- after the checks (a read-only transaction is refused before it takes an xid), before
        -- any seq is taken: see events.seq
        tx := pg_current_xact_id();
        INSERT INTO outbox.events
            (id, topic, aggregate_type, aggregate_id, event_type, payload, headers, txid, shard)
        SELECT u.id, emit_many.topic, emit_many.aggregate_type, u.key, emit_many.event_type,
               u.payload, emit_many.headers, tx, outbox.shard_of(u.key)
        FROM unnest(ids, aggregate_ids, payloads) AS u(id, key, payload);
    END IF;
    RETURN QUERY SELECT unnest(ids);
END
$$;
