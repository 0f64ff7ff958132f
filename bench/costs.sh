#!/usr/bin/env bash
# Costs that should not grow with what a call does not need to read, each factor varied in
# one run (no network):
#   outbox.status and outbox.shard_status with BIG events in the log, pending and delivered
#   a drain of BIG events against one of SMALL (one relay, batch 100, claim + settle)
#   an empty claim (16 shards, nothing to read), also while a transaction holds an xid open
#   outbox.maintain() with nothing to do, at 4 and at about 400 partitions
#   claim + settle with 4 partitions, with 198 more ahead of now, with 198 more of history
#   (sealed), and with those and 199 more ahead
# Targets (#14): status under 20 ms; the big drain >= 0.8x the small one's rate; an empty
# claim under 1 ms (and no WAL with an xid held open); maintain under 50 ms at 400 partitions;
# 200 partitions within 1.25x of 4.
# Usage: bench/costs.sh [big, default 2000000] [small, default 20000]
source "$(dirname "$0")/common.sh"
BIG=${1:-2000000}
SMALL=${2:-20000}
WORK=$(mktemp -d)
start_bench_cluster costs
sql -c "CREATE EXTENSION outbox_ext" -c "SELECT count(*) FROM outbox.maintain()" >/dev/null
write_outbox_relay "$WORK/relay.sql" 100

# ms SQL [runs]: the median wall time of a query, in milliseconds, over runs in one transaction
ms() {
    sql -At <<SQL
CREATE TEMP TABLE t (ms float8);
DO \$\$ DECLARE s timestamptz; BEGIN
    FOR i IN 1 .. ${2:-5} LOOP
        s := clock_timestamp(); PERFORM * FROM ($1) AS q; INSERT INTO t VALUES (extract(epoch FROM clock_timestamp() - s) * 1000);
    END LOOP; END \$\$;
SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 2) FROM t;
SQL
}

# fill N: a fresh consumer 'bench' and N events (100,000 per statement), then VACUUM ANALYZE
fill() {
    sql -c "TRUNCATE outbox.events" -c "SELECT outbox.drop_consumer('bench')" -c "SELECT outbox.create_consumer('bench')" >/dev/null
    local left=$1 n
    while (( left > 0 )); do
        n=$(( left < 100000 ? left : 100000 )); left=$(( left - n ))
        sql -c "SELECT count(*) FROM outbox.emit_many('order', 'order.created', (SELECT array_agg((i % 10000)::text) FROM generate_series(1, $n) i), (SELECT array_agg(jsonb_build_object('customer', 'c', 'total', i)) FROM generate_series(1, $n) i))" >/dev/null
    done
    sql -c "VACUUM ANALYZE" >/dev/null
}

# drain N -> events/s: one relay, batch 100, claim + settle, until nothing is left
drain() {
    local start end
    start=$(now_s)
    "$BIN/pgbench" -n -M prepared -h 127.0.0.1 -p "$PORT" -U postgres -c 1 -j 1 -t $(( $1 / 100 + 20 )) \
        -f "$WORK/relay.sql" bench >/dev/null 2>"$WORK/err" || { cat "$WORK/err"; exit 1; }
    end=$(now_s)
    [ "$(sql_value "SELECT count(*) FROM outbox.claim('bench', 1)")" = 0 ] || { echo "not drained" >&2; exit 1; }
    awk -v n="$1" -v a="$start" -v b="$end" 'BEGIN{printf "%.0f", n/(b-a)}'
}

declare -A v
fill "$SMALL"; v[small]=$(drain "$SMALL"); log "drain of $SMALL: ${v[small]} events/s"
fill "$BIG"
v[status_pending]=$(ms "SELECT * FROM outbox.status"); v[shard_pending]=$(ms "SELECT * FROM outbox.shard_status")
log "status with $BIG pending: ${v[status_pending]} ms, shard_status ${v[shard_pending]} ms"
v[big]=$(drain "$BIG"); log "drain of $BIG: ${v[big]} events/s"
v[status_done]=$(ms "SELECT * FROM outbox.status"); v[shard_done]=$(ms "SELECT * FROM outbox.shard_status")
log "status with $BIG delivered: ${v[status_done]} ms, shard_status ${v[shard_done]} ms"
echo "SELECT count(*) FROM outbox.claim('bench', 100);" > "$WORK/empty.sql"   # a transaction each
v[empty]=$(awk -v t="$(pgbench_run "$WORK/empty.sql" 1 -T 5)" 'BEGIN{printf "%.3f", 1000/t}')
log "empty claim: ${v[empty]} ms"
# the same while a transaction holds an xid open (a session idle in transaction after a write),
# begun before a drain that gave every shard events: until 0.29.0 each such claim locked every
# shard, took an xid and wrote WAL
"$BIN/psql" -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d bench -c "BEGIN" \
    -c "SELECT pg_current_xact_id()" -c "SELECT pg_sleep(3600) /* xid holder */" >/dev/null 2>&1 &
until [ "$(sql_value "SELECT count(*) FROM pg_stat_activity WHERE backend_xid IS NOT NULL AND query LIKE '%xid holder%'")" = 1 ]; do sleep 0.1; done
fill "$SMALL"; drain "$SMALL" >/dev/null
wal=$(sql_value "SELECT pg_current_wal_insert_lsn()")
v[empty_held]=$(awk -v t="$(pgbench_run "$WORK/empty.sql" 1 -t 2000)" 'BEGIN{printf "%.3f", 1000/t}')
v[empty_held_wal]=$(sql_value "SELECT round(pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '$wal') / 2000)")
sql_value "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE query LIKE '%xid holder%' AND pid <> pg_backend_pid()" >/dev/null
log "empty claim with an xid held open: ${v[empty_held]} ms, ${v[empty_held_wal]} B of WAL"

