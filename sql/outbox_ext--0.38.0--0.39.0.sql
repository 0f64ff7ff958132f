-- outbox_ext 0.38.0 -> 0.39.0
--
-- Why: a deploy that started refusing everything dead-lettered the batches already out (a
-- success of a request that started later was taken for the sink's health; that is in the
-- worker). An event written behind a seal that maintain() had made but not yet committed
-- recorded no seal break (its trigger could not see the seal), and once both committed,
-- claims that had read past its shard while it was in flight skipped it for good: the
-- trigger now records a break wherever a partition's time is over, one per transaction
-- (_seal_breaks is indexed). A key parked for long whose producer commits faster than a
-- window is read kept a claim copying its stream for as long as it lasted, the shard locked:
-- a claim opens two windows at most. A reject (or a final report) of an event nacked in the
-- same batch changed nothing, silently: it is refused (22023); an event listed both ways in
-- one settle is dead-lettered; a give-back after a nack and a replay of the key's dead letter
-- left the key on the nack's attempt and backoff. After a change of width, the day's
-- partition was cut to the first gap and the rest never covered: every gap is filled, a
-- partition with no rows moved says "created", and each partition counts against a run's
-- budget. Partition names carry microseconds when a bound has any (a width under a second
-- failed with 42P07 on every run), and a suffix when a detached table keeps the name.
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.39.0'" to load this file. \quit

-- (sql/cursors.sql)
CREATE INDEX IF NOT EXISTS _seal_breaks_at ON outbox._seal_breaks (at);

-- (a give-back undoes the attempt of a key this batch parked, though a replay keeps it parked)
CREATE OR REPLACE FUNCTION outbox_internal._unpark_released(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    page    outbox.events[];  -- the batch's page: what its claim may have copied into queues
    ids     uuid[];           -- and their ids
    emptied text[];           -- keys whose queues lost events of the page
BEGIN
    IF NOT EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = c.id AND p.shard = cur.shard)
       AND NOT EXISTS (SELECT FROM outbox.dead_letters d WHERE d.consumer = c.name) THEN
        RETURN;  -- nothing to undo (the common case: the page is not read again)
    END IF;
    page := outbox_internal._batch(cur);
    ids := ARRAY(SELECT e.id FROM unnest(page) e);
    UPDATE outbox._parked p
       SET attempts = 0, next_attempt_at = now(), nacked_epoch = NULL, nacked_pos = NULL
     WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch
       AND (p.nacked_pos IS NULL  -- parked by this batch (a window event failed): a replay's
                                  -- event may keep it parked, on no attempt of its own
            OR EXISTS (SELECT FROM outbox._parked_events q
                        WHERE q.aggregate_id = p.aggregate_id AND q.consumer_id = c.id
                          AND q.pos = p.nacked_pos AND q.id = ANY (ids)
                       OFFSET 0));  -- a lookup by the key's queue position, not a semi-join
    WITH unparked AS (
        DELETE FROM outbox._parked p
         WHERE p.consumer_id = c.id AND p.shard = cur.shard AND p.nacked_epoch = cur.epoch
           AND NOT EXISTS (SELECT FROM outbox._parked_events q
                            WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                              AND (q.id = ANY (cur.heads) OR q.id <> ALL (ids)))
        RETURNING p.aggregate_id)
    DELETE FROM outbox._parked_events q
     USING unparked u
     WHERE q.consumer_id = c.id AND q.aggregate_id = u.aggregate_id;
    WITH gone AS (DELETE FROM outbox._parked_events q
                   WHERE q.consumer_id = c.id AND q.id = ANY (ids) RETURNING q.aggregate_id)
    SELECT array_agg(DISTINCT g.aggregate_id) INTO emptied FROM gone g;
    -- a key whose whole queue was of the page (a replay queued its dead letter while the batch
    -- was out) flows with the page again: parked with nothing queued, it would take a due
    -- head's place in claims and hand out nothing
    PERFORM outbox_internal._unpark_emptied(c.id, coalesce(emptied, '{}'));
    DELETE FROM outbox.dead_letters d
     USING unnest(page) e
     WHERE d.consumer = c.name AND d.aggregate_id = e.aggregate_id AND d.event_id = e.id;
END
$$;

