#!/usr/bin/env bash
# Drain benchmark: pre-filled events drained with no network, in one run, printed as ratios.
# Relays run as pgbench clients; every relay step touches each event's payload.
#   outbox_ext, two calls: claim (one transaction) + settle (the next)
#   outbox_ext, one call: settle_and_claim (settles the last batch and claims the next)
#   outbox_ext, 5% failed: claim + settle reporting 5% of the events failed (retried at once)
#   (each at batches of 100 and 1,000, 1 and 2 relays)
#   outbox_ext, one hot key failing once: HOT events of one key and HOT of 200 others, batch
#            500, one relay; the hot key's first event fails once, due again at once; against
#            the same backlog with no failure (claims and rate)
#   plain-SQL outbox relay: SELECT ... FOR UPDATE SKIP LOCKED LIMIT n + UPDATE published_at
#   PgQ 3.5: next_batch + get_batch_events + finish_batch, one consumer (PgQ has one reader
#            per consumer), ticks every 100 / 1,000 events, and one tick over everything
#   floor: the least any claim + settle relay can cost here: read a batch through the same
#          index and write one small row in each of two transactions, with no window, lock or lease
# Targets (#14): batch 100, 1 relay >= 0.8x the floor; batch 100, 2 relays >= 1.0x PgQ;
# batch 1,000, 1 relay >= 1.0x PgQ.
# Every figure is the median of ROUNDS drains (default 3), the rounds interleaved so that each
# system meets the same moments of a noisy machine (single drains of a second or two here
# vary by a third from run to run, PgQ's as much as ours).
# Usage: bench/claim.sh [events, default 300000] [rounds, default 3]
source "$(dirname "$0")/common.sh"
EVENTS=${1:-300000}
ROUNDS=${2:-3}
WORK=$(mktemp -d)
start_bench_cluster claim

sql <<'SQL'
CREATE EXTENSION outbox_ext;
SELECT count(*) FROM outbox.maintain();  -- the first partitions
CREATE EXTENSION pgq;
CREATE TABLE plain_outbox (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text NOT NULL, aggregate_id text NOT NULL, event_type text NOT NULL,
    payload jsonb, created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz);
CREATE INDEX plain_outbox_unpublished ON plain_outbox (created_at) WHERE published_at IS NULL;
CREATE TABLE floor_log (shard int, step int);
-- One relay draining with claim + settle, a transaction each, touching every payload; with
-- fail_hot, the first event of key 'hot' that comes out fails once (due again at once).
-- Returns the claims that found something.
CREATE PROCEDURE drain_hot(fail_hot boolean, batch int, INOUT claims int DEFAULT 0) LANGUAGE plpgsql AS $$
DECLARE
    b        outbox.claimed[];
    failures jsonb;
    failed   boolean := NOT fail_hot;
BEGIN
    LOOP
        b := ARRAY(SELECT c FROM outbox.claim('bench', batch) c);
        COMMIT;
        EXIT WHEN cardinality(b) = 0;
        claims := claims + 1;
        PERFORM sum(length(e.payload::text)) FROM unnest(b) e;
        failures := CASE WHEN NOT failed THEN
            (SELECT jsonb_build_array(jsonb_build_object('id', e.id, 'error', 'bench', 'retry_after', 0))
               FROM unnest(b) e WHERE e.aggregate_id = 'hot' ORDER BY e.seq LIMIT 1) END;
        failed := failed OR failures IS NOT NULL;
        PERFORM outbox.settle('bench', b[1].shard, b[1].epoch, coalesce(failures, '[]'));
        COMMIT;
    END LOOP;
END $$;
-- PgQ ticks in their own transactions, every `every` events (NULL: one tick at the end).
CREATE PROCEDURE fill_pgq(n int, every int) LANGUAGE plpgsql AS $$
BEGIN
    FOR chunk IN 0 .. (n - 1) / coalesce(every, n) LOOP
        PERFORM pgq.insert_event('bench', 'order.created', jsonb_build_object('customer', 'c', 'total', i)::text,
                                 (i % 10000)::text, NULL, NULL, NULL)
           FROM generate_series(chunk * coalesce(every, n) + 1, least(n, (chunk + 1) * coalesce(every, n))) i;
        COMMIT;
        PERFORM pgq.ticker('bench');
        COMMIT;
    END LOOP;
