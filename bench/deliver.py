"""Delivery benchmark (run by bench/deliver.sh against a running bench cluster whose worker
serves database "bench"). Prints, each against a baseline measured in the same run:

1. throughput: a pre-filled backlog drained by the worker to a local batching HTTP receiver,
   against (a) the receiver's own ceiling (a client posting the same batches, no database) and
   (b) a hand-rolled relay (4 threads: SELECT ... FOR UPDATE SKIP LOCKED, POST, DELETE);
2. commit-to-sink latency p50/p99 at a fixed 1,000 events/s, against a hand-rolled relay
   polling a plain table every 100 ms;
3. the worker's private RSS while it drains a 1M-event backlog (webhook: rss; kafka: rss_kafka);
4. throughput through the Kafka REST path (REST front over a real 3-node Apache Kafka 4.4
   cluster, replication factor 3, min.insync.replicas 2, acks=all), against the front's own
   ceiling; then the native Kafka sink into the same cluster, with 100,000 keys and with 1,000
   hot keys, against a plain confluent-kafka producer sending the same records (the ceiling)
   and against the REST path's hot-key rate, and against Debezium's outbox event router
   draining the same backlog from the WAL; and the commit-to-consumer latency at 1,000
   events/s of all three (last: the Kafka client's threads linger in this process and disturb the HTTP
   latency figures).
Usage: deliver.py PORT EVENTS BACKLOG [steps: throughput latency rss kafka rss_kafka latency_kafka]
(latency_kafka: only the Kafka latency figures of the kafka step)"""

from __future__ import annotations

import bisect
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.debezium import (guide_slot, run_outbox_router, start_outbox_router,  # noqa: E402
                              wait_outbox_router)
from support.kafka_cluster import KafkaCluster  # noqa: E402
from support.peers import KafkaRestFront  # noqa: E402
from support.pgcluster import free_port  # noqa: E402

PORT, EVENTS, BACKLOG = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
DSN = f"host=127.0.0.1 port={PORT} user=postgres dbname=bench"
# What a run measured, by figure, for bench/chart.py: written to target/bench/deliver.json,
# over the figures of an earlier run's other steps.
RESULTS_FILE = Path(__file__).resolve().parent.parent / "target/bench/deliver.json"
RESULTS: dict = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.exists() else {}


def record(figure: str, **values) -> None:
    RESULTS[figure] = values
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps(RESULTS, indent=1, sort_keys=True) + "\n")


def summary(ms: list[float]) -> dict:
    """p50, p99 and p999 of latencies in ms, and how many there were."""
    ms = sorted(ms)
    at = lambda q: ms[max(0, int(len(ms) * q) - 1)]  # noqa: E731
    return {"p50": statistics.median(ms), "p99": at(0.99), "p999": at(0.999), "n": len(ms)}


def said(lat: dict) -> str:
    return f"p50 {lat['p50']:6.1f} ms   p99 {lat['p99']:6.1f} ms   p999 {lat['p999']:6.1f} ms"


