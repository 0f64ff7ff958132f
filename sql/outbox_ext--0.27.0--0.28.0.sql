-- outbox_ext 0.27.0 -> 0.28.0
--
-- Why: when more shards had work than a relay had free slots, a claim took the shards from a
-- random one on, so a shard with events could be passed over claim after claim while others
-- were served (at 1,000 events/s into Kafka, events waited up to 280 ms to be claimed while
-- every batch took under 32 ms). A claim now takes the shards in the order their cursors last
-- moved, the one that has waited longest first; a backlog (nearly every shard with work) still
-- starts at a random shard. And a sink has 8 batches in flight by default, not 4: a Kafka
-- batch is out about 7 ms (linger, acks), and with 4 slots a steady stream of 1,000 events/s
-- over 16 shards waited for them (median commit to consumer 22 ms against 10 with 8). Sinks
-- made before keep the concurrency they have.

\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.28.0'" to load this file. \quit

ALTER TABLE outbox.sinks ALTER COLUMN concurrency SET DEFAULT 8;

-- The shards where a claim may find something for the consumer: those not under a live lease
-- with parked keys due, a window open, a restored cursor, a floor behind a seal, or an event
-- above their floor — what _free_cursor asks of each shard, asked of all of them read-only,
-- without locking a shard or taking an xid. In the order their cursors last moved, longest ago
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
    floors bigint[]; -- and its floor
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
           array_agg(outbox_internal._pending_floor(cur.l) ORDER BY (cur.l).pos)
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
    newest outbox._seals := outbox_internal._newest_seal();  -- read once: see _since
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
            since := outbox_internal._window_since(cur, newest);
            until := outbox_internal._reach();  -- read after the window's snapshot: see _reach
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


CREATE OR REPLACE FUNCTION outbox.create_sink(
    name            text,
    kind            text,
    url             text,
    topics          text[]   DEFAULT NULL,
    aggregate_types text[]   DEFAULT NULL,
    format          text     DEFAULT NULL,
    batch_size      int      DEFAULT 100,
    concurrency     int      DEFAULT 8,
    connect_timeout interval DEFAULT '5 seconds',
    request_timeout interval DEFAULT '30 seconds',
    secret          text     DEFAULT NULL,
    http_headers    jsonb    DEFAULT NULL,
    tls_ca          text     DEFAULT NULL,
    topic_map       jsonb    DEFAULT NULL,
    cluster_id      text     DEFAULT NULL,
    compression     text     DEFAULT NULL,
    linger          interval DEFAULT '5 milliseconds',
    sasl_mechanism  text     DEFAULT NULL,
    sasl_username   text     DEFAULT NULL,
    max_attempts    int      DEFAULT 10,
    backoff_base    interval DEFAULT '1 second',
    backoff_max     interval DEFAULT '10 minutes',
    from_beginning  boolean  DEFAULT false
) RETURNS void
    LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.create_consumer(name, from_beginning, max_attempts, backoff_base, backoff_max);
    INSERT INTO outbox.sinks (name, kind, url, topics, aggregate_types, format, batch_size,
                              concurrency, connect_timeout, request_timeout, secret, http_headers,
                              tls_ca, topic_map, cluster_id, compression, linger, sasl_mechanism,
                              sasl_username)
    VALUES (name, kind, url, topics, aggregate_types, format, batch_size, concurrency,
            connect_timeout, request_timeout, secret, http_headers, tls_ca, topic_map, cluster_id,
            compression, linger, sasl_mechanism, sasl_username);
END
$$;
