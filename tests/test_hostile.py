"""Hostile sinks: one that never answers holds only its own delivery threads; request_timeout
bounds the whole exchange, however slowly a peer trickles; a 2xx is a delivery whatever its
body, read only a little, never sent again, and the worker's memory stays flat."""

from __future__ import annotations

import select
import socket
import threading
import time

from support.events import emit
from support.peers import Receiver, create_sink, wait_for


class Silent:
    """A listener that accepts connections into its backlog and never reads or answers them."""

    def __init__(self):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(1024)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}/hook"

    def close(self):
        self.socket.close()


class Trickle:
    """Answers `200 OK`: the first `fast` requests at once (keeping the connection open), every
    later one a byte a second. Records how long each trickled exchange lasted."""

    REPLY = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

    def __init__(self, fast: int = 0):
        self.fast, self.lasted, self.requests = fast, [], 0
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(64)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}/hook"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.socket.accept()
            except OSError:
                return
            threading.Thread(target=self.connection, args=(conn,), daemon=True).start()

    def read_request(self, conn) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        while len(body) < length:
            body += conn.recv(65536)
        return True

    def connection(self, conn):
        with conn:
            while self.read_request(conn):
                self.requests += 1
                if self.requests <= self.fast:
                    conn.sendall(self.REPLY)
                    continue
                started = time.monotonic()
                try:
                    for byte in self.REPLY:
                        conn.sendall(bytes([byte]))
                        readable, _, _ = select.select([conn], [], [], 1.0)
                        if readable and not conn.recv(1):
                            break                   # the worker hung up: what we measure
                except OSError:
                    pass
                self.lasted.append(time.monotonic() - started)
                return

    def close(self):
        self.socket.close()


def status(conn, sink: str) -> dict:
    cur = conn.execute("SELECT * FROM outbox.status WHERE consumer = %s", (sink,))
    return dict(zip([d.name for d in cur.description], cur.fetchone()))


def test_hung_sinks_never_take_a_healthy_sinks_capacity(conn, new_sink):
    silent = [Silent() for _ in range(4)]
    healthy = Receiver()
    try:
        hung = [new_sink("webhook", s.url, concurrency=16, batch_size=1, request_timeout="2 min")
                for s in silent]
        for k in range(64):                   # over every shard: each hung sink fills 16 threads
            emit(conn, f"warm-{k}")
        wait_for(lambda: all(status(conn, s)["shards_leased"] == 16 for s in hung), timeout=30)
        new_sink("webhook", healthy.url)
        probe = emit(conn, "probe")           # the worker has the new sink once this arrives
        wait_for(lambda: {e["id"] for e in healthy.accepted_events()} >= set(probe), timeout=30)
        committed = time.time()
        ids = emit(conn, "late", 5)
        wait_for(lambda: {e["id"] for e in healthy.accepted_events()} >= set(ids), timeout=30)
        arrived = max(r.at for r in healthy.requests)
        assert arrived - committed < 1.0, f"the healthy sink's events took {arrived - committed:.1f} s"
    finally:
        for s in silent:
            s.close()
        healthy.close()


def test_request_timeout_bounds_a_trickled_reply_on_fresh_and_reused_connections(conn, new_sink):
    for fast in (0, 1):                       # the trickle on a fresh connection, then a reused one
        peer = Trickle(fast=fast)
        try:
            sink = new_sink("webhook", peer.url, request_timeout="3 s", concurrency=1)
            if fast:
                emit(conn, "first")           # answered at once: the connection stays open
                wait_for(lambda: status(conn, sink)["delivered_total"] == 1)
            emit(conn, "slow")
            wait_for(lambda: peer.lasted, timeout=30)
            assert peer.lasted[0] < 4.0, f"the exchange lasted {peer.lasted[0]:.1f} s"
            wait_for(lambda: "timeout" in (status(conn, sink)["last_sink_error"] or ""))
            s = status(conn, sink)
            assert (s["delivered_total"] or 0) == fast and s["pending"] == 1, "a cut exchange is no delivery"
        finally:
            peer.close()


