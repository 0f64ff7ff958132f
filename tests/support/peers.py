"""Real peers for the delivery tests, all in this process or its children:

- Receiver: an HTTP(S) server that records every request and answers as the test says;
- certificates(): a CA and a server certificate made with openssl for the TLS tests;
- FaultProxy: an HTTP proxy in front of a receiver that answers 500 / 429 or hangs at random;
- KafkaRestFront: the Confluent REST v2/v3 produce
  contract (../shared/kafka-rest.md) over a real Kafka producer, with fault injection;
- wait_for, and check_delivery: no loss, no phantom, per-key order, bounded duplicates.
"""

from __future__ import annotations

import base64
import json
import random
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from .pgcluster import free_port
from .relay import first_deliveries


def create_sink(conn, name: str, kind: str, url: str, **options) -> str:
    """outbox.create_sink with named options; retries are fast unless the test says otherwise."""
    options = {"backoff_base": "50 ms", "backoff_max": "200 ms", **options}
    args = "".join(f", {k} => %({k})s" for k in options)
    conn.execute(f"SELECT outbox.create_sink(%(name)s, %(kind)s, %(url)s{args})",
                 {"name": name, "kind": kind, "url": url, **options})
    return name


def wait_for(what, timeout: float = 30.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what.__doc__ or what}")


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float

    def events(self) -> list[dict]:
        data = json.loads(self.body)
        return data if isinstance(data, list) else [data]


# answer(request) -> (status, headers, body); the default accepts everything
Answer = Callable[[Request], tuple[int, dict, bytes]]


def accept(_: Request) -> tuple[int, dict, bytes]:
    return 200, {}, b""


class _Server:
    """A threaded HTTP server on 127.0.0.1 whose handler calls self.handle(request)."""

    def __init__(self, port: int | None = None, tls: tuple[Path, Path] | None = None):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                outer.connections.add(self.connection)

            def finish(self):
                outer.connections.discard(self.connection)
                super().finish()

            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                if len(body) < length:      # the sender died mid-request: nothing was delivered
                    self.close_connection = True
                    return
                request = Request(self.path, {k.lower(): v for k, v in self.headers.items()},
                                  body, time.time())
                status, headers, body = outer.handle(request)
                if status is None:          # drop the connection without an answer
                    self.close_connection = True
                    return
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.connections: set[socket.socket] = set()   # open keep-alive connections
        self.port = port or free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.scheme = "http"
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.scheme = "https"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def handle(self, request: Request):
        raise NotImplementedError

    def close(self) -> None:
        """Stops listening and cuts the keep-alive connections too: the peer is gone."""
        self.server.shutdown()
        self.server.server_close()
        for connection in list(self.connections):
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Receiver(_Server):
    """Records every request; answers with answer(request)."""

    def __init__(self, answer: Answer = accept, port: int | None = None,
                 tls: tuple[Path, Path] | None = None):
        self.answer = answer
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        super().__init__(port, tls)

    def handle(self, request: Request):
        status, headers, body = self.answer(request)
        with self.lock:
            if status is not None and 200 <= status < 300:
                self.requests.append(request)
        return status, headers, body

    def accepted_events(self) -> list[dict]:
        """Every event the receiver accepted, in the order it accepted them."""
        with self.lock:
            return [e for r in self.requests for e in r.events()]


class FaultProxy(_Server):
    """Forwards to `upstream`, except: 500 with probability p500, 429 (Retry-After: 1) with
    p429, and a hang longer than the sink's timeout with p_hang (before forwarding). A forward
    whose answer came `slow` seconds or more after the request arrived is counted in
    faults["slow"]: the sink may have timed out on it, and sent again what was delivered."""

    def __init__(self, upstream: str, p500=0.0, p429=0.0, p_hang=0.0, hang=3.0, seed=7, slow=0.5):
        self.upstream, self.p500, self.p429, self.p_hang, self.hang = upstream, p500, p429, p_hang, hang
        self.slow = slow
        self.random = random.Random(seed)
        self.faults: dict[str, int] = defaultdict(int)
        super().__init__()

    def handle(self, request: Request):
        r = self.random.random()
        if r < self.p500:
            self.faults["500"] += 1
            return 500, {}, b"injected"
        if r < self.p500 + self.p429:
            self.faults["429"] += 1
            return 429, {"retry-after": "1"}, b"slow down"
        if r < self.p500 + self.p429 + self.p_hang:
            self.faults["hang"] += 1
            time.sleep(self.hang)
            return None, {}, b""
        forward = urllib.request.Request(self.upstream + request.path, data=request.body, method="POST",
                                         headers=request.headers)
        try:
            with urllib.request.urlopen(forward, timeout=30) as reply:
                return reply.status, {}, reply.read()
        except urllib.error.HTTPError as e:
            return e.code, {}, e.read()
        finally:
            if time.time() - request.at >= self.slow:
                self.faults["slow"] += 1