END $$;
SQL

write_outbox_relay "$WORK/outbox.sql" :batch
write_outbox_loop "$WORK/loop.sql" :batch
write_outbox_relay "$WORK/failing.sql" :batch 0.05
cat > "$WORK/plain.sql" <<'SQL'
WITH batch AS (SELECT id FROM plain_outbox WHERE published_at IS NULL
                ORDER BY created_at LIMIT :batch FOR UPDATE SKIP LOCKED),
     done AS (UPDATE plain_outbox o SET published_at = now() FROM batch WHERE o.id = batch.id
              RETURNING length(o.payload::text) AS bytes)
SELECT count(*), sum(bytes) FROM done;
SQL
cat > "$WORK/floor.sql" <<'SQL'
\set s random(0, 15)
\set from random(:lo, :hi)
SELECT count(*), sum(length(payload::text))
  FROM (SELECT payload FROM outbox.events WHERE shard = :s AND seq > :from ORDER BY seq LIMIT :batch) AS b;
INSERT INTO floor_log VALUES (:s, 1);
INSERT INTO floor_log VALUES (:s, 2);
SQL
cat > "$WORK/pgq.sql" <<'SQL'
SELECT coalesce(pgq.next_batch('bench', 'reader'), -1) AS batch_id \gset
\if :batch_id >= 0
SELECT count(*), sum(length(ev_data)) FROM pgq.get_batch_events(:batch_id);
SELECT pgq.finish_batch(:batch_id);
\endif
SQL

fill() {
    case $1 in
        outbox) sql -c "TRUNCATE outbox.events" -c "SELECT outbox.drop_consumer('bench')" -c "SELECT outbox.create_consumer('bench')" \
                    -c "SELECT count(*) FROM outbox.emit_many('order', 'order.created', (SELECT array_agg((i % 10000)::text) FROM generate_series(1, $EVENTS) i), (SELECT array_agg(jsonb_build_object('customer', 'c', 'total', i)) FROM generate_series(1, $EVENTS) i))" >/dev/null ;;
        plain) sql -c "TRUNCATE plain_outbox" -c "INSERT INTO plain_outbox (aggregate_type, aggregate_id, event_type, payload) SELECT 'order', (i % 10000)::text, 'order.created', jsonb_build_object('customer', 'c', 'total', i) FROM generate_series(1, $EVENTS) i" ;;
        pgq) sql -c "SELECT pgq.drop_queue('bench', true)" 2>/dev/null || true
             sql -c "SELECT pgq.create_queue('bench')" -c "SELECT pgq.register_consumer('bench', 'reader')" >/dev/null
             sql -c "CALL fill_pgq($EVENTS, ${2:-NULL})" ;;
    esac
    sql -c "VACUUM ANALYZE" -c "CHECKPOINT"
}

remaining() {
    case $1 in
        outbox) outbox_left ;;
        plain) sql_value "SELECT count(*) FROM plain_outbox WHERE published_at IS NULL" ;;
        pgq) echo 0 ;;
    esac
}

# hot FAIL -> "claims events/s": HOT events of key 'hot' and HOT of 200 others drained by
# drain_hot (FAIL true: the hot key's first event fails once)
HOT=${HOT:-20000}
hot() {
    local start claims
    sql -c "TRUNCATE outbox.events" -c "SELECT outbox.drop_consumer('bench')" -c "SELECT outbox.create_consumer('bench')" \
        -c "SELECT count(*) FROM outbox.emit_many('order', 'order.created', array_fill('hot'::text, ARRAY[$HOT]), (SELECT array_agg(jsonb_build_object('i', i)) FROM generate_series(1, $HOT) i))" \
        -c "SELECT count(*) FROM outbox.emit_many('order', 'order.created', (SELECT array_agg('k' || i % 200) FROM generate_series(1, $HOT) i), (SELECT array_agg(jsonb_build_object('i', i)) FROM generate_series(1, $HOT) i))" \
        -c "VACUUM ANALYZE" >/dev/null
    start=$(now_s)
    claims=$(sql_value "CALL drain_hot($1, 500)")
    [ "$(outbox_left)" = 0 ] || { echo "the hot-key drain left events behind" >&2; exit 1; }
    awk -v c="$claims" -v n=$(( 2 * HOT )) -v a="$start" -v b="$(now_s)" 'BEGIN{printf "%d %.0f", c, n/(b-a)}'
}