-- (a reject of an event nacked in its batch is refused, not ignored)
CREATE OR REPLACE FUNCTION outbox_internal._fail_keys(c outbox.consumers, cur outbox._cursor_log,
                                             batch outbox.events[], firsts outbox_internal._failure[]) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    fresh   outbox_internal._failure[];  -- the keys not failed in this batch before
    early   uuid;
    retried uuid;
    parked  text[];
    riders  text[];  -- keys with heads in this batch whose events of the page failed
    kept    int;
BEGIN
    -- where each key failed in this batch before, if it did: a head's key by its record, a
    -- window event's key by its events of the batch already queued or dead-lettered
    WITH before AS (
        SELECT f, CASE WHEN f.head THEN
                   (SELECT p.nacked_pos FROM outbox._parked p
                     WHERE p.consumer_id = c.id AND p.aggregate_id = f.aggregate_id
                       AND p.nacked_epoch = cur.epoch)
               ELSE (SELECT min(x.seq) FROM unnest(batch) b
                      CROSS JOIN LATERAL (
                          SELECT q.seq FROM outbox._parked_events q
                           WHERE q.consumer_id = c.id AND q.id = b.id
                          UNION ALL
                          SELECT d.seq FROM outbox.dead_letters d
                           WHERE d.consumer = c.name AND d.aggregate_id = b.aggregate_id AND d.event_id = b.id) x
                      WHERE b.aggregate_id = f.aggregate_id)
               END AS failed_from
          FROM unnest(firsts) f)
    SELECT (SELECT (b.f).event_id FROM before b WHERE (b.f).seq < b.failed_from LIMIT 1),
           -- a reject of the very event a nack of this batch queued for a retry: it would
           -- change nothing (not one a replay queued again after a reject: that one is dead)
           (SELECT (b.f).event_id FROM before b
             WHERE (b.f).final AND (b.f).seq = b.failed_from
               AND EXISTS (SELECT FROM outbox._parked_events q
                            WHERE q.consumer_id = c.id AND q.id = (b.f).event_id)
               AND EXISTS (SELECT FROM outbox._parked p
                            WHERE p.consumer_id = c.id AND p.aggregate_id = (b.f).aggregate_id
                              AND p.nacked_epoch = cur.epoch)
             LIMIT 1),
           ARRAY(SELECT b.f FROM before b WHERE b.failed_from IS NULL)
      INTO early, retried, fresh;
    IF early IS NOT NULL THEN
        RAISE EXCEPTION 'event % comes before an event of its key already reported failed in this batch', early
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Report a key''s failures in batch order, or all at once with outbox.settle.';
    ELSIF retried IS NOT NULL THEN
        RAISE EXCEPTION 'event % was reported failed in this batch already, to be retried', retried
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Report an event''s failure once per claim: reject it the first time, or '
                         'when it is claimed again.';
    END IF;
    -- the window's events kept back: from a failed one on, or all that rode behind a failed head
    kept := (SELECT count(*) FROM unnest(batch) b JOIN unnest(fresh) f ON f.aggregate_id = b.aggregate_id
              WHERE CASE WHEN f.head THEN NOT EXISTS (SELECT FROM outbox._parked_events q
                                                       WHERE q.consumer_id = c.id AND q.id = b.id)
                         ELSE b.seq >= f.seq END);
    IF EXISTS (SELECT FROM unnest(fresh) f WHERE f.head) THEN
        -- the heads from each failed one on, each head looked up by its id (see _deliver_rest)
        kept := kept + (SELECT count(*) FROM unnest(cur.heads) AS out(id)
                         WHERE EXISTS (SELECT FROM outbox._parked_events h JOIN unnest(fresh) f
                                           ON f.head AND f.aggregate_id = h.aggregate_id AND h.pos >= f.seq
                                        WHERE h.consumer_id = c.id AND h.id = out.id OFFSET 0));
    END IF;
    -- window events park their keys; a key parked meanwhile (a replay) keeps its record: its
    -- events wait behind its queue, nothing counted
    WITH made AS (
        INSERT INTO outbox._parked (consumer_id, aggregate_id, shard, next_attempt_at)
        SELECT c.id, f.aggregate_id, cur.shard, now() FROM unnest(fresh) f WHERE NOT f.head
        ON CONFLICT DO NOTHING
        RETURNING aggregate_id)
    SELECT array_agg(m.aggregate_id) INTO parked FROM made m;
    IF parked IS NOT NULL THEN
        PERFORM outbox_internal._replan_when_grown('outbox._parked');
    END IF;
    IF cardinality(cur.heads) > 0 AND EXISTS (SELECT FROM unnest(fresh) f WHERE NOT f.head) THEN
        -- (not a key whose queue a replay lengthened while the batch was out: the replayed
        -- event heads it once the heads are through, and did not fail). Each failed key's
        -- queue is looked up on its own (OFFSET 0: a semi- or anti-join planned while the
        -- queues were tiny could read all of them); most are empty, the key not parked.
        riders := ARRAY(SELECT f.aggregate_id FROM unnest(fresh) f
                         WHERE NOT f.head
                           AND EXISTS (SELECT FROM outbox._parked_events q
                                        WHERE q.aggregate_id = f.aggregate_id AND q.consumer_id = c.id
                                          AND q.id = ANY (cur.heads) OFFSET 0)
                           AND NOT EXISTS (SELECT FROM outbox._parked_events q
                                            WHERE q.aggregate_id = f.aggregate_id AND q.consumer_id = c.id
                                              AND q.id <> ALL (cur.heads) OFFSET 0));
    END IF;
    -- (a head's key: its events of the page that were copied when the claim read them, as a key
    -- that did not ride has, are there already: ON CONFLICT)
    PERFORM outbox_internal._queue_parked(c.id, ARRAY(
        SELECT b FROM unnest(batch) b JOIN unnest(fresh) f ON f.aggregate_id = b.aggregate_id
         WHERE f.head OR b.seq >= f.seq ORDER BY b.seq));
    IF cardinality(riders) > 0 THEN
        fresh := ARRAY(SELECT CASE WHEN f.head OR f.aggregate_id <> ALL (riders) THEN f
                              ELSE ROW(f.event_id, f.aggregate_id,
                                       (SELECT q.pos FROM outbox._parked_events q
                                         WHERE q.consumer_id = c.id AND q.id = f.event_id),
                                       true, f.error, f.retry_after, f.final, f.attempted)::outbox_internal._failure
                              END
                         FROM unnest(fresh) f);
    END IF;
    PERFORM outbox_internal._keys_failed(c, ARRAY(SELECT f FROM unnest(fresh) f
                                                   WHERE f.head OR f.aggregate_id = ANY (parked)),
                                         cur.epoch);
    RETURN kept;
