-- outbox_ext: claims — a shard taken under a lease, its next batch handed out in commit order.
--
-- A claim locks one free shard's row (FOR UPDATE SKIP LOCKED), opens or continues its commit
-- window (sql/cursors.sql), and writes a claim row: owner, lease expiry, epoch (+1 on every
-- claim) and the batch's end. A shard with parked keys (sql/parking.sql) hands out its due
-- heads before the page, and its parked keys' events join their queues instead of going out,
-- but those of a key whose whole queue is among the heads: they follow it (the key rides).
-- release and release_owner give batches back unsettled.
--
-- Keeps: at most one batch of a shard out under a live lease; whatever reports on a batch
-- names its epoch, and a stale epoch is refused (_leased); a claim takes its bound before its
-- transaction writes anything.
--
-- Name resolution (sql/grants.sql): the API functions are [pinned], helpers (outbox_internal._*) run
-- [inside] them and do not pin search_path themselves: only the SECURITY DEFINER API functions
-- call them, and those pin it. A SET clause on every helper would cost each call a GUC save and
-- restore and a new search path lookup, about 5% of a claim.
--
-- Rerunnable: tables and indexes only where missing, functions replaced. A changed table needs
-- its own ALTER in the upgrade script.

INSERT INTO outbox._reach (upper) VALUES ('infinity');  -- no bound until maintain() records one

-- One row of a claimed batch.
DO $type$
BEGIN
    CREATE TYPE outbox.claimed AS (
        shard          int,
        epoch          bigint,
        id             uuid,
        topic          text,
        aggregate_type text,
        aggregate_id   text,
        event_type     text,
        payload        jsonb,
        headers        jsonb,
        created_at     timestamptz,
        seq            bigint,
        attempt        int
    );
EXCEPTION WHEN duplicate_object THEN NULL;  -- rerun: the type is there
END
$type$;

COMMENT ON TYPE outbox.claimed IS
    'A claimed event: ack or nack it with (shard, epoch); attempt is 1 + its earlier failures.';

-- Lock a shard for ack/nack/release and return its cursor, refusing a stale epoch.
CREATE OR REPLACE FUNCTION outbox_internal._leased(consumer_id int, shard int, epoch bigint) RETURNS outbox._cursor_log
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    cur outbox._cursor_log;
BEGIN
    PERFORM outbox_internal._not_null(shard IS NULL, 'shard', 'the function (the shard a claimed row came with)');
    PERFORM outbox_internal._not_null(epoch IS NULL, 'epoch', 'the function (the epoch a claimed row came with)');
    PERFORM outbox_internal._check_shard(shard);
    PERFORM FROM outbox._shards s
     WHERE s.consumer_id = _leased.consumer_id AND s.shard = _leased.shard FOR UPDATE;
    cur := outbox_internal._cursor(consumer_id, shard);
    IF cur.epoch IS DISTINCT FROM epoch OR cur.owner IS NULL THEN
        RAISE EXCEPTION 'the batch of shard % with epoch % is no longer held', shard, epoch
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = format('The shard is at epoch %s%s.', cur.epoch,
                                  CASE WHEN cur.owner IS NULL THEN ', with no batch out' ELSE
                                  format(', held by %s', cur.owner) END),
                  HINT = 'Its lease expired and another claim took the shard, or it was already '
                         'acked or released; drop the batch and claim again.';
    END IF;
    RETURN cur;
END
$$;

-- The bound every window a claim opens closes at: the event seq, then a fresh xid (see the
-- header), taken before the transaction writes anything (_check_claim refused a transaction
-- that had). Once a second it is also recorded as a mark (outbox._marks).
CREATE OR REPLACE FUNCTION outbox_internal._claim_bound(OUT seq bigint, OUT x xid8)
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    seq := coalesce(pg_sequence_last_value('outbox.event_seq'), 0);
    x := pg_current_xact_id();
    IF coalesce((SELECT m.at FROM outbox._marks m ORDER BY m.top DESC LIMIT 1), '-infinity')
       < now() - interval '1 second' THEN
        INSERT INTO outbox._marks (top, seq) VALUES (x, seq) ON CONFLICT DO NOTHING;
    END IF;
END
$$;

