-- outbox_ext: consumers — the named readers of the event log (a sink is one), their shards,
-- and the argument checks every API function shares.
--
-- Owns: outbox.consumers (name and retry policy), outbox._shards (what claims lock, FOR UPDATE
-- SKIP LOCKED, to take a shard; never updated), create_consumer and drop_consumer.
-- Keeps: a consumer has a row in _shards and a cursor (sql/cursors.sql) for every shard from
-- the moment it exists; drop_consumer is the one place a consumer's rows go (cursors, parked
-- keys and dead letters included: they have no foreign key, see _cursor_log).
--
-- Name resolution (sql/grants.sql): the API functions are [pinned], helpers (outbox_internal._*) run
-- [inside] them and do not pin search_path themselves: only the SECURITY DEFINER API functions
-- call them, and those pin it. A SET clause on every helper would cost each call a GUC save and
-- restore and a new search path lookup, about 5% of a claim.
--
-- Rerunnable: tables and indexes only where missing, functions replaced. A changed table needs
-- its own ALTER in the upgrade script.

CREATE TABLE IF NOT EXISTS outbox.consumers (
    id           int         GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name         text        NOT NULL UNIQUE,
    max_attempts int         NOT NULL DEFAULT 10 CHECK (max_attempts >= 1),
    -- (as create_consumer checks them: outbox_admin may UPDATE them, and a backoff beyond
    -- what _backoff computes would fail every settle of a failure)
    backoff_base interval    NOT NULL DEFAULT '1 second' CHECK (backoff_base > '0' AND backoff_base <= '30 days'),
    backoff_max  interval    NOT NULL DEFAULT '10 minutes' CHECK (backoff_max > '0' AND backoff_max <= '30 days'),
    created_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT consumers_backoff_check CHECK (backoff_base <= backoff_max)
);

COMMENT ON TABLE outbox.consumers IS
    'Named readers of the event log (one per sink); each has its own cursor in every shard.';

-- What claims lock (FOR UPDATE SKIP LOCKED) to take a shard; never updated.
CREATE TABLE IF NOT EXISTS outbox._shards (
    consumer_id int NOT NULL REFERENCES outbox.consumers ON DELETE CASCADE,
    shard       int NOT NULL,
    PRIMARY KEY (consumer_id, shard)
);

