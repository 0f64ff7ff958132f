"""What the integration tests share, written once; test modules import from here, never from each other.

- pgcluster: real PostgreSQL clusters (Cluster: initdb, start, stop, restart), free_port, as_postgres
- relay: a relay in Python over the SQL claim API (Relay), and first_deliveries
- peers: Receiver, FaultProxy, certificates, KafkaRestFront; create_sink, wait_for, check_delivery
- kafka_cluster: a real 3-node Apache Kafka cluster (KafkaCluster)
- pgbouncer: a real PgBouncer 1.18 in transaction mode in front of a test database
- debezium: Debezium's embedded engine with the outbox event router, on the Kafka guide's configuration
- versions: the released versions one can upgrade from (RELEASED) and this one (NEW)
- db: keys_in_shard, count_events, waits_for_a_lock, insert_event_at, partitions_scanned, worker_pid
- events: emit (one key, n events) and emit_keys (several keys, one transaction per round)
"""
