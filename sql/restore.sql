-- outbox_ext: restoring a dump (pg_restore, psql) — how a restored state is recognised and
-- rebased onto the transaction ids of the cluster it lands in.
--
-- A dump holds events with their txids and cursors whose windows are snapshots, all in the
-- transaction ids of the dumped cluster; the cluster it is restored into counts its own
-- (far below, far above or overlapping). What the restore makes true, and what the rebase
-- builds on:
--   - every restored event is committed (pg_dump reads only committed rows);
--   - a restored event has a seq at most the restored event_seq, every event emitted after the
--     restore a greater one (the sequence goes on from there).
-- So a cursor is rebased into two steps (see _advance and _open_window in sql/cursors.sql): it
-- first finishes reading the dump's events in the dump's own ids — its windows as dumped, then
-- one last window up to restored_top, a txid above every txid of the dump, under which every
-- restored event is committed — pure comparisons between restored values; then it goes on
-- with every event of a greater seq than restored_seq, in this cluster's ids. What a consumer
-- had acknowledged is not delivered again; what it had not, is, in order; a batch that was out
-- at dump time comes again.
--
-- Recognised: outbox._origin holds one row, made by CREATE EXTENSION. A dump carries it too,
-- and restoring the dump inserts the dump's row over the one CREATE EXTENSION just made: that
-- is a restore. It marks the state pending, and makes emits (a statement trigger on
-- outbox.events) and every API call on cursors (outbox_internal._consumer, claim, create_consumer)
-- rebase first, once, before any event of this cluster gets a seq. outbox.maintain() then
-- removes the trigger. pg_upgrade and physical copies (base backups, standbys) keep the
-- transaction ids, copy no rows through SQL and need nothing of this.
--
-- Name resolution (sql/grants.sql): the trigger functions are [pinned]; _rebase and
-- _rebase_if_restored run [inside] pinned functions.
--
-- Rerunnable.

CREATE TABLE IF NOT EXISTS outbox._origin (
    one             boolean     PRIMARY KEY DEFAULT true CHECK (one),  -- a single row
    made_in         text        NOT NULL,  -- system identifier / database oid, for a look
    made_at         timestamptz NOT NULL DEFAULT now(),
    restore_pending boolean     NOT NULL DEFAULT false,  -- restored, not rebased yet
    restored_at     timestamptz,           -- the last restore
    restored_seq    bigint,                -- the last restore's events: seq at most this,
    restored_top    xid8,                  -- txids below this (for consumers made later)
    restorer        int,                   -- the backend restoring, and since when: nothing is
    restorer_since  timestamptz            -- rebased while it runs (it has not loaded all yet)
);
COMMENT ON TABLE outbox._origin IS
    'Where this outbox state was made, and its last restore from a dump (see sql/restore.sql).';

CREATE OR REPLACE FUNCTION outbox_internal._here() RETURNS text
    LANGUAGE sql STABLE
    RETURN (SELECT c.system_identifier FROM pg_catalog.pg_control_system() c)::text || '/'
        || (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database())::text;

-- The dump's row arriving over ours: a restore.
CREATE OR REPLACE FUNCTION outbox_internal._restored() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM outbox._origin) THEN
        RETURN NEW;  -- CREATE EXTENSION's own row
    END IF;
    DELETE FROM outbox._seals;  -- made before the dump's events arrived: not about them
    -- no bound until maintain() has seen the dump's events (outbox._reach)
    INSERT INTO outbox._reach (upper) VALUES ('infinity');
    UPDATE outbox._origin
       SET restore_pending = true, restored_at = now(), restorer = pg_backend_pid(),
           restorer_since = (SELECT a.backend_start FROM pg_stat_activity a WHERE a.pid = pg_backend_pid());
    CREATE OR REPLACE TRIGGER rebase_before_emit BEFORE INSERT ON outbox.events
        FOR EACH STATEMENT EXECUTE FUNCTION outbox_internal._rebase_before_emit();
    -- a session with session_replication_role = replica emits too (and takes seqs)
    ALTER TABLE outbox.events ENABLE ALWAYS TRIGGER rebase_before_emit;
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER restored BEFORE INSERT ON outbox._origin
    FOR EACH ROW EXECUTE FUNCTION outbox_internal._restored();
-- (not ON CONFLICT: the trigger, which fires first, would take a second insert for a restore)
INSERT INTO outbox._origin (made_in) SELECT outbox_internal._here() WHERE NOT EXISTS (SELECT FROM outbox._origin);

