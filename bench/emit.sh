#!/usr/bin/env bash
# Emit benchmark: pgbench, every variant in one run on one cluster, printed as ratios.
#   single: a business INSERT in BEGIN/COMMIT, plus one event written by
#           - nothing (the business transaction alone, for reference)
#           - the plain-SQL outbox (uuid primary key, partial index on unpublished rows)
#           - outbox.emit
#   bulk:   1,000 events in one statement, from the same input arrays, written by
#           - a plain heap INSERT into a table with no index (the physical floor)
#           - a plain INSERT ... SELECT into a table of the events' shape (columns, defaults,
#             the one (shard, seq, txid) index readers need), no partitions, no checks
#           - the plain-SQL outbox INSERT ... SELECT
#           - pgq.insert_event, once per event (PgQ 3.5, Debian's postgresql-15-pgq3)
#           - outbox.emit_many
# Usage: bench/emit.sh [seconds per run, default 10] [rounds, default 2]. Figures are the
# best of the rounds; variants alternate inside each round so drift hits them all alike.
PG_TREES="$(cd "$(dirname "$0")/.." && pwd)/target/pg-bench"
source "$(dirname "$0")/../scripts/lib.sh"
SECONDS_PER_RUN=${1:-10}
ROUNDS=${2:-2}
PORT=${BENCH_PORT:-55499}
DATA="$TARGET/bench/emit"
WORK=$(mktemp -d)

setup_machine
install_extension 15 release
stop_cluster 15 "$DATA"
start_cluster 15 "$DATA" "$PORT" "synchronous_commit = off" "shared_buffers = 1GB" "max_wal_size = 8GB"
trap 'stop_cluster 15 "$DATA"; rm -rf "$WORK"' EXIT
BIN=$(pg_bindir 15)
sql() { "$BIN/psql" -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d bench -v ON_ERROR_STOP=1 "$@"; }
"$BIN/psql" -X -q -h 127.0.0.1 -p "$PORT" -U postgres -c "CREATE DATABASE bench"

sql <<'SQL'
CREATE EXTENSION outbox_ext;
SELECT count(*) FROM outbox.maintain();  -- the first partitions
CREATE EXTENSION pgq;
SELECT pgq.create_queue('bench');
CREATE TABLE business (id bigserial PRIMARY KEY, customer text, total numeric);
-- The plain-SQL outbox most teams hand-roll.
CREATE TABLE plain_outbox (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text NOT NULL, aggregate_id text NOT NULL, event_type text NOT NULL,
    payload jsonb, created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz);
CREATE INDEX plain_outbox_unpublished ON plain_outbox (created_at) WHERE published_at IS NULL;
-- The floor: the same columns, no index, no defaults to compute.
CREATE TABLE heap_floor (aggregate_type text, aggregate_id text, event_type text, payload jsonb);
-- What any SQL INSERT of an event row costs: the events' columns, defaults and index.
CREATE TABLE events_shape (LIKE outbox.events INCLUDING DEFAULTS);
CREATE INDEX ON events_shape (shard, seq, txid);
SQL

cat > "$WORK/single_business.sql" <<'SQL'
\set id random(1, 1000000)
BEGIN;
INSERT INTO business (customer, total) VALUES ('c' || :id, :id);
COMMIT;
SQL
cat > "$WORK/single_plain.sql" <<'SQL'
\set id random(1, 1000000)
BEGIN;
INSERT INTO business (customer, total) VALUES ('c' || :id, :id);
INSERT INTO plain_outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('order', :id, 'order.created', '{"customer": "c", "total": 10}');
COMMIT;
SQL
cat > "$WORK/single_emit.sql" <<'SQL'
\set id random(1, 1000000)
BEGIN;
INSERT INTO business (customer, total) VALUES ('c' || :id, :id);
SELECT outbox.emit('order', :id, 'order.created', '{"customer": "c", "total": 10}');
COMMIT;
SQL
INPUT="WITH input AS (SELECT array_agg(i::text) AS keys, array_agg(jsonb_build_object('customer', 'c', 'total', i)) AS payloads FROM generate_series(1, 1000) i)"
echo "$INPUT INSERT INTO heap_floor SELECT 'order', k, 'order.created', p FROM input, unnest(keys, payloads) AS u(k, p);" > "$WORK/bulk_floor.sql"
echo "$INPUT INSERT INTO plain_outbox (aggregate_type, aggregate_id, event_type, payload) SELECT 'order', k, 'order.created', p FROM input, unnest(keys, payloads) AS u(k, p);" > "$WORK/bulk_plain.sql"
echo "$INPUT SELECT count(pgq.insert_event('bench', 'order.created', p::text, k, NULL, NULL, NULL)) FROM input, unnest(keys, payloads) AS u(k, p);" > "$WORK/bulk_pgq.sql"
echo "$INPUT INSERT INTO events_shape (id, aggregate_type, aggregate_id, event_type, payload, shard) SELECT outbox.uuid_v7(), 'order', k, 'order.created', p, outbox.shard_of(k) FROM input, unnest(keys, payloads) AS u(k, p);" > "$WORK/bulk_shape.sql"
echo "$INPUT SELECT count(*) FROM input, outbox.emit_many('order', 'order.created', keys, payloads);" > "$WORK/bulk_emit.sql"

