#!/usr/bin/env bash
# Delivery benchmark: the background worker end to end (see bench/deliver.py for what it
# measures and against which baselines). Release build, cluster settings of
# ../shared/baselines.md, worker serving database "bench".
# Usage: bench/deliver.sh [events, default 200000] [backlog for the RSS run, default 1000000] [steps...]
source "$(dirname "$0")/common.sh"
EVENTS=${1:-200000}
BACKLOG=${2:-1000000}
shift 2 || shift $#
# wal_level logical: the Kafka step runs Debezium beside the native sink
# metrics on PORT - 1: the Kafka latency step reads how long its batches took (deliver.py)
start_bench_cluster deliver "outbox_ext.databases = 'bench'" "wal_level = logical" \
    "outbox_ext.metrics_address = '127.0.0.1:$((PORT - 1))'"
"$VENV/bin/python" "$(dirname "$0")/deliver.py" "$PORT" "$EVENTS" "$BACKLOG" "$@"
draw_chart deliver "$TARGET/bench/deliver.json"   # deliver.py writes what it measured there