class Counter:
    """bench/receiver.py in a process of its own, and how to ask it what arrived."""

    def __init__(self, track_ids: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        script = Path(__file__).resolve().parent / "receiver.py"
        self.process = subprocess.Popen([sys.executable, str(script), str(self.port)] +
                                        (["--track"] if track_ids else []), stdout=subprocess.PIPE, text=True)
        self.process.stdout.readline()   # "ready"

    def get(self, what: str) -> dict:
        with urllib.request.urlopen(self.url + what) as reply:
            return json.loads(reply.read())

    @property
    def count(self) -> int:
        return self.get("stats")["count"]

    def arrivals(self) -> dict[str, float]:
        return self.get("arrivals")

    def wait(self, n: int, timeout: float = 600) -> dict:
        """Waits until n events arrived; returns the stats (count, first and last arrival)."""
        deadline = time.monotonic() + timeout
        while (stats := self.get("stats"))["count"] < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return stats

    def reset(self) -> None:
        urllib.request.urlopen(urllib.request.Request(self.url, method="DELETE")).read()

    def close(self):
        self.process.terminate()
        self.process.wait()


def db() -> psycopg.Connection:
    return psycopg.connect(DSN, autocommit=True)


def fill(conn, n: int, topic: str | None = None, keys: int = 1000) -> None:
    """n events over `keys` keys, in transactions of 1,000 (emit_many)."""
    for start in range(0, n, 1000):
        size = min(1000, n - start)
        conn.execute("SELECT count(*) FROM outbox.emit_many('order', 'order.created', "
                     "ARRAY(SELECT (i %% %s)::text FROM generate_series(%s::int, %s::int) i), "
                     "ARRAY(SELECT jsonb_build_object('customer', 'c' || i, 'total', i) "
                     "      FROM generate_series(%s::int, %s::int) i), NULL, %s)",
                     (keys, start, start + size - 1, start, start + size - 1, topic))


def drain(conn, sink: str, wait, n: int) -> float:
    """Enables the (disabled) sink; events/s from the first arrival to the last (the worker
    notices the change within a second: that wait is not delivery)."""
    conn.execute("UPDATE outbox.sinks SET enabled = true WHERE name = %s", (sink,))
    stats = wait(n)
    return n / (stats["last"] - stats["first"])


def ceiling(url: str, n: int, batch: int, headers: dict, body_for) -> float:
    """events/s of 4 threads posting pre-built batches straight to the sink (no database)."""
    per_thread = n // 4 // batch

    def post():
        for _ in range(per_thread):
            req = urllib.request.Request(url, data=body_for(batch), headers=headers, method="POST")
            urllib.request.urlopen(req).read()
    threads = [threading.Thread(target=post) for _ in range(4)]
    t0 = time.monotonic()
    [t.start() for t in threads]
    [t.join() for t in threads]
    return per_thread * 4 * batch / (time.monotonic() - t0)


def sample_batch(n: int) -> bytes:
    return json.dumps([{"id": f"{i}", "topic": None, "aggregate_type": "order", "aggregate_id": str(i % 1000),
                        "event_type": "order.created", "payload": {"customer": f"c{i}", "total": i},
                        "headers": None, "created_at": "2026-11-29T00:00:00+00:00", "attempt": 1}
                       for i in range(n)]).encode()


def hand_rolled_relay(conn, url: str, n: int) -> float:
    """The relay users write by hand: a plain table, 4 threads, POST inside the transaction."""
    conn.execute("CREATE TABLE IF NOT EXISTS plain_outbox (id bigserial PRIMARY KEY, aggregate_id text, "
                 "event_type text, payload jsonb, created_at timestamptz DEFAULT now())")
    conn.execute("TRUNCATE plain_outbox")
    conn.execute("INSERT INTO plain_outbox (aggregate_id, event_type, payload) SELECT (i %% 1000)::text, "
                 "'order.created', jsonb_build_object('customer', 'c' || i, 'total', i) FROM generate_series(1, %s) i",
                 (n,))

    def relay():
        with psycopg.connect(DSN) as c:
            while True:
                with c.transaction():
                    rows = c.execute("SELECT id, aggregate_id, event_type, payload, created_at FROM plain_outbox "
                                     "ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED").fetchall()
                    if not rows:
                        return
                    body = json.dumps([{"id": r[0], "aggregate_id": r[1], "event_type": r[2], "payload": r[3],
                                        "created_at": r[4].isoformat()} for r in rows]).encode()
                    urllib.request.urlopen(urllib.request.Request(
                        url, data=body, method="POST", headers={"content-type": "application/json",
                                                                "outbox-event-count": str(len(rows))})).read()
                    c.execute("DELETE FROM plain_outbox WHERE id = ANY(%s)", ([r[0] for r in rows],))
    threads = [threading.Thread(target=relay) for _ in range(4)]
    t0 = time.monotonic()
    [t.start() for t in threads]
    [t.join() for t in threads]
    return n / (time.monotonic() - t0)


def throughput(conn) -> None:
    receiver = Counter()
    conn.execute("SELECT outbox.create_sink('http', 'webhook', %s, batch_size => 1000, concurrency => 4)",
                 (receiver.url,))
    conn.execute("UPDATE outbox.sinks SET enabled = false WHERE name = 'http'")
    fill(conn, EVENTS)
    ours = drain(conn, "http", receiver.wait, EVENTS)
    conn.execute("SELECT outbox.drop_sink('http')")
    receiver.reset()
    top = ceiling(receiver.url, EVENTS, 1000, {"content-type": "application/json", "outbox-event-count": "1000"},
                  lambda n, b=sample_batch(1000): b)
    receiver.reset()
    baseline = hand_rolled_relay(conn, receiver.url, EVENTS)
    receiver.close()
    record("http_throughput", events=EVENTS, worker=ours, ceiling=top, hand_rolled_relay=baseline)
    print(f"HTTP webhook, {EVENTS:,} events, batches of 1,000, 4 in flight:")
    print(f"  outbox_ext worker        {ours:>10,.0f} events/s")
    print(f"  receiver ceiling         {top:>10,.0f} events/s   worker/ceiling  {ours / top:.2f}x")
    print(f"  hand-rolled relay        {baseline:>10,.0f} events/s   worker/relay    {ours / baseline:.2f}x")


def kafka(conn) -> None:
    """Through the Kafka REST path, then the native sink. A REST batch goes in rounds (one
    event per key per request, see src/sinks/kafka_rest.rs), so the number of distinct keys in
    a batch matters: measured with many keys (the usual case: one aggregate, a few events) and
    with 1,000 hot keys."""
    brokers = KafkaCluster()
    brokers.create_topic("bench", partitions=4)
    front = KafkaRestFront(brokers.bootstrap(), {"bench"})
    n = min(EVENTS, 50_000)
    results = {}
    for keys in (100_000, 1000):
        sink = f"kafka{keys}"
        conn.execute("SELECT outbox.create_sink(%s, 'kafka_rest_v2', %s, batch_size => 500, concurrency => 4)",
                     (sink, front.url))
        conn.execute("UPDATE outbox.sinks SET enabled = false WHERE name = %s", (sink,))
        fill(conn, n, topic="bench", keys=keys)
        front.faults.produced.clear()
        results[keys] = drain(conn, sink, lambda k: _wait_produced(front, k), n)
        conn.execute("SELECT outbox.drop_sink(%s)", (sink,))
    front.faults.produced.clear()
    body = json.dumps({"records": [{"key": str(i), "value": {"customer": f"c{i}", "total": i}}
                                   for i in range(500)]}).encode()
    top = ceiling(front.url + "/topics/bench", n, 500, {"content-type": "application/vnd.kafka.json.v2+json"},
                  lambda _n: body)
    front.close()
    record("kafka_rest", events=n, ceiling=top, keys_100000=results[100_000], keys_1000=results[1000])
    print(f"Kafka REST v2 (REST front in Python over 3-node Kafka), {n:,} events, batches of 500:")
    print(f"  front ceiling            {top:>10,.0f} events/s   (500 records per request, no database)")
    for keys, rate in results.items():
        print(f"  outbox_ext, {keys:>7,} keys  {rate:>10,.0f} events/s   worker/ceiling  {rate / top:.2f}x")
    sys.stdout.flush()
    kafka_native(conn, brokers, rest_hot=results[1000])
    kafka_latency(conn, brokers)
    brokers.close()


def kafka_sink(conn, name: str, bootstrap: str, batch_size: int = 1000, enabled: bool = False) -> None:
    """A native Kafka sink, 4 batches in flight; created disabled unless `enabled`."""
    conn.execute("SELECT outbox.create_sink(%s, 'kafka', %s, batch_size => %s, concurrency => 4)",
                 (name, f"kafka://{bootstrap}", batch_size))
    if not enabled:
        conn.execute("UPDATE outbox.sinks SET enabled = false WHERE name = %s", (name,))


def left(conn, sink: str) -> int:
    """Events the sink has still to deliver (outbox.status: exact once under 1,000 a shard)."""
    return conn.execute("SELECT pending FROM outbox.status WHERE consumer = %s", (sink,)).fetchone()[0]


def native_drain(conn, brokers, sink: str, batch: int, keys: int) -> float:
    """events/s of a native Kafka sink draining an EVENTS backlog into its own topic. The sink
    is started first (its producer id, the topic's metadata: one event delivered), as the
    ceiling's producer is before its clock; the backlog is committed at once (one transaction)
    and timed from its first record's CreateTime (the producer's clock, this machine's) to
    the poll that finds none left to settle."""
    kafka_sink(conn, sink, brokers.bootstrap(), batch, enabled=True)
    conn.execute("SELECT outbox.emit('order', 'warm-up', 'order.created', '{}', NULL, %s)", (sink,))
    while left(conn, sink):
        time.sleep(0.05)
    with conn.transaction():
        fill(conn, EVENTS, topic=sink, keys=keys)
    seen = None   # when a poll first saw progress
    while (pending := left(conn, sink)) > 0:
        if seen is None and pending < EVENTS:
            seen = time.time()
        # status costs up to 10 ms with a big backlog: polled every 50 ms it would take a
        # third of a core from the drain it times. So each poll waits a third of the time the
        # rate so far leaves: a few polls in all, the last ones 10 ms apart
        rest = pending * (time.time() - seen) / (EVENTS - pending) if seen else 0.15
        time.sleep(min(0.5, max(0.01, rest / 3)))
    last = time.time()
    conn.execute("SELECT outbox.drop_sink(%s)", (sink,))
    return EVENTS / (last - first_record_at(brokers, sink, skip_key=b"warm-up"))


def first_record_at(brokers, topic: str, skip_key: bytes, partitions: int = 4) -> float:
    """The earliest CreateTime of the topic's records, but for those of skip_key."""
    from confluent_kafka import Consumer, TopicPartition
    consumer = Consumer({"bootstrap.servers": brokers.bootstrap(), "group.id": f"first-{topic}",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    firsts, deadline = {}, time.monotonic() + 10
    try:
        while len(firsts) < partitions and time.monotonic() < deadline:
            m = consumer.poll(0.2)
            if m is not None and not m.error() and m.key() != skip_key:
                firsts.setdefault(m.partition(), m.timestamp()[1] / 1000)
    finally:
        consumer.close()
    return min(firsts.values())


def producer_ceiling(bootstrap: str, topic: str, n: int, keys: int) -> float:
    """events/s of a plain confluent-kafka producer sending the same records (key, JSON value,
    two headers) with the same guarantees (idempotent, acks=all, murmur2_random)."""
    from confluent_kafka import Producer
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                         "partitioner": "murmur2_random", "linger.ms": 5,
                         "queue.buffering.max.messages": 1_000_000})
    records = [(str(i % keys).encode(), json.dumps({"customer": f"c{i}", "total": i}).encode())
               for i in range(n)]
    headers = [("outbox-id", b"0190f3c2-7d4e-7c4a-9d5e-3f1a2b3c4d5e"), ("outbox-event-type", b"order.created")]
    # started before the clock (its producer id, the topic's metadata), as native_drain starts
    # the worker's sink before the backlog
    producer.produce(topic, key=b"warm-up", value=b"{}")
    assert producer.flush(30) == 0
    t0 = time.monotonic()
    for key, value in records:
        producer.produce(topic, key=key, value=value, headers=headers)
        producer.poll(0)
    assert producer.flush(120) == 0
    return n / (time.monotonic() - t0)


def kafka_native(conn, brokers, rest_hot: float) -> None:
    """Each run into a topic of its own, between two measurements of the producer ceiling (each
    into a fresh topic) and taken against the higher of its two: the broker's speed drifts over
    a run, so a ceiling measured once, far from a run, misstates it."""
    def topic(name: str) -> str:
        brokers.create_topic(name, partitions=4)
        return name

    def ceiling(i: int) -> float:
        return producer_ceiling(brokers.bootstrap(), topic(f"ceiling{i}"), EVENTS, 100_000)

    runs = ((100_000, 1000), (1000, 1000), (100_000, 5000), (1000, 5000))
    ceilings = [ceiling(0)]
    results = {}
    for i, (keys, batch) in enumerate(runs, start=1):
        sink = f"native{keys}_{batch}"
        results[keys, batch] = native_drain(conn, brokers, topic(sink), batch, keys)
        ceilings.append(ceiling(i))
    record("kafka_native", events=EVENTS, ceilings=ceilings,
           runs=[{"keys": keys, "batch": batch, "rate": rate, "ceiling": max(ceilings[i], ceilings[i + 1])}
                 for i, ((keys, batch), rate) in enumerate(results.items())])
    print(f"Kafka native (librdkafka into 3-node Kafka, RF 3, acks=all), {EVENTS:,} events, 4 batches in flight:")
    print("  plain producer ceiling (confluent-kafka, same records, no database), before, between and after the runs:")
    print("   " + ", ".join(f"{c:,.0f}" for c in ceilings) + " events/s")
    for i, ((keys, batch), rate) in enumerate(results.items()):
        top = max(ceilings[i], ceilings[i + 1])
        print(f"  outbox_ext, {keys:>7,} keys, batches of {batch:,}  {rate:>10,.0f} events/s   "
              f"worker/ceiling  {rate / top:.2f}x  (against {top:,.0f})")
    for batch in (1000, 5000):
        print(f"  batches of {batch:,}: hot keys / 100,000 keys  "
              f"{results[1000, batch] / results[100_000, batch]:.2f}x;   "
              f"hot keys native / REST  {results[1000, batch] / rest_hot:.1f}x")
    sys.stdout.flush()
    print("Debezium 3.6.1's outbox event router (embedded engine, pgoutput, the Kafka guide's configuration;")
    print("  sends a batch, waits for its acks, then commits its offsets, as Debezium Server does):")
    for keys in (100_000, 1000):
        rate = debezium_drain(conn, brokers, keys)
        RESULTS["kafka_native"][f"debezium_{keys}"] = rate
        record("kafka_native", **RESULTS["kafka_native"])
        native = max(results[keys, 1000], results[keys, 5000])
        print(f"  Debezium, {keys:>7,} keys         {rate:>10,.0f} events/s   "
              f"native/Debezium  {native / rate:.1f}x  (native's best batch size)")


def debezium_drain(conn, brokers, keys: int) -> float:
    """events/s of Debezium's router draining an EVENTS backlog from the WAL into Kafka, from
    the first record it hands over to the last ack (the backlog is committed before it starts,
    as the native sink's is)."""
    topic = f"dbz{keys}."
    brokers.create_topic(f"{topic}outbox.event.order", partitions=4)
    with guide_slot(conn):
        fill(conn, EVENTS, keys=keys)
        seconds = run_outbox_router(PORT, "bench", brokers.bootstrap(), expect=EVENTS, topic_prefix=topic,
                                    timeout=900)
    return EVENTS / seconds


def batches_of(consumer: str) -> tuple[int, float]:
    """How many batches the worker delivered for consumer, and their mean time from hand-off to
    the last report (outbox_delivery_duration_seconds, from the worker's metrics on PORT - 1)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT - 1}/metrics") as reply:
        text = reply.read().decode()
    def value(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and f'consumer="{consumer}"' in line)
    count = value("outbox_delivery_duration_seconds_count")
    return int(count), 1000 * value("outbox_delivery_duration_seconds_sum") / max(count, 1)


def latency_kafka(conn) -> None:
    """The Kafka latency figures alone (the last part of the kafka step), on a cluster of their
    own, warmed first as the kafka step's runs warm it (a fresh cluster's first seconds, with
    coordinators still loading, would be measured otherwise)."""
    brokers = KafkaCluster()
    brokers.create_topic("warm", partitions=4)
    producer_ceiling(brokers.bootstrap(), "warm", EVENTS, 100_000)
    kafka_latency(conn, brokers)
    brokers.close()


def kafka_latency(conn, brokers) -> None:
    """Commit to broker, as a consumer tailing the topic sees each event id arrive; against a
    plain producer sending at the same pace into the same broker (its send to that arrival)."""
    from confluent_kafka import Producer
    rate, seconds = 1000, 10
    brokers.create_topic("lat", partitions=4)
    conn.execute("SELECT outbox.create_sink('kafka_lat', 'kafka', %s)", (f"kafka://{brokers.bootstrap()}",))
    time.sleep(1.5)
    # the sink's producer starts with its first batch (about 0.5 s to get its producer id)
    conn.execute("SELECT outbox.emit('order', 'warm', 'order.created', '{}', NULL, 'lat')")
    while left(conn, "kafka_lat"):
        time.sleep(0.05)
    with Tail(brokers, "lat") as tail:
        committed = paced(rate, seconds, lambda i: conn.execute(
            "SELECT outbox.emit('order', %s, 'order.created', '{\"n\": 1}', NULL, 'lat')::text",
            (str(i % 100),)).fetchone()[0])
        ours = tail.percentiles(committed)
    # a suspension (the sink judged down) during the run would make the tail: say so
    ours["suspensions"], ours["failed"] = conn.execute(
        "SELECT sink_suspensions, failed_total FROM outbox.status WHERE consumer = 'kafka_lat'").fetchone()
    ours["batches"], ours["batch_ms"] = batches_of("kafka_lat")
    parts = where_the_time_goes(conn, "kafka_lat", committed, tail.arrivals)
    conn.execute("SELECT outbox.drop_sink('kafka_lat')")
    brokers.create_topic("lat_plain", partitions=4)
    producer = Producer({"bootstrap.servers": brokers.bootstrap(), "enable.idempotence": True, "acks": "all",
                         "partitioner": "murmur2_random", "linger.ms": 5})

    producer.produce("lat_plain", key=b"warm", value=b"{}", headers=[("outbox-id", b"warm")])  # as above
    producer.flush(10)

    def send(i):
        producer.produce("lat_plain", key=str(i % 100).encode(), value=b'{"n": 1}',
                         headers=[("outbox-id", f"p{i}".encode())])
        producer.poll(0)
        return f"p{i}"
    with Tail(brokers, "lat_plain") as tail:
        theirs = tail.percentiles(paced(rate, seconds, send))
    producer.flush(10)
    debezium = debezium_latency(conn, brokers, rate, seconds)
    record("kafka_latency", rate=rate, seconds=seconds, native=ours, producer=theirs, debezium=debezium,
           native_parts=parts)
    print(f"Kafka commit-to-consumer latency at {rate:,} events/s for {seconds} s (as a consumer sees it):")
    print(f"  outbox_ext worker        {said(ours)}   ({ours['n']:,} events; sink suspended "
          f"{ours['suspensions']} times, {ours['failed']} failed deliveries; {ours['batches']:,} batches, "
          f"each {ours['batch_ms']:.1f} ms from hand-off to its last report on average)")
    print(f"  plain producer           {said(theirs)}   "
          f"(send to arrival: the broker's and consumer's share)   worker/producer p99 {ours['p99'] / theirs['p99']:.1f}x")
    print(f"  Debezium outbox router   {said(debezium)}   "
          f"(its defaults)   Debezium/worker p99 {debezium['p99'] / ours['p99']:.1f}x")
    print_parts(parts, "produce, acks, consumer")


def debezium_latency(conn, brokers, rate: int, seconds: int) -> dict:
    """Commit to arrival through Debezium's router (the Kafka guide's configuration, its defaults
    otherwise), paced as the native sink's run."""
    prefix = "dbzlat."
    brokers.create_topic(f"{prefix}outbox.event.order", partitions=4)
    with guide_slot(conn):
        router = start_outbox_router(PORT, "bench", brokers.bootstrap(), expect=1 + rate * seconds,
                                     topic_prefix=prefix)
        try:
            with Tail(brokers, f"{prefix}outbox.event.order", id_header="id") as tail:
                warm = conn.execute("SELECT outbox.emit('order', 'warm', 'order.created', '{}')::text").fetchone()[0]
                while warm not in tail.arrivals:   # the engine is up and streaming
                    time.sleep(0.05)
                result = tail.percentiles(paced(rate, seconds, lambda i: conn.execute(
                    "SELECT outbox.emit('order', %s, 'order.created', '{\"n\": 1}')::text",
                    (str(i % 100),)).fetchone()[0]))
            wait_outbox_router(router, timeout=120)
        finally:
            if router.poll() is None:
                router.kill()
    return result