def certificates(directory: Path) -> dict[str, Path]:
    """A CA, and a certificate it signs for 127.0.0.1 and localhost (and the same, expired); plus
    an untrusted CA."""
    d = directory
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    for ca in ("ca", "other_ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN=outbox test {ca}",
            "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                               "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key",
        "-out", "server.csr")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "ext.cnf", "-out", "server.pem")
    # the same key, certified by the same CA, for a day in 2024: expired
    (d / "db").mkdir(exist_ok=True)
    (d / "db" / "index.txt").write_text("")
    (d / "db" / "serial").write_text("1000\n")
    (d / "ca.cnf").write_text("[ca]\ndefault_ca = test\n[test]\ndatabase = db/index.txt\nnew_certs_dir = db\n"
                              "serial = db/serial\ndefault_md = sha256\npolicy = any\nx509_extensions = ext\n"
                              "[any]\ncommonName = supplied\n[ext]\nsubjectAltName = IP:127.0.0.1,DNS:localhost\n"
                              "basicConstraints = CA:FALSE\nextendedKeyUsage = serverAuth\n")
    run("ca", "-batch", "-config", "ca.cnf", "-cert", "ca.pem", "-keyfile", "ca.key", "-in", "server.csr",
        "-out", "expired.pem", "-startdate", "20240101000000Z", "-enddate", "20240102000000Z")
    return {name: d / f"{name}.pem" for name in ("ca", "other_ca", "server", "expired")} | {"key": d / "server.key"}


def check_delivery(emitted: dict[str, list[str]], received: list[dict], max_duplicates: int = 0) -> None:
    """emitted: key -> event ids in emit (commit) order; received: events in arrival order.
    Asserts no loss, no phantom, per-key order of first arrivals, and at most max_duplicates
    extra arrivals."""
    want = {i for ids in emitted.values() for i in ids}
    got = [e["id"] for e in received]
    assert want - set(got) == set(), "lost events"
    assert set(got) - want == set(), "phantom events"
    duplicates = len(got) - len(set(got))
    assert duplicates <= max_duplicates, f"{duplicates} duplicates, at most {max_duplicates} allowed"
    first = first_deliveries((e["id"], e["aggregate_id"]) for e in received)
    for key, ids in emitted.items():
        assert first.get(key, []) == ids, f"key {key} arrived out of order"


# --- Kafka: the REST front (over the brokers of support/kafka_cluster.py) -------------------

@dataclass
class FrontFaults:
    """Fault injection of the REST front. fail(topic, key, value) -> a per-record error code or
    None; variant: 'confluent' (documented replies), 'old' (v2: the whole request 422 when any
    record fails, codes 1 / 2, no error fields on success)."""
    fail: Callable[[str, bytes, bytes], int | None] = lambda topic, key, value: None
    variant: str = "confluent"
    max_records: int = 0            # more records in one request: 413 (0: no limit)
    # whole(topic) -> (HTTP status, error code) to fail a whole request to the topic, or None
    whole: Callable[[str], tuple[int, int] | None] = lambda topic: None
    calls: int = 0
    produced: list = field(default_factory=list)
    refused: list = field(default_factory=list)   # (topic, key, code) of the producer's refusals