-- A claim's arguments, and that its transaction has not written yet (its bound must come first,
-- even when it finds nothing: the rule does not depend on the backlog).
CREATE OR REPLACE FUNCTION outbox_internal._check_claim(batch_size int, lease interval, shards int, func text)
RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION '% must come before any write in its transaction', func
            USING ERRCODE = 'active_sql_transaction',
                  HINT = 'Call it in a transaction of its own (autocommit is fine).';
    END IF;
    PERFORM outbox_internal._not_null(batch_size IS NULL, 'batch_size', func);
    PERFORM outbox_internal._not_null(lease IS NULL, 'lease', func);
    PERFORM outbox_internal._check_interval(lease, 'lease', '1 day', false);
    PERFORM outbox_internal._not_null(shards IS NULL, 'shards', func);
    IF batch_size < 1 OR batch_size > 100000 THEN
        RAISE EXCEPTION 'batch_size % is out of range', batch_size
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass 1 to 100000.';
    END IF;
    IF shards < 1 THEN
        RAISE EXCEPTION 'shards % is out of range', shards
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass 1 or more: the most shards whose batches one call hands out.';
    END IF;
END
$$;

-- A shard's cursor if a claim may take the shard now: it locks the shard (SKIP LOCKED), which
-- then has no batch out under a live lease, and has something to read: parked keys (parked),
-- a window open, or an event it may read (above _probe_floor: one index probe; no window is
-- opened for nothing), or a floor behind the newest seal (an empty window read once moves it
-- past).
-- Otherwise no cursor.
CREATE OR REPLACE FUNCTION outbox_internal._free_cursor(consumer_id int, shard int, newest outbox._seals,
                                               until timestamptz, OUT cur outbox._cursor_log, OUT parked boolean)
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    floor_seq bigint;
    since     timestamptz;
BEGIN
    PERFORM FROM outbox._shards s
     WHERE s.consumer_id = _free_cursor.consumer_id AND s.shard = _free_cursor.shard
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;  -- another claim is taking this shard right now
    END IF;
    cur := outbox_internal._cursor(consumer_id, shard);
    IF cur.lease_until > now() THEN
        cur := NULL;  -- a batch is out under a live lease, or a release asked to wait
        RETURN;
    ELSIF cur.owner IS NOT NULL THEN
        -- a batch whose lease ran out: given back as outbox.release gives it back, so that a
        -- key its relay nacked before it died is read again from the page, in order
        PERFORM outbox_internal._unpark_released(c, cur)
           FROM outbox.consumers c WHERE c.id = _free_cursor.consumer_id;
    END IF;
    parked := EXISTS (SELECT FROM outbox._parked p
                       WHERE p.consumer_id = _free_cursor.consumer_id AND p.shard = _free_cursor.shard);
    IF NOT parked AND cur.hi_snap IS NULL AND cur.restored_seq IS NULL THEN
        -- a value: the probe's index bound
        floor_seq := outbox_internal._probe_floor(cur, pg_current_snapshot());
        since := outbox_internal._since(floor_seq, newest);
        IF NOT outbox_internal._any_events(ARRAY[shard], ARRAY[floor_seq], since, until)
           AND NOT outbox_internal._behind_a_seal(cur, newest) THEN
            cur := NULL;
        END IF;
    END IF;
END
$$;