# outbox_left -> events outbox_ext has still to deliver (pending, or parked for a retry)
outbox_left() { sql_value "SELECT coalesce(sum(pending), 0) + coalesce(sum(parked_events), 0) FROM outbox.status"; }

# drain SYSTEM SCRIPT CLIENTS BATCH -> events/s. outbox_ext relays run in rounds of pgbench
# until nothing is left (retries take a number of steps no one knows in advance). The time is
# the relays' alone, the pgbench runs: the checks between rounds (two psql calls, about 30 ms
# here, a twentieth of a drain at batch 1,000) are the harness's, and only outbox_ext has them.
drain() {
    local system=$1 script=$2 clients=$3 batch=$4 per_client start seconds=0 rounds=0
    per_client=$(( EVENTS / batch / clients + 20 ))
    [ "$system" = pgq ] && per_client=$(( EVENTS / batch + 20 ))
    while :; do
        start=$(now_s)
        "$BIN/pgbench" -n -M prepared -h 127.0.0.1 -p "$PORT" -U postgres -c "$clients" -j "$clients" \
            -t "$per_client" -D batch="$batch" -D shard=-1 -D epoch=-1 -f "$WORK/$script.sql" bench \
            >/dev/null 2>"$WORK/err" || { cat "$WORK/err"; exit 1; }
        seconds=$(awk -v s="$seconds" -v a="$start" -v b="$(now_s)" 'BEGIN{print s + b - a}')
        [ "$script" = loop ] && sql -c "SELECT outbox.release_owner('bench', 'bench-loop')" >/dev/null
        [ "$system" != outbox ] || [ "$(outbox_left)" = 0 ] && break
        (( ++rounds < 100 )) || { echo "outbox_ext did not drain everything" >&2; exit 1; }
        per_client=$(( per_client / 4 + 10 ))
    done
    if [ "$(remaining "$system")" != 0 ]; then echo "$system did not drain everything" >&2; exit 1; fi
    awk -v n="$EVENTS" -v s="$seconds" 'BEGIN{printf "%.0f", n/s}'
}

# floor CLIENTS BATCH -> events/s: as many steps as a drain takes, over the events outbox_ext
# just drained (rows stay; the floor reads them from random places of the seq range)
floor() {
    local clients=$1 batch=$2 lo hi start end
    lo=$(sql_value "SELECT min(seq) FROM outbox.events"); hi=$(sql_value "SELECT max(seq) - 20 * $batch FROM outbox.events")
    start=$(now_s)
    "$BIN/pgbench" -n -M prepared -h 127.0.0.1 -p "$PORT" -U postgres -c "$clients" -j "$clients" \
        -t $(( EVENTS / batch / clients )) -D batch="$batch" -D lo="$lo" -D hi="$hi" -f "$WORK/floor.sql" bench \
        >/dev/null 2>"$WORK/err" || { cat "$WORK/err"; exit 1; }
    end=$(now_s)
    awk -v n="$EVENTS" -v a="$start" -v b="$end" 'BEGIN{printf "%.0f", n/(b-a)}'
}

# measure KEY LABEL COMMAND...: runs the command (which prints events/s), logs the figure and
# adds it to the figures of KEY
declare -A rate
measure() {
    local key=$1 label=$2 value; shift 2
    value=$("$@")
    log "$label: $value events/s"
    rate[$key]="${rate[$key]:-} $value"
}
# median KEY -> the median of its figures
median() { tr ' ' '\n' <<<"${rate[$1]}" | sed '/^$/d' | sort -n | awk '{v[NR]=$1} END{print v[int((NR+1)/2)]}'; }