class Tail:
    """A consumer thread noting when each record (by its id_header, outbox-id unless told)
    arrives."""

    def __init__(self, brokers, topic: str, id_header: str = "outbox-id"):
        self.brokers, self.topic, self.arrivals, self.stop = brokers, topic, {}, threading.Event()
        self.id_header = id_header
        self.thread = threading.Thread(target=self.run)

    def run(self):
        from confluent_kafka import Consumer, TopicPartition
        consumer = Consumer({"bootstrap.servers": self.brokers.bootstrap(), "group.id": self.topic,
                             "fetch.wait.max.ms": 5, "fetch.min.bytes": 1})
        consumer.assign([TopicPartition(self.topic, p, 0) for p in range(4)])
        while not self.stop.is_set():
            # one record per poll: it returns as soon as one is there (consume(n, timeout) waits
            # for n records or the timeout, and would stamp records up to the timeout late)
            m = consumer.poll(0.05)
            if m is not None and not m.error():
                self.arrivals[dict(m.headers())[self.id_header].decode()] = time.time()
        consumer.close()

    def __enter__(self):
        self.thread.start()
        time.sleep(1)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def percentiles(self, sent: dict[str, float]) -> dict:
        deadline = time.monotonic() + 30
        while len(self.arrivals) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.05)
        return summary([(self.arrivals[i] - t) * 1000 for i, t in sent.items() if i in self.arrivals])