def test_a_2xx_with_a_huge_body_is_one_delivery_and_memory_stays_flat(cluster, conn, new_sink, deliver_db):
    huge = b"x" * (50 * 1024 * 1024)
    receiver = Receiver(lambda r: (200, {}, huge))
    try:
        pid = cluster.worker_pid(deliver_db)
        before = rss_anon(pid)
        sink = new_sink("webhook", receiver.url, batch_size=100, concurrency=4)
        ids = [i for k in range(30) for i in emit(conn, f"k{k}", 10)]
        wait_for(lambda: status(conn, sink)["pending"] == 0, timeout=60)
        time.sleep(1)
        got = [e["id"] for e in receiver.accepted_events()]
        assert sorted(got) == sorted(ids), "each event exactly once: a 2xx is never sent again"
        assert rss_anon(pid) - before < 20 * 1024, "the worker read no reply whole"
    finally:
        receiver.close()


def rss_anon(pid: int) -> int:
    """Private resident memory of a process, in kB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))


def test_routing_matches_the_effective_topic_and_sink_figures_count_only_routed_events(conn, new_sink):
    receiver = Receiver()
    try:
        sink = new_sink("webhook", receiver.url, topics=["kq"])
        conn.execute("UPDATE outbox.sinks SET enabled = false WHERE name = %s", (sink,))
        for i in range(5):        # routed: aggregate type kq, no topic (its topic is kq), and topic kq
            conn.execute("SELECT outbox.emit('kq', %s, 'e', '{}')", (f"a{i}",))
            conn.execute("SELECT outbox.emit('other', %s, 'e', '{}', NULL, 'kq')", (f"b{i}",))
        for i in range(30):       # not routed
            conn.execute("SELECT outbox.emit('other', %s, 'e', '{}')", (f"c{i}",))
            conn.execute("SELECT outbox.emit('kq', %s, 'e', '{}', NULL, 'elsewhere')", (f"d{i}",))
        assert status(conn, sink)["pending"] == 10, "pending counts only what the sink delivers"
        conn.execute("UPDATE outbox.sinks SET enabled = true WHERE name = %s", (sink,))
        wait_for(lambda: len(receiver.accepted_events()) >= 10)
        wait_for(lambda: (status(conn, sink)["delivered_total"] or 0) >= 10 and status(conn, sink)["pending"] == 0)
        time.sleep(2.5)           # the worker writes its figures every 2 s
        s = status(conn, sink)
        assert s["delivered_total"] == 10 and len(receiver.accepted_events()) == 10
    finally:
        receiver.close()


def test_create_sink_warns_when_topics_name_kafka_topics_of_the_topic_map(db):
    notices = []
    db.add_notice_handler(lambda d: notices.append(d.message_primary))
    create_sink(db, "k", "kafka_rest_v2", "http://127.0.0.1:9", topics=["orders-v2"],
                topic_map='{"orders": "orders-v2"}')
    assert any("orders-v2" in n and "topic_map" in n for n in notices)
    notices.clear()
    create_sink(db, "k2", "kafka_rest_v2", "http://127.0.0.1:9", topics=["orders"],
                topic_map='{"orders": "orders-v2"}')
    assert notices == []


def test_emit_headers_reach_a_webhook_as_http_headers(conn, new_sink):
    receiver = Receiver()
    try:
        new_sink("webhook", receiver.url, format="single")
        conn.execute("""SELECT outbox.emit('order', 'h1', 'e', '{}', '{"traceparent": "00-abc-def-01",
                        "tracestate": "x=1", "bad name": "v", "content-type": "text/evil"}')""")
        wait_for(lambda: receiver.requests)
        request = receiver.requests[0]
        assert request.headers["traceparent"] == "00-abc-def-01" and request.headers["tracestate"] == "x=1"
        assert request.headers["content-type"] == "application/json", "the sink's own headers win"
        assert request.events()[0]["headers"]["bad name"] == "v", "all of them in the body"
    finally:
        receiver.close()
