# Shared by the benchmarks: a release build of outbox_ext in its own PostgreSQL tree
# (target/pg-bench) and one cluster with the settings of ../shared/baselines.md.
PG_TREES="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/pg-bench"
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/lib.sh"
PORT=${BENCH_PORT:-55499}
BIN=""

# start_bench_cluster NAME [postgresql.conf lines]: fresh cluster in target/bench/NAME with
# database "bench".
start_bench_cluster() {
    local data="$TARGET/bench/$1"; shift
    setup_machine
    install_extension 15 release
    stop_cluster 15 "$data"
    start_cluster 15 "$data" "$PORT" "synchronous_commit = off" "shared_buffers = 1GB" \
        "max_wal_size = 8GB" "autovacuum_naptime = 10s" "$@"
    BENCH_DATA=$data
    trap 'stop_cluster 15 "$BENCH_DATA"' EXIT
    BIN=$(pg_bindir 15)
    "$BIN/psql" -X -q -h 127.0.0.1 -p "$PORT" -U postgres -c "CREATE DATABASE bench"
}

sql() { "$BIN/psql" -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d bench -v ON_ERROR_STOP=1 "$@"; }
sql_value() { sql -At -c "$1"; }

# pgbench_run SCRIPT CLIENTS ARGS...: runs pgbench quietly; prints its tps.
pgbench_run() {
    local script=$1 clients=$2; shift 2
    "$BIN/pgbench" -n -M prepared -h 127.0.0.1 -p "$PORT" -U postgres -c "$clients" -j "$clients" \
        -f "$script" "$@" bench 2>/dev/null | sed -n 's/^tps = \([0-9.]*\).*/\1/p'
}

# draw_chart KIND FILE: the charts of docs/benchmarks.md from a run's output (bench/chart.py),
# with matplotlib in the venv (only the benchmarks need it).
CHART_PACKAGES="matplotlib==3.10.8"
draw_chart() {
    "$VENV/bin/python" -c "import matplotlib" 2>/dev/null ||
        "$VENV/bin/pip" install -q --disable-pip-version-check $CHART_PACKAGES
    "$VENV/bin/python" "$ROOT/bench/chart.py" "$@"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN{ if (b > 0) printf "%.2fx", a/b; else print "-" }'; }
now_s() { date +%s.%N; }

# write_outbox_relay FILE BATCH [FAILED]: a pgbench script for one relay step of outbox_ext:
# claim (one transaction), touch every payload, settle (the next), reporting a FAILED share of
# the events (0 to 1, default 0) as failed and due again at once; nothing when no shard has work.
write_outbox_relay() {
    printf '%s\n' \
        "SELECT coalesce(min(shard), -1) AS shard, coalesce(min(epoch), -1) AS epoch, count(*) AS n," \
        "       sum(length(payload::text)) AS bytes," \
        "       coalesce(jsonb_agg(jsonb_build_object('id', id, 'error', 'bench', 'retry_after', 0))" \
        "                FILTER (WHERE random() < ${3:-0}), '[]') AS failures" \
        "  FROM outbox.claim('bench', $2) \\gset" \
        "\\if :n" \
        "SELECT outbox.settle('bench', :shard, :epoch, :failures::jsonb);" \
        "\\endif" > "$1"
}

# write_outbox_loop FILE BATCH: one relay step in one call: settle the batch the last step
# claimed and claim the next (settle_and_claim), touching every payload; the first step of a
# client, and one after an empty claim, only claims. Run with -D shard=-1 -D epoch=-1. A
# client's last batch is left unsettled: outbox.release_owner('bench', 'bench-loop') gives it
# back.
write_outbox_loop() {
    printf '%s\n' \
        "\\if :shard < 0" \
        "SELECT coalesce(min(shard), -1) AS shard, coalesce(min(epoch), -1) AS epoch, count(*) AS n," \
        "       sum(length(payload::text)) AS bytes" \
        "  FROM outbox.claim('bench', $2, '30 seconds', 'bench-loop') \\gset" \
        "\\else" \
        "SELECT coalesce(min(shard), -1) AS shard, coalesce(min(epoch), -1) AS epoch, count(*) AS n," \
        "       sum(length(payload::text)) AS bytes" \
        "  FROM outbox.settle_and_claim('bench', :shard, :epoch, '[]', $2, '30 seconds', 'bench-loop') \\gset" \
        "\\endif" > "$1"
}