def _wait_produced(front, n):
    first = None
    while len(front.faults.produced) < n:
        if first is None and front.faults.produced:
            first = time.time()
        time.sleep(0.001)
    return {"first": first, "last": time.time()}


def paced(rate: int, seconds: int, emit_one) -> dict[str, float]:
    """Calls emit_one(i) rate times a second (autocommit); returns id -> commit time."""
    committed, start = {}, time.monotonic()
    for i in range(rate * seconds):
        while (wait := start + i / rate - time.monotonic()) > 0:
            time.sleep(wait)
        event_id = emit_one(i)
        committed[event_id] = time.time()
    return committed


def percentiles(receiver: Counter, committed: dict[str, float]) -> dict:
    receiver.wait(len(committed), timeout=30)
    arrivals = receiver.arrivals()
    return summary([(arrivals[i] - t) * 1000 for i, t in committed.items() if i in arrivals])


def polling_relay(url: str, stop: threading.Event) -> None:
    """A hand-rolled relay polling a plain table every 100 ms."""
    with psycopg.connect(DSN) as c:
        while not stop.is_set():
            with c.transaction():
                rows = c.execute("SELECT id, aggregate_id, payload FROM plain_outbox ORDER BY id LIMIT 1000 "
                                 "FOR UPDATE SKIP LOCKED").fetchall()
                if rows:
                    body = json.dumps([{"id": f"p{r[0]}", "aggregate_id": r[1], "payload": r[2]} for r in rows])
                    urllib.request.urlopen(urllib.request.Request(url, data=body.encode(), method="POST")).read()
                    c.execute("DELETE FROM plain_outbox WHERE id = ANY(%s)", ([r[0] for r in rows],))
            stop.wait(0.1)