END
$$;

-- (an event listed twice: its final listing counts)
CREATE OR REPLACE FUNCTION outbox_internal._fail_batch(c outbox.consumers, cur outbox._cursor_log,
                                              failures outbox_internal._failure[]) RETURNS int
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    batch  outbox.events[] := outbox_internal._batch(cur, c, ARRAY(SELECT f.event_id FROM unnest(failures) f));
    firsts outbox_internal._failure[];
    f      outbox_internal._failure;
    kept   int := 0;
BEGIN
    firsts := ARRAY(SELECT DISTINCT ON (r.aggregate_id) r
                      FROM unnest(outbox_internal._resolve(c, cur, batch, failures)) AS r
                     -- a key's heads before its page; an event listed twice, final first
                     ORDER BY r.aggregate_id, r.head DESC, r.seq, r.final DESC);
    BEGIN
        kept := outbox_internal._fail_keys(c, cur, batch, firsts);
    EXCEPTION WHEN invalid_parameter_value THEN
        RAISE;  -- a report _fail_keys refuses (out of order, a reject after a nack): the relay's to mend
    WHEN OTHERS THEN
        kept := 0;
        FOREACH f IN ARRAY firsts LOOP
            kept := kept + outbox_internal._fail_key_or_say_why(c, cur, batch, f);
        END LOOP;
    END;
    RETURN kept;
END
$$;

