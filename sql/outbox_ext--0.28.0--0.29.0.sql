-- outbox_ext 0.28.0 -> 0.29.0
--
-- Why: a batch given back (release, release_owner, a lease that ran out, a restore) after
-- reject, or after a nack of an event's last attempt, left the event in outbox.dead_letters
-- while the page was read again and the event delivered: it was both dead and delivered, and
-- a replay sent it once more, after its key's later events. The dead letters of the page's
-- events now go back with the batch, as its parked keys and queued copies already did.
--
-- And a transaction holding an xid open (a long report, a session idle in transaction) kept
-- every shard's floor below it, so every shard that had an event since it began looked as if
-- it had work: each idle poll locked them all, took an xid and wrote WAL (about 3.7 ms a poll).
-- A probe now starts above lo.seq, and lower only for a transaction that has ended
-- (_probe_floor).

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.29.0'" to load this file. \quit

-- A batch given back (release, release_owner, a lease that ran out, a restore) after nack or
-- reject: the shard reads its page again, so what the batch's failures made of the page's
-- events is undone. A key that this batch parked (its queue holds only copies of this batch's
-- page, none of them a parked head it handed out) is unparked, its queue dropped, as if the
-- batch had never been claimed: kept, its earlier events would be queued behind the failed one.
-- A key parked before (its head handed out and nacked) keeps its queue and the attempt counted,
-- less the copies of this page's events: the next claim may read a smaller page, and a copy
-- beyond it would go out from the queue and again from the log. And an event of the page
-- dead-lettered at once (reject, or a nack of its last attempt) comes again with the page, so
-- its dead letter goes: kept, the event was both delivered and dead, and a replay sent it again
-- after its key's later events. A dead head stays dead: it left its queue, and is not read again
-- (unless the page holds it too: then it comes again with the page). The page is read on every
-- give-back of a consumer that has dead letters; give-backs are rare (a suspended sink's probes
-- are 10 events) and a page is at most a batch.
-- The page's events are known by id, not by seq range: a queue may hold an event of an earlier
-- window whose seq falls inside this page's range.
CREATE OR REPLACE FUNCTION outbox_internal._unpark_released(c outbox.consumers, cur outbox._cursor_log) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    page outbox.events[];  -- the batch's page: what its claim may have copied into queues
    ids  uuid[];           -- and their ids
BEGIN
    IF NOT EXISTS (SELECT FROM outbox._parked p WHERE p.consumer_id = c.id AND p.shard = cur.shard)
       AND NOT EXISTS (SELECT FROM outbox.dead_letters d WHERE d.consumer = c.name) THEN
        RETURN;  -- nothing to undo (the common case: the page is not read again)
    END IF;
    page := outbox_internal._batch(cur);
    ids := ARRAY(SELECT e.id FROM unnest(page) e);
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
    DELETE FROM outbox._parked_events q
     WHERE q.consumer_id = c.id AND q.id = ANY (ids);
    DELETE FROM outbox.dead_letters d
     USING unnest(page) e
     WHERE d.consumer = c.name AND d.aggregate_id = e.aggregate_id AND d.event_id = e.id;
END
$$;

-- Where a probe for something to read in an idle shard (its lo, no window open) starts: every
-- event still to come has a seq above this. That is lo.seq, or lower for a transaction of lo's
-- in-progress list that snap sees ended: its events (above its floor) come in the next window.
-- One still in progress is left out: its events cannot be read before it ends, and its end
-- shows in a later snapshot. (The pending floor counts them all: with a transaction holding an
-- xid open for minutes, every shard that had an event since it began looked as if it had work,
-- and each idle poll locked them all, took an xid and wrote WAL.)
CREATE OR REPLACE FUNCTION outbox_internal._probe_floor(cur outbox._cursor_log, snap pg_snapshot) RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    low bigint := cur.lo_seq;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(cur.lo_txids), 0) LOOP
        IF cur.lo_floors[i] < low AND pg_catalog.pg_visible_in_snapshot(cur.lo_txids[i], snap) THEN
            low := cur.lo_floors[i];
        END IF;
    END LOOP;
    RETURN least(low, cur.restored_seq);
END
$$;
REVOKE ALL ON FUNCTION outbox_internal._probe_floor(outbox._cursor_log, pg_snapshot) FROM PUBLIC;

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