def latency(conn) -> None:
    rate, seconds = 1000, 10
    receiver = Counter(track_ids=True)
    conn.execute("SELECT outbox.create_sink('lat', 'webhook', %s)", (receiver.url,))
    time.sleep(1.5)
    committed = paced(rate, seconds, lambda i: conn.execute(
        "SELECT outbox.emit('order', %s, 'order.created', '{\"n\": 1}')::text", (str(i % 100),)).fetchone()[0])
    ours = percentiles(receiver, committed)
    parts = where_the_time_goes(conn, "lat", committed, receiver.arrivals())
    conn.execute("SELECT outbox.drop_sink('lat')")
    conn.execute("CREATE TABLE IF NOT EXISTS plain_outbox (id bigserial PRIMARY KEY, aggregate_id text, "
                 "event_type text, payload jsonb, created_at timestamptz DEFAULT now())")
    conn.execute("TRUNCATE plain_outbox")
    receiver.reset()
    stop = threading.Event()
    relay = threading.Thread(target=polling_relay, args=(receiver.url, stop))
    relay.start()
    theirs = percentiles(receiver, paced(rate, seconds, lambda i: "p" + str(conn.execute(
        "INSERT INTO plain_outbox (aggregate_id, payload) VALUES (%s, '{\"n\": 1}') RETURNING id",
        (str(i % 100),)).fetchone()[0])))
    stop.set()
    relay.join()
    receiver.close()
    record("http_latency", rate=rate, seconds=seconds, worker=ours, polling_relay=theirs, worker_parts=parts)
    print(f"Commit-to-sink latency at {rate:,} events/s for {seconds} s:")
    print(f"  outbox_ext worker        {said(ours)}   ({ours['n']:,} events)")
    print(f"  100 ms polling relay     {said(theirs)}   "
          f"relay/worker p50 {theirs['p50'] / ours['p50']:.1f}x, p99 {theirs['p99'] / ours['p99']:.1f}x")
    print_parts(parts, "HTTP, receiver")