-- (partition names: microseconds when a bound has any)
CREATE OR REPLACE FUNCTION outbox_internal._partition_name(parent text, lo_at timestamptz) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    -- (microseconds too when there are any: widths under a second, and gaps a change of width
    -- left, give bounds within one second)
    RETURN parent || '_p' || pg_catalog.to_char(lo_at AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS')
           || CASE WHEN pg_catalog.to_char(lo_at AT TIME ZONE 'UTC', 'US') <> '000000'
                   THEN pg_catalog.to_char(lo_at AT TIME ZONE 'UTC', '"_"US') ELSE '' END;

-- (a partition fills the first gap of its range; a name taken by a detached table gets a suffix)
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

-- (every gap of a range is filled: several after a change of width)
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

-- (every gap of a range is filled: several after a change of width)
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

-- (a claim opens two windows at most: a key parked for long, streaming in, kept it copying)
CREATE OR REPLACE FUNCTION outbox_internal._claim_parked(c outbox.consumers, cur outbox._cursor_log,
                                                batch_size int, lease interval, owner text,
                                                seq_mark bigint, x xid8)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    stale     boolean := cur.hi_snap IS NOT NULL;  -- as in _claim
    keys      jsonb := (SELECT CASE WHEN count(*) <= batch_size  -- see below
                                     THEN coalesce(jsonb_object_agg(t.k, true), '{}') END
                          FROM (SELECT p.aggregate_id FROM outbox._parked p
                                 WHERE p.consumer_id = c.id AND p.shard = cur.shard
                                 LIMIT batch_size + 1) AS t(k));
    fresh     boolean;
    page      outbox.events[];
    queued    outbox.events[];  -- the page's events of parked keys
    mine      outbox.events[];  -- and the others (riding keys' among them)
    heads     outbox.claimed[] := outbox_internal._due_heads(c, cur.shard, batch_size);
    riding    jsonb := outbox_internal._riding(c, heads);
    exhausted boolean;
    all_due     boolean;  -- a page of parked keys' events only: are all their keys due,
    catching_up boolean;  -- and all catching up?
    held        boolean := false;  -- such a page left to read once their queues are out
    share       int;  -- of batch_size, each key catching up gets (as _due_heads gives it)
    windows     int := 0;  -- windows this call opened
    since     timestamptz;
    until     timestamptz;
BEGIN
    LOOP
        fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
        IF cur.hi_snap IS NULL THEN
            cur := outbox_internal._open_window(cur, seq_mark, x);
            windows := windows + 1;
        END IF;
        since := outbox_internal._window_since(cur, outbox_internal._newest_seal());
        until := outbox_internal._reach();  -- both after the window's snapshot: see _claim
        page := ARRAY(SELECT w FROM outbox_internal._window_events(cur, NULL, batch_size, since, until) AS w);
        exhausted := cardinality(page) < batch_size;
        -- each event's key looked up among the shard's parked keys, read once into keys (a
        -- JSON object: its keys are sorted, ? searches them) when they are no more than a
        -- page's events; else through _parked's key, once per event (a join planned from
        -- statistics taken while nothing was parked compared every event with every parked
        -- key). A lookup in _parked per event was half of a drain with 5% of its events
        -- failing (#38): every failure leaves versions of _parked that such lookups walk.
        SELECT coalesce(array_agg(k.e ORDER BY (k.e).seq) FILTER (WHERE k.parked), '{}'),
               coalesce(array_agg(k.e ORDER BY (k.e).seq) FILTER (WHERE NOT k.parked), '{}')
          INTO queued, mine
          FROM (SELECT e, CASE WHEN keys IS NULL
                               THEN EXISTS (SELECT FROM outbox._parked p
                                             WHERE p.consumer_id = c.id AND p.aggregate_id = e.aggregate_id)
                               ELSE keys ? e.aggregate_id END AND NOT riding ? e.aggregate_id AS parked
                  FROM unnest(page) e
                OFFSET 0) k;  -- parked worked out once per event, not once per FILTER
        IF cardinality(mine) = 0 AND cardinality(page) > 0 THEN
            -- only parked keys' events here: are all their keys due, at their first retry or
            -- catching up; and are all catching up (due, their last head through) with a queue
            -- that two claims' shares empty (so that keys behind the page wait two claims at
            -- most), none of the page's events queued already (by a claim given back)?
            share := greatest(1, batch_size / greatest(1, (
                         SELECT count(*) FROM (SELECT FROM outbox._parked p
                                                WHERE p.shard = cur.shard AND p.consumer_id = c.id
                                                  AND p.next_attempt_at <= now() LIMIT batch_size) d)));
            SELECT bool_and(p.next_attempt_at <= now() AND (p.attempts = 1 OR p.head_through)),
                   bool_and(p.next_attempt_at <= now() AND p.head_through
                            AND (SELECT count(*) FROM (SELECT FROM outbox._parked_events q
                                                        WHERE q.aggregate_id = p.aggregate_id AND q.consumer_id = c.id
                                                        LIMIT 2 * share + 1) n) BETWEEN 1 AND 2 * share
                            AND NOT EXISTS (SELECT FROM outbox._parked_events q
                                             WHERE q.id = k.first_id AND q.consumer_id = c.id))
              INTO all_due, catching_up
              FROM (SELECT DISTINCT ON (q.aggregate_id) q.aggregate_id, q.id AS first_id
                      FROM unnest(queued) q ORDER BY q.aggregate_id, q.seq) k
             CROSS JOIN LATERAL (SELECT p.* FROM outbox._parked p
                                  WHERE p.aggregate_id = k.aggregate_id AND p.consumer_id = c.id) p;
            IF catching_up THEN
                -- the page waits until their queues, handed out below, are empty and they flow
                -- with the shard again: not copied into the queues and out again (#38: a hot key)
                page := '{}';
                exhausted := false;  -- the window is not read to its end: the page is still to read
                held := true;
                EXIT;
            END IF;
        END IF;
        PERFORM outbox_internal._queue_parked(c.id, queued);
        EXIT WHEN cardinality(mine) > 0;
        -- A second window this call opened and still only parked keys' events: enough for one
        -- call. (A key parked for long, its producer committing faster than a window is read,
        -- kept the claim copying its stream into its queue for as long as the stream lasted,
        -- the shard locked.) Heads to hand out go with this page; else the shard moves past
        -- it below, and the next claim goes on.
        EXIT WHEN windows > 1 AND cardinality(heads) > 0;
        IF cardinality(page) > 0 THEN
            -- record that the shard moved past the page; go on to the next, unless its keys
            -- are all due at their first retry or catching up: their heads make this batch,
            -- and the shard moves past a page of them per claim, not all their events at once,
            -- so that a key failing once keeps its backlog in the log (a key failing again, or
            -- refused unjudged, is moved past at once; and not when the page ended the window,
            -- which the batch's claim row must be in)
            cur := outbox_internal._advance(cur, page[cardinality(page)].seq, exhausted);
            PERFORM outbox_internal._append(cur);
            EXIT WHEN all_due AND NOT exhausted;
            EXIT WHEN windows > 1;  -- nothing to hand out: the next claim goes on from here
        ELSIF fresh THEN
            EXIT;  -- nothing new since the last window
        ELSE
            cur := outbox_internal._next_window(cur);
        END IF;
    END LOOP;
    IF cardinality(mine) = 0 AND cardinality(heads) = 0 THEN
        -- only a window found empty is recorded so: a page held is still to read, and one the
        -- shard moved past is recorded already, with the rest of its window still to read
        IF NOT held AND cardinality(page) = 0 THEN
            PERFORM outbox_internal._record_empty(cur, stale, outbox_internal._newest_seal());
        END IF;
        RETURN;
    END IF;
    cur := outbox_internal._claimed(cur, owner, lease,
                           CASE WHEN cardinality(page) > 0 THEN page[cardinality(page)].seq ELSE cur.after_seq END,
                           exhausted, ARRAY(SELECT h.id FROM unnest(heads) h));
    PERFORM outbox_internal._append(cur);
    RETURN QUERY  -- heads first: a riding key's events of the page come after its queue
    SELECT h.shard, cur.epoch, h.id, h.topic, h.aggregate_type, h.aggregate_id, h.event_type,
           h.payload, h.headers, h.created_at, h.seq, h.attempt
      FROM unnest(heads) AS h;
    RETURN QUERY
    SELECT cur.shard, cur.epoch, m.id, m.topic, m.aggregate_type, m.aggregate_id, m.event_type,
           m.payload, m.headers, m.created_at, m.seq, 1
      FROM unnest(mine) AS m ORDER BY m.seq;
END
$$;

-- (an event behind time breaks the seals though it cannot see them: a maintain() not committed yet)
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
