"""Delivery benchmark (run by bench/deliver.sh against a running bench cluster whose worker
serves database "bench"). Prints, each against a baseline measured in the same run:

1. throughput: a pre-filled backlog drained by the worker to a local batching HTTP receiver,
   against (a) the receiver's own ceiling (a client posting the same batches, no database) and
   (b) a hand-rolled relay (4 threads: SELECT ... FOR UPDATE SKIP LOCKED, POST, DELETE);
2. commit-to-sink latency p50/p99 at a fixed 1,000 events/s, against a hand-rolled relay
   polling a plain table every 100 ms;
3. the worker's private RSS while it drains a 1M-event backlog;
4. throughput through the Kafka path (REST front over Tansu), against the front's own ceiling
   (last: the Kafka client's threads linger in this process and disturb latency figures).
Usage: deliver.py PORT EVENTS BACKLOG"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sinks import KafkaRestFront, Tansu, free_port  # noqa: E402

PORT, EVENTS, BACKLOG = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
DSN = f"host=127.0.0.1 port={PORT} user=postgres dbname=bench"


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
    print(f"HTTP webhook, {EVENTS:,} events, batches of 1,000, 4 in flight:")
    print(f"  outbox_ext worker        {ours:>10,.0f} events/s")
    print(f"  receiver ceiling         {top:>10,.0f} events/s   worker/ceiling  {ours / top:.2f}x")
    print(f"  hand-rolled relay        {baseline:>10,.0f} events/s   worker/relay    {ours / baseline:.2f}x")


def kafka(conn) -> None:
    """Through the Kafka path. A batch goes in rounds (one event per key per request, see
    src/sinks/kafka.rs), so the number of distinct keys in a batch matters: measured with
    many keys (the usual case: one aggregate, a few events) and with 1,000 hot keys."""
    tansu = Tansu()
    tansu.create_topic("bench", partitions=4)
    front = KafkaRestFront(tansu, {"bench"})
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
    tansu.close()
    print(f"Kafka REST v2 (REST front in Python over Tansu), {n:,} events, batches of 500:")
    print(f"  front ceiling            {top:>10,.0f} events/s   (500 records per request, no database)")
    for keys, rate in results.items():
        print(f"  outbox_ext, {keys:>7,} keys  {rate:>10,.0f} events/s   worker/ceiling  {rate / top:.2f}x")


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


def percentiles(receiver: Counter, committed: dict[str, float]) -> tuple[float, float, int]:
    receiver.wait(len(committed), timeout=30)
    arrivals = receiver.arrivals()
    ms = sorted((arrivals[i] - t) * 1000 for i, t in committed.items() if i in arrivals)
    return statistics.median(ms), ms[max(0, int(len(ms) * 0.99) - 1)], len(ms)


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
    ours = percentiles(receiver, paced(rate, seconds, lambda i: conn.execute(
        "SELECT outbox.emit('order', %s, 'order.created', '{\"n\": 1}')::text", (str(i % 100),)).fetchone()[0]))
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
    print(f"Commit-to-sink latency at {rate:,} events/s for {seconds} s:")
    print(f"  outbox_ext worker        p50 {ours[0]:6.1f} ms   p99 {ours[1]:6.1f} ms   ({ours[2]:,} events)")
    print(f"  100 ms polling relay     p50 {theirs[0]:6.1f} ms   p99 {theirs[1]:6.1f} ms   "
          f"relay/worker p50 {theirs[0] / ours[0]:.1f}x, p99 {theirs[1] / ours[1]:.1f}x")


def rss(conn) -> None:
    receiver = Counter()
    conn.execute("SELECT outbox.create_sink('rss', 'webhook', %s, batch_size => 1000, concurrency => 4)",
                 (receiver.url,))
    conn.execute("UPDATE outbox.sinks SET enabled = false WHERE name = 'rss'")
    fill(conn, BACKLOG)
    pid = conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_ext worker'").fetchone()[0]

    def kb():
        """private (anonymous) resident memory: what a leak grows; shared buffers excluded"""
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon"):
                return int(line.split()[1])
    before, samples = kb(), []
    conn.execute("UPDATE outbox.sinks SET enabled = true WHERE name = 'rss'")
    t0 = time.monotonic()
    while receiver.count < BACKLOG and time.monotonic() - t0 < 900:
        samples.append((receiver.count, kb()))
        time.sleep(0.5)
    took = time.monotonic() - t0
    conn.execute("SELECT outbox.drop_sink('rss')")
    receiver.close()
    quarter = [s[1] for s in samples if s[0] < BACKLOG / 4]
    last = [s[1] for s in samples if s[0] >= 3 * BACKLOG / 4]
    print(f"Worker private RSS (RssAnon) draining a {BACKLOG:,}-event backlog ({BACKLOG / took:,.0f} events/s):")
    print(f"  before {before / 1024:.1f} MB, peak {max(s[1] for s in samples) / 1024:.1f} MB, "
          f"first quarter max {max(quarter or [0]) / 1024:.1f} MB, last quarter max {max(last or [0]) / 1024:.1f} MB")


if __name__ == "__main__":
    with db() as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS outbox_ext")
        c.execute("SELECT count(*) FROM outbox.maintain()")  # the first partitions
        time.sleep(2)   # the worker notices the extension
        for step in sys.argv[4:] or ["throughput", "latency", "rss", "kafka"]:
            globals()[step](c)
            sys.stdout.flush()