def print_parts(parts: dict, sink_side: str) -> None:
    """Prints where_the_time_goes's split."""
    print("  the worker's time, commit -> claim (wake-up, waiting for a free slot or a round) and "
          f"claim -> arrival (hand-off, {sink_side}):")
    for part in ("to_claim", "to_arrival"):
        print(f"    {part:<12} all events p50 {parts[part]['p50']:5.1f} ms  p99 {parts[part]['p99']:5.1f} ms;  "
              f"the slowest 1%: median {parts['tail_' + part]:5.1f} ms")
    print(f"    the slowest 1% fall in {parts['tail_bursts']} bursts (events within 50 ms of each other); "
          f"{parts['batches']:,} batches for {parts['n']:,} events, each out {parts['batch_out_ms']:.1f} ms "
          "(median, claim to settle)")


def where_the_time_goes(conn, sink: str, committed: dict[str, float], arrivals: dict[str, float]) -> dict:
    """Splits each event's commit-to-arrival time at the claim that handed it out: the first
    claim row of its shard in the sink's cursor log (kept a minute) whose batch ends at or
    after its seq (the events here commit one at a time, so seq order is commit order); `at`
    is the start of the claim's transaction. (Sound here, a healthy sink: a lease that ran out, a
    release or a parked key would pair rows otherwise.) And how bunched the slowest 1% are in time (a
    few bursts point at a stall of the worker's loop, many at queueing), how many batches
    carried the events and how long each was out: with its delivery slots full, an event
    waits for one to free."""
    claims: dict[int, list[tuple[int, float]]] = {}
    out_for: list[float] = []   # claim to the shard's next row (its settle), ms
    last_claim: dict[int, float] = {}
    for shard, batch_end, at in conn.execute(
            "SELECT l.shard, l.batch_end, extract(epoch FROM l.at)::float8 FROM outbox._cursor_log l "
            "WHERE l.consumer_id = (SELECT c.id FROM outbox.consumers c WHERE c.name = %s) "
            "ORDER BY l.pos", (sink,)):
        if shard in last_claim:
            out_for.append((at - last_claim.pop(shard)) * 1000)
        if batch_end is not None:
            claims.setdefault(shard, []).append((batch_end, at))
            last_claim[shard] = at
    ends = {shard: [end for end, _ in rows] for shard, rows in claims.items()}
    to_claim, to_arrival, total = [], [], []
    for event_id, shard, seq in conn.execute(
            "SELECT e.id::text, e.shard, e.seq FROM outbox.events e WHERE e.id = ANY(%s::uuid[])",
            (list(committed),)):
        rows = claims.get(shard, [])
        i = bisect.bisect_left(ends.get(shard, []), seq)
        if i == len(rows) or event_id not in arrivals:
            continue
        at, commit, arrival = rows[i][1], committed[event_id], arrivals[event_id]
        to_claim.append((at - commit) * 1000)
        to_arrival.append((arrival - at) * 1000)
        total.append(((arrival - commit) * 1000, commit, len(total)))
    if not total:
        raise SystemExit("latency: no event could be matched to its claim in the cursor log")
    slowest = sorted(total, reverse=True)[:max(1, len(total) // 100)]
    commits = sorted(commit for _, commit, _ in slowest)
    bursts = 1 + sum(1 for a, b in zip(commits, commits[1:]) if b - a > 0.05)
    return {"to_claim": summary(to_claim), "to_arrival": summary(to_arrival),
            "tail_to_claim": statistics.median(to_claim[i] for _, _, i in slowest),
            "tail_to_arrival": statistics.median(to_arrival[i] for _, _, i in slowest),
            "tail_bursts": bursts, "n": len(total),
            "batches": sum(len(rows) for rows in claims.values()),
            "batch_out_ms": statistics.median(out_for) if out_for else None}


def rss(conn) -> None:
    receiver = Counter()
    conn.execute("SELECT outbox.create_sink('rss', 'webhook', %s, batch_size => 1000, concurrency => 4)",
                 (receiver.url,))
    conn.execute("UPDATE outbox.sinks SET enabled = false WHERE name = 'rss'")
    memory_while_draining(conn, "rss", lambda: receiver.count, "webhook")
    receiver.close()


def rss_kafka(conn) -> None:
    brokers = KafkaCluster()
    brokers.create_topic("rss", partitions=4)
    kafka_sink(conn, "rss", brokers.bootstrap())
    memory_while_draining(conn, "rss", lambda: BACKLOG - left(conn, "rss"), "native Kafka")
    brokers.close()


def memory_while_draining(conn, sink: str, count, what: str) -> None:
    """Fills a backlog for the (disabled) sink, enables it, and samples the worker's memory
    until count() reaches the backlog."""
    fill(conn, BACKLOG, topic="rss" if what != "webhook" else None)
    pid = conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_ext worker'").fetchone()[0]

    def kb():
        """private (anonymous) resident memory: what a leak grows; shared buffers excluded"""
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon"):
                return int(line.split()[1])
    before, samples = kb(), []
    conn.execute("UPDATE outbox.sinks SET enabled = true WHERE name = %s", (sink,))
    t0 = time.monotonic()
    while (done := count()) < BACKLOG and time.monotonic() - t0 < 900:
        samples.append((done, kb()))
        time.sleep(0.5)
    took = time.monotonic() - t0
    conn.execute("SELECT outbox.drop_sink(%s)", (sink,))
    quarter = [s[1] for s in samples if s[0] < BACKLOG / 4]
    last = [s[1] for s in samples if s[0] >= 3 * BACKLOG / 4]
    print(f"Worker private RSS (RssAnon), {what} sink, draining a {BACKLOG:,}-event backlog "
          f"({BACKLOG / took:,.0f} events/s):")
    print(f"  before {before / 1024:.1f} MB, peak {max(s[1] for s in samples) / 1024:.1f} MB, "
          f"first quarter max {max(quarter or [0]) / 1024:.1f} MB, last quarter max {max(last or [0]) / 1024:.1f} MB")


if __name__ == "__main__":
    with db() as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS outbox_ext")
        c.execute("SELECT count(*) FROM outbox.maintain()")  # the first partitions
        time.sleep(2)   # the worker notices the extension
        for step in sys.argv[4:] or ["throughput", "latency", "rss", "rss_kafka", "kafka"]:
            globals()[step](c)
            sys.stdout.flush()