# partitions: one-minute ones, 4 (this minute, two ahead, the default), then about 200 and 400
parts() { sql_value "SELECT count(*) FROM outbox.partitions WHERE parent = 'outbox.events'::regclass"; }
ahead() {
    sql -c "UPDATE outbox.partition_config SET width = '1 minute', ahead = $1 WHERE parent = 'outbox.events'::regclass" >/dev/null
    # a run makes at most 100 partitions: run it until it defers nothing
    until [ "$(sql_value "SELECT count(*) FROM outbox.maintain() WHERE action = 'deferred'")" = 0 ]; do :; done
}
sql -c "TRUNCATE outbox.events" >/dev/null
sql_value "SELECT format('DROP TABLE %s;', partition) FROM outbox.partitions
            WHERE parent = 'outbox.events'::regclass AND NOT is_default" | sql >/dev/null
# as if there had been no daily partitions: their recorded reach (two days on) goes with them
sql -c "DELETE FROM outbox._reach" >/dev/null
ahead 2; v[parts_4]=$(parts); v[maintain_4]=$(ms "SELECT * FROM outbox.maintain()")
fill "$SMALL"; v[claim_4]=$(drain "$SMALL")
# ahead: 198 more one-minute partitions ahead of now (202 in all), then gone again
ahead 200; v[parts_ahead]=$(parts); fill "$SMALL"; v[claim_ahead]=$(drain "$SMALL")
sql_value "SELECT format('DROP TABLE %s;', partition) FROM outbox.partitions
            WHERE parent = 'outbox.events'::regclass AND lower > now() + interval '3 minutes'" | sql >/dev/null
ahead 2
# history: 198 one-minute partitions before this one (as retention keeps them), sealed by maintain
sql -c "SELECT count(outbox_internal._create_partition('outbox.events', date_trunc('minute', now()) - g * interval '1 minute', '1 minute')) FROM generate_series(1, 198) g" \
    -c "SELECT count(*) FROM outbox.maintain()" >/dev/null
v[parts_past]=$(parts); fill "$SMALL"; v[claim_past]=$(drain "$SMALL")
ahead 199; v[parts_200]=$(parts); fill "$SMALL"; v[claim_200]=$(drain "$SMALL")
log "claim + settle with ${v[parts_4]} partitions: ${v[claim_4]} events/s, with ${v[parts_ahead]} (198 ahead): ${v[claim_ahead]}, with ${v[parts_past]} (198 past): ${v[claim_past]}, with ${v[parts_200]} (199 more ahead): ${v[claim_200]}"
ahead 399; v[parts_400]=$(parts); v[maintain_400]=$(ms "SELECT * FROM outbox.maintain()")
log "maintain with nothing to do: ${v[maintain_4]} ms at ${v[parts_4]} partitions, ${v[maintain_400]} ms at ${v[parts_400]}"

echo
echo "Costs benchmark: PostgreSQL 15, $(nproc) cores, no network"
echo
echo "| what | measured | against | ratio or target |"
echo "| --- | --- | --- | --- |"
echo "| outbox.status, $BIG events pending | ${v[status_pending]} ms | | target < 20 ms |"
echo "| outbox.shard_status, $BIG events pending | ${v[shard_pending]} ms | | target < 20 ms |"
echo "| outbox.status, $BIG events delivered | ${v[status_done]} ms | | target < 20 ms |"
echo "| outbox.shard_status, $BIG events delivered | ${v[shard_done]} ms | | target < 20 ms |"
echo "| drain of $BIG (batch 100, 1 relay) | ${v[big]}/s | drain of $SMALL: ${v[small]}/s | $(ratio "${v[big]}" "${v[small]}") (target >= 0.8x) |"
echo "| empty claim, 16 shards | ${v[empty]} ms | | target < 1 ms |"
echo "| empty claim, 16 shards, while a transaction holds an xid open | ${v[empty_held]} ms, ${v[empty_held_wal]} B of WAL | with none: ${v[empty]} ms | target < 1 ms, no WAL |"
echo "| maintain(), nothing to do, ${v[parts_400]} partitions | ${v[maintain_400]} ms | ${v[parts_4]} partitions: ${v[maintain_4]} ms | target < 50 ms |"
echo "| claim + settle, ${v[parts_ahead]} partitions (198 ahead of now) | ${v[claim_ahead]}/s | ${v[parts_4]} partitions: ${v[claim_4]}/s | $(ratio "${v[claim_ahead]}" "${v[claim_4]}") (target >= 0.8x) |"
echo "| claim + settle, ${v[parts_past]} partitions (198 of history, sealed) | ${v[claim_past]}/s | ${v[parts_4]} partitions: ${v[claim_4]}/s | $(ratio "${v[claim_past]}" "${v[claim_4]}") (target >= 0.8x) |"
echo "| claim + settle, ${v[parts_200]} partitions (199 more ahead) | ${v[claim_200]}/s | ${v[parts_4]} partitions: ${v[claim_4]}/s | $(ratio "${v[claim_200]}" "${v[claim_4]}") (target >= 0.8x) |"
rm -rf "$WORK"