-- Refuses a transaction at REPEATABLE READ or SERIALIZABLE (25000): what locks a shard (or a
-- consumer's shards, or what emits write to) must then read what others committed before it
-- got the lock, which a snapshot taken before the lock does not show. A claim would hand out a
-- batch another relay holds, under the same epoch, and two relays would deliver the same key
-- at once; maintain() and the drop guard would take an event committed since for delivered,
-- and drop it.
CREATE OR REPLACE FUNCTION outbox_internal._check_read_committed(what text) RETURNS void
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF pg_catalog.current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        RAISE EXCEPTION '% must run at READ COMMITTED, not %', what,
                pg_catalog.upper(pg_catalog.current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state',
                  DETAIL = 'It locks what others write and then reads what they committed, which '
                           'a snapshot taken before the lock does not show.',
                  HINT = 'Call it in a READ COMMITTED transaction (the default isolation level), '
                         'e.g. after SET default_transaction_isolation = ''read committed''.';
    END IF;
END
$$;

-- A consumer by name, for the API functions that lock its shards: claims, settles,
-- give-backs and replays (at READ COMMITTED only, see _check_read_committed).
CREATE OR REPLACE FUNCTION outbox_internal._consumer(name text) RETURNS outbox.consumers
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    c outbox.consumers;
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'consumer', 'the function');
    PERFORM outbox_internal._check_read_committed('claims, settles, releases and replays');
    PERFORM outbox_internal._rebase_if_restored();
    SELECT * INTO c FROM outbox.consumers WHERE consumers.name = _consumer.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'consumer "%" does not exist', name
            USING ERRCODE = 'undefined_object',
                  HINT = 'Create it with outbox.create_consumer(name).';
    END IF;
    RETURN c;
END
$$;

-- The one NULL check of the API's arguments: 22004, naming the argument and the function.
CREATE OR REPLACE FUNCTION outbox_internal._not_null(is_null boolean, arg text, func text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF is_null THEN
        RAISE EXCEPTION '% must not be NULL', arg
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = format('Pass %s to %s; %s describes every argument.', arg, func,
                                CASE WHEN func ~ '^(outbox|inbox)[.][a-z_]+$' THEN 'docs/reference/' || func || '.md'
                                     ELSE 'docs/reference/README.md' END);
    END IF;
END
$$;

-- An interval argument: positive (or zero, if zero_ok) and at most max, else 22023.
CREATE OR REPLACE FUNCTION outbox_internal._check_interval(v interval, arg text, max interval, zero_ok boolean)
RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF v < '0' OR (v = '0' AND NOT zero_ok) OR v > max THEN
        RAISE EXCEPTION '% % is out of range', arg, v
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = format('%s is %s to %s.', arg, CASE WHEN zero_ok THEN '0' ELSE 'more than 0' END, max);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox_internal._check_shard(shard int) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF shard IS NULL OR shard < 0 OR shard >= outbox.shard_count() THEN
        RAISE EXCEPTION 'shard % does not exist', shard
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = format('Shards are 0 to %s; pass the shard a claimed row came with.',
                                outbox.shard_count() - 1);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox.create_consumer(
    name          text,
    from_beginning boolean  DEFAULT false,
    max_attempts  int      DEFAULT 10,
    backoff_base  interval DEFAULT '1 second',
    backoff_max   interval DEFAULT '10 minutes'
) RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    rebased boolean := outbox_internal._rebase_if_restored();  -- first: it may write
    c_id   int;
    -- The first bound, taken as claims take theirs (see the header); if this transaction has
    -- written already, its xid may be older than the seq, so start the seq bound at 0.
    -- (never below a restored dump's events: their txids are not this cluster's)
    restored bigint := coalesce((SELECT o.restored_seq FROM outbox._origin o), 0);
    lo_seq bigint := CASE WHEN pg_current_xact_id_if_assigned() IS NULL
                          THEN coalesce(pg_sequence_last_value('outbox.event_seq'), 0) ELSE restored END;
    x      xid8 := pg_current_xact_id();
    lo     pg_snapshot := outbox_internal._bound_snapshot(x);
    lo_top xid8 := outbox_internal._top(lo, x);
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'name', 'outbox.create_consumer');
    PERFORM outbox_internal._not_null(from_beginning IS NULL, 'from_beginning', 'outbox.create_consumer');
    PERFORM outbox_internal._not_null(max_attempts IS NULL, 'max_attempts', 'outbox.create_consumer');
    PERFORM outbox_internal._not_null(backoff_base IS NULL, 'backoff_base', 'outbox.create_consumer');
    PERFORM outbox_internal._not_null(backoff_max IS NULL, 'backoff_max', 'outbox.create_consumer');
    IF name = '' OR length(name) > 128 THEN
        RAISE EXCEPTION 'consumer name must be 1 to 128 characters'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Name the consumer after its sink.';
    END IF;
    PERFORM outbox_internal._check_interval(backoff_base, 'backoff_base', '30 days', false);
    PERFORM outbox_internal._check_interval(backoff_max, 'backoff_max', '30 days', false);
    IF max_attempts < 1 OR backoff_max < backoff_base THEN
        RAISE EXCEPTION 'invalid retry policy (max_attempts %, backoff % to %)',
                max_attempts, backoff_base, backoff_max
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'max_attempts >= 1 and 0 < backoff_base <= backoff_max.';
    END IF;
    INSERT INTO outbox.consumers (name, max_attempts, backoff_base, backoff_max)
    VALUES (create_consumer.name, create_consumer.max_attempts, create_consumer.backoff_base,
            create_consumer.backoff_max)
    ON CONFLICT ON CONSTRAINT consumers_name_key DO NOTHING
    RETURNING id INTO c_id;
    IF c_id IS NULL THEN
        RAISE EXCEPTION 'consumer "%" already exists', name
            USING ERRCODE = 'duplicate_object',
                  HINT = 'Pick another name, or outbox.drop_consumer it first.';
    END IF;
    INSERT INTO outbox._shards SELECT c_id, s FROM generate_series(0, outbox.shard_count() - 1) s;
    -- Transactions in progress now get floor 0: their events may be older than anything; this
    -- transaction's own, lo_seq.
    -- From the beginning in a database restored from a dump: the dump's events first, in its
    -- transaction ids (sql/restore.sql). Epochs from (id - 1) * 2^32 on: a consumer made again
    -- under a dropped one's name does not take the same epochs, so a relay of the dropped one,
    -- back late, cannot settle its batches (the first consumer's still begin at 0).
    INSERT INTO outbox._cursor_log (consumer_id, shard, epoch, lo_snap, lo_seq, lo_top, lo_txids,
                                    lo_floors, restored_seq, restored_top)
    SELECT c_id, s, (c_id - 1)::bigint << 32, b.snap, b.seq, b.top, b.txids,
           ARRAY(SELECT CASE WHEN t = x THEN lo_seq ELSE restored END FROM unnest(b.txids) AS t),
           o.restored_seq, o.restored_top
      FROM generate_series(0, outbox.shard_count() - 1) AS s
      LEFT JOIN outbox._origin o ON from_beginning,
           (SELECT '1:1:'::pg_snapshot AS snap, 0::bigint AS seq, '1'::xid8 AS top, '{}'::xid8[] AS txids
             WHERE from_beginning
            UNION ALL
            SELECT lo, lo_seq, lo_top, outbox_internal._in_progress(lo, x) WHERE NOT from_beginning) AS b;
END
$$;

COMMENT ON FUNCTION outbox.create_consumer(text, boolean, int, interval, interval) IS
    'Creates a consumer that reads events committed from now on (or all, from_beginning). '
    'Example: SELECT outbox.create_consumer(''billing-webhook'', max_attempts => 5);';

CREATE OR REPLACE FUNCTION outbox.drop_consumer(name text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    c_id int := (SELECT c.id FROM outbox.consumers c WHERE c.name = drop_consumer.name);
BEGIN
    PERFORM outbox_internal._not_null(name IS NULL, 'name', 'outbox.drop_consumer');
    -- The deletes below must see the rows relays commit while the drop waits for their shards:
    -- with a snapshot taken before, those would be left behind.
    PERFORM outbox_internal._check_read_committed('outbox.drop_consumer');
    -- Its shards first, in order, as claims and settles take them before they write a cursor
    -- row: the drop waits for a claim or a settle under way, then deletes what no one holds.
    PERFORM FROM outbox._shards s WHERE s.consumer_id = c_id ORDER BY s.shard FOR UPDATE;
    DELETE FROM outbox._cursor_log l WHERE l.consumer_id = c_id;
    DELETE FROM outbox._parked_events q WHERE q.consumer_id = c_id;
    DELETE FROM outbox._parked p WHERE p.consumer_id = c_id;
    DELETE FROM outbox.dead_letters d WHERE d.consumer = drop_consumer.name;
    DELETE FROM outbox.consumers c WHERE c.id = c_id;         -- and its shards (a cascade)
    RETURN FOUND;
END
$$;

COMMENT ON FUNCTION outbox.drop_consumer(text) IS
    'Drops a consumer with its cursors, parked keys and dead letters; false if there was none.';