reset_tables() {
    sql -c "TRUNCATE business, plain_outbox, heap_floor, events_shape, outbox.events" \
        -c "SELECT pgq.maint_rotate_tables_step1('bench'); SELECT pgq.maint_rotate_tables_step2();" >/dev/null
    sql -c "TRUNCATE pgq.event_1, pgq.event_1_0, pgq.event_1_1, pgq.event_1_2" 2>/dev/null || true
    sql -c "VACUUM ANALYZE" -c "CHECKPOINT"
}

# run NAME CLIENTS -> prints transactions per second
run() {
    local name=$1 clients=$2
    reset_tables
    "$BIN/pgbench" -n -M prepared -h 127.0.0.1 -p "$PORT" -U postgres -c "$clients" -j "$clients" \
        -T "$SECONDS_PER_RUN" -f "$WORK/$name.sql" bench 2>/dev/null | sed -n 's/^tps = \([0-9.]*\).*/\1/p'
}

declare -A best
for round in $(seq "$ROUNDS"); do
    for name in single_business single_plain single_emit bulk_floor bulk_shape bulk_plain bulk_pgq bulk_emit; do
        clients=4; [[ $name == bulk_* ]] && clients=2
        tps=$(run "$name" "$clients")
        log "round $round: $name ($clients clients) $tps tps"
        if [ -z "${best[$name]:-}" ] || awk -v a="$tps" -v b="${best[$name]}" 'BEGIN{exit !(a>b)}'; then
            best[$name]=$tps
        fi
    done
done

ratio() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2fx", a/b}'; }
per_s() { awk -v t="$1" 'BEGIN{printf "%.0f", t*1000}'; }
echo
echo "Emit benchmark: PostgreSQL 15, $(nproc) cores, synchronous_commit=off, best of $ROUNDS x ${SECONDS_PER_RUN}s"
echo
echo "| single event in a business transaction (4 clients) | tps | vs plain-SQL outbox |"
echo "| --- | --- | --- |"
echo "| business INSERT only | ${best[single_business]} | $(ratio "${best[single_business]}" "${best[single_plain]}") |"
echo "| + plain-SQL outbox INSERT | ${best[single_plain]} | 1.00x |"
echo "| + outbox.emit | ${best[single_emit]} | $(ratio "${best[single_emit]}" "${best[single_plain]}") (target >= 0.95x) |"
echo
echo "| 1,000 events in one statement (2 clients) | events/s | vs heap floor | vs pgq.insert_event |"
echo "| --- | --- | --- | --- |"
for name in bulk_floor bulk_shape bulk_plain bulk_pgq bulk_emit; do
    label=${name#bulk_}
    case $label in floor) label="plain heap INSERT, no index (floor)";; plain) label="plain-SQL outbox INSERT ... SELECT";;
        shape) label="plain INSERT ... SELECT of the events' shape (columns, defaults, index)";;
        pgq) label="pgq.insert_event per event";; emit) label="outbox.emit_many";; esac
    echo "| $label | $(per_s "${best[$name]}") | $(ratio "${best[$name]}" "${best[bulk_floor]}") | $(ratio "${best[$name]}" "${best[bulk_pgq]}") |"
done
echo
echo "targets: emit_many >= 0.5x floor and >= 2x pgq.insert_event"