class KafkaRestFront(_Server):
    """Confluent REST Proxy produce API (v2 json/binary, v3 streamed) over a real producer."""

    CLUSTER = "outbox-test-cluster"

    def __init__(self, bootstrap: str, topics: set[str]):
        """bootstrap: the brokers' host:port list (PLAINTEXT)."""
        from confluent_kafka import Producer
        self.topics, self.faults = topics, FrontFaults()
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2,
                                  "max.in.flight.requests.per.connection": 1, "acks": "all"})
        self.lock = threading.Lock()   # one request at a time keeps each partition in request order
        super().__init__()

    def close(self) -> None:
        super().close()
        self.producer.flush(1)
        self.producer = None   # librdkafka's threads end with the producer

    def handle(self, request: Request):
        self.faults.calls += 1
        parts = request.path.strip("/").split("/")
        with self.lock:
            topic = parts[1] if len(parts) == 2 else parts[4] if len(parts) == 6 else None
            if topic and (failed := self.faults.whole(topic)):
                return self.error(*failed, "injected failure of the whole request")
            if parts[0] == "topics" and len(parts) == 2:
                return self.v2(parts[1], request)
            if parts[:2] == ["v3", "clusters"] and len(parts) == 6 and parts[5] == "records":
                if parts[2] != self.CLUSTER:
                    return self.error(404, 404, "cluster not found")
                return self.v3(parts[4], request)
        return self.error(404, 404, "not found")

    @staticmethod
    def error(status: int, code: int, message: str):
        return status, {"content-type": "application/json"}, json.dumps(
            {"error_code": code, "message": message}).encode()

    def too_many(self, records: list) -> bool:
        return 0 < self.faults.max_records < len(records)

    def produce(self, topic: str, records: list[tuple[bytes, bytes, list]]) -> list[dict]:
        """Produces in order; one report per record: partition/offset or an error code."""
        reports: list[dict] = [{} for _ in records]
        for i, (key, value, headers) in enumerate(records):
            code = self.faults.fail(topic, key, value)
            if code is not None:
                reports[i] = {"error_code": code, "error": "injected failure"}
                continue
            def done(err, msg, i=i, topic=topic, key=key):
                reports[i] = ({"error_code": self.error_code(err), "error": str(err)} if err else
                              {"partition": msg.partition(), "offset": msg.offset()})
                if err:
                    self.faults.refused.append((topic, key, reports[i]["error_code"]))
            self.producer.produce(topic, value=value, key=key, headers=headers, on_delivery=done)
            self.faults.produced.append((topic, key))
        self.producer.flush(10)
        return reports

    @staticmethod
    def error_code(err) -> int:
        """As Confluent's proxy reports a producer's error: a record the brokers refuse for its
        content (too large, not valid) is not retriable (50002); the rest is (50003). This
        front's producer is librdkafka's, which does not split a record batch refused as too
        large: every record of it is refused (Java's producer, in Confluent's proxy, splits it)."""
        from confluent_kafka import KafkaError
        content = (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE, KafkaError.INVALID_RECORD)
        return 50002 if err.code() in content else 50003

    def v2(self, topic: str, request: Request):
        content_type = request.headers.get("content-type", "")
        if topic not in self.topics:
            return self.error(404, 40401, "Topic not found.")
        body = json.loads(request.body)
        if not body.get("records"):
            return self.error(422, 42201, "records must not be empty")
        if self.too_many(body["records"]):
            return self.error(413, 413, "Request Entity Too Large")
        # as a real proxy serializes: binary, the bytes; json, the JSON text (a key "k1" is
        # stored as the 4 bytes "k1" with its quotes); a null value, a Kafka null
        binary = "binary" in content_type
        decode = (lambda v: base64.b64decode(v)) if binary else (lambda v: json.dumps(v).encode())
        records = [(decode(r["key"]), None if r.get("value") is None else decode(r["value"]), [])
                   for r in body["records"]]
        reports = self.produce(topic, records)
        old = self.faults.variant == "old"
        offsets = []
        for r in reports:
            if "error_code" in r:
                code = {50002: 1, 50003: 2}.get(r["error_code"], r["error_code"]) if old else r["error_code"]
                offsets.append({"partition": None, "offset": None, "error_code": code, "error": r["error"]})
            elif old:
                offsets.append({"partition": r["partition"], "offset": r["offset"]})
            else:
                offsets.append({"partition": r["partition"], "offset": r["offset"], "error_code": None, "error": None})
        status = 422 if old and any("error_code" in r for r in reports) else 200
        return status, {"content-type": "application/vnd.kafka.v2+json"}, json.dumps(
            {"key_schema_id": None, "value_schema_id": None, "offsets": offsets}).encode()

    def v3(self, topic: str, request: Request):
        if topic not in self.topics:
            return self.error(404, 40403, "This server does not host this topic-partition.")
        decoder, text = json.JSONDecoder(), request.body.decode()
        records, pos = [], 0
        while pos < len(text):
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos >= len(text):
                break
            obj, pos = decoder.raw_decode(text, pos)
            records.append(obj)
        if not records:
            return self.error(422, 422, "empty body")
        if self.too_many(records):
            return self.error(413, 413, "Request Entity Too Large")

        def data(part):
            kind, value = part["type"], part["data"]
            return base64.b64decode(value) if kind == "BINARY" else (
                value.encode() if kind == "STRING" else json.dumps(value).encode())
        produced = self.produce(topic, [(data(r["key"]), data(r["value"]) if r.get("value") else None,
                                         [(h["name"], base64.b64decode(h["value"]) if h.get("value") else None)
                                          for h in r.get("headers", [])]) for r in records])
        out = []
        for r in produced:
            if "error_code" in r:
                out.append({"error_code": r["error_code"], "message": r["error"]})
            else:
                out.append({"error_code": 200, "cluster_id": self.CLUSTER, "topic_name": topic,
                            "partition_id": r["partition"], "offset": r["offset"]})
        return 200, {"content-type": "application/json"}, "\n".join(json.dumps(o) for o in out).encode()
