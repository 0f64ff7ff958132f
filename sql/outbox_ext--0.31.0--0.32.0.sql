-- outbox_ext 0.31.0 -> 0.32.0
--
-- Why: a relay whose transactions ran at REPEATABLE READ or SERIALIZABLE (a session, role or
-- database default some teams set) could be handed a batch another relay held under a live
-- lease, with the same epoch: a claim locks a free shard and then reads its cursor, and a
-- snapshot taken before the lock does not show a claim committed just before it. Two relays
-- then delivered the same key at once. Claims, settles, releases and replays now refuse such a
-- transaction with 25000 (_check_read_committed, called by _consumer; drop_consumer's own
-- check is now that one), and the worker pins its session to READ COMMITTED. The worker's
-- library also caps a receiver's Retry-After at 5 minutes for a parked key (it already did for
-- a suspended sink), and retries a give-back that failed as it retries a failed settle.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.32.0'" to load this file. \quit

-- Refuses a transaction at REPEATABLE READ or SERIALIZABLE (25000): what locks a shard (or a
-- consumer's shards) must then read what others committed before it got the lock, which a
-- snapshot taken before the lock does not show. A claim would hand out a batch another relay
-- holds, under the same epoch, and two relays would deliver the same key at once.
CREATE OR REPLACE FUNCTION outbox_internal._check_read_committed(what text) RETURNS void
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF pg_catalog.current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
        RAISE EXCEPTION '% must run at READ COMMITTED, not %', what,
                pg_catalog.upper(pg_catalog.current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state',
                  DETAIL = 'It locks shards and then reads what other relays committed, which a '
                           'snapshot taken before the lock does not show.',
                  HINT = 'Call it in a READ COMMITTED transaction (the default isolation level), '
                         'e.g. after SET default_transaction_isolation = ''read committed''.';
    END IF;
END
$$;

REVOKE ALL ON FUNCTION outbox_internal._check_read_committed(text) FROM PUBLIC;

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
