#!/usr/bin/env bash
# Held-xmin benchmark: does a transaction that holds back vacuum slow the relay down or bloat
# the tables it reads? For outbox_ext and for the plain-SQL SKIP LOCKED relay, side by side:
#   1. clean: drain a backlog of N events, measure events/s
#   2. a REPEATABLE READ transaction takes a snapshot and stays open; for CHURN seconds
#      producers emit 2,000 events/s while one relay keeps up (the plain relay's UPDATEs now
#      leave dead tuples vacuum may not remove)
#   3. still held: drain a fresh backlog of N events, measure events/s
# Prints held/clean throughput and the dead tuples of the tables each relay reads.
# Usage: bench/held_xmin.sh [churn seconds, default 60] [backlog N, default 100000]
source "$(dirname "$0")/common.sh"
CHURN=${1:-60}
N=${2:-100000}
WORK=$(mktemp -d)
start_bench_cluster held_xmin

sql <<'SQL'
CREATE EXTENSION outbox_ext;
SELECT count(*) FROM outbox.maintain();  -- the first partitions
SELECT outbox.create_consumer('bench');
CREATE TABLE business (id bigserial PRIMARY KEY, v int);
CREATE TABLE plain_outbox (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text NOT NULL, aggregate_id text NOT NULL, event_type text NOT NULL,
    payload jsonb, created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz);
CREATE INDEX plain_outbox_unpublished ON plain_outbox (created_at) WHERE published_at IS NULL;
SQL

cat > "$WORK/produce_outbox.sql" <<'SQL'
\set id random(1, 100000)
BEGIN;
INSERT INTO business (v) VALUES (:id);
SELECT outbox.emit('order', :id, 'order.created', '{"total": 10}');
COMMIT;
SQL
cat > "$WORK/produce_plain.sql" <<'SQL'
\set id random(1, 100000)
BEGIN;
INSERT INTO business (v) VALUES (:id);
INSERT INTO plain_outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', :id, 'order.created', '{"total": 10}');
COMMIT;
SQL
write_outbox_relay "$WORK/relay_outbox.sql" 100
cat > "$WORK/relay_plain.sql" <<'SQL'
WITH batch AS (SELECT id FROM plain_outbox WHERE published_at IS NULL
                ORDER BY created_at LIMIT 100 FOR UPDATE SKIP LOCKED),
     done AS (UPDATE plain_outbox o SET published_at = now() FROM batch WHERE o.id = batch.id
              RETURNING length(o.payload::text) AS bytes)
SELECT count(*), sum(bytes) FROM done;
SQL

backlog() {
    case $1 in
        outbox) sql -c "SELECT count(*) FROM outbox.emit_many('order', 'order.created', (SELECT array_agg((i % 10000)::text) FROM generate_series(1, $N) i), (SELECT array_agg(jsonb_build_object('total', i)) FROM generate_series(1, $N) i))" >/dev/null ;;
        plain) sql -c "INSERT INTO plain_outbox (aggregate_type, aggregate_id, event_type, payload) SELECT 'order', (i % 10000)::text, 'order.created', jsonb_build_object('total', i) FROM generate_series(1, $N) i" ;;
    esac
}
# drain SYSTEM -> events/s for N events (plus whatever churn left)
drain() {
    local start end
    start=$(now_s)
    "$BIN/pgbench" -n -M prepared -h 127.0.0.1 -p "$PORT" -U postgres -c 1 -t $(( N / 100 + 50 )) \
        -f "$WORK/relay_$1.sql" bench >/dev/null 2>&1
    end=$(now_s)
    awk -v n="$N" -v a="$start" -v b="$end" 'BEGIN{printf "%.0f", n/(b-a)}'
}
dead_tuples() {
    sql -c "SELECT pg_stat_force_next_flush()" >/dev/null
    sleep 1.2
    case $1 in
        outbox) sql_value "SELECT coalesce(sum(n_dead_tup), 0) || ' (events), ' ||
                                  (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = '_cursor_log') || ' (cursor log)'
                             FROM pg_stat_user_tables WHERE schemaname = 'outbox' AND relname LIKE 'events%'" ;;
        plain) sql_value "SELECT n_dead_tup || ' (plain_outbox)' FROM pg_stat_user_tables WHERE relname = 'plain_outbox'" ;;
    esac
}
size_of() {
    case $1 in
        outbox) sql_value "SELECT pg_size_pretty(sum(pg_total_relation_size(c.oid))) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'outbox' AND c.relkind IN ('r')" ;;
        plain) sql_value "SELECT pg_size_pretty(pg_total_relation_size('plain_outbox'))" ;;
    esac
}

declare -A clean held dead size
for system in outbox plain; do
    backlog "$system"; sql -c "VACUUM ANALYZE" -c CHECKPOINT
    clean[$system]=$(drain "$system")
    log "$system clean drain: ${clean[$system]} events/s"
    sql -c "BEGIN ISOLATION LEVEL REPEATABLE READ" -c "SELECT count(*) FROM business" \
        -c "SELECT pg_sleep(100000)" >/dev/null 2>&1 &
    holder=$!
    sleep 1
    log "$system: snapshot held; ${CHURN}s of 2,000 events/s with the relay keeping up"
    "$BIN/pgbench" -n -M prepared -h 127.0.0.1 -p "$PORT" -U postgres -c 4 -j 2 -R 2000 -T "$CHURN" \
        -f "$WORK/produce_$system.sql" bench >/dev/null 2>&1 &
    producers=$!
    "$BIN/pgbench" -n -M prepared -h 127.0.0.1 -p "$PORT" -U postgres -c 1 -T "$CHURN" \
        -f "$WORK/relay_$system.sql" bench >/dev/null 2>&1
    wait "$producers"
    backlog "$system"
    held[$system]=$(drain "$system")
    dead[$system]=$(dead_tuples "$system")
    size[$system]=$(size_of "$system")
    log "$system held drain: ${held[$system]} events/s; dead tuples ${dead[$system]}"
    sql -c "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(100000)%' AND pid <> pg_backend_pid()" >/dev/null
    wait "$holder" 2>/dev/null || true
    sql -c "VACUUM" >/dev/null
done

echo
echo "Held xmin: a REPEATABLE READ snapshot held through ${CHURN}s of 2,000 events/s, then a drain of $N events"
echo
echo "| relay | clean drain events/s | held drain events/s | held / clean | dead tuples in what the relay reads | size |"
echo "| --- | --- | --- | --- | --- | --- |"
echo "| outbox_ext claim+ack (batch 100) | ${clean[outbox]} | ${held[outbox]} | $(ratio "${held[outbox]}" "${clean[outbox]}") (target >= 0.90x) | ${dead[outbox]} | ${size[outbox]} |"
echo "| plain-SQL SKIP LOCKED + UPDATE (batch 100) | ${clean[plain]} | ${held[plain]} | $(ratio "${held[plain]}" "${clean[plain]}") | ${dead[plain]} | ${size[plain]} |"
rm -rf "$WORK"
