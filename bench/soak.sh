#!/usr/bin/env bash
# Soak benchmark: sustained emit and claim over many partition rotations; storage stays
# bounded, event tables gain no dead tuples, every event is delivered.
# Usage: bench/soak.sh [minutes, default 10] [partition width in seconds, default 60] [events/s, default 1000]
source "$(dirname "$0")/common.sh"
MINUTES=${1:-10}
WIDTH=${2:-60}
RATE=${3:-1000}
start_bench_cluster soak
sql -c "CREATE EXTENSION outbox_ext" -c "CREATE TABLE business (id bigserial PRIMARY KEY, v int)"
echo "Soak: ${MINUTES} min, ${WIDTH}-second partitions kept ${WIDTH} s after delivery, ${RATE} events/s"
echo
"$VENV/bin/python" "$(dirname "$0")/soak.py" "host=127.0.0.1 port=$PORT dbname=bench user=postgres" \
    "$MINUTES" "$WIDTH" "$RATE"