-- The shards where a claim may find something for the consumer: those not under a live lease
-- with parked keys due, a window open, a restored cursor, a floor behind a seal, or an event
-- they may read (above _probe_floor) — what _free_cursor asks of each shard, asked of all of
-- them read-only, without locking a shard or taking an xid. In the order their cursors last moved, longest ago
-- first: a claim takes the shard that has waited longest, so that an event normally waits
-- behind no more than one batch of each other shard (picked at random, a shard could be passed
-- over claim after claim while more shards had work than a relay has slots). NULL: every shard
-- (one picked at random is free with a window open, as most are in a backlog, where reading
-- every cursor would cost more than it saves). Empty: no shard, so a claim with nothing to do
-- (an idle relay's poll, or one whose work is all leased) stops here and writes nothing: no row
-- lock, no mark, no commit record. A shard listed may still give nothing (a lock, a lease taken
-- since, events not yet committed). Listed, a claim of a sparse stream tries the one shard that
-- has events instead of every shard in turn (#38: about half of such a claim).
CREATE OR REPLACE FUNCTION outbox_internal._shards_with_work(consumer_id int) RETURNS int[]
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    one    outbox._cursor_log := outbox_internal._cursor(consumer_id, floor(random() * outbox.shard_count())::int);
    newest outbox._seals;
    listed int[];    -- shards with a window open, restored, or behind a seal; then with work
    leased int[];    -- shards under a live lease (or a release's wait)
    shards int[];    -- every shard, the longest since its cursor last moved first
    floors bigint[]; -- and where its probe starts
    snap   pg_snapshot := pg_current_snapshot();
    due    int[] := '{}';
BEGIN
    IF (one.hi_snap IS NOT NULL OR one.restored_seq IS NOT NULL) AND coalesce(one.lease_until <= now(), true) THEN
        RETURN NULL;
    END IF;
    newest := outbox_internal._newest_seal();
    -- each shard's newest cursor row read once, into plain arrays (an array of cursor rows,
    -- read again for each question, cost as much as the reads)
    SELECT array_agg(s.shard ORDER BY s.shard)
               FILTER (WHERE (cur.l).hi_snap IS NOT NULL OR (cur.l).restored_seq IS NOT NULL
                          OR outbox_internal._behind_a_seal(cur.l, newest)),
           array_agg(s.shard ORDER BY s.shard) FILTER (WHERE (cur.l).lease_until > now()),
           array_agg(s.shard ORDER BY (cur.l).pos),
           array_agg(outbox_internal._probe_floor(cur.l, snap) ORDER BY (cur.l).pos)
      INTO listed, leased, shards, floors
      FROM generate_series(0, outbox.shard_count() - 1) AS s(shard)
     CROSS JOIN LATERAL (SELECT l FROM outbox._cursor_log l
                          WHERE l.consumer_id = _shards_with_work.consumer_id AND l.shard = s.shard
                          ORDER BY l.pos DESC LIMIT 1) AS cur(l);
    -- a parked key counts once it is due: one waiting for its backoff gives a claim nothing
    -- to do (its new events, if any, are found with the shard's); each shard probed once, only
    -- when some key is due
    IF EXISTS (SELECT FROM outbox._parked p
                WHERE p.consumer_id = _shards_with_work.consumer_id AND p.next_attempt_at <= now()) THEN
        due := ARRAY(SELECT s FROM unnest(shards) AS s
                      WHERE EXISTS (SELECT FROM outbox._parked p
                                     WHERE p.consumer_id = _shards_with_work.consumer_id AND p.shard = s
                                       AND p.next_attempt_at <= now()));
    END IF;
    -- one since for every shard (the lowest floor's): partitions pruned before they are opened
    listed := coalesce(listed, '{}') || due
              || outbox_internal._shards_with_new_events(
                     shards, floors,
                     outbox_internal._since((SELECT min(f) FROM unnest(floors) AS f), newest),
                     outbox_internal._reach());
    RETURN ARRAY(SELECT w.s FROM unnest(shards) WITH ORDINALITY AS w(s, i)
                  WHERE w.s = ANY (listed) AND w.s <> ALL (coalesce(leased, '{}'))
                  ORDER BY w.i);
END
$$;

-- The claim row of a batch: the cursor, leased to owner, with the batch's last seq, whether
-- it ends the window, and the parked heads handed out with it. Written by _append alone.
CREATE OR REPLACE FUNCTION outbox_internal._claimed(cur outbox._cursor_log, owner text, lease interval,
                                           batch_end bigint, exhausted boolean, heads uuid[])
RETURNS outbox._cursor_log
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    cur.epoch := cur.epoch + 1;
    cur.owner := owner;
    -- from the call, not the transaction's start: a relay that polls in one transaction (a
    -- driver out of autocommit) would take a lease run out already, and another relay the batch
    cur.lease_until := statement_timestamp() + lease;
    cur.batch_end := batch_end;
    cur.exhausted := exhausted;
    cur.heads := heads;
    RETURN cur;
END
$$;

-- Nothing new since the last window (cur: the window just opened, found empty): record the
-- empty window as read when that raises where the next probe starts (_probe_floor; a rise of
-- the pending floor is one: the transactions that held it down have ended, so the probe
-- counted them), so that the next claim's probe starts above what this one read (a
-- transaction in flight at the last bound, ended since: else, while a long one holds the
-- pending floor down, the shard would be listed at every poll); when the claim began in a
-- window that held nothing more (stale: else every poll would read it to its end again, and
-- _shards_with_work would never say none); or when the shard was read for a seal (once per
-- seal).
CREATE OR REPLACE FUNCTION outbox_internal._record_empty(cur outbox._cursor_log, stale boolean, newest outbox._seals)
RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    next outbox._cursor_log := outbox_internal._advance(cur, NULL, true);
    snap pg_snapshot := pg_current_snapshot();
BEGIN
    IF outbox_internal._probe_floor(next, snap) > outbox_internal._probe_floor(cur, snap) OR stale
       OR outbox_internal._behind_a_seal(cur, newest) THEN
        PERFORM outbox_internal._append(next);
    END IF;
END
$$;

-- Claim the next batch of at most `batches` free shards of those listed (_shards_with_work), in
-- their order (NULL: all, tried from a random one on): each shard's events in commit order,
-- handed out by _claim_page, which also writes the shard's claim row; or, when a shard has
-- parked keys, the rows of _claim_parked, returned. Each shard its own batch and epoch; the
-- windows opened all close at the transaction's one bound (seq_mark, x). Nothing when no shard
-- has work.
CREATE OR REPLACE FUNCTION outbox_internal._claim(c outbox.consumers, batch_size int, lease interval,
                                         owner text, seq_mark bigint, x xid8, shards int[], batches int)
RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    tried  int[] := coalesce(shards, ARRAY(SELECT generate_series(0, outbox.shard_count() - 1)));
    n      int := cardinality(tried);
    start  int := CASE WHEN shards IS NULL THEN floor(random() * n)::int ELSE 0 END;
    newest outbox._seals := outbox_internal._newest_seal();  -- for the probes: see _since
    until  timestamptz := outbox_internal._reach();  -- for the probes; a window reads it again
    free   record;
    cur    outbox._cursor_log;
    fresh  boolean;
    stale  boolean;
    since  timestamptz;
    got    bigint;
    taken  int := 0;
BEGIN
    FOR i IN 0 .. n - 1 LOOP
        free := outbox_internal._free_cursor(c.id, tried[(start + i) % n + 1], newest, until);
        CONTINUE WHEN free.cur IS NULL;
        got := 0;
        cur := free.cur;
        stale := cur.hi_snap IS NOT NULL;  -- a window open, perhaps read to its end already
        IF free.parked THEN
            RETURN QUERY SELECT * FROM outbox_internal._claim_parked(c, cur, batch_size, lease, owner, seq_mark, x);
            GET DIAGNOSTICS got = ROW_COUNT;
        ELSE LOOP
            fresh := cur.hi_snap IS NULL AND cur.restored_seq IS NULL;
            IF cur.hi_snap IS NULL THEN
                cur := outbox_internal._open_window(cur, seq_mark, x);
            END IF;
            -- both read after the window's snapshot: an event it sees committed has broken
            -- the seals it lies behind (_break_seals), or recorded its reach (_reach)
            since := outbox_internal._window_since(cur, outbox_internal._newest_seal());
            until := outbox_internal._reach();
            got := outbox_internal._claim_page(cur, batch_size, owner, lease, since, until);
            EXIT WHEN got > 0;
            IF fresh THEN
                PERFORM outbox_internal._record_empty(cur, stale, newest);
                EXIT;
            END IF;
            cur := outbox_internal._next_window(cur);
        END LOOP; END IF;
        IF got > 0 THEN
            taken := taken + 1;
            EXIT WHEN taken >= batches;
        END IF;
    END LOOP;
END
$$;

-- The parked keys of a shard that are due, in the order they fell due, and events of their
-- queues from the head on, at most lim in all: one of a key whose head is failing (a retry
-- probes with one event), and an equal share of lim each of a key catching up (its head went
-- through, or it waits uncounted), so that a key alone drains its queue a full batch at a time.
CREATE OR REPLACE FUNCTION outbox_internal._due_heads(c outbox.consumers, shard int, lim int)
RETURNS outbox.claimed[]
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    due   outbox._parked[] := ARRAY(SELECT p FROM outbox._parked p
                                     WHERE p.consumer_id = c.id AND p.shard = _due_heads.shard
                                       AND p.next_attempt_at <= now()
                                     ORDER BY p.next_attempt_at LIMIT lim);
    share int := greatest(1, lim / greatest(cardinality(due), 1));
BEGIN
    RETURN ARRAY(
        SELECT ROW(_due_heads.shard, NULL, q.id, q.topic, q.aggregate_type, q.aggregate_id,
                   q.event_type, q.payload, q.headers, q.created_at, q.seq, p.attempts + 1)::outbox.claimed
          FROM unnest(due) WITH ORDINALITY AS p
         CROSS JOIN LATERAL (SELECT * FROM outbox._parked_events q
                              WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                              ORDER BY q.pos LIMIT CASE WHEN p.attempts > 0 THEN 1 ELSE share END) AS q
         ORDER BY p.ordinality, q.pos);
END
$$;

-- Of the due heads a claim hands out (_due_heads), the keys that ride (a JSON object of them,
-- for ?): each at a first attempt (catching up, or waiting uncounted, so its heads go out with
-- the rest of the batch, not alone: src/sinks/mod.rs) with its whole queue among the heads, so
-- that its events of the page may follow its queue in the same batch. A key probed after a
-- failure does not ride: its probe is one event, and a page's events behind a head failing
-- again would be copied into its queue all the same.
CREATE OR REPLACE FUNCTION outbox_internal._riding(c outbox.consumers, heads outbox.claimed[]) RETURNS jsonb
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (SELECT coalesce(jsonb_object_agg(h.aggregate_id, true), '{}')
              FROM (SELECT k.aggregate_id, count(*) AS n FROM unnest(heads) k
                     GROUP BY k.aggregate_id HAVING max(k.attempt) = 1) h
             WHERE (SELECT count(*) FROM (SELECT FROM outbox._parked_events q
                                           WHERE q.aggregate_id = h.aggregate_id AND q.consumer_id = c.id
                                           LIMIT h.n + 1) q) = h.n);
END
$$;

-- _claim for a shard with parked keys: the batch holds the due heads (_due_heads: at most
-- batch_size more), first, then the page. A key whose whole queue is among the heads, at a
-- first attempt (catching up, or waiting uncounted), rides: its events of the page go out
-- behind its queue, in order, and when they all go through the key is unparked with nothing
-- copied (#38: each copy was written, read and deleted again, most of a drain with 5% of its
-- events failing). The page's events of other parked keys join their queues instead of going
-- out (the shard moves past pages that hold only those: one per claim when their keys are all
-- due at their first retry or catching up). A page that holds only events of keys catching up
-- (their last head went through) whose queues two claims empty is left where it is while the
-- queues go out. Nothing (and no claim row) when neither is left; then the empty window is
-- recorded as _claim records it (_record_empty), so that polls while the shard's keys wait out
-- their backoff stay idle.
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

-- outbox.claim's body: what it returns, the page's rows aside (see outbox.claim).
CREATE OR REPLACE FUNCTION outbox_internal._claim_body(
    consumer   text,
    batch_size int,
    lease      interval,
    owner      text,
    shards     int
) RETURNS SETOF outbox.claimed
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    rebased boolean := outbox_internal._rebase_if_restored();  -- first: it may write
    c       outbox.consumers := outbox_internal._consumer(consumer);
    working int[];
    b       record;
BEGIN
    IF rebased THEN
        RETURN;  -- this transaction rebased a restored database (it wrote): claim in the next
    END IF;
    PERFORM outbox_internal._check_claim(batch_size, lease, shards, 'outbox.claim');
    working := outbox_internal._shards_with_work(c.id);
    IF cardinality(working) = 0 THEN
        RETURN;  -- nothing to read: no bound taken, nothing written
    END IF;
    b := outbox_internal._claim_bound();
    RETURN QUERY SELECT * FROM outbox_internal._claim(c, batch_size, lease,
                                             coalesce(owner, 'backend ' || pg_backend_pid()), b.seq, b.x,
                                             working, shards);
END
$$;

-- A claim's result is made natively (src/claim/result.rs): the events of its page go from the
-- executor into it once, where RETURN QUERY would copy them again in every function on the
-- way. The body runs in PL/pgSQL (_claim_body), with the settings and the rights of the call.
CREATE OR REPLACE FUNCTION outbox.claim(
    consumer   text,
    batch_size int      DEFAULT 100,
    lease      interval DEFAULT '30 seconds',
    owner      text     DEFAULT NULL,
    shards     int      DEFAULT 1
) RETURNS SETOF outbox.claimed
    LANGUAGE c VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off SET plan_cache_mode = force_generic_plan
AS 'MODULE_PATHNAME', 'outbox_claim';

COMMENT ON FUNCTION outbox.claim(text, int, interval, text, int) IS
    'Takes a free shard (at most shards of them) under a lease and returns its next events in '
    'commit order (at most batch_size, plus at most batch_size events of its parked keys due '
    'for retry), each shard a batch with its own epoch; nothing when no shard has work. '
    'Example: SELECT * FROM outbox.claim(''billing-webhook'', 100, ''30 seconds'');';

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
    cur.lease_until := CASE WHEN retry_after > '0' THEN statement_timestamp() + retry_after END;
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
