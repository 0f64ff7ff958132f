-- outbox_ext: parking and dead letters — how a failing key blocks only itself.
--
-- A failure parks its key: the failed event and every later event of the key are copied, in
-- order, into a small side queue (_parked_events) as the shard reads past them, and the shard
-- goes on with other keys. The queue's head is retried alone, with exponential backoff and
-- jitter; after max_attempts it goes to outbox.dead_letters and the key moves on. Once the head
-- goes through, the key catches up: its queue goes out in order, batches of it at a time (a
-- claim's share, sql/claim.sql: _due_heads), and when the queue is empty the key is unparked
-- and flows with its shard again; the batch that hands out the rest of its queue hands out its
-- new events of the page behind it, not copied (the key rides: _riding); meanwhile a page of
-- the shard that holds only events of keys catching up waits in the log, not copied into
-- their queues (_claim_parked). A failure the
-- sink never judged (settle's "attempted": false) parks the key the same way without counting
-- an attempt.
--
-- Owns: outbox._parked, outbox._parked_events, outbox.dead_letters, outbox_internal._failure.
-- Keeps: a key's queued events are its undelivered events, in order; only a transaction that
-- holds the key's shard row changes them.
--
-- Name resolution (sql/grants.sql): the API functions are [pinned], helpers (outbox_internal._*) run
-- [inside] them and do not pin search_path themselves: only the SECURITY DEFINER API functions
-- call them, and those pin it. A SET clause on every helper would cost each call a GUC save and
-- restore and a new search path lookup, about 5% of a claim.
--
-- Rerunnable: tables and indexes only where missing, functions replaced. A changed table needs
-- its own ALTER in the upgrade script.

CREATE TABLE IF NOT EXISTS outbox._parked (
    consumer_id     int         NOT NULL,
    aggregate_id    text        NOT NULL,
    shard           int         NOT NULL,
    attempts        int         NOT NULL DEFAULT 0,  -- failed attempts of the current head
    next_attempt_at timestamptz NOT NULL,
    last_error      text,
    nacked_epoch    bigint,                          -- the batch that last failed the key
    parked_at       timestamptz NOT NULL DEFAULT now(),
    nacked_pos      bigint,                          -- the queue position of the head that failed then
    head_through    boolean     NOT NULL DEFAULT false,  -- its last head went through: catching up
    PRIMARY KEY (aggregate_id, consumer_id)  -- no foreign key: see _cursor_log
);

CREATE INDEX IF NOT EXISTS _parked_shard_consumer_id_next_attempt_at_idx
    ON outbox._parked (shard, consumer_id, next_attempt_at);

CREATE TABLE IF NOT EXISTS outbox._parked_events (
    consumer_id    int         NOT NULL,
    aggregate_id   text        NOT NULL,
    pos            bigint      GENERATED ALWAYS AS IDENTITY,
    id             uuid        NOT NULL,
    topic          text,
    aggregate_type text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb,
    headers        jsonb,
    created_at     timestamptz NOT NULL,
    seq            bigint      NOT NULL,
    PRIMARY KEY (aggregate_id, consumer_id, pos),
    UNIQUE (id, consumer_id)
    -- no foreign key to _parked: whatever deletes a parked key deletes its queue, or finds it
    -- empty (a foreign key's check cost each queued event more than queueing it did)
);
-- No index of _parked or _parked_events leads with consumer_id, so that each lookup (by key,
-- by shard, by event id) has one index that bounds it: with consumer_id first in all of them,
-- a plan made while the tables were small (a few hundred rows look like one row to the
-- planner) could take one index for another, and then read all of a consumer's rows for each
-- row it looked up (#38: a drain with 5% of its events failing ran at a sixth of its rate in
-- some sessions).

CREATE TABLE IF NOT EXISTS outbox.dead_letters (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer       text        NOT NULL,
    event_id       uuid        NOT NULL,
    topic          text,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb,
    headers        jsonb,
    created_at     timestamptz NOT NULL,
    seq            bigint      NOT NULL,
    attempts       int         NOT NULL,
    last_error     text,
    dead_at        timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS dead_letters_consumer_aggregate_id_id_idx
    ON outbox.dead_letters (consumer, aggregate_id, id);

COMMENT ON TABLE outbox.dead_letters IS
    'Events a consumer gave up on after max_attempts, with the last error; outbox.replay re-queues them.';

-- A failure a relay reports (sql/settle.sql), resolved against its batch: the event, its key
-- and seq, and whether it is a parked key's head (handed out from the key's queue) or an event
-- read from the shard's window.
DO $type$
BEGIN
    CREATE TYPE outbox_internal._failure AS (
        event_id     uuid,
        aggregate_id text,
        seq          bigint,
        head         boolean,
        error        text,
        retry_after  interval,
        final        boolean,
        attempted    boolean   -- false: not sent (the sink's doing): the key waits, uncounted
    );
EXCEPTION WHEN duplicate_object THEN NULL;  -- rerun: the type is there
END
$type$;

-- A parking table's cached plans made again when it has doubled in pages (src/replan.rs says
-- why); called after each insert into one.
CREATE OR REPLACE FUNCTION outbox_internal._replan_when_grown(rel regclass) RETURNS void
    LANGUAGE c VOLATILE STRICT AS 'MODULE_PATHNAME', 'outbox_replan_when_grown';

-- The wait before a failed head's next attempt: backoff_base doubled per attempt, at most
-- backoff_max, times a jitter of 0.5 to 1. Doubled in seconds and capped before it becomes an
-- interval: an interval of a base of a few hours times 2^30 is out of range (22008), and a
-- settle that raised so could never record the failure, nor dead-letter the event.
CREATE OR REPLACE FUNCTION outbox_internal._backoff(c outbox.consumers, attempts int) RETURNS interval
    LANGUAGE sql VOLATILE
    RETURN make_interval(secs => least(extract(epoch FROM c.backoff_max),
                                       extract(epoch FROM c.backoff_base) * power(2, least(attempts - 1, 30))))
           * (0.5 + random() / 2);

-- Parked keys failed, each at one event (failures: each key's first failed event of a batch,
-- epoch, resolved by settle): its head, or an event of its queue handed out behind heads that
-- went through (those leave the queue when the batch settles: _deliver_rest reads nacked_pos),
-- or an event of the window, which parked it.
-- Each failure is counted and its retry scheduled; past max_attempts (or at once when the
-- failure is final) the event moves to dead_letters and its key moves on. A failure not
-- attempted (the sink throttled, lacked its topic, ran out of time) counts nothing and kills
-- nothing: its retry is scheduled as if the current attempt had failed. Set-based: the same
-- few statements for one failure or hundreds.
CREATE OR REPLACE FUNCTION outbox_internal._keys_failed(c outbox.consumers, failures outbox_internal._failure[],
                                                        epoch bigint) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    dead_ids      uuid[];
    dead_attempts int[];
    dead_errors   text[];
BEGIN
    WITH counted AS (
        UPDATE outbox._parked p
           SET attempts = p.attempts + CASE WHEN f.attempted IS FALSE THEN 0 ELSE 1 END,
               last_error = f.error, nacked_epoch = epoch, nacked_pos = CASE WHEN f.head THEN f.seq END,
               head_through = false,
               next_attempt_at = now() + coalesce(f.retry_after, outbox_internal._backoff(c,
                   CASE WHEN f.attempted IS FALSE THEN greatest(p.attempts, 1) ELSE p.attempts + 1 END))
          FROM unnest(failures) f
         WHERE p.consumer_id = c.id AND p.aggregate_id = f.aggregate_id
        RETURNING f.event_id, f.error, f.final, f.attempted, p.attempts)
    SELECT array_agg(k.event_id), array_agg(k.attempts), array_agg(k.error)
      INTO dead_ids, dead_attempts, dead_errors
      FROM counted k
     WHERE k.attempted IS NOT FALSE AND (k.final OR k.attempts >= c.max_attempts);
    IF dead_ids IS NULL THEN
        RETURN;
    END IF;
    WITH dead AS (
        DELETE FROM outbox._parked_events q
         USING unnest(dead_ids, dead_attempts, dead_errors) AS d(id, attempts, error)
         WHERE q.consumer_id = c.id AND q.id = d.id
        RETURNING q.*, d.attempts AS n, d.error AS error)
    INSERT INTO outbox.dead_letters (consumer, event_id, topic, aggregate_type, aggregate_id,
                                     event_type, payload, headers, created_at, seq, attempts, last_error)
    SELECT c.name, d.id, d.topic, d.aggregate_type, d.aggregate_id, d.event_type, d.payload,
           d.headers, d.created_at, d.seq, d.n, d.error
      FROM dead d ORDER BY d.seq;
    -- their keys move on: the next event is due at once, and a key with none is unparked
    UPDATE outbox._parked p SET attempts = 0, next_attempt_at = now()
      FROM unnest(failures) f
     WHERE p.consumer_id = c.id AND p.aggregate_id = f.aggregate_id AND f.event_id = ANY (dead_ids);
    PERFORM outbox_internal._unpark_emptied(c.id, ARRAY(SELECT f.aggregate_id FROM unnest(failures) f
                                                         WHERE f.event_id = ANY (dead_ids)));
END
$$;

-- Of keys whose queues lost events, those with none left are unparked: they flow with their
-- shard again. Each key's queue is looked up on its own (OFFSET 0 keeps it a lookup): an
-- anti-join planned while nothing was parked would read every queued event per key.
CREATE OR REPLACE FUNCTION outbox_internal._unpark_emptied(consumer_id int, keys text[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    DELETE FROM outbox._parked p
     WHERE p.consumer_id = _unpark_emptied.consumer_id AND p.aggregate_id = ANY (keys)
       AND NOT EXISTS (SELECT FROM outbox._parked_events q
                        WHERE q.consumer_id = p.consumer_id AND q.aggregate_id = p.aggregate_id
                       OFFSET 0);
END
$$;

-- Copy events of parked keys into their queues (idempotent: a re-claim copies nothing twice).
CREATE OR REPLACE FUNCTION outbox_internal._queue_parked(consumer_id int, events outbox.events[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
BEGIN
    INSERT INTO outbox._parked_events AS q (consumer_id, aggregate_id, id, topic, aggregate_type,
                                            event_type, payload, headers, created_at, seq)
    SELECT _queue_parked.consumer_id, e.aggregate_id, e.id, e.topic, e.aggregate_type,
           e.event_type, e.payload, e.headers, e.created_at, e.seq
      FROM unnest(events) AS e
     ORDER BY e.seq
    ON CONFLICT (consumer_id, id) DO NOTHING;
    IF FOUND THEN
        PERFORM outbox_internal._replan_when_grown('outbox._parked_events');
    END IF;
END
$$;

-- A batch given back (release, release_owner, a lease that ran out, a restore) after nack or
-- reject: the shard reads its page again, so what the batch's failures made of the page's
-- events is undone. A key that this batch parked (its queue holds only copies of this batch's
-- page, none of them a parked head it handed out) is unparked, its queue dropped, as if the
-- batch had never been claimed: kept, its earlier events would be queued behind the failed one.
-- (If a replay queued a dead letter of the key meanwhile, the key stays parked for it, with
-- nothing counted and due at once: the replay's, not the batch's.)
-- A key parked before (its head handed out and nacked) keeps its queue and the attempt counted
-- (but for a head nacked behind another of the batch's heads: those went out together, at no
-- attempt counted, and the first did not fail: nothing stays counted),
-- less the copies of this page's events: the next claim may read a smaller page, and a copy
-- beyond it would go out from the queue and again from the log. A key that rode and failed at
-- an event of the page (counted at that event's copy as its head: _fail_keys) is due again at
-- once with nothing counted: the event comes again with the page, and its heads did not fail
-- (it rode at a first attempt, so none was counted before). And an event of the page
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
                       OFFSET 0)  -- a lookup by the key's queue position, not a semi-join
            -- or a head of the batch came before the one that failed: heads go out together
            -- only at no attempt counted, and the first did not fail
            OR EXISTS (SELECT FROM outbox._parked_events q
                        WHERE q.aggregate_id = p.aggregate_id AND q.consumer_id = c.id
                          AND q.pos < p.nacked_pos AND q.id = ANY (cur.heads)
                       OFFSET 0));
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