-- Before the first event of this cluster takes a seq. (Native emit takes the plain INSERT
-- path while a table has a trigger, so this fires for every kind of emit.)
CREATE OR REPLACE FUNCTION outbox_internal._rebase_before_emit() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox_internal._rebase_if_restored();
    RETURN NULL;
END
$$;

-- Rebases a restored state if it is one, once the restore is over. True when the state is
-- not ready for claims in this transaction: it was just rebased (the transaction has written),
-- or the restore is still running.
CREATE OR REPLACE FUNCTION outbox_internal._rebase_if_restored() RETURNS boolean
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF NOT coalesce((SELECT o.restore_pending FROM outbox._origin o), false) THEN
        RETURN false;
    END IF;
    IF outbox_internal._restore_running() THEN
        RETURN true;
    END IF;
    LOCK TABLE outbox._origin IN EXCLUSIVE MODE;  -- one rebase; the others wait, then see it done
    IF NOT (SELECT o.restore_pending FROM outbox._origin o) THEN
        RETURN false;
    END IF;
    PERFORM outbox_internal._rebase();
    RETURN true;
END
$$;

-- Whether the backend that restored the dump's _origin row still runs (a restore not made in
-- one transaction goes on loading after it), or a pg_restore is connected to this database as
-- a role that can write the outbox's tables (any role can call itself pg_restore: counting it
-- would let it make maintain() skip for as long as it stays connected).
CREATE OR REPLACE FUNCTION outbox_internal._restore_running() RETURNS boolean
    LANGUAGE sql STABLE
    RETURN EXISTS (SELECT FROM pg_catalog.pg_stat_activity a, outbox._origin o
                    WHERE a.pid = o.restorer AND a.backend_start = o.restorer_since
                      AND a.pid <> pg_catalog.pg_backend_pid())
        OR EXISTS (SELECT FROM pg_catalog.pg_stat_activity a, pg_catalog.pg_class c
                    WHERE a.datname = pg_catalog.current_database() AND a.application_name = 'pg_restore'
                      AND a.pid <> pg_catalog.pg_backend_pid()
                      AND c.oid = 'outbox.events'::regclass
                      AND pg_catalog.pg_has_role(a.usesysid, c.relowner, 'MEMBER'));

-- Every cursor: its batch out at dump time (lease, parked heads) comes again, given back as
-- outbox.release gives it back (a key its relay had nacked is read again from the batch's page,
-- in order), and it reads the dump's events in the dump's ids, then the rest (see the header).
-- Marks go: their xids are the dump's, and claims make new ones. Seals go too (one made while
-- the dump loaded knew nothing of its events); maintain() seals the rebased log.
CREATE OR REPLACE FUNCTION outbox_internal._rebase() RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    n   bigint;
    top xid8;
    sh  outbox._shards;
    cur outbox._cursor_log;
BEGIN
    SELECT greatest(max(e.seq), coalesce(pg_sequence_last_value('outbox.event_seq'), 0)), max(e.txid)
      INTO n, top FROM outbox.events e;
    SELECT greatest(top, max(greatest(l.lo_top, l.hi_top, pg_snapshot_xmax(l.lo_snap),
                                      pg_snapshot_xmax(l.hi_snap))))
      INTO top FROM outbox._cursor_log l;
    top := (coalesce(top::text::bigint, 2) + 1)::text::xid8;
    FOR sh IN SELECT * FROM outbox._shards s ORDER BY s.consumer_id, s.shard FOR UPDATE LOOP
        cur := outbox_internal._cursor(sh.consumer_id, sh.shard);
        IF cur.owner IS NOT NULL THEN
            PERFORM outbox_internal._unpark_released(c, cur)
               FROM outbox.consumers c WHERE c.id = sh.consumer_id;
        END IF;
        IF cur.restored_seq IS NOT NULL THEN
            -- restored again before it read an earlier dump's events: all of them from its
            -- floor on come again (the ids of two dumps cannot be told apart)
            cur := outbox_internal._lo_after_seq(cur, outbox_internal._pending_floor(cur));
        END IF;
        cur.owner := NULL; cur.lease_until := NULL;
        cur.batch_end := NULL; cur.exhausted := NULL; cur.heads := NULL;
        cur.restored_seq := n; cur.restored_top := top;
        PERFORM outbox_internal._append(cur);
    END LOOP;
    DELETE FROM outbox._marks;
    DELETE FROM outbox._seals;
    UPDATE outbox._origin
       SET restore_pending = false, restored_seq = n, restored_top = top, made_in = outbox_internal._here();
    RAISE NOTICE 'outbox_ext: rebased the outbox restored from a dump (events up to seq %, txids below %)', n, top;
END
$$;
