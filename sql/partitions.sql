-- outbox_ext: partitions of the event log and the inbox, and their maintenance.
--
-- outbox.events is partitioned by created_at, inbox.messages by message_id (UUIDv7, so by
-- time too). outbox.maintain() keeps both: it creates partitions ahead, drops (or detaches)
-- those past their retention — for events only once every consumer has read past all of their
-- events — and moves rows that landed in a default partition into partitions of their own.
-- Partitions are named <parent>_pYYYYMMDD_HH24MISS after their lower bound in UTC (with _US,
-- its microseconds, when it has any; with _2, _3 ... when the name is taken).
--
-- Rerunnable: the 0.1.0 -> 0.2.0 upgrade script includes this file.
-- Name resolution (sql/grants.sql): maintain() and the trigger functions _note_reach and
-- _break_seals are [pinned]; maintain()'s phases (_maint_*) run [inside] it; the helpers that
-- run dynamic SQL (_create_partition, _partition_pending, _revoke_all, _index_partition,
-- _advance_reach, _arm_seals) pin search_path too, the others are [parsed]; the view is
-- [parsed].
--
-- maintain() is a short driver over phases, one function each (lock, rebase, retire, move the
-- default partitions' rows, create ahead, seal, trim): a change to one phase is one CREATE OR
-- REPLACE in an upgrade script.

-- Bounded so that no setting an admin may write makes maintain() (run by the worker, as the
-- owner) work without end: a width of days and times only (a month's length varies: '1 mon
-- -28 days' advances by nothing in February), partitions ahead and a retention whose times
-- stay in range.
CREATE TABLE IF NOT EXISTS outbox.partition_config (
    parent    regclass PRIMARY KEY,
    width     interval NOT NULL CHECK (width > '0' AND width <= '366 days'
                                       AND date_part('month', width) = 0 AND date_part('year', width) = 0),
    ahead     int      NOT NULL DEFAULT 2 CHECK (ahead >= 0 AND ahead <= 100000),
    retention interval NOT NULL CHECK (retention >= '0' AND retention <= '100 years'),
    detach    boolean  NOT NULL DEFAULT false
);
COMMENT ON TABLE outbox.partition_config IS
    'How outbox.maintain() partitions each table: width of a partition, how many to create ahead, '
    'how long to keep them (for events: after every consumer has read them), and whether to detach '
    'instead of drop. Example: UPDATE outbox.partition_config SET retention = ''3 days'' WHERE parent = ''outbox.events''::regclass;';
INSERT INTO outbox.partition_config (parent, width, ahead, retention) VALUES
    ('outbox.events', '1 day', 2, '2 days'),
    ('inbox.messages', '1 day', 2, '7 days')
ON CONFLICT (parent) DO NOTHING;

CREATE OR REPLACE FUNCTION outbox_internal._partition_name(parent text, lo_at timestamptz) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    -- (microseconds too when there are any: widths under a second, and gaps a change of width
    -- left, give bounds within one second)
    RETURN parent || '_p' || pg_catalog.to_char(lo_at AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS')
           || CASE WHEN pg_catalog.to_char(lo_at AT TIME ZONE 'UTC', 'US') <> '000000'
                   THEN pg_catalog.to_char(lo_at AT TIME ZONE 'UTC', '"_"US') ELSE '' END;

-- The partition key column of a table, and its value at a moment, as a literal (the inbox's
-- key is a UUIDv7).
CREATE OR REPLACE FUNCTION outbox_internal._key_column(parent regclass) RETURNS text
    LANGUAGE sql IMMUTABLE
    RETURN CASE WHEN parent = 'inbox.messages'::regclass THEN 'message_id' ELSE 'created_at' END;
-- The time of a row's partition key, as an SQL expression.
CREATE OR REPLACE FUNCTION outbox_internal._key_time(parent regclass) RETURNS text
    LANGUAGE sql IMMUTABLE
    RETURN CASE WHEN parent = 'inbox.messages'::regclass THEN 'inbox.uuid_time(message_id)' ELSE 'created_at' END;
-- (A time as text in ISO form, UTC, whatever the session's DateStyle and TimeZone: in another
-- style a zone prints as an abbreviation, which may be read back as another zone, 'CST' of
-- Asia/Shanghai as US Central, and the partitions came out hours off.)
CREATE OR REPLACE FUNCTION outbox_internal._bound(parent regclass, at timestamptz) RETURNS text
    LANGUAGE sql STABLE
    RETURN CASE WHEN parent = 'inbox.messages'::regclass THEN inbox.uuid_at(at)::text
                ELSE to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US') || '+00' END;

-- A partition's bound clause, printed in ISO form (see _bound).
CREATE OR REPLACE FUNCTION outbox_internal._bound_clause(bound pg_node_tree, rel oid) RETURNS text
    LANGUAGE sql STABLE SET datestyle = 'ISO, YMD'
    RETURN pg_get_expr(bound, rel);

-- Every partition of the two tables with its time range (NULLs for a default partition).
CREATE OR REPLACE VIEW outbox_internal.partition_ranges AS
SELECT i.inhparent::regclass AS parent,
       c.oid::regclass AS partition,
       CASE WHEN i.inhparent = 'inbox.messages'::regclass THEN inbox.uuid_time(b[1]::uuid) ELSE b[1]::timestamptz END AS lower,
       CASE WHEN i.inhparent = 'inbox.messages'::regclass THEN inbox.uuid_time(b[2]::uuid) ELSE b[2]::timestamptz END AS upper,
       b IS NULL AS is_default
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
  CROSS JOIN LATERAL outbox_internal._bound_clause(c.relpartbound, c.oid) AS e
  -- FOR VALUES FROM ('lower') TO ('upper'): the quoted values, cut out without a regexp
  CROSS JOIN LATERAL (SELECT CASE WHEN e LIKE 'FOR VALUES FROM (''%'') TO (''%'')'
                                  THEN ARRAY[split_part(e, '''', 2), split_part(e, '''', 4)] END) AS x(b)
 WHERE i.inhparent IN ('outbox.events'::regclass, 'inbox.messages'::regclass);

-- The same with each partition's size on disk. (pg_total_relation_size is volatile, which
-- keeps a view that computes it from being merged into a query: maintain() reads the ranges.)
CREATE OR REPLACE VIEW outbox.partitions AS
SELECT r.parent, r.partition, r.lower, r.upper, r.is_default, pg_total_relation_size(r.partition) AS bytes
  FROM outbox_internal.partition_ranges r;
COMMENT ON VIEW outbox.partitions IS 'Partitions of outbox.events and inbox.messages with their time ranges.';

-- outbox.partitions as a value, without the sizes (each a stat of every file of a partition).
CREATE OR REPLACE FUNCTION outbox_internal._partition_list() RETURNS outbox.partitions[]
    LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
AS $$
    SELECT ARRAY(SELECT ROW(x.parent, x.partition, x.lower, x.upper, x.is_default, NULL)::outbox.partitions
                   FROM outbox_internal.partition_ranges x)
$$;

CREATE OR REPLACE FUNCTION outbox_internal._floor_time(at timestamptz, width interval) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN to_timestamp(floor(extract(epoch FROM at) / extract(epoch FROM width)) * extract(epoch FROM width));

-- The index a partition of parent needs: events, (shard, seq, txid), which claims read; the
-- inbox, unique (message_id, consumer), which dedups (message_id decides the partition, so a
-- key unique in each partition is unique in the table). Made on each partition, never on the
-- parent: pg_dump restores the partitions maintain() made as tables of their own, attached to
-- the parent CREATE EXTENSION made; an index of the parent would be copied onto each at
-- ATTACH, and the dump's own CREATE INDEX for it would then fail.
CREATE OR REPLACE FUNCTION outbox_internal._index_partition(parent regclass, part regclass) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    name text := (SELECT c.relname FROM pg_class c WHERE c.oid = part);
BEGIN
    IF parent = 'inbox.messages'::regclass THEN
        EXECUTE format('CREATE UNIQUE INDEX IF NOT EXISTS %I ON %s (message_id, consumer)',
                       name || '_key', part);
    ELSE
        EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON %s (shard, seq, txid)', name || '_read', part);
    END IF;
END
$$;

-- Take every privilege on rel from every role but its owner. A new partition gets its
-- owner's default privileges (ALTER DEFAULT PRIVILEGES); partitions need no grant at all
-- (rows are reached through the parent), and a TRIGGER or TRUNCATE grant on one would let its
-- holder run code inside the worker and the SECURITY DEFINER functions (see sql/grants.sql).
CREATE OR REPLACE FUNCTION outbox_internal._revoke_all(rel regclass) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    grantee oid;
BEGIN
    FOR grantee IN SELECT DISTINCT a.grantee FROM pg_class c, aclexplode(c.relacl) a
                    WHERE c.oid = rel AND a.grantee <> c.relowner LOOP
        EXECUTE format('REVOKE ALL ON TABLE %s FROM %s', rel,
                       CASE WHEN grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(grantee)) END);
    END LOOP;
END
$$;

-- Create a partition of parent for the first gap the existing partitions leave in
-- [lo_at, lo_at + width) (after a change of width there may be several: call it until it
-- returns NULL); rows for that range waiting in the default partition move into it first.
-- Returns the partition created, or NULL if the range is covered (or a lock was not had).
CREATE OR REPLACE FUNCTION outbox_internal._create_partition(parent regclass, lo_at timestamptz, width interval)
RETURNS regclass
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    hi_at timestamptz;
    nsp   text;
    rel   text;
    part  text;
    taken int := 1;
    dflt  regclass;
    old_timeout text := current_setting('lock_timeout');
BEGIN
    SELECT lower(g), upper(g) INTO lo_at, hi_at
      FROM unnest(tstzmultirange(tstzrange(lo_at, lo_at + width))
                  - (SELECT coalesce(range_agg(tstzrange(p.lower, p.upper)), '{}')
                       FROM outbox_internal.partition_ranges p
                      WHERE p.parent = _create_partition.parent AND NOT p.is_default
                        AND tstzrange(p.lower, p.upper) && tstzrange(lo_at, lo_at + width))) AS g
     ORDER BY lower(g) LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT n.nspname, c.relname INTO nsp, rel
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = parent;
    -- a name of its own: a table detached from that range (detach = true) may keep it
    part := outbox_internal._partition_name(rel, lo_at);
    WHILE EXISTS (SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE n.nspname = nsp AND c.relname IN (part, part || '_read', part || '_key')) LOOP
        taken := taken + 1;
        part := outbox_internal._partition_name(rel, lo_at) || '_' || taken;
    END LOOP;
    SELECT p.partition INTO dflt FROM outbox_internal.partition_ranges p
     WHERE p.parent = _create_partition.parent AND p.is_default;
    -- Every lock waited for at most a second; the next run tries again. The ATTACH takes the
    -- default partition in ACCESS EXCLUSIVE mode: waiting on a reader that holds it for long (a
    -- pg_dump over midnight, a session idle in a transaction), its queued request would block
    -- every claim, which reads the default partition, and the worker's loop with this run.
    PERFORM set_config('lock_timeout', '1s', true);
    BEGIN
        IF lo_at <= clock_timestamp() + interval '1 minute' THEN
            -- A range writers may be writing to now: hold them off until the partition is
            -- attached. A row routed to the default partition just before the ATTACH would
            -- fail on the default's narrowed constraint, which PostgreSQL checks after waiting
            -- for its lock (an emit racing the first maintain() after CREATE EXTENSION).
            EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', parent);
        END IF;
        -- Standalone first, then the default partition's rows of the range, then attach: a
        -- default partition holding rows of the range would make a plain CREATE ... PARTITION
        -- OF fail.
        EXECUTE format('CREATE TABLE %I.%I (LIKE %I.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                       nsp, part, nsp, rel);
        IF dflt IS NOT NULL THEN
            EXECUTE format('WITH moved AS (DELETE FROM %s d WHERE %I >= %L AND %I < %L RETURNING d.*) '
                           'INSERT INTO %I.%I SELECT * FROM moved',
                           dflt, outbox_internal._key_column(parent), outbox_internal._bound(parent, lo_at),
                           outbox_internal._key_column(parent), outbox_internal._bound(parent, hi_at), nsp, part);
        END IF;
        PERFORM outbox_internal._index_partition(parent, format('%I.%I', nsp, part)::regclass);
        EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                       nsp, rel, nsp, part, outbox_internal._bound(parent, lo_at), outbox_internal._bound(parent, hi_at));
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', old_timeout, true);
        RETURN NULL;  -- all of it undone: the moved rows are back in the default partition
    END;
    PERFORM set_config('lock_timeout', old_timeout, true);
    PERFORM outbox_internal._revoke_all(format('%I.%I', nsp, part)::regclass);
    RETURN format('%I.%I', nsp, part)::regclass;
END
$$;

-- Reach (outbox._reach, sql/cursors.sql). The trigger outbox_reach is defined on outbox.events,
-- so PostgreSQL puts it on every partition, whoever makes or attaches it; on while a
-- partition's time lies ahead, where nothing is written unless a clock ran ahead: no claim
-- need open such a partition until its trigger has fired. ALWAYS: a session with
-- session_replication_role = replica (logical replication) fires it too. A row records its
-- partition's upper bound, or in the default partition (or one without a finite bound) the
-- hour after its created_at, unless a recorded bound is above it already: an index probe.
-- maintain() turns a partition's trigger off as its time nears (_advance_reach).
CREATE OR REPLACE FUNCTION outbox_internal._note_reach() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT isfinite(NEW.created_at) THEN  -- no read could bound it
        RAISE EXCEPTION 'outbox_ext: an event''s created_at must be finite, not %', NEW.created_at
            USING ERRCODE = 'invalid_datetime_format', HINT = 'outbox.emit writes the transaction''s start.';
    END IF;
    IF NOT EXISTS (SELECT FROM outbox._reach r WHERE r.upper > NEW.created_at AND r.upper < 'infinity') THEN
        INSERT INTO outbox._reach (upper)
        VALUES (coalesce((SELECT p.upper FROM outbox_internal.partition_ranges p
                           WHERE p.partition = TG_RELID AND NOT p.is_default AND p.upper > NEW.created_at),
                         date_trunc('hour', NEW.created_at, 'UTC') + interval '1 hour'));
    END IF;
    RETURN NEW;
END
$$;

-- Turn the reach trigger off on the events partitions whose time begins within a width, then
-- record, in the same transaction, a bound above every event no trigger that is on will
-- record: the greatest upper bound of a partition whose trigger is off (or not ALWAYS), and
-- the hour after the latest event beyond it (rows that came in with the trigger off: moved
-- out of the default partition, restored, attached). That bound replaces 'infinity'. A
-- partition in use (lock timeout, deadlock) keeps its trigger until the next run.
CREATE OR REPLACE FUNCTION outbox_internal._advance_reach(parts outbox.partitions[]) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    width interval := (SELECT c.width FROM outbox.partition_config c WHERE c.parent = 'outbox.events'::regclass);
    p     outbox.partitions;
    bound timestamptz;
    old_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    -- ALWAYS again where a data-only restore's ENABLE TRIGGER ALL made it fire in origin mode only
    IF EXISTS (SELECT FROM pg_trigger t WHERE t.tgname = 'outbox_reach' AND t.tgenabled <> 'A'
                  AND t.tgrelid IN ('outbox.events'::regclass, 'outbox.events_default'::regclass)) THEN
        BEGIN
            ALTER TABLE ONLY outbox.events ENABLE ALWAYS TRIGGER outbox_reach;
            ALTER TABLE outbox.events_default ENABLE ALWAYS TRIGGER outbox_reach;
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;  -- next run
        END;
    END IF;
    FOR p IN SELECT x.* FROM unnest(parts) x
               JOIN pg_trigger t ON t.tgrelid = x.partition AND t.tgname = 'outbox_reach' AND t.tgenabled = 'A'
              WHERE x.parent = 'outbox.events'::regclass AND NOT x.is_default AND x.lower < now() + width LOOP
        BEGIN
            EXECUTE format('ALTER TABLE %s DISABLE TRIGGER outbox_reach', p.partition);
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;  -- emits write there already: it stays on until the next run
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', old_timeout, true);
    SELECT max(x.upper) INTO bound FROM unnest(parts) x
     WHERE x.parent = 'outbox.events'::regclass AND NOT x.is_default
       AND NOT EXISTS (SELECT FROM pg_trigger t  -- on: always
                        WHERE t.tgrelid = x.partition AND t.tgname = 'outbox_reach' AND t.tgenabled = 'A');
    bound := greatest(bound, (SELECT date_trunc('hour', max(e.created_at), 'UTC') + interval '1 hour'
                                FROM outbox.events e WHERE e.created_at >= coalesce(bound, '-infinity')));
    IF bound IS NULL THEN
        RETURN;  -- no partition and no event: nothing to bound yet
    END IF;
    INSERT INTO outbox._reach (upper) SELECT bound
     WHERE NOT EXISTS (SELECT FROM outbox._reach r WHERE r.upper >= bound AND r.upper < 'infinity');
    DELETE FROM outbox._reach r
     WHERE r.upper = 'infinity'
        OR r.upper < (SELECT max(s.upper) FROM outbox._reach s WHERE s.upper < 'infinity');
END
$$;

-- Why an event partition past its retention must stay, or NULL when it may go. Rows of open
-- transactions are invisible, so first: no open transaction started before the partition's
-- upper bound (emit's created_at is the transaction's start, so it may still write there),
-- and no transaction, prepared ones included, holds a lock on it (it has written there).
-- (A session with track_activities off shows no transaction start: then nothing may go.)
-- Then no consumer may have an event of it pending (outbox_internal._pending, sql/cursors.sql),
-- a consumer being made included: its cursor is invisible until it commits. So a partition
-- about to go is read again once the run holds the parent as the drop takes it (waiting a
-- second at most, as the drop does: no emit is under way then, none begins until the run ends)
-- and SHARE on outbox.consumers (which create_consumer, drop_consumer and an admin's change of
-- a retry policy write) without waiting: a consumer being made may wait behind its own
-- transaction's emit, which waits for this run. Held until the run ends.
-- VOLATILE, so that these reads take their snapshots after the rest: a STABLE function
-- reads with its caller's, taken before them, which does not show the events of a transaction
-- that ended in between (and that the first two then no longer show either).
CREATE OR REPLACE FUNCTION outbox_internal._partition_pending(part regclass, upper timestamptz) RETURNS text
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pending boolean;
    pid     int;
    again   boolean;
BEGIN
    SELECT a.pid INTO pid FROM pg_stat_activity a
     WHERE a.xact_start < _partition_pending.upper ORDER BY a.xact_start LIMIT 1;
    IF FOUND THEN
        RETURN format('transaction of backend %s, open since before the partition ends, may still write to it', pid);
    END IF;
    IF EXISTS (SELECT FROM pg_stat_activity a WHERE a.state = 'disabled' AND a.pid <> pg_backend_pid()) THEN
        RETURN 'a session with track_activities off may have a transaction open since before the partition ends';
    END IF;
    IF EXISTS (SELECT FROM pg_locks l WHERE l.relation = part AND l.pid IS DISTINCT FROM pg_backend_pid()) THEN
        RETURN 'an open or prepared transaction has written to it';
    END IF;
    FOREACH again IN ARRAY ARRAY[false, true] LOOP
        IF again THEN
            LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE;
            LOCK TABLE outbox.consumers IN SHARE MODE NOWAIT;
        END IF;
        EXECUTE format(
            'SELECT EXISTS (SELECT FROM outbox._shards s
                              CROSS JOIN LATERAL (SELECT l FROM outbox._cursor_log l
                                                   WHERE l.consumer_id = s.consumer_id AND l.shard = s.shard
                                                   ORDER BY l.pos DESC LIMIT 1) AS cur
                             WHERE EXISTS (SELECT FROM %s e WHERE e.shard = s.shard
                                              AND e.seq > outbox_internal._pending_floor(cur.l)
                                              AND outbox_internal._pending(cur.l, e.txid, e.seq)))', part)
            INTO pending;
        IF pending THEN
            RETURN 'a consumer has not read all its events';
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- Seals (outbox._seals, sql/cursors.sql) hold only while no event lands behind one: one made
-- by a transaction that began before a seal's upper but took its seq after the seal was made.
-- That takes a clock stepped back past the seal (a minute or more: seals are made a minute
-- behind it), and such an event lands in a partition whose time is over, or in the default
-- partition. The trigger outbox_seal, defined on outbox.events (so on every partition, whoever
-- makes or attaches it), is on there, ALWAYS (as outbox_reach), and off where emits write. It
-- records a seal break at the event's created_at, in the event's own transaction: in a
-- partition whose time is over, always (events land there only from such a clock, so seldom);
-- in the default partition, when a seal lies above the event. A claim that sees the event
-- committed sees the break (it reads the seals after its window's snapshot: sql/claim.sql), so
-- it trusts no seal above and reads the event's partition. Without it, once the clock was past
-- the seal again and before maintain() noticed, claims skipped the event for good. Not only
-- when a seal it can see lies above: a maintain() that sealed and has not committed yet (held
-- up by a lock, or the clock stepped back while it ran) is invisible to it, and so is the
-- deletion of an earlier break by such a run. A seal made while the event's transaction is
-- open lies a minute below its start (_seal): none is missed.
CREATE OR REPLACE FUNCTION outbox_internal._break_seals() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF (TG_RELID <> 'outbox.events_default'::regclass
        OR EXISTS (SELECT FROM outbox._seals s WHERE s.upper > NEW.created_at))
       -- one break per transaction (its own are the only ones no one else can delete)
       AND NOT EXISTS (SELECT FROM outbox._seal_breaks b
                        WHERE b.at <= NEW.created_at AND b.xmin = pg_current_xact_id()::xid) THEN
        INSERT INTO outbox._seal_breaks (at) VALUES (NEW.created_at);
    END IF;
    RETURN NEW;
END
$$;

-- Turn outbox_seal on (ALWAYS) where the time of an events partition is over (upper at most
-- before) and on the default partition, and off on the parent (what partitions made later
-- start with) and where its time is not over (upper after now: a data-only restore's ENABLE
-- TRIGGER ALL turns it on there). The earliest lower bound of a partition whose time is over
-- but whose trigger could not be turned on (an emit writes there: lock timeout, deadlock), or
-- NULL: no seal may lie above it. A partition whose trigger could not be turned off keeps it
-- until the next run; it costs its emits the native path (src/emit/insert.rs), nothing else.
CREATE OR REPLACE FUNCTION outbox_internal._arm_seals(parts outbox.partitions[], before timestamptz)
RETURNS timestamptz
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    p           record;
    unarmed     timestamptz;
    old_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    FOR p IN SELECT x.partition, x.lower, x.is_default OR x.upper <= before AS over
               FROM unnest(parts) x JOIN pg_trigger t ON t.tgrelid = x.partition AND t.tgname = 'outbox_seal'
              WHERE x.parent = 'outbox.events'::regclass
                AND ((x.is_default OR x.upper <= before) AND t.tgenabled <> 'A'
                     OR NOT x.is_default AND x.upper > now() AND t.tgenabled <> 'D')
              ORDER BY x.lower NULLS FIRST LOOP
        BEGIN
            EXECUTE format('ALTER TABLE %s %s TRIGGER outbox_seal', p.partition,
                           CASE WHEN p.over THEN 'ENABLE ALWAYS' ELSE 'DISABLE' END);
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            IF p.over THEN
                unarmed := least(unarmed, coalesce(p.lower, '-infinity'));
            END IF;
        END;
    END LOOP;
    IF EXISTS (SELECT FROM pg_trigger t WHERE t.tgrelid = 'outbox.events'::regclass
                  AND t.tgname = 'outbox_seal' AND t.tgenabled <> 'D') THEN
        BEGIN
            ALTER TABLE ONLY outbox.events DISABLE TRIGGER outbox_seal;
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;  -- next run: a partition made meanwhile is turned off by it
        END;
    END IF;
    PERFORM set_config('lock_timeout', old_timeout, true);
    RETURN unarmed;
END
$$;

-- Seal the event log's past (outbox._seals, sql/cursors.sql) at the newest upper bound of an
-- events partition that no open transaction, in any database, began before, a minute back:
-- every transaction that began before it has ended or is prepared, so its events already have
-- their seqs, all at most the sequence's value read after. Seals below the oldest partition
-- skip nothing and go (the newest stays). No seal while a restored dump is not yet rebased,
-- nor while a session does not report its transactions (track_activities off: its
-- xact_start is hidden). Seals above a seal break go, with the breaks. The partitions whose
-- time is over are armed first (_arm_seals): no seal lies above one whose trigger is off, so
-- an event that lands behind a seal all the same (a clock gone back) breaks it.
CREATE OR REPLACE FUNCTION outbox_internal._seal(parts outbox.partitions[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    before  timestamptz := least(now(), (SELECT min(a.xact_start) FROM pg_stat_activity a)) - interval '1 minute';
    bound   timestamptz;
    unarmed timestamptz;
BEGIN
    IF (SELECT o.restore_pending FROM outbox._origin o)
       OR EXISTS (SELECT FROM pg_stat_activity a WHERE a.state = 'disabled') THEN
        RETURN;
    END IF;
    IF clock_timestamp() < (SELECT max(s.upper) FROM outbox._seals s) + interval '1 minute' THEN
        -- the clock went back: a transaction begun since may make events behind a seal
        DELETE FROM outbox._seals;
        RAISE WARNING 'outbox.maintain: the clock is behind the newest seal of the event log; dropped the seals'
            USING HINT = 'Claims read every partition until maintain() seals again, once the clock is past them.';
        RETURN;
    END IF;
    -- the breaks it sees, and the seals above them, in one snapshot (a break committed later
    -- lies above every seal made now)
    WITH gone AS (DELETE FROM outbox._seal_breaks b RETURNING b.at)
    DELETE FROM outbox._seals s WHERE s.upper > (SELECT min(g.at) FROM gone g);
    unarmed := outbox_internal._arm_seals(parts, before);
    IF unarmed IS NOT NULL THEN  -- an emit writes behind it: its trigger is off, so no seal above
        DELETE FROM outbox._seals s WHERE s.upper > unarmed;
    END IF;
    SELECT max(x.upper) INTO bound FROM unnest(parts) x
     WHERE x.parent = 'outbox.events'::regclass AND NOT x.is_default AND x.upper <= before
       AND x.upper <= coalesce(unarmed, 'infinity');
    IF bound > coalesce((SELECT max(s.upper) FROM outbox._seals s), '-infinity') THEN
        INSERT INTO outbox._seals (max_seq, upper)
        VALUES (coalesce(pg_sequence_last_value('outbox.event_seq'), 0), bound);
    END IF;
    DELETE FROM outbox._seals s
     WHERE s.upper < (SELECT max(t.upper) FROM outbox._seals t)
       AND s.upper <= (SELECT min(x.lower) FROM unnest(parts) x
                        WHERE x.parent = 'outbox.events'::regclass AND NOT x.is_default);
END
$$;

-- Which inbox rows of the default partition maintain() moves into partitions, as a WHERE
-- clause: UUIDv7 ids of the time it keeps partitions for (retention back, ahead forward).
-- Callers of inbox.claim choose the ids: a partition per distinct day of theirs would let any
-- of them make one run create thousands (out of shared memory, on every run). The rest, and ids
-- that are not UUIDv7 (no time), stay in the default partition, deduplicated there, and are
-- forgotten retention after they were received; a future id moves once its time is in reach.
CREATE OR REPLACE FUNCTION outbox_internal._inbox_ids_to_move(cfg outbox.partition_config) RETURNS text
    LANGUAGE sql STABLE
    RETURN pg_catalog.format(
        'WHERE substr(message_id::text, 15, 1) = ''7'' AND message_id >= %L AND message_id < %L',
        inbox.uuid_at(outbox_internal._floor_time(pg_catalog.now() - cfg.retention, cfg.width)),
        inbox.uuid_at(outbox_internal._floor_time(pg_catalog.now(), cfg.width) + cfg.width * (cfg.ahead + 1)));

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
    moved   boolean;
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
        LOOP  -- each gap of the range (several after a change of width), within the budget
            EXIT WHEN step.used >= budget;
            created := outbox_internal._create_partition(cfg.parent, lo_at, cfg.width);
            EXIT WHEN created IS NULL;
            step.used := step.used + 1;
            step.changed := true;
            EXECUTE format('SELECT EXISTS (SELECT FROM %s)', created) INTO moved;
            IF moved THEN
                RAISE WARNING 'outbox.maintain: rows of % were in its default partition; moved them to %',
                    cfg.parent, created;
                step.rows := step.rows || ROW('moved', created::text, 'rows from the default partition')::outbox_internal._maint_row;
            ELSE
                step.rows := step.rows || ROW('created', created::text, NULL)::outbox_internal._maint_row;
            END IF;
        END LOOP;
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
        LOOP  -- each gap of the range (several after a change of width), within the budget
            EXIT WHEN step.used >= budget AND lo_at > outbox_internal._floor_time(now(), cfg.width) + cfg.width;
            created := outbox_internal._create_partition(cfg.parent, lo_at, cfg.width);
            EXIT WHEN created IS NULL;
            step.used := least(step.used + 1, budget);
            step.changed := true;
            step.rows := step.rows || ROW('created', created::text, NULL)::outbox_internal._maint_row;
        END LOOP;
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
    -- about 0.1 ms each), read again only after a phase changed them; read after the lock
    -- (deparsing a bound opens its partition: a run that attaches one holds the default
    -- partition, and a second run would wait for it instead of skipping)
    parts   outbox.partitions[];
    cfg     outbox.partition_config;
    step    outbox_internal._maint_step;
    skipped text;
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN;  -- a replica follows its primary's maintenance
    END IF;
    -- a partition's events are read before it is dropped: at READ COMMITTED, with a snapshot
    -- taken after the transactions that may write there are known to have ended
    PERFORM outbox_internal._check_read_committed('outbox.maintain()');
    skipped := outbox_internal._maint_lock();
    IF skipped IS NOT NULL THEN
        RETURN QUERY SELECT 'skipped', NULL::text, skipped;
        RETURN;
    END IF;
    parts := outbox_internal._partition_list();
    RETURN QUERY SELECT * FROM outbox_internal._maint_rebase();
    -- (before the drops: a drop_consumer waiting on the run's lock of outbox.consumers has
    -- deleted cursor rows this trim would wait for)
    RETURN QUERY SELECT * FROM outbox_internal._maint_trim();
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
END
$$;
COMMENT ON FUNCTION outbox.maintain() IS
    'Creates partitions ahead, drops (or detaches) those past retention once every consumer has '
    'read them, moves rows out of default partitions, seals the past and records how far ahead '
    'events may lie (claims then skip the partitions they need not read), trims cursor history; '
    'returns what it did. '
    'Safe to run concurrently (one runs, the other skips) and from pg_cron: '
    'SELECT cron.schedule(''outbox-maintain'', ''* * * * *'', ''SELECT * FROM outbox.maintain()'');';

-- The default partitions belong to the extension; dated partitions do not: CREATE EXTENSION
-- makes none (the first outbox.maintain() does, which the worker runs soon after), so that a
-- restore, which runs CREATE EXTENSION first, does not make partitions its dump brings too.
CREATE TABLE IF NOT EXISTS outbox.events_default PARTITION OF outbox.events DEFAULT;
CREATE TABLE IF NOT EXISTS inbox.messages_default PARTITION OF inbox.messages DEFAULT;
SELECT outbox_internal._index_partition('outbox.events', 'outbox.events_default');
SELECT outbox_internal._index_partition('inbox.messages', 'inbox.messages_default');
CREATE OR REPLACE TRIGGER outbox_reach BEFORE INSERT ON outbox.events
    FOR EACH ROW EXECUTE FUNCTION outbox_internal._note_reach();
ALTER TABLE outbox.events ENABLE ALWAYS TRIGGER outbox_reach;
CREATE OR REPLACE TRIGGER outbox_seal BEFORE INSERT ON outbox.events
    FOR EACH ROW EXECUTE FUNCTION outbox_internal._break_seals();
ALTER TABLE outbox.events DISABLE TRIGGER outbox_seal;  -- on by maintain() (_arm_seals)
ALTER TABLE outbox.events_default ENABLE ALWAYS TRIGGER outbox_seal;

-- Restoring a dump puts its partition_config rows over those CREATE EXTENSION made (a plain
-- COPY would collide with them); see sql/dump.sql.
CREATE OR REPLACE FUNCTION outbox_internal._restore_partition_config() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE outbox.partition_config c
       SET width = NEW.width, ahead = NEW.ahead, retention = NEW.retention, detach = NEW.detach
     WHERE c.parent = NEW.parent;
    RETURN CASE WHEN FOUND THEN NULL ELSE NEW END;
END
$$;
CREATE OR REPLACE TRIGGER restore_partition_config BEFORE INSERT ON outbox.partition_config
    FOR EACH ROW EXECUTE FUNCTION outbox_internal._restore_partition_config();