for round in $(seq "$ROUNDS"); do
    for batch in 100 1000; do
        for clients in 1 2; do
            fill outbox; measure "outbox_${batch}_$clients" "outbox_ext claim + settle, batch $batch, $clients relay(s)" \
                drain outbox outbox "$clients" "$batch"
            measure "floor_${batch}_$clients" "floor batch $batch, $clients relay(s)" floor "$clients" "$batch"
            fill outbox; measure "loop_${batch}_$clients" "outbox_ext settle_and_claim, batch $batch, $clients relay(s)" \
                drain outbox loop "$clients" "$batch"
            fill outbox; measure "failing_${batch}_$clients" "outbox_ext claim + settle, 5% failed, batch $batch, $clients relay(s)" \
                drain outbox failing "$clients" "$batch"
            fill plain; measure "plain_${batch}_$clients" "plain-SQL relay batch $batch, $clients relay(s)" \
                drain plain plain "$clients" "$batch"
        done
        fill pgq "$batch"; measure "pgq_$batch" "PgQ ticks every $batch" drain pgq pgq 1 "$batch"
    done
    for fail in false true; do
        read -r c r <<<"$(hot "$fail")"
        log "hot key, failing once: $fail: $c claims, $r events/s"
        rate[hot_claims_$fail]="${rate[hot_claims_$fail]:-} $c"; rate[hot_rate_$fail]="${rate[hot_rate_$fail]:-} $r"
    done
done
fill pgq; start=$(now_s)
sql -c "SELECT count(*) FROM pgq.get_batch_events(pgq.next_batch('bench', 'reader'))" >/dev/null
rate[pgq_all]=$(awk -v n="$EVENTS" -v a="$start" -v b="$(now_s)" 'BEGIN{printf "%.0f", n/(b-a)}')
log "PgQ one batch of everything: ${rate[pgq_all]} events/s"
for key in "${!rate[@]}"; do rate[$key]=$(median "$key"); done

report() {
echo
echo "Drain benchmark: $EVENTS events, PostgreSQL 15, $(nproc) cores, no network; medians of $ROUNDS rounds"
echo
echo "| batch | relays | claim + settle | settle_and_claim | 5% failed | plain-SQL relay | PgQ, same batch | floor | best vs floor | best vs PgQ | best vs plain |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for batch in 100 1000; do
    for clients in 1 2; do
        o=${rate[outbox_${batch}_$clients]} l=${rate[loop_${batch}_$clients]} x=${rate[failing_${batch}_$clients]}
        p=${rate[plain_${batch}_$clients]} q=${rate[pgq_$batch]} f=${rate[floor_${batch}_$clients]}
        best=$(( o > l ? o : l ))
        echo "| $batch | $clients | $o | $l | $x | $p | $q | $f | $(ratio "$best" "$f") | $(ratio "$best" "$q") | $(ratio "$best" "$p") |"
    done
done
echo
best=0; for k in "${!rate[@]}"; do [[ $k == outbox_* || $k == loop_* ]] && (( rate[$k] > best )) && best=${rate[$k]}; done
echo "PgQ reading everything as one batch: ${rate[pgq_all]} events/s; best outbox_ext run: $best ($(ratio "$best" "${rate[pgq_all]}"))"
echo
echo "One hot key failing once ($HOT events of one key and $HOT of 200 others, batch 500, one relay; targets 1.5x the claims and 0.7x the rate at most/least):"
echo "| | claims | events/s |"
echo "| --- | --- | --- |"
echo "| no failure | ${rate[hot_claims_false]} | ${rate[hot_rate_false]} |"
echo "| hot key's first event fails once | ${rate[hot_claims_true]} ($(ratio "${rate[hot_claims_true]}" "${rate[hot_claims_false]}")) | ${rate[hot_rate_true]} ($(ratio "${rate[hot_rate_true]}" "${rate[hot_rate_false]}")) |"
}
# the report, kept for the chart of docs/benchmarks.md
report | tee "$TARGET/bench/claim.md"
draw_chart drain "$TARGET/bench/claim.md"
rm -rf "$WORK"
